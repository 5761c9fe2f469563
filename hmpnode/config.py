"""The node's settings: built-in defaults < config file < environment < flags.

Pure: `load_settings` reads at most one TOML file and otherwise only the
mappings it is handed (it never reads `os.environ` itself), and it returns a
frozen `Settings` or raises `ConfigError`.

Layers, lowest to highest precedence:

1. the defaults of the dataclasses below;
2. `<data_dir>/hmpnode.toml` if it exists, or the `config_file` given
   explicitly (which must exist); unknown sections and keys are errors;
3. environment variables `HMPNODE_<SECTION>_<KEY>` (`HMPNODE_API_PORT=8080`),
   plus `HMPNODE_DATA_DIR` for the data directory when none is given;
   a variable naming a known section but an unknown key is an error, other
   `HMPNODE_*` variables are left alone;
4. `overrides`, dotted keys (`{"api.port": 8080}`): the command-line flags.
   A value of None means "flag not given" and is skipped.

Every value is checked in the layer it comes from, so a bad value is reported
with its source even when a higher layer would have replaced it. Relative
paths (from any layer) are relative to the data directory; the CLI should make
flag paths absolute before passing them.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import platformdirs

if TYPE_CHECKING:
    from hmpnode.container.verify import Limits
    from hmpnode.net.circuit import CircuitLimits
    from hmpnode.net.addresses import AddressSettings
    from hmpnode.net.deltaplan import DeltaLimits
    from hmpnode.net.dht import DhtLimits
    from hmpnode.net.dialing import DialLimits
    from hmpnode.net.reach import DialbackLimits
    from hmpnode.net.interests import Interests
    from hmpnode.net.lan import LanSettings
    from hmpnode.net.settings import MeshLimits
    from hmpnode.net.punch import PunchLimits
    from hmpnode.net.relayquota import RelayLimits
    from hmpnode.net.session import SessionLimits
    from hmpnode.net.slots import SlotLimits

__all__ = [
    "ConfigError",
    "Settings",
    "NodeSettings",
    "IdentitySettings",
    "ApiSettings",
    "LimitsSettings",
    "StoreSettings",
    "PeerSettings",
    "RelaySettings",
    "RecallSettings",
    "ConsensusSettings",
    "InterestsSettings",
    "DeltaSettings",
    "CONFIG_FILENAME",
    "ENV_PREFIX",
    "DATA_DIR_ENV",
    "default_data_dir",
    "env_var_name",
    "load_settings",
]

CONFIG_FILENAME = "hmpnode.toml"
ENV_PREFIX = "HMPNODE_"
#: HMPNODE_* variables that are no setting but are read elsewhere: the data dir, and the
#: test suite's own (HMPNODE_TEST_*, HMPNODE_REQUIRE_*); any other name is refused, so that
#: a typo in a section's name (HMPNODE_PEERS_PORT) is not silently ignored
ENV_NOT_SETTINGS = ("HMPNODE_DATA_DIR",)
ENV_NOT_SETTING_PREFIXES = ("HMPNODE_TEST_", "HMPNODE_REQUIRE_")
DATA_DIR_ENV = "HMPNODE_DATA_DIR"

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB


class ConfigError(ValueError):
    """An invalid setting; the message names the setting and where it came from."""


# ---------------------------------------------------------------------------
# Field specifications: how a setting is parsed and what values it accepts.


@dataclass(frozen=True, slots=True)
class _Spec:
    kind: str  # "int" | "bool" | "str" | "choice" | "path" | "list"
    rule: str  # completes "must ..." in error messages
    lo: int = 0
    hi: int = 0
    choices: tuple[str, ...] = ()
    optional: bool = False  # path: "" means "none"
    check: Callable[[str], bool] | None = None  # str values, list items


class _Bad(Exception):
    """A value a spec refuses; `shown` is how the message displays it."""

    def __init__(self, shown: str):
        super().__init__(shown)
        self.shown = shown


def _setting(default: Any, spec: _Spec) -> Any:
    if isinstance(default, (list, tuple)):
        value = tuple(default)
        return field(default_factory=lambda: value, metadata={"spec": spec})
    return field(default=default, metadata={"spec": spec})


def _int(lo: int, hi: int) -> _Spec:
    return _Spec("int", f"must be an integer {lo}..{hi}", lo=lo, hi=hi)


def _choice(*choices: str) -> _Spec:
    return _Spec("choice", f"must be one of {', '.join(choices)}", choices=choices)


_BOOL = _Spec("bool", "must be true or false (in the environment also 1/0/yes/no)")
_PORT = _int(0, 65535)
_STABLE_PORT = _Spec("auto_int", 'must be "auto" (the port of the first start, kept) or a port 0..65535 (0: any)',
                     lo=0, hi=65535)

_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")


def _is_host(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        pass
    name = text[:-1] if text.endswith(".") else text
    if not name or len(name) > 253:
        return False
    return all(_HOST_LABEL.match(label) for label in name.split("."))


def _is_host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    if not sep or not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
        return False
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.ip_address(host[1:-1]).version == 6
        except ValueError:
            return False
    return ":" not in host and _is_host(host)


def _is_entry(text: str) -> bool:
    """An interest or topic: 1..128 printable characters (the DHT topic limit)."""
    return 0 < len(text) <= 128 and text.isprintable()


def _is_name(text: str) -> bool:
    return len(text) <= 64 and text.isprintable()


_HOST = _Spec("str", "must be an IP address or a host name", check=_is_host)
KNOWN_ROLES = ("relay", "mailman", "circuit")
#: peer.announce entries: each is an address record (~150 bytes with its proof of work) of an
#: announce that must fit one LAN datagram (8 KiB) beside the interfaces' addresses
MAX_ANNOUNCE = 16


# ---------------------------------------------------------------------------
# The sections.


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """[node]"""

    log_format: str = _setting("text", _choice("text", "json"))
    log_level: str = _setting("info", _choice("debug", "info", "warning", "error"))
    roles: tuple[str, ...] = _setting(
        (), _Spec("list", f"must list roles among {', '.join(KNOWN_ROLES)}", check=KNOWN_ROLES.__contains__)
    )
    name: str = _setting("", _Spec("str", "must be at most 64 printable characters", check=_is_name))
    #: topics this agent is interested in (peer_announce `interests`, DHT topic records)
    interests: tuple[str, ...] = _setting((), _Spec("list", "must list topics of 1..128 printable characters",
                                                    check=_is_entry))
    #: seconds an API or peer connection may stay open with no request in progress
    idle_connection_seconds: int = _setting(30, _int(1, 86_400))
    #: worker processes verifying big batches (hmpnode.verifyprocs): "auto" (none on 1 core,
    #: 2 on 2 cores, one per core but one beyond: resolve_count), 0 (verify threads only) or a number
    verify_processes: str | int = _setting("auto", _Spec("auto_int", "must be \"auto\" or an integer 0..64",
                                                          lo=0, hi=64))
    #: containers a batch needs to go to the worker processes (smaller ones: threads)
    verify_process_min_batch: int = _setting(64, _int(1, 100_000))
    #: threads verifying in the node's process: "auto" (hmpnode.verifyprocs.thread_count) or a number
    verify_threads: str | int = _setting("auto", _Spec("auto_int", "must be \"auto\" or an integer 1..64",
                                                        lo=1, hi=64))
    #: microseconds a Python thread runs before one waiting for the GIL may take it
    #: (sys.setswitchinterval; Python's default is 5000): how long the event loop, and
    #: so every API read, can wait behind the writer's or a verify thread's Python code
    #: each time it needs the GIL; 500 measured best for reads while importing
    switch_interval_us: int = _setting(500, _int(100, 100_000))
    #: objects allocated (less freed) between two young-generation collections of the
    #: cyclic GC (gc.set_threshold's first value; Python's default is 700): ingest
    #: allocates thousands per batch, and each collection holds the GIL
    gc_young_threshold: int = _setting(50_000, _int(700, 10_000_000))


@dataclass(frozen=True, slots=True)
class IdentitySettings:
    """[identity]. `load_settings` makes `keystore` absolute (`<data_dir>/identity.json`)."""

    keystore: Path = _setting(Path("identity.json"), _Spec("path", "must be a non-empty path"))
    #: None: the keystore is not sealed with a passphrase
    passphrase_file: Path | None = _setting(None, _Spec("path", "must be a path or \"\"", optional=True))


@dataclass(frozen=True, slots=True)
class ApiSettings:
    """[api]: the local agent API."""

    host: str = _setting("127.0.0.1", _HOST)
    #: "auto": the port picked on the first start, kept in <data_dir>/ports.json; 0: a free port every start
    port: str | int = _setting("auto", _STABLE_PORT)
    max_body_bytes: int = _setting(8 * MIB, _int(1, 1 * GIB))
    #: containers per import request
    max_batch: int = _setting(1000, _int(1, 100_000))
    max_list_limit: int = _setting(1000, _int(1, 100_000))
    default_list_limit: int = _setting(100, _int(1, 100_000))
    max_event_subscribers: int = _setting(64, _int(1, 10_000))
    event_queue_size: int = _setting(10_000, _int(1, 10_000_000))
    # ingest and event-stream budgets (issue 10)
    #: decompressed bytes of all containers of one import request (over: over_budget)
    max_import_decompressed_bytes: int = _setting(64 * MIB, _int(1, 64 * GIB))
    #: bytes of events waiting for one event-stream client, and for all of them together
    event_queue_bytes: int = _setting(4 * MIB, _int(64 * KIB, 16 * GIB))
    event_queue_total_bytes: int = _setting(64 * MIB, _int(64 * KIB, 64 * GIB))
    #: serve the web dashboard's static files at / (they hold no data; the page needs the token)
    dashboard: bool = _setting(True, _BOOL)
    #: milliseconds between two points of the dashboard's charts (GET /v1/history keeps 720 of them)
    history_interval_ms: int = _setting(5000, _int(100, 60_000))


@dataclass(frozen=True, slots=True)
class LimitsSettings:
    """[limits]: bounds for untrusted containers (hmpnode.container.verify.Limits)."""

    max_container_bytes: int = _setting(1 * MIB, _int(1, 1 * GIB))
    max_depth: int = _setting(64, _int(1, 512))
    max_clock_skew_seconds: int = _setting(300, _int(0, 365 * 86400))
    max_decompressed_bytes: int = _setting(16 * MIB, _int(1, 4 * GIB))
    # ingest budgets (issue 10)
    #: largest decompressed payload of a container received from a peer
    max_peer_decompressed_bytes: int = _setting(4 * MIB, _int(1, 4 * GIB))
    #: decompressed bytes held by verifications in progress, node-wide (API imports and all peers)
    max_inflight_decompressed_bytes: int = _setting(64 * MIB, _int(1, 64 * GIB))

    def verify_limits(self) -> Limits:
        from hmpnode.container.verify import Limits

        return Limits(
            max_container_bytes=self.max_container_bytes,
            max_depth=self.max_depth,
            max_clock_skew=timedelta(seconds=self.max_clock_skew_seconds),
            max_decompressed_bytes=self.max_decompressed_bytes,
        )


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """[store]: the container store."""

    synchronous: str = _setting("full", _choice("full", "normal"))
    #: containers per write transaction
    batch_max: int = _setting(512, _int(1, 100_000))
    batch_wait_ms: int = _setting(2, _int(0, 10_000))
    reader_threads: int = _setting(2, _int(1, 64))
    #: a GET (1 row) and a list page of at most this many rows are read on the event loop
    #: (0: all reads in the reader threads); one that takes more SQLite steps than its rows
    #: need is moved to a reader thread
    loop_read_rows: int = _setting(1, _int(0, 1000))
    #: after a forget, rewrite the full-text index (FTS5 optimize) and truncate the WAL, so
    #: that no word of the forgotten text stays in the database files (0.3-0.5 s per forget
    #: at 100 000 memories, during which writes wait; 2 ms without); false: forgotten words may linger
    #: in dead index segments and the WAL until SQLite reuses them
    forget_scrub: bool = _setting(True, _BOOL)
    #: full-text indexing after the commit (hmpnode.store.indexer): milliseconds the indexer
    #: waits after a commit to gather rows into one step (a search or recall never waits it
    #: out), and the most rows indexed per step
    index_delay_ms: int = _setting(50, _int(0, 60_000))
    index_batch: int = _setting(2000, _int(1, 100_000))
    #: SQLite page size of a NEW store (an existing one keeps its own): 16 KiB pages cost the
    #: writer ~6 us less per container than 4 KiB (fewer WAL frames per commit, issue 15)
    page_size: int = _setting(16384, _Spec("int", "must be a power of two 4096..65536", lo=4096, hi=65536,
                                           check=lambda v: v & (v - 1) == 0))
    #: MiB of page cache of the writer's connection (SQLite's default 2): at 100 000 stored an
    #: ingest commit's pages no longer fit in 2 MiB, and every miss is a read (issue 15)
    writer_cache_mib: int = _setting(64, _int(2, 4096))


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
        return True
    except ValueError:
        return False


def _is_cidr(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
        return "/" in text
    except ValueError:
        return False


def _parses(parse: Callable[[str], Any], text: str) -> bool:
    try:
        parse(text)
        return True
    except ValueError:
        return False


def _announce_entry(text: str):
    from hmpnode.net.addresses import parse_announce

    return parse_announce(text)


def _static_peer(text: str):
    from hmpnode.net.addresses import parse_static

    return parse_static(text)


def _is_did(text: str) -> bool:
    return text.startswith("did:") and 5 <= len(text) <= 512 and text.isprintable()


@dataclass(frozen=True, slots=True)
class PeerSettings:
    """[peer]: the node-to-node side; builds the mesh's limits objects (hmpnode.net.settings.MeshSettings)."""

    #: where the peer port listens; 0.0.0.0 = every interface (LAN peers can connect)
    host: str = _setting("0.0.0.0", _HOST)
    #: as api.port: "auto" keeps the port of the first start (announced in the node's peer_announce)
    port: str | int = _setting("auto", _STABLE_PORT)
    #: Kademlia DHT (UDP) on dht_port; 0 picks a free port
    dht: bool = _setting(True, _BOOL)
    dht_port: int = _setting(0, _PORT)
    #: DHT (UDP) addresses to bootstrap from, besides peers found on the LAN
    bootstrap: tuple[str, ...] = _setting(
        (), _Spec("list", 'must list "host:port" entries (port 1..65535, IPv6 as "[addr]:port")', check=_is_host_port)
    )
    #: DHT store: records held for others in all, per source address, per source /24 (IPv6: /64);
    #: when full, the subnet holding the most gives up its least recently stored record
    dht_max_records: int = _setting(8192, _int(16, 1_000_000))
    dht_max_records_per_ip: int = _setting(512, _int(1, 1_000_000))
    dht_max_records_per_subnet: int = _setting(1024, _int(1, 1_000_000))
    #: seconds a record stored by another node is kept after its last STORE (signers store every 30 min)
    dht_hold_seconds: int = _setting(7200, _int(3600, 86_400))
    #: seconds a DHT record's timestamp may be ahead of this node's clock
    dht_max_skew_seconds: int = _setting(120, _int(0, 3600))
    #: the agent's newest broadcasts that get a DHT provider record (the list is on disk),
    #: and how many such records are signed and stored per second at most (burst: 16 s worth)
    dht_max_provided: int = _setting(1024, _int(1, 1_000_000))
    dht_provides_per_second: int = _setting(2, _int(1, 1000))
    lan_discovery: bool = _setting(True, _BOOL)
    discovery_port: int = _setting(47474, _int(1, 65535))
    discovery_group: str = _setting("239.255.74.77", _Spec(
        "str", "must be an IPv4 multicast address", check=lambda t: _is_ipv4(t) and ipaddress.IPv4Address(t).is_multicast))
    discovery_mode: str = _setting("both", _choice("multicast", "broadcast", "both"))
    discovery_interval_ms: int = _setting(5000, _int(100, 3_600_000))
    #: IPv4 addresses of the interfaces to discover on; empty: every interface that is up
    discovery_interfaces: tuple[str, ...] = _setting((), _Spec("list", "must list IPv4 addresses", check=_is_ipv4))
    #: proof of work (leading zero hex digits) demanded of announced addresses
    min_difficulty: int = _setting(3, _int(0, 16))
    target_peers: int = _setting(8, _int(0, 10_000))
    max_peers: int = _setting(64, _int(1, 100_000))
    fanout: int = _setting(4, _int(1, 1000))
    #: milliseconds a broadcast's announcements wait after its pushes (the eager tree goes first)
    announce_delay_ms: int = _setting(200, _int(0, 60_000))
    max_frame_bytes: int = _setting(4 * MIB, _int(64 * KIB, 1 * GIB))
    max_items_per_frame: int = _setting(512, _int(1, 100_000))
    #: container DIDs a node may have asked one peer for and not received yet
    max_requested: int = _setting(20_000, _int(1, 10_000_000))
    #: who-has-what entries (hmpnode.net.ledger, ~66 bytes each) one connection may fill, and all together
    ledger_session_entries: int = _setting(20_000, _int(8, 10_000_000))
    ledger_max_entries: int = _setting(400_000, _int(8, 100_000_000))
    frames_per_second: int = _setting(200, _int(1, 1_000_000))
    # ingest budgets (issue 10)
    #: decompressed bytes of all containers of one `containers` frame (over: over_budget)
    max_frame_decompressed_bytes: int = _setting(32 * MIB, _int(1, 64 * GIB))
    #: verification CPU milliseconds per second one peer may use (its frames wait beyond)
    verify_ms_per_second: int = _setting(500, _int(1, 1_000_000))
    containers_per_second: int = _setting(2000, _int(1, 10_000_000))
    #: strikes (1 per refused container, 5 per broken frame) that cut a peer off
    strike_threshold: int = _setting(50, _int(1, 1_000_000))
    ban_seconds: int = _setting(600, _int(0, 365 * 86400))
    # peer slots (hmpnode.net.slots): caps per address, subnet and this host; eviction; DID churn
    max_per_address: int = _setting(8, _int(1, 100_000))
    max_per_subnet: int = _setting(16, _int(1, 100_000))
    max_loopback_peers: int = _setting(32, _int(1, 100_000))
    #: connections the node keeps open by itself, whatever its inbound ones (at most target_peers)
    min_outbound: int = _setting(4, _int(0, 10_000))
    #: DIDs that always get a slot and are never evicted
    pinned: tuple[str, ...] = _setting((), _Spec("list", "must list DIDs", check=_is_did))
    #: CIDRs whose peers are treated as pinned (and whose addresses are never banned)
    allow: tuple[str, ...] = _setting((), _Spec("list", 'must list CIDRs ("10.0.0.0/8", "fd00::/8")', check=_is_cidr))
    #: distinct DIDs one address may show within did_window_seconds; more bans the address
    max_dids_per_address: int = _setting(16, _int(1, 1_000_000))
    did_window_seconds: int = _setting(600, _int(1, 365 * 86400))
    #: DIDs of relays that hold containers for this agent (connected relays are added)
    mailman: tuple[str, ...] = _setting((), _Spec("list", "must list DIDs", check=_is_did))
    # -- what the node announces and whom it keeps connected (hmpnode.net.addresses)
    #: addresses announced besides (or, announce_interfaces = false, instead of) the interfaces'
    announce: tuple[str, ...] = _setting((), _Spec(
        "list", 'must list "tcp://IP[:port]" or "udp://IP[:port]" entries (IP addresses, IPv6 in brackets)',
        check=lambda t: _parses(_announce_entry, t)))
    announce_interfaces: bool = _setting(True, _BOOL)
    #: CIDRs never announced (a container's bridge, a VPN)
    no_announce: tuple[str, ...] = _setting((), _Spec("list", 'must list CIDRs ("172.17.0.0/16")', check=_is_cidr))
    #: peers kept connected: "tcp://host:port" or "did:...@tcp://host:port"
    static: tuple[str, ...] = _setting((), _Spec(
        "list", 'must list "tcp://host:port" or "did:...@tcp://host:port" entries', check=lambda t: _parses(_static_peer, t)))
    #: static peers in all (configured and added at run time)
    static_max: int = _setting(64, _int(1, 10_000))
    # -- dialing and the peers table (hmpnode.net.dialing; docs/protocol.md 20.6)
    #: addresses learnt from a handshake or the DHT may be loopback/private/link-local
    dial_private: bool = _setting(False, _BOOL)
    #: CIDRs a handshake or DHT record may name although they are not globally routable
    dial_allow: tuple[str, ...] = _setting((), _Spec("list", 'must list CIDRs ("10.0.0.0/8")', check=_is_cidr))
    #: announced host names may be dialled (never those from a LAN announce)
    dial_hostnames: bool = _setting(False, _BOOL)
    #: connection attempts per second, node-wide, and how many may be saved up
    dials_per_second: int = _setting(2, _int(1, 10_000))
    dial_burst: int = _setting(16, _int(1, 100_000))
    #: longest wait between dial rounds to a peer that keeps failing
    dial_backoff_max_seconds: int = _setting(900, _int(1, 86_400))
    #: failed rounds in a row after which a peer that never answered is forgotten
    dial_give_up_after: int = _setting(5, _int(1, 1000))
    #: rows of the peers table
    peers_max: int = _setting(1000, _int(8, 1_000_000))
    #: a peer never connected to is forgotten when not heard of for this long
    peer_unanswered_max_age_seconds: int = _setting(86_400, _int(60, 365 * 86_400))
    # catch-up by reconciliation (hmpnode.net.syncset; docs/protocol.md 22.4)
    #: reconciliations one peer may start per minute (more: rate_limited)
    sync_per_minute: int = _setting(6, _int(1, 10_000))
    #: a stale node-wide snapshot is rebuilt at most this often (seconds)
    sync_snapshot_seconds: int = _setting(5, _int(0, 3600))
    #: an answered reconciliation left idle this long is dropped (seconds)
    sync_idle_seconds: int = _setting(60, _int(1, 3600))
    # the container index on request (hmpnode.net.index; docs/protocol.md 31)
    #: index requests one peer may make per minute (more are declined: rate_limited)
    index_requests_per_minute: int = _setting(30, _int(1, 10_000))
    #: entries of one index answer, and store rows read to make one
    index_page: int = _setting(500, _int(1, 100_000))
    index_scan: int = _setting(2000, _int(1, 1_000_000))
    #: a mesh-wide query (versions?mesh=1): peers asked, and how long it waits for them in all (ms)
    index_query_peers: int = _setting(8, _int(1, 1000))
    index_query_ms: int = _setting(2000, _int(1, 60_000))
    #: a container asked of a peer and not received within this long is asked for again at
    #: its next offer, from that peer or another (docs/protocol.md 22.2)
    request_timeout_ms: int = _setting(10_000, _int(100, 3_600_000))
    # observed addresses and dial-back (hmpnode.net.reach; docs/protocol.md 34.1, 34.2)
    #: serving: one dial-back per asking DID and per target IP this often (seconds)
    dialback_peer_interval_seconds: int = _setting(60, _int(1, 86_400))
    #: serving: dial-backs per minute node-wide, and at once
    dialback_per_minute: int = _setting(30, _int(1, 10_000))
    dialback_concurrent: int = _setting(4, _int(1, 1000))
    #: serving: milliseconds one dial-back (connect and request) may take (the asker waits 20 s)
    dialback_timeout_ms: int = _setting(5000, _int(100, 10_000))
    #: asking: one dial-back asked of a peer this often (seconds)
    dialback_ask_interval_seconds: int = _setting(600, _int(1, 86_400))
    #: asking: how long a reachability verdict holds (seconds; asked again after half of it)
    dialback_recheck_seconds: int = _setting(1800, _int(60, 7 * 86_400))
    # circuit relays (hmpnode.net.circuit; docs/protocol.md 34.3): the relay's caps (role circuit)
    #: reservations held in all, and from one address
    circuit_reservations: int = _setting(128, _int(1, 1_000_000))
    circuit_reservations_per_ip: int = _setting(4, _int(1, 1_000_000))
    #: how long a reservation lasts (a node renews it at half)
    circuit_reservation_seconds: int = _setting(3600, _int(60, 86_400))
    #: circuits (pending ones included) in all, and to one reserving node
    circuit_max: int = _setting(64, _int(1, 100_000))
    circuit_per_reservation: int = _setting(16, _int(1, 10_000))
    #: what one circuit carries at most: seconds, and bytes both ways together
    circuit_seconds: int = _setting(1800, _int(10, 86_400))
    circuit_bytes: int = _setting(64 * MIB, _int(64 * KIB, 64 * GIB))
    #: a pending circuit the reserving node has not accepted within this long is dropped
    circuit_accept_ms: int = _setting(5000, _int(100, 60_000))
    #: the reserving side: "auto" (when reachability is not public), "always", "never"
    circuit_reserve: str = _setting("auto", _choice("auto", "always", "never"))
    #: circuit relays this node holds reservations on at most
    circuit_relays: int = _setting(2, _int(1, 16))
    # hole punching over relayed sessions (hmpnode.net.punch; docs/protocol.md 34.4)
    #: attempts of one punch; ms to wait for the peer's answer or sync; ms each side keeps dialling
    punch_attempts: int = _setting(3, _int(1, 10))
    punch_answer_ms: int = _setting(5000, _int(100, 60_000))
    punch_dial_ms: int = _setting(2000, _int(100, 60_000))
    #: punch attempts (either role) per minute node-wide; punches with one peer per 10 minutes
    punch_per_minute: int = _setting(30, _int(1, 10_000))
    punch_peer_per_10min: int = _setting(3, _int(1, 1000))

    # What the mesh runs with (hmpnode.daemon.mesh_settings): each limits object is declared,
    # with its defaults, in its own module; here each is built once, in its units.

    def session_limits(self, relay: RelaySettings, interests: InterestsSettings) -> SessionLimits:
        """Per connection (hmpnode.net.session), with [relay] reoffer_ms and what [interests]
        bounds of a peer's peer_query."""
        from hmpnode.net.session import SessionLimits

        verify = self.verify_ms_per_second / 1000
        return SessionLimits(
            max_frame_bytes=self.max_frame_bytes, max_items_per_frame=self.max_items_per_frame,
            max_requested=self.max_requested, frames_per_second=self.frames_per_second,
            frame_burst=self.frames_per_second * 5, containers_per_second=self.containers_per_second,
            container_burst=self.containers_per_second * 10, strike_threshold=self.strike_threshold,
            verify_seconds_per_second=verify, verify_burst_seconds=verify * 4,
            max_frame_decompressed_bytes=self.max_frame_decompressed_bytes, sync_per_minute=self.sync_per_minute,
            peer_queries_per_minute=interests.queries_per_minute, max_interest_entries=interests.max_entries,
            index_requests_per_minute=self.index_requests_per_minute, index_page=self.index_page,
            index_scan=self.index_scan, request_timeout_seconds=self.request_timeout_ms / 1000,
            relay_reoffer_seconds=relay.reoffer_ms / 1000)

    def mesh_limits(self) -> MeshLimits:
        """The mesh's node-wide limits (hmpnode.net.settings.MeshLimits)."""
        from hmpnode.net.settings import MeshLimits

        return MeshLimits(
            fanout=self.fanout, announce_delay_seconds=self.announce_delay_ms / 1000,
            ledger_session_entries=self.ledger_session_entries, ledger_max_entries=self.ledger_max_entries,
            ban_seconds=self.ban_seconds, max_dids_per_address=self.max_dids_per_address,
            did_window_seconds=self.did_window_seconds, sync_snapshot_seconds=self.sync_snapshot_seconds,
            sync_idle_seconds=self.sync_idle_seconds, index_query_peers=self.index_query_peers,
            index_query_seconds=self.index_query_ms / 1000)

    def dialback_limits(self) -> DialbackLimits:
        """Dial-backs served and asked (hmpnode.net.reach.DialbackLimits)."""
        from hmpnode.net.reach import DialbackLimits

        return DialbackLimits(
            peer_interval_seconds=self.dialback_peer_interval_seconds, per_minute=self.dialback_per_minute,
            concurrent=self.dialback_concurrent, timeout_seconds=self.dialback_timeout_ms / 1000,
            ask_interval_seconds=self.dialback_ask_interval_seconds, recheck_seconds=self.dialback_recheck_seconds)

    def slot_limits(self) -> SlotLimits:
        """Peer slots (hmpnode.net.slots): inbound connections never take the last
        min(target_peers, max_peers // 2)."""
        from hmpnode.net.slots import SlotLimits

        return SlotLimits(max_peers=self.max_peers, outbound_slots=min(self.target_peers, self.max_peers // 2),
                          max_per_address=self.max_per_address, max_per_subnet=self.max_per_subnet,
                          max_loopback=self.max_loopback_peers)

    def dial_limits(self, interests: InterestsSettings) -> DialLimits:
        """Dialing and the peers table (hmpnode.net.dialing), with [interests] topic_dials."""
        from hmpnode.net.dialing import DialLimits, DialPolicy, parse_cidrs

        return DialLimits(
            policy=DialPolicy(private=self.dial_private, hostnames=self.dial_hostnames,
                              allow=parse_cidrs(self.dial_allow)),
            target_peers=self.target_peers, min_outbound=self.min_outbound, per_second=self.dials_per_second,
            burst=self.dial_burst, backoff_max=self.dial_backoff_max_seconds, give_up_after=self.dial_give_up_after,
            peers_max=self.peers_max, unanswered_max_age=self.peer_unanswered_max_age_seconds,
            topic_dials=interests.topic_dials)

    def address_settings(self) -> AddressSettings:
        """What the node announces and its static peers (hmpnode.net.addresses)."""
        from hmpnode.net.addresses import AddressSettings, parse_announce, parse_static
        from hmpnode.net.dialing import parse_cidrs

        return AddressSettings(announce=tuple(parse_announce(e) for e in self.announce),
                               no_announce=parse_cidrs(self.no_announce), announce_interfaces=self.announce_interfaces,
                               static=tuple(parse_static(e) for e in self.static), static_max=self.static_max)

    def dht_limits(self) -> DhtLimits:
        """The DHT's limits with the dht_* settings (everything else: hmpnode.net.dht's defaults)."""
        from hmpnode.net.dht import DhtLimits
        from hmpnode.net.dhtrecords import RecordLimits, StoreLimits

        store = StoreLimits(max_entries=self.dht_max_records, max_per_source=self.dht_max_records_per_ip,
                            max_per_group=self.dht_max_records_per_subnet,
                            max_hold=timedelta(seconds=self.dht_hold_seconds))
        return DhtLimits(store=store, records=RecordLimits(max_skew=timedelta(seconds=self.dht_max_skew_seconds)),
                         max_provided=self.dht_max_provided, provide_rate=self.dht_provides_per_second,
                         provide_burst=max(1.0, self.dht_provides_per_second * 16))

    def lan_settings(self) -> LanSettings:
        """LAN discovery (hmpnode.net.lan), demanding min_difficulty of announces as the rest of the node."""
        from hmpnode.net.lan import LanSettings

        return LanSettings(enabled=self.lan_discovery, port=self.discovery_port, group=self.discovery_group,
                           mode=self.discovery_mode, interval=self.discovery_interval_ms / 1000,
                           interfaces=self.discovery_interfaces or None, min_difficulty=self.min_difficulty)

    def circuit_limits(self) -> CircuitLimits:
        """Circuit relays (hmpnode.net.circuit), in seconds."""
        from hmpnode.net.circuit import CircuitLimits

        return CircuitLimits(
            max_reservations=self.circuit_reservations, max_reservations_per_ip=self.circuit_reservations_per_ip,
            reservation_seconds=float(self.circuit_reservation_seconds), max_circuits=self.circuit_max,
            max_circuits_per_reservation=self.circuit_per_reservation, circuit_seconds=float(self.circuit_seconds),
            circuit_bytes=self.circuit_bytes, accept_seconds=self.circuit_accept_ms / 1000,
            reserve=self.circuit_reserve, relays=self.circuit_relays)
    def punch_limits(self) -> PunchLimits:
        """Hole punching (hmpnode.net.punch)."""
        from hmpnode.net.punch import PunchLimits

        return PunchLimits(attempts=self.punch_attempts, answer_seconds=self.punch_answer_ms / 1000,
                           dial_seconds=self.punch_dial_ms / 1000, per_minute=self.punch_per_minute,
                           peer_punches=self.punch_peer_per_10min, peer_window_seconds=600.0)

    def bootstrap_addresses(self) -> tuple[tuple[str, int], ...]:
        """`bootstrap` as (host, port) pairs (an IPv6 host without its brackets)."""
        from hmpnode.net.announce import parse_addr

        return tuple((host.strip("[]"), port) for host, port in
                     (parse_addr("udp://" + entry)[1:] for entry in self.bootstrap))


@dataclass(frozen=True, slots=True)
class RelaySettings:
    """[relay]: limits of the relay/mailman role (node.roles)."""

    max_per_recipient: int = _setting(100_000, _int(1, 100_000_000))
    max_bytes_per_recipient: int = _setting(256 * MIB, _int(1, 1024 * GIB))
    max_total_bytes: int = _setting(2 * GIB, _int(1, 1024 * GIB))
    #: on behalf of one sending peer (DID), and of one sending address (not on loopback)
    max_per_sender: int = _setting(100_000, _int(1, 100_000_000))
    max_bytes_per_sender: int = _setting(256 * MIB, _int(1, 1024 * GIB))
    max_bytes_per_address: int = _setting(512 * MIB, _int(1, 1024 * GIB))
    #: for recipients the relay never heard of (no announce, no contact), all together
    max_unknown_bytes: int = _setting(32 * MIB, _int(0, 1024 * GIB))
    #: longest hold; a container's ttl ends it earlier
    max_hold_seconds: int = _setting(7 * 86_400, _int(1, 365 * 86_400))
    #: what a connected recipient has not acknowledged is offered again after this long
    #: (docs/protocol.md 24.2)
    reoffer_ms: int = _setting(15_000, _int(100, 3_600_000))

    def relay_limits(self) -> RelayLimits:
        """The relay's quotas (hmpnode.net.relayquota); reoffer_ms is a session limit."""
        from hmpnode.net.relayquota import RelayLimits

        return RelayLimits(
            max_per_recipient=self.max_per_recipient, max_bytes_per_recipient=self.max_bytes_per_recipient,
            max_total_bytes=self.max_total_bytes, max_per_sender=self.max_per_sender,
            max_bytes_per_sender=self.max_bytes_per_sender, max_bytes_per_address=self.max_bytes_per_address,
            max_unknown_bytes=self.max_unknown_bytes, max_hold_seconds=self.max_hold_seconds)


@dataclass(frozen=True, slots=True)
class RecallSettings:
    """[recall]: candidates and relevance of recall (hmpnode.memory.recall.RecallLimits)."""

    #: hits not excluded by lifecycle that recall ranks
    candidates: int = _setting(100, _int(1, 10_000))
    #: full-text hits looked at per recall at most, whatever their state
    max_scan: int = _setting(5000, _int(1, 1_000_000))
    #: the share of the query's weight a relevant memory matches, in percent
    min_coverage_percent: int = _setting(50, _int(0, 100))

    def recall_limits(self):
        from hmpnode.memory.recall import RecallLimits

        return RecallLimits(candidates=self.candidates, max_scan=self.max_scan,
                            min_coverage=self.min_coverage_percent / 100)


@dataclass(frozen=True, slots=True)
class ConsensusSettings:
    """[consensus]: proposals this agent makes (hmpnode.consensus) and the trust figure (hmpnode.trust)."""

    #: voting window of a new proposal (its ttl) when `propose` names none
    default_ttl_seconds: int = _setting(3600, _int(1, 365 * 86_400))
    #: rules written into a new proposal when `propose` names none
    quorum: int = _setting(2, _int(1, 4096))
    threshold_percent: int = _setting(50, _int(1, 100))
    weighting: str = _setting("equal", _choice("equal", "trust"))
    #: after the deadline, how long the proposer's node waits for votes still in flight before it closes
    close_grace_seconds: int = _setting(10, _int(0, 86_400))
    #: how often the node looks for its proposals to close
    check_seconds: int = _setting(5, _int(1, 3600))
    #: phantom neutral evaluators in the trust figure: how slowly evidence moves it
    trust_damping: int = _setting(3, _int(1, 1000))
    #: votes read per proposal (the rest is not counted); a result references at most 4096
    max_votes: int = _setting(4096, _int(1, 4096))


@dataclass(frozen=True, slots=True)
class InterestsSettings:
    """[interests]: what the agent wants from the mesh (hmpnode.net.interests; docs/protocol.md 33).
    Nothing declared: everything in scope, as before. The API's PUT /v1/interests replaces
    these until they are cleared (`<data_dir>/interests.json`)."""

    #: "selective": broadcasts matching a list below (none listed: all); "everything": all (relays)
    mode: str = _setting("selective", _choice("selective", "everything"))
    classes: tuple[str, ...] = _setting((), _Spec("list", "must list classes of 1..128 printable characters",
                                                  check=_is_entry))
    tags: tuple[str, ...] = _setting((), _Spec("list", "must list tags of 1..128 printable characters",
                                               check=_is_entry))
    senders: tuple[str, ...] = _setting((), _Spec("list", "must list DIDs (did:...) of at most 128 characters",
                                                  check=lambda t: _is_entry(t) and t.startswith("did:")))
    #: tags that are also published as DHT topic records (peers find each other by them)
    topics: tuple[str, ...] = _setting((), _Spec("list", "must list topics of 1..128 printable characters",
                                                 check=_is_entry))
    #: entries per list, ours and what a peer's peer_query may declare
    max_entries: int = _setting(64, _int(1, 1000))
    #: peer_query messages one peer may send per minute (each re-plans what it is sent)
    queries_per_minute: int = _setting(6, _int(1, 600))
    #: peers found by a declared topic's DHT record that the node dials (0: none)
    topic_dials: int = _setting(4, _int(0, 64))

    def declared(self) -> Interests:
        """What the agent declared (hmpnode.net.interests)."""
        from hmpnode.net.interests import Interests

        return Interests(self.mode, self.classes, self.tags, self.senders, self.topics)


@dataclass(frozen=True, slots=True)
class DeltaSettings:
    """[delta]: container_delta `modified`/`removed` this node sends (hmpnode.net.delta.DeltaLimits)."""

    #: changes of one container within this window go out as one entry
    flush_ms: int = _setting(1000, _int(50, 60_000))
    #: entries (modified + removed) sent per second node-wide, and how many may be saved up
    entries_per_second: int = _setting(500, _int(1, 1_000_000))
    burst: int = _setting(2000, _int(1, 10_000_000))
    #: entries per flush, so per message to one peer (a receiver takes at most 1000 of each kind)
    max_batch: int = _setting(1000, _int(1, 1000))
    #: containers waiting to be announced; changes beyond are dropped (counted: delta_dropped)
    max_pending: int = _setting(20_000, _int(1, 10_000_000))

    def delta_limits(self) -> DeltaLimits:
        """The delta queue's limits (hmpnode.net.deltaplan), in seconds."""
        from hmpnode.net.deltaplan import DeltaLimits

        return DeltaLimits(flush_seconds=self.flush_ms / 1000, entries_per_second=self.entries_per_second,
                           burst=self.burst, max_batch=self.max_batch, max_pending=self.max_pending)


_SECTIONS: dict[str, type] = {
    "node": NodeSettings,
    "identity": IdentitySettings,
    "api": ApiSettings,
    "limits": LimitsSettings,
    "store": StoreSettings,
    "peer": PeerSettings,
    "relay": RelaySettings,
    "recall": RecallSettings,
    "consensus": ConsensusSettings,
    "interests": InterestsSettings,
    "delta": DeltaSettings,
}


def _section_dict(section: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(section):
        value = getattr(section, f.name)
        if isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, Path):
            value = str(value)
        elif value is None:  # an optional path left unset
            value = ""
        out[f.name] = value
    return out


@dataclass(frozen=True, slots=True)
class Settings:
    data_dir: Path
    node: NodeSettings = field(default_factory=NodeSettings)
    identity: IdentitySettings = field(default_factory=IdentitySettings)
    api: ApiSettings = field(default_factory=ApiSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    store: StoreSettings = field(default_factory=StoreSettings)
    peer: PeerSettings = field(default_factory=PeerSettings)
    relay: RelaySettings = field(default_factory=RelaySettings)
    recall: RecallSettings = field(default_factory=RecallSettings)
    consensus: ConsensusSettings = field(default_factory=ConsensusSettings)
    interests: InterestsSettings = field(default_factory=InterestsSettings)
    delta: DeltaSettings = field(default_factory=DeltaSettings)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/TOML-ready values: paths as strings, lists, "" for an unset path."""
        out: dict[str, Any] = {"data_dir": str(self.data_dir)}
        for name in _SECTIONS:
            out[name] = _section_dict(getattr(self, name))
        return out

    def shown(self, sources: Mapping[str, str]) -> dict[str, Any]:
        """`hmpnode config show`: each setting's value and where it came from (`sources`, as
        `load_settings` fills them), with secrets masked (`masked`)."""
        out: dict[str, Any] = {}
        for name, values in self.to_dict().items():
            if name == "data_dir":
                continue
            out[name] = {key: {"value": masked(f"{name}.{key}", value), "source": sources.get(f"{name}.{key}", "default")}
                         for key, value in values.items()}
        return out


#: settings whose values `config show` never prints (none holds a secret today: the
#: keystore passphrase lives in a file named by a path, the API token in the data dir)
_SECRET = re.compile(r"(token|secret|password)(?!_file)", re.IGNORECASE)


def masked(setting: str, value: Any) -> Any:
    """`value`, or "***" when `setting` names a secret (and is set)."""
    return "***" if _SECRET.search(setting.rsplit(".", 1)[-1]) and value not in ("", None) else value


_SPECS: dict[str, dict[str, _Spec]] = {
    name: {f.name: f.metadata["spec"] for f in fields(cls)} for name, cls in _SECTIONS.items()
}


def env_var_name(setting: str) -> str:
    """`api.port` -> `HMPNODE_API_PORT`."""
    section, _, key = setting.partition(".")
    return f"{ENV_PREFIX}{section.upper()}_{key.upper()}"


def default_data_dir() -> Path:
    """The platform's per-user data directory (e.g. ~/.local/share/hmpnode)."""
    return Path(platformdirs.user_data_dir("hmpnode", appauthor=False))


# ---------------------------------------------------------------------------
# Conversion.

_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (str, os.PathLike)):
        return json.dumps(os.fspath(value), ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


def _convert(spec: _Spec, raw: Any, *, text: bool, data_dir: Path) -> Any:
    """The typed value of `raw`; `text` for strings still to be parsed (env, flags)."""
    if spec.kind == "auto_int":  # "auto" or an integer lo..hi, as a number or as text
        if isinstance(raw, str) and raw.strip().lower() == "auto":
            return "auto"
        try:
            return _convert(_int(spec.lo, spec.hi), raw, text=isinstance(raw, str), data_dir=data_dir)
        except _Bad:
            raise _Bad(_show(raw)) from None
    if spec.kind == "int":
        if text:
            if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", raw):
                raise _Bad(_show(raw))
            value = int(raw)
        elif isinstance(raw, int) and not isinstance(raw, bool):
            value = raw
        else:
            raise _Bad(_show(raw))
        if not spec.lo <= value <= spec.hi or (spec.check is not None and not spec.check(value)):
            raise _Bad(_show(value))
        return value
    if spec.kind == "bool":
        if text:
            word = raw.strip().lower()
            if word in _TRUE:
                return True
            if word in _FALSE:
                return False
            raise _Bad(_show(raw))
        if isinstance(raw, bool):
            return raw
        raise _Bad(_show(raw))
    if spec.kind in ("str", "choice"):
        if not isinstance(raw, str):
            raise _Bad(_show(raw))
        value = raw.strip()
        if spec.kind == "choice":
            value = value.lower()
            if value not in spec.choices:
                raise _Bad(_show(raw))
        elif spec.check is not None and not spec.check(value):
            raise _Bad(_show(raw))
        return value
    if spec.kind == "path":
        if not isinstance(raw, (str, os.PathLike)):
            raise _Bad(_show(raw))
        value = os.fspath(raw)
        if not isinstance(value, str) or "\x00" in value:
            raise _Bad(_show(raw))
        value = value.strip()
        if not value:
            if spec.optional:
                return None
            raise _Bad(_show(raw))
        return data_dir / Path(value).expanduser()
    if spec.kind == "list":
        if text:
            items = [item.strip() for item in raw.split(",")]
            items = [item for item in items if item]
        elif isinstance(raw, (list, tuple)) and all(isinstance(item, str) for item in raw):
            items = [item.strip() for item in raw]
        else:
            raise _Bad(_show(raw))
        if spec.check is not None and not all(spec.check(item) for item in items):
            raise _Bad(_show(raw if not text else items))
        return tuple(dict.fromkeys(items))  # drop repeats, keep order
    raise AssertionError(spec.kind)


def _value(setting: str, spec: _Spec, raw: Any, source: str, *, text: bool, data_dir: Path) -> Any:
    try:
        return _convert(spec, raw, text=text, data_dir=data_dir)
    except _Bad as bad:
        raise ConfigError(f"{setting} = {bad.shown} (from {source}): {spec.rule}") from None


# ---------------------------------------------------------------------------
# Loading.


def _resolve_data_dir(data_dir: Path | None, env: Mapping[str, str]) -> Path:
    if data_dir is not None:
        raw: Any = data_dir
        source = "the data_dir argument"
    elif DATA_DIR_ENV in env:
        raw = env[DATA_DIR_ENV]
        source = DATA_DIR_ENV
    else:
        return default_data_dir().expanduser().absolute()
    text = os.fspath(raw).strip() if isinstance(raw, (str, os.PathLike)) else None
    if not text or "\x00" in text:
        raise ConfigError(f"data_dir = {_show(raw)} (from {source}): must be a non-empty path")
    return Path(text).expanduser().absolute()


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"invalid TOML in {path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML in {path}: {exc}") from None


def _file_layer(path: Path, data_dir: Path, into: dict[str, tuple[Any, str]]) -> None:
    doc = _read_toml(path)
    source = str(path)
    for section, table in doc.items():
        if section not in _SPECS:
            if isinstance(table, dict):
                raise ConfigError(f"unknown section [{section}] in {source}")
            raise ConfigError(f"unknown setting {section} in {source} (settings belong in a [section])")
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] in {source} must be a table, not {_show(table)}")
        specs = _SPECS[section]
        for key, raw in table.items():
            if key not in specs:
                raise ConfigError(f"unknown setting [{section}] {key} in {source}")
            setting = f"{section}.{key}"
            into[setting] = (_value(setting, specs[key], raw, source, text=False, data_dir=data_dir), source)


def _env_layer(env: Mapping[str, str], data_dir: Path, into: dict[str, tuple[Any, str]]) -> None:
    prefixes = {f"{ENV_PREFIX}{section.upper()}_": section for section in _SPECS}
    for name in sorted(env):
        for prefix, section in prefixes.items():
            if name.startswith(prefix):
                break
        else:
            if name.startswith(ENV_PREFIX) and name not in ENV_NOT_SETTINGS \
                    and not name.startswith(ENV_NOT_SETTING_PREFIXES):
                raise ConfigError(f"unknown setting {name}: no section [{name[len(ENV_PREFIX):].split('_')[0].lower()}] "
                                  f"(settings are {ENV_PREFIX}<SECTION>_<KEY>, sections: {', '.join(_SPECS)})")
            continue  # not a setting (HMPNODE_DATA_DIR, the tests' variables) or another program's
        key = name[len(prefix):].lower()
        specs = _SPECS[section]
        if key not in specs:
            raise ConfigError(f"unknown setting [{section}] {key} (from {name})")
        setting = f"{section}.{key}"
        into[setting] = (_value(setting, specs[key], env[name], name, text=True, data_dir=data_dir), name)


def _override_layer(
    overrides: Mapping[str, Any],
    sources: Mapping[str, str],
    data_dir: Path,
    into: dict[str, tuple[Any, str]],
) -> None:
    for setting, raw in overrides.items():
        source = sources.get(setting, f"override {setting}")
        section, dot, key = setting.partition(".")
        if not dot or section not in _SPECS or key not in _SPECS[section]:
            raise ConfigError(f"unknown setting {setting} (from {source})")
        if raw is None:
            continue
        spec = _SPECS[section][key]
        text = isinstance(raw, str) and spec.kind in ("int", "bool", "list")
        into[setting] = (_value(setting, spec, raw, source, text=text, data_dir=data_dir), source)


def _cross_checks(settings: Settings, origin: Mapping[str, tuple[Any, str]]) -> None:
    def where(setting: str) -> str:
        return origin[setting][1] if setting in origin else "default"

    api, peer = settings.api, settings.peer
    if api.default_list_limit > api.max_list_limit:
        raise ConfigError(
            f"api.default_list_limit = {api.default_list_limit} (from {where('api.default_list_limit')}): "
            f"must not exceed api.max_list_limit = {api.max_list_limit} (from {where('api.max_list_limit')})"
        )
    for name in ("classes", "tags", "senders", "topics"):
        declared = getattr(settings.interests, name)
        if len(declared) > settings.interests.max_entries:
            raise ConfigError(f"interests.{name} (from {where('interests.' + name)}): {len(declared)} entries; at most "
                              f"interests.max_entries = {settings.interests.max_entries}")
    if len(peer.static) > peer.static_max:
        raise ConfigError(f"peer.static (from {where('peer.static')}): {len(peer.static)} entries; at most "
                          f"peer.static_max = {peer.static_max}")
    if len(peer.announce) > MAX_ANNOUNCE:  # the announce travels in one LAN datagram (8 KiB)
        raise ConfigError(f"peer.announce (from {where('peer.announce')}): {len(peer.announce)} entries; at most "
                          f"{MAX_ANNOUNCE}")
    hidden = peer.address_settings().no_announce
    for entry in peer.announce:
        ip = ipaddress.ip_address(_announce_entry(entry).ip)
        if any(ip.version == net.version and ip in net for net in hidden):
            raise ConfigError(f"peer.announce = {entry!r} (from {where('peer.announce')}): inside peer.no_announce "
                              f"(from {where('peer.no_announce')}); it would never be announced")
    wildcard = {"0.0.0.0", "::"}
    if (
        isinstance(api.port, int)
        and api.port != 0
        and api.port == peer.port
        and (api.host == peer.host or api.host in wildcard or peer.host in wildcard)
    ):
        raise ConfigError(
            f"peer.port = {peer.port} (from {where('peer.port')}): "
            f"must differ from api.port = {api.port} (from {where('api.port')}) on the same host"
        )


def load_settings(
    *,
    data_dir: Path | None,
    config_file: Path | None,
    env: Mapping[str, str],
    overrides: Mapping[str, Any],
    override_sources: Mapping[str, str] | None = None,
    sources_out: dict[str, str] | None = None,
) -> Settings:
    """The effective settings (see the module docstring for the layers).

    `data_dir`: the --data-dir flag; None falls back to $HMPNODE_DATA_DIR, then
    `default_data_dir()`. `config_file`: the --config flag; None means
    `<data_dir>/hmpnode.toml` when that exists. `env`: usually `os.environ`.
    `overrides`: dotted keys to values (typed, or strings parsed like the
    environment's). `override_sources`: how errors name each override, e.g.
    `{"node.log_format": "--log-format"}`; default "override node.log_format".
    `sources_out`: filled with where each setting in force came from ("default", the
    config file's path, the variable's name, the flag) for `hmpnode config show`.
    """
    base = _resolve_data_dir(data_dir, env)
    values: dict[str, tuple[Any, str]] = {}

    if config_file is not None:
        path = Path(config_file).expanduser()
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        _file_layer(path, base, values)
    else:
        path = base / CONFIG_FILENAME
        if path.exists():
            _file_layer(path, base, values)

    _env_layer(env, base, values)
    _override_layer(overrides, override_sources or {}, base, values)

    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        given: dict[str, Any] = {}
        for f in fields(cls):
            setting = f"{name}.{f.name}"
            if setting in values:
                given[f.name] = values[setting][0]
            elif isinstance(f.default, Path):  # a built-in default path: relative to the data dir
                given[f.name] = base / f.default
        sections[name] = cls(**given)

    settings = Settings(data_dir=base, **sections)
    _cross_checks(settings, values)
    if sources_out is not None:
        for name, cls in _SECTIONS.items():
            for f in fields(cls):
                setting = f"{name}.{f.name}"
                sources_out[setting] = values[setting][1] if setting in values else "default"
    return settings
