"""Recall quality and latency against a real node (issue 12): does recall find the current
fact, say "I don't know", and spend the budget on content?

    ./scripts/bench_recall_quality [--quick] [--sizes 2000,100000] [--seed 12] [--questions 150] [--code DIR]

A seeded corpus (`--seed`) is built per store size: port facts of services
("billing-v3") with 1-200 versions (a supersede chain, the wording varying),
look-alikes (the same service's backups, other services' ports, the same name
at another version), per fact sometimes a contradicted twin (another sender,
contradicted by the author), an expired twin, a negatively evaluated twin and a
twin from a sender whose key is then revoked; decisions with short look-alike
notes about the same topic; people with a role and a namesake; config values
with 1-3 versions; noise notes from a vocabulary that includes the domain words.
Everything is imported through `POST /v1/containers/import` (batches of 1 000,
the fastest honest path; the time it took is printed) into a real `hmpnode run`
process; negative evaluations (by the node's agent) through
`POST /v1/containers/{did}/evaluations`.

Clusters with made-up lowercase names ("felbur") and one or two attributes each
("the felbur cluster's backup window is 02:00 UTC"), so that the familiar words
are rare and a name is the one thing telling two questions apart (issue 21).

Questions: one per planted fact (answerable) and about as many about entities never
stored (an unseen version of a known service, unknown people, in capitals and in
lowercase, topics, config keys, a made-up cluster name with a familiar attribute:
"what is the backup window of the zarnik cluster"), at most `--questions` of each
(a seeded sample). Variants of answerable questions, each reported apart (`variants`:
hit@1 and false abstain): a typo in a common word of 6 letters or more ("bakup"), a
common English phrase the corpus never uses appended ("these days"), a word in the
plural, the whole question in lowercase, and for backup windows the hour asked about
("is the felbur cluster's backup window at 02:00 UTC?"). Each is asked through `POST /v1/recall` at 800 / 4 000 / 20 000 tokens
(bytes 8x tokens, so tokens bind). Items are recognised by their payload text
(the envelope format may change, the texts are unique). Figures, at 4 000 tokens
unless named: hit@1 (first item is the current value), hit within budget (the
current value among the items at 800 tokens), stale (an answer holding a
superseded, twin or expired value of the asked fact), unknown-entity abstain rate
(no item; also per kind), false abstain (answerable, no item), empty-answer tokens and per-item
overhead (used tokens minus payload tokens minus the empty answer, per item),
and p50/p95/p99/max latency per budget and store size (HTTP round trip on loopback).
`--code DIR` runs the node from another checkout (the BEFORE figures). The last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import orjson

from _benchlib import node_session, percentile, positive_ints, start_node, stop_node  # scripts/ is on sys.path

from hmpnode.container.build import build_container
from hmpnode.container.canonical import canonical_json
from hmpnode.identity import Identity
from hmpnode.memory.tokens import count_canonical_tokens
from hmpnode.net.announce import build_peer_announce

BUDGETS = (800, 4000, 20_000)
AUTHOR, RIVAL, MALLORY = (Identity(bytes([b]) * 32) for b in (121, 122, 124))
SERVICES = ("billing payments search auth ledger catalog orders inventory shipping notify reports gateway"
            " profile media chat metrics invoices wallet pricing fraud tickets archive export import").split()
FIRST = ("anna boris clara dmitri elena felix greta hugo irina jonas katya leon marta nikolai olga pavel"
         " quentin rosa sergei tanya ulrich vera walter xenia yuri zoe").split()
LAST = ("novak berg costa dahl ekberg fischer garcia horvat ivanova jensen kowalski lindqvist moreau nilsen"
        " orlov petrov quinn rossi schmidt tanaka ueda volkov weber young zimmer").split()
ROLES = ("on-call lead, release manager, database owner, security reviewer, product owner, tech lead,"
         " incident commander, budget approver").split(", ")
TEAMS = "platform storage checkout growth identity data mobile infra".split()
TOPICS = ("session cache, log retention, api versioning, search ranking, release cadence, feature flags,"
          " error budgets, schema migrations, backup encryption, queue technology, tracing vendor, cdn provider,"
          " password hashing, mobile analytics, load balancer, secrets storage, code review policy,"
          " test coverage gate, incident reviews, data residency, rate limiting, dependency updates,"
          " oncall rotation, cost reporting").split(", ")
OPTIONS = "redis memcached postgres kafka rabbitmq jaeger zipkin argon2 bcrypt vault envoy haproxy weekly monthly".split()
KEYS = ("max_connections retry_limit timeout_ms pool_size log_level batch_size worker_count cache_ttl"
        " queue_depth heartbeat_ms").split()
DOMAIN = ("database port service listens deploy team decision meeting config value release cache backup owner"
          " role notes question migration cluster server network latency incident review").split()
ATTRIBUTES = (("backup window", "{h:02d}:00 UTC"), ("maintenance window", "{day} at {h:02d}:00"),
              ("failover region", "{region}"), ("log retention", "{n} days"), ("disk quota", "{n} GB"),
              ("on-call rotation", "the {team} team"))
DAYS = "monday tuesday wednesday thursday friday saturday sunday".split()
REGIONS = "north east south west central".split()
#: common English the corpus never uses: appended to answerable questions (variant "extra")
EXTRA = ("these days", "at the moment", "by any chance", "for the record", "in our setup")
PORT_TEMPLATES = ("the {s} database listens on port {p}", "{s} database port is now {p}",
                  "moved the {s} database to port {p}", "{s} db: port {p} after the change")


def did(c: dict) -> str:
    return c["hmp_container"]["head"]["container_did"]


class Corpus:
    """The containers to import, evaluations to post and questions to ask."""

    def __init__(self, size: int, seed: int, now: datetime):
        self.rng = random.Random(seed)
        self.t = now - timedelta(days=60)
        self.step = timedelta(seconds=60 * 24 * 3600 * 0.9 / max(size, 1))
        self.containers: list[dict] = []
        self.revocations: list[dict] = []
        self.evaluations: list[tuple[str, dict]] = []
        self.answerable: list[dict] = []  # {"q", "kind", "want": text, "stale": {texts}}
        self.unknown: list[dict] = []
        self.now = now
        self.build(size)

    def tick(self) -> datetime:
        self.t += self.step
        return self.t

    def note(self, who: Identity, text: str, **options) -> dict:
        c = build_container(who, "note", {"text": text}, now=self.tick(), **options)
        self.containers.append(c)
        return c

    def made_up_name(self) -> str:
        """A lowercase name like "felbur": 2-3 syllables of a consonant, a vowel and maybe a
        consonant (no list of English words decides which: some may be English)."""
        rng = self.rng
        return "".join(rng.choice("bcdfghjklmnprstvwxz") + rng.choice("aeiou")
                       + (rng.choice("bcdfghjklmnprstvwxz") if rng.random() < 0.6 else "")
                       for _ in range(rng.randint(2, 3)))

    def chain_length(self) -> int:
        roll = self.rng.random()
        return (self.rng.randint(150, 200) if roll < 0.06 else self.rng.randint(10, 60) if roll < 0.2
                else self.rng.randint(1, 3))

    def build(self, size: int) -> None:
        rng = self.rng
        facts = min(150, max(8, size // 40))  # of 216 service names: some stay unknown
        combos = [(s, v) for s in SERVICES for v in range(1, 10)]
        rng.shuffle(combos)
        known, spare = combos[:facts], combos[facts:]
        used_ports: set[int] = set()

        def port() -> int:
            while True:
                p = rng.randint(1025, 65000)
                if p not in used_ports:
                    used_ports.add(p)
                    return p

        for s, v in known:
            name = f"{s}-v{v}"
            stale: set[str] = set()
            prev = None
            versions = self.chain_length()
            fixed = rng.choice(PORT_TEMPLATES) if rng.random() < 0.7 else None  # mostly the same wording
            for k in range(versions):
                text = (fixed or rng.choice(PORT_TEMPLATES)).format(s=name, p=port())
                c = self.note(AUTHOR, text, related={"previous_version": did(prev)} if prev else None)
                if prev is not None:
                    stale.add(prev["hmp_container"]["payload"]["text"])
                prev = c
            want = prev["hmp_container"]["payload"]["text"]
            self.note(AUTHOR, f"the {name} database backups run nightly at {rng.randint(0, 23)}:00")
            roll = rng.random()
            if roll < 0.15:
                twin = self.note(RIVAL, f"the {name} database listens on port {port()}")
                self.note(AUTHOR, "no, that is wrong", related={"contradicts": did(twin)})
                stale.add(twin["hmp_container"]["payload"]["text"])
            elif roll < 0.3:
                t = self.tick()
                twin = build_container(AUTHOR, "note", {"text": f"the {name} database listens on port {port()} for now"},
                                       now=t, ttl=t + timedelta(hours=1))
                self.containers.append(twin)
                stale.add(twin["hmp_container"]["payload"]["text"])
            elif roll < 0.45:
                twin = self.note(RIVAL, f"{name} database port is {port()}")
                self.evaluations.append((did(twin), {"target": did(twin), "type": "accuracy", "value": -1.0}))
                stale.add(twin["hmp_container"]["payload"]["text"])
            elif roll < 0.6:
                twin = self.note(MALLORY, f"the {name} database listens on port {port()}")
                stale.add(twin["hmp_container"]["payload"]["text"])
            q = rng.choice(("which port does the {n} database use?", "what port is the {n} database on",
                            "{n} database port"))
            self.answerable.append({"q": q.format(n=name), "kind": "port", "want": want, "stale": stale})
        for s, v in spare[:max(4, facts // 2)]:
            q = rng.choice(("which port does the {n} database use?", "what port is the {n} database on"))
            self.unknown.append({"q": q.format(n=f"{s}-v{v}"), "kind": "port"})

        people = [(f, la) for f in FIRST for la in LAST]
        rng.shuffle(people)
        n_people = max(4, facts // 3)
        asked = set(people[:n_people + max(4, n_people // 2)])  # known and unknown people
        for f, la in people[:n_people]:
            role, team = rng.choice(ROLES), rng.choice(TEAMS)
            c = self.note(AUTHOR, f"{f.title()} {la.title()} is the {role} of the {team} team")
            namesake = rng.choice([x for x in LAST if (f, x) not in asked])  # same first name, someone else
            self.note(AUTHOR, f"{f.title()} {namesake.title()} joined the {rng.choice(TEAMS)} team last week")
            self.answerable.append({"q": f"what role does {f.title()} {la.title()} have?", "kind": "person",
                                    "want": c["hmp_container"]["payload"]["text"], "stale": set()})
        for f, la in people[n_people:n_people + max(4, n_people // 2)]:
            self.unknown.append({"q": f"what role does {f.title()} {la.title()} have?", "kind": "person"})
            self.unknown.append({"q": f"what role does {f} {la} have?", "kind": "person-lowercase"})

        topics = list(TOPICS)
        rng.shuffle(topics)
        n_topics = min(len(topics) - 4, max(4, facts // 4))
        for topic in topics[:n_topics]:
            a, b = rng.sample(OPTIONS, 2)
            c = self.note(AUTHOR, f"Decision on {topic}: we chose {a} over {b} because it is simpler to operate"
                                  f" and the team already knows it")
            self.note(AUTHOR, f"{topic} notes")
            self.note(AUTHOR, f"{topic}: open questions about {b}")
            self.answerable.append({"q": f"what did we decide about {topic}?", "kind": "decision",
                                    "want": c["hmp_container"]["payload"]["text"], "stale": set()})
        for topic in topics[n_topics:]:
            self.unknown.append({"q": f"what did we decide about {topic}?", "kind": "decision"})

        names: list[str] = []
        while len(names) < 2 * max(4, facts // 3):
            name = self.made_up_name()
            if name not in names:
                names.append(name)
        clusters, strangers = names[: len(names) // 2], names[len(names) // 2:]
        for name in clusters:
            for attribute, value in rng.sample(ATTRIBUTES, rng.randint(1, 2)):
                h, n = rng.randint(0, 23), rng.randint(2, 400)
                text = (f"the {name} cluster's {attribute} is "
                        + value.format(h=h, n=n, day=rng.choice(DAYS), region=rng.choice(REGIONS), team=rng.choice(TEAMS)))
                self.note(AUTHOR, text)
                q = rng.choice(("what is the {a} of the {n} cluster?", "{n} cluster {a}", "what {a} does the {n} cluster have"))
                fact = {"q": q.format(a=attribute, n=name), "kind": "cluster", "want": text, "stale": set(), "name": name}
                if attribute == "backup window":
                    fact["hour"] = f"is the {name} cluster's backup window at {h:02d}:00 UTC?"
                self.answerable.append(fact)
        for name in strangers:
            attribute = rng.choice(ATTRIBUTES)[0]
            q = rng.choice(("what is the {a} of the {n} cluster?", "{n} cluster {a}", "what {a} does the {n} cluster have"))
            self.unknown.append({"q": q.format(a=attribute, n=name), "kind": "cluster"})

        n_config = max(4, facts // 3)
        unknown_keys = KEYS[-2:]
        for _ in range(n_config):
            s, v = rng.choice(known)
            key = rng.choice(KEYS[:-2])
            name = f"{s}-v{v}"
            if any(a["kind"] == "config" and a["key"] == (name, key) for a in self.answerable):
                continue
            prev, stale = None, set()
            for _ in range(rng.randint(1, 3)):
                c = self.note(AUTHOR, f"config {name} {key} = {rng.randint(2, 90000)}",
                              related={"previous_version": did(prev)} if prev else None)
                if prev is not None:
                    stale.add(prev["hmp_container"]["payload"]["text"])
                prev = c
            self.answerable.append({"q": f"what is {key} for {name}?", "kind": "config", "key": (name, key),
                                    "want": prev["hmp_container"]["payload"]["text"], "stale": stale})
            self.unknown.append({"q": f"what is {rng.choice(unknown_keys)} for {name}?", "kind": "config"})

        vocabulary = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "su", "ta", "ri", "vo") for b in
                      ("bar", "den", "fix", "gol", "hum", "jat", "kel", "mor", "nup", "pex", "rud", "sil",
                       "tov", "wen", "yad")] + DOMAIN
        while len(self.containers) < size:
            words = [rng.choice(vocabulary) for _ in range(rng.randint(6, 30))]
            if rng.random() < 0.3:
                words.insert(rng.randrange(len(words)), rng.choice(SERVICES))
            self.note(rng.choice((AUTHOR, RIVAL)), " ".join(words))
        self.revocations.append(build_peer_announce(MALLORY, addresses=[], now=self.now - timedelta(minutes=1),
                                                    key_is_falsified=True))


async def import_all(session, url: str, containers: list[dict]) -> float:
    start = time.perf_counter()
    for i in range(0, len(containers), 1000):
        body = orjson.dumps({"containers": containers[i:i + 1000]})
        async with session.post(url + "/v1/containers/import", data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            out = await resp.json()
            assert resp.status == 200 and out["rejected"] == 0, str(out)[:500]
    return time.perf_counter() - start


def items_of(envelope: dict) -> list[dict]:
    return envelope.get("items") or []


def payload_of(item) -> dict:
    if isinstance(item, dict):
        return item.get("payload", item.get("p"))
    return item[-1]


async def ask(session, url: str, q: str, tokens: int) -> tuple[float, int, dict | None]:
    body = {"query": q, "max_tokens": tokens, "max_bytes": tokens * 8}
    start = time.perf_counter()
    async with session.post(url + "/v1/recall", json=body) as resp:
        data = await resp.read()
        took = (time.perf_counter() - start) * 1000
        return took, resp.status, (orjson.loads(data) if resp.status == 200 else None)


async def run_size(size: int, seed: int, code: str | None, limit: int) -> dict:
    now = datetime.now(timezone.utc).replace(microsecond=0)
    t0 = time.perf_counter()
    corpus = Corpus(size, seed, now)
    build_s = time.perf_counter() - t0
    print(f"[{size}] built {len(corpus.containers)} containers in {build_s:.1f}s;"
          f" {len(corpus.answerable)} answerable, {len(corpus.unknown)} unknown questions", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="hmpnode-recallq-") as tmp:
        data_dir = Path(tmp)
        env = {**os.environ, "HMPNODE_PEER_HOST": "127.0.0.1", "HMPNODE_PEER_DISCOVERY_INTERFACES": "127.0.0.1"}
        if code:  # the other checkout first on the path, not the current directory (-m puts it first)
            env.update(PYTHONPATH=code, PYTHONSAFEPATH="1")
        proc = start_node(data_dir, env, stderr=subprocess.PIPE)
        try:
            async with node_session(data_dir, proc) as (url, s):
                ingest_s = await import_all(s, url, corpus.containers)
                for target, item in corpus.evaluations:
                    async with s.post(f"{url}/v1/containers/{target}/evaluations", json=item) as resp:
                        assert resp.status in (200, 201), await resp.text()
                await import_all(s, url, corpus.revocations)
                print(f"[{size}] imported in {ingest_s:.1f}s", file=sys.stderr)
                for q in corpus.answerable[:3] + corpus.unknown[:3]:  # warm-up
                    await ask(s, url, q["q"], 800)
                return await measure(s, url, corpus, size, ingest_s, limit)
        finally:
            stop_node(proc)


def sample(questions: list[dict], limit: int, seed: int) -> list[dict]:
    """At most `limit` questions, as many of each kind as the kinds allow (deterministic)."""
    if len(questions) <= limit:
        return questions
    rng = random.Random(seed)
    kinds: dict[str, list[dict]] = {}
    for q in questions:
        kinds.setdefault(q["kind"], []).append(q)
    for group in kinds.values():
        rng.shuffle(group)
    out: list[dict] = []
    while len(out) < limit:
        for group in kinds.values():
            if group and len(out) < limit:
                out.append(group.pop())
    return out


async def measure(s, url: str, corpus: Corpus, size: int, ingest_s: float, limit: int) -> dict:
    answerable, unknown = sample(corpus.answerable, limit, 1), sample(corpus.unknown, limit, 2)
    lat: dict[int, list[float]] = {b: [] for b in BUDGETS}
    hit1 = hit_budget = stale = false_abstain = errors = 0
    by_kind: dict[str, list[int]] = {}
    overheads: list[float] = []
    for q in answerable:
        answers = {}
        for budget in BUDGETS:
            took, status, env = await ask(s, url, q["q"], budget)
            lat[budget].append(took)
            answers[budget] = env
            if env is None:
                errors += 1
        texts = {b: [(payload_of(i) or {}).get("text") for i in items_of(e or {})] for b, e in answers.items()}
        first = texts[4000][:1] == [q["want"]]
        hit1 += first
        by_kind.setdefault(q["kind"], [0, 0])[0] += first
        by_kind[q["kind"]][1] += 1
        hit_budget += q["want"] in texts[800]
        stale += any(t in q["stale"] for b in BUDGETS for t in texts[b])
        false_abstain += not texts[4000]
        env = answers[4000]
        if env and items_of(env):
            payload_tokens = sum(count_canonical_tokens(canonical_json(payload_of(i))) for i in items_of(env))
            overheads.append((env_used(env) - payload_tokens, len(items_of(env))))
    took, status, env = await ask(s, url, "xylophone zeppelin quasar", 800)  # nothing stored matches
    empty_tokens = [env_used(env)] if env and not items_of(env) else []
    abstained = 0
    unknown_by_kind: dict[str, list[int]] = {}
    for q in unknown:
        for budget in BUDGETS:
            took, status, env = await ask(s, url, q["q"], budget)
            lat[budget].append(took)
            if budget == 800:
                if env is None:
                    errors += 1
                abstained += env is not None and not items_of(env)
                unknown_by_kind.setdefault(q["kind"], [0, 0])[0] += env is not None and not items_of(env)
                unknown_by_kind[q["kind"]][1] += 1
    variant_figures = {}
    for kind, asked in variants(corpus.answerable, limit, random.Random(3)).items():
        first = none = 0
        for q, text in asked:
            took, status, env = await ask(s, url, text, 4000)
            errors += env is None
            texts = [(payload_of(i) or {}).get("text") for i in items_of(env or {})]
            first += texts[:1] == [q["want"]]
            none += not texts
        variant_figures[kind] = {"asked": len(asked), "hit_at_1": round(first / len(asked), 3),
                                 "false_abstain": round(none / len(asked), 3)}
    empty = empty_tokens[0] if empty_tokens else None
    per_item = None
    if overheads and empty is not None:
        per_item = round(sum(o - empty for o, _ in overheads) / sum(n for _, n in overheads), 1)
    n = len(answerable)
    return {
        "stored": len(corpus.containers) + len(corpus.revocations), "ingest_s": round(ingest_s, 1),
        "answerable": n, "unknown": len(unknown),
        "hit_at_1": round(hit1 / n, 3), "hit_in_budget_800": round(hit_budget / n, 3),
        "hit_at_1_by_kind": {k: round(a / b, 3) for k, (a, b) in sorted(by_kind.items())},
        "stale_rate": round(stale / n, 3), "unknown_abstain": round(abstained / len(unknown), 3),
        "unknown_abstain_by_kind": {k: round(a / b, 3) for k, (a, b) in sorted(unknown_by_kind.items())},
        "variants": variant_figures,
        "false_abstain": round(false_abstain / n, 3), "empty_answer_tokens": empty,
        "overhead_tokens_per_item": per_item, "errors": errors,
        "latency_ms": {str(b): {"p50": round(percentile(v, 0.5), 1), "p95": round(percentile(v, 0.95), 1),
                               "p99": round(percentile(v, 0.99), 1), "max": round(max(v), 1)}
                       for b, v in lat.items()},
    }


#: the plural of a question word (variant "plural": the first of these the question has)
PLURALS = {"database": "databases", "window": "windows", "port": "ports", "region": "regions", "quota": "quotas",
           "rotation": "rotations", "role": "roles", "retention": "retentions"}


def typo(word: str, rng: random.Random) -> str:
    """`word` with one typo: a letter dropped, doubled, changed or swapped with the next."""
    i, how = rng.randrange(len(word) - 1), rng.randrange(4)
    if how == 0:
        return word[:i] + word[i + 1:]
    if how == 1:
        return word[:i] + word[i] + word[i:]
    if how == 2:
        return word[:i] + rng.choice([c for c in "abcdefghijklmnopqrstuvwxyz" if c != word[i]]) + word[i + 1:]
    return word[:i] + word[i + 1] + word[i] + word[i + 2:]


def variants(answerable: list[dict], limit: int, rng: random.Random) -> dict[str, list[tuple[dict, str]]]:
    """Per variant kind, at most `limit` (answerable question, its variant's text): "typo" (in
    a lowercase word of 6 letters or more that is not the name asked about, nor part of a
    compound), "extra" (a common English phrase appended), "plural", "lowercase" and
    "hour" (backup windows: the hour the memory states)."""
    out: dict[str, list[tuple[dict, str]]] = {"typo": [], "extra": [], "plural": [], "lowercase": [], "hour": []}
    for q in sample(answerable, len(answerable), 4):  # a seeded order, the kinds interleaved
        text = q["q"]
        words = [w.strip("?") for w in text.split()]
        common = [w for w in words if len(w) >= 6 and w.isalpha() and w.islower() and w != q.get("name")]
        if common:
            word = rng.choice(common)
            out["typo"].append((q, " ".join(typo(word, rng) if w.strip("?") == word else w for w in text.split())))
        out["extra"].append((q, text.rstrip("?") + " " + rng.choice(EXTRA) + ("?" if text.endswith("?") else "")))
        plural = next((w for w in words if w in PLURALS), None)
        if plural:
            out["plural"].append((q, " ".join(PLURALS[plural] if w.strip("?") == plural else w for w in text.split())))
        if text.lower() != text:
            out["lowercase"].append((q, text.lower()))
        if "hour" in q:
            out["hour"].append((q, q["hour"]))
    return {kind: asked[:limit] for kind, asked in out.items() if asked}


def env_used(env: dict) -> int:
    """used tokens as the receipt states them (the envelope before issue 12, or after)."""
    if "receipt" in env:
        return env["receipt"]["used_tokens"]
    return env["used"][0]


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=positive_ints, default=[2000, 100_000])
    parser.add_argument("--quick", action="store_true", help="2 000 memories only")
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--questions", type=int, default=150, help="at most this many of each kind per size")
    parser.add_argument("--code", help="run the node from this checkout (PYTHONPATH), e.g. the old code")
    args = parser.parse_args()
    sizes = [2000] if args.quick else args.sizes
    results = {}
    for size in sizes:
        results[str(size)] = await run_size(size, args.seed, args.code, args.questions)
        print(json.dumps({str(size): results[str(size)]}), file=sys.stderr)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
