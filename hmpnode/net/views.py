"""What the API shows of the mesh: peers, queues, status and metrics.

Read-only views over the Mesh's state and the store, kept out of the wiring so
that adding a number to /status or /metrics does not touch connection code.
`hmpnode.api.app` serves them (`/v1/peers`, `/v1/mesh/queues`, `/v1/mesh/graph`, `/v1/status`,
`/metrics`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hmpnode.config import KNOWN_ROLES
from hmpnode.net.announce import parse_relay_addr
from hmpnode.container.encoding import format_time
from hmpnode.net.slots import score as slot_score
from hmpnode.net.slots import usage as slot_usage
from hmpnode.store import mesh as ms
from hmpnode.store import records as db

if TYPE_CHECKING:
    from hmpnode.net.host import Host as Mesh

__all__ = ["peers_view", "queues", "status", "metrics", "reachability", "graph", "build_graph", "GraphPeer",
           "GRAPH_MAX_NODES", "LINK_STATES"]


def peers_view(mesh: Mesh) -> list[dict[str, Any]]:
    out = []
    static = mesh.dialer.admission.static  # the static peers' DIDs (hmpnode.net.peers)
    for did, row in sorted(mesh.peers.items()):
        link = mesh.sessions.get(did)
        out.append({
            "did": did, "connected": link is not None, "addresses": row.addresses, "roles": row.roles,
            "mailman": row.mailman, "source": row.source, "static": did in static,
            "last_seen": format_time(db.from_us(row.last_seen_us)),
            "last_contact": format_time(db.from_us(row.last_contact_us)) if row.last_contact_us else None,
            **({"ip": link.ip, "channel": str(link.channel), "initiator": link.initiator, "via": link.via,
                "received": link.session.received, "sent": link.session.sent,
                "score": slot_score(link.session.useful, link.session.strikes.count),
                # what it declared in its peer_query (docs/protocol.md 33); None: everything
                "interests": link.session.interests.to_dict() if link.session.interests else None,
                # broadcasts kept from it on this connection because they match none of those (33.3)
                "interests_withheld": link.session.withheld,
                # the last hole punch with it (docs/protocol.md 34.4): state, attempts, reason
                "punch": mesh.punching.view(did)} if link else {}),
        })
    for did, link in sorted(mesh.sessions.items()):
        if did not in mesh.peers:
            out.append({"did": did, "connected": True, "ip": link.ip, "channel": str(link.channel),
                        "roles": list(link.roles), "via": link.via, "static": did in static,
                        "punch": mesh.punching.view(did)})
    return out


async def queues(mesh: Mesh, limit: int) -> dict[str, Any]:
    """What waits: the agent's outbox and the containers held as a relay (up to `limit` each)."""
    def read(conn):
        return ms.outbox_list(conn, limit), ms.relay_list(conn, limit)

    outbox, relay = await mesh.node.db.read(read)
    return {
        "outbox": [{"did": did, "recipient": recipient, "seq": seq, "tries": tries,
                    "next_attempt": format_time(db.from_us(next_us))}
                   for did, recipient, seq, tries, next_us in outbox],
        "relay": [{"recipient": recipient, "did": did, "seq": seq, "size": size, "sender": sender or None,
                   "until": format_time(db.from_us(until_us)) if 0 < until_us < ms.NEVER_US else None}
                  for recipient, did, seq, size, sender, until_us in relay],
    }


async def status(mesh: Mesh) -> dict[str, Any]:
    def read(conn):
        return ms.outbox_count(conn), ms.relay_counts(conn)

    outbox, relay = await mesh.node.db.read(read)
    return {
        "outbox": outbox, "relay": relay,
        "peer_port": mesh.port, "dht_port": mesh.dht_port or None, "addresses": mesh.addresses,
        "roles": list(mesh.settings.roles), "connected": len(mesh.sessions), "known_peers": len(mesh.peers),
        "counters": dict(mesh.counters), "dht": mesh.dht.stats() if mesh.dht is not None else None,
        "dht_routing": mesh.dht.routing_size() if mesh.dht is not None else None,
        "lan": mesh.lan.stats() if mesh.lan is not None else None,
        "clock_skew": {"max_abs_seconds": round(mesh.skew.max_abs(), 3), "peers": mesh.skew.view()},
        "peers_table": {"size": len(mesh.peers), "cap": mesh.settings.dialing.peers_max},
        "dials": {
            "attempts": mesh.counters["dial_attempts"], "failed": mesh.counters["dial_failed"],
            "failed_rounds": mesh.counters["dial_failed_rounds"],
            "rate_limited": mesh.counters["dial_rate_limited"], "backing_off": len(mesh.dialer.dials),
            "refused": {r: n for (area, r), n in sorted(mesh.node.refusals.items()) if area == "dial"},
            "off_rule": mesh.counters["dial_off_rule"],
        },
        "slots": slot_usage(mesh.slots(), mesh.settings.slots),
        "ledger": mesh.core.ledger.stats(),
        "reachability": reachability(mesh),
        "circuits": mesh.circuits.status(),
    }


def reachability(mesh: Mesh) -> dict[str, Any]:
    """The reachability verdict and its evidence (hmpnode.net.reach; docs/protocol.md 34.1, 34.2)."""
    reach = mesh.reach
    return {"verdict": reach.verdict, "public_addresses": reach.public_ips(),
            "confirmed_addresses": reach.confirmed_addresses(), "port_preserving": reach.port_preserving(),
            "evidence": reach.evidence()}


async def metrics(mesh: Mesh) -> dict[str, Any]:
    """The mesh's numbers for /metrics (hmpnode.api.metrics.render): sessions by
    direction and by the peer's role (roles outside KNOWN_ROLES count as "other":
    a peer names them, the label set stays bounded), the relay queue, the outbox
    and its oldest entry, what interests kept from peers, the DHT and LAN discovery."""
    def read(conn):
        return ms.relay_usage(conn), ms.outbox_backlog(conn), ms.provide_count(conn)

    (relay_items, relay_bytes), (outbox_items, outbox_oldest_us), provides = await mesh.node.db.read(read)
    live = [s for s in mesh.sessions.values() if not s.closed]
    roles = Counter(r if r in KNOWN_ROLES else "other" for s in live for r in set(s.roles))
    dht = mesh.dht.stats() if mesh.dht is not None else None
    lan = mesh.lan.counters if mesh.lan is not None else None
    return {
        "peers_known": len(mesh.peers),
        "sessions": Counter("outbound" if s.initiator else "inbound" for s in live),
        "session_roles": {r: roles[r] for r in (*KNOWN_ROLES, "other")},
        "relay": {"items": relay_items, "bytes": relay_bytes},
        # acknowledgement deadlines on live connections (docs/protocol.md 22.2, 24.2)
        "deadlines": {k: mesh.counters[k] for k in ("relay_reoffered", "requests_expired", "requests_omitted",
                                                     "relay_expired_connected", "outbox_woken")},
        # broadcasts kept from peers that declared other interests, once per connection (33.3)
        "interests_withheld": mesh.counters["interests_filtered"],
        "outbox": {"items": outbox_items, "oldest_age_seconds":
                   max(0.0, (mesh.node.now_us() - outbox_oldest_us) / 1e6) if outbox_oldest_us else 0.0},
        "dht": None if dht is None else {
            "routing_table_size": dht["routing_size"], "records_held": dht.get("stored_records", 0),
            "records_held_bytes": dht.get("stored_bytes", 0), "provides": provides,
            "provides_published": mesh.counters["dht_provided"], "peer_records_published": mesh.counters["dht_published"],
        },
        "reachability": {
            "verdict": mesh.reach.verdict,
            **{k: mesh.counters[f"dialback_{k}"] for k in ("asked", "arrived", "failed", "served", "unasked")},
            "refused": {k[len("dialback_refused_"):]: n for k, n in mesh.counters.items()
                        if k.startswith("dialback_refused_")},
        },
        "lan": None if lan is None else {
            "sent": lan["sent_multicast"] + lan["sent_broadcast"], "received": lan["received"],
            "accepted": mesh.counters["lan_announces"],
            "refused": sum(n for (area, _), n in mesh.node.refusals.items() if area == "lan"),
            "peers": len(mesh.lan.peers()),
        },
    }


# -- the mesh as a graph (the dashboard's picture) ----------------------------------------------

#: most nodes `GET /v1/mesh/graph` returns (its `limit` may ask for fewer); more are left out,
#: least close first, and the answer says `truncated`
GRAPH_MAX_NODES = 200
#: link states, closest first: a session; a dial under way; a ban in force (a DID or an address);
#: a row of our peers table without a connection; a peer's announce names the other end as its
#: mailman or as the circuit relay that holds a reservation for it
LINK_STATES = ("connected", "dialling", "banned", "known", "reported")


@dataclass(frozen=True, slots=True)
class GraphPeer:
    """What the node knows of one peer for the graph: its announce's roles and what it reports
    (its mailmen, the relays of its relay:// addresses); `via` the circuit relay of a session."""

    did: str
    roles: Sequence[str] = ()
    mailman: Sequence[str] = ()
    addresses: Sequence[str] = ()
    via: str | None = None
    last_seen_us: int = 0


def _label(key: str) -> str:
    return "…" + key[-8:] if key.startswith("did:") else key


def _reported(peer: GraphPeer) -> list[str]:
    """The DIDs a peer's announce names: its mailmen, then its circuit relays."""
    relays = []
    for addr in peer.addresses:
        if addr.startswith("relay://"):
            try:
                relays.append(parse_relay_addr(addr)[2])
            except ValueError:
                continue
    return list(dict.fromkeys([*peer.mailman, *relays]))


def build_graph(own: GraphPeer, own_roles: Sequence[str], *, connected: Iterable[GraphPeer],
                table: Iterable[GraphPeer], dialling: Iterable[str], banned: Iterable[str],
                limit: int = GRAPH_MAX_NODES) -> dict[str, Any]:
    """Nodes and links (sans-IO): this node (ring 0); the peers it is connected to, dialling or
    has banned (ring 1); the rest of its peers table and the peers those report (ring 2). At
    most `limit` nodes, closest first (each group in DID order, the table's most recently seen
    first); a link is kept when both its ends are."""
    sessions = {p.did: p for p in connected}
    rows = {p.did: p for p in table}
    known = {**rows, **sessions, own.did: own}
    nodes: dict[str, dict[str, Any]] = {}
    links: list[dict[str, Any]] = []
    wanted: set[str] = set()

    def add(key: str, ring: int) -> bool:
        wanted.add(key)
        if key not in nodes and len(nodes) < limit:
            peer = known.get(key)
            nodes[key] = {"id": key, "did": key if key.startswith("did:") else None, "label": _label(key),
                          "ring": ring, "roles": sorted(set(peer.roles if peer else ()))}
        return key in nodes

    add(own.did, 0)
    nodes[own.did].update(roles=sorted(set(own_roles)), self=True)
    linked: dict[str, str] = {}  # ring 1: each peer once, in its closest state
    for state, keys in (("connected", sessions), ("dialling", dialling), ("banned", banned)):
        for key in sorted(set(keys) - {own.did}):
            linked.setdefault(key, state)
    for key, state in linked.items():
        if add(key, 1):
            via = sessions[key].via if key in sessions else None
            links.append({"from": own.did, "to": key, "state": state, **({"via": via} if via else {})})
    by_recency = sorted((d for d in rows if d not in sessions), key=lambda d: (-rows[d].last_seen_us, d))
    for did in [own.did, *sorted(sessions), *by_recency]:  # each peer, and the peers it reports
        if did not in linked and did != own.did and add(did, 2):
            links.append({"from": own.did, "to": did, "state": "known"})
        for other in _reported(known[did]) if did in nodes else ():
            if other != did and add(other, 2) and not (did == own.did and other in linked):
                links.append({"from": did, "to": other, "state": "reported"})
    for link in links:
        if link.get("via") not in nodes:
            link.pop("via", None)
    for did in own.mailman:
        if did in nodes:
            nodes[did]["our_mailman"] = True
    return {"nodes": list(nodes.values()), "links": links, "states": list(LINK_STATES),
            "limit": limit, "truncated": len(wanted) > len(nodes), "omitted": len(wanted) - len(nodes)}


def graph(mesh: Mesh, limit: int = GRAPH_MAX_NODES) -> dict[str, Any]:
    """The mesh as this node knows it (`build_graph`), from its sessions, peers table, dials
    under way and ban list."""
    mono = time.monotonic()
    bans = mesh.admission.bans
    banned = [key for key in list(bans.until) if bans.banned(key, mono)]
    live = [GraphPeer(link.did, link.roles, link.info.announce.mailman, link.info.announce.addresses, link.via)
            for link in mesh.sessions.values() if not link.closed]
    table = [GraphPeer(row.did, row.roles, row.mailman, row.addresses, last_seen_us=row.last_seen_us)
             for row in mesh.peers.values()]
    own = GraphPeer(mesh.identity.did, mailman=mesh.mailman())
    out = build_graph(own, mesh.settings.roles, connected=live, table=table, dialling=mesh.dialer.dialing,
                      banned=banned, limit=limit)
    out["dht_contacts"] = mesh.dht.routing_size() if mesh.dht is not None else None
    return out
