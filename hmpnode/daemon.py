"""`hmpnode run`: the node daemon.

Startup, in order:

1. settings: flags > HMPNODE_* environment > <data-dir>/hmpnode.toml > defaults
   (an invalid setting is one line naming it; exit 2);
2. the data directory (created 0700 with its missing parents) and its lock: an
   exclusive `flock` on `<data-dir>/lock`, held for the life of the process. The
   kernel drops it when the process dies however it dies, so a node killed with
   SIGKILL never blocks a restart; a second live node on the same directory is
   refused (exit 1). A data dir, or a file in it, that another local user could
   have written or replaced (a symlink, another owner, group/other-writable; see
   hmpnode.fsutil), or a lock file the node cannot open, is refused: one line
   naming the path, exit 2;
3. the identity: `<data-dir>/identity.json` (or `identity.keystore`), created
   0600 on first start, sealed when `identity.passphrase_file` is set; read
   without following symlinks, its owner and mode checked on the open file;
4. the API token: `<data-dir>/api.token`, 32 random bytes as base64url,
   created 0600 on first start (written to a 0600 temp file, then linked into
   place), read like the identity;
5. the node (store open, keys loaded) - refused (exit 2) when the store is
   missing, empty or behind what `<data-dir>/store-state.json` says it held
   (hmpnode.store.marker) unless `--accept-store-loss`, or is not a database, is
   damaged, unreadable or a newer hmpnode's (exit_code_of) -, its mesh (peer port,
   DHT, LAN discovery; docs/protocol.md sections 19-26), then the local agent API.
   The API and peer ports set to "auto" (the default) are the ones recorded in
   `<data-dir>/ports.json` at the first start (`StablePorts`; the API's is bound
   right after the lock);
6. `<data-dir>/node.json` (atomically, 0600) says where the node listens:
   {"did", "public_key", "pid", "api": {"host", "port", "url"},
    "peer": {"port", "dht_port", "addresses", "roles"}, "started", "version"}.

SIGINT / SIGTERM (or `POST /v1/shutdown`, which `hmpnode stop` sends): stop
listening, let in-flight requests finish (bounded by SHUTDOWN_TIMEOUT), stop the
node (which drains queued writes), remove node.json, release the lock, exit 0. Another signal during shutdown, FORCE_AFTER seconds or more
after the first, exits at once (exit 1); acknowledged writes are committed
already, so nothing acknowledged is lost. The process umask is 0077: every file
the node creates is its owner's only.

SIGHUP: the log level is read again from the settings (flags > environment >
config file, as at start) and applied; nothing else is reloaded (a restart
applies the other settings). `PUT /v1/log-level` sets it until the next
SIGHUP or restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import gc
import ipaddress
import logging
import os
import secrets
import signal
import socket
import sqlite3
import stat
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import orjson

from hmpnode import __version__
from hmpnode.config import ConfigError, Settings, load_settings
from hmpnode.fsutil import UnsafePath, check_path_file, check_private_dir, read_secret, write_private_file

__all__ = [
    "DaemonError",
    "RunOptions",
    "DataDirLock",
    "NODE_FILE",
    "TOKEN_FILE",
    "LOCK_FILE",
    "SHUTDOWN_TIMEOUT",
    "settings_for",
    "lock_holder",
    "run",
]

log = logging.getLogger("hmpnode.daemon")

NODE_FILE = "node.json"
#: the ports the node got on its first start (api.port / peer.port "auto"): StablePorts
PORTS_FILE = "ports.json"
TOKEN_FILE = "api.token"
LOCK_FILE = "lock"
TOKEN_BYTES = 32
#: seconds in-flight HTTP requests get to finish on shutdown (event streams end at once)
SHUTDOWN_TIMEOUT = 10.0
#: a second SIGINT/SIGTERM this many seconds after the first forces an immediate exit
FORCE_AFTER = 1.0
_MAX_SMALL_FILE = 64 * 1024
#: FOR TESTS ONLY: seconds added to the node's clock (negative: behind), so that a test can
#: run a real node whose clock is off (tests/test_clock_skew.py); or a file holding that
#: number, read again every half second (a clock that jumps while the node runs). Not
#: settings: a deployment keeps its clock right (NTP); docs/protocol.md 25.4 says what skew does.
TEST_CLOCK_OFFSET_ENV = "HMPNODE_TEST_CLOCK_OFFSET_SECONDS"
TEST_CLOCK_FILE_ENV = "HMPNODE_TEST_CLOCK_OFFSET_FILE"

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class DaemonError(Exception):
    """Startup failed; `code` is the exit status (2: configuration or input, 1: runtime)."""

    def __init__(self, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.code = code


#: errno values of a failure that stays until the operator acts: a permission, a read-only
#: file system, a path that is not the kind of file it should be
_LASTING_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.ELOOP,
                             errno.ENAMETOOLONG,
                             # a port another program holds: the node keeps its ports (ports.json), so
                             # it would ask for the same one again; the operator frees it or sets another
                             errno.EADDRINUSE})
#: SQLite's primary result codes of a store that stays unusable until the operator acts
_LASTING_SQLITE = frozenset({sqlite3.SQLITE_PERM, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CORRUPT,
                             sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_AUTH, sqlite3.SQLITE_NOTADB})


def exit_code_of(exc: BaseException) -> int:
    """The exit status of a start that failed with `exc`: EXIT_USAGE (2) when starting
    again cannot help (a permission, a lock or store file that is not one, a store that is
    not a database, is damaged or is a newer hmpnode's, a busy port), so that systemd's
    `RestartPreventExitStatus=2` stops retrying; EXIT_FAILED (1) when it may pass (a full
    disk, a database locked by another program)."""
    from hmpnode.store.schema import NewerSchema

    if isinstance(exc, OSError):
        lasting = exc.errno in _LASTING_ERRNOS
    elif isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        lasting = code is not None and code & 0xFF in _LASTING_SQLITE
    else:
        lasting = isinstance(exc, NewerSchema)
    return EXIT_USAGE if lasting else EXIT_FAILED


@dataclass(frozen=True, slots=True)
class RunOptions:
    """The flags of `hmpnode run`; None means "not given"."""

    data_dir: Path | None = None
    config: Path | None = None
    api_host: str | None = None
    api_port: str | int | None = None
    log_format: str | None = None
    log_level: str | None = None
    roles: str | None = None
    peer_host: str | None = None
    peer_port: str | int | None = None
    dht_port: str | int | None = None
    #: comma-separated lists, as the environment's ([peer] announce, no_announce, static)
    announce: str | None = None
    no_announce: str | None = None
    static: str | None = None
    #: start even though the store is missing, empty or behind its marker (hmpnode.store.marker)
    accept_store_loss: bool = False


_FLAG_SETTINGS = {
    "api_host": ("api.host", "--api-host"),
    "api_port": ("api.port", "--api-port"),
    "log_format": ("node.log_format", "--log-format"),
    "log_level": ("node.log_level", "--log-level"),
    "roles": ("node.roles", "--roles"),
    "peer_host": ("peer.host", "--peer-host"),
    "peer_port": ("peer.port", "--peer-port"),
    "dht_port": ("peer.dht_port", "--dht-port"),
    "announce": ("peer.announce", "--announce"),
    "no_announce": ("peer.no_announce", "--no-announce"),
    "static": ("peer.static", "--static"),
}


def settings_for(options: RunOptions, env: Mapping[str, str], sources_out: dict[str, str] | None = None) -> Settings:
    """The effective settings for these flags; DaemonError (exit 2) if invalid. `sources_out`:
    filled with where each setting came from (`load_settings`), for `GET /v1/config`."""
    overrides = {setting: getattr(options, attr) for attr, (setting, _) in _FLAG_SETTINGS.items()}
    sources = {setting: flag for setting, flag in _FLAG_SETTINGS.values()}
    try:
        return load_settings(
            data_dir=Path(options.data_dir).expanduser().absolute() if options.data_dir is not None else None,
            config_file=Path(options.config).expanduser().absolute() if options.config is not None else None,
            env=env,
            overrides=overrides,
            override_sources=sources,
            sources_out=sources_out,
        )
    except ConfigError as exc:
        raise DaemonError(f"invalid configuration: {exc}", EXIT_USAGE) from None


# -- files -------------------------------------------------------------------




def _unsafe(exc: UnsafePath) -> DaemonError:
    return DaemonError(f"refusing to start: {exc}", EXIT_USAGE)


def _read_secret(path: Path, what: str, **options: Any) -> bytes:
    """`fsutil.read_secret` with its refusals as DaemonError (exit 2); FileNotFoundError passes."""
    try:
        return read_secret(path, what, _MAX_SMALL_FILE, **options)
    except UnsafePath as exc:
        raise _unsafe(exc) from None


#: files the node opens by name in its data dir (SQLite follows symlinks): each must be
#: a regular file of the node's user that group/others cannot write, if it exists
_STORE_FILES = ("hmpnode.sqlite3", "hmpnode.sqlite3-wal", "hmpnode.sqlite3-shm", "hmpnode.sqlite3-journal")


def prepare_data_dir(path: Path) -> None:
    """Create the data directory with mode 0700 (a path given that does not exist
    yet: its missing parents too, 0700 under the node's umask), then refuse it
    (DaemonError, exit 2) if another local user could have written or replaced it
    or the files the node opens by name in it (fsutil.check_private_dir)."""
    try:
        if not os.path.lexists(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
    except OSError as exc:
        raise DaemonError(f"cannot create data dir {path}: {exc.strerror or exc}", EXIT_USAGE) from None
    try:
        check_private_dir(path)
        check_path_file(path / "hmpnode.toml", "config file", root_ok=True)
        for name in _STORE_FILES:
            check_path_file(path / name, "store file")
    except UnsafePath as exc:
        raise _unsafe(exc) from None
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    if mode & 0o077:
        log.warning("data dir %s is readable by other users (mode %o); chmod 700 recommended", path, mode)


#: how long a start waits for a lock that is held shared: `lock_holder` (`hmpnode stop`,
#: `status`) probes with a shared flock held for microseconds; a node's exclusive one stays
LOCK_PROBE_GRACE_SECONDS = 0.5


def _flock_exclusive(fd: int) -> None:
    """Take the exclusive flock, waiting out a probe's brief shared one (bounded by
    LOCK_PROBE_GRACE_SECONDS); OSError EWOULDBLOCK when another node holds it."""
    deadline = time.monotonic() + LOCK_PROBE_GRACE_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) or time.monotonic() >= deadline:
                raise
        time.sleep(0.01)


class DataDirLock:
    """An exclusive flock on `<data-dir>/lock`, held until `release()` or process
    exit. The file keeps the holder's pid, for error messages only: the lock,
    not the file, decides."""

    def __init__(self, data_dir: Path):
        self.path = Path(data_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> None:
        try:
            # O_NOFOLLOW: a planted `lock -> /some/file` must not make the node truncate that file
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError as exc:
            if os.path.islink(self.path):
                raise _unsafe(UnsafePath(self.path, "the lock file is a symlink")) from None
            raise DaemonError(f"cannot open {self.path}: {exc.strerror or exc}", exit_code_of(exc)) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (os.name != "nt" and st.st_uid != os.geteuid()):
            os.close(fd)
            raise _unsafe(UnsafePath(self.path, "the lock file is not a regular file of the node's user"))
        try:
            _flock_exclusive(fd)
        except OSError as exc:
            holder = ""
            try:
                pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                holder = f" (pid {pid})" if pid.isdigit() else ""
            except OSError:
                pass
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DaemonError(
                    f"another node is running on data dir {self.path.parent}{holder}; stop it first"
                ) from None
            raise DaemonError(f"cannot lock {self.path}: {exc.strerror or exc}", exit_code_of(exc)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass
            os.close(fd)  # closing the only descriptor drops the flock


def lock_holder(data_dir: Path) -> int | None:
    """The pid of the node holding `<data-dir>/lock`, None when no process holds it (no
    lock file, or the flock is free). A held lock whose recorded pid cannot be confirmed
    as the holder (a pid that is gone, or, where /proc lists it, a process without the
    lock file open) gives 0: a node runs, but which process it is is not known."""
    path = Path(data_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DaemonError(f"cannot open {path}: {exc.strerror or exc}", exit_code_of(exc)) from None
    try:
        try:  # a shared lock is refused while the node holds its exclusive one; taken, it is let go at once
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DaemonError(f"cannot test the lock {path}: {exc.strerror or exc}", exit_code_of(exc)) from None
        else:
            return None
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        lock_stat = os.fstat(fd)
    finally:
        os.close(fd)
    pid = int(text) if text.isdigit() else 0
    if pid <= 0 or not _pid_has_open(pid, lock_stat):
        return 0
    return pid


def _pid_has_open(pid: int, file_stat: os.stat_result) -> bool:
    """Whether process `pid` has the file of `file_stat` open (through /proc where there
    is one; elsewhere, whether the process exists)."""
    from hmpnode.client import pid_alive

    fds = Path(f"/proc/{pid}/fd")
    if not Path("/proc/self/fd").is_dir():
        return pid_alive(pid)
    try:
        entries = list(fds.iterdir())
    except OSError:  # gone, or another user's process: not ours to signal
        return False
    for entry in entries:
        try:
            st = entry.stat()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (file_stat.st_dev, file_stat.st_ino):
            return True
    return False


def _read_passphrase(path: Path | None) -> bytes | None:
    from hmpnode.identity.keystore import KeystoreError, passphrase_from_bytes

    if path is None:
        return None
    try:
        # root's file is fine here (e.g. handed over by the service manager); never chmodded
        data = _read_secret(path, "passphrase file", root_ok=True, tighten=False)
        return passphrase_from_bytes(data, path)
    except FileNotFoundError:
        raise DaemonError(f"identity.passphrase_file: passphrase file {path}: No such file or directory",
                          EXIT_USAGE) from None
    except KeystoreError as exc:
        raise DaemonError(f"identity.passphrase_file: {exc}", EXIT_USAGE) from None


def load_or_create_identity(settings: Settings):
    """The node's identity from its keystore, created on first start."""
    from hmpnode.identity import Identity, KeystoreError, save_keystore
    from hmpnode.identity.keystore import loads_keystore

    path = settings.identity.keystore
    passphrase = _read_passphrase(settings.identity.passphrase_file)
    if path.parent != settings.data_dir:  # a keystore kept elsewhere: its directory must be as safe
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise DaemonError(f"cannot create {path.parent}: {exc.strerror or exc}", EXIT_USAGE) from None
        try:
            check_private_dir(path.parent, "keystore directory")
        except UnsafePath as exc:
            raise _unsafe(exc) from None
    if not os.path.lexists(path):
        identity = Identity.generate()
        try:
            save_keystore(path, identity, passphrase=passphrase)
        except FileExistsError:
            pass  # appeared meanwhile (we hold the lock, so someone else's doing): load it
        except (OSError, ValueError) as exc:
            raise DaemonError(f"cannot write identity keystore {path}: {exc}", EXIT_USAGE) from None
        else:
            log.info("created a new identity", extra={"fields": {"did": identity.did, "keystore": str(path)}})
            return identity
    try:
        return loads_keystore(_read_secret(path, "identity keystore"), passphrase=passphrase)
    except FileNotFoundError:
        raise DaemonError(f"identity keystore {path} disappeared while starting", EXIT_USAGE) from None
    except KeystoreError as exc:
        raise DaemonError(f"identity keystore {path}: {exc}", EXIT_USAGE) from None


def load_or_create_token(data_dir: Path) -> str:
    """The API bearer token from `<data-dir>/api.token`, created on first start."""
    path = data_dir / TOKEN_FILE
    if not os.path.lexists(path):
        token = secrets.token_urlsafe(TOKEN_BYTES)  # 32 bytes, base64url without padding
        try:
            write_private_file(path, (token + "\n").encode(), replace=False)
            log.info("created the API token", extra={"fields": {"path": str(path)}})
            return token
        except FileExistsError:
            pass
        except OSError as exc:
            raise DaemonError(f"cannot write {path}: {exc.strerror or exc}", EXIT_USAGE) from None
    try:
        text = _read_secret(path, "API token").decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise DaemonError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}", EXIT_USAGE) from None
    if len(text) < 16 or not text.isprintable() or " " in text:
        raise DaemonError(f"{path} does not hold a usable token; delete it to have a new one made", EXIT_USAGE)
    return text


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _url_host(host: str) -> str:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if address.is_unspecified:
        address = ipaddress.ip_address("::1" if address.version == 6 else "127.0.0.1")
    return f"[{address}]" if address.version == 6 else str(address)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def node_info(identity, host: str, bound: tuple[Any, ...], started: datetime) -> dict[str, Any]:
    port = int(bound[1])
    url_host = _url_host(str(bound[0]).split("%", 1)[0])
    return {
        "did": identity.did,
        "public_key": identity.public_key_b58,
        "pid": os.getpid(),
        "api": {"host": host, "port": port, "url": f"http://{url_host}:{port}"},
        "started": rfc3339(started),
        "version": __version__,
    }


# -- running ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StablePorts:
    """api.port and peer.port "auto": the port a node got on its first start (a free one
    then) is kept in `<data-dir>/ports.json` and taken again on every start, so that a
    bookmark, a Prometheus target, a router's port forward or another node's static peer
    entry stays right. A port set in the configuration, the environment or a flag (0: a
    free one each start) is used as given and not recorded."""

    path: Path
    #: "api" / "peer" -> the recorded port
    recorded: Mapping[str, int]
    #: which of "api", "peer" are "auto"
    auto: frozenset[str]

    @classmethod
    def load(cls, settings: Settings) -> StablePorts:
        """The record, if any; one that cannot be read is logged and a new one made (the
        ports are picked anew: nothing is lost but the ports themselves)."""
        path = settings.data_dir / PORTS_FILE
        auto = frozenset(name for name, port in (("api", settings.api.port), ("peer", settings.peer.port))
                         if port == "auto")
        recorded: dict[str, int] = {}
        try:
            data = orjson.loads(_read_secret(path, "ports file"))
            recorded = {k: v for k, v in data.items() if k in ("api", "peer") and type(v) is int and 0 < v < 65536}
        except FileNotFoundError:
            pass
        except (OSError, orjson.JSONDecodeError, AttributeError) as exc:
            log.warning("%s: %s; new ports are picked", path, exc)
        return cls(path, recorded, auto)

    def resolve(self, settings: Settings) -> Settings:
        """`settings` with each "auto" port replaced by the recorded one (0 before the first start)."""
        return dataclasses.replace(
            settings, api=dataclasses.replace(settings.api, port=self.port("api", settings.api.port)),
            peer=dataclasses.replace(settings.peer, port=self.port("peer", settings.peer.port)))

    def port(self, name: str, configured: str | int) -> int:
        return self.recorded.get(name, 0) if configured == "auto" else int(configured)

    def where(self, name: str) -> str | None:
        """Where a recorded port came from, for the line a busy one makes (None: not recorded)."""
        if name in self.auto and name in self.recorded:
            return (f"--{name}-host, {name}.host; the port of this node's first start, kept in {self.path}: "
                    f"set {name}.port to move")
        return None

    def record(self, **bound: int) -> None:
        """Keep the ports bound now for the "auto" ones (written only when they changed);
        a failed write is logged (the node runs; the next start picks again)."""
        new = {**self.recorded, **{k: v for k, v in bound.items() if k in self.auto}}
        if new == self.recorded:
            return
        try:
            write_private_file(self.path, orjson.dumps(new) + b"\n", replace=True)
        except OSError as exc:
            log.warning("cannot record the ports in %s: %s", self.path, exc.strerror or exc)


def bind_api(host: str, port: int, where: str | None = None) -> list[socket.socket]:
    """The agent API's listening sockets, bound (not yet listening) before the store, the
    peer port, the DHT or LAN discovery start, so that a busy or unusable API address is
    reported first, alone (exit 1), and nothing else was started for nothing. Bound as
    asyncio's create_server would (every address `host` resolves to, SO_REUSEADDR, IPv6
    sockets IPv6-only)."""
    where = f"{host}:{port} ({where or '--api-host/--api-port, api.host/api.port'})"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise DaemonError(f"cannot listen on {where}: {exc.strerror or exc}", exit_code_of(exc)) from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise DaemonError(f"cannot listen on {where}: {exc.strerror or exc}", exit_code_of(exc)) from None
    return sockets


def mesh_settings(settings: Settings):
    """The mesh's settings: the node's facts, and the limits objects its sections build."""
    from hmpnode.net.settings import MeshSettings

    node, peer, interests = settings.node, settings.peer, settings.interests
    return MeshSettings(
        host=peer.host, port=peer.port if isinstance(peer.port, int) else 0, roles=node.roles, name=node.name, interests=node.interests,
        mailman=peer.mailman, min_difficulty=peer.min_difficulty, pinned=peer.pinned, allow=peer.allow,
        idle_connection_seconds=node.idle_connection_seconds, dht=peer.dht, dht_port=peer.dht_port,
        bootstrap=peer.bootstrap_addresses(), declared=interests.declared(),
        mesh=peer.mesh_limits(), session=peer.session_limits(settings.relay, interests),
        relay=settings.relay.relay_limits(), delta=settings.delta.delta_limits(), slots=peer.slot_limits(),
        dialing=peer.dial_limits(interests), dht_limits=peer.dht_limits(), lan=peer.lan_settings(), addresses=peer.address_settings(),
        dialback=peer.dialback_limits(),
        circuit=peer.circuit_limits(),
        punch=peer.punch_limits(),
    )


def consensus_policy(settings: Settings):
    """[consensus] as the node's hmpnode.consensus.Policy."""
    from dataclasses import asdict

    from hmpnode.consensus import Policy

    return Policy(**asdict(settings.consensus))


def _api_limits(settings: Settings):
    from hmpnode.api.app import ApiLimits

    wanted = {f.name for f in dataclasses.fields(ApiLimits)} if dataclasses.is_dataclass(ApiLimits) else None
    values = {
        f.name: getattr(settings.api, f.name)
        for f in dataclasses.fields(settings.api)
        if wanted is None or f.name in wanted
    }
    if wanted is None:  # not a dataclass: pass what the contract names
        keys = ("max_body_bytes", "max_batch", "max_list_limit", "default_list_limit", "max_event_subscribers")
        values = {k: values[k] for k in keys}
    return ApiLimits(**values)


class _Shutdown:
    """The daemon's signals: SIGINT/SIGTERM (and the API's shutdown request) stop it,
    SIGHUP re-reads the log level (`reload_level`: its name and where it came from)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, node_file: Path,
                 reload_level: Callable[[], tuple[str, str]] | None = None):
        self.event = asyncio.Event()
        self.signals = 0
        self.first = 0.0
        self.node_file = node_file
        self.loop = loop
        self.reload_level = reload_level

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(sig, self.on_signal, sig)
        if self.reload_level is not None:
            self.loop.add_signal_handler(signal.SIGHUP, self.on_hangup)

    def request(self, why: str) -> None:
        """Stop as on a first SIGTERM (POST /v1/shutdown)."""
        if not self.event.is_set():
            log.info("shutdown requested (%s); shutting down", why)
            self.event.set()

    def on_hangup(self) -> None:
        from hmpnode.logs import current_level, set_level

        try:
            level, source = self.reload_level()
        except DaemonError as exc:
            log.warning("SIGHUP: the log level stays %s: %s", current_level(), exc)
            return
        previous = set_level(level)
        log.warning("SIGHUP: log level %s (was %s; from %s); only the log level is reloaded, "
                    "restart to apply other settings", level, previous, source)

    def uninstall(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                self.loop.remove_signal_handler(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass

    def on_signal(self, sig: signal.Signals) -> None:
        self.signals += 1
        now = time.monotonic()
        if self.signals == 1:
            self.first = now
            log.info("%s received; shutting down", signal.Signals(sig).name)
            self.event.set()
            return
        if now - self.first < FORCE_AFTER:  # e.g. one signal to the process and one to its group
            return
        log.warning("%s received again; exiting now", signal.Signals(sig).name)
        self.node_file.unlink(missing_ok=True)
        logging.shutdown()
        os._exit(EXIT_FAILED)


class StoreGuard:
    """Keeps `<data-dir>/store-state.json` (hmpnode.store.marker): refuses a store that
    is missing, empty or behind it, unless the operator accepted the loss, and
    moves it forward at start, every MARKER_EVERY seconds while the sequence moves,
    and at a clean stop."""

    def __init__(self, data_dir: Path, db_path: Path, accept_loss: bool):
        from hmpnode.store import marker

        self.m = marker
        self.path = data_dir / marker.MARKER_FILE
        self.db_path = db_path
        self.accept_loss = accept_loss
        self.marker = None
        self.written = -1

    def _judge(self, problem: str | None) -> None:
        if problem is None:
            return
        if not self.accept_loss:
            raise DaemonError(
                f"refusing to start: {problem}; restore it from a backup, or run once with --accept-store-loss "
                f"(or delete {self.path}) to go on with the store as it is", EXIT_USAGE)
        log.warning("accepted with --accept-store-loss: %s", problem)
        self.marker = None  # a new history starts here

    def before_open(self) -> None:
        try:
            self.marker = self.m.read_marker(self.path)
        except UnsafePath as exc:
            raise _unsafe(exc) from None
        except self.m.MarkerError as exc:
            raise DaemonError(f"refusing to start: {exc}; delete it if the store is known to be good", EXIT_USAGE) from None
        self._judge(self.m.store_problem(self.marker, self.db_path, self.m.db_size(self.db_path)))

    async def after_open(self, node) -> None:
        high = await node.db.read(self.m.high_seq)
        self._judge(self.m.store_problem(self.marker, self.db_path, self.m.db_size(self.db_path), high))
        await self.update(max(high, node.last_seq))

    async def update(self, high: int) -> None:
        if high == self.written:
            return
        now = rfc3339(datetime.now(timezone.utc))
        created = self.marker.created if self.marker is not None else now
        self.marker = self.m.StoreMarker(self.db_path.name, created, max(high, self.written, 0), now)
        await asyncio.get_running_loop().run_in_executor(None, self.m.write_marker, self.path, self.marker)
        self.written = self.marker.high_seq

    async def keep(self, node) -> None:
        while True:
            await asyncio.sleep(self.m.MARKER_EVERY)
            try:
                await self.update(node.last_seq)
            except OSError as exc:  # disk full, most likely: the store says so on its own
                log.warning("cannot update the store marker %s: %s", self.path, exc.strerror or exc)


def _offset(raw: str, where: str) -> timedelta:
    try:
        return timedelta(seconds=float(raw.strip()))
    except (ValueError, OverflowError):
        raise DaemonError(f"{where}: {raw.strip()!r:.40} is not a number of seconds", EXIT_USAGE) from None


def _test_clock(env: Mapping[str, str]) -> dict[str, Any]:
    """{"clock": ...} off by TEST_CLOCK_OFFSET_ENV seconds or by what TEST_CLOCK_FILE_ENV
    holds (tests only), else {} (the node's own clock)."""
    raw, path = env.get(TEST_CLOCK_OFFSET_ENV, "").strip(), env.get(TEST_CLOCK_FILE_ENV, "").strip()
    if not raw and not path:
        return {}
    if raw:
        offset = _offset(raw, TEST_CLOCK_OFFSET_ENV)
        log.warning("the node's clock is off by %s s (%s, for tests only)", raw, TEST_CLOCK_OFFSET_ENV)
        return {"clock": lambda: datetime.now(timezone.utc) + offset}
    try:
        state = [0.0, _offset(Path(path).read_text(), path)]
    except OSError as exc:
        raise DaemonError(f"{TEST_CLOCK_FILE_ENV}={path}: {exc.strerror or exc}", EXIT_USAGE) from None
    log.warning("the node's clock is off by what %s holds (%s, for tests only)", path, TEST_CLOCK_FILE_ENV)

    def clock() -> datetime:
        mono = time.monotonic()
        if mono - state[0] >= 0.5:
            state[0] = mono
            with contextlib.suppress(OSError, DaemonError):
                state[1] = _offset(Path(path).read_text(), path)
        return datetime.now(timezone.utc) + state[1]

    return {"clock": clock}


async def serve(settings: Settings, identity, token: str, *, sources: Mapping[str, str],
                accept_store_loss: bool = False, api_sockets: list[socket.socket] | None = None,
                ports: StablePorts | None = None,
                reload_level: Callable[[], tuple[str, str]] | None = None) -> int:
    """Run the node and its API until SIGINT/SIGTERM; the lock is held by the caller.
    `sources`: where each setting came from (`settings_for`); `api_sockets`: the API's
    sockets bound already (bind_api), else bound here; `ports`: the stable ports,
    resolved in `settings` already, recorded once bound; `reload_level`: what SIGHUP
    applies, (level, where it came from) read from the settings again."""
    from aiohttp import web

    from hmpnode.api.app import create_app
    from hmpnode.node import Node
    from hmpnode.verifyprocs import resolve_count, thread_count

    data_dir = settings.data_dir
    node_file = data_dir / NODE_FILE
    sys.setswitchinterval(settings.node.switch_interval_us / 1e6)  # [node] switch_interval_us
    gc.set_threshold(settings.node.gc_young_threshold, *gc.get_threshold()[1:])  # [node] gc_young_threshold
    test_clock = _test_clock(os.environ)
    node_file.unlink(missing_ok=True)  # a leftover of a killed node: we hold the lock, it is stale
    loop = asyncio.get_running_loop()
    shutdown = _Shutdown(loop, node_file, reload_level)
    shutdown.install()

    node = Node(
        identity,
        data_dir,
        limits=settings.limits.verify_limits(),
        synchronous=settings.store.synchronous,
        batch_max=settings.store.batch_max,
        batch_wait_ms=settings.store.batch_wait_ms,
        reader_threads=settings.store.reader_threads,
        page_size=settings.store.page_size,
        writer_cache_mib=settings.store.writer_cache_mib,
        loop_read_rows=settings.store.loop_read_rows,
        forget_scrub=settings.store.forget_scrub,
        index_delay_ms=settings.store.index_delay_ms,
        index_batch=settings.store.index_batch,
        consensus=consensus_policy(settings),
        **test_clock,
        inflight_bytes=settings.limits.max_inflight_decompressed_bytes,
        peer_max_decompressed_bytes=settings.limits.max_peer_decompressed_bytes,
        recall_limits=settings.recall.recall_limits(),
        verify_processes=resolve_count(settings.node.verify_processes),
        verify_threads=thread_count(settings.node.verify_threads),
        verify_process_min_batch=settings.node.verify_process_min_batch,
    )
    guard = StoreGuard(data_dir, node.db.path, accept_store_loss)
    try:
        guard.before_open()
    except DaemonError:
        shutdown.uninstall()
        raise
    try:
        await node.start()
    except Exception as exc:
        log.debug("store open failed", exc_info=True)
        await _quietly(node.stop())
        shutdown.uninstall()
        raise DaemonError(f"cannot open the store in {data_dir}: {exc}", exit_code_of(exc)) from None
    try:
        await guard.after_open(node)
    except BaseException as exc:
        await _quietly(node.stop())
        shutdown.uninstall()
        if isinstance(exc, OSError):
            raise DaemonError(f"cannot write the store marker {guard.path}: {exc.strerror or exc}",
                              exit_code_of(exc)) from None
        raise

    from hmpnode.net.mesh import Mesh

    mesh = node.mesh = Mesh(node, mesh_settings(settings))
    try:
        await mesh.start()
    except OSError as exc:
        await _quietly(mesh.stop())
        await _quietly(node.stop())
        shutdown.uninstall()
        where = (ports.where("peer") if ports is not None else None) or "--peer-host/--peer-port, peer.host/peer.port"
        raise DaemonError(
            f"cannot listen for peers on {settings.peer.host}:{settings.peer.port} ({where}), "
            f"or the DHT on UDP port {settings.peer.dht_port} (--dht-port, peer.dht_port): "
            f"{exc.strerror or exc}", exit_code_of(exc)
        ) from None

    from hmpnode.logs import ACCESS_LOGGER, LevelAccessLogger

    access_log = logging.getLogger(ACCESS_LOGGER)  # writes only at debug (hmpnode.logs.set_level)
    app = create_app(node, token=token, limits=_api_limits(settings), dashboard=settings.api.dashboard,
                     config={"data_dir": str(settings.data_dir), "settings": settings.shown(sources)},
                     stop=shutdown.request)
    from hmpnode.serving import server_options

    runner = web.AppRunner(app, **server_options(settings.node.idle_connection_seconds), access_log=access_log,
                           access_log_class=LevelAccessLogger,
                           shutdown_timeout=SHUTDOWN_TIMEOUT, handle_signals=False)
    try:
        await runner.setup()
        try:
            for sock in api_sockets if api_sockets is not None else bind_api(settings.api.host, settings.api.port):
                await web.SockSite(runner, sock).start()
        except OSError as exc:
            raise DaemonError(
                f"cannot listen on {settings.api.host}:{settings.api.port} (api.host/api.port): {exc.strerror or exc}",
                exit_code_of(exc)) from None
        addresses = runner.addresses
        if not addresses:
            raise DaemonError(f"the API did not bind a socket on {settings.api.host}:{settings.api.port}")
        info = node_info(identity, settings.api.host, addresses[0], datetime.now(timezone.utc))
        info["peer"] = {"port": mesh.port, "dht_port": mesh.dht_port or None, "addresses": mesh.addresses,
                        "roles": list(settings.node.roles)}
        if ports is not None:
            ports.record(api=info["api"]["port"], peer=mesh.port)
        if not _is_loopback(settings.api.host):
            log.warning("the agent API listens on %s, beyond this machine; only the token guards it",
                        settings.api.host)
        write_private_file(node_file, orjson.dumps(info, option=orjson.OPT_INDENT_2) + b"\n", replace=True)
        log.info(
            "node ready",
            extra={"fields": {
                "did": identity.did, "url": info["api"]["url"], "data_dir": str(data_dir),
                "roles": list(settings.node.roles), "name": settings.node.name, "pid": info["pid"],
            }},
        )
        sd_notify(f"READY=1\nSTATUS=serving the API on {info['api']['url']}\nMAINPID={info['pid']}")
        # what start-up left alive stays (modules, schemas, settings): out of every later
        # collection's way (a full one walked it all again, holding the GIL)
        gc.collect()
        gc.freeze()
        trimmer = asyncio.create_task(_trim_heap_while_running())
        keeper = asyncio.create_task(guard.keep(node))
        closer = asyncio.create_task(node.close_proposals_forever())
        try:
            await shutdown.event.wait()
        finally:
            trimmer.cancel()
            keeper.cancel()
            closer.cancel()
    except BaseException:
        await _quietly(runner.cleanup())
        await _quietly(mesh.stop())
        await _quietly(node.stop())
        node_file.unlink(missing_ok=True)
        shutdown.uninstall()
        raise

    # Graceful: stop accepting, let in-flight requests end, then drain the store.
    sd_notify("STOPPING=1")
    try:
        await runner.cleanup()
    except Exception:
        log.exception("error while stopping the API")
    try:
        await mesh.stop()
    except Exception:
        log.exception("error while stopping the mesh")
    try:
        await node.stop()
    except Exception:
        log.exception("error while stopping the node")
        node_file.unlink(missing_ok=True)
        return EXIT_FAILED
    try:
        await guard.update(node.last_seq)
    except OSError as exc:
        log.warning("cannot update the store marker %s: %s", guard.path, exc.strerror or exc)
    node_file.unlink(missing_ok=True)
    shutdown.uninstall()
    log.info("stopped")
    return EXIT_OK


#: where the service manager listens for readiness (systemd `Type=notify`, sd_notify(3))
NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"


def sd_notify(message: str, env: Mapping[str, str] | None = None) -> bool:
    """Tell the service manager `message` (e.g. "READY=1"): one datagram to the unix
    socket named by $NOTIFY_SOCKET (a path, or "@name" in the abstract namespace), as
    sd_notify(3) does, so systemd's `Type=notify` needs no library. False when not run
    under one, or when the socket cannot be reached (logged; the node runs on)."""
    path = (os.environ if env is None else env).get(NOTIFY_SOCKET_ENV, "")
    if not path or path[0] not in "/@":
        return False
    address = "\0" + path[1:] if path[0] == "@" else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode("utf-8"))
    except OSError as exc:
        log.warning("cannot notify the service manager at %s (%s): %s", NOTIFY_SOCKET_ENV, path,
                    exc.strerror or exc)
        return False
    return True


#: seconds after "node ready" at which the C heap is trimmed, then the period of trimming
TRIM_AFTER = (1.0, 10.0)
TRIM_EVERY = 300.0


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; False
    where there is none). Python gives freed memory back to malloc, which keeps the
    pages: start-up (imports, migrations, the first discovery rounds) or a burst of
    ingest would otherwise stay in an idle node's RSS (about 2 MB after start-up)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim(0)
    return True


async def _trim_heap_while_running() -> None:
    for delay in TRIM_AFTER:
        await asyncio.sleep(delay)
        if not release_free_memory():
            return
    while True:
        await asyncio.sleep(TRIM_EVERY)
        release_free_memory()


async def _quietly(awaitable) -> None:
    try:
        await awaitable
    except Exception:
        log.debug("ignored during cleanup", exc_info=True)


def configured_log_level(options: RunOptions, env: Mapping[str, str]) -> tuple[str, str]:
    """(node.log_level, where it came from) as a start with `options` and `env` would read it
    now (SIGHUP); DaemonError when the settings are invalid."""
    sources: dict[str, str] = {}
    level = settings_for(options, env, sources).node.log_level
    return level, sources.get("node.log_level", "default")


def run(options: RunOptions, env: Mapping[str, str] | None = None) -> int:
    """`hmpnode run`: returns the exit status; DaemonError for a failed start."""
    from hmpnode.logs import setup_logging

    env = os.environ if env is None else env
    sources: dict[str, str] = {}
    settings = settings_for(options, env, sources)
    os.umask(0o077)  # everything the node creates (store, WAL, temp files) is the owner's only
    setup_logging(settings.node.log_format, settings.node.log_level)
    from hmpnode.serving import raise_open_file_limit

    before, after = raise_open_file_limit()
    log.debug("open file limit %d -> %d", before, after)
    prepare_data_dir(settings.data_dir)
    lock = DataDirLock(settings.data_dir)
    lock.acquire()
    try:
        ports = StablePorts.load(settings)
        settings = ports.resolve(settings)
        api_sockets = bind_api(settings.api.host, settings.api.port, ports.where("api"))
        try:
            identity = load_or_create_identity(settings)
            token = load_or_create_token(settings.data_dir)
            return asyncio.run(serve(settings, identity, token, accept_store_loss=options.accept_store_loss,
                                     api_sockets=api_sockets, ports=ports, sources=sources,
                                     reload_level=lambda: configured_log_level(options, env)))
        finally:
            for sock in api_sockets:
                sock.close()
    finally:
        lock.release()
