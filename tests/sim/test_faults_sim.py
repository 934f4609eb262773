"""Partitions and churn in the simulator: every node's real control plane
(gossip.sim.fault_runs on gossip.sim.cluster), so detection, joins and merges are the
protocol's. Training starts after discovery (``settle``, a quarter of ``detect``
here), a little after time 0."""

from __future__ import annotations

import pytest
import torch

import gossip
from gossip.api import Simulation
from gossip.sim.cluster import node_id
from gossip.sim.faults import parse_faults

torch.set_num_threads(1)  # tiny models: threads only contend

COMMON = dict(nodes=8, topology="ring", task="digits", steps=300, eval_every=10, compute="fixed:0.01")


_RUNS: dict = {}


def partitioned(asynchronous=False, detector="heartbeat"):
    """The run of two halves cut apart from 1 s to 2 s (shared by the tests that read it)."""
    key = ("partition", asynchronous, detector)
    if key not in _RUNS:
        sim = Simulation(faults=["partition:0-3|4-7@1.0-2.0"], detect=0.2, asynchronous=asynchronous,
                         detector=detector, **COMMON)
        _RUNS[key] = sim, sim.run().result()
    return _RUNS[key]


def restarted(detector="heartbeat"):
    """Node 3 crashes at 1 s and restarts at 2 s; stopped at 1.2 s and 1.8 s on the way
    (the survivors' member lists then, for the tests that read them); and the clean run."""
    key = ("restart", detector)
    if key not in _RUNS:
        sim = Simulation(faults=["crash:3@1.0", "join:3@2.0"], detect=0.3, detector=detector, **COMMON)
        dead = node_id(3)
        sim.run(until=1.2)
        early = [dead in n.members for n in sim.nodes]
        sim.run(until=1.8)
        late = [dead in n.members for i, n in enumerate(sim.nodes) if i != 3]
        _RUNS[key] = sim, sim.run().result(), early, late, gossip.simulate(**COMMON)
    return _RUNS[key]


def late_detection(sim) -> float:
    """How much later than the heartbeat detector the run's detector may find a crash,
    at worst (gossip.protocol.timing.Timing.detection_bound: SWIM's bound is loose, its usual delay a
    few periods more than the heartbeat's)."""
    t, n = sim.timing, sim.config.nodes
    return t.detection_bound(sim.config.detector, n) - t.detection_bound("heartbeat", n)


def at(history, t):
    """The last evaluation at or before simulated time t."""
    return [h for h in history if h["time"] <= t][-1]


@pytest.mark.parametrize("asynchronous,detector", [(False, "heartbeat"), (True, "heartbeat"), (False, "swim")])
def test_both_halves_progress_and_consensus_recovers_after_healing(asynchronous, detector):
    sim, r = partitioned(asynchronous, detector)
    before, during, after = at(r.history, 1.0), at(r.history, 2.0), r.history[-1]
    # both halves kept training: about 100 steps in the 1 s apart, with the 0.2 s detection
    # (80 with heartbeats; SWIM, 50, may take longer to find the other half gone)
    assert during["step"] - before["step"] >= 75 - late_detection(sim) / 0.01
    assert during["consensus_distance"] > 5 * before["consensus_distance"]  # they drifted apart
    assert after["consensus_distance"] < before["consensus_distance"]       # and came back together
    assert r.summary["final_accuracy"] > 0.93
    assert r.summary["engine"] == "protocol" and r.summary["faults"] == ["1.000s partition 0-3|4-7", "2.000s heal"]
    # the protocol merged them: each half dropped the other, and after the heal one half
    # joined the other as new lives; everyone ends in one cluster of all eight
    results = sim.cluster.results()
    assert all(r["exit"] == "done" and r["steps"] == 300 for r in results), results
    assert {tuple(sorted(r["member_ids"])) for r in results} == {tuple(sorted(node_id(i) for i in range(8)))}
    assert r.summary["merges"] == 4 and r.summary["exits"] == ["done"] * 8


@pytest.mark.parametrize("detector", ["heartbeat", "swim"])
def test_a_healed_partition_costs_no_round_timeout(detector):
    """After the heal the four nodes of the losing half join at once. A joiner asked its
    ring neighbour for the state, a fellow joiner still waiting, which has none to give
    and does not answer: it waited max(2 s, timeout) before asking another, and its
    neighbours' rounds timed out meanwhile. A joiner now asks members that train."""
    sim, r = partitioned(detector=detector)
    assert r.summary["timed_out_rounds"] == 0
    assert r.summary["sim_time_s"] < 300 * 0.01 + 1.0  # no timeouts left to wait out (30 s: SimConfig.timeout)


@pytest.mark.parametrize("detector", ["heartbeat", "swim"])
def test_a_crashed_node_is_dropped_and_a_restarted_one_catches_up(detector):
    sim, r, early, late, clean = restarted(detector)
    dead = node_id(3)
    # the survivors' failure detector, not the simulator, removes it: still a member a
    # while after the crash (1.2 s), gone once it was silent for dead_after (0.3 s) and
    # the leave round came, half of dead_after of rounds after that (by 1.8 s)
    assert all(early) and not any(late)
    ups = [h["nodes_up"] for h in r.history]
    assert min(ups) == 7 and ups[-1] == 8
    assert r.summary["faults"] == ["1.000s crash 3", "2.000s join 3"]
    # the restarted process joined and pulled a member's state: the parameters it took are
    # exactly what that member handed over (SimCluster audits both sides)
    results = sim.cluster.results()
    joiner = results[3]
    assert joiner["joined"] and joiner["took"] is not None
    donor, sha = joiner["took"]
    assert donor == joiner["state_from"] and donor != dead
    assert (dead, sha) in {r["node"]: r for r in results}[donor]["handed"]
    assert all(r["exit"] == "done" and r["steps"] == 300 and r["members"] == 8 for r in results), results
    # it ends in consensus with the others
    final = torch.stack(r.params)
    assert float(((final - final.mean(0)) ** 2).sum(1).max()) < 0.1
    assert abs(r.summary["final_accuracy"] - clean.summary["final_accuracy"]) <= 0.02


@pytest.mark.parametrize("detector", ["heartbeat", "swim"])
def test_a_restart_costs_no_round_timeout(detector):
    """The joiner's first round message reached its neighbours while they still ran the
    local step before that round, before they adopted the member list that has it: it
    was rejected as not-member, and both waited the round's timeout (30 s). A live
    node's message of a round not reached yet is now held until that list is adopted."""
    sim, r, early, late, clean = restarted(detector)
    assert r.summary["timed_out_rounds"] == 0
    # survivors did not wait on the dead node beyond the detection delay (and discovery at
    # the start): 3.45 s with heartbeats, 3.67 with SWIM, against 3.03 without the fault
    assert r.summary["sim_time_s"] < clean.summary["sim_time_s"] + 0.5 + late_detection(sim)


def test_a_crash_in_a_hierarchical_cluster_costs_no_round_timeout():
    """A member found dead stays listed until its leave round; the order gave a member
    no longer in the table the label '' and sorted it first, so the members that found
    it dead early (its own datacenter) built another hierarchical graph than the rest,
    and rounds timed out. A removed member now keeps its label until it leaves. (The
    heartbeat detector this was found with: SWIM's probes at detect=0.2 cost five times
    the run and nothing the labels depend on.)"""
    r = gossip.simulate(nodes=8, topology="hierarchical:4,4", task="synthetic", steps=100, faults=["crash:1@0.4"],
                        detect=0.2, timeout=2.0, detector="heartbeat")
    assert r.summary["exits"] == ["done", "crashed"] + ["done"] * 6
    assert r.summary["timed_out_rounds"] == 0


def test_a_late_starter_joins_with_a_neighbours_state():
    sim = Simulation(nodes=6, topology="ring", task="synthetic", steps=200, eval_every=10, faults=["join:5@1.0"],
                     detect=0.2)
    r = sim.run().result()
    ups = [h["nodes_up"] for h in r.history]
    assert ups[0] == 5 and ups[-1] == 6
    late = sim.cluster.results()[5]
    assert late["joined"] and late["state_from"] is not None and late["members"] == 6
    assert r.summary["sim_time_s"] < 200 * 0.01 + 0.5  # discovery at the start, the join's rounds: no timeouts
    final = torch.stack(r.params)
    assert float(((final - final.mean(0)) ** 2).sum(1).max()) < 0.1


@pytest.mark.parametrize("mixing", [dict(algorithm="choco", compression="topk:0.1", gamma=0.5),
                                    dict(period=4, outer="nesterov", split="dirichlet:0.5", topology="exponential")])
def test_the_real_nodes_train_as_the_fault_free_simulator_does(mixing):
    """Each process gets the run's task, topology, mixing settings, split, shard and
    seed: with a fault that falls after the end, the real protocol's nodes end with
    the fault-free engine's parameters. The reference is the per-node engine, whose local
    steps are the protocol's own: the batched engine's matmuls round differently, and top-k
    would turn that rounding into other entries sent."""
    base = {"nodes": 6, "task": "synthetic", "steps": 60, "seed": 2, "topology": "ring", **mixing}
    clean = gossip.simulate(engine="per-node", **base)
    real = gossip.simulate(faults=["crash:1@50"], **base)
    assert real.summary["engine"] == "protocol" and real.summary["exits"] == ["done"] * 6
    for a, b in zip(clean.params, real.params):
        assert torch.allclose(a, b, atol=1e-6), float((a - b).abs().max())


def test_detect_sets_the_real_detector_and_bad_combinations_are_refused():
    from gossip.protocol.timing import Timing

    t = Timing.from_detect(0.4, 0.01)
    assert (t.dead_after, t.heartbeat, t.settle, t.grace) == (0.4, 0.1, 0.1, 1.0)
    assert t.join_margin == 10 and Timing.from_detect(3.0, 0.01).join_margin == 20
    sim = Simulation(nodes=4, steps=10, faults=["crash:1@0.05"], detect=0.4)
    cfg = sim.cluster.procs[0].cfg
    assert (cfg.dead_after, cfg.heartbeat, cfg.rank, cfg.world_size) == (0.4, 0.1, 0, 4)
    import networkx as nx

    from gossip.protocol.detector import HeartbeatDetector
    from gossip.protocol.swim_detector import SwimDetector
    from gossip.protocol.timing import DEFAULT_DETECTOR

    assert cfg.detector == DEFAULT_DETECTOR
    for name, kind in (("heartbeat", HeartbeatDetector), ("swim", SwimDetector)):
        sim = Simulation(nodes=4, steps=30, faults=["crash:1@0.05"], detect=0.4, detector=name)
        assert all(p.cfg.detector == name for p in sim.cluster.procs)
        r = sim.run().result()
        assert all(isinstance(p.life.control.detector, kind) for p in sim.cluster.procs if p.life is not None)
        assert r.summary["detector"]["name"] == name and r.summary["exits"][1] == "crashed"

    for change, needle in [(dict(detect=0), "detect must be a positive number"),
                           (dict(topology=nx.cycle_graph(4)), "faults need a topology spec string"),
                           (dict(byzantine="2=10"), "byzantine"), (dict(compute="measured"), "measured"),
                           (dict(detector="gossip"), "detector must be one of heartbeat, swim, got 'gossip'"),
                           (dict(engine="lockstep"), "engine 'lockstep' cannot run a simulation with faults"),
                           (dict(engine="batched"), "engine 'batched' cannot run a simulation with faults")]:
        with pytest.raises(ValueError, match=needle):
            Simulation(**{"nodes": 4, "steps": 10, "faults": ["crash:1@0.05"], **change})


def test_fault_schedule_parsing():
    evs = parse_faults(["partition:0-1,3|2@1-2", "crash:2@0.5"], 4)
    assert [(e.kind, e.time) for e in evs] == [("crash", 0.5), ("partition", 1.0), ("heal", 2.0)]
    assert evs[1].groups == ((0, 1, 3), (2,))
    for bad, needle in [("crash:9@1", "not in 0..3"), ("explode:1@1", "expected"), ("crash:1@soon", "time"),
                        ("partition:0-1@1-2", "two groups"), ("partition:0|0@1-2", "two groups"),
                        ("partition:0|1@2-1", "end after")]:
        with pytest.raises(ValueError, match=needle):
            parse_faults([bad], 4)


def test_cli_fault_flag(capsys):
    import logging

    from gossip.cli import sim_main

    before = logging.getLogger("gossip.membership").level
    assert sim_main(["--nodes", "4", "--steps", "20", "--fault", "crash:1@0.05", "--detect", "0.05", "--json"]) == 0
    out = capsys.readouterr()
    assert "crash 1" in out.out
    # the simulated control planes' own lines (the survivors removing node 1) only with -v
    assert "removed" not in out.err and logging.getLogger("gossip.membership").level == before
    assert sim_main(["--nodes", "4", "--steps", "2", "--fault", "crash:7@1"]) == 2
    with pytest.raises(SystemExit) as e:
        sim_main(["--nodes", "4", "--fault", "crash:1@1", "--detector", "gossip"])
    assert e.value.code == 2 and "invalid choice: 'gossip'" in capsys.readouterr().err
    assert sim_main(["--nodes", "4", "--steps", "2", "--fault", "crash:1@1", "--engine", "lockstep"]) == 2
    assert "cannot run a simulation with faults" in capsys.readouterr().err
