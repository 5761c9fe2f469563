"""`hmpnode run`: the node daemon.

Startup, in order:

1. settings: flags > HMPNODE_* environment > <data-dir>/hmpnode.toml > defaults
   (an invalid setting is one line naming it; exit 2);
2. the data directory (created 0700) and its lock: an exclusive `flock` on
   `<data-dir>/lock`, held for the life of the process. The kernel drops it
   when the process dies however it dies, so a node killed with SIGKILL never
   blocks a restart; a second live node on the same directory is refused (exit 1);
3. the identity: `<data-dir>/identity.json` (or `identity.keystore`), created
   0600 on first start, sealed when `identity.passphrase_file` is set;
4. the API token: `<data-dir>/api.token`, 32 random bytes as base64url,
   created 0600 on first start (written to a 0600 temp file, then linked into place);
5. the node (store open, keys loaded), its mesh (peer port, DHT, LAN
   discovery; docs/protocol.md sections 19-26), then the local agent API;
6. `<data-dir>/node.json` (atomically, 0600) says where the node listens:
   {"did", "public_key", "pid", "api": {"host", "port", "url"},
    "peer": {"port", "dht_port", "addresses", "roles"}, "started", "version"}.

SIGINT / SIGTERM: stop listening, let in-flight requests finish (bounded by
SHUTDOWN_TIMEOUT), stop the node (which drains queued writes), remove
node.json, exit 0. Another signal during shutdown, FORCE_AFTER seconds or more
after the first, exits at once (exit 1); acknowledged writes are committed
already, so nothing acknowledged is lost. The process umask is 0077: every file
the node creates is its owner's only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import fcntl
import ipaddress
import logging
import os
import secrets
import signal
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson

from hmpnode import __version__
from hmpnode.config import ConfigError, Settings, load_settings
from hmpnode.fsutil import write_private_file

__all__ = [
    "DaemonError",
    "RunOptions",
    "DataDirLock",
    "NODE_FILE",
    "TOKEN_FILE",
    "LOCK_FILE",
    "SHUTDOWN_TIMEOUT",
    "settings_for",
    "run",
]

log = logging.getLogger("hmpnode.daemon")

NODE_FILE = "node.json"
TOKEN_FILE = "api.token"
LOCK_FILE = "lock"
TOKEN_BYTES = 32
#: seconds in-flight HTTP requests get to finish on shutdown (event streams end at once)
SHUTDOWN_TIMEOUT = 10.0
#: a second SIGINT/SIGTERM this many seconds after the first forces an immediate exit
FORCE_AFTER = 1.0
_MAX_SMALL_FILE = 64 * 1024

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class DaemonError(Exception):
    """Startup failed; `code` is the exit status (2: configuration or input, 1: runtime)."""

    def __init__(self, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.code = code


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


_FLAG_SETTINGS = {
    "api_host": ("api.host", "--api-host"),
    "api_port": ("api.port", "--api-port"),
    "log_format": ("node.log_format", "--log-format"),
    "log_level": ("node.log_level", "--log-level"),
    "roles": ("node.roles", "--roles"),
    "peer_host": ("peer.host", "--peer-host"),
    "peer_port": ("peer.port", "--peer-port"),
    "dht_port": ("peer.dht_port", "--dht-port"),
}


def settings_for(options: RunOptions, env: Mapping[str, str]) -> Settings:
    """The effective settings for these flags; DaemonError (exit 2) if invalid."""
    overrides = {setting: getattr(options, attr) for attr, (setting, _) in _FLAG_SETTINGS.items()}
    sources = {setting: flag for setting, flag in _FLAG_SETTINGS.values()}
    try:
        return load_settings(
            data_dir=Path(options.data_dir).expanduser().absolute() if options.data_dir is not None else None,
            config_file=Path(options.config).expanduser().absolute() if options.config is not None else None,
            env=env,
            overrides=overrides,
            override_sources=sources,
        )
    except ConfigError as exc:
        raise DaemonError(f"invalid configuration: {exc}", EXIT_USAGE) from None


# -- files -------------------------------------------------------------------




def _read_small(path: Path) -> bytes:
    with open(path, "rb") as fh:
        data = fh.read(_MAX_SMALL_FILE + 1)
    if len(data) > _MAX_SMALL_FILE:
        raise DaemonError(f"{path} is larger than {_MAX_SMALL_FILE} bytes", EXIT_USAGE)
    return data


def _tighten(path: Path, what: str) -> None:
    """Group/other access to a secret file: warn and take it away."""
    try:
        mode = os.stat(path).st_mode
        if mode & 0o077:
            os.chmod(path, stat.S_IMODE(mode) & 0o700)
            log.warning("%s %s was accessible by other users; mode set to %o", what, path, stat.S_IMODE(mode) & 0o700)
    except OSError as exc:
        log.warning("cannot check the mode of %s %s: %s", what, path, exc.strerror or exc)


def prepare_data_dir(path: Path) -> None:
    """Create the data directory with mode 0700 (parents with the default mode)."""
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
            else:
                os.chmod(path, 0o700)
        elif not path.is_dir():
            raise DaemonError(f"data dir {path} is not a directory", EXIT_USAGE)
    except OSError as exc:
        raise DaemonError(f"cannot create data dir {path}: {exc.strerror or exc}", EXIT_USAGE) from None
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        log.warning("data dir %s is accessible by other users (mode %o); chmod 700 recommended", path, mode)


class DataDirLock:
    """An exclusive flock on `<data-dir>/lock`, held until `release()` or process
    exit. The file keeps the holder's pid, for error messages only: the lock,
    not the file, decides."""

    def __init__(self, data_dir: Path):
        self.path = Path(data_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise DaemonError(f"cannot open {self.path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
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
            raise DaemonError(f"cannot lock {self.path}: {exc.strerror or exc}") from None
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


def _read_passphrase(path: Path | None) -> bytes | None:
    from hmpnode.identity.keystore import KeystoreError, read_passphrase_file

    if path is None:
        return None
    try:
        return read_passphrase_file(path)
    except KeystoreError as exc:
        raise DaemonError(f"identity.passphrase_file: {exc}", EXIT_USAGE) from None


def load_or_create_identity(settings: Settings):
    """The node's identity from its keystore, created on first start."""
    from hmpnode.identity import Identity, KeystoreError, load_keystore, save_keystore

    path = settings.identity.keystore
    passphrase = _read_passphrase(settings.identity.passphrase_file)
    if not os.path.lexists(path):
        identity = Identity.generate()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_keystore(path, identity, passphrase=passphrase)
        except FileExistsError:
            pass  # appeared meanwhile (we hold the lock, so someone else's doing): load it
        except (OSError, ValueError) as exc:
            raise DaemonError(f"cannot write identity keystore {path}: {exc}", EXIT_USAGE) from None
        else:
            log.info("created a new identity", extra={"fields": {"did": identity.did, "keystore": str(path)}})
            return identity
    _tighten(path, "keystore")
    try:
        return load_keystore(path, passphrase=passphrase)
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
    _tighten(path, "API token")
    try:
        text = _read_small(path).decode("ascii").strip()
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


def mesh_settings(settings: Settings):
    """The mesh's settings from the [node], [peer] and [relay] sections."""
    from hmpnode.net.announce import parse_addr
    from hmpnode.net.mesh import MeshSettings

    peer, relay = settings.peer, settings.relay
    bootstrap = tuple(parse_addr("udp://" + entry)[1:] for entry in peer.bootstrap)
    return MeshSettings(
        host=peer.host, port=peer.port, roles=tuple(settings.node.roles), name=settings.node.name,
        interests=tuple(settings.node.interests), mailman=tuple(peer.mailman), min_difficulty=peer.min_difficulty,
        target_peers=peer.target_peers, max_peers=peer.max_peers, fanout=peer.fanout,
        max_frame_bytes=peer.max_frame_bytes, max_items_per_frame=peer.max_items_per_frame,
        max_requested=peer.max_requested, idle_connection_seconds=settings.node.idle_connection_seconds,
        frames_per_second=peer.frames_per_second, containers_per_second=peer.containers_per_second,
        frame_burst=peer.frames_per_second * 5, container_burst=peer.containers_per_second * 10,
        strike_threshold=peer.strike_threshold, ban_seconds=peer.ban_seconds,
        max_frame_decompressed_bytes=peer.max_frame_decompressed_bytes,
        verify_seconds_per_second=peer.verify_ms_per_second / 1000,
        verify_burst_seconds=peer.verify_ms_per_second / 1000 * 4,
        relay_max_per_recipient=relay.max_per_recipient, relay_max_bytes_per_recipient=relay.max_bytes_per_recipient,
        relay_max_total_bytes=relay.max_total_bytes,
        lan=peer.lan_discovery, lan_port=peer.discovery_port, lan_group=peer.discovery_group,
        lan_mode=peer.discovery_mode, lan_interval=peer.discovery_interval_ms / 1000,
        lan_interfaces=tuple(peer.discovery_interfaces),
        dht=peer.dht, dht_port=peer.dht_port, bootstrap=tuple((h.strip("[]"), p) for h, p in bootstrap),
    )


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
    def __init__(self, loop: asyncio.AbstractEventLoop, node_file: Path):
        self.event = asyncio.Event()
        self.signals = 0
        self.first = 0.0
        self.node_file = node_file
        self.loop = loop

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(sig, self.on_signal, sig)

    def uninstall(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
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


async def serve(settings: Settings, identity, token: str) -> int:
    """Run the node and its API until SIGINT/SIGTERM; the lock is held by the caller."""
    from aiohttp import web

    from hmpnode.api.app import create_app
    from hmpnode.node import Node

    data_dir = settings.data_dir
    node_file = data_dir / NODE_FILE
    node_file.unlink(missing_ok=True)  # a leftover of a killed node: we hold the lock, it is stale
    loop = asyncio.get_running_loop()
    shutdown = _Shutdown(loop, node_file)
    shutdown.install()

    node = Node(
        identity,
        data_dir,
        limits=settings.limits.verify_limits(),
        synchronous=settings.store.synchronous,
        batch_max=settings.store.batch_max,
        batch_wait_ms=settings.store.batch_wait_ms,
        reader_threads=settings.store.reader_threads,
        inflight_bytes=settings.limits.max_inflight_decompressed_bytes,
        peer_max_decompressed_bytes=settings.limits.max_peer_decompressed_bytes,
    )
    try:
        await node.start()
    except Exception as exc:
        log.debug("store open failed", exc_info=True)
        await _quietly(node.stop())
        shutdown.uninstall()
        raise DaemonError(f"cannot open the store in {data_dir}: {exc}") from None

    from hmpnode.net.mesh import Mesh

    mesh = node.mesh = Mesh(node, mesh_settings(settings))
    try:
        await mesh.start()
    except OSError as exc:
        await _quietly(mesh.stop())
        await _quietly(node.stop())
        shutdown.uninstall()
        raise DaemonError(
            f"cannot listen for peers on {settings.peer.host}:{settings.peer.port} (peer.host/peer.port, "
            f"peer.dht_port {settings.peer.dht_port}): {exc.strerror or exc}"
        ) from None

    access_log = logging.getLogger("hmpnode.access") if log.isEnabledFor(logging.DEBUG) else None
    app = create_app(node, token=token, limits=_api_limits(settings))
    from hmpnode.serving import server_options

    runner = web.AppRunner(app, **server_options(settings.node.idle_connection_seconds), access_log=access_log,
                           shutdown_timeout=SHUTDOWN_TIMEOUT, handle_signals=False)
    try:
        await runner.setup()
        site = web.TCPSite(runner, settings.api.host, settings.api.port)
        try:
            await site.start()
        except OSError as exc:
            raise DaemonError(
                f"cannot listen on {settings.api.host}:{settings.api.port} (api.host/api.port): {exc.strerror or exc}"
            ) from None
        addresses = runner.addresses
        if not addresses:
            raise DaemonError(f"the API did not bind a socket on {settings.api.host}:{settings.api.port}")
        info = node_info(identity, settings.api.host, addresses[0], datetime.now(timezone.utc))
        info["peer"] = {"port": mesh.port, "dht_port": mesh.dht_port or None, "addresses": mesh.addresses,
                        "roles": list(settings.node.roles)}
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
        trimmer = asyncio.create_task(_trim_heap_while_running())
        try:
            await shutdown.event.wait()
        finally:
            trimmer.cancel()
    except BaseException:
        await _quietly(runner.cleanup())
        await _quietly(mesh.stop())
        await _quietly(node.stop())
        node_file.unlink(missing_ok=True)
        shutdown.uninstall()
        raise

    # Graceful: stop accepting, let in-flight requests end, then drain the store.
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
    node_file.unlink(missing_ok=True)
    shutdown.uninstall()
    log.info("stopped")
    return EXIT_OK


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


def run(options: RunOptions, env: Mapping[str, str] | None = None) -> int:
    """`hmpnode run`: returns the exit status; DaemonError for a failed start."""
    from hmpnode.logs import setup_logging

    settings = settings_for(options, os.environ if env is None else env)
    os.umask(0o077)  # everything the node creates (store, WAL, temp files) is the owner's only
    setup_logging(settings.node.log_format, settings.node.log_level)
    from hmpnode.serving import raise_open_file_limit

    before, after = raise_open_file_limit()
    log.debug("open file limit %d -> %d", before, after)
    prepare_data_dir(settings.data_dir)
    lock = DataDirLock(settings.data_dir)
    lock.acquire()
    try:
        identity = load_or_create_identity(settings)
        token = load_or_create_token(settings.data_dir)
        return asyncio.run(serve(settings, identity, token))
    finally:
        lock.release()
