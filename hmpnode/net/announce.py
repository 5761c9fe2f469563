"""`peer_announce` discovery records (HMP profile sections 4 and 10; spec 4.1-4.7).

Pure functions: no sockets, no clock reads (`now` is a parameter).

Address record (one per entry of `payload.addresses`)::

    {"addr": "tcp://host:port", "nonce": 1234, "pow_hash": "000a...", "difficulty": 3}

    pow_hash   = sha256_hex(DID + " -- " + addr + " -- " + str(nonce))   (UTF-8, lowercase hex)
    difficulty = number of leading "0" hex digits of pow_hash

The DID is the announce's `sender_did`, so a record copied into another
agent's announce no longer hashes to its `pow_hash` (`pow_mismatch`).

`addr` schemes (`parse_addr`): `tcp://host:port` is the node's peer endpoint
(HTTP/1.1 and WebSocket on that port), `udp://host:port` its Kademlia DHT port,
`relay://host:port/<relay DID>` a circuit relay that holds a reservation for the
node (docs/protocol.md 34.3: dial the relay's peer port, ask for a circuit).
Hosts are DNS names, dotted IPv4 or bracketed IPv6; ports 1..65535. Anything
else (other schemes, paths but the relay's DID, user info, zone ids) raises ValueError.

Difficulty default: `DEFAULT_MIN_DIFFICULTY = 3` hex digits, i.e. 16**3 = 4096
hashes expected per address: a few milliseconds, so a node starts in well under
a second, while mass-minting addresses still costs something. Nodes may demand
more (`min_difficulty`); `MAX_NONCE_TRIES` (2**20, about a second of hashing)
bounds the search: at difficulty 3 it fails with probability ~e**-256.

Refused by `check_peer_announce` (reason codes):

- `unverified`       the container did not verify (the Verifier's reason is in `detail`)
- `wrong_class`      class is not `peer_announce`
- `unreadable`       the payload cannot be read without a key (encrypted) or does not open
- `bad_payload`      the payload is not an object of the announce shape
- `expired`          past its `ttl` at `now` (a revocation never expires)
- `no_valid_address` no address record survives the checks, and it is not a revocation

Invalid address records are dropped one by one (`AnnounceCheck.dropped` lists
their index and reason: `malformed`, `pow_mismatch`, `pow_too_weak`). A payload
with `key_is_falsified: true` is a revocation of the sender DID (profile section
4): `revoked=True`, and it needs no address.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hmpnode.container.build import build_container
from hmpnode.container.encoding import EncodingError, parse_time
from hmpnode.container.payload import PayloadError, open_payload
from hmpnode.container.verify import VerifyResult
from hmpnode.identity.keys import Identity

__all__ = [
    "ANNOUNCE_CLASS",
    "DEFAULT_MIN_DIFFICULTY",
    "MAX_NONCE_TRIES",
    "MAX_NONCE",
    "SCHEMES",
    "AnnounceCheck",
    "pow_hash",
    "leading_zeros",
    "make_address_record",
    "check_address_record",
    "parse_addr",
    "url_host",
    "relay_addr",
    "parse_relay_addr",
    "build_peer_announce",
    "check_peer_announce",
    "newer_announce",
    "OwnAnnounce",
]

ANNOUNCE_CLASS = "peer_announce"
#: 3 leading zero hex digits: 4096 hashes expected, a few ms per address.
DEFAULT_MIN_DIFFICULTY = 3
#: Bound on the nonce search of `make_address_record` (about a second of hashing).
MAX_NONCE_TRIES = 1 << 20
#: Largest nonce (JSON-safe integer, as the class schema says).
MAX_NONCE = 2**53 - 1
#: addr scheme -> what listens there.
SCHEMES = {"tcp": "peer endpoint (HTTP/1.1 + WebSocket)", "udp": "Kademlia DHT",
           "relay": "a circuit relay's peer endpoint, then its DID"}

_MAX_ADDR_LEN = 1024
_HEX64 = re.compile(r"[0-9a-f]{64}")
_SEP = " -- "


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # never raises on odd input


def pow_hash(did: str, addr: str, nonce: int) -> str:
    """sha256_hex(DID + " -- " + addr + " -- " + str(nonce))."""
    return hashlib.sha256(_bytes(did + _SEP + addr + _SEP + str(nonce))).hexdigest()


def leading_zeros(hex_digest: str) -> int:
    """Number of leading `0` hex digits."""
    return len(hex_digest) - len(hex_digest.lstrip("0"))


def _check_difficulty(value: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 64:
        raise ValueError(f"{what} must be an int in 0..64")


def make_address_record(
    did: str,
    addr: str,
    *,
    difficulty: int = DEFAULT_MIN_DIFFICULTY,
    start_nonce: int = 0,
    max_tries: int = MAX_NONCE_TRIES,
) -> dict[str, Any]:
    """Find the first nonce >= start_nonce whose hash has `difficulty` leading zeros.

    Deterministic given `start_nonce` (pass a random start for unpredictable
    nonces). The record's `difficulty` is the hash's actual count (>= the one
    asked for). Raises ValueError when none is found within `max_tries`."""
    _check_difficulty(difficulty, "difficulty")
    if not isinstance(addr, str) or not 1 <= len(addr) <= _MAX_ADDR_LEN:
        raise ValueError(f"addr must be a string of 1..{_MAX_ADDR_LEN} characters")
    if isinstance(start_nonce, bool) or not isinstance(start_nonce, int) or not 0 <= start_nonce <= MAX_NONCE:
        raise ValueError(f"start_nonce must be an int in 0..{MAX_NONCE}")
    base = hashlib.sha256(_bytes(did + _SEP + addr + _SEP))
    target = "0" * difficulty
    stop = min(start_nonce + max(max_tries, 0), MAX_NONCE + 1)
    for nonce in range(start_nonce, stop):
        h = base.copy()
        h.update(str(nonce).encode("ascii"))
        digest = h.hexdigest()
        if digest.startswith(target):
            return {"addr": addr, "nonce": nonce, "pow_hash": digest, "difficulty": leading_zeros(digest)}
    raise ValueError(f"no nonce with difficulty {difficulty} in {stop - start_nonce} tries from {start_nonce}")


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def check_address_record(did: str, record: Any, *, min_difficulty: int) -> str | None:
    """None when `record` is a valid address record of `did`, else a reason:
    `malformed`, `pow_mismatch` or `pow_too_weak`. Never raises on the record."""
    _check_difficulty(min_difficulty, "min_difficulty")
    if not isinstance(record, dict):
        return "malformed"
    addr = record.get("addr")
    nonce = record.get("nonce")
    claimed_hash = record.get("pow_hash")
    claimed = record.get("difficulty")
    if (
        not isinstance(addr, str)
        or not 1 <= len(addr) <= _MAX_ADDR_LEN
        or not _is_int(nonce, 0, MAX_NONCE)
        or not isinstance(claimed_hash, str)
        or _HEX64.fullmatch(claimed_hash) is None
        or not _is_int(claimed, 0, 64)
    ):
        return "malformed"
    actual = pow_hash(did, addr, nonce)
    if actual != claimed_hash:
        return "pow_mismatch"
    if leading_zeros(actual) < claimed or claimed < min_difficulty:
        return "pow_too_weak"
    return None


_ADDR = re.compile(r"([a-z]+)://(\[[^\]/]*\]|[^:/\[\]@?#]*):([0-9]+)")
_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)", re.ASCII | re.IGNORECASE)


def outward_first(addrs: Sequence[str]) -> list[str]:
    """`addrs` ordered for a record that may not hold them all (the DHT peer record
    keeps what fits, first ones first): addresses other hosts can dial first, then
    link-local ones, loopback last (only this host can use those, and it finds its
    own nodes through LAN discovery). Order within a rank is kept."""
    def rank(addr: str) -> int:
        try:
            ip = ipaddress.ip_address(parse_addr(addr)[1])
        except ValueError:
            return 0  # a hostname: as dialable as the caller says
        return 2 if ip.is_loopback else 1 if ip.is_link_local else 0

    return sorted(addrs, key=rank)


#: a relay's DID in a `relay://` address (the DID grammar without "/", which ends the host part)
_RELAY_DID = re.compile(r"did:[a-z0-9]+:[!-.0-~]{1,200}")


def url_host(host: str) -> str:
    """`host` as it stands in an address or a URL before `:port`: an IPv6 literal in brackets."""
    return f"[{host}]" if ":" in host else host


def relay_addr(host: str, port: int, relay_did: str) -> str:
    """The relayed address through the relay at host:port with DID `relay_did`."""
    return f"relay://{url_host(host)}:{port}/{relay_did}"


def parse_relay_addr(addr: str) -> tuple[str, int, str]:
    """`relay://host:port/<did>` -> (host, port, relay DID); ValueError otherwise."""
    if not isinstance(addr, str) or not addr.startswith("relay://"):
        raise ValueError("not a relay:// address")
    base, sep, did = addr[len("relay://"):].partition("/")
    if not sep or _RELAY_DID.fullmatch(did) is None:
        raise ValueError(f"a relay:// address ends with /<relay DID>: {addr!r:.80}")
    _scheme, host, port = _parse_host_port("relay://" + base)
    return host, port, did


def parse_addr(addr: str) -> tuple[str, str, int]:
    """`tcp://host:port`, `udp://host:port` or `relay://host:port/<did>` -> (scheme, host, port).

    IPv6 hosts come in brackets and are returned without them. Raises ValueError
    for other schemes, bad hosts, ports outside 1..65535 or any trailing part (but a
    relay's DID: `parse_relay_addr`)."""
    if isinstance(addr, str) and addr.startswith("relay://"):
        host, port, _did = parse_relay_addr(addr)
        return "relay", host, port
    return _parse_host_port(addr)


def _parse_host_port(addr: str) -> tuple[str, str, int]:
    if not isinstance(addr, str):
        raise ValueError("addr must be a string")
    m = _ADDR.fullmatch(addr)
    if m is None:
        raise ValueError(f"not scheme://host:port: {addr!r:.80}")
    scheme, host, port_text = m.groups()
    if scheme not in SCHEMES:
        raise ValueError(f"unsupported addr scheme {scheme!r}")
    if len(port_text) > 5 or port_text.startswith("0") or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"port must be 1..65535: {port_text!r:.20}")
    port = int(port_text)
    if host.startswith("["):
        inner = host[1:-1]
        if "%" in inner:
            raise ValueError("IPv6 zone ids are not allowed")
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            raise ValueError(f"bad IPv6 address {inner!r:.60}") from None
        return scheme, inner, port
    if not host or len(host) > 253:
        raise ValueError("host must be 1..253 characters")
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"bad IPv4 address {host!r:.60}") from None
        return scheme, host, port
    if not all(_LABEL.fullmatch(label) for label in host.split(".")):
        raise ValueError(f"bad host name {host!r:.60}")
    return scheme, host, port


def build_peer_announce(
    identity: Identity,
    *,
    addresses: Sequence[str],
    now: datetime,
    name: str = "",
    interests: Sequence[str] = (),
    expertise: Sequence[str] = (),
    roles: Sequence[str] = (),
    mailman: Sequence[str] = (),
    ttl: datetime | str | None = None,
    difficulty: int = DEFAULT_MIN_DIFFICULTY,
    rng_start: int = 0,
    key_is_falsified: bool = False,
    protocols: Sequence[str] | None = None,
) -> dict[str, Any]:
    """A signed `peer_announce` (full form) with a PoW record per address.

    Every address must pass `parse_addr` (ValueError otherwise). `rng_start` is
    the first nonce tried for each record. `key_is_falsified=True` makes it a
    revocation of `identity.did`. `protocols` (e.g. ["hmp-peer/2"]) lists the peer
    protocol versions the node accepts on its `tcp://` addresses; None leaves the
    member out (which a reader takes as ["hmp-peer/1"])."""
    if isinstance(addresses, str):
        raise ValueError("addresses is a list of strings")
    for addr in addresses:
        parse_addr(addr)
    payload: dict[str, Any] = {
        "name": name,
        "interests": list(interests),
        "expertise": list(expertise),
        "roles": list(roles),
        "mailman": list(mailman),
        "addresses": [
            make_address_record(identity.did, addr, difficulty=difficulty, start_nonce=rng_start)
            for addr in addresses
        ],
    }
    if protocols is not None:
        payload["protocols"] = _protocol_list(protocols)
    if key_is_falsified:
        payload["key_is_falsified"] = True
    return build_container(identity, ANNOUNCE_CLASS, payload, now=now, ttl=ttl)


#: what an announce without `protocols` speaks (written before the member existed)
LEGACY_PROTOCOL = "hmp-peer/1"
MAX_PROTOCOLS = 16


@dataclass(frozen=True, slots=True)
class AnnounceCheck:
    """What a node may take from a verified `peer_announce`."""

    ok: bool
    reason: str | None = None
    detail: str = ""
    did: str | None = None
    #: `addr` of the valid address records, in order, without duplicates
    addresses: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    mailman: tuple[str, ...] = ()
    timestamp: datetime | None = None
    #: `key_is_falsified: true`: the sender DID is revoked (profile section 4)
    revoked: bool = False
    #: (index in payload.addresses, reason) of every dropped address record
    dropped: tuple[tuple[int, str], ...] = ()
    #: peer protocol versions its `tcp://` addresses accept (payload `protocols`; absent:
    #: the v1 of before the member existed; not a list of short strings: none we know)
    protocols: tuple[str, ...] = (LEGACY_PROTOCOL,)


def _protocol_list(value: Sequence[str]) -> list[str]:
    if isinstance(value, str) or not all(isinstance(v, str) and 1 <= len(v) <= 32 for v in value):
        raise ValueError("protocols is a list of strings of 1..32 characters")
    if not 1 <= len(value) <= MAX_PROTOCOLS:
        raise ValueError(f"1..{MAX_PROTOCOLS} protocols")
    return list(value)


def _protocols_of(payload: dict[str, Any]) -> tuple[str, ...]:
    if "protocols" not in payload:
        return (LEGACY_PROTOCOL,)
    value = payload["protocols"]
    if not isinstance(value, list) or len(value) > MAX_PROTOCOLS:
        return ()
    return tuple(v for v in value if isinstance(v, str) and 1 <= len(v) <= 32)


def _refuse(reason: str, detail: str, did: str | None = None, timestamp: datetime | None = None) -> AnnounceCheck:
    return AnnounceCheck(False, reason, detail, did=did, timestamp=timestamp)


def _str_tuple(payload: dict[str, Any], key: str) -> tuple[str, ...] | None:
    value = payload.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return None
    return tuple(value)


def check_peer_announce(verify_result: VerifyResult, *, min_difficulty: int, now: datetime) -> AnnounceCheck:
    """Check a container the Verifier already accepted as a `peer_announce`.

    Never raises on the container; raises ValueError only for a bad `min_difficulty`."""
    _check_difficulty(min_difficulty, "min_difficulty")
    if not verify_result.ok:
        return _refuse("unverified", f"{verify_result.reason}: {verify_result.detail}")
    try:
        hmp = verify_result.container["hmp_container"]  # type: ignore[index]
        head = hmp["head"]
        did = head["sender_did"]
        class_ = head["class"]
        timestamp = parse_time(head["timestamp"])
        ttl = parse_time(head["ttl"]) if "ttl" in head else None
        if not isinstance(did, str):
            raise TypeError("sender_did")
    except (TypeError, KeyError, EncodingError):
        return _refuse("unverified", "no readable container head in the verify result")
    if class_ != ANNOUNCE_CLASS:
        return _refuse("wrong_class", f"class {class_!r:.60} is not {ANNOUNCE_CLASS}", did, timestamp)
    try:
        payload = open_payload(hmp)  # no key: encrypted announces stay closed
    except (PayloadError, ValueError, KeyError, TypeError) as exc:
        return _refuse("unreadable", f"payload: {exc}", did, timestamp)
    if not isinstance(payload, dict):
        return _refuse("unreadable", "payload is not a JSON object", did, timestamp)
    revoked = payload.get("key_is_falsified") is True
    # a revocation needs no addresses (spec 4.1, profile section 13)
    records = payload.get("addresses", [] if revoked else None)
    roles = _str_tuple(payload, "roles")
    mailman = _str_tuple(payload, "mailman")
    if not isinstance(records, list) or roles is None or mailman is None:
        return _refuse("bad_payload", "addresses, roles and mailman must be lists (of strings)", did, timestamp)
    if not revoked and ttl is not None and ttl <= now:
        return _refuse("expired", f"ttl {head['ttl']} has passed", did, timestamp)
    addresses: list[str] = []
    dropped: list[tuple[int, str]] = []
    for index, record in enumerate(records):
        problem = check_address_record(did, record, min_difficulty=min_difficulty)
        if problem is not None:
            dropped.append((index, problem))
        elif record["addr"] not in addresses:
            addresses.append(record["addr"])
    detail = "; ".join(f"addresses[{i}]: {r}" for i, r in dropped)
    if not addresses and not revoked:
        return AnnounceCheck(
            False, "no_valid_address", detail or "no address records", did=did, timestamp=timestamp,
            dropped=tuple(dropped),
        )
    return AnnounceCheck(
        True, None, detail, did=did, addresses=tuple(addresses), roles=roles, mailman=mailman,
        timestamp=timestamp, revoked=revoked, dropped=tuple(dropped), protocols=_protocols_of(payload),
    )


def newer_announce(current: AnnounceCheck | None, candidate: AnnounceCheck) -> bool:
    """True when `candidate` should replace `current` (profile section 10).

    A newer `timestamp` from the same DID replaces the older announce; an equal
    timestamp keeps the current one (no flapping). A revocation is final: it
    replaces any non-revoking announce whatever its timestamp (profile section 4
    rejects what the key signs after it), and a non-revoking announce never
    replaces it. A refused candidate replaces nothing; a refused or missing
    `current` is replaced by any accepted candidate. Different DIDs: ValueError."""
    if current is not None and None not in (current.did, candidate.did) and current.did != candidate.did:
        raise ValueError(f"announces of different DIDs: {current.did} and {candidate.did}")
    if not candidate.ok or candidate.timestamp is None:
        return False
    if current is None or not current.ok or current.timestamp is None:
        return True
    if current.revoked != candidate.revoked:
        return candidate.revoked
    return candidate.timestamp > current.timestamp


class OwnAnnounce:
    """This node's signed peer_announce: re-signed when older than a second or when its
    mailmen changed; each address record's proof of work is made once (the DHT peer
    record reuses them: `record`)."""

    def __init__(self, identity: Identity, *, name: str, interests: Sequence[str], roles: Sequence[str],
                 difficulty: int, protocols: Sequence[str]) -> None:
        self.identity, self.difficulty = identity, difficulty
        self._static = {"name": name, "interests": list(interests), "expertise": [], "roles": list(roles)}
        self._protocols = list(protocols)
        self._records: dict[str, dict[str, Any]] = {}
        self._current: dict[str, Any] | None = None
        self._at = 0.0

    def record(self, addr: str) -> dict[str, Any]:
        """The address record of `addr` (made on first use)."""
        record = self._records.get(addr)
        if record is None:
            record = self._records[addr] = make_address_record(self.identity.did, addr, difficulty=self.difficulty)
        return record

    def current(self, addresses: Sequence[str], mailman: list[str], now: datetime, mono: float) -> dict[str, Any]:
        """The announce to send at `now` (wall clock, signed) and `mono` (its age)."""
        now = now.replace(microsecond=now.microsecond // 1000 * 1000)  # what the timestamp can say
        current = self._current
        records = [self.record(a) for a in addresses]
        if (current is not None and current["hmp_container"]["payload"]["mailman"] == mailman and mono - self._at < 1.0
                and current["hmp_container"]["payload"]["addresses"] == records):
            return current
        payload = {**self._static, "mailman": mailman, "addresses": records, "protocols": self._protocols}
        self._current = build_container(self.identity, ANNOUNCE_CLASS, payload, now=now)
        self._at = mono
        return self._current
