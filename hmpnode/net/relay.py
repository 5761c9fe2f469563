"""Relay chain (profile section 11, spec 6.8.4).

Each relay that passes a container on appends one entry to the full form's
top-level `relay_chain` array::

    {"relay_did": ..., "timestamp": RFC 3339 UTC, "sig_algo": "ed25519",
     "public_key": base58btc, "signature": base64url}

signing the UTF-8 string `timestamp + ", " + relay_did`. A relay never
touches `hmp_container` (only that part is signed by the sender).

The chain is informational only. The signed string names the relay and a
time but not the container, so an entry is not bound to the container it sits
on: anyone can copy a valid entry onto another container's chain, and can
drop or reorder entries. A verified chain therefore shows at most that each
listed relay signed *some* entry at that time; use it for hop counts and for
showing which relays handled a container, never as a basis for trust, access
or routing decisions.

`verify_relay_chain` checks, entry by entry, stopping at the first bad one:

1. shape -- a list of at most `max_entries` objects with exactly the five
   string members above, `relay_did` non-empty (`malformed`)
2. `timestamp` is RFC 3339 UTC and `public_key` base58btc of 32 bytes (`malformed`)
3. the key binds to `relay_did` (`bind_key`): `key_mismatch`, `unknown_key`, `revoked`
4. `sig_algo` is `ed25519` (`unsupported_sig_algo`)
5. `signature` is base64url of a valid Ed25519 signature (`bad_signature`)

It never raises on hostile input. A foreign-form relay DID with no pinned key
is accepted on its offered key and is not pinned: the chain does not feed trust.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hmpnode.container.encoding import EncodingError, b64url_decode, b64url_encode, format_time, parse_time
from hmpnode.identity.keys import Identity, ed25519_verify, public_key_from_b58
from hmpnode.identity.registry import KeyRegistry, bind_key

__all__ = ["SIG_ALGO", "ENTRY_MEMBERS", "MAX_ENTRIES", "RelayCheck", "signed_string", "append_relay", "verify_relay_chain"]

SIG_ALGO = "ed25519"
ENTRY_MEMBERS = frozenset({"relay_did", "timestamp", "sig_algo", "public_key", "signature"})
MAX_ENTRIES = 32


@dataclass(frozen=True, slots=True)
class RelayCheck:
    ok: bool
    reason: str | None = None  # malformed, key_mismatch, unknown_key, revoked, unsupported_sig_algo, bad_signature
    detail: str = ""
    index: int | None = None  # the first bad entry; None when ok or the chain itself is not a list


def signed_string(timestamp: str, relay_did: str) -> bytes:
    """The bytes a relay signs: UTF-8 of `timestamp + ", " + relay_did`."""
    return (timestamp + ", " + relay_did).encode("utf-8")


def append_relay(full_form: dict[str, Any], identity: Identity, *, now: datetime) -> dict[str, Any]:
    """A new full form with `identity`'s relay entry appended; the input is not modified.

    ValueError when `full_form` is not a full form (no `hmp_container`), its
    `relay_chain` is present but not a list, or `now` is naive.
    """
    if not isinstance(full_form, dict) or "hmp_container" not in full_form:
        raise ValueError("append_relay needs a full form with hmp_container")
    chain = full_form.get("relay_chain", [])
    if not isinstance(chain, list):
        raise ValueError("relay_chain is not an array")
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    timestamp = format_time(now)
    entry = {
        "relay_did": identity.did,
        "timestamp": timestamp,
        "sig_algo": SIG_ALGO,
        "public_key": identity.public_key_b58,
        "signature": b64url_encode(identity.sign(signed_string(timestamp, identity.did))),
    }
    out = dict(full_form)
    out["relay_chain"] = [*chain, entry]
    return out


def _bad(reason: str, detail: str, index: int | None) -> RelayCheck:
    return RelayCheck(False, reason, detail, index)


def verify_relay_chain(chain: Any, *, registry: KeyRegistry | None = None, max_entries: int = MAX_ENTRIES) -> RelayCheck:
    """Check every entry of a `relay_chain` value; see the module docstring."""
    if not isinstance(chain, list):
        return _bad("malformed", "relay_chain is not an array", None)
    if len(chain) > max_entries:
        return _bad("malformed", f"relay_chain has {len(chain)} entries, more than {max_entries}", max_entries)
    for i, entry in enumerate(chain):
        check = _verify_entry(entry, registry)
        if check is not None:
            return _bad(check[0], check[1], i)
    return RelayCheck(True)


def _verify_entry(entry: Any, registry: KeyRegistry | None) -> tuple[str, str] | None:
    if not isinstance(entry, dict):
        return "malformed", "relay entry is not an object"
    if len(entry) != len(ENTRY_MEMBERS) or not all(isinstance(k, str) and k in ENTRY_MEMBERS for k in entry):
        return "malformed", f"relay entry members must be exactly {sorted(ENTRY_MEMBERS)}"
    if not all(isinstance(v, str) for v in entry.values()):
        return "malformed", "relay entry members must be strings"
    relay_did: str = entry["relay_did"]
    timestamp: str = entry["timestamp"]
    if not relay_did:
        return "malformed", "relay_did is empty"
    try:
        stamped = parse_time(timestamp)
    except EncodingError:
        return "malformed", "timestamp is not RFC 3339 UTC"
    try:
        message = signed_string(timestamp, relay_did)
    except UnicodeEncodeError:
        return "malformed", "relay_did is not encodable as UTF-8"
    try:
        offered = public_key_from_b58(entry["public_key"])
    except EncodingError:
        return "malformed", "public_key is not base58btc of 32 bytes"

    binding = bind_key(relay_did, offered, registry, stamped)
    if binding.reason is not None or binding.key is None:
        return binding.reason or "unknown_key", f"relay_did: {binding.detail}"

    if entry["sig_algo"] != SIG_ALGO:
        return "unsupported_sig_algo", f"sig_algo {entry['sig_algo']!r:.40} not supported"
    try:
        signature = b64url_decode(entry["signature"])
    except EncodingError:
        return "bad_signature", "signature is not base64url"
    if not ed25519_verify(binding.key, message, signature):
        return "bad_signature", "Ed25519 signature does not verify"
    return None
