"""The member table and its schedule (gossip/protocol/membership.py): who trains in which round,
in what order announcements arrive, which cluster goes on when two meet."""

from __future__ import annotations

from gossip.protocol.membership import Membership
from gossip.protocol.timing import Timing
from tests.helpers import tick
from tests.protocol.test_control import FP, Plane  # (one recorded ControlPlane for both files)


def _keep_alive(p: Plane, alive: list[str], start: float, end: float) -> None:
    """Heartbeats of ``p`` from ``start`` to ``end`` (0.5 s apart), hearing ``alive`` at each
    (those still in its member table)."""
    t = start
    while t <= end:
        for a in alive:
            if a in p.m.members:
                p.m.heard(a, p.m.members[a].incarnation, t)
        tick(p.cp, t)
        t += 0.5


def _split(me: str, starters: list[str], other_side: list[str], rnd: int) -> Plane:
    """Node ``me`` of a cluster started with ``starters``, training at ``rnd``, that
    declared ``other_side`` dead (a partition): their leaves are announced."""
    p = Plane(me, status="training", rnd=rnd)
    for x in starters:
        if x != me:
            p.m.heard(x, 1, 0.0, status="training", round=rnd)
    p.m.start(starters)
    for x in other_side:
        p.m.remove(x, "silent")
    return p


def _lists(p: Plane) -> dict:
    """The member lists ``p`` sends (the extra fields of its members message)."""
    x = p.cp._members_message().extra
    return {k: x[k] for k in ("mids", "mincs", "base", "jids", "jrounds", "lids", "lrounds", "bincs", "jincs",
                              "lincs") if k in x}


def test_clusters_of_equal_size_agree_which_one_goes_on():
    a, b, c, d = (f"10.0.0.{i}:1" for i in range(1, 5))
    left, right = _split(a, [a, b, c, d], [c, d], 10), _split(d, [a, b, c, d], [a, b], 10)
    left.receive("members", d, status="training", rnd=10, **_lists(right))
    right.receive("members", a, status="training", rnd=10, **_lists(left))
    # two members each: the one holding the smallest id (a) goes on, the other joins it
    assert left.merges == [] and right.merges == [(a, {a, b})]


def test_only_a_training_node_of_the_other_cluster_counts():
    a, b = "10.0.0.1:1", "10.0.0.2:1"
    me = _split(b, [a, b], [a], 40)
    # a waits (a new life of its own, or a finished run): not a cluster that trains
    me.receive("members", a, status="waiting", rnd=60, mids=[a], mincs=[1], base=[a], lids=[b], lrounds=[45])
    me.receive("members", a, status="done", rnd=60, mids=[a], mincs=[1], base=[a], lids=[b], lrounds=[45])
    assert me.merges == [] and me.excluded == []
    me.status = "done"  # nor does a node that finished
    me.receive("members", a, status="training", rnd=60, mids=[a], mincs=[1], base=[a, b], lids=[b], lrounds=[45])
    assert me.merges == []
    me.status = "training"
    me.receive("members", a, status="training", rnd=60, mids=[a], mincs=[1], base=[a, b], lids=[b], lrounds=[45])
    assert me.merges == [(a, {a})]  # {a} against {b}: a holds the smaller id


def test_one_side_of_a_partition_that_is_forming_does_not_drop_a_node_of_the_other():
    """The cut reaches each side at a slightly different moment: for a moment, a node
    of the small side still reaches a node of the large side, and its lists drop the
    large side's nodes. That is not the large cluster's verdict: the node stays."""
    a1, a2, a3, b1, b2 = (f"10.0.0.{i}:1" for i in range(1, 6))
    everyone = [a1, a2, a3, b1, b2]
    small = _split(b1, everyone, [a1, a2], 40)  # b1 already dropped a1 and a2, not yet a3
    me = _split(a1, everyone, [], 40)  # a1 has dropped nobody yet
    me.receive("members", b1, status="training", rnd=40, **_lists(small))
    _keep_alive(me, everyone[1:], 0.0, 5.0)
    assert me.excluded == [] and me.merges == []
    # b1 still is alive and trains with us by the time the verdict is judged: it is the one
    # out of line (it dropped a2, whom the rest still count), and a1 drops it in turn
    assert b1 not in me.m.members and b1 in me.m.leaves
    me.receive("members", b1, status="training", rnd=40, **_lists(small))
    _keep_alive(me, everyone[1:], 5.5, 10.0)
    assert me.excluded == [] and me.merges == []
    # the verdict of the whole cluster (every other member trains on without us) counts
    rest = _split(a2, everyone, [a1], 40)
    me.receive("members", a2, status="training", rnd=40, **_lists(rest))
    _keep_alive(me, everyone[1:], 10.5, 14.0)
    assert me.excluded == [(45, a2)]


def test_a_list_that_drops_us_from_a_member_that_then_falls_silent_is_a_partition_not_a_verdict():
    a1, a2, b1, b2 = (f"10.0.0.{i}:1" for i in range(1, 5))
    everyone = [a1, a2, b1, b2]
    other_side = _split(a1, everyone, [b1], 40)  # a1 dropped b1 first; b2 it still counts
    me = _split(b1, everyone, [], 40)
    me.receive("members", a1, status="training", rnd=40, **_lists(other_side))
    assert a1 in me.m.eventual() and me.m.eventual() - {b1} <= other_side.m.eventual()
    _keep_alive(me, [b2], 0.0, 3.0)  # then the cut reaches this direction too: a1 and a2 fall silent
    assert me.excluded == [] and a1 not in me.m.members


def test_joins_and_leaves_of_lives_give_one_schedule_in_any_order():
    """Every order of the same announcements (two lives of x, a death of y's joiner
    life, a leave that arrives before its join) leaves the same schedule."""
    import itertools

    a, x, y = "10.0.0.1:1", "10.0.0.4:1", "10.0.0.5:1"
    events = [("leave", x, 105, 1), ("join", x, 120, 2), ("leave", x, 140, 2), ("join", x, 160, 3),
              ("join", y, 130, 7), ("leave", y, 150, 7)]
    schedules = set()
    for order in itertools.permutations(events):
        m = Membership(a, 1, FP)
        m.heard(x, 1, 0.0, status="training")
        m.start([a, x])
        m.training = True
        for kind, who, rnd, inc in order:
            (m.announce_join if kind == "join" else m.announce_leave)(who, rnd, inc)
        schedules.add((tuple(tuple(m.at_round(r)) for r in (100, 110, 125, 135, 145, 155, 165)),
                       m.schedule_digest()))
    assert len(schedules) == 1, schedules
    (rounds, _), = schedules
    # x's first life to its leave at 105, its second from 120 to 140, its third from 160
    # (each life keeps its own rounds, however late its join or leave arrives); y from 130 to 150
    assert rounds == ((a, x), (a,), (a, x), (a, x, y), (a, y), (a,), (a, x))


def test_the_docstring_examples_of_membership_hold():
    import doctest

    import gossip.protocol.membership

    result = doctest.testmod(gossip.protocol.membership)
    assert result.attempted >= 8 and result.failed == 0


def test_a_neighbour_far_behind_is_out_of_step_and_one_far_ahead_means_this_node_is():
    """The wedge under churn: four nodes near round 122,700 waited every round for a
    live member that trained at round 47,937 from a stale checkpoint."""
    from gossip.protocol.membership import out_of_step

    awaited = {"a": ("training", 47_937), "b": ("training", 122_699), "c": ("waiting", 0), "d": ("done", 10)}
    assert out_of_step(122_700, awaited, 25) == (["a"], None)
    assert out_of_step(47_937, {"b": ("training", 122_700)}, 25) == ([], "b")
    assert out_of_step(1000, {"b": ("training", 1020), "e": ("training", 980)}, 25) == ([], None)  # near: wait


def test_a_joiner_that_starts_training_announces_the_leaves_of_members_it_found_dead():
    """A node waiting for its join announces no leave of a member it finds silent
    (its silence is often its own). When it starts training, the members its schedule
    still counts but it found dead in this life leave, once they stayed silent
    another --dead-after: the trainers who would have announced it may be dead too
    (explorer seeds 10000077, 10000260: a survivor trained to the end with a crashed
    member in its topology). One that speaks again meanwhile stays; one last heard
    before this life began (across a partition, say) is no suspect: a merging node
    that announced those leaves dropped the live members of the cluster it joined."""
    a, b, c, d, e = (f"10.0.0.{i}:1" for i in range(1, 6))
    m = Membership(a, 1, FP, timing=Timing(dead_after=2.0))
    for x in (b, c, d, e):
        m.heard(x, 1, 0.0, status="training", round=4)
    m.start([b, c, d, e])
    m.new_life(2, now=1.0)  # a new life (its join comes from the lists)
    m.start([b, c, d, e], [1, 1, 1, 1])
    m.joins[a] = 6
    m.heard(c, 1, 1.5)
    m.heard(d, 1, 1.5)
    for x in (b, c, d):
        assert m.remove(x, "silent for more than 2 s")
    assert not m.leaves  # waiting: no verdict of its own yet
    m.begin_training(4.0)
    assert m.training and sorted(m.suspects) == [c, d]  # b was last heard before this life began
    m.heard(d, 1, 5.0)  # d speaks again: re-admitted, no longer a suspect
    assert m.confirm_dead(5.9) == [] and c not in m.leaves
    assert m.confirm_dead(6.0) == [c]
    assert m.leaves == {c: 4 + m.timing.leave_margin} and m.eventual() == {a, b, d, e}
    assert m.confirm_dead(9.0) == [] and not m.suspects


def test_round_now_extrapolates_each_training_member_at_this_nodes_pace_but_a_suspect_only_until_last_heard():
    """Leave rounds are announced past ``round_now``: a member that runs on may be ahead
    of its last report, one that the detector suspects (dead, most likely) is not."""
    m = Membership("a:1", 1, "f")
    m.start(["a:1", "b:1", "c:1"], [1, 1, 1])
    for mid in ("b:1", "c:1"):
        m.heard(mid, 1, 10.0, status="training", round=100)
    m.members["c:1"].last_seen = 10.5  # c spoke (a SWIM ack) after its round report
    m.clock, m.rate = 12.0, 50.0  # two seconds on, at 50 rounds a second
    assert m.round_now() == 200
    m.suspected = lambda mid: mid == "b:1"  # b suspected: c still runs on
    assert m.round_now() == 200
    m.suspected = lambda mid: mid in ("b:1", "c:1")  # both: c ran on until last heard
    assert m.round_now() == 125
    m.suspected = lambda mid: False
    m.members["b:1"].status = m.members["c:1"].status = "waiting"  # not training: where it said
    assert m.round_now() == 100


def test_a_leave_of_the_dead_is_announced_half_dead_after_of_rounds_ahead_at_this_nodes_pace():
    """Eight real nodes, two killed together: at 180 rounds a second a leave announced 5
    rounds ahead (28 ms) reached members already past it, which adopted it at rounds of
    their own, and rounds timed out; a heartbeat of rounds (45) did it too on a loaded
    CI machine. The margin is a time: the rounds of half of ``dead_after``."""
    a, b, c, d = "a:1", "b:1", "c:1", "d:1"
    m = Membership(a, 1, FP, timing=Timing(heartbeat=0.25, dead_after=2.0))
    m.start([a, b, c, d], [1, 1, 1, 1])
    m.begin_training(0.0)
    for x in (b, c, d):
        m.heard(x, 1, 10.0, status="training", round=1000)
    m.clock = 10.0
    m.rate = 2.0  # slow rounds: the configured margin holds
    assert m.remove(b, "silent for more than 2 s") and m.leaves[b] == 1000 + m.timing.leave_margin
    m.rate = 180.0
    assert m.remove(c, "silent for more than 2 s") and m.leaves[c] == 1000 + 180


def test_a_delayed_message_does_not_turn_a_trainer_back_into_a_waiter_nor_its_round_back():
    """Explorer seed 24000246 (with digests on member lists): a message sent before a
    member started, delayed 2.5 s behind a slow link, arrived after one that said it
    trained; taken, a joiner saw no member training, gave up its join and trained
    alone, and the cluster ended in two views. Only a sender's latest control message
    (by its number) says its status, round and step; an older one says it is alive."""
    m = Membership("a:1", 1, FP)
    m.heard("b:1", 1, 1.0, status="waiting", round=0, seq=1)
    m.heard("b:1", 1, 2.0, status="training", round=6, seq=5)
    for seq, status, rnd in ((2, "waiting", 0), (4, "training", 4), (5, "training", 3)):  # late, or a duplicate
        m.heard("b:1", 1, 2.5, status=status, round=rnd, seq=seq)
    b = m.members["b:1"]
    assert (b.status, b.round, b.round_at, b.last_seen) == ("training", 6, 2.0, 2.5)
    m.heard("b:1", 1, 3.0, status="training", round=7, seq=6)
    assert (b.round, b.round_at) == (7, 3.0)
    m.heard("b:1", 2, 4.0, status="waiting", round=0, seq=1)  # a new life (a new process) counts afresh
    assert (m.members["b:1"].status, m.members["b:1"].round) == ("waiting", 0)
    m.heard("b:1", 1, 4.1, status="training", round=8, seq=7)  # the old life's last words: stale
    assert (m.members["b:1"].incarnation, m.members["b:1"].status) == (2, "waiting")


def test_members_of_one_process_share_one_topology_per_spec_size_and_seed():
    """The simulator's n members each used to build their own graph of n nodes (n squared
    graph entries: 22 GB at 4,096 members); a topology never changes once built, so one
    process builds it once."""
    from gossip.protocol.membership import topology_for

    ring = topology_for("ring", 8, seed=0)
    assert topology_for("ring", 8, seed=0) is ring
    assert topology_for("ring", 9, seed=0) is not ring and topology_for("ring", 8, seed=1) is not ring
    assert topology_for("torus:4x4", 15).spec.startswith("ring")  # a spec that does not fit: a ring, as before
