"""What the node-wide jobs (`gossip`, `delta`, `peers`, `provide`, `views`, `indexquery`,
`ourinterests`) use of the node's driver.

A Protocol, so that they type against it and never import the driver
(`hmpnode.net.mesh.Mesh`, which builds and starts them): imports run one way, and
each job says here what it reads of the node. Everything named is public; the state
behind it has one owner (the driver, the core, or the job's own class).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hmpnode.net.core import MeshCore
    from hmpnode.net.deltaplan import DeltaQueue
    from hmpnode.net.dialing import Origin
    from hmpnode.net.drive import World
    from hmpnode.net.link import Link
    from hmpnode.net.session import SessionEvent
    from hmpnode.net.settings import MeshSettings
    from hmpnode.net.skew import SkewEstimates
    from hmpnode.net.slots import Slot
    from hmpnode.store import mesh as ms

__all__ = ["Host"]


class Host(Protocol):
    """The node's driver as its jobs see it."""

    #: the hmpnode.node.Node (store, clock, registry, refusals)
    node: Any
    identity: Any
    settings: MeshSettings
    counters: Counter[str]
    #: the connected peers (DID -> link) and the peers table (DID -> row): the core's
    sessions: dict[str, Link]
    peers: dict[str, ms.PeerRow]
    core: MeshCore
    world: World
    #: the DHT and LAN discovery, None when off
    dht: Any
    lan: Any
    #: container_delta modified/removed waiting for the next flush
    delta: DeltaQueue
    #: our listening ports and the addresses we announce
    port: int
    dht_port: int
    addresses: list[str]
    #: the peers table's owner and the dial budget (hmpnode.net.peers.Peers, which types against this)
    dialer: Any
    #: each peer's clock offset
    skew: SkewEstimates
    #: what peers see us at, what dial-backs confirmed (hmpnode.net.reach.Reachability)
    reach: Any
    #: circuit relays, both sides (hmpnode.net.circuits.Circuits)
    circuits: Any
    #: what we publish in the DHT (hmpnode.net.provide.Publisher)
    publisher: Any
    #: hole punching (hmpnode.net.punching.Punching): each peer's last punch
    punching: Any

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task: ...

    async def drive(self, link: Link, events: Sequence[SessionEvent]) -> None: ...

    async def dial(self, addr: str, expect_did: str | None = None, *, origin: Origin,
                   require_did: bool = False) -> Link | None: ...

    def mailman(self) -> list[str]: ...

    def announced_addresses(self) -> list[str]: ...

    def slots(self) -> list[Slot]: ...
