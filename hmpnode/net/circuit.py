"""A circuit relay's bookkeeping (docs/protocol.md 34.3), sans-IO: reservations and circuits.

A node with the role `circuit` lets nodes that cannot be dialled (behind a NAT) hold a
*reservation*: while it lasts, a dialer may ask the relay for a *circuit* to the reserving
node, the relay tells that node a one-time token over their session, the node comes to
accept it, and the relay splices the two WebSockets (the driver: hmpnode.net.circuits).
Everything here is counted and capped so that a flood of reservations or circuits costs
the relay a bounded amount of memory:

- reservations: at most `max_reservations` in all and `max_reservations_per_ip` per
  address of the reserving connection; each lasts `reservation_seconds`, a new
  `reserve` renews it;
- circuits (pending ones included): at most `max_circuits` in all and
  `max_circuits_per_reservation` to one reserving node; a pending one expires after
  `accept_seconds` when the reserving node does not come; an open one lasts at most
  `circuit_seconds` and carries at most `circuit_bytes` (both directions together).

Time (`now`, monotonic seconds) and the token source (`rng`) are passed in; the refusal
codes (`REFUSALS`) are stable: they go on the wire.
"""

from __future__ import annotations

import ipaddress
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = ["CircuitLimits", "CircuitRelay", "Reservation", "Circuit", "REFUSALS", "TOKEN_HEX", "hello", "parse_hello"]

#: refusal code -> what it means (the `reason` of `reserved`, the `error` of an HTTP refusal)
REFUSALS = {
    "not_a_circuit_relay": "this node does not have the role circuit",
    "reservation_limit": "the relay holds as many reservations as it takes",
    "address_limit": "the relay holds as many reservations from this address as it takes",
    "no_reservation": "no live reservation for that node",
    "circuit_limit": "that node has as many circuits as its reservation allows",
    "relay_busy": "the relay carries as many circuits as it takes",
    "expired": "no such pending circuit (unknown, already taken, or not accepted in time)",
    "malformed": "the request does not say which node (to=<did>) or which circuit (accept=<token>)",
}
#: hex digits of a circuit token (128 bits: it is the only credential of an accept)
TOKEN_HEX = 32


@dataclass(frozen=True, slots=True)
class CircuitLimits:
    """The relay's caps and the reserving side's choices ([peer] circuit_*; built once by
    hmpnode.config.PeerSettings.circuit_limits). libp2p's defaults are 128 reservations,
    4 per IP, circuits of 2 minutes and 128 KiB: enough for its hole-punch coordination.
    Ours carry whole sessions (catch-up, containers up to 16 MiB) for as long as no punch
    moves them, so a circuit may last longer and carry more; a relay that ends one only
    makes the two nodes open another."""

    max_reservations: int = 128
    max_reservations_per_ip: int = 4
    reservation_seconds: float = 3600.0
    max_circuits: int = 64
    max_circuits_per_reservation: int = 16
    circuit_seconds: float = 1800.0
    circuit_bytes: int = 64 * 1024 * 1024
    #: a pending circuit not accepted by the reserving node within this long is dropped
    accept_seconds: float = 5.0
    #: the reserving side: "auto" (when reachability is not "public"), "always" or "never"
    reserve: str = "auto"
    #: relays one node holds reservations on at most
    relays: int = 2


@dataclass(slots=True)
class Reservation:
    did: str
    ip: str
    expires: float
    #: circuits (pending and open) to this node
    circuits: int = 0


@dataclass(slots=True)
class Circuit:
    token: str
    to: str
    #: pending until `accept` (then `deadline` is the end of its duration)
    deadline: float
    pending: bool = True
    bytes: int = 0


@dataclass
class CircuitRelay:
    """The relay's reservations and circuits (the module docstring)."""

    limits: CircuitLimits
    rng: random.Random
    counters: Counter[str] = field(default_factory=Counter)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    circuits: dict[str, Circuit] = field(default_factory=dict)

    # -- reservations -----------------------------------------------------------------------

    def reserve(self, did: str, ip: str, now: float) -> tuple[float | None, str | None]:
        """(seconds the reservation lasts, None) or (None, refusal code). A node that holds one
        renews it (even from another address: its session moved)."""
        self.expire(now)
        lim = self.limits
        held = self.reservations.get(did)
        if held is None:
            if len(self.reservations) >= lim.max_reservations:
                return self.refused("reservation_limit")
            if sum(1 for r in self.reservations.values() if r.ip == ip) >= lim.max_reservations_per_ip:
                return self.refused("address_limit")
            held = self.reservations[did] = Reservation(did, ip, 0.0)
            self.counters["circuit_reservations_made"] += 1
        else:
            held.ip = ip
            self.counters["circuit_reservations_renewed"] += 1
        held.expires = now + lim.reservation_seconds
        return lim.reservation_seconds, None

    def drop(self, did: str) -> None:
        """The reserving node's session ended: its reservation goes (its circuits run on)."""
        self.reservations.pop(did, None)

    def keep_only(self, live: set[str]) -> None:
        """Drop the reservations of nodes that have no session with the relay any more."""
        for did in [d for d in self.reservations if d not in live]:
            self.drop(did)
            self.counters["circuit_reservations_dropped"] += 1

    # -- circuits ---------------------------------------------------------------------------

    def open(self, to: str, now: float) -> tuple[Circuit | None, str | None]:
        """A dialer asks for a circuit to `to`: a pending circuit (its token goes to `to`), or
        (None, refusal code)."""
        self.expire(now)
        held = self.reservations.get(to)
        if held is None:
            return self.refused("no_reservation")
        if held.circuits >= self.limits.max_circuits_per_reservation:
            return self.refused("circuit_limit")
        if len(self.circuits) >= self.limits.max_circuits:
            return self.refused("relay_busy")
        token = f"{self.rng.getrandbits(4 * TOKEN_HEX):0{TOKEN_HEX}x}"
        circuit = self.circuits[token] = Circuit(token, to, now + self.limits.accept_seconds)
        held.circuits += 1
        self.counters["circuit_opened"] += 1
        return circuit, None

    def accept(self, token: str, now: float) -> tuple[Circuit | None, str | None]:
        """The reserving node came with `token`: the circuit, now open for `circuit_seconds`,
        or (None, "expired") for a token that is unknown, taken or too late."""
        self.expire(now)
        circuit = self.circuits.get(token) if isinstance(token, str) else None
        if circuit is None or not circuit.pending:
            return self.refused("expired")
        circuit.pending = False
        circuit.deadline = now + self.limits.circuit_seconds
        self.counters["circuit_accepted"] += 1
        return circuit, None

    def carry(self, circuit: Circuit, size: int) -> bool:
        """May `size` more bytes cross `circuit`? False: over its byte limit (close it)."""
        if circuit.bytes + size > self.limits.circuit_bytes:
            self.counters["circuit_cut_bytes"] += 1
            return False
        circuit.bytes += size
        self.counters["circuit_bytes"] += size
        return True

    def close(self, circuit: Circuit) -> None:
        """The circuit ended (either side closed, a limit, or it was never accepted)."""
        if self.circuits.pop(circuit.token, None) is None:
            return
        held = self.reservations.get(circuit.to)
        if held is not None:
            held.circuits = max(0, held.circuits - 1)
        self.counters["circuit_closed"] += 1

    def expire(self, now: float) -> list[Circuit]:
        """Drop expired reservations and pending circuits; the open circuits past their
        duration (the driver closes their sockets, then `close`)."""
        for did in [d for d, r in self.reservations.items() if r.expires <= now]:
            del self.reservations[did]
            self.counters["circuit_reservations_expired"] += 1
        late = []
        for circuit in [c for c in self.circuits.values() if c.deadline <= now]:
            if circuit.pending:
                self.close(circuit)
                self.counters["circuit_accept_expired"] += 1
            else:
                late.append(circuit)
        return late

    def refused(self, reason: str) -> tuple[None, str]:
        self.counters[f"circuit_refused_{reason}"] += 1
        return None, reason

    def status(self) -> dict[str, Any]:
        """For /v1/status "circuits"."""
        lim = self.limits
        return {
            "reservations": len(self.reservations), "max_reservations": lim.max_reservations,
            "max_reservations_per_ip": lim.max_reservations_per_ip,
            "circuits": sum(1 for c in self.circuits.values() if not c.pending),
            "pending": sum(1 for c in self.circuits.values() if c.pending), "max_circuits": lim.max_circuits,
            "max_circuits_per_reservation": lim.max_circuits_per_reservation,
            "circuit_seconds": lim.circuit_seconds, "circuit_bytes": lim.circuit_bytes,
            "bytes": self.counters["circuit_bytes"], "opened": self.counters["circuit_opened"],
            "cut_bytes": self.counters["circuit_cut_bytes"], "cut_seconds": self.counters["circuit_cut_seconds"],
            "refused": {k.removeprefix("circuit_refused_"): n for k, n in sorted(self.counters.items())
                        if k.startswith("circuit_refused_")},
        }


def hello(peer_ip: str) -> str:
    """The relay's first message on each end of a spliced circuit (a text message, before
    the binary ones): the IP it sees the other end at (docs/protocol.md 34.3). A hole punch
    (34.4) dials only IPs someone it trusts vouched for: this is the relay vouching."""
    return orjson.dumps({"peer_ip": peer_ip}).decode()


def parse_hello(text: Any) -> str | None:
    """The IP of a relay's `hello`, or None when `text` is not one."""
    if not isinstance(text, str) or len(text) > 256:
        return None
    try:
        ip = orjson.loads(text)["peer_ip"]
        return str(ipaddress.ip_address(ip)) if isinstance(ip, str) else None
    except (orjson.JSONDecodeError, TypeError, KeyError, ValueError):
        return None
