"""How long a synchronous round waits for a silent neighbour (gossip/protocol/patience.py):
the rule on its own, and in simulated clusters running the real protocol."""

from __future__ import annotations

import pytest
import torch

from gossip.protocol.config import PeerConfig
from gossip.protocol.patience import DEFAULT_FLOOR, MIN_GAPS, Patience
from gossip.sim.cluster import FAST, SimCluster, node_id
from gossip.transport.links import LinkModel

torch.set_num_threads(1)


def test_the_docstring_examples_hold():
    import doctest

    import gossip.protocol.patience

    result = doctest.testmod(gossip.protocol.patience)
    assert result.attempted >= 4 and result.failed == 0


def test_the_bound_follows_each_neighbour_s_rhythm_between_the_floor_and_the_timeout():
    p = Patience(floor=0.5, ceiling=5.0)
    for k in range(MIN_GAPS):  # MIN_GAPS messages: one gap short of a rhythm
        p.heard("fast", 0.01 * k)
        p.heard("slow", 0.9 * k)
        p.heard("crawl", 3.0 * k)
    assert p.bound("fast") is None
    for k in range(MIN_GAPS, 40):
        p.heard("fast", 0.01 * k)
        p.heard("slow", 0.9 * k)
        p.heard("crawl", 3.0 * k)
    assert p.bound("fast") == 0.5  # 4 x 0.01 s: the floor
    assert p.bound("slow") == pytest.approx(3.6)  # 4 x 0.9 s: a slow but steady neighbour keeps its wait
    assert p.bound("crawl") == 5.0  # never beyond --timeout
    # one outlier (a restart's gap) among 32 does not move the 95th percentile
    p.heard("slow", 0.9 * 39 + 30.0)
    assert p.bound("slow") == pytest.approx(3.6)
    p.forget("slow")
    assert p.bound("slow") is None and "slow" not in p.last


def test_min_wait_is_checked():
    with pytest.raises(ValueError, match="min_wait must be a positive number of seconds, got 0"):
        PeerConfig(listen="127.0.0.1:7000", min_wait=0)
    with pytest.raises(ValueError, match="min_wait must be a positive number of seconds"):
        Patience(floor=float("nan"))
    assert PeerConfig(listen="127.0.0.1:7000").min_wait == DEFAULT_FLOOR


def test_a_crash_costs_its_neighbours_about_min_wait_not_the_detection_time():
    """Two of eight killed at 3 s: their neighbours stop waiting for them once they have
    been silent for min_wait (their rhythm is a step of 0.01 s), not at the removal
    2 s later; no round waits out --timeout."""
    c = SimCluster(8, steps=600)
    c.crash(2, at=3.0)
    c.crash(5, at=3.0)
    c.run(until=120.0)
    rs = [r for i, r in enumerate(c.results()) if i not in (2, 5)]
    assert all(r["exit"] == "done" and r["steps"] == 600 and r["members"] == 6 for r in rs), rs
    assert all(r["timed_out_rounds"] == 0 for r in rs), rs
    # the ring neighbours of 2 and 5 skipped rounds; nobody stalled much longer than min_wait
    assert all(rs[i]["skipped_rounds"] > 0 for i in (1, 2, 3, 4)), [r["skipped_rounds"] for r in rs]
    assert max(r["max_step_gap_s"] for r in rs) < DEFAULT_FLOOR + 0.2, [r["max_step_gap_s"] for r in rs]
    assert FAST["timing"].dead_after >= 4 * DEFAULT_FLOOR  # (so the figure above says something)


@pytest.mark.parametrize("slow", ["compute", "link"])
def test_a_slow_but_steady_neighbour_is_never_skipped(slow):
    """A node 80 times slower than the rest (0.8 s a step), or two datacenters behind a
    0.3 s link with min_wait 0.1 s: every message from the slow part comes longer after
    the last than min_wait, so a rule that gave up after min_wait of silence would skip
    it every round. Its rhythm sets how long its neighbours wait instead: no round
    mixes without it, and the replicas agree."""
    steps = 80
    if slow == "compute":
        c = SimCluster(4, steps=steps, step_time=lambda i: 0.8 if i == 1 else 0.01)
    else:
        c = SimCluster(4, steps=steps, configure=lambda i: {"dc": "east" if i < 2 else "west"},
                       inter_link=LinkModel(latency=0.3, bandwidth=1e9), min_wait=0.1)
    c.run(until=600.0)
    rs = c.results()
    assert all(r["exit"] == "done" and r["steps"] == steps and r["members"] == 4 for r in rs), rs
    assert [r["skipped_rounds"] for r in rs] == [0, 0, 0, 0] and [r["timed_out_rounds"] for r in rs] == [0] * 4
    assert max(r["neighbor_distance"] for r in rs) < 0.05, [r["neighbor_distance"] for r in rs]
    # (every node waited longer than min_wait at some round: the check above can fail)
    assert min(r["max_step_gap_s"] for r in rs) > (DEFAULT_FLOOR if slow == "compute" else 0.1)


def test_a_stall_shorter_than_detection_skips_rounds_then_mixes_again_without_a_new_life():
    """A node stalled for 1.2 s (SIGSTOP shorter than --dead-after 2 s): its neighbours
    mix without it after min_wait, and with it again from its next message; it is
    never declared dead, and nobody waits out --timeout."""
    steps = 600
    c = SimCluster(4, steps=steps)
    c.stall(1, at=3.0, until=4.2)
    c.run(until=120.0)
    rs = c.results()
    assert all(r["exit"] == "done" and r["steps"] == steps and r["members"] == 4 for r in rs), rs
    assert all(r["rejoins"] == 0 and r["timed_out_rounds"] == 0 for r in rs), rs
    assert rs[0]["skipped_rounds"] > 0 and rs[2]["skipped_rounds"] > 0, [r["skipped_rounds"] for r in rs]
    assert max(r["neighbor_distance"] for r in rs) < 0.05, [r["neighbor_distance"] for r in rs]
    assert node_id(1) in rs[0]["member_ids"]
