"""The lockstep engine (gossip/sim/lockstep.py): whole rounds of synchronous gossip at once,
against the event loop, and every condition that sends a run back to it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from gossip.api import SimConfig, Simulation, simulate
from gossip.sim.lockstep import DELIVER, Lockstep
from gossip.training.tasks import SyntheticTask


TOL = 2e-4  # float rounding of batched matmuls, carried through a few hundred steps of mixing


LOCKSTEP = {
    "ring": dict(topology="ring"),
    "time-varying": dict(topology="one-peer-exponential"),
    # a period of 3 with 100 steps: the last step ends without an exchange
    "period-3": dict(topology="exponential", period=3, steps=100),
}


@pytest.mark.numeric
@pytest.mark.parametrize("case", sorted(LOCKSTEP))
def test_lockstep_gives_the_per_node_results(case):
    cfg = SimConfig(**{"nodes": 8, "task": "digits", "steps": 200, "seed": 3, "eval_every": 20, **LOCKSTEP[case]})
    per = simulate(dataclasses.replace(cfg, engine="per-node"))
    auto = simulate(cfg)  # auto chooses lockstep for this run
    assert auto.summary["engine"] == "lockstep" and auto.summary["engine_note"] == "lockstep"
    a, b = torch.stack(per.params), torch.stack(auto.params)
    assert (a - b).abs().max().item() <= TOL
    init = torch.stack(simulate(dataclasses.replace(cfg, steps=0)).params)
    assert (b - init).abs().max() > 0.05 and auto.summary["final_accuracy"] > 0.5
    for key in ("sim_time_s", "bytes_sent", "bytes_intra", "bytes_inter", "missing_neighbors", "steps",
                "messages_lost", "rejected"):
        assert per.summary[key] == auto.summary[key], key
    assert per.summary["bytes_sent"] > 0
    # the same evaluation points, at the same virtual times, with the same byte counts
    assert len(per.history) == len(auto.history) >= 5
    for x, y in zip(per.history, auto.history):
        for key in ("time", "step", "bytes_sent", "bytes_intra", "nodes_up"):
            assert x[key] == y[key], key
        for key in ("loss", "train_loss", "mean_node_loss", "consensus_distance"):
            assert x[key] == pytest.approx(y[key], rel=1e-3, abs=1e-6), key


def _counts(sim):
    """What the event loop keeps per node and per link, for comparing engines at a cut."""
    s = sim.sim
    nodes = s.nodes
    return dict(now=s.now, steps_done=s.steps_done, sent=list(s.bytes_sent), received=list(s.bytes_received),
                seq=[n.seq for n in nodes], rounds=[n.round for n in nodes], steps=[n.step for n in nodes],
                mixed=[n.mix_totals.mixed for n in nodes], finished=list(s.finished),
                by_class=dict(s.network.bytes_by_class), messages=dict(s.network.messages_by_class),
                busy=dict(s.network.busy_until))


def _rows(sim):
    b = sim.batched
    return b.matrix[b.row_of]


@pytest.mark.numeric
@pytest.mark.parametrize("topology,period", [("exponential", 1), ("one-peer-exponential", 2)])
def test_lockstep_matches_the_event_loop_at_every_cut(topology, period):
    """Over 128 nodes, message headers differ in size by sender, so nodes mix nanoseconds
    apart; cuts between phases and inside them (some nodes mixed, some not) must see what the
    event loop sees: the same clock, counters, bytes and parameters. (A smooth model: with
    ReLU, a pre-activation within rounding of zero flips a gradient, and one row would differ
    by ~1e-3 after a rounding-sized difference; that is the float tolerance, not the engine.)"""
    task = SyntheticTask(dim=16, samples=2000, test_samples=200,
                         model_fn=lambda: nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 10)))
    cfg = SimConfig(nodes=260, topology=topology, period=period, task=task, steps=140, seed=3, eval_every=20)
    ev = Simulation(dataclasses.replace(cfg, engine="batched"))
    ls = Simulation(dataclasses.replace(cfg, engine="lockstep"))
    assert ls.engine == "lockstep" and ev.engine == "batched"
    # cuts inside phases: half way through the events of a few delivery and step phases
    found: dict[bool, list[float]] = {True: [], False: []}  # delivery phases, step-end phases
    for ph in Lockstep(Simulation(dataclasses.replace(cfg, engine="batched")).sim)._plan():
        if ph.times[0] < ph.times[-1] and len(found[ph.kind == DELIVER]) < 2:
            found[ph.kind == DELIVER].append(float(ph.times[len(ph.times) // 2]))
    assert len(found[True]) == len(found[False]) == 2
    inside = found[True] + found[False]
    cuts = sorted([0.0, *(k * 0.037 for k in range(1, 45)), *inside])
    split = 0
    for until in cuts:
        ev.run(until)
        ls.run(until)
        a, b = _counts(ev), _counts(ls)
        assert a == b, until
        assert (_rows(ev) - _rows(ls)).abs().max().item() <= TOL, until
        split += len(set(a["rounds"])) > 1
    assert split >= 2  # some cuts fell between two nodes' mixing of one round
    x, y = ev.result(), ls.result()
    assert x.summary["sim_time_s"] == y.summary["sim_time_s"] and x.summary["bytes_sent"] == y.summary["bytes_sent"]
    assert [h["time"] for h in x.history] == [h["time"] for h in y.history]
    assert [h["bytes_sent"] for h in x.history] == [h["bytes_sent"] for h in y.history]
    ev.run(100.0)
    ls.run(100.0)  # after the end, only wait timers are left: the clock moves as the event loop's does
    assert _counts(ev) == _counts(ls)


# each condition alone makes an otherwise lockstep run fall back, with its reason
BASE = dict(nodes=6, task="synthetic", steps=12, topology="ring")


REFUSALS = {
    "async": (dict(asynchronous=True), "AsyncGossipRule"),
    "choco-topk": (dict(compression="topk:0.1"), "ChocoRule"),
    "push-sum": (dict(algorithm="push-sum"), "PushSumRule"),
    "fp16": (dict(algorithm="naive", compression="fp16"), "compresses with fp16"),
    "clip": (dict(clip=1.0), "clipped gossip"),
    "overlap": (dict(overlap=True), "overlap"),
    "outer": (dict(outer="nesterov", period=2), "OuterRule"),
    "byzantine": (dict(byzantine="2=10"), "node 2 mixes with ScaledSender"),
    "link-policy": (dict(link_policy="inter:period=2"), "link policies"),
    "lognormal": (dict(compute="lognormal:0.01,0.3"), "lognormal compute model"),
    "slow": (dict(slow="3=2"), "slow nodes"),
    "jitter": (dict(link="latency=1ms,jitter=1ms"), "intra links have jitter"),
    "loss": (dict(link="loss=0.01"), "intra links have loss"),
    "timeout": (dict(timeout=1e-5), "would wait past its timeout"),
    "interleaved": (dict(nodes=8, topology="hierarchical:4,4", inter_link="latency=20ms"),
                    "rounds interleave"),
}


def test_the_base_run_is_lockstep():
    sim = Simulation(SimConfig(**BASE))
    assert sim.engine == "lockstep" and sim.engine_note == "lockstep"
    # two datacenters whose links are as fast as the LAN's still step together
    assert Simulation(SimConfig(**{**BASE, "nodes": 8, "topology": "hierarchical:4,4", "inter_link": "lan"})).engine \
        == "lockstep"


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_each_disqualifying_condition_falls_back_and_says_why(case):
    change, needle = REFUSALS[case]
    cfg = SimConfig(**{**BASE, **change})
    auto = Simulation(cfg)
    assert auto.engine == "batched" and auto.sim.lockstep is None
    assert auto.engine_note.startswith("batched; not in lockstep: ") and needle in auto.engine_note
    with pytest.raises(ValueError, match="engine 'lockstep' cannot run this simulation: .*" + needle):
        Simulation(dataclasses.replace(cfg, engine="lockstep"))
    assert Simulation(dataclasses.replace(cfg, engine="per-node")).engine == "per-node"
    result = auto.run().result()
    assert result.summary["engine"] == "batched" and needle in result.summary["engine_note"]


def test_lockstep_needs_batched_steps():
    class Unbatchable(SyntheticTask):
        batchable = False

    cfg = SimConfig(nodes=3, task=Unbatchable(samples=200, test_samples=50), steps=5)
    assert Simulation(cfg).engine == "per-node"
    with pytest.raises(ValueError, match="engine 'lockstep' cannot run this simulation: task 'synthetic'"):
        Simulation(dataclasses.replace(cfg, engine="lockstep"))


@pytest.mark.numeric
@pytest.mark.parametrize("topology", ["ring", "one-peer-exponential"])
def test_lockstep_mixing_is_the_product_of_the_mixing_matrices(topology):
    """With (almost) no training, 300 rounds of lockstep mixing are W_299 ... W_0 X_0, as the
    per-node engine computes them: no drift of the average (float32 weights such as 1/3 sum to
    1 + 1e-7, and X <- W X with them would grow every node by that per round)."""
    task = SyntheticTask(dim=16, samples=2000, test_samples=200, lr=1e-12)
    cfg = SimConfig(nodes=12, topology=topology, task=task, steps=300, seed=2, eval_every=300)
    finals = {}
    for engine in ("per-node", "lockstep"):
        sim = Simulation(dataclasses.replace(cfg, engine=engine))
        assert sim.engine == engine
        start = 10 + torch.randn(12, sim.nodes[0].numel, generator=torch.Generator().manual_seed(5))
        for node, row in zip(sim.nodes, start):
            node.state.flat.copy_(row)
        finals[engine] = torch.stack(sim.run().result().params).double()
    x = start.double()
    for r in range(300):
        x = torch.as_tensor(sim.topology.mixing_matrix(r)) @ x
    # float32 rounding of values near 10 over 300 rounds: ~1e-5 either way; W in float32 gave 5e-5 on the ring
    assert (finals["per-node"] - x).abs().max() < 2e-5
    assert (finals["lockstep"] - x).abs().max() < 2e-5
    assert (x - start.double()).abs().max() > 0.5  # the nodes moved a long way towards their average


def test_a_network_changed_mid_run_is_refused_in_lockstep():
    sim = Simulation(SimConfig(nodes=8, topology="ring", task="synthetic", steps=100, engine="lockstep"))
    assert sim.engine == "lockstep"
    sim.run(until=0.3)
    steps = [n.step for n in sim.nodes]
    sim.network.partition([[0, 1, 2, 3], [4, 5, 6, 7]])
    with pytest.raises(RuntimeError, match="changed during a lockstep run.*engine 'batched'"):
        sim.run(until=0.6)
    assert [n.step for n in sim.nodes] == steps and sim.now == 0.3  # nothing ran
    sim.network.partition(None)
    assert sim.run().result().summary["steps"] == 100  # undisturbed, it goes on
    # the event-loop engine follows the partition: messages across it are lost
    ev = Simulation(SimConfig(nodes=8, topology="ring", task="synthetic", steps=100, engine="batched"))
    ev.run(until=0.3)
    ev.network.partition([[0, 1, 2, 3], [4, 5, 6, 7]])
    ev.run(until=0.6)
    assert ev.network.lost > 0


def test_auto_runs_a_piecewise_run_on_the_event_loop():
    """engine auto never raises for a network changed mid-run: a first run(until=...) takes the
    event loop (which follows the change); a run to the end stays in lockstep."""
    cfg = SimConfig(nodes=8, topology="ring", task="synthetic", steps=100)
    sim = Simulation(cfg)
    assert sim.engine == "lockstep"  # provisional until the first run()
    sim.run(until=0.3)
    assert sim.engine == "batched" and "run piecewise" in sim.engine_note
    sim.network.partition([[0, 1, 2, 3], [4, 5, 6, 7]])
    sim.run(until=0.6)
    assert sim.network.lost > 0  # messages across the partition are lost, as the event loop has it
    sim.network.partition(None)
    summary = sim.run().result().summary
    assert summary["engine"] == "batched" and summary["steps"] == 100
    # the same piecewise run undisturbed: the event loop gives the parameters lockstep gives
    pieces = Simulation(cfg)
    for t in (0.3, 0.6, None):
        pieces.run(until=t)
    whole = Simulation(cfg).run()
    assert whole.engine == "lockstep" and whole.engine_note == "lockstep" and pieces.engine == "batched"
    assert torch.allclose(pieces.batched.matrix, whole.batched.matrix, atol=1e-5)
    assert pieces.result().summary["bytes_sent"] == whole.result().summary["bytes_sent"]
    # a change made before the first run: auto takes the event loop from the start
    early = Simulation(cfg)
    early.network.partition([[0, 1, 2, 3], [4, 5, 6, 7]])
    early.run()
    assert early.engine == "batched" and "partitioned" in early.engine_note and early.network.lost > 0
