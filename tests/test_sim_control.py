"""Simulated twins of the real-process fault tests: the real control plane and
lifecycle (gossip.lifecycle, gossip.control) over a simulated network and clock.

Each scenario applies faults to processes and links only (a crash, a restart, a
stall, a partition); detection, leave rounds, joins, state transfer and merges
come from the protocol. Each checks the outcome its real-process test checks
(tests/test_faults_real.py, tests/test_peer_cli.py), in seconds and
deterministically.
"""

from __future__ import annotations

import torch

from gossip import wire
from gossip.compression import get_codec
from gossip.message import Message
from gossip.simcluster import FAST, SimCluster, node_id

torch.set_num_threads(1)  # tiny models: threads only contend


def test_a_cluster_without_faults_trains_to_the_end_in_one_cluster():
    c = SimCluster(3, steps=60)
    c.run(until=60.0)
    rs = c.results()
    assert [r["exit"] for r in rs] == ["done"] * 3
    assert all(r["steps"] == 60 and r["members"] == 3 and r["timed_out_rounds"] == 0 for r in rs), rs
    assert all(not r["joined"] and r["rejected"] == {} for r in rs), rs


def test_killing_two_of_eight_costs_only_their_work():
    """Twin of test_killing_two_of_eight_nodes_costs_only_their_work."""
    steps = 600
    c = SimCluster(8, steps=steps)
    c.crash(2, at=3.0)
    c.crash(5, at=3.0)
    c.run(until=120.0)
    rs = c.results()
    assert rs[2]["exit"] == rs[5]["exit"] == "crashed"
    for i, r in enumerate(rs):
        if i in (2, 5):
            continue
        assert r["exit"] == "done" and r["steps"] == steps and r["members"] == 6, r
        assert node_id(2) not in r["member_ids"] and node_id(5) not in r["member_ids"]
        # nobody stalled longer than detection (2 s of silence) plus a heartbeat and slack
        assert r["max_step_gap_s"] < FAST["dead_after"] + 1.5, r


def test_a_late_node_joins_receives_a_state_and_trains():
    """Twin of test_late_node_joins_receives_state_and_trains."""
    steps = 600
    c = SimCluster(4, steps=steps, late=[3], join_margin=10, peers=lambda i: [(i + 1) % 3] if i < 3 else [1])
    c.start(3, at=2.5)
    c.run(until=120.0)
    rs = c.results()
    s = rs[3]
    assert s["joined"] is True and s["state_from"] in {node_id(i) for i in range(3)}, s
    assert s["steps"] == steps and s["members"] == 4, s
    assert all(r["members"] == 4 and r["exit"] == "done" for r in rs), rs
    assert s["neighbor_distance"] < 0.05, s


def test_a_restarted_node_takes_the_newer_state_and_catches_up(tmp_path):
    """Twin of test_a_restarted_node_takes_the_newer_state_and_catches_up: killed,
    restarted with --resume from checkpoints older than its neighbours' state."""
    steps = 800
    c = SimCluster(4, steps=steps, join_margin=10, checkpoint_every=50,
                   checkpoint_dir=lambda i: str(tmp_path / "ck1") if i == 1 else None)
    c.crash(1, at=3.0)
    c.start(1, at=6.0, resume=True)
    c.run(until=120.0)
    rs = c.results()
    s = rs[1]
    first_life = c.procs[1].lives[0]
    assert first_life["exit"] == "crashed" and first_life["steps"] < steps
    assert s["joined"] and s["state_from"] is not None, s
    assert s["resumed_from"] is None  # its checkpoint was older than the neighbour's state
    assert s["steps"] == steps and s["members"] == 4, s
    steady = max(r["neighbor_distance"] for i, r in enumerate(rs) if i != 1)
    assert s["neighbor_distance"] <= 2 * steady + 1e-3, (s["neighbor_distance"], steady)


def test_a_restarted_node_without_a_checkpoint_joins_with_a_member_state():
    steps = 800
    c = SimCluster(4, steps=steps, join_margin=10)
    c.crash(2, at=3.0)
    c.start(2, at=6.0)
    c.run(until=120.0)
    rs = c.results()
    assert rs[2]["joined"] and rs[2]["state_from"] is not None and rs[2]["resumed_from"] is None, rs[2]
    assert all(r["exit"] == "done" and r["steps"] == steps and r["members"] == 4 for r in rs), rs


def test_a_stalled_node_declared_dead_joins_again_by_itself():
    """Twin of test_a_paused_node_declared_dead_joins_again_by_itself (SIGSTOP past
    --dead-after, then SIGCONT)."""
    steps = 1000
    c = SimCluster(4, steps=steps, join_margin=10)
    c.stall(1, at=3.0, until=6.0)
    c.run(until=120.0)
    rs = c.results()
    s = rs[1]
    assert s["rejoins"] == 1 and s["joined"] and s["state_from"] is not None, s
    assert s["steps"] == steps and s["members"] == 4, s
    assert all(r["members"] == 4 and r["exit"] == "done" for r in rs), rs  # back in everyone's topology
    assert all(r["timed_out_rounds"] <= 2 for r in rs), rs
    assert max(r["neighbor_distance"] for r in rs) < 0.01, rs


def test_the_halves_of_a_partition_become_one_cluster_again_when_it_heals():
    """Twin of test_the_halves_of_a_partition_become_one_cluster_again_when_it_heals:
    the smaller half (3, 4) joins the larger (0, 1, 2) as new lives with a member's state."""
    steps = 1200
    c = SimCluster(5, steps=steps, join_margin=10)
    c.partition([[0, 1, 2], [3, 4]], at=3.0, until=7.0)
    c.run(until=120.0)
    rs = c.results()
    for s in rs[:3]:  # the larger half went on: no new life
        assert s["rejoins"] == 0 and s["merges"] == 0, s
    for s in rs[3:]:  # the smaller came back as new lives, with a member's state
        assert s["rejoins"] == 1 and s["joined"] and s["state_from"] is not None, s
    assert sum(s["merges"] for s in rs[3:]) >= 1, rs[3:]
    assert all(s["members"] == 5 and s["steps"] == steps and s["exit"] == "done" for s in rs), rs


def test_halves_that_started_apart_become_one_cluster():
    """Clusters started apart (each half's seeds across the cut did not answer, so
    each started alone after --join-timeout) meet when the link comes up; the
    smaller joins the larger."""
    steps = 1200
    c = SimCluster(5, steps=steps, join_margin=10, join_timeout=3.0)
    c.partition([[0, 1, 2], [3, 4]], at=0.0, until=6.0)
    c.run(until=120.0)
    rs = c.results()
    assert all(s["rejoins"] == 0 for s in rs[:3]), rs[:3]
    assert all(s["rejoins"] == 1 and s["merges"] == 1 and s["state_from"] in {node_id(i) for i in range(3)}
               for s in rs[3:]), rs[3:]
    assert all(s["members"] == 5 and s["steps"] == steps for s in rs), rs


def test_a_run_replays_exactly_from_its_seed():
    def once():
        c = SimCluster(4, steps=300, seed=7, join_margin=10, late=[3], peers=lambda i: [(i + 1) % 3])
        c.start(3, at=1.5)
        c.crash(1, at=2.0)
        c.run(until=60.0)
        return [(r["params_sha256"], r["steps"], r["member_ids"], r["state_from"]) for r in c.results()], \
            c.frames_sent
    assert once() == once()


def test_bad_frames_from_a_member_change_nothing_and_are_counted():
    """Garbage, a forged sender, and a state message of the wrong size, from a member's
    id: each is refused by the real decoder and checks, the run ends as a clean one."""
    def run(attack: bool):
        c = SimCluster(3, steps=200)
        if attack:
            good = Message("state", node_id(1), 5, 5, 99, None, None, {}, c.fingerprint)
            frames = [bytes(memoryview(f).cast("B")) for f in wire.encode(good)]
            for k, bad in enumerate(([b"junk"], [b"GSP/1", b"\xc1"], frames)):
                c.at(1.5 + 0.1 * k, "inject", lambda bad=bad: c._receive(c.procs[0], node_id(1), bad))
            c.at(1.9, "forged", lambda: c._receive(c.procs[0], node_id(2), frames))
        c.run(until=60.0)
        return c.results()

    clean, attacked = run(False), run(True)
    assert attacked[0]["params_sha256"] == clean[0]["params_sha256"]
    assert all(r["exit"] == "done" and r["steps"] == 200 for r in attacked)
    assert sum(attacked[0]["rejected"].values()) >= 3, attacked[0]["rejected"]
    assert "sender-mismatch" in attacked[0]["rejected"], attacked[0]["rejected"]


def test_explored_schedules_hold_every_invariant():
    """A bounded form of ``python -m gossip.explore`` (CI); the soak form runs many more."""
    from gossip import explore

    assert explore.main(["--runs", "3", "--seed", "11"]) == 0


def test_the_explorer_reports_survivors_that_stay_apart():
    """The check can fail: a partition that never heals leaves two clusters."""
    from gossip import explore

    c = SimCluster(4, steps=explore.STEPS, step_time=explore.STEP_S, task=explore.TASK, join_margin=10)
    c.partition([[0, 1], [2, 3]], at=2.0)
    c.run(until=200.0)
    bad = explore.check(c)
    assert any("end in clusters" in b for b in bad), bad
    assert all(r["exit"] == "done" for r in c.results())  # each half trained on to the end


def test_an_explored_schedule_replays_exactly():
    from gossip import explore

    def trace(seed):
        import tempfile

        with tempfile.TemporaryDirectory() as work:
            c = explore.run_schedule(explore.draw(seed), work)
            return [r["params_sha256"] for r in c.results()], c.frames_sent

    s = explore.draw(5)
    assert s.faults and s == explore.draw(5)
    assert trace(5) == trace(5)


def test_the_mixing_audit_catches_a_message_filed_under_the_wrong_member():
    """The check behind "no round mixes a message from a non-member or of another
    round" can fail: a message slipped into a neighbour's inbox slot is reported."""
    c = SimCluster(3, steps=100)

    def slip():
        node = c.procs[0].life.node
        j = next(j for j in node.topology.in_weights(node.index, node.round) if j != node.index)
        payload = get_codec("none").encode(node.state.snapshot())
        forged = Message("state", "10.9.9.9:1", node.round + 3, 0, 10**6, payload, None, {}, c.fingerprint)
        node.channels[0].inbox.add(j, forged)

    c.at(1.6, "slip", slip)
    c.run(until=60.0)
    assert any("from 10.9.9.9:1" in v for v in c.procs[0].mix_violations), c.procs[0].mix_violations
    assert not c.procs[1].mix_violations and not c.procs[2].mix_violations


def test_the_swim_detector_runs_in_the_simulated_cluster_too():
    """The failure detector is a part the control plane is given: with SWIM, a crash is
    detected and the survivors train on without it, as with heartbeats."""
    c = SimCluster(6, steps=600, detector="swim")
    c.crash(2, at=3.0)
    c.run(until=120.0)
    rs = c.results()
    for i, r in enumerate(rs):
        if i != 2:
            assert r["exit"] == "done" and r["steps"] == 600 and r["members"] == 5, r
            assert r["max_step_gap_s"] < FAST["dead_after"] + 1.5, r
