"""Logging for the daemon: one line per record on stderr, as text or as one
JSON object per line (`--log-format json`), for people and for log shippers.

Extra fields passed with `log.info("...", extra={"fields": {...}})` appear as
`key=value` pairs in text and as top-level keys in JSON."""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Hashable
from datetime import datetime, timezone
from typing import Any, Callable, TextIO

import orjson
from aiohttp.web_log import AccessLogger

from hmpnode.net.penalty import TokenBucket

__all__ = ["setup_logging", "set_level", "current_level", "LEVELS", "LevelAccessLogger", "JsonFormatter", "TextFormatter",
           "HttpNoiseFilter", "LogLimiter"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
#: the level names the node takes (node.log_level, --log-level, PUT /v1/log-level, `hmpnode log-level`)
LEVELS = tuple(_LEVELS)
#: aiohttp's access log of the API: one line per request, written only at "debug"
ACCESS_LOGGER = "hmpnode.access"
_RESERVED = frozenset({"time", "level", "logger", "message", "exception"})


def _time(record: logging.LogRecord) -> str:
    moment = datetime.fromtimestamp(record.created, timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _time(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _fields(record).items():
            out[key if key not in _RESERVED else f"field_{key}"] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{_time(record)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        extra = " ".join(f"{k}={_text_value(v)}" for k, v in _fields(record).items())
        if extra:
            line += " " + extra
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _text_value(value: Any) -> str:
    text = value if isinstance(value, str) else orjson.dumps(value, default=str).decode()
    return text if text and not any(c.isspace() or c in '"=' for c in text) else orjson.dumps(text).decode()


class LogLimiter:
    """Log lines that an outside party can cause, at a bounded rate: at most `lines` per key
    (e.g. a peer and a reason) in `seconds`, the ones held back counted and said in the next
    line of that key. A flood of refusals is worth a line in the log (a stalled run whose log
    looks clean cannot be diagnosed), not thousands. Keys are bounded: the least recently
    written go first."""

    def __init__(self, logger: logging.Logger | None = None, seconds: float = 60.0, lines: int = 1, *,
                 max_keys: int = 1024, clock: Callable[[], float] = time.monotonic):
        self.logger, self.seconds, self.lines, self.max_keys, self.clock = logger, seconds, lines, max_keys, clock
        #: key -> [its bucket, lines held back since the last one written]
        self._keys: OrderedDict[Hashable, list[Any]] = OrderedDict()

    def admit(self, key: Hashable) -> int | None:
        """May a line of `key` be written now? None: no (it is counted); else the lines held
        back since the last one written (to be said in this one)."""
        entry = self._keys.get(key)
        if entry is None:
            entry = self._keys[key] = [TokenBucket(self.lines / self.seconds, float(self.lines)), 0]
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
        if not entry[0].take(self.clock()):
            entry[1] += 1
            return None
        self._keys.move_to_end(key)
        held, entry[1] = entry[1], 0
        return held

    def log(self, level: int, key: Hashable, msg: str, *args: Any) -> bool:
        """Write `msg % args` to the logger unless `key` is over its rate; True when written."""
        if self.logger is None or not self.logger.isEnabledFor(level):
            return False
        held = self.admit(key)
        if held is None:
            return False
        if held:
            msg, args = msg + " (%d more like it not logged)", (*args, held)
        self.logger.log(level, msg, *args)
        return True


class HttpNoiseFilter(logging.Filter):
    """aiohttp logs at ERROR, with a traceback, what anyone who can reach a port can
    cause (the peer port listens on the LAN): a request it cannot parse (refused with
    a 400 before any handler runs), and a client gone before its answer was written (a
    dialler that drops during the WebSocket upgrade: an ordinary disconnect). Each
    becomes one line without a traceback (WARNING, INFO for a disconnect), at most
    `per_minute` a minute of each kind; the ones left out are counted in the next line
    of their kind."""

    def __init__(self, per_minute: int = 10, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        from aiohttp.http_exceptions import HttpProcessingError

        #: (exception class, level, message with the remote address, the reason, the count left out)
        self._kinds = (
            (HttpProcessingError, logging.WARNING, "refused a malformed HTTP request from %s (400): %s%s"),
            (ConnectionError, logging.INFO, "connection from %s closed before its answer was written: %s%s"),
        )
        self._limiter = LogLimiter(None, 60.0, per_minute, clock=clock)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        kind = next((i for i, (cls, _, _) in enumerate(self._kinds) if isinstance(exc, cls)), None)
        if kind is None:
            return True
        _, level, message = self._kinds[kind]
        if not logging.getLogger(record.name).isEnabledFor(level):  # logged at ERROR: below the set level
            return False
        quiet = self._limiter.admit(kind)
        if quiet is None:
            return False
        reason = " ".join(str(getattr(exc, "message", "") or exc).split())[:160] or type(exc).__name__
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        record.msg = message
        record.args = (remote, reason, f" ({quiet} more not logged)" if quiet else "")
        record.levelno, record.levelname = level, logging.getLevelName(level)
        record.exc_info = record.exc_text = None
        return True


def setup_logging(fmt: str = "text", level: str = "info", stream: TextIO | None = None) -> None:
    """Route every logger to `stream` (default stderr) at `level`, replacing
    earlier handlers on the root logger."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    set_level(level if level in _LEVELS else "info")
    server = logging.getLogger("aiohttp.server")
    for old in [f for f in server.filters if isinstance(f, HttpNoiseFilter)]:
        server.removeFilter(old)
    server.addFilter(HttpNoiseFilter())
    logging.captureWarnings(True)


def set_level(level: str) -> str:
    """Log at `level` from now on (at start, and while running: the API, SIGHUP); returns
    the level before. ValueError for a name not in LEVELS."""
    if level not in _LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    previous = current_level()
    root = logging.getLogger()
    root.setLevel(_LEVELS[level])
    # aiohttp's own loggers are chatty at debug; keep them one level quieter.
    logging.getLogger("aiohttp").setLevel(logging.INFO if root.level <= logging.DEBUG else logging.NOTSET)
    # kademlia and rpcudp log every lookup at info (a line per crawl, listing its peers):
    # hmpnode.dht reports what matters
    for name in ("kademlia", "rpcudp"):
        logging.getLogger(name).setLevel(max(root.level, logging.WARNING))
    # the access log writes at INFO: on only when the node logs at debug
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO if root.level <= logging.DEBUG else logging.WARNING)
    return previous


class LevelAccessLogger(AccessLogger):
    """aiohttp's access log, asked at each request whether it is on: aiohttp asks once per
    connection, so a level changed at run time would miss the connections kept alive."""

    @property
    def enabled(self) -> bool:
        return True

    def log(self, request, response, time: float) -> None:
        if self.logger.isEnabledFor(logging.INFO):
            super().log(request, response, time)


def current_level() -> str:
    """The name of the root logger's level ("info" for one set outside LEVELS)."""
    level = logging.getLogger().level
    return next((name for name, value in _LEVELS.items() if value == level), "info")
