"""Log lines that a peer (or any outside party) can cause, at a bounded rate.

A hostile or broken peer can make the node refuse thousands of frames a second; each
refusal is worth a line in the log (a stalled run whose logs look clean cannot be
diagnosed), but not thousands of lines. `LogLimiter` writes the first line of a key
(e.g. peer and reason), then at most one per `seconds`, saying how many were held
back in between. Keys are bounded: the least recently logged go first."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["LogLimiter"]


class LogLimiter:
    def __init__(self, logger: logging.Logger, seconds: float = 60.0, *, max_keys: int = 1024,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.seconds = seconds
        self.max_keys = max_keys
        self.clock = clock
        #: key -> [when last written, lines held back since]
        self._keys: OrderedDict[Hashable, list[Any]] = OrderedDict()

    def log(self, level: int, key: Hashable, msg: str, *args: Any) -> bool:
        """Write `msg % args` unless `key` was written within `seconds` (then it is only
        counted); True when written."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self.clock()
        entry = self._keys.get(key)
        if entry is not None and now - entry[0] < self.seconds:
            entry[1] += 1
            return False
        held = entry[1] if entry is not None else 0
        self._keys[key] = [now, 0]
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        if held:
            msg += " (%d more like it in the last %.0f s)"
            args = (*args, held, now - entry[0])
        self.logger.log(level, msg, *args)
        return True
