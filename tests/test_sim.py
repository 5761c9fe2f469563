"""The simulator (hmpnode.sim): seeded runs of the real mesh core with faults, the
invariants after each, and the stalls it must find (each scenario fails with its fix
taken out, here by patching the fix away for the one run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hmpnode.net import core as C
from hmpnode.net import ledger, scope
from hmpnode.net import session as SE
from hmpnode.sim.scenario import Scenario, replay_command, run

ROOT = Path(__file__).resolve().parent.parent

#: faults of every kind, on a 200-node mesh (the suite's seeded run)
FAULTS = dict(nodes=200, broadcasts=8, directed=16, relays=3, offline=0.1, churn=0.1, relay_crashes=0.34, drops=8,
              skew=5.0, active=20.0, settle=30.0)


def _explain(report) -> str:
    return (f"seed {report.scenario.seed}: {len(report.violations)} violations, e.g. {report.violations[:3]}; "
            f"replay: {replay_command(report.scenario)}")


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_a_200_node_mesh_with_faults_keeps_every_invariant(seed):
    report = run(Scenario(seed=seed, **FAULTS))
    assert report.ok, _explain(report)
    f = report.figures
    assert f["deliveries"] == f["broadcasts"] * (f["nodes"] - 1), f  # every node but the origin, once
    assert len(report.digest) == 64


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    small = dict(nodes=30, broadcasts=4, directed=4, relays=2, churn=0.2, offline=0.2, drops=3, skew=3.0, active=10.0,
                 settle=15.0)
    first, again, other = run(Scenario(seed=7, **small)), run(Scenario(seed=7, **small)), run(Scenario(seed=8, **small))
    assert first.ok and again.ok and other.ok, (first.violations, other.violations)
    assert first.digest == again.digest
    assert first.figures["frames"] == again.figures["frames"]
    assert first.digest != other.digest


# -- the stalls on a live connection (docs/protocol.md 22.2, 24.2) --------------------------------------

LIVE = dict(nodes=12, relays=1, directed=10, offline=0.5, broadcasts=0, active=30.0, settle=30.0)


def test_a_relay_offer_lost_on_a_live_connection_is_made_again(monkeypatch):
    scenario = Scenario(seed=1, lose=("relay_offer",), **LIVE)
    assert run(scenario).ok
    # without the relay's re-offer the mail waits for a reconnection that never comes
    monkeypatch.setattr(SE.PeerSession, "_arm_reoffer", lambda self, mono: None)
    stalled = run(scenario)
    assert any("stored 0 times at its recipient" in v for v in stalled.violations), stalled.violations


def test_a_request_lost_on_a_live_connection_is_forgotten_and_made_again(monkeypatch):
    scenario = Scenario(seed=1, lose=("recipient_request",), **LIVE)
    assert run(scenario).ok
    # a request that never expires blocks every later offer of the same container
    monkeypatch.setattr(ledger.Requested, "expire", lambda self, cutoff: 0)
    stalled = run(scenario)
    assert any("stored 0 times at its recipient" in v for v in stalled.violations), stalled.violations


def test_the_outbox_wakes_when_its_relay_comes_back(monkeypatch):
    """Mail for offline recipients waits in the sender's outbox while the relay is down
    (sent in the first 30 s of a 270 s outage, its retries back off to minutes); when the
    relay is back it goes at once."""
    scenario = Scenario(seed=1, nodes=12, relays=1, directed=10, offline=0.5, broadcasts=0, outage=(0.0, 0.9),
                        active=300.0, settle=30.0, mail_window=0.1)
    assert run(scenario).ok
    monkeypatch.setattr(C.MeshCore, "served_by", lambda self, arrived: set())
    stalled = run(scenario)
    assert any("stored 0 times at its recipient" in v for v in stalled.violations), stalled.violations


def test_a_recipient_that_comes_back_reaches_the_relays_that_hold_its_mail(monkeypatch):
    """Found by the simulator: a recipient back after being away connected to whichever
    peers it drew, and mail its relay held for it stayed there. It now keeps its best
    ranked relays connected (MeshCore.relays_to_dial), the ones its announce names."""
    scenario = Scenario(seed=2, nodes=100, broadcasts=0, directed=20, relays=4, offline=0.2, churn=0.1,
                        relay_crashes=0.5, drops=5)
    assert run(scenario).ok
    monkeypatch.setattr(C.MeshCore, "relays_to_dial", lambda self, known, due: [])
    stranded = run(scenario)
    assert any("stored 0 times at its recipient" in v for v in stranded.violations), stranded.violations


# -- the invariants can fail ------------------------------------------------------------------------------

SMALL = dict(nodes=20, broadcasts=4, active=10.0, settle=10.0)


def test_a_broadcast_that_does_not_spread_is_reported(monkeypatch):
    def forward(self, rows):  # stored, never offered onwards
        return
        yield

    monkeypatch.setattr(C.MeshCore, "forward", forward)
    monkeypatch.setattr(C.MeshCore, "start_sync", forward)
    report = run(Scenario(seed=3, **SMALL))
    assert any(v.startswith("broadcast ") and "missing at" in v for v in report.violations), report.violations


def test_a_scoped_broadcast_that_leaves_its_origin_is_reported(monkeypatch):
    real = scope.may_forward

    def unscoped(head, **kw):  # a scope check that forgets the network
        return real({**head, "network": ""}, **kw)

    monkeypatch.setattr(SE, "may_forward", unscoped)
    report = run(Scenario(seed=3, **SMALL))
    assert any("localhost-scoped" in v for v in report.violations), report.violations


def test_a_forgotten_container_fetched_again_is_reported(monkeypatch):
    from hmpnode.sim.store import MemoryStore

    real_forget = MemoryStore.forget

    def forget_but_fetch_again(self, did):
        real_forget(self, did)
        self.forgotten.discard(did)  # the tombstone lost: reconciliation brings it back

    monkeypatch.setattr(MemoryStore, "forget", forget_but_fetch_again)
    report = run(Scenario(seed=3, drops=60, **SMALL))
    assert any("again after its agent forgot it" in v for v in report.violations), report.violations


def test_a_failing_run_names_its_seed_and_the_command_that_replays_it():
    scenario = Scenario(seed=11, nodes=20, broadcasts=3, lose=("relay_offer",), relays=1, directed=2, skew=2.5)
    command = replay_command(scenario)
    assert command == ("./scripts/sim mesh --nodes 20 --seed 11 --broadcasts 3 --directed 2 --relays 1 --skew 2.5 "
                       "--lose relay_offer")
    out = subprocess.run([str(ROOT / "scripts" / "sim"), *command.split()[1:]], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    digest = next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("digest:"))
    assert digest == run(scenario).digest
    bad = subprocess.run([sys.executable, "-m", "hmpnode.sim.cli", "mesh", "--nodes", "5", "--lose", "nothing"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown loss 'nothing'" in bad.stderr and "Traceback" not in bad.stderr
    for args, says in ((["--nodes", "1"], "--nodes must be at least 2"), (["--churn", "1.5"], "fraction from 0 to 1"),
                       (["--outage", "0.5"], "--outage is two fractions"), (["--latency", "a,b"], "could not convert")):
        bad = subprocess.run([sys.executable, "-m", "hmpnode.sim.cli", "mesh", *args], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode == 2 and says in bad.stderr and "Traceback" not in bad.stderr, (args, bad.stderr)


def test_a_run_that_breaks_an_invariant_says_so_and_exits_1(monkeypatch, capsys):
    from hmpnode.sim import cli

    monkeypatch.setattr(SE.PeerSession, "_arm_reoffer", lambda self, mono: None)
    code = cli.main(["mesh", "--nodes", "12", "--relays", "1", "--directed", "10", "--offline", "0.5",
                     "--broadcasts", "0", "--lose", "relay_offer"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "VIOLATION: directed" in out
    assert "FAILED: seed 1; replay: ./scripts/sim mesh --nodes 12 --broadcasts 0 --directed 10 --relays 1" in err


def test_a_full_relay_does_not_churn_the_nodes_that_want_it(monkeypatch):
    """Every node keeps its best-ranked relays connected; a relay with fewer slots than that
    evicts to admit the next. The evicted node backs off that relay as after a failed dial
    (dialing.GIVE_WAY): without it, each eviction is dialled straight back and evicts another."""
    from hmpnode.net import dialing
    from hmpnode.sim import mesh as SM

    nets = []
    real_init = SM.SimNet.__init__

    def keep(self, *args, **kw):
        real_init(self, *args, **kw)
        nets.append(self)

    monkeypatch.setattr(SM.SimNet, "__init__", keep)
    scenario = Scenario(seed=1, nodes=120, relays=1, relay_slots=40, broadcasts=2, crypto="plain", active=20.0,
                        settle=20.0)

    def evictions(report) -> int:
        assert not [v for v in report.violations if "over" in v], report.violations
        return sum(n.counters["evicted"] for n in nets[-1].nodes.values())

    backed_off = evictions(run(scenario))
    monkeypatch.setattr(dialing, "GIVE_WAY", frozenset())
    churned = evictions(run(scenario))
    assert churned > 3 * max(backed_off, 1), (backed_off, churned)


def test_with_the_dht_senders_find_unknown_recipients_there_and_the_run_replays(monkeypatch):
    """Each node runs its own DHT (hmpnode.net.dht on the simulated UDP network); a sender
    that knows neither the recipient nor its mailmen looks its peer record up there."""
    from hmpnode.sim import mesh as SM

    looked_up = []
    real = SM.SimWorld.find_peer

    async def find_peer(self, did):
        record = await real(self, did)
        looked_up.append(self.node.dht is not None and record is not None)
        return record

    scenario = Scenario(seed=3, nodes=30, relays=2, directed=12, known=3, offline=0.2, broadcasts=2, dht=True,
                        crypto="plain", active=15.0, settle=20.0)
    monkeypatch.setattr(SM.SimWorld, "find_peer", find_peer)
    first, again = run(scenario), run(scenario)
    assert first.ok, _explain(first)
    assert looked_up and all(looked_up), looked_up  # found in the DHT, every time
    assert first.digest == again.digest
