"""One peer session of the v2 protocol as a sans-IO state machine (docs/protocol.md 21-25).

Who does what, in the h11/aioquic shape:

- `transport` turns WebSocket bytes into the session's plaintext frames and back
  (Noise handshake, AEAD records);
- `PeerSession` (this module) is one authenticated peer: frames and decisions in,
  events and frames to send out. It owns the per-connection protocol state (the
  budgets as plain token buckets, strikes, the ledger views of what went either
  way, lazy push, relay handoffs, the reconciliations in progress) and every
  protocol decision: what a frame means, which refusal or strike it earns, what
  may be acknowledged, how many DIDs may be asked for, which containers to send
  and how to batch them, what a reconciliation step found;
- a driver (`mesh` in the node, a simulator) moves the frames, answers the events
  from the store and node-wide policy (slots, bans, dialing, the ledger, sync
  snapshots, the forward loop, outbox, relay holding, the DHT) and runs the work.

The session never touches a socket, the store, the event loop, a thread or a clock.
Time comes in as arguments (`mono` for budgets, strikes and deadlines, `now` for
signed dates). Its input protocol is closed; every call returns `SessionEvent`s, in order:

- `frame_received(data, mono, now)`: a frame of the peer. The frame budget comes
  first, then a `Pause` while the peer is in debt on its verification budget, then
  the parse, then what the frame means;
- `work_done(work, result, mono, now)`: the result of a `Work` it handed out. Work
  is pure CPU the driver runs (`work.run()`: on a verify thread in the node, inline
  in a simulator) and charges to the peer (`charge_cpu`): `ParseFrame` (a big
  frame), `MceCheck` (an MCE message's signature), `ReconcileWork` (a
  reconciliation step), `MceWork` (signing our requests for an offer); a `Pause`
  has nothing to run, the driver waits its `seconds` first;
- `handle_timer(mono)` when `next_timer()` is due (requests not answered, a relay's
  re-offer);
- the driver's answers to events (`ingested`, `answer_start`, `take_offered`/`ask`,
  `answer_request`, ...) and `record_failed` when the record stream breaks.

A refusal is made one way: the session strikes, queues the error frame and reports
`Refused(reason, detail, cut)`; when `cut` the peer crossed its strike threshold
(the driver bans it). A message dated outside our window is `ClockSkew` (not an
offence, 25.4). A shape its checks let through (ValueError, TypeError, ...) is
refused as malformed_frame; `fault` does the same for what the driver's handling
of an event raises. Cut off, clock skew, a broken record stream and `close(reason)`
end the session: `closed`, `close_reason`; from then on input is ignored (the
entry points return []) and only the frames queued before come out of `data_to_send`.

MCE messages are checked and signed by what the session is given (`check`: an
MceChecker, `sign`: an MceSigner); the default is real crypto (`verify_mce`,
`mce.build_mce` with the node's identity), a simulator may pass cheap stand-ins.
Per-DID bookkeeping of a big offer is taken in slices (`take_offered`, OFFER_SLICE
DIDs) that the driver lets other work run between.
"""

from __future__ import annotations

import base64
import binascii
import functools
import random
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

import orjson

from hmpnode.container import inflight
from hmpnode.container.encoding import format_time
from hmpnode.container.payload import recipients_of
from hmpnode.container.verify import Verifier
from hmpnode.identity.keys import Identity
from hmpnode.net import deltaplan as DL
from hmpnode.net import index as IX
from hmpnode.net import ledger
from hmpnode.net import mce as M
from hmpnode.net import syncset as SY
from hmpnode.net.interests import InterestError, InterestLimits, Interests
from hmpnode.net.penalty import NOT_OFFENCES, Strikes, TokenBucket
from hmpnode.net.reconcile import ID_SIZE, ReconcileError, Reconciler
from hmpnode.net.scope import FORWARDING_ROLES, Channel, may_forward
from hmpnode.net.transport import TransportError

__all__ = [
    "SessionLimits", "PeerSession", "MceChecker", "MceSigner", "verify_mce", "PEER_FAULTS",
    "plan_forward", "choose_push", "refusal_of", "keeps_new_connection", "b64", "unb64",
    "SessionEvent", "Work", "Pause", "ParseFrame", "MceCheck", "ReconcileWork", "MceWork",
    "ContainersReceived", "Requested", "Offered", "Acknowledged", "BlocksReceived", "ReofferHeld",
    "ReconcileStart", "ReconcileStep", "WantReceived", "PeerError", "Refused", "ClockSkew", "ClockSample", "NatReceived",
    "Ingested", "Modified", "Removed", "IndexRequested", "IndexEntries", "IndexDone",
]

#: DIDs of one `container_request` answered, and of one request we send
MAX_ASKED = 10_000
REQUEST_CHUNK = 1000
#: offered DIDs taken in one step of the event loop (`take_offered`: ~3 us a DID, the
#: ledger's keyed digests; an index of 4 800 taken at once held the loop ~30 ms with
#: the signing of its requests, now off the loop: `MceWork`)
OFFER_SLICE = 250
#: containers of one referenced-by/evaluations request or exchange taken
MAX_BLOCKS = 1000
#: containers pushed per paced step of a reconciliation transfer
PUSH_CHUNK = 256
#: pauses one frame makes while its peer is in debt on its verification budget (then it is taken)
MAX_CPU_WAITS = 100


@dataclass(frozen=True, slots=True)
class SessionLimits:
    """The per-session limits, declared here only: hmpnode.config.PeerSettings.session_limits builds
    them from [peer] (with [relay] reoffer_ms and [interests]); MeshSettings.session carries them."""

    max_frame_bytes: int = 4 * 1024 * 1024
    max_items_per_frame: int = 512
    max_requested: int = 20_000
    frames_per_second: float = 200.0
    frame_burst: float = 1000.0
    containers_per_second: float = 2000.0
    container_burst: float = 20000.0
    strike_threshold: int = 50
    verify_seconds_per_second: float = 0.5
    verify_burst_seconds: float = 2.0
    offload_frame_bytes: int = 64 * 1024
    max_frame_decompressed_bytes: int = 32 * 1024 * 1024
    mce_max_age_seconds: int = 600
    delta_page: int = 2000
    sync_per_minute: float = 6.0
    #: interests (docs/protocol.md 33): peer_query messages per minute, entries per declared list
    peer_queries_per_minute: float = 6.0
    max_interest_entries: int = 64
    # the container index on request (docs/protocol.md 31)
    index_requests_per_minute: float = 30.0
    index_page: int = 500
    index_scan: int = 2000
    #: a request not answered within this long is forgotten (its container is asked for at
    #: the next offer, from this peer or another); longer while the peer keeps answering others
    request_timeout_seconds: float = 10.0
    #: a relay offers again what a connected recipient has not acknowledged after this long
    #: without progress (doubling, up to 8 times, while offers bring no acknowledgement)
    relay_reoffer_seconds: float = 15.0


# -- events ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionEvent:
    """What a session's entry points return: something for the driver to carry out (a
    `Work` to run, a store read, a refusal to log), in order."""


@dataclass(frozen=True, slots=True)
class ContainersReceived(SessionEvent):
    """A `containers` frame: the adapter screens (scope, relay quotas), ingests, then
    calls `PeerSession.ingested`. `dids`/`heads` are per item (None/junk when malformed)."""

    items: list[Any]
    dids: list[str | None]
    heads: list[Any]


@dataclass(frozen=True, slots=True)
class Requested(SessionEvent):
    """A `container_request`: the delta page after `after` (when not None), the
    containers `dids` (answered with a `container_response` when `answer`), and
    referenced-by / evaluations blocks of these DIDs."""

    after: int | None
    dids: list[str]
    answer: bool
    referenced_by: list[str]
    evaluations: list[str]


@dataclass(frozen=True, slots=True)
class Offered(SessionEvent):
    """The peer holds these (delta, index): the adapter learns which it lacks, then `ask`."""

    dids: list[str]


@dataclass(frozen=True, slots=True)
class Acknowledged(SessionEvent):
    """What the peer acknowledged that we gave or offered it, and the (DID, recipient)
    pairs it settles (the peer itself and the recipients we handed it over for)."""

    dids: list[str]
    pairs: list[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class ReofferHeld(SessionEvent):
    """A relay's timer: offer again what it holds for the peer (`offer_held` with `again`),
    since what was offered or given was not all acknowledged in time (24.2)."""


@dataclass(frozen=True, slots=True)
class BlocksReceived(SessionEvent):
    """Signed referenced-by or evaluations blocks (`kind`), per container DID."""

    kind: str
    items: list[tuple[str, dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class ReconcileStart(SessionEvent):
    """The peer starts reconciling set `name`: the adapter takes the node-wide snapshot
    and calls `PeerSession.answer_start`."""

    name: str
    data: bytes


@dataclass(frozen=True, slots=True)
class ReconcileStep(SessionEvent):
    """What a reconciliation step this side started found: ids the peer lacks (`have`)
    and ids it holds that we lack (`need`), in `snap`."""

    name: str
    snap: Any
    have: list[bytes]
    need: list[bytes]

    def batches(self) -> Iterator[tuple[str, list[bytes]]]:
        """The transfer, in paced steps: ("want", ids) frames of at most SY.MAX_WANT ids
        first (what we lack), then ("push", ids) of PUSH_CHUNK containers the peer lacks."""
        for i in range(0, len(self.need), SY.MAX_WANT):
            yield "want", self.need[i:i + SY.MAX_WANT]
        for i in range(0, len(self.have), PUSH_CHUNK):
            yield "push", self.have[i:i + PUSH_CHUNK]


@dataclass(frozen=True, slots=True)
class WantReceived(SessionEvent):
    """The peer asks for containers by reconciliation id; `snap` is the snapshot of
    its reconciliation (None: the adapter takes the current one)."""

    name: str
    ids: list[bytes]
    snap: Any


@dataclass(frozen=True, slots=True)
class PeerError(SessionEvent):
    """The peer sent an error frame (counted; nothing to answer)."""

    reason: str
    detail: str


@dataclass(frozen=True, slots=True)
class Refused(SessionEvent):
    """The session refused something the peer sent, and answered it already: a strike and
    the error frame `reason` (`banned` when `cut`: the peer crossed its strike threshold,
    the session is closed and the driver bans it). `sync`: a refused reconciliation frame,
    counted as refused{sync, sync}. `cause`: for the log only, what could not be handled."""

    reason: str
    detail: str
    cut: bool
    sync: str | None = None
    cause: str = ""


@dataclass(frozen=True, slots=True)
class NatReceived(SessionEvent):
    """A `nat` frame of the peer (docs/protocol.md 34): its `op` and the whole frame, for the
    driver's NAT side (hmpnode.net.nat), which checks the members its op needs."""

    op: str
    message: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ClockSkew(SessionEvent):
    """A signed message of the peer dated outside our window (`offset` seconds from our
    clock): not an offence (25.4); the session said so (error clock_skew) and is closed."""

    offset: float


@dataclass(frozen=True, slots=True)
class ClockSample(SessionEvent):
    """A verified MCE message of the peer was signed `offset` seconds from our clock (the
    node's skew estimate takes it)."""

    offset: float


@dataclass(frozen=True, slots=True)
class Ingested(SessionEvent):
    """The outcome of one `containers` frame: what was acknowledged (`for_us`: those of
    it addressed to this node, which relays that hold them too are told of), the items
    stored with their seq (for relay chains), and the refusal the invalid ones earned
    once they cross the strike threshold (None: not cut off)."""

    acknowledged: list[str]
    for_us: list[str]
    stored: list[tuple[int, int]]
    refused: Refused | None


class SyncRefusal(M.FrameError):
    """A refused reconciliation frame (inside the session); `refusal` becomes `Refused.sync`."""

    def __init__(self, reason: str, detail: str, refusal: str):
        super().__init__(reason, detail)
        self.refusal = refusal


#: what a peer's input can raise in the session's checks: a refusal (FrameError, SkewError)
#: or a shape the checks let through (still the peer's fault: refused malformed_frame)
PEER_FAULTS = (M.FrameError, ValueError, TypeError, LookupError, AttributeError, ArithmeticError)


# -- what checks and signs MCE messages (injected: real crypto by default) --------------------


class MceChecker(Protocol):
    """Verifies an MCE message of `peer_did` for `own_did` (`mce.check_mce`): its `Mce`, or
    raises FrameError (bad_mce) / SkewError. Runs on a verify thread (CPU)."""

    def __call__(self, container: dict[str, Any], *, peer_did: str, own_did: str, now: datetime,
                 max_age: timedelta) -> M.Mce: ...


class MceSigner(Protocol):
    """Builds and signs an MCE message to `peer_did` (`mce.build_mce` with this node's identity)."""

    def __call__(self, class_: str, payload: dict[str, Any], *, peer_did: str, now: datetime,
                 in_reply_to: str | None = None) -> dict[str, Any]: ...


_verifiers = threading.local()


def verify_mce(container: dict[str, Any], *, peer_did: str, own_did: str, now: datetime,
               max_age: timedelta) -> M.Mce:
    """The default MceChecker: `mce.check_mce` with this thread's plain Verifier (no
    revocations, default limits); the node passes its own (its registry and MCE limits)."""
    verifier = getattr(_verifiers, "verifier", None)
    if verifier is None:
        verifier = _verifiers.verifier = Verifier()
    return M.check_mce(verifier, container, peer_did=peer_did, own_did=own_did, now=now, max_age=max_age)


# -- work: pure CPU the driver runs and feeds back (`PeerSession.work_done`) -----------------------


@dataclass(frozen=True, slots=True, eq=False)
class Work(SessionEvent, ABC):
    """Pure work of this session the driver runs (`run()`: on a verify thread in the node,
    inline in a simulator) and feeds back with its result to `PeerSession.work_done`. Its
    CPU time is the peer's: the driver charges it (`charge_cpu`). What the peer sent
    cannot make `run()` raise: a refusal comes back as the result."""

    @abstractmethod
    def run(self) -> Any: ...


@dataclass(frozen=True, slots=True, eq=False)
class Pause(Work):
    """The peer is in debt on its verification budget: its frame `data` waits `seconds`
    (the driver reads nothing more from it meanwhile), then goes back to `work_done`
    (`run()` has nothing to compute). `waits`: the pauses this frame had."""

    data: bytes
    seconds: float
    waits: int

    def run(self) -> None:
        return None


@dataclass(frozen=True, slots=True, eq=False)
class ParseFrame(Work):
    """A frame over peer.offload_frame_bytes to parse off the loop: its envelope, or the FrameError."""

    data: bytes
    max_items: int

    def run(self) -> dict[str, Any] | M.FrameError:
        try:
            return M.parse_frame(self.data, max_items=self.max_items)
        except M.FrameError as exc:
            return exc


@dataclass(frozen=True, slots=True, eq=False)
class MceCheck(Work):
    """An `mce` frame's message to verify (the session's MceChecker, `now` as it arrived):
    the Mce, or the refusal (FrameError, SkewError, or a shape error)."""

    container: Any
    now: datetime
    peer_did: str
    own_did: str
    max_age: timedelta
    check: MceChecker

    def run(self) -> M.Mce | Exception:
        try:
            return self.check(self.container, peer_did=self.peer_did, own_did=self.own_did, now=self.now,
                              max_age=self.max_age)
        except PEER_FAULTS as exc:
            return exc


@dataclass(frozen=True, slots=True, eq=False)
class ReconcileWork(Work):
    """One `Reconciler.reconcile` call: the next message and what was found, or the ReconcileError."""

    name: str
    rec: Reconciler
    snap: Any
    data: bytes
    initiator: bool

    def run(self) -> tuple[bytes | None, list[bytes], list[bytes]] | ReconcileError:
        try:
            return self.rec.reconcile(self.data)
        except ReconcileError as exc:
            return exc


@dataclass(frozen=True, slots=True, eq=False)
class MceWork(Work):
    """MCE messages to this peer to build and sign (`run`: their frames, in order, queued by
    `work_done`): a 1 000-DID request costs ~2.5 ms (schema, canonical JSON, signature), an
    offer of 4 800 DIDs five of them. Each is dated already (the session's `_stamp`: every
    message of a connection after the one before, 22.1)."""

    sign: MceSigner
    peer_did: str
    #: (class, payload, timestamp)
    messages: list[tuple[str, dict[str, Any], datetime]]

    def run(self) -> list[bytes]:
        return [M.frame("mce", container=self.sign(class_, payload, peer_did=self.peer_did, now=stamp))
                for class_, payload, stamp in self.messages]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: Any) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise M.FrameError("malformed_frame", "not base64") from None


def spend(bucket: TokenBucket, mono: float, amount: float, what: str) -> None:
    """Take a peer's work from one of its budgets, or refuse the message (rate_limited)."""
    if not bucket.take(mono, amount):
        raise M.FrameError("rate_limited", what)


def reconciler(snap: Any) -> Reconciler:
    return Reconciler(snap.items, frame_size_limit=SY.FRAME_LIMIT, max_message_size=SY.FRAME_LIMIT)


def refusal_of(first: bytes) -> str | None:
    """The responder's verdict on the initiator (21.2): its first frame after the
    handshake is empty (admitted: None) or an error frame (the reason it refused);
    anything else breaks the handshake (TransportError malformed)."""
    if not first:
        return None
    try:
        refusal = M.parse_frame(first, max_items=1)
    except M.FrameError:
        refusal = {}
    reason = refusal.get("reason") if refusal.get("type") == "error" else None
    if reason is None:
        raise TransportError("malformed", "the responder's first frame is neither empty nor an error")
    return reason


def keeps_new_connection(own_did: str, peer_did: str, *, new_is_ours: bool, old_is_ours: bool,
                         new_hash: bytes, old_hash: bytes, new_relayed: bool = False,
                         old_relayed: bool = False) -> bool:
    """Of two connections between the same two nodes (21.3), is the new one kept? A direct
    one always wins over one through a circuit relay (`*_relayed`, 34.3: the relay's
    bandwidth is shared and limited). Otherwise, opened by different sides (both dialled
    at once): the one the smaller DID opened. Opened by the same side: the one with the
    smaller Noise handshake hash. Both ends know the same facts of both connections,
    whatever order they completed in, so both keep the same one.
    `*_is_ours`: this side opened that connection."""
    if new_relayed != old_relayed:
        return old_relayed
    if new_is_ours != old_is_ours:
        return new_is_ours == (own_did < peer_did)
    return new_hash < old_hash


def plan_forward(head: dict[str, Any], did: str, sessions: Iterable[PeerSession], *, origin: str | None,
                 now: datetime, fanout: int, rng: random.Random) -> tuple[list[PeerSession], list[PeerSession]]:
    """Where a stored container goes (23): the sessions to push it to and those to announce
    it to. Never back to `origin` (the peer it came from) nor to a peer that has it; only
    where scope lets it go; a broadcast only to peers whose declared interests it matches
    (`wants`, 33.3), by Plumtree (`choose_push`), a directed one to
    every eligible peer (eligible means: it serves a recipient)."""
    targets = [s for s in sessions if s.peer_did != origin and did not in s.known and s.may_receive(head, now)
               and s.wants(head, did)]
    if not targets:
        return [], []
    if head.get("broadcast") is True:
        return choose_push(targets, fanout, rng)
    return targets, []


def choose_push(targets: Sequence[Any], fanout: int, rng: random.Random) -> tuple[list[Any], list[Any]]:
    """Plumtree (docs/protocol.md 23.2): of the peers a broadcast goes to (anything with
    the session's `lazy`), push it to `fanout` random eager ones, announce it to the others."""
    targets = list(targets)
    rng.shuffle(targets)
    eager = [s for s in targets if not s.lazy][:fanout]
    return eager, [s for s in targets if s not in eager]


# -- the session ------------------------------------------------------------------------------


@dataclass(eq=False)
class PeerSession:
    """One authenticated peer (`peer_did`, its announced `peer_roles`) over `channel`."""

    identity: Identity
    peer_did: str
    ip: str
    channel: Channel
    peer_roles: tuple[str, ...] = ()
    initiator: bool = False
    limits: SessionLimits = field(default_factory=SessionLimits)
    book: ledger.Book = field(default_factory=lambda: ledger.Ledger().open())
    #: node-wide counters the session adds to (status, metrics)
    counters: Counter = field(default_factory=Counter)
    #: containers first received from it (stored): its usefulness, for eviction
    useful: int = 0
    received: int = 0
    sent: int = 0
    #: broadcasts kept from it on this connection because they match none of its interests (33.3)
    withheld: int = 0
    #: the link carried a broadcast twice (its ack said `duplicate`, or it pushed us one we
    #: held): announce broadcasts to it instead of pushing them (until it asks)
    lazy: bool = False
    #: relay: the seq after which its holdings for this peer were not offered yet (None: all offered)
    held_after: int | None = None
    #: container DID -> recipients we handed it to this relay for
    handoffs: dict[str, set[str]] = field(default_factory=dict)
    #: reconciliations: set name -> (Reconciler, Snapshot[, last use]); the ones this side
    #: started (it learns have/need) and the ones it answers
    recon_out: dict[str, tuple[Reconciler, Any]] = field(default_factory=dict)
    recon_in: dict[str, tuple[Reconciler, Any, float]] = field(default_factory=dict)
    #: when this side last started its reconciliations (mono)
    recon_at: float = 0.0
    #: what the peer declared it wants (its last peer_query; None: nothing declared, it gets everything)
    interests: Interests | None = None
    #: our index requests awaiting their answer: request DID -> entries still taken for it (31.3)
    index_asks: dict[str, int] = field(default_factory=dict)
    #: this node holds mail for others (relay/mailman role): it re-offers what the peer
    #: did not acknowledge (`reoffer_at`, 24.2)
    relaying: bool = False
    #: when the relay offers its holdings for the peer again (mono; None: nothing outstanding)
    reoffer_at: float | None = None
    #: when the last `containers` frame came (mono): requests wait longer while the peer answers
    answered_at: float = float("-inf")
    #: what verifies the peer's MCE messages and what signs ours (None: real crypto, `verify_mce`
    #: and `mce.build_mce` with `identity`); a simulator may pass cheap stand-ins
    check: MceChecker | None = None
    sign: MceSigner | None = None
    #: the peer listed hmp-nat/1 in its handshake: `nat` frames go both ways (docs/protocol.md 34)
    nat: bool = False
    #: why the session ended (None: open); set once by `close`
    close_reason: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.check is None:
            self.check = verify_mce
        if self.sign is None:
            self.sign = functools.partial(M.build_mce, self.identity)
        L = self.limits
        self.frames = TokenBucket(L.frames_per_second, L.frame_burst)
        self.containers = TokenBucket(L.containers_per_second, L.container_burst)
        #: containers it may ask of us (explicit requests), at the same rate as it may send them
        self.asks = TokenBucket(L.containers_per_second, L.container_burst)
        #: verification CPU seconds (its containers, its MCE messages, parsing its big frames)
        self.cpu = TokenBucket(L.verify_seconds_per_second, L.verify_burst_seconds)
        #: reconciliations it may start (peer.sync_per_minute)
        self.recon_starts = TokenBucket(L.sync_per_minute / 60.0, max(L.sync_per_minute, 1.0))
        #: what reconciliation found moves at half the peer's container budget
        self.pace = TokenBucket(L.containers_per_second / 2, L.container_burst / 4)
        self.strikes = Strikes(L.strike_threshold)
        #: index requests it may make (peer.index_requests_per_minute; docs/protocol.md 31.4)
        self.index_starts = TokenBucket(L.index_requests_per_minute / 60.0, max(L.index_requests_per_minute, 1.0))
        #: peer_query messages it may send (docs/protocol.md 33.2)
        self.queries = TokenBucket(L.peer_queries_per_minute / 60.0, max(L.peer_queries_per_minute, 1.0))
        book = self.book
        #: what it has (it offered or acknowledged it, or we gave it)
        self.known, self.got, self.gave = book.view(ledger.KNOWN), book.view(ledger.GOT), book.view(ledger.GAVE)
        #: broadcasts we only announced to it; what we offered it (it may acknowledge those too)
        self.announced, self.offered = book.view(ledger.ANNOUNCED), book.view(ledger.OFFERED)
        #: asked of it and not received yet (at most max_requested); its MCE messages seen
        self.requested, self.seen_mce = book.requested_view(), book.view(ledger.SEEN_MCE)
        #: the broadcasts `withheld` counts, so that each counts once however often it is found again
        self._withheld = book.view(ledger.WITHHELD)
        self._out: list[bytes] = []
        #: the re-offer timer: first armed (mono; it is postponed by progress, at most 4
        #: intervals from then) and re-offers in a row that brought no acknowledgement
        self._reoffer_since: float | None = None
        self._reoffer_idle = 0
        #: the date of the last MCE message sent (each is dated after the one before)
        self._last_stamp: datetime | None = None

    @property
    def did(self) -> str:
        return self.peer_did

    @property
    def peer_relays(self) -> bool:
        return bool(FORWARDING_ROLES.intersection(self.peer_roles))

    @property
    def closed(self) -> bool:
        return self.close_reason is not None

    def close(self, reason: str) -> None:
        """End the session (terminal): the entry points ignore input from now on (they
        return []); the frames queued before still come out of `data_to_send`."""
        if self.close_reason is None:
            self.close_reason = reason

    # -- output ------------------------------------------------------------------------------

    def data_to_send(self) -> list[bytes]:
        """The frames queued since the last call, in order (the adapter encrypts and sends them)."""
        out, self._out = self._out, []
        return out

    def send_mce(self, class_: str, payload: dict[str, Any], now: datetime, in_reply_to: str | None = None) -> str:
        """Queue an MCE message; its container DID. Each message of a connection is dated at
        least a millisecond after the one before (22.1): two equal messages (a re-offer, a
        repeated ack) within one millisecond would otherwise have the same DID, which the peer
        refuses as a replay."""
        message = self.sign(class_, payload, peer_did=self.peer_did, now=self._stamp(now), in_reply_to=in_reply_to)
        self._out.append(M.frame("mce", container=message))
        return message["hmp_container"]["head"]["container_did"]

    def _stamp(self, now: datetime) -> datetime:
        """The date of the next MCE message: `now` in milliseconds, or 1 ms after the last one."""
        stamp = now.replace(microsecond=now.microsecond // 1000 * 1000)
        if self._last_stamp is not None and stamp <= self._last_stamp:
            stamp = self._last_stamp + timedelta(milliseconds=1)
        self._last_stamp = stamp
        return stamp

    def admitted(self) -> None:
        """The responder admits the initiator: its first frame is empty (21.2)."""
        self._out.append(b"")

    def send_error(self, reason: str, detail: str) -> None:
        self._out.append(M.error_frame(reason, detail))

    def send_nat(self, op: str, **members: Any) -> bool:
        """Queue a `nat` frame (docs/protocol.md 34); False (nothing queued) when the peer
        did not offer hmp-nat/1."""
        if not self.nat or self.closed:
            return False
        self._out.append(M.frame("nat", op=op, **members))
        return True

    def _send_reconcile(self, **members: Any) -> None:
        data = M.frame("reconcile", **members)
        self.counters["sync_bytes_sent"] += len(data)  # reconciliation frames as sent (before the transport)
        self._out.append(data)

    # -- budgets and verdicts -----------------------------------------------------------------

    def charge_cpu(self, mono: float, seconds: float) -> None:
        """Verification CPU its frames cost (into debt: the work was done): what each `Work`
        took, and what the driver spent on the peer's behalf (its containers' verification)."""
        self.cpu.take(mono, seconds, force=True)

    def cpu_delay(self, mono: float) -> float:
        """How long its next frame waits (0: it is not in debt on its verification budget)."""
        bucket = self.cpu
        if bucket.take(mono, 0.0):
            return 0.0
        return min(5.0, -bucket.tokens / max(bucket.rate, 1e-6)) + 0.001

    def pace_delay(self, mono: float, n: int) -> float:
        """0 when `n` containers of a reconciliation transfer may go now (taken), else the wait."""
        if self.pace.take(mono, n):
            return 0.0
        return min(5.0, (n - self.pace.tokens) / max(self.pace.rate, 1e-6)) + 0.01

    def strike(self, reason: str, mono: float, times: int = 1) -> bool:
        """Count an offence; True when the peer has now crossed its strike threshold."""
        self.counters[f"strike_{reason}"] += times
        return self.strikes.add(reason, mono, times)

    def record_failed(self, reason: str, mono: float) -> list[SessionEvent]:
        """The record stream broke: the session ends (21.6), nothing is sent (the channel
        can no longer be trusted). Only a frame over the limit inside the channel is the
        peer's own doing and earns a strike; what a man in the middle can cause (tampered,
        replayed, reordered records) does not. Refused (cut) when that cuts it off."""
        if self.closed:
            return []
        cut = reason == "frame_too_large" and self.strike(reason, mono)
        self.close(reason)
        return [Refused(reason, "the record stream broke", True)] if cut else []

    def refuse(self, reason: str, detail: str, mono: float, *, sync: str | None = None,
               cause: str = "") -> list[SessionEvent]:
        """Refuse something the peer sent (the one way refusals are made): a strike and the
        error frame, `banned` and the session closed when that crosses the threshold."""
        if self.closed:
            return []
        cut = self.strike(reason, mono)
        self.send_error("banned" if cut else reason, detail)
        if cut:
            self.close("banned")
        return [Refused(reason, detail, cut, sync, cause)]

    def fault(self, exc: BaseException, mono: float) -> list[SessionEvent]:
        """What the peer sent could not be taken: a FrameError raised by a check is refused
        with its reason; a clock outside our window ends the session (ClockSkew: not an
        offence, 25.4, only said); any other shape error (PEER_FAULTS, here or in the
        driver's handling of an event) is refused as malformed_frame."""
        if self.closed:
            return []
        if isinstance(exc, M.SkewError):
            self.send_error("clock_skew", exc.detail)
            self.close("clock_skew")
            return [ClockSkew(exc.offset_seconds)]
        if isinstance(exc, M.FrameError):
            return self.refuse(exc.reason, exc.detail, mono, sync=exc.refusal if isinstance(exc, SyncRefusal) else None)
        return self.refuse("malformed_frame", f"cannot handle: {type(exc).__name__}", mono, cause=repr(exc)[:300])

    def _taking(self, mono: float, step: Callable[[], list[SessionEvent]]) -> list[SessionEvent]:
        """The events of one step on the peer's input, or its refusal (`fault`)."""
        try:
            return step()
        except PEER_FAULTS as exc:
            return self.fault(exc, mono)

    def may_receive(self, head: dict[str, Any], now: datetime, *, as_relay: bool = False) -> bool:
        """May the peer be given this container (scope, expiry, audience; as a relay for others)?"""
        return may_forward(head, peer_ip=self.ip, channel=self.channel, now=now, peer_dids=[self.peer_did],
                           peer_roles=self.peer_roles if as_relay else ()).ok

    def screen(self, head: Any, now: datetime, own_roles: Sequence[str]) -> str | None:
        """Why the peer may not hand us this container (its head: scope, expiry, audience
        for this node with `own_roles`), or None when it may."""
        if not isinstance(head, dict):
            return "malformed"
        decision = may_forward(head, peer_ip=self.ip, channel=self.channel, now=now, peer_dids=[self.identity.did],
                               peer_roles=own_roles)
        if decision.reason == "unknown_scope":
            # a scope this node cannot read: taken and stored, never forwarded (profile section 13)
            decision = may_forward({**head, "network": ""}, peer_ip=self.ip, channel=self.channel, now=now,
                                   peer_dids=[self.identity.did], peer_roles=own_roles)
        return None if decision.ok else decision.reason

    def expire_reconciliations(self, idle_before: float) -> None:
        """Drop the answered reconciliations unused since `idle_before` (they hold a snapshot)."""
        for name in [n for n, e in self.recon_in.items() if e[2] < idle_before]:
            del self.recon_in[name]

    # -- timers (acknowledgement deadlines, 22.2 and 24.2) -----------------------------------------

    def next_timer(self) -> float | None:
        """When `handle_timer` has something to do (mono), or None."""
        if self.closed:
            return None
        times = [t for t in (self._request_deadline(), self.reoffer_at) if t is not None]
        return min(times) if times else None

    def handle_timer(self, mono: float) -> list[SessionEvent]:
        """Deadlines that passed: requests not answered are forgotten (counted
        requests_expired; the container is asked for at its next offer) and a relay's
        re-offer is due (ReofferHeld)."""
        if self.closed:
            return []
        timeout = self.limits.request_timeout_seconds
        # while the peer keeps delivering, it is busy answering: its requests wait up to 3 timeouts
        cutoff = mono if mono - self.answered_at >= timeout else mono - 2 * timeout
        expired = self.requested.expire(cutoff)
        if expired:
            self.counters["requests_expired"] += expired
        if self.reoffer_at is not None and self.reoffer_at <= mono:
            self.reoffer_at = self._reoffer_since = None
            self._reoffer_idle += 1
            return [ReofferHeld()]
        return []

    def _request_deadline(self) -> float | None:
        first = self.requested.next_deadline()
        if first is None:
            return None
        timeout = self.limits.request_timeout_seconds
        return max(first, min(self.answered_at + timeout, first + 2 * timeout))

    def _arm_reoffer(self, mono: float) -> None:
        """Something the peer should acknowledge went out (or progress was made): the
        relay's re-offer comes one interval after the last of it, at most four intervals
        after it was first armed (a steady stream must not postpone it for ever)."""
        if not self.relaying:
            return
        if self._reoffer_since is None:
            self._reoffer_since = mono
        interval = self.limits.relay_reoffer_seconds * 2 ** min(self._reoffer_idle, 3)
        self.reoffer_at = min(mono + interval, self._reoffer_since + 4 * interval)

    # -- input: the entry points ----------------------------------------------------------------

    def frame_received(self, data: bytes, mono: float, now: datetime) -> list[SessionEvent]:
        """A frame of the peer: the events it brings. In this order: the frame budget
        (peer.frames_per_second, else Refused rate_limited), a Pause while the peer is in
        debt on its verification budget, the parse (inline, or ParseFrame off the loop when
        over peer.offload_frame_bytes), then what it means (an `mce` frame: MceCheck)."""
        if self.closed:
            return []
        if not self.frames.take(mono):
            return self.refuse("rate_limited", "too many frames", mono)
        return self._admit(data, mono, now, 0)

    def work_done(self, work: Work, result: Any, mono: float, now: datetime) -> list[SessionEvent]:
        """The result of `work.run()` (after the wait of a Pause): the events that follow."""
        if self.closed:
            return []
        if isinstance(work, Pause):
            return self._admit(work.data, mono, now, work.waits)
        if isinstance(work, MceWork):
            self._out.extend(result)
            return []
        if isinstance(result, BaseException) and not isinstance(result, ReconcileError):
            return self.fault(result, mono)
        if isinstance(work, ParseFrame):
            return self._taking(mono, lambda: self._receive(result, mono, now))
        if isinstance(work, MceCheck):
            return [ClockSample((result.timestamp - work.now).total_seconds()),
                    *self._taking(mono, lambda: self._mce_checked(result, mono, now))]
        if isinstance(work, ReconcileWork):
            return self._taking(mono, lambda: self._reconciled(work, result, mono))
        raise TypeError(f"not work of a session: {work!r:.80}")

    def _admit(self, data: bytes, mono: float, now: datetime, waits: int) -> list[SessionEvent]:
        """A frame within its budget: it waits while the peer is in debt (at most
        MAX_CPU_WAITS pauses: each refills what was missing), then is parsed."""
        delay = self.cpu_delay(mono)
        if delay and waits < MAX_CPU_WAITS:
            self.counters["verify_throttled"] += 1
            return [Pause(data, delay, waits + 1)]
        if len(data) > self.limits.offload_frame_bytes:
            return [ParseFrame(data, self.limits.max_items_per_frame)]
        return self._taking(mono, lambda: self._receive(M.parse_frame(data, max_items=self.limits.max_items_per_frame),
                                                        mono, now))

    def _receive(self, message: dict[str, Any], mono: float, now: datetime) -> list[SessionEvent]:
        """A parsed frame: the events it brings (FrameError when refused)."""
        kind = message["type"]
        if kind == "containers":
            return self._on_containers(message["items"], mono)
        if kind == "mce":
            return [MceCheck(message["container"], now, self.peer_did, self.identity.did,
                             timedelta(seconds=self.limits.mce_max_age_seconds), self.check)]
        if kind == "reconcile":
            return self._on_reconcile(message, mono)
        if kind == "nat":
            if not self.nat:
                raise M.FrameError("malformed_frame", "a nat frame, but hmp-nat/1 was not in your handshake")
            return [NatReceived(message["op"], message)]
        reason = message["reason"]  # error (parse_frame admits no other type)
        self.counters[f"peer_error_{reason if reason in M.ERROR_REASONS else 'other'}"] += 1
        return [PeerError(reason, str(message.get("detail", ""))[:200])]

    def _mce_checked(self, mce: M.Mce, mono: float, now: datetime) -> list[SessionEvent]:
        """A verified MCE message: refused when replayed on this connection, else its events."""
        if mce.did in self.seen_mce:
            raise M.FrameError("bad_mce", "message replayed on this connection")
        self.seen_mce.add(mce.did)
        p = mce.payload
        class_ = mce.class_
        if class_ == "container_request":
            if IX.is_index_request(p):  # spec 12.9 (docs/protocol.md 31)
                return self._on_index_request(mce, p, mono, now)
            return self._on_request(p, mono)
        if class_ == "container_delta":
            # announcements, a relay's offer of what it holds for us, or a v1 catch-up page
            # (its `cursor`/`complete` are ignored: catch-up is by reconciliation, 22.4);
            # `modified` and `removed` are judged by the adapter (hmpnode.net.delta, 32)
            return self._on_delta(p, mono)
        if class_ == "container_index":
            if mce.reply_to is not None:  # an answer to an index request (31.3), never an offer
                return self._on_index_entries(mce.reply_to, p)
            return self._on_offer(list(p.keys()), mono)
        if class_ == "container_response":
            if mce.reply_to is not None:  # closes an answer to an index request (31.3)
                return self._on_index_done(mce.reply_to, p)
            available = {a.get("container_did") for a in p.get("available", []) if isinstance(a, dict)}
            omitted = self.requested.keep_only(available)  # asked but not coming: asked for at its next offer
            if omitted:
                self.counters["requests_omitted"] += omitted
            return []
        if class_ == "container_ack":
            return self._on_ack(p, mono)
        if class_ == "peer_query":
            return self._on_peer_query(p, mono)
        if class_ in ("referenced-by_exchange", "evaluations_exchange"):
            # signed blocks for up to 1 000 containers, each costs what a container does
            items = [(did, block) for did, block in list(p.items())[:MAX_BLOCKS] if isinstance(block, dict)]
            if items:
                spend(self.containers, mono, len(items), "blocks sent faster than peer.containers_per_second")
                return [BlocksReceived("referenced_by" if class_.startswith("referenced") else "evaluations", items)]
            return []
        raise M.FrameError("bad_mce", f"class {class_!r:.60} is not an MCE class")  # check_mce admits none

    # containers -------------------------------------------------------------------------------

    def _on_containers(self, items: list[Any], mono: float) -> list[SessionEvent]:
        spend(self.containers, mono, len(items), "too many containers")
        self.received += len(items)
        self.answered_at = mono
        dids: list[str | None] = []
        heads: list[Any] = []
        for item in items:
            hmp = item.get("hmp_container") if isinstance(item, dict) else None
            head = hmp.get("head") if isinstance(hmp, dict) else None
            did = head.get("container_did") if isinstance(head, dict) else None
            dids.append(did if isinstance(did, str) and len(did) <= 512 else None)
            heads.append(head)
        return [ContainersReceived(items, dids, heads)]

    def ingested(self, event: ContainersReceived, outcomes: dict[int, Any], rejected: list[dict[str, Any]],
                 mono: float, now: datetime) -> Ingested:
        """The node's verdicts on a `containers` frame: `outcomes` maps an item's index to
        its ingest result (`status`, `did`, `seq`, `reason`, `detail`), `rejected` are the
        items refused before ingest. Queues the `container_ack` (acknowledged, rejected,
        duplicate pushes: "announce, don't push", 23.2) and strikes invalid containers."""
        acknowledged: list[str] = []
        pushed_twice: list[str] = []  # broadcasts pushed to us that we held already
        stored: list[tuple[int, int]] = []
        rejected = list(rejected)
        dids, heads = event.dids, event.heads
        for i, result in outcomes.items():
            if result.status in ("stored", "duplicate", "conflict"):
                acknowledged.append(result.did or dids[i] or "")
                if result.status == "stored":
                    self.useful += 1  # first received from this peer: what keeps it in its slot
                    stored.append((i, result.seq))
                if (result.status == "duplicate" and dids[i] not in self.requested
                        and heads[i].get("broadcast") is True):
                    pushed_twice.append(dids[i])
            else:
                rejected.append({"container_did": dids[i] or "", "reason": result.reason or "rejected",
                                 "detail": (result.detail or "")[:200]})
        if pushed_twice and not self.lazy:
            # both ends prune (Plumtree): the link carried a copy another path brought
            # first, so we announce to it too; a request for what we announce grafts it
            self.lazy = True
            self.counters["pruned_pusher"] += 1
        self.counters["containers_received"] += len(event.items)
        self.counters["containers_accepted"] += len(acknowledged)
        for d in dids:
            if d:
                if d in self.got:
                    self.counters["received_twice_on_connection"] += 1
                self.got.add(d)
        self.known.update(d for d in dids if d)
        # answered (whatever the verdict: one refused may be asked for at its next offer);
        # what is held now needs no request of anyone (on a closed book too: it is held)
        self.answered_at = mono
        self.requested.answered(d for d in dids if d)
        self.book.ledger.inflight.settle(acknowledged)
        payload: dict[str, Any] = {"acknowledged": [d for d in acknowledged if d.startswith("did:")]}
        if rejected:
            payload["rejected"] = [r for r in rejected if r["container_did"].startswith("did:")] or []
        if pushed_twice:
            payload["duplicate"] = pushed_twice
        self.send_mce("container_ack", payload, now)
        bad = sum(1 for r in rejected if r["reason"] not in NOT_OFFENCES)
        refused = None
        if bad and not self.closed and self.strike("rejected_container", mono, bad):
            self.send_error("banned", "too many invalid containers")
            self.close("banned")
            refused = Refused("rejected_container", "too many invalid containers", True)
        own = self.identity.did
        taken = set(acknowledged)
        for_us = [d for d, h in zip(dids, heads, strict=True)
                  if d in taken and isinstance(h, dict) and own in recipients_of(h)]
        return Ingested(acknowledged, list(dict.fromkeys(for_us)), stored, refused)

    def select_push(self, dids: Iterable[str], *, relay_for: str | None = None, asked: bool = False,
                    again: bool = False) -> list[str]:
        """Which of these containers to send: each at most once per connection, never what
        the peer has; `asked`: requested explicitly (sent even if we think it has it,
        unless this connection carried it already: a push crossing the request); `again`:
        their acknowledgement is overdue (the outbox's ack_timeout), so they are sent even
        if this connection carried them (a frame of it was dropped, or refused for want of
        room). With `relay_for`, the peer is a relay holding them for that recipient (its
        ack covers it)."""
        dids = list(dids)
        if asked and not again:
            dids = [d for d in dids if d not in self.gave]
        if asked or again:
            for d in dids:
                self.known.discard(d)
        out = []
        for d in dids:
            if relay_for is not None:  # also when carried already (for another recipient)
                self.handoffs.setdefault(d, set()).add(relay_for)
            if d in self.known:
                continue
            self.known.add(d)
            if d in self.gave:
                self.counters["sent_twice_on_connection"] += 1  # asked again, or an unacknowledged retry
            self.gave.add(d)
            out.append(d)
        return out

    def send_containers(self, items: Sequence[dict[str, Any]], mono: float) -> int:
        """Queue `containers` frames for these (selected) containers: at most
        max_items_per_frame each, half of max_frame_bytes, and within the receiver's
        (default) decompressed budget per frame. On a relay, they are to be acknowledged:
        the re-offer timer runs."""
        if not items:
            return 0
        self._arm_reoffer(mono)
        L = self.limits
        batch: list[dict[str, Any]] = []
        size = expands = 0
        limit = L.max_frame_bytes // 2
        expand_limit = L.max_frame_decompressed_bytes
        for item in items:
            n = len(orjson.dumps(item))
            x = inflight.decompressed_cost(item, expand_limit)
            if batch and (size + n > limit or expands + x > expand_limit or len(batch) >= L.max_items_per_frame):
                self._out.append(M.frame("containers", items=batch))
                batch, size, expands = [], 0, 0
            batch.append(item)
            size += n
            expands += x
        self._out.append(M.frame("containers", items=batch))
        self.sent += len(items)
        self.counters["containers_sent"] += len(items)
        return len(items)

    # offers, requests, acks ----------------------------------------------------------------------

    def _on_offer(self, dids: list[str], mono: float) -> list[SessionEvent]:
        """The peer holds these (the adapter hands them to `take_offered`). At most
        `max_requested` DIDs are outstanding per connection: an offer beyond that is
        refused (too_many_items) after the part that fits."""
        room = max(self.limits.max_requested - len(self.requested), 0)
        excess = len(dids) - room
        if excess > 0:
            dids = dids[:room]
        events: list[SessionEvent] = [Offered(dids)] if dids else []
        if excess > 0:
            self.counters["offers_refused"] += excess
            events += self.refuse("too_many_items", f"{excess} offered containers over the "
                                  f"{self.limits.max_requested} outstanding requests a connection may have", mono)
        return events

    def take_offered(self, dids: Sequence[str], settled: set[str], mono: float) -> list[str]:
        """Of offered DIDs (an `Offered` event's, or a slice of them), the ones to ask for:
        not `settled` (held, or forgotten by our agent: never asked for again), not asked
        of it already nor in flight to another peer (one request per container across
        connections, ledger.Inflight). All are noted as what the peer has; the ones
        returned are requested, each with its deadline (`handle_timer`). None once the
        connection's book is closed (it ended or was replaced, its answer cannot come).
        Then `ask`."""
        if self.book.closed:
            return []
        self.known.update(dids)
        asked = self.requested.claim([d for d in dids if d not in settled], mono,
                                     mono + self.limits.request_timeout_seconds)
        if asked and self.lazy:
            # what it offered reached us by no push: the link is a branch again, both ways
            # (it grafts on the request; both ends prune alike, `ingested`)
            self.lazy = False
            self.counters["grafted_asking"] += 1
        return asked

    def ask(self, missing: list[str], settled: Sequence[str], now: datetime) -> MceWork | None:
        """The requests for what `take_offered` chose (with their evaluations: spec 5.6;
        referenced-by we compute ourselves), REQUEST_CHUNK DIDs each, and to a relay the
        confirmation of the offered ones that are `settled` (so it stops holding them), to
        build and sign off the loop; None when there is nothing to send or the book or session is closed."""
        if self.book.closed or self.closed:
            return None
        messages: list[tuple[str, dict[str, Any], datetime]] = []
        if settled and self.peer_relays:
            messages.append(("container_ack", {"acknowledged": sorted(settled)}, self._stamp(now)))
        for i in range(0, len(missing), REQUEST_CHUNK):
            chunk = missing[i:i + REQUEST_CHUNK]
            messages.append(("container_request", {"request_container": chunk, "request_evaluations": chunk},
                             self._stamp(now)))
        return MceWork(self.sign, self.peer_did, messages) if messages else None

    def _on_request(self, p: dict[str, Any], mono: float) -> list[SessionEvent]:
        after = None
        if "after" in p:
            text = p["after"]
            # a cursor is a seq we gave out (an int64); anything else starts from the beginning
            valid = isinstance(text, str) and text.isascii() and text.isdigit() and len(text) <= 18
            after = int(text) if valid else 0
            # a page costs a quarter of what asking for its containers one by one would
            spend(self.asks, mono, min(self.limits.delta_page / 4, self.asks.burst), "catch-up pages asked for too fast")
        wanted = p.get("request_container") or []
        if isinstance(wanted, list) and wanted:
            spend(self.asks, mono, min(len(wanted), MAX_ASKED),
                  "containers requested faster than peer.containers_per_second")
        dids = [d for d in wanted[:MAX_ASKED] if isinstance(d, str)] if isinstance(wanted, list) else []
        if self.lazy and any(d in self.announced for d in dids):
            self.lazy = False  # it needed what we only announced: push again
            self.counters["grafted"] += 1
        rb = [d for d in p.get("request_referenced-by") or [] if isinstance(d, str)][:MAX_BLOCKS]
        ev = [d for d in p.get("request_evaluations") or [] if isinstance(d, str)][:MAX_BLOCKS]
        return [Requested(after, dids, bool(wanted), rb, ev)]

    def answer_page(self, added: dict[str, Any], now: datetime, *, after: int, read: Sequence[int]) -> None:
        """A catch-up page (`container_delta` answering `after`, 22.4): the entries the peer
        may receive of the `read` seqs (at most delta_page); `since` is now, the cursor the
        last seq read, complete when the page was not full."""
        self.offered.update(added)
        self.send_mce("container_delta", {"since": format_time(now), "added": added,
                                          "cursor": str(read[-1] if read else after),
                                          "complete": len(read) < self.limits.delta_page}, now)

    def answer_request(self, available: list[tuple[str, str]], now: datetime) -> None:
        """The `container_response` to a request: the (DID, signature) of what we send."""
        self.send_mce("container_response", {"available": [{"container_did": d, "signature": s}
                                                           for d, s in available]}, now)

    def announce(self, entries: dict[str, Any], now: datetime) -> int:
        """Announce broadcasts (a `container_delta` of index entries) it does not know of."""
        added = {d: e for d, e in entries.items() if d not in self.known}
        if added:
            self.known.update(added)
            self.announced.update(added)
            self.offered.update(added)
            self.send_mce("container_delta", {"since": format_time(now), "added": added}, now)
        return len(added)

    def offer_held(self, entries: dict[str, Any], now: datetime, mono: float, *, read: Sequence[int],
                   again: bool = False) -> None:
        """A relay offers what it holds for the peer (24.2): the entries it may receive of
        the page of `read` seqs; a full page (delta_page) means more: the next one starts
        after its last seq once the peer's acks released some (`held_after`). `again`: the
        re-offer of what was not acknowledged in time; what this connection carried of it
        is sent again when asked (it was lost, or refused for want of room)."""
        self.held_after = read[-1] if len(read) >= self.limits.delta_page else None
        if entries:
            if again:
                for d in entries:
                    self.gave.discard(d)
                self.counters["relay_reoffered"] += len(entries)
            self.offered.update(entries)
            self.counters["relay_offered"] += len(entries)
            self.send_mce("container_delta", {"since": format_time(now), "added": entries}, now)
            self._arm_reoffer(mono)

    def confirm(self, dids: Iterable[str], now: datetime) -> None:
        """Tell a relay that offered these too that we have them (it stops holding them)."""
        offered = sorted(d for d in dids if d in self.known)
        if offered:
            self.send_mce("container_ack", {"acknowledged": offered}, now)

    def _on_ack(self, p: dict[str, Any], mono: float) -> list[SessionEvent]:
        if p.get("duplicate") and not self.lazy:
            self.lazy = True  # it had what we pushed: from now on, announce broadcasts to it
            self.counters["pruned"] += 1
        # only what this connection gave or offered can be acknowledged on it (a peer's
        # made-up DIDs would otherwise fill `known` and cost a store write each)
        claimed = [d for d in p.get("acknowledged", []) if isinstance(d, str)]
        acked = [d for d in claimed if d in self.gave or d in self.offered]
        if len(acked) < len(claimed):
            self.counters["acks_not_given"] += len(claimed) - len(acked)
        for r in p.get("rejected", []) if isinstance(p.get("rejected"), list) else []:
            if isinstance(r, dict):
                reason = r.get("reason")
                known = isinstance(reason, str) and reason in M.REJECT_REASONS
                self.counters[f"peer_rejected_{reason if known else 'other'}"] += 1
                refused = r.get("container_did")
                if isinstance(refused, str) and refused in self.gave:  # not taken: it may be asked for again
                    self.gave.discard(refused)
                    self.known.discard(refused)
        if not acked:
            return []
        self._reoffer_idle = 0  # progress: a re-offer that is armed waits for the rest
        if self.reoffer_at is not None:
            self._arm_reoffer(mono)
        self.known.update(acked)
        pairs = [(d, self.peer_did) for d in acked]
        for d in acked:
            pairs.extend((d, r) for r in self.handoffs.pop(d, ()))
        return [Acknowledged(acked, pairs)]

    # reconciliation (docs/protocol.md 22.4) ---------------------------------------------------------

    def start_sync(self, snaps: dict[str, Any], mono: float) -> None:
        """Start one reconciliation per set (all in the same round trip)."""
        self.recon_at = mono
        self.recon_out.clear()
        for name, snap in snaps.items():
            rec = reconciler(snap)
            self.recon_out[name] = (rec, snap)
            self._send_reconcile(set=name, start=True, msg=b64(rec.initiate()))
            self.counters["sync_started"] += 1
            self.counters["sync_messages_sent"] += 1

    def _on_reconcile(self, message: dict[str, Any], mono: float) -> list[SessionEvent]:
        name = message["set"]
        if "want" in message:
            blob = unb64(message["want"])
            n = len(blob) // ID_SIZE
            if len(blob) % ID_SIZE or not 0 < n <= SY.MAX_WANT:
                raise M.FrameError("malformed_frame", f"want: 1..{SY.MAX_WANT} ids of {ID_SIZE} bytes")
            spend(self.asks, mono, n, "containers requested faster than peer.containers_per_second")
            entry = self.recon_in.get(name)
            return [WantReceived(name, [blob[i * ID_SIZE:(i + 1) * ID_SIZE] for i in range(n)],
                                 entry[1] if entry is not None else None)]
        if "reply" in message:  # an answer to a reconciliation we started
            out = self.recon_out.get(name)
            if out is None:
                raise M.FrameError("malformed_frame", "a reconcile reply to no reconciliation")
            return [ReconcileWork(name, out[0], out[1], unb64(message["reply"]), True)]
        data = unb64(message["msg"])
        if message.get("start") is True:
            if not self.recon_starts.take(mono):
                raise SyncRefusal("rate_limited", "reconciliations started faster than peer.sync_per_minute",
                                  "rate_limited")
            return [ReconcileStart(name, data)]
        entry = self.recon_in.get(name)
        if entry is None:
            raise M.FrameError("malformed_frame", "a reconcile message to no reconciliation")
        self.recon_in[name] = (entry[0], entry[1], mono)
        return [ReconcileWork(name, entry[0], entry[1], data, False)]

    def answer_start(self, start: ReconcileStart, snap: Any, mono: float) -> list[SessionEvent]:
        """The snapshot to answer a reconciliation the peer started (replaces one of that
        set): the ReconcileWork of its first step."""
        if self.closed:
            return []
        rec = reconciler(snap)
        self.recon_in[start.name] = (rec, snap, mono)
        return [ReconcileWork(start.name, rec, snap, start.data, False)]

    def _reconciled(self, work: ReconcileWork, result: Any, mono: float) -> list[SessionEvent]:
        """The result of `work.run()`: the next message (or reply) queued; on the side that
        started it, a ReconcileStep with what was found. A bad message ends that
        reconciliation and is refused (bad_reconcile)."""
        name = work.name
        if isinstance(result, ReconcileError):
            (self.recon_out if work.initiator else self.recon_in).pop(name, None)
            raise SyncRefusal("bad_reconcile", result.reason, result.reason)
        out, have, need = result
        if not work.initiator:
            self.counters["sync_answered"] += 1
            self._send_reconcile(set=name, reply=b64(out))
            return []
        if out is not None:
            self.counters["sync_messages_sent"] += 1
            self._send_reconcile(set=name, msg=b64(out))
        else:
            self.recon_out.pop(name, None)
            self.counters["sync_done"] += 1
            self.counters[f"sync_round_trips_{name}"] += work.rec.rounds  # messages answered = round trips
            self.counters[f"sync_ms_{name}"] += int((mono - self.recon_at) * 1000)
        return [ReconcileStep(name, work.snap, have, need)] if have or need else []

    def send_want(self, name: str, ids: Sequence[bytes]) -> None:
        """Ask for containers a reconciliation found we lack (at most SY.MAX_WANT ids)."""
        self.counters["sync_wanted"] += len(ids)
        self._send_reconcile(set=name, want=b64(b"".join(ids)))

    # interests: peer_query (docs/protocol.md 33) ---------------------------------------------------

    def send_interests(self, interests: Interests, roles: Sequence[str], now: datetime) -> None:
        """Tell the peer what our agent wants (a `peer_query`, 33.1)."""
        self.send_mce("peer_query", interests.query_payload(roles), now)
        self.counters["peer_queries_sent"] += 1

    def _on_peer_query(self, p: dict[str, Any], mono: float) -> list[SessionEvent]:
        """The peer declares what it wants: it replaces what it declared before on this
        connection. Over peer_queries_per_minute: rate_limited; lists over
        max_interest_entries or entries that are no text: bad_mce (the old declaration stays)."""
        spend(self.queries, mono, 1, "peer_query messages faster than interests.queries_per_minute")
        try:
            declared = Interests.from_query(p, InterestLimits(max_entries=self.limits.max_interest_entries))
        except InterestError as exc:
            raise M.FrameError("bad_mce", f"peer_query: {exc}") from None
        self.interests = declared if declared.declared else None
        self.counters["peer_queries_received"] += 1
        return []

    def wants(self, head: dict[str, Any], did: str) -> bool:
        """May the container `did` with this head be pushed or announced to the peer unasked? A
        broadcast only when it matches what the peer declared (33.3); a directed container
        always (its recipients and relays get it whatever they declared). A broadcast kept
        from it is counted once per connection (`withheld`, node-wide `interests_filtered`),
        not at every reconciliation that finds the peer still lacks it."""
        if self.interests is None or head.get("broadcast") is not True or self.interests.matches(head):
            return True
        if did not in self._withheld:
            self._withheld.add(did)
            self.withheld += 1
            self.counters["interests_filtered"] += 1
        return False

    # -- container_delta `modified` and `removed` (issue 14; hmpnode.net.delta, docs/protocol.md 32) --------

    def _on_delta(self, p: dict[str, Any], mono: float) -> list[SessionEvent]:
        """A `container_delta`: `added` is an offer; `modified` and `removed` entries cost
        what a container does (each is a store lookup here) and at most MAX_BLOCKS of each
        are taken (the rest counted, not an offence)."""
        added, modified = p.get("added"), p.get("modified")
        modified = modified if isinstance(modified, dict) else {}
        entries = dict(list(modified.items())[:MAX_BLOCKS])
        dids, reasons = DL.read_removals(p, MAX_BLOCKS)
        if len(entries) + len(dids):
            spend(self.containers, mono, len(entries) + len(dids), "delta changes faster than peer.containers_per_second")
        removed = p.get("removed")
        dropped = len(modified) - len(entries) + (len(removed) if isinstance(removed, list) else 0) - len(dids)
        if dropped > 0:
            self.counters["delta_entries_ignored"] += dropped
        events = self._on_offer(list(added), mono) if isinstance(added, dict) and added else []
        if entries:
            events.append(Modified(entries))
        if dids:
            events.append(Removed(dids, reasons))
        return events

    def send_changes(self, modified: dict[str, Any], removed: list[str], reasons: dict[str, Any],
                     now: datetime) -> int:
        """Queue one `container_delta` of `modified` entries and `removed` DIDs (with their
        `removed_reasons`); the entries sent."""
        payload: dict[str, Any] = {"since": format_time(now)}
        if modified:
            payload["modified"] = modified
        if removed:
            payload["removed"] = removed
            payload["removed_reasons"] = reasons
        self.send_mce("container_delta", payload, now)
        return len(modified) + len(removed)

    def offered_by_delta(self, dids: list[str], mono: float) -> list[SessionEvent]:
        """`modified` entries of containers we lack: an offer of them, as before (22.1)."""
        return self._on_offer(dids, mono) if dids and not self.closed else []

    def ask_blocks(self, referenced_by: list[str], evaluations: list[str], now: datetime) -> None:
        """Ask for the blocks a peer's `modified` says changed (22.2, spec 5.6)."""
        for i in range(0, max(len(referenced_by), len(evaluations)), MAX_BLOCKS):
            rb, ev = referenced_by[i:i + MAX_BLOCKS], evaluations[i:i + MAX_BLOCKS]
            self.send_mce("container_request", {**({"request_referenced-by": rb} if rb else {}),
                                                **({"request_evaluations": ev} if ev else {})}, now)
            self.counters["delta_blocks_asked"] += len(rb) + len(ev)

    def peer_removed(self, dids: list[str], verdicts: dict[str, str], proofs: list[str],
                     mono: float) -> list[SessionEvent]:
        """What a peer's `removed` does to this connection: a DID we lack is not waited for
        from it; one it dropped that we cannot check is not offered to it again; the
        revocations it names that we lack are an offer (we ask for them, then check)."""
        for did in dids:
            verdict = verdicts.get(did)
            if verdict == "not_held":
                self.requested.discard(did)
            elif verdict == "unverified":
                self.known.add(did)
        return self._on_offer(list(dict.fromkeys(proofs)), mono) if proofs and not self.closed else []

    # the container index on request (spec 12.9; docs/protocol.md 31) ---------------------------

    def _on_index_request(self, mce: M.Mce, p: dict[str, Any], mono: float, now: datetime) -> list[SessionEvent]:
        """The peer asks for our index: declined (answered here) when over its budget or
        unreadable, else an IndexRequested for the adapter to read the store. The DIDs a
        request lists beside its selection are answered as any request (12.9.2: the union)."""
        others = self._on_request(p, mono) if set(p) - IX.REQUEST_KEYS else []
        if not self.index_starts.take(mono):
            self.answer_index(mce.did, None, now, declined="rate_limited",
                              detail="index requests faster than peer.index_requests_per_minute")
            return [IndexRequested(mce.did, None, "rate_limited"), *others]
        try:
            query = IX.parse_query(p)
        except IX.SelectionError as exc:
            self.answer_index(mce.did, None, now, declined="bad_selection", detail=str(exc))
            return [IndexRequested(mce.did, None, "bad_selection"), *others]
        return [IndexRequested(mce.did, query, None), *others]

    def index_limit(self, query: IX.IndexQuery) -> int:
        """Entries one answer carries: the requester's bound within ours (peer.index_page)."""
        return min(query.limit or self.limits.index_page, self.limits.index_page)

    def answer_index(self, request: str, page: IX.Page | None, now: datetime, *, ignored: Sequence[str] = (),
                     declined: str | None = None, detail: str = "") -> None:
        """Answer the index request `request`: its `container_index` page, then the
        `container_response` that closes it (12.9.3) -- or only that, declined."""
        if page is not None:
            self.send_mce("container_index", page.entries, now, in_reply_to=request)
            self.counters["index_answered"] += 1
            self.counters["index_entries_sent"] += len(page.entries)
            status: dict[str, Any] = {"selection_status": "processed", "index_cursor": str(page.cursor),
                                      "complete": page.complete}
            if ignored:
                status["selection_ignored"] = list(ignored)
        else:
            self.counters[f"index_declined_{declined}"] += 1
            status = {"selection_status": "declined", "reason": declined, "detail": detail[:200]}
        self.send_mce("container_response", {"available": [], **status}, now, in_reply_to=request)

    def ask_index(self, selections: Sequence[dict[str, Any]], now: datetime, *, nonce: str, after: str | None = None,
                  limit: int | None = None) -> str:
        """Ask the peer for its index (what `selections` match, from cursor `after`); the
        request's DID, which its answer names (`nonce`: fresh random text, so that two equal
        requests are two messages). At most MAX_INDEX_ASKS wait at once (the oldest is
        forgotten: its late answer is then ignored)."""
        bound = min(limit or self.limits.index_page, self.limits.index_page)
        payload = IX.request_payload(selections, after=after, limit=bound, nonce=nonce)
        did = self.send_mce("container_request", payload, now)
        while len(self.index_asks) >= MAX_INDEX_ASKS:
            self.index_asks.pop(next(iter(self.index_asks)))
        self.index_asks[did] = bound
        self.counters["index_asked"] += 1
        return did

    def _on_index_entries(self, request: str, p: dict[str, Any]) -> list[SessionEvent]:
        """A page of the peer's index answering `request`: at most the entries we asked
        for are taken, entries that are not objects with a head are dropped (counted)."""
        room = self.index_asks.get(request)
        if room is None:
            self.counters["index_unsolicited"] += 1  # late (forgotten) or never asked: not an offer either
            return []
        good = [(d, e) for d, e in p.items() if isinstance(e, dict) and isinstance(e.get("head"), dict)]
        taken = dict(good[:room])
        self.index_asks[request] = room - len(taken)
        self.counters["index_entries_received"] += len(taken)
        if len(taken) < len(p):
            self.counters["index_entries_dropped"] += len(p) - len(taken)
        self.known.update(taken)  # it holds them
        return [IndexEntries(request, taken)] if taken else []

    def _on_index_done(self, request: str, p: dict[str, Any]) -> list[SessionEvent]:
        """The `container_response` closing the answer to `request` (12.9.3)."""
        if self.index_asks.pop(request, None) is None:
            self.counters["index_unsolicited"] += 1  # late, or never asked: nothing to close
            return []
        status = p.get("selection_status")
        status = status if status in ("processed", "declined") else "unknown"
        cursor = p.get("index_cursor")
        cursor = cursor if isinstance(cursor, str) and cursor.isascii() and cursor.isdigit() and len(cursor) <= 18 \
            else None
        reason = p.get("reason")
        reason = reason if isinstance(reason, str) and reason in INDEX_DECLINES else None if status != "declined" \
            else "other"
        return [IndexDone(request, status, cursor, status == "processed" and p.get("complete") is True, reason)]


# -- events of container_delta `modified` and `removed` (issue 14) --------------------------------


@dataclass(frozen=True, slots=True)
class Modified(SessionEvent):
    """`modified` entries of a peer's delta (at most MAX_BLOCKS): the adapter compares
    their block hashes with ours (`delta.on_modified`)."""

    entries: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Removed(SessionEvent):
    """`removed` DIDs of a peer's delta (at most MAX_BLOCKS) and the reasons it gives
    (`removed_reasons`): the adapter applies what it can check (`delta.on_removed`)."""

    dids: list[str]
    reasons: dict[str, DL.Removal]

#: index requests of ours one session keeps waiting for an answer
MAX_INDEX_ASKS = 64
#: why a peer declines an index request (ours: rate_limited, bad_selection); others count as "other"
INDEX_DECLINES = frozenset({"rate_limited", "bad_selection"})


@dataclass(frozen=True, slots=True)
class IndexRequested(SessionEvent):
    """The peer asked for our index (`request`: its DID): read the store, `answer_index`.
    With `refusal` it was declined already (the adapter counts it)."""

    request: str
    query: IX.IndexQuery | None
    refusal: str | None


@dataclass(frozen=True, slots=True)
class IndexEntries(SessionEvent):
    """Entries of the peer's index answering our `request` (not offers: nothing is fetched)."""

    request: str
    entries: dict[str, Any]


@dataclass(frozen=True, slots=True)
class IndexDone(SessionEvent):
    """The peer closed its answer to `request`: processed or declined (`reason`), the cursor
    to ask from for more, and whether it reached the end of what matched."""

    request: str
    status: str
    cursor: str | None
    complete: bool
    reason: str | None
