"""Who the peer of a v2 handshake is: the node's announce hook for `transport.NoiseHandshake`.

Sans-IO (no sockets, `now` given). The transport calls the hook with the raw
announce of the peer's identity payload (message 2 for the initiator, message 3
for the responder), before it checks the identity signature. `AnnounceGate`
carries over what the v1 JSON handshake (`hmpnode/net/handshake.py`, removed)
checked of the announce, in this order:

1. `early(claimed_did)`: the DID the announce claims, unverified, read from its
   head before any signature work (the node refuses a banned DID, a fresh DID
   from a locked host, or a claimed identity that gets no peer slot). A refusal
   is kept in `refusal` and the handshake fails (the transport's `bad_announce`;
   the node closes the carrier with that refusal, docs/protocol.md 21.2).
2. `Verifier.verify`; an announce refused as from the future but valid as of
   its own timestamp is the peer's clock being ahead: `clock_skew`.
3. `check_peer_announce` (class, payload, expiry, address records), not a
   revocation, the key bound to the DID (`bind_key`).
4. An announce older than `max_age`: the peer's clock is behind: `clock_skew`.

A clock skew does not fail the handshake: the announce is still valid as of its
own time, the identity signature still proves the key, so the gate returns it
and sets `clock_skew` (the detail, with the offset); the node then refuses the
authenticated peer with an encrypted `clock_skew` error frame (no strikes), so
the offset reaches the peer whose clock is off and nobody else. `skew` is the
(DID, seconds ahead of our clock) reading of every announce that got that far.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import orjson

from hmpnode.container.encoding import EncodingError, b58decode, parse_time
from hmpnode.container.reasons import FUTURE_TIMESTAMP
from hmpnode.container.verify import VerifyResult
from hmpnode.identity.registry import bind_key
from hmpnode.net.announce import AnnounceCheck, check_peer_announce
from hmpnode.net.transport import AnnounceRejected, CheckedAnnounce

__all__ = ["PeerInfo", "AnnounceGate", "claimed_did"]


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """The authenticated peer of a session."""

    did: str
    public_key: bytes
    #: its checked `peer_announce` (addresses, roles, mailman, protocols, timestamp)
    announce: AnnounceCheck
    #: the Verifier's result for that announce (`.container`)
    verify_result: VerifyResult
    #: its Noise static key (bound to `did` by its identity signature) and its versions
    static_key: bytes = b""
    versions: tuple[str, ...] = ()


def claimed_did(raw: bytes) -> str | None:
    """The DID an announce's head claims (unverified), or None."""
    try:
        did = orjson.loads(raw)["hmp_container"]["head"]["sender_did"]
    except (orjson.JSONDecodeError, TypeError, KeyError):
        return None
    return did if isinstance(did, str) else None


def _timestamp_of(raw: bytes) -> datetime | None:
    try:
        return parse_time(orjson.loads(raw)["hmp_container"]["head"]["timestamp"])
    except (orjson.JSONDecodeError, TypeError, KeyError, EncodingError, ValueError):
        return None


class AnnounceGate:
    """The announce hook of one handshake (module docstring); read its attributes after."""

    def __init__(self, verifier: Any, *, min_difficulty: int, now: datetime, max_age: timedelta | None = None,
                 early: Callable[[str], str | None] | None = None):
        self._verifier = verifier
        self._min_difficulty = min_difficulty
        self._now = now
        self._max_age = max_age
        self._early = early
        #: a reason of the node's to refuse the claimed DID before any signature work
        self.refusal: str | None = None
        #: the detail of a clock skew (the announce is valid, its date is outside our window)
        self.clock_skew: str | None = None
        #: (DID, seconds its clock is ahead of ours) from its announce's timestamp
        self.skew: tuple[str, float] | None = None
        self.checked: tuple[AnnounceCheck, VerifyResult] | None = None

    def __call__(self, raw: bytes) -> CheckedAnnounce:
        if self._early is not None:
            claimed = claimed_did(raw)
            reason = self._early(claimed) if claimed is not None else None
            if reason is not None:
                self.refusal = reason
                raise AnnounceRejected(f"refused before verification: {reason}")
        now = self._now
        result = self._verifier.verify(raw, now=now)
        if result.reason == FUTURE_TIMESTAMP:
            result = self._ahead(raw, result)
        check = check_peer_announce(result, min_difficulty=self._min_difficulty, now=now)
        if not check.ok or check.did is None:
            raise AnnounceRejected(f"{check.reason}: {check.detail}")
        if check.revoked:
            raise AnnounceRejected("the announce revokes its DID (key_is_falsified)")
        if check.timestamp is not None:
            offset = (check.timestamp - now).total_seconds()
            self.skew = (check.did, offset)
            if self._max_age is not None and self.clock_skew is None and check.timestamp < now - self._max_age:
                # a node signs its announce just before its handshake: this one's clock is behind
                self.clock_skew = (f"the peer's announce is dated {-offset:.0f} s behind our clock (window "
                                   f"{self._max_age.total_seconds():.0f} s): one of the two clocks is off "
                                   f"(offset_seconds={offset:+.3f})")
        head = result.container["hmp_container"]["head"]
        key = b58decode(head["public_key"]) if "public_key" in head else self._verifier.registry.pinned_key(check.did)
        binding = bind_key(check.did, bytes(key) if key is not None else None, self._verifier.registry, now)
        if binding.reason is not None or key is None:
            raise AnnounceRejected(f"{binding.reason}: {binding.detail}")
        self.checked = (check, result)
        return CheckedAnnounce(check.did, bytes(key), (check, result))

    def _ahead(self, raw: bytes, result: VerifyResult) -> VerifyResult:
        """An announce refused as from the future: if it is valid as of its own time, the
        peer's clock is ahead of ours (clock_skew, not bad_announce)."""
        at = _timestamp_of(raw)
        if at is None:
            return result
        ahead = self._verifier.verify(raw, now=at)
        check = check_peer_announce(ahead, min_difficulty=self._min_difficulty, now=self._now)
        if not check.ok or check.did is None or check.timestamp is None:
            return result
        offset = (check.timestamp - self._now).total_seconds()
        window = self._verifier.limits.max_clock_skew.total_seconds()
        self.clock_skew = (f"the peer's announce is dated {offset:.0f} s ahead of our clock (window "
                           f"{window:.0f} s): one of the two clocks is off (offset_seconds={offset:+.3f})")
        return ahead
