"""The simulator's cheap stand-in for signatures (`--crypto plain`), for the largest runs.

Real crypto is the default: every container is verified (Ed25519, canonical form, schema)
and every MCE message signed and checked as the node does. With the stand-in, nothing is
signed or checked: a container is taken as its head says (its DID, its dates), an MCE
message is a plain object with a counting DID, and a refusal by signature can no longer
happen. The mesh's decisions are the same code either way: the stand-in changes what
a frame costs, not what any node decides (both modes keep every invariant; the figures
say which one they were measured with).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from hmpnode.container.encoding import format_time
from hmpnode.container.verify import VerifyResult
from hmpnode.net import mce as M

__all__ = ["PlainMce", "plain_verify"]


class PlainMce:
    """An unsigned MCE message: class, payload, date and a DID that counts up per sender."""

    def __init__(self, own_did: str) -> None:
        self.own_did = own_did
        self.count = 0

    def sign(self, class_: str, payload: dict[str, Any], *, peer_did: str, now: datetime,
             in_reply_to: str | None = None) -> dict[str, Any]:
        self.count += 1
        head: dict[str, Any] = {"class": class_, "container_did": f"did:hmp:container:plain{self.count}",
                                "sender_did": self.own_did, "recipient": [peer_did], "timestamp": format_time(now)}
        if in_reply_to:
            head["related"] = {"in_reply_to": in_reply_to}
        return {"hmp_container": {"head": head, "payload": payload}}

    @staticmethod
    def check(container: dict[str, Any], *, peer_did: str, own_did: str, now: datetime,
              max_age: timedelta) -> M.Mce:
        head = container["hmp_container"]["head"]
        if head.get("sender_did") != peer_did or head.get("recipient") != [own_did]:
            raise M.FrameError("bad_mce", "not from this peer to us")
        reply = (head.get("related") or {}).get("in_reply_to")
        return M.Mce(head["class"], container["hmp_container"]["payload"], head["container_did"] + "|" + peer_did,
                     now, reply)


def plain_verify(item: dict[str, Any], now: datetime) -> VerifyResult:
    """A container taken as its head says (no signature, hash or schema check)."""
    try:
        did = item["hmp_container"]["head"]["container_did"]
    except (KeyError, TypeError):
        return VerifyResult(False, "malformed", "no head")
    return VerifyResult(True, container_did=did, container=item)
