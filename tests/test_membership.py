"""The membership protocol of one peer, without sockets: starting together, restarts,
fresh connections towards members that come back, and a live member declared dead."""

from __future__ import annotations

import threading

from gossip.control import ControlPlane
from gossip.membership import Membership
from gossip.message import Message

FP = "f" * 16


class Plane:
    """A ControlPlane for node ``me`` whose sends and reconnects are recorded."""

    def __init__(self, me: str, *, seeds: tuple[str, ...] = (), status: str = "waiting", rnd: int = 0) -> None:
        self.sent: list[tuple[str, Message]] = []
        self.reconnected: list[str] = []
        self.excluded: list[tuple[int, str]] = []
        self.status, self.round = status, rnd
        self.m = Membership(me, 1, FP, dead_after=2.0)
        self.m.training = status == "training"
        self.m.heard(me, 1, 0.0)
        self.cp = ControlPlane(me, 1, FP, "", self.m, threading.RLock(), lambda d, m: self.sent.append((d, m)),
                               lambda m: None, lambda: (self.status, self.round, 0), heartbeat=0.5, seeds=seeds,
                               reconnect=self.reconnected.append,
                               excluded=lambda r, by: self.excluded.append((r, by)))

    def receive(self, kind: str, sender: str, inc: int = 1, *, status: str = "waiting", rnd: int = 0,
                **extra) -> None:
        from gossip import wire

        x = {"inc": inc, "status": status, "dc": "", **extra}
        frames = wire.encode(Message(kind, sender, rnd, 0, 0, None, None, x, FP))
        self.cp.on_frames(sender.encode(), [bytes(memoryview(f)) for f in frames])


def test_a_fresh_start_waits_for_every_seed_of_every_member():
    a = Plane("10.0.0.1:1", seeds=("10.0.0.2:1",))
    a.receive("hello", "10.0.0.2:1", mids=["10.0.0.1:1", "10.0.0.2:1"], mincs=[1, 1], seeding=True)
    a.cp.now = 10.0
    a.cp.digests["10.0.0.2:1"] = a.m.digest()
    ok, why = a.cp.settled(10.0, 1.0)
    # our own seed answered, but the other member still waits for one of its seeds
    assert not ok and "10.0.0.2:1 waits for one of its seeds" in why
    a.receive("ping", "10.0.0.2:1", digest=a.m.digest(), seeding=False)
    assert a.cp.settled(10.0, 1.0) == (True, "")
    # after --join-timeout a silent seed no longer holds the start back
    b = Plane("10.0.0.3:1", seeds=("10.0.0.9:1",))
    b.receive("hello", "10.0.0.4:1", mids=["10.0.0.3:1", "10.0.0.4:1"], mincs=[1, 1])
    b.cp.digests["10.0.0.4:1"] = b.m.digest()
    assert b.cp.settled(10.0, 1.0)[0] is False
    assert b.cp.settled(10.0, 1.0, seeds=False) == (True, "")


def test_a_restarted_member_is_scheduled_as_a_joiner_after_its_old_life_leaves():
    a = Plane("10.0.0.1:1", status="training", rnd=100)
    a.m.heard("10.0.0.2:1", 1, 0.0, status="training", round=100)
    a.m.start(["10.0.0.1:1", "10.0.0.2:1"])
    assert a.m.at_round(100) == ["10.0.0.1:1", "10.0.0.2:1"]
    a.receive("hello", "10.0.0.2:1", inc=2)  # same id, a new life (it was killed and restarted)
    join = a.m.joins["10.0.0.2:1"]
    assert join >= 100 + a.m.join_margin
    # its old life no longer counts; the new one takes part from the announced round on
    assert "10.0.0.2:1" not in a.m.base and "10.0.0.2:1" not in a.m.leaves
    assert a.m.at_round(join - 1) == ["10.0.0.1:1"] and a.m.at_round(join) == ["10.0.0.1:1", "10.0.0.2:1"]
    announced = [m for d, m in a.sent if m.kind == "members"]
    assert announced and announced[-1].extra["jids"] == ["10.0.0.2:1"]
    # the connection towards its previous life is dropped before anything is sent to the new one
    assert a.reconnected == ["10.0.0.2:1"]
    assert [d for d, m in a.sent if m.kind == "members"][:1] == ["10.0.0.2:1"]


def test_a_restarted_node_learns_it_is_no_longer_a_starter():
    """The running cluster lists an older incarnation of us: we join, not start as a member."""
    me = Plane("10.0.0.2:1")
    me.cp.incarnation = 2
    me.receive("members", "10.0.0.1:1", status="training", rnd=50, mids=["10.0.0.1:1", "10.0.0.2:1"],
               mincs=[1, 1], base=["10.0.0.1:1", "10.0.0.2:1"], jids=["10.0.0.2:1"], jrounds=[70],
               lids=["10.0.0.2:1"], lrounds=[60])
    assert me.m.base == {"10.0.0.1:1"}
    assert me.m.joins == {"10.0.0.2:1": 70}


def test_a_live_node_learns_the_cluster_dropped_it_and_joins_as_a_new_life():
    """A paused process is declared dead; back, it hears its own leave and starts afresh."""
    a, b = "10.0.0.1:1", "10.0.0.2:1"
    me = Plane(b, status="training", rnd=40)
    me.m.heard(a, 1, 0.0, status="training", round=60)
    me.m.start([a, b])
    # not from a member, or from one still waiting: not the running cluster's word
    me.receive("members", "10.0.0.9:1", status="training", rnd=60, lids=[b], lrounds=[45])
    me.receive("members", a, status="waiting", rnd=60, lids=[b], lrounds=[45])
    assert me.excluded == []
    me.receive("members", a, status="training", rnd=60, mids=[a], mincs=[1], base=[a, b], lids=[b], lrounds=[45])
    assert me.excluded == [(45, a)]
    assert b in me.m.base and b not in me.m.leaves  # our own table never drops ourselves

    # the new life: like a restarted process, it is a joiner the members schedule
    me.status = "waiting"
    me.cp.incarnation = 2
    me.m.new_life(2)
    assert me.m.base == {a} and me.m.members[b].incarnation == 2
    other = Plane(a, status="training", rnd=60)
    other.m.heard(b, 1, 0.0, status="training", round=40)
    other.m.start([a, b])
    other.m.remove(b, "silent")  # what its failure detector did during the pause
    other.receive("hello", b, inc=2, base=[a])
    join = other.m.joins[b]
    assert join >= 60 + other.m.join_margin and other.m.at_round(join) == [a, b]
    announced = [m for d, m in other.sent if m.kind == "members"][-1]
    me.receive("members", a, status="training", rnd=60, mids=[a, b], mincs=[1, 2], base=sorted(other.m.base),
               jids=announced.extra["jids"], jrounds=announced.extra["jrounds"], lids=[b], lrounds=[45])
    assert me.m.joins[b] == join and me.m.at_round(join) == [a, b]

    # trained again from its join round: a leave older than that is its previous life's
    me.status = "training"
    me.receive("members", a, status="training", rnd=join + 1, lids=[b], lrounds=[45])
    assert me.excluded == [(45, a)]


def test_a_node_that_stalled_does_not_count_its_own_stall_as_the_members_silence():
    a, b = "10.0.0.1:1", "10.0.0.2:1"
    me = Plane(a, status="training")
    me.m.heard(b, 1, 0.0, status="training")
    assert me.cp.tick(0.0) == [] and me.cp.tick(0.5) == []
    assert me.cp.tick(30.0) == []  # 29.5 s without a tick: we were stopped, not b
    assert b in me.m.members
    # from then on b's silence counts as usual: dead once it is longer than dead_after (2 s)
    assert [me.cp.tick(t) for t in (30.5, 31.0, 31.5, 32.0)] == [[], [], [], [b]]
    # a normal gap is silence as usual
    c = Plane(a, status="training")
    c.m.heard(b, 1, 0.0, status="training")
    for t in (0.0, 0.5, 1.0, 1.5, 2.0):
        assert c.cp.tick(t) == []
    assert c.cp.tick(2.5) == [b]


def test_a_node_waiting_for_its_join_does_not_drop_a_member_it_cannot_hear():
    """A node between lives (waiting for its join round and a neighbour's state) may not
    hear a member for a while. Its verdict must not become a leave round: the member
    ignores a non-training node's word, keeps training, and the two would never again
    agree on who trains (every synchronous round would wait for the other in vain)."""
    a, b, c = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
    me = Plane(b, status="training", rnd=40)
    for other in (a, c):
        me.m.heard(other, 1, 0.0, status="training", round=40)
    me.m.start([a, b, c])
    me.status = "waiting"
    me.m.new_life(2)  # declared dead while paused: a new life, which joins at an announced round
    assert not me.m.training
    me.m.announce_join(b, 60)
    me.m.members[c].last_seen = 3.0
    assert me.cp.tick(3.0) == [a]  # a was silent for more than dead_after: removed from the table
    assert a not in me.m.members and a not in me.m.leaves  # but no leave round: we do not train
    me.receive("ping", a, status="training", rnd=45)  # a speaks: it was alive all along
    assert me.m.at_round(60) == [a, b, c]  # the same members a and c train with from round 60

    # a training node's verdict still is a leave round, announced to all
    other = Plane(c, status="training", rnd=40)
    other.m.heard(a, 1, 0.0, status="training", round=40)
    other.m.start([a, c])
    assert other.cp.tick(3.0) == [a] and a in other.m.leaves
