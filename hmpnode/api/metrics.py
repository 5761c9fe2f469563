"""Prometheus text exposition (format 0.0.4) of the node's counters, written by hand.

Request durations are a histogram by route (the route pattern, never the raw
path) and method; the ingest rate is derived from a small ring buffer of
(time, stored count) samples taken on every request, on every scrape and once a
second by a background task.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hmpnode.container import reasons as R

__all__ = ["Histogram", "RateWindow", "render", "CONTENT_TYPE", "BUCKETS", "METHODS"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Method label values; anything else is counted as "other" (bounded label sets).
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
INGEST_STATUSES = ("stored", "duplicate", "conflict", "rejected")


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Histogram:
    def __init__(self, buckets: Iterable[float] = BUCKETS):
        self.buckets = tuple(sorted(buckets))
        # labels -> [counts per bucket (non-cumulative) + overflow, sum, count]
        self._series: dict[tuple[str, str], list[Any]] = {}

    def observe(self, route: str, method: str, seconds: float) -> None:
        series = self._series.get((route, method))
        if series is None:
            series = self._series[(route, method)] = [[0] * (len(self.buckets) + 1), 0.0, 0]
        series[0][bisect_left(self.buckets, seconds)] += 1
        series[1] += seconds
        series[2] += 1

    def lines(self, name: str) -> list[str]:
        out = []
        for (route, method), (counts, total, count) in sorted(self._series.items()):
            labels = f'route="{escape(route)}",method="{escape(method)}"'
            running = 0
            for bound, n in zip(self.buckets, counts):
                running += n
                out.append(f'{name}_bucket{{{labels},le="{_num(bound)}"}} {running}')
            out.append(f'{name}_bucket{{{labels},le="+Inf"}} {count}')
            out.append(f"{name}_sum{{{labels}}} {_num(total)}")
            out.append(f"{name}_count{{{labels}}} {count}")
        return out


class RateWindow:
    """Per-second rate of a monotonic counter over the last `window` seconds."""

    def __init__(self, read: Callable[[], int], window: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.read = read
        self.window = window
        self.clock = clock
        self._samples: deque[tuple[float, int]] = deque(maxlen=4096)

    def sample(self) -> None:
        now, value = self.clock(), self.read()
        samples = self._samples
        if len(samples) >= 2 and now - samples[-2][0] < 0.05:
            samples[-1] = (now, value)  # coalesce bursts of requests (one sample per 50 ms)
        else:
            samples.append((now, value))
        # keep one sample at or beyond the window's start as the baseline
        while len(samples) > 1 and samples[1][0] <= now - self.window:
            samples.popleft()

    def rate(self) -> float:
        self.sample()
        (t0, v0), (t1, v1) = self._samples[0], self._samples[-1]
        # With less history than the window (just started), what happened before the
        # first sample is unknown and counted as nothing: divide by the whole window.
        return max(0, v1 - v0) / max(t1 - t0, self.window)


def _family(out: list[str], name: str, kind: str, help_text: str, samples: Iterable[tuple[str, float]]) -> None:
    out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        out.append(f"{name}{labels} {_num(value)}")


def render(status: Mapping[str, Any], counters: Mapping[str, int], rejections: Mapping[str, int], *,
           rate: float, subscribers: int, histogram: Histogram,
           refusals: Mapping[tuple[str, str], int] | None = None, clock_skew_max: float | None = None,
           mesh: Mapping[str, Any] | None = None) -> str:
    store = status.get("store") or {}
    out: list[str] = []
    _family(out, "hmpnode_containers_stored", "gauge", "Containers held in the store (conflicting copies excluded).",
            [("", store.get("containers", 0))])
    _family(out, "hmpnode_container_conflicts", "gauge", "Conflicting copies of opaque container DIDs held apart.",
            [("", store.get("conflicts", 0))])
    _family(out, "hmpnode_evaluations_stored", "gauge", "Active evaluation items held.",
            [("", store.get("evaluations", 0))])
    _family(out, "hmpnode_last_seq", "gauge", "Store sequence number of the newest stored container.",
            [("", status.get("last_seq", 0))])
    _family(out, "hmpnode_uptime_seconds", "gauge", "Seconds since the node started.",
            [("", status.get("uptime_seconds", 0))])
    statuses = list(INGEST_STATUSES) + sorted(
        k[len("ingest_"):] for k in counters if k.startswith("ingest_") and k[len("ingest_"):] not in INGEST_STATUSES
    )
    _family(out, "hmpnode_ingest_total", "counter", "Containers offered to ingest, by outcome.",
            [(f'{{status="{escape(s)}"}}', counters.get(f"ingest_{s}", 0)) for s in statuses])
    _family(out, "hmpnode_ingest_verified_total", "counter", "Containers handed to verification.",
            [("", counters.get("verified", 0))])
    _family(out, "hmpnode_ingest_duplicate_unverified_total", "counter",
            "Containers answered duplicate from the store before verification (same DID and signature held).",
            [("", counters.get("duplicate_unverified", 0))])
    reasons = list(R.ALL) + sorted(r for r in rejections if r not in R.ALL)
    _family(out, "hmpnode_rejected_total", "counter", "Containers rejected by verification, by reason.",
            [(f'{{reason="{escape(r)}"}}', rejections.get(r, 0)) for r in reasons])
    _family(out, "hmpnode_refused_total", "counter",
            "Work refused to stay within a limit (peer, LAN, DHT, relay, API), by area and reason.",
            [(f'{{area="{escape(a)}",reason="{escape(r)}"}}', n) for (a, r), n in sorted((refusals or {}).items())])
    if clock_skew_max is not None:
        _family(out, "hmpnode_peer_clock_skew_max_seconds", "gauge",
                "Largest clock offset estimated for a peer, in absolute seconds (refusals: refused_total reason clock_skew).",
                [("", round(clock_skew_max, 3))])
    _family(out, "hmpnode_ingest_rate_per_second", "gauge", "Containers stored per second over the last 10 seconds.",
            [("", round(rate, 6))])
    _family(out, "hmpnode_event_subscribers", "gauge", "Open event-stream (SSE) subscriptions.",
            [("", subscribers)])
    lag = status.get("loop_lag_seconds") or {}
    _family(out, "hmpnode_event_loop_lag_max_seconds", "gauge",
            "Largest delay of the event loop seen since start (a 0.1 s timer firing late).", [("", lag.get("max", 0))])
    held = status.get("inflight_decompressed") or {}
    _family(out, "hmpnode_inflight_decompressed_bytes", "gauge",
            "Decompressed bytes held by verifications in progress (limits.max_inflight_decompressed_bytes).",
            [("", held.get("used", 0))])
    procs = status.get("verify_processes") or {}
    _family(out, "hmpnode_verify_processes", "gauge",
            "Verify worker processes ready (node.verify_processes; 0: verification on threads).",
            [("", procs.get("ready", 0))])
    _family(out, "hmpnode_verify_processes_lost_total", "counter",
            "Verify worker processes that died or did not start (their work went to the threads).",
            [("", procs.get("lost", 0))])
    if mesh is not None:
        _mesh_families(out, mesh)
    name = "hmpnode_api_request_duration_seconds"
    out.append(f"# HELP {name} API request handling time by route pattern and method.")
    out.append(f"# TYPE {name} histogram")
    out.extend(histogram.lines(name))
    return "\n".join(out) + "\n"


def _mesh_families(out: list[str], mesh: Mapping[str, Any]) -> None:
    """Peers, sessions, relay queue, outbox, DHT and LAN discovery (hmpnode.net.mesh.Mesh.metrics)."""
    sessions, relay, outbox = mesh["sessions"], mesh["relay"], mesh["outbox"]
    _family(out, "hmpnode_peer_sessions", "gauge",
            "Open peer sessions by direction (outbound: this node dialled).",
            [(f'{{direction="{d}"}}', sessions.get(d, 0)) for d in ("inbound", "outbound")])
    _family(out, "hmpnode_peer_sessions_by_role", "gauge",
            "Open peer sessions whose peer announces a role (a peer with two roles counts in both).",
            [(f'{{role="{escape(r)}"}}', n) for r, n in mesh["session_roles"].items()])
    # (name, type, help, value): one unlabelled sample each; a part that is off (None) is left out
    rows: list[tuple[str, str, str, float]] = [
        ("hmpnode_peers_known", "gauge", "Peers in the peer table (LAN, DHT, connections).", mesh["peers_known"]),
        ("hmpnode_relay_queue_items", "gauge", "Containers held for other recipients (relay role).", relay["items"]),
        ("hmpnode_relay_queue_bytes", "gauge", "Bytes held for other recipients (relay role).", relay["bytes"]),
        ("hmpnode_outbox_items", "gauge",
         "Directed containers of this agent not yet handed to their recipient or a relay.", outbox["items"]),
        ("hmpnode_outbox_oldest_age_seconds", "gauge", "Age of the oldest container waiting in the outbox (0 when empty).",
         round(outbox["oldest_age_seconds"], 3)),
    ]
    deadlines = mesh.get("deadlines") or {}
    rows += [
        ("hmpnode_relay_reoffered_total", "counter",
         "Held containers offered again to a connected recipient that had not acknowledged them in time.",
         deadlines.get("relay_reoffered", 0)),
        ("hmpnode_relay_expired_connected_total", "counter",
         "Relay holdings that ended undelivered while their recipient was connected (an error, also logged).",
         deadlines.get("relay_expired_connected", 0)),
        ("hmpnode_peer_requests_expired_total", "counter",
         "Containers asked of a peer and not received by the request deadline (asked again at their next offer).",
         deadlines.get("requests_expired", 0)),
        ("hmpnode_peer_requests_omitted_total", "counter",
         "Containers asked of a peer that its container_response said are not coming.",
         deadlines.get("requests_omitted", 0)),
        ("hmpnode_outbox_woken_total", "counter",
         "Outbox entries made due at once because a path to their recipient connected.",
         deadlines.get("outbox_woken", 0)),
        ("hmpnode_interests_withheld_total", "counter",
         "Broadcasts not sent to a peer because they match none of the interests it declared (once per connection).",
         mesh.get("interests_withheld", 0)),
    ]
    dht = mesh.get("dht")
    if dht is not None:
        rows += [
            ("hmpnode_dht_routing_table_size", "gauge", "Contacts in the DHT routing table.", dht["routing_table_size"]),
            ("hmpnode_dht_records_held", "gauge", "DHT records this node stores for the network.", dht["records_held"]),
            ("hmpnode_dht_records_held_bytes", "gauge", "Bytes of the DHT records this node stores.",
             dht["records_held_bytes"]),
            ("hmpnode_dht_provides", "gauge",
             "This agent's containers that have a provider record (republished from the store).", dht["provides"]),
            ("hmpnode_dht_provides_published_total", "counter", "Provider records signed and stored.",
             dht["provides_published"]),
            ("hmpnode_dht_peer_records_published_total", "counter", "Times this node's peer record was published.",
             dht["peer_records_published"]),
        ]
    reach = mesh.get("reachability")
    if reach is not None:  # docs/protocol.md 34.1, 34.2
        _family(out, "hmpnode_reachability", "gauge",
                "This node's reachability verdict (public: a dial-back reached its peer port; private: asked, none did).",
                [(f'{{verdict="{v}"}}', int(reach["verdict"] == v)) for v in ("public", "private", "unknown")])
        _family(out, "hmpnode_dialback_refused_total", "counter",
                "Dial-backs peers asked of this node and refused (not their address, rate limited, busy...), by reason.",
                [(f'{{reason="{escape(r)}"}}', n) for r, n in sorted(reach["refused"].items())])
        rows += [
            ("hmpnode_dialback_asked_total", "counter", "Dial-backs this node asked of peers.", reach["asked"]),
            ("hmpnode_dialback_arrived_total", "counter", "Dial-backs asked by this node whose nonce arrived.",
             reach["arrived"]),
            ("hmpnode_dialback_failed_total", "counter", "Dial-backs asked by this node whose nonce did not arrive in time.",
             reach["failed"]),
            ("hmpnode_dialback_served_total", "counter", "Dial-backs this node made for peers (reached or not).",
             reach["served"]),
            ("hmpnode_dialback_unasked_total", "counter",
             "Requests on the dial-back path with a nonce this node had not asked for.", reach["unasked"]),
        ]
    lan = mesh.get("lan")
    if lan is not None:
        rows += [
            ("hmpnode_lan_announces_sent_total", "counter", "LAN discovery datagrams sent (one per interface and mode).",
             lan["sent"]),
            ("hmpnode_lan_announces_received_total", "counter", "Datagrams received on the LAN discovery port.",
             lan["received"]),
            ("hmpnode_lan_announces_accepted_total", "counter", "LAN announces of other nodes accepted.",
             lan["accepted"]),
            ("hmpnode_lan_announces_refused_total", "counter",
             'LAN announces refused (by reason: hmpnode_refused_total{area="lan"}).', lan["refused"]),
            ("hmpnode_lan_peers", "gauge", "Nodes currently seen by LAN discovery.", lan["peers"]),
        ]
    for name, kind, help_text, value in rows:
        _family(out, name, kind, help_text, [("", value)])
