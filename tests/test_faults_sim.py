"""Partitions and churn in the simulator."""

from __future__ import annotations

import pytest
import torch

import gossip
from gossip.faults import parse_faults


def at(history, t):
    """The last evaluation at or before simulated time t."""
    return [h for h in history if h["time"] <= t][-1]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_both_halves_progress_and_consensus_recovers_after_healing(asynchronous):
    r = gossip.simulate(nodes=8, topology="ring", task="digits", steps=300, eval_every=10, compute="fixed:0.01",
                        faults=["partition:0-3|4-7@1.0-2.0"], detect=0.2, asynchronous=asynchronous)
    before, during, after = at(r.history, 1.0), at(r.history, 2.0), r.history[-1]
    # both halves kept training: about 100 steps in the 1 s apart, with the 0.2 s detection
    assert during["step"] - before["step"] >= 75
    assert during["consensus_distance"] > 5 * before["consensus_distance"]  # they drifted apart
    assert after["consensus_distance"] < before["consensus_distance"]       # and came back together
    assert r.summary["final_accuracy"] > 0.93
    assert r.summary["sim_time_s"] < 300 * 0.01 + 1.0  # no timeouts left to wait out


def test_a_crashed_node_is_dropped_and_a_restarted_one_catches_up():
    common = dict(nodes=8, topology="ring", task="digits", steps=300, eval_every=10, compute="fixed:0.01")
    clean = gossip.simulate(**common)
    r = gossip.simulate(faults=["crash:3@1.0", "join:3@2.0"], detect=0.3, **common)
    ups = [h["nodes_up"] for h in r.history]
    assert min(ups) == 7 and ups[-1] == 8
    assert r.summary["faults"][0].startswith("1.000s crash 3")
    # survivors did not wait on the dead node beyond the detection delay
    assert r.summary["sim_time_s"] < clean.summary["sim_time_s"] + 0.5
    # the restarted node took a neighbour's state and ends in consensus with the others
    final = torch.stack(r.params)
    assert float(((final - final.mean(0)) ** 2).sum(1).max()) < 0.1
    assert abs(r.summary["final_accuracy"] - clean.summary["final_accuracy"]) <= 0.02


def test_a_late_starter_joins_with_a_neighbours_state():
    r = gossip.simulate(nodes=6, topology="ring", task="synthetic", steps=200, eval_every=10, faults=["join:5@1.0"],
                        detect=0.2)
    ups = [h["nodes_up"] for h in r.history]
    assert ups[0] == 5 and ups[-1] == 6
    final = torch.stack(r.params)
    assert float(((final - final.mean(0)) ** 2).sum(1).max()) < 0.1


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
    from gossip.cli import sim_main

    assert sim_main(["--nodes", "4", "--steps", "20", "--fault", "crash:1@0.05", "--detect", "0.05", "--json"]) == 0
    assert "crash 1" in capsys.readouterr().out
    assert sim_main(["--nodes", "4", "--steps", "2", "--fault", "crash:7@1"]) == 2
