"""The `referenced-by` block (HMP §3.16, profile section 8).

A container's `referenced-by` block lists the containers known to point at it:
one link `{"type": relation, "target": DID}` for every container `DID` whose
`related.<relation>` names this container. The generating node signs
`canonical_json(links)` with its Ed25519 key:

    {"links": [...], "peer_did": ..., "public_key": base58btc, "sig_algo": "ed25519",
     "signature": base64url(Ed25519(canonical_json(links))),
     "referenced-by_hash": sha256_tag(canonical_json(links))}

Choices hmpnode makes where the spec and profile are silent:

* **Links are read in any order and in every form of spec 12.3**
  (profile section 13). `referenced-by_hash` and the signature are checked
  over `canonical_json(links)` exactly as received, so nothing the signer
  signed is re-read differently; `read_links` then turns the links into the
  set of (`type`, `target`) pairs they state. Accepted forms:
  the canonical list `[{"type", "target": DID}]` in any order (a repeated
  pair counts once), the grouped list `[{"type", "target": [DID, ...]}]`
  (12.3.1; both kinds of entry may mix), and the compact map
  `{type: [DID, ...]}` (12.3.2; the value must be an array). A block this node builds is always the canonical
  list, sorted by (`type`, `target`) in code point order, without
  repeats, so that two nodes with the same findings write the same bytes.
* **A link entry is exactly `{"type", "target"}`.** Both non-empty strings
  (or, for `target`, a non-empty array of them); any other member makes the
  block `malformed`: nothing else is defined, and a member nobody reads
  would be a second meaning under one signature.
* **Key binding** follows profile section 4: a self-certifying `peer_did`
  (`did:hmp:agent:` + base58(SHA-256(key)[:20])) must hash to `public_key`,
  and any DID with a pinned key must show that key (`identity.bind_key`, the
  rule containers and evaluations use too). A `peer_did` the registry reports as revoked is rejected
  (`revoked`): the block carries no timestamp, so nothing shows it was signed
  before the revocation.
* **The signature does not name the container the block belongs to**, so a
  block can be copied onto another container. It therefore only attributes a
  claim to a peer; it never proves a link. `merge_referenced_by` keeps a
  received link only after the node has checked, against the referencing
  container it holds itself, that the relation really exists (profile
  section 8, §3.16.3 item 6). A link whose referencing container is not held
  yet is reported as pending so the node can re-check it when that
  container arrives.

Every function here is pure: no clock, no I/O. `verify_referenced_by` never
raises on hostile input; type confusion of any kind yields `malformed`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hmpnode.container.canonical import CanonicalError, canonical_json
from hmpnode.container.encoding import EncodingError, b64url_decode, b64url_encode, sha256_tag
from hmpnode.identity.keys import Identity, ed25519_verify, public_key_from_b58
from hmpnode.identity.registry import KeyRegistry, bind_key

__all__ = [
    "SIG_ALGO",
    "MAX_LINKS",
    "BacklinkCheck",
    "BacklinkMerge",
    "Confirm",
    "links_from_related",
    "sort_links",
    "read_links",
    "referenced_by_hash",
    "build_referenced_by",
    "verify_referenced_by",
    "merge_referenced_by",
]

SIG_ALGO = "ed25519"
# Upper bound on links in one received block; larger blocks are `malformed`
# (each received link may cost the node a store lookup in merge).
MAX_LINKS = 10_000
_BLOCK_STRING_FIELDS = ("peer_did", "public_key", "sig_algo", "signature", "referenced-by_hash")
_LINK_KEYS = frozenset(("type", "target"))

# confirm(relation, source_did, container_did): does the locally held container
# `source_did` carry related.<relation> -> container_did?  True / False / None (not held).
Confirm = Callable[[str, str, str], "bool | None"]


@dataclass(frozen=True, slots=True)
class BacklinkCheck:
    """Outcome of `verify_referenced_by`. `reason` is a stable code when not ok:
    `malformed`, `hash_mismatch`, `key_mismatch`, `revoked`,
    `unsupported_sig_algo`, `bad_signature`."""

    ok: bool
    reason: str | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class BacklinkMerge:
    """Outcome of `merge_referenced_by`.

    links    -- the sorted, deduplicated links to sign into the local block
    pending  -- received links whose referencing container is not held yet
    dropped  -- received links the node has shown to be false
    rejected -- checks of received blocks that failed verification (for logs)
    """

    links: list[dict[str, str]]
    pending: list[dict[str, str]]
    dropped: list[dict[str, str]]
    rejected: list[BacklinkCheck]


def _fail(reason: str, detail: str) -> BacklinkCheck:
    return BacklinkCheck(False, reason, detail)


def links_from_related(container_did: str, related: Any) -> list[tuple[str, str]]:
    """The (relation, target_did) pairs the `related` block of container
    `container_did` declares, sorted and without duplicates.

    Values may be a string or an array of strings (profile section 3).
    Entries that are not non-empty strings, and a container pointing at
    itself, are skipped; a `related` that is not an object yields `[]`.
    Never raises.
    """
    if not isinstance(related, Mapping):
        return []
    pairs: set[tuple[str, str]] = set()
    for relation, value in related.items():
        if not isinstance(relation, str) or not relation:
            continue
        targets = value if isinstance(value, list) else [value]
        for target in targets:
            if isinstance(target, str) and target and target != container_did:
                pairs.add((relation, target))
    return sorted(pairs)


def _link_key(link: Any) -> tuple[str, str]:
    if isinstance(link, Mapping):
        if set(link.keys()) != _LINK_KEYS:
            raise ValueError("a link has exactly the members 'type' and 'target'")
        relation, target = link["type"], link["target"]
    elif isinstance(link, tuple) and len(link) == 2:
        relation, target = link
    else:
        raise ValueError("a link is a {'type', 'target'} object or a (type, target) pair")
    if not (isinstance(relation, str) and relation and isinstance(target, str) and target):
        raise ValueError("link type and target must be non-empty strings")
    return relation, target


def sort_links(links: Iterable[Any]) -> list[dict[str, str]]:
    """Deduplicate and sort links by (type, target), code point order.

    Accepts `{"type", "target"}` mappings or `(type, target)` pairs; returns
    fresh dicts. Raises ValueError for anything else."""
    keys = {_link_key(link) for link in links}
    return [{"type": t, "target": d} for t, d in sorted(keys)]


def _targets(value: Any, where: str) -> list[str]:
    targets = value if isinstance(value, list) else [value]
    if not targets:
        raise ValueError(f"{where} has no target")
    for target in targets:
        if not (isinstance(target, str) and target):
            raise ValueError(f"{where} target is not a non-empty string")
    return targets


def read_links(links: Any, max_links: int = MAX_LINKS) -> list[tuple[str, str]]:
    """The (type, target) pairs a received `links` value states, sorted, each once.

    Reads the canonical list in any order, the grouped list (12.3.1) and the
    compact map (12.3.2); raises ValueError for anything else or for more than
    `max_links` pairs. Never changes what was signed: the caller hashes and
    verifies `links` as received."""
    if isinstance(links, dict):
        entries = []
        for relation, targets in links.items():
            if not isinstance(targets, list):  # 12.3.2 maps a type to an array, always
                raise ValueError(f"links[{relation!r:.40}] is not an array of targets")
            entries.append(({"type": relation, "target": targets}, f"links[{relation!r:.40}]"))
    elif isinstance(links, list):
        entries = [(link, f"links[{i}]") for i, link in enumerate(links)]
    else:
        raise ValueError("links is neither an array nor a map of type -> targets")
    pairs: set[tuple[str, str]] = set()
    count = 0
    for link, where in entries:
        if not isinstance(link, dict) or set(link.keys()) != _LINK_KEYS:
            raise ValueError(f"{where} is not a {{type, target}} object")
        relation = link["type"]
        if not (isinstance(relation, str) and relation):
            raise ValueError(f"{where} type is not a non-empty string")
        targets = _targets(link["target"], where)
        count += len(targets)
        if count > max_links:
            raise ValueError(f"more than {max_links} links")
        pairs.update((relation, target) for target in targets)
    return sorted(pairs)


def referenced_by_hash(links: list[dict[str, str]]) -> str:
    """`sha256:` hex of canonical_json(links), links taken as given."""
    return sha256_tag(canonical_json(links))


def build_referenced_by(links: Iterable[Any], identity: Identity) -> dict[str, Any]:
    """Sort `links` and sign them into a `referenced-by` block as `identity`."""
    ordered = sort_links(links)
    body = canonical_json(ordered)
    return {
        "links": ordered,
        "peer_did": identity.did,
        "public_key": identity.public_key_b58,
        "sig_algo": SIG_ALGO,
        "signature": b64url_encode(identity.sign(body)),
        "referenced-by_hash": sha256_tag(body),
    }


def verify_referenced_by(
    block: Any, *, registry: KeyRegistry | None = None, max_links: int = MAX_LINKS
) -> BacklinkCheck:
    """Check a received `referenced-by` block. Order of checks, first failure wins:

    1. shape: an object; `links` in a form `read_links` reads (≤ max_links
       pairs, any order); `peer_did`, `public_key`, `sig_algo`, `signature`,
       `referenced-by_hash` strings; `public_key` decodes to 32 bytes --
       else `malformed`
    2. `referenced-by_hash` == sha256_tag(canonical_json(links)) -- `hash_mismatch`
    3. key binding (`identity.bind_key`): a self-certifying `peer_did` hashes to
       `public_key`, a pinned key equals it -- `key_mismatch`; registry reports
       `peer_did` revoked at all (a block has no timestamp) -- `revoked`
    4. `sig_algo` is `ed25519` -- `unsupported_sig_algo`
    5. `signature` is base64url of a valid 64-byte Ed25519 signature over
       canonical_json(links) -- `bad_signature`

    Never raises on hostile `block`.
    """
    try:
        return _verify(block, registry, max_links)
    except Exception as exc:  # defence in depth: hostile input must not crash the node
        return _fail("malformed", f"unexpected {type(exc).__name__} while verifying")


def _verify(block: Any, registry: KeyRegistry | None, max_links: int) -> BacklinkCheck:
    if not isinstance(block, dict):
        return _fail("malformed", "referenced-by is not an object")
    for name in _BLOCK_STRING_FIELDS:
        if not isinstance(block.get(name), str):
            return _fail("malformed", f"{name} missing or not a string")
    links = block.get("links")
    try:
        read_links(links, max_links)
    except ValueError as exc:
        return _fail("malformed", str(exc))
    peer_did: str = block["peer_did"]
    if not peer_did:
        return _fail("malformed", "peer_did is empty")
    try:
        public_key = public_key_from_b58(block["public_key"])
    except EncodingError:
        return _fail("malformed", "public_key is not base58btc of 32 bytes")

    try:
        body = canonical_json(links)
    except CanonicalError as exc:
        return _fail("malformed", f"links have no canonical JSON form: {exc}")
    if block["referenced-by_hash"] != sha256_tag(body):
        return _fail("hash_mismatch", "referenced-by_hash does not match canonical_json(links)")

    # A block carries no timestamp, so any revocation of peer_did refuses it.
    binding = bind_key(peer_did, public_key, registry, None)
    if binding.reason is not None:
        return _fail(binding.reason, f"peer_did: {binding.detail}")

    if block["sig_algo"] != SIG_ALGO:
        return _fail("unsupported_sig_algo", f"sig_algo {block['sig_algo']!r:.40} not supported")
    try:
        signature = b64url_decode(block["signature"])
    except EncodingError:
        return _fail("bad_signature", "signature is not base64url")
    if not ed25519_verify(public_key, body, signature):
        return _fail("bad_signature", "Ed25519 signature does not verify")
    return BacklinkCheck(True, None, "")


def merge_referenced_by(
    container_did: str,
    local_links: Iterable[Any],
    received_blocks: Iterable[Any],
    confirm: Confirm,
    *,
    registry: KeyRegistry | None = None,
    max_links: int = MAX_LINKS,
) -> BacklinkMerge:
    """Merge received `referenced-by` blocks for `container_did` into `local_links`.

    `local_links` are the node's own findings and are kept as they are.
    Each received block is verified first; a block that fails contributes
    nothing (its check is listed in `rejected`). Each link of a verified block
    that is not already local is put to `confirm(type, target, container_did)`
    once: True keeps it, None (the referencing container `target` is not held)
    makes it pending, anything else drops it.
    """
    own = sort_links(local_links)
    have = {(link["type"], link["target"]) for link in own}
    keep: set[tuple[str, str]] = set(have)
    pending: set[tuple[str, str]] = set()
    dropped: set[tuple[str, str]] = set()
    rejected: list[BacklinkCheck] = []
    decided: set[tuple[str, str]] = set()
    for block in received_blocks:
        check = verify_referenced_by(block, registry=registry, max_links=max_links)
        if not check.ok:
            rejected.append(check)
            continue
        for key in read_links(block["links"], max_links):
            if key in have or key in decided:
                continue
            decided.add(key)
            verdict = confirm(key[0], key[1], container_did)
            if verdict is True:
                keep.add(key)
            elif verdict is None:
                pending.add(key)
            else:
                dropped.add(key)

    def as_links(keys: set[tuple[str, str]]) -> list[dict[str, str]]:
        return [{"type": t, "target": d} for t, d in sorted(keys)]

    return BacklinkMerge(as_links(keep), as_links(pending), as_links(dropped), rejected)
