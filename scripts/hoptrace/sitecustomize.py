"""Hop tracer for ./scripts/bench_mesh (a probe, not part of the node): with this directory on
PYTHONPATH and HMPTRACE_DIR set, every node process wraps a few of its own functions and writes one
JSON line per step of a broadcast (frame received, held lookup, verify, ingest committed, forward,
push, announce, duplicate ack, graft) with `time.monotonic()`, one clock for every process of the
host. `analyze.py DIR` turns the lines into the per-hop breakdown of docs/benchmarks-journal.md:

    mkdir /tmp/hops && PYTHONPATH=scripts/hoptrace HMPTRACE_DIR=/tmp/hops ./scripts/bench_mesh --nodes 30
    .venv/bin/python scripts/hoptrace/analyze.py /tmp/hops

It wraps methods of MeshCore and private methods of Node and PeerSession: it follows them, or it
breaks loudly."""
import os, time
_dir = os.environ.get("HMPTRACE_DIR")
if _dir:
    import orjson
    from hmpnode.net import core as _core, gossip as _gossip, session as _se, transport as _tr
    from hmpnode import node as _node
    _fh = open(os.path.join(_dir, f"{os.getpid()}.jsonl"), "ab", buffering=0)
    _me = {"did": None}
    def ev(kind, **kw):
        kw["k"] = kind; kw["t"] = time.monotonic(); kw["me"] = _me["did"]
        _fh.write(orjson.dumps(kw) + b"\n")

    _feed = _tr.Transport.feed
    def feed(self, data):
        self._fed_at = time.monotonic()
        return _feed(self, data)
    _tr.Transport.feed = feed

    # the core decides in generators (hmpnode.net.core): wrapped with `yield from`
    _containers = _core.MeshCore.containers
    def containers(self, link, event):
        _me["did"] = self.own
        t0 = time.monotonic()
        dids = [d for d, h in zip(event.dids, event.heads) if isinstance(h, dict) and h.get("broadcast") is True]
        if dids:
            ev("rx", frm=link.did, dids=dids, fed=getattr(link.transport, "_fed_at", None))
        out = yield from _containers(self, link, event)
        if dids:
            ev("rx_done", frm=link.did, dids=dids, t0=t0)
        return out
    _core.MeshCore.containers = containers

    _offered = _core.MeshCore.offered
    def offered(self, link, event):
        ev("offered", frm=link.did, dids=event.dids)
        return (yield from _offered(self, link, event))
    _core.MeshCore.offered = offered

    _requested = _core.MeshCore.requested
    def requested(self, link, event):
        if event.dids:
            ev("requested", frm=link.did, dids=event.dids)
        return (yield from _requested(self, link, event))
    _core.MeshCore.requested = requested

    _ingest = _node.Node.ingest
    async def ingest(self, raws, *, source="agent", **kw):
        t0 = time.monotonic()
        res = await _ingest(self, raws, source=source, **kw)
        ev("ingest", src=source, t0=t0, res=[(r.did, r.status) for r in res])
        return res
    _node.Node.ingest = ingest

    _verify = _node.Node._verify
    async def verify(self, raws, *a, **kw):
        t0 = time.monotonic()
        out = await _verify(self, raws, *a, **kw)
        ev("verify", t0=t0, n=len(raws), cpu=out[1])
        return out
    _node.Node._verify = verify

    _held = _node.Node._answer_held
    async def held(self, *a, **kw):
        t0 = time.monotonic()
        out = await _held(self, *a, **kw)
        ev("held", t0=t0)
        return out
    _node.Node._answer_held = held

    _wake = _node.Node._wake
    def wake(self, *a, **kw):
        ev("wake", seq=self.last_seq)
        return _wake(self, *a, **kw)
    _node.Node._wake = wake

    _fwd = _gossip.forward
    async def fwd(mesh, rows):
        t0 = time.monotonic()
        await _fwd(mesh, rows)
        ev("fwd", t0=t0, dids=[r.did for r in rows], src=[r.source for r in rows])
    _gossip.forward = fwd

    _push = _core.MeshCore.push
    def push(self, link, rows, **kw):
        t0 = time.monotonic()
        out = yield from _push(self, link, rows, **kw)
        if out:
            ev("push", to=link.did, dids=[r.did for r in out], t0=t0, asked=kw.get("asked", False),
               again=kw.get("again", False), relay=kw.get("relay_for"))
        return out
    _core.MeshCore.push = push

    _ann = _se.PeerSession.announce
    def ann(self, entries, now):
        n = _ann(self, entries, now)
        if n:
            ev("ann", to=self.peer_did, dids=list(entries))
        return n
    _se.PeerSession.announce = ann

    _ack = _se.PeerSession._on_ack
    def on_ack(self, p, mono):
        if p.get("duplicate"):
            ev("dupack", frm=self.peer_did, dids=p.get("duplicate"), lazy_before=self.lazy)
        return _ack(self, p, mono)
    _se.PeerSession._on_ack = on_ack

    _req = _se.PeerSession._on_request
    def on_req(self, p, mono):
        lazy = self.lazy
        out = _req(self, p, mono)
        if lazy and not self.lazy:
            ev("graft", frm=self.peer_did)
        return out
    _se.PeerSession._on_request = on_req
