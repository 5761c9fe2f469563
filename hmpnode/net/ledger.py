"""Who has what, per connection, in one node-wide bounded structure (issue 11).

A connection used to keep five sets of container DIDs (known, got, gave, announced,
offered: up to 50 000 DID strings each, ~10 MB a full set) plus its MCE replay
memory: a peer that offered made-up DIDs made the node hold ~30 MB on its behalf.
Here each connection has a `Book` in the node's `Ledger`: one dict from a 60-bit
keyed digest of a DID (a small int, not the ~100-byte string) to a bit mask of the
kinds it is in, created on the first entry (an idle connection holds nothing), and
the DIDs asked of the peer and not received yet (`requested`) as digests too (a dict:
a set's table of 20 000 ints alone is 2 MB, a dict's 0.6 MB).

Bounds: a book holds at most `session_entries` entries (its requested ones
included); the ledger at most `max_entries` over all books. Over a cap, the oldest
eighth of a book's entries falls off (oldest first added, as before), and over the
node-wide cap the largest book gives up its oldest eighth: one connection cannot
crowd out the others. Requested entries never fall off a cap (they are bounded by
peer.max_requested); each has a deadline instead (`Requested.expire`): a request
that is never answered on a connection that stays up is forgotten by then, so that
the next offer of the container is asked for.

One request per container at a time, node-wide (`Inflight`): a request in flight
belongs to the book that made it, and only that book's answer, expiry or end
releases it (a container that arrives and is held settles it wherever it came from).

What falls off costs at most a container sent again (answered as a duplicate), an
ack not counted (the outbox retries) or a withheld broadcast counted again
(`interests_withheld`): the same as the bounded sets before. The
digest is keyed with a random per-node key, so a peer cannot make up DIDs that
collide with real ones; between honest DIDs a collision (2^-60 per pair) at worst
makes the node skip sending one container to one peer, which another peer or the
next catch-up makes good.

Sans-IO: no sockets, no clock; mesh.py opens a book per session and closes it when
the session ends."""

from __future__ import annotations

import os
from collections.abc import Iterable
from hashlib import blake2b
from itertools import islice

#: the kinds of a book's entries (bits of its mask); FAILED: asked of this peer, not answered in time;
#: WITHHELD: a broadcast kept from this peer because it declared other interests (counted once)
KNOWN, GOT, GAVE, ANNOUNCED, OFFERED, SEEN_MCE, FAILED, WITHHELD = 1, 2, 4, 8, 16, 32, 64, 128


class Ledger:
    """All connections' books, with a node-wide cap on their entries."""

    def __init__(self, max_entries: int = 400_000, session_entries: int = 20_000, key: bytes | None = None):
        if max_entries < 1 or session_entries < 8:
            raise ValueError("ledger caps too small")
        self.max_entries = max_entries
        self.session_entries = session_entries
        self._key = key if key is not None else os.urandom(16)
        #: books that hold entries (an empty one is registered on its first entry)
        self._books: dict[int, Book] = {}
        self._next_id = 0
        #: entries of all open books
        self.entries = 0
        self.evicted_session = 0
        self.evicted_node = 0
        #: containers asked of some peer, node-wide (one request per container at a time)
        #: (a quarter of what one connection may hold: a peer can fill it with made-up offers,
        #: so it counts towards what one connection can make the node hold; under the
        #: 100 000 at which mesh.py used to prune its plain dict)
        self.inflight = Inflight(self, min(65_536, max(8, session_entries // 4)))

    def digest(self, did: object) -> int | None:
        """A DID's 60-bit keyed digest (None for what is not a string)."""
        if not isinstance(did, str):
            return None
        return int.from_bytes(blake2b(did.encode(), digest_size=8, key=self._key).digest(), "big") >> 4

    def open(self) -> Book:
        self._next_id += 1
        return Book(self, self._next_id)

    def close(self, book: Book) -> None:
        """The connection ended: its entries go, and what it was asked for and did not
        deliver is no longer in flight (it never comes on this connection: another peer's
        offer of it, e.g. a relay's on the connection that replaced this one, is taken up)."""
        if book.closed:
            return
        book.closed = True
        if book._requested:
            self.inflight.release(book._requested, book.id)
        if self._books.pop(book.id, None) is not None:
            self.entries -= book.size()
        book._bits = book._requested = None

    def largest(self) -> int:
        return max((b.size() for b in self._books.values()), default=0)

    def stats(self) -> dict[str, int]:
        return {"entries": self.entries, "max_entries": self.max_entries, "session_entries": self.session_entries,
                "books": len(self._books), "largest_book": self.largest(),
                "evicted_session": self.evicted_session, "evicted_node": self.evicted_node,
                "inflight": len(self.inflight), "inflight_evicted": self.inflight.evicted}

    # -- book bookkeeping ---------------------------------------------------------------

    def _grew(self, book: Book, n: int) -> None:
        if book.id not in self._books:
            self._books[book.id] = book
        self.entries += n
        if book.size() > self.session_entries:
            self.evicted_session += book._trim(self.session_entries - self.session_entries // 8)
        if self.entries > self.max_entries:
            victim = max(self._books.values(), key=Book.size)
            size = victim.size()
            self.evicted_node += victim._trim(min(size - size // 8, size - (self.entries - self.max_entries)))

    def _shrank(self, book: Book, n: int) -> None:
        self.entries -= n


class Book:
    """One connection's entries in the ledger."""

    __slots__ = ("ledger", "id", "closed", "_bits", "_requested")

    def __init__(self, ledger: Ledger, id_: int):
        self.ledger = ledger
        self.id = id_
        self.closed = False
        self._bits: dict[int, int] | None = None
        self._requested: dict[int, None] | None = None

    def size(self) -> int:
        return len(self._bits or ()) + len(self._requested or ())

    def view(self, kind: int) -> View:
        return View(self, kind)

    def requested_view(self) -> Requested:
        return Requested(self)

    def has(self, kind: int, did: object) -> bool:
        if not self._bits:
            return False
        key = self.ledger.digest(did)
        return key is not None and bool(self._bits.get(key, 0) & kind)

    def mark(self, kind: int, dids: Iterable[object]) -> None:
        digest = self.ledger.digest
        self._mark_keys(kind, (k for k in map(digest, dids) if k is not None))

    def _mark_keys(self, kind: int, keys: Iterable[int]) -> None:
        if self.closed:
            return
        new = 0
        for key in keys:
            if self._bits is None:
                self._bits = {}
            old = self._bits.get(key)
            if old is None:
                self._bits[key] = kind
                new += 1
                if new >= 256:  # the caps hold within one long update too
                    self.ledger._grew(self, new)
                    new = 0
            else:
                self._bits[key] = old | kind
        if new:
            self.ledger._grew(self, new)

    def unmark(self, kind: int, did: object) -> None:
        if not self._bits:
            return
        key = self.ledger.digest(did)
        old = self._bits.get(key) if key is not None else None
        if old is None or not old & kind:
            return
        if old & ~kind:
            self._bits[key] = old & ~kind
        else:
            del self._bits[key]
            self.ledger._shrank(self, 1)

    def _trim(self, keep: int) -> int:
        """Drop the oldest entries until at most `keep` remain (requested ones stay);
        how many were dropped."""
        bits = self._bits
        if not bits:
            return 0
        room = max(0, keep - len(self._requested or ()))
        drop = len(bits) - room
        if drop <= 0:
            return 0
        # a new dict: dropping from the front of a dict leaves holes a later scan walks over
        self._bits = dict(islice(bits.items(), drop, None)) if room else {}
        self.ledger.entries -= drop
        return drop


class View:
    """The entries of one kind in a book: the bounded set the mesh code uses
    (`in`, add, update, discard)."""

    __slots__ = ("book", "kind")

    def __init__(self, book: Book, kind: int):
        self.book, self.kind = book, kind

    def __contains__(self, did: object) -> bool:
        return self.book.has(self.kind, did)

    def add(self, did: object) -> None:
        self.book.mark(self.kind, (did,))

    def update(self, dids: Iterable[object]) -> None:
        self.book.mark(self.kind, dids)

    def discard(self, did: object) -> None:
        self.book.unmark(self.kind, did)


class Requested:
    """The DIDs asked of the peer and not received yet, each with its deadline (mono):
    bounded by peer.max_requested where they are added, they count towards the book's
    entries but never fall off a cap. Each holds the node-wide in-flight mark of its
    container (`Inflight`) until it is answered, omitted, expired or its book closes."""

    __slots__ = ("book",)

    def __init__(self, book: Book):
        self.book = book

    def _keys(self, dids: Iterable[object]) -> set[int]:  # transient: the peer's message
        digest = self.book.ledger.digest
        return {k for k in map(digest, dids) if k is not None}

    def __contains__(self, did: object) -> bool:
        req = self.book._requested
        return bool(req) and self.book.ledger.digest(did) in req

    def __len__(self) -> int:
        return len(self.book._requested or ())

    def __bool__(self) -> bool:
        return bool(self.book._requested)

    def claim(self, dids: Iterable[str], mono: float, until: float) -> list[str]:
        """Ask for these (not asked of this peer already, nor in flight to another one):
        each is recorded with its deadline `until` and takes the node-wide in-flight mark.
        The DIDs claimed, none once the book is closed (its answer cannot come)."""
        book = self.book
        if book.closed:
            return []
        inflight, digest = book.ledger.inflight, book.ledger.digest
        req = book._requested if book._requested is not None else {}
        bits = book._bits or {}
        claimed = []
        for did in dids:
            key = digest(did)
            # asked of this peer before and not answered in time: asked again, but without
            # keeping another peer's offer of it from being taken up (a peer that offers and
            # never delivers, first each time, must not starve the others)
            if key is None or key in req or not inflight.take(key, mono, until, book.id,
                                                              exclusive=not bits.get(key, 0) & FAILED):
                continue
            req[key] = until
            claimed.append(did)
        if claimed:
            book._requested = req
            book.ledger._grew(book, len(claimed))
        return claimed

    def next_deadline(self) -> float | None:
        """The earliest deadline (entries are added in deadline order: one timeout for all)."""
        req = self.book._requested
        return next(iter(req.values())) if req else None

    def expire(self, mono: float) -> int:
        """Forget the requests whose deadline passed (their in-flight marks go, and the
        containers are marked FAILED for this peer); how many."""
        req = self.book._requested
        if not req:
            return 0
        gone = []
        for key, until in req.items():
            if until > mono:
                break
            gone.append(key)
        self.book._mark_keys(FAILED, gone)
        return self._drop(gone)

    def answered(self, dids: Iterable[object]) -> int:
        """These came (whatever the verdict on them): no longer asked, their marks released."""
        req = self.book._requested
        if not req:
            return 0
        return self._drop([k for k in self._keys(dids) if k in req])

    def keep_only(self, dids: Iterable[object]) -> int:
        """The peer says only these are coming: the others are no longer asked (their
        marks released, so that another offer of them is taken up); how many went."""
        req = self.book._requested
        if not req:
            return 0
        keep = self._keys(dids)
        return self._drop([k for k in req if k not in keep])

    def discard(self, did: object) -> None:
        self.answered((did,))

    def _drop(self, keys: list[int]) -> int:
        book = self.book
        req = book._requested
        for key in keys:
            del req[key]
        book.ledger.inflight.release(keys, book.id)
        if not req:
            book._requested = None  # an emptied set gives its table back
        if keys:
            book.ledger._shrank(book, len(keys))
        return len(keys)


class Inflight:
    """Container DID -> until when (monotonic) a request for it is out to some peer, and
    which book asked, so that another peer's offer is taken up only if the first did not
    deliver in time.

    A peer that offers made-up DIDs and answers that none is coming put each into the
    old dict until it held 100 000 (~200 bytes a DID, ~20 MB). Here keys are digests
    and at most `cap` (a quarter of peer.ledger_session_entries) are kept, the oldest
    eighth falling off over it: what falls off costs at most the same container asked
    of two peers (one answers a duplicate)."""

    __slots__ = ("ledger", "cap", "evicted", "_until")

    def __init__(self, ledger: Ledger, cap: int):
        self.ledger, self.cap, self.evicted = ledger, cap, 0
        #: digest -> (until, id of the book that asked, whether it keeps other books from asking)
        self._until: dict[int, tuple[float, int, bool]] = {}

    def __len__(self) -> int:
        return len(self._until)

    def get(self, did: object, default: float = 0.0) -> float:
        key = self.ledger.digest(did)
        entry = self._until.get(key) if key is not None else None
        return entry[0] if entry is not None else default

    def take(self, key: int, mono: float, until: float, owner: int, *, exclusive: bool = True) -> bool:
        """Mark `key` in flight for `owner` until `until`, unless another book's exclusive
        request for it is still in flight at `mono`. A request that is not `exclusive`
        (asked again of a peer that failed it once) is made, but leaves the mark to any
        other book that asks (both may then deliver: the second copy is a duplicate)."""
        entry = self._until.get(key)
        if entry is not None and entry[0] > mono and entry[1] != owner:
            if entry[2]:
                return False
            if not exclusive:
                return True  # another weak request is out: this one is made too, the mark stays
        self._until[key] = (until, owner, exclusive)
        if len(self._until) > self.cap:
            drop = len(self._until) - (self.cap - self.cap // 8)
            self._until = dict(islice(self._until.items(), drop, None))
            self.evicted += drop
        return True

    def settle(self, dids: Iterable[object]) -> None:
        """These are held now: no request for them is needed any more, whoever made it."""
        digest = self.ledger.digest
        for did in dids:
            key = digest(did)
            if key is not None:
                self._until.pop(key, None)

    def release(self, keys: Iterable[int], owner: int) -> None:
        """Forget `owner`'s requests of these digests (answered, expired, or its connection
        ended); a mark another book took since is not `owner`'s to release."""
        until = self._until
        for key in keys:
            entry = until.get(key)
            if entry is not None and entry[1] == owner:
                del until[key]
