"""What the mesh runs with: `MeshSettings` (the node's facts and one frozen limits object
per area) and `MeshLimits` (what spans connections). Below every mesh module, so that
the driver, the simulator and the config read them without importing the driver."""

from __future__ import annotations

from dataclasses import dataclass

from hmpnode.net import dialing as D
from hmpnode.net.circuit import CircuitLimits
from hmpnode.net.addresses import AddressSettings
from hmpnode.net.announce import DEFAULT_MIN_DIFFICULTY
from hmpnode.net.deltaplan import DeltaLimits
from hmpnode.net.dht import DhtLimits
from hmpnode.net.interests import Interests
from hmpnode.net.lan import LanSettings
from hmpnode.net.reach import DialbackLimits
from hmpnode.net.punch import PunchLimits
from hmpnode.net.relayquota import RelayLimits
from hmpnode.net.session import SessionLimits
from hmpnode.net.slots import SlotLimits
from hmpnode.serving import DEFAULT_IDLE_CONNECTION_SECONDS

__all__ = ["MeshLimits", "MeshSettings", "DialbackLimits"]


@dataclass(frozen=True, slots=True)
class MeshLimits:
    """The mesh's node-wide limits: what spans connections (the core's forward plan, ledger
    and outbox; admission; catch-up snapshots; mesh-wide queries). Declared here only;
    hmpnode.config.PeerSettings.mesh_limits builds them from [peer] once."""

    #: peers a broadcast container is pushed to (the others get an announcement)
    fanout: int = 4
    #: how long a broadcast's announcements wait after its pushes (MeshCore.announce)
    announce_delay_seconds: float = 0.2
    #: who-has-what entries (hmpnode.net.ledger) one connection may fill, and all of them together
    ledger_session_entries: int = 20_000
    ledger_max_entries: int = 400_000
    #: a directed container handed to a peer and not acknowledged within this long is sent again
    ack_timeout: float = 30.0
    #: the outbox's back-off (core.retry_at): base seconds doubled per try, at most retry_max
    retry_base: float = 1.0
    retry_max: float = 300.0
    #: how long a peer cut off (or an address over its DID churn) stays banned
    ban_seconds: float = 600.0
    #: distinct DIDs one (non-loopback) address may present within did_window_seconds before it is banned
    max_dids_per_address: int = 16
    did_window_seconds: float = 600.0
    #: seconds a handshake may take
    handshake_timeout: float = 10.0
    #: a stale node-wide snapshot is rebuilt only when at least this old (one rebuild of
    #: 100 000 items costs ~0.5 s of CPU; what arrives meanwhile travels by gossip)
    sync_snapshot_seconds: float = 5.0
    #: a responder's reconciliation left unanswered this long is dropped
    sync_idle_seconds: float = 60.0
    #: a mesh-wide query (versions?mesh=1) asks at most this many connected peers, waiting this long in all
    index_query_peers: int = 8
    index_query_seconds: float = 2.0


@dataclass(frozen=True, slots=True)
class MeshSettings:
    """What the mesh runs with: the node's facts, then one frozen limits object per area,
    each declared in its own module and built once from its config section
    (hmpnode.daemon.mesh_settings; tests/test_config.py checks no limit is declared twice)."""

    host: str = "127.0.0.1"
    port: int = 0
    roles: tuple[str, ...] = ()
    name: str = ""
    interests: tuple[str, ...] = ()
    #: DIDs of relays that hold containers for this agent, besides connected relays
    mailman: tuple[str, ...] = ()
    min_difficulty: int = DEFAULT_MIN_DIFFICULTY
    #: DIDs that always get a slot and are never evicted; CIDRs whose peers are treated alike
    pinned: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()
    #: seconds a peer connection may stay open with no request in progress ([node])
    idle_connection_seconds: float = DEFAULT_IDLE_CONNECTION_SECONDS
    #: the DHT (UDP, on dht_port; 0: any) and where it bootstraps from
    dht: bool = True
    dht_port: int = 0
    bootstrap: tuple[tuple[str, int], ...] = ()
    #: what the agent declared in [interests] (<data_dir>/interests.json, written by the API, wins)
    declared: Interests = Interests()
    mesh: MeshLimits = MeshLimits()
    #: per connection (hmpnode.net.session)
    session: SessionLimits = SessionLimits()
    #: the relay role's quotas (hmpnode.net.relayquota)
    relay: RelayLimits = RelayLimits()
    #: container_delta `modified`/`removed` (hmpnode.net.deltaplan; docs/protocol.md 32)
    delta: DeltaLimits = DeltaLimits()
    #: peer slots (hmpnode.net.slots; docs/protocol.md 21.4)
    slots: SlotLimits = SlotLimits()
    #: dialing and the peers table (hmpnode.net.dialing; docs/protocol.md 20.6)
    dialing: D.DialLimits = D.DialLimits()
    #: the DHT's bounds (hmpnode.net.dht, its store: hmpnode.net.dhtrecords)
    dht_limits: DhtLimits = DhtLimits()
    #: LAN discovery (hmpnode.net.lan; `enabled`)
    lan: LanSettings = LanSettings()
    #: observed addresses and dial-back (hmpnode.net.reach; docs/protocol.md 34.1, 34.2)
    dialback: DialbackLimits = DialbackLimits()
    #: circuit relays: the relay's caps and the reserving side's choices (hmpnode.net.circuit; docs/protocol.md 34.3)
    circuit: CircuitLimits = CircuitLimits()
    #: what the node announces, its static peers (hmpnode.net.addresses)
    addresses: AddressSettings = AddressSettings()
    #: hole punching (hmpnode.net.punch; docs/protocol.md 34.4)
    punch: PunchLimits = PunchLimits()
