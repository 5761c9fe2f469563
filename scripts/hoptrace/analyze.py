"""The per-hop breakdown, the duplicates by how they came, and the depth of each broadcast's
delivery tree, from the lines of sitecustomize.py (its docstring says how). `--show-dups`: the
events around the first few duplicates."""
import json, sys, glob, statistics as st
from collections import defaultdict, Counter
d = sys.argv[1]
evs = []
for f in glob.glob(f"{d}/*.jsonl"):
    for line in open(f, "rb"):
        e = json.loads(line)
        if e.get("me"): evs.append(e)
evs.sort(key=lambda e: e["t"])
# broadcasts: forwarded from agent
bcast = {}
for e in evs:
    if e["k"] == "fwd":
        for did, src in zip(e["dids"], e["src"]):
            if src == "agent": bcast.setdefault(did, (e["me"], e["t0"]))
print("broadcasts", len(bcast))
def q(xs, p): xs = sorted(xs); return xs[min(len(xs)-1, int(p*len(xs)))] if xs else None
def fmt(xs): return f"n={len(xs)} med={1000*st.median(xs):.1f} p90={1000*q(xs,.9):.1f} mean={1000*st.mean(xs):.1f} ms" if xs else "-"
push = defaultdict(list)   # (did, from, to) -> push events
ann = {}
for e in evs:
    if e["k"] == "push":
        for did in e["dids"]: push[(did, e["me"], e["to"])].append(e)
    if e["k"] == "ann":
        for did in e["dids"]: ann.setdefault((did, e["me"], e["to"]), e)
rx = defaultdict(list)
for e in evs:
    if e["k"] == "rx":
        for did in e["dids"]: rx[(did, e["frm"], e["me"])].append(e)
rxdone = {}
for e in evs:
    if e["k"] == "rx_done":
        for did in e["dids"]: rxdone.setdefault((did, e["frm"], e["me"]), e)
ingest = defaultdict(list)
for e in evs:
    if e["k"] == "ingest":
        for did, status in e["res"]:
            if did in bcast: ingest[(did, e["me"])].append((e, status))
# per-node verify/held events, matched by time containment within ingest span
byme = defaultdict(list)
for e in evs: byme[e["me"]].append(e)
fwd_of = {}
for e in evs:
    if e["k"] == "fwd":
        for did in e["dids"]:
            if did in bcast: fwd_of.setdefault((did, e["me"]), e)
stages = defaultdict(list)
paths = Counter(); dupkind = Counter()
last = []
for did, (origin, t0) in bcast.items():
    arrivals = {}
    for (dd, me), items in ingest.items():
        if dd != did: continue
        for e, status in items:
            if status == "stored" and e["src"].startswith("peer:"):
                arrivals[me] = e
    if arrivals:
        lastme = max(arrivals, key=lambda m: arrivals[m]["t"])
        last.append(arrivals[lastme]["t"] - t0)
    for me, e in arrivals.items():
        frm = e["src"][5:]
        p = push.get((did, frm, me))
        r = rx.get((did, frm, me))
        if not p or not r: paths["unmatched"] += 1; continue
        p = p[0]; r = r[0]
        kind = "asked" if p["asked"] else "eager"
        paths[kind] += 1
        stages[f"{kind}: sender push() start->flushed"].append(p["t"] - p["t0"])
        stages[f"{kind}: flushed->fed (wire+ws queue)"].append((r["fed"] or r["t"]) - p["t"])
        stages[f"{kind}: fed->parsed (frame loop, parse)"].append(r["t"] - (r["fed"] or r["t"]))
        stages[f"{kind}: parsed->ingest start"].append(e["t0"] - r["t"])
        # inner spans
        vs = [x for x in byme[me] if x["k"] == "verify" and e["t0"] <= x["t0"] and x["t"] <= e["t"]]
        hs = [x for x in byme[me] if x["k"] == "held" and e["t0"] <= x["t0"] and x["t"] <= e["t"]]
        if hs: stages[f"{kind}: ingest: held lookup"].append(hs[0]["t"] - hs[0]["t0"])
        if vs:
            stages[f"{kind}: ingest: held->verify start"].append(vs[0]["t0"] - (hs[0]["t"] if hs else e["t0"]))
            stages[f"{kind}: ingest: verify"].append(vs[0]["t"] - vs[0]["t0"])
            stages[f"{kind}: ingest: verify->committed"].append(e["t"] - vs[0]["t"])
        f = fwd_of.get((did, me))
        if f:
            stages["fwd: committed->forward() start (tick, 2 reads, provider)"].append(f["t0"] - e["t"])
            stages["fwd: forward() (plan, push, announce, flush)"].append(f["t"] - f["t0"])
            stages["hop total: sender flushed->this node's forward done"].append(f["t"] - p["t"])
        if kind == "asked":
            a = ann.get((did, frm, me))
            if a:
                stages["asked: announce->push(asked) start"].append(p["t0"] - a["t"])
    # origin hop
    f = fwd_of.get((did, origin))
    if f: stages["origin: stored->forward() start"].append(f["t0"] - t0) if False else None
print("time to last node:", fmt(last))
print("first-arrival path:", dict(paths))
for k in sorted(stages): print(f"  {k:60s} {fmt(stages[k])}")
# duplicates
dups = Counter(); detail = Counter()
first_rx = {}
for (did, me), items in ingest.items():
    for e, status in items:
        if status == "stored": first_rx[(did, me)] = e
for (did, me), items in ingest.items():
    for e, status in items:
        if status != "duplicate" or not e["src"].startswith("peer:"): continue
        frm = e["src"][5:]
        p = push.get((did, frm, me))
        if not p: dups["unmatched"] += 1; continue
        p = p[0]
        kind = "asked" if p["asked"] else "eager"
        fr = first_rx.get((did, me))
        if fr is None: dups[kind + ": origin"] += 1; continue  # me is the origin?
        # did me send did to frm before frm's push started?
        mine = [x for x in push.get((did, me, frm), [])] 
        myann = ann.get((did, me, frm))
        told = min([x["t"] for x in mine] + ([myann["t"]] if myann else []), default=None)
        if p["t0"] < fr["t0"]:
            sub = "sent before I started ingesting my first copy (parallel paths)"
        elif told is not None and told > p["t0"]:
            sub = "sent while I held it, before I told the sender (crossing / my forward lag)"
        elif told is not None:
            sub = "sent after I told the sender (in flight)"
        else:
            sub = "sent while I held it; I never told the sender"
        dups[f"{kind}: {sub}"] += 1
nodes = len({e["me"] for e in evs})
print("duplicates per node per broadcast:", sum(dups.values()) / nodes / max(len(bcast), 1), "nodes", nodes)
for k, v in dups.most_common(): print(f"  {v:5d} {k}")
print("dupacks:", sum(1 for e in evs if e["k"] == "dupack"), "pruned:", sum(1 for e in evs if e["k"] == "dupack" and not e["lazy_before"]),
      "grafts:", sum(1 for e in evs if e["k"] == "graft"))
# how many pushes eager per broadcast per node vs announce
np = Counter(); na = Counter()
for (did, f, t), ps in push.items():
    if did in bcast:
        for p in ps: np["asked" if p["asked"] else "eager"] += 1
for (did, f, t) in ann:
    if did in bcast: na["ann"] += 1
print("pushes per broadcast:", {k: v / len(bcast) for k, v in np.items()}, "announces per broadcast:", na["ann"] / len(bcast))
if "--show-dups" in sys.argv[2:]:
    shown = 0
    for (did, me), items in ingest.items():
        for e, status in items:
            if status != "duplicate" or not e["src"].startswith("peer:"): continue
            frm = e["src"][5:]
            p = push.get((did, frm, me))
            if not p or p[0]["asked"]: continue
            fr = first_rx.get((did, me))
            if fr is None or p[0]["t0"] < fr["t0"]: continue
            if push.get((did, me, frm)) or ann.get((did, me, frm)): continue
            shown += 1
            if shown > 3: break
            print("=== dup", did[-8:], "at", me[-6:], "from", frm[-6:], "origin", bcast[did][0][-6:])
            for x in evs:
                if x["me"] in (me, frm) and (did in x.get("dids", []) or any(r[0] == did for r in x.get("res", []))):
                    print(f"  {x['t']-bcast[did][1]:8.3f} {x['me'][-6:]} {x['k']:8s} {str(x.get('frm') or x.get('to') or x.get('src'))[-6:]} asked={x.get('asked')} {[r[1] for r in x.get('res', []) if r[0]==did]}")

# the depth of each broadcast's delivery tree (first arrivals), and of its last node
first = {}
for e in evs:
    if e["k"] == "ingest":
        for did, s in e["res"]:
            if did in bcast and s == "stored" and e["src"].startswith("peer:"):
                first.setdefault((did, e["me"]), (e["src"][5:], e["t"]))
maxdepths = []
for i, did in enumerate(sorted(bcast, key=lambda d: bcast[d][1])):
    origin, t0 = bcast[did]
    depth = {origin: 0}
    def dep(m, k=0):
        if m not in depth:
            depth[m] = 99 if k > 40 else dep(first[(did, m)][0], k + 1) + 1
        return depth[m]
    nodes = [m for (d, m) in first if d == did]
    if not nodes:
        continue
    last = max(nodes, key=lambda m: first[(did, m)][1])
    maxdepths.append(max(dep(m) for m in nodes))
    print(f"broadcast {i}: tree depth {maxdepths[-1]}, last node at depth {dep(last)},"
          f" {1000 * (first[(did, last)][1] - t0):.0f} ms after the origin stored it")
print("tree depth mean", round(st.mean(maxdepths), 2), "after the first 3:", round(st.mean(maxdepths[3:]), 2) if len(maxdepths) > 3 else None)
