"""The control plane of one peer, without sockets (gossip/protocol/control.py): starting together,
restarts, fresh connections towards members that come back, a live member declared dead, the
heartbeat detector and the verdicts of any detector."""

from __future__ import annotations

import threading

from gossip.core.message import Message
from gossip.protocol.control import ControlPlane
from gossip.protocol.membership import Membership
from gossip.protocol.timing import Timing
from tests.helpers import tick


FP = "f" * 16


class Plane:
    """A ControlPlane for node ``me`` whose sends and reconnects are recorded, on the
    heartbeat detector (its verdicts follow from ``last_seen`` alone)."""

    def __init__(self, me: str, *, seeds: tuple[str, ...] = (), status: str = "waiting", rnd: int = 0,
                 inc: int = 1) -> None:
        self.sent: list[tuple[str, Message]] = []
        self.reconnected: list[str] = []
        self.excluded: list[tuple[int, str]] = []
        self.merges: list[tuple[str, set[str]]] = []  # (by, the cluster to join)
        self.status, self.round = status, rnd
        self.m = Membership(me, inc, FP, timing=Timing(dead_after=2.0))
        self.m.training = status == "training"
        self.m.heard(me, inc, 0.0)
        self.cp = ControlPlane(me, inc, FP, "", self.m, threading.RLock(), lambda d, m: self.sent.append((d, m)),
                               lambda m: None, lambda: (self.status, self.round, 0), timing=self.m.timing, seeds=seeds,
                               reconnect=self.reconnected.append,
                               excluded=self._excluded, detector="heartbeat")

    def _excluded(self, rnd: int, by: str, cluster: set[str], merge: bool) -> None:
        if merge:
            self.merges.append((by, cluster))
        else:
            self.excluded.append((rnd, by))

    def receive(self, kind: str, sender: str, inc: int = 1, *, status: str = "waiting", rnd: int = 0,
                proven: bool = True, **extra) -> None:
        """A message from ``sender``; one that has proved its address (``proven``: it sends
        this node's token back) unless told otherwise."""
        from gossip.transport import wire

        x = {"inc": inc, "status": status, "dc": "", **({"echo": self.cp.token(sender)} if proven else {}), **extra}
        frames = wire.encode(Message(kind, sender, rnd, 0, 0, None, None, x, FP))
        self.cp.on_frames(sender.encode(), [bytes(memoryview(f)) for f in frames])


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


def test_a_fresh_start_waits_for_every_seed_of_every_member():
    a = Plane("10.0.0.1:1", seeds=("10.0.0.2:1",))
    a.receive("hello", "10.0.0.2:1", mids=["10.0.0.1:1", "10.0.0.2:1"], mincs=[1, 1], seeding=True)
    a.cp.now = 10.0
    a.receive("ping", "10.0.0.2:1", digest=a.m.digest(), seeding=True)
    ok, why = a.cp.settled(10.0, 1.0)
    # our own seed answered, but the other member still waits for one of its seeds
    assert not ok and "10.0.0.2:1 waits for one of its seeds" in why
    a.receive("ping", "10.0.0.2:1", digest=a.m.digest(), seeding=False)
    assert a.cp.settled(10.0, 1.0) == (True, "")
    # after --join-timeout a silent seed no longer holds the start back
    b = Plane("10.0.0.3:1", seeds=("10.0.0.9:1",))
    b.receive("hello", "10.0.0.4:1", mids=["10.0.0.3:1", "10.0.0.4:1"], mincs=[1, 1])
    b.receive("ping", "10.0.0.4:1", digest=b.m.digest())
    assert b.cp.settled(10.0, 1.0)[0] is False
    assert b.cp.settled(10.0, 1.0, seeds=False) == (True, "")


def test_a_restarted_member_is_scheduled_as_a_joiner_after_its_old_life_leaves():
    a = Plane("10.0.0.1:1", status="training", rnd=100)
    a.m.heard("10.0.0.2:1", 1, 0.0, status="training", round=100)
    a.m.start(["10.0.0.1:1", "10.0.0.2:1"])
    assert a.m.at_round(100) == ["10.0.0.1:1", "10.0.0.2:1"]
    a.receive("hello", "10.0.0.2:1", inc=2)  # same id, a new life (it was killed and restarted)
    join = a.m.joins["10.0.0.2:1"]
    assert join >= 100 + a.m.timing.join_margin
    # its old life no longer counts; the new one takes part from the announced round on
    assert "10.0.0.2:1" not in a.m.base and "10.0.0.2:1" not in a.m.leaves
    assert a.m.at_round(join - 1) == ["10.0.0.1:1"] and a.m.at_round(join) == ["10.0.0.1:1", "10.0.0.2:1"]
    announced = [m for d, m in a.sent if m.kind == "members"]
    assert announced and announced[-1].extra["jids"] == ["10.0.0.2:1"]
    # the connection towards its previous life is dropped before anything is sent to the new one
    assert a.reconnected == ["10.0.0.2:1"]
    assert [d for d, m in a.sent if m.kind == "members"][:1] == ["10.0.0.2:1"]


def test_a_training_member_s_hello_reopens_the_connection_towards_it_before_the_answer():
    """A member that trains, in the life the table holds, says hello when its rounds keep
    timing out waiting for this node (Lifecycle.out_of_step): the connection from here to
    it may deliver nothing while its own works. It is reopened before the member list
    goes back; its other messages reopen nothing."""
    a = Plane("10.0.0.1:1", status="training", rnd=100)
    a.m.heard("10.0.0.2:1", 1, 0.0, status="training", round=100)
    a.m.start(["10.0.0.1:1", "10.0.0.2:1"])
    a.m.take_renewed()  # (its record is not news: known before)
    a.receive("hello", "10.0.0.2:1", status="training", rnd=100)
    assert a.reconnected == ["10.0.0.2:1"]
    assert [(d, m.kind) for d, m in a.sent] == [("10.0.0.2:1", "members")]  # (after the reconnect: apply's order)
    a.receive("ping", "10.0.0.2:1", status="training", rnd=101)  # (its other messages reopen nothing)
    a.receive("members", "10.0.0.2:1", status="training", rnd=101, mids=["10.0.0.1:1", "10.0.0.2:1"], mincs=[1, 1])
    assert a.reconnected == ["10.0.0.2:1"]


def test_a_new_life_learned_first_from_a_member_list_still_ends_the_counted_life():
    """(explorer seed 115000414) c's list tells a of b's new life before b speaks; the
    table takes it silently, so b's own first message is no restart. The life a's
    schedule counts ended all the same: it leaves at an announced round. Before, it
    stayed counted for good, and b's new cluster and a's never merged."""
    a, b, c = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
    pa = Plane(a, status="training", rnd=100)
    for x in (b, c):
        pa.m.heard(x, 1, 0.0, status="training", round=100)
    pa.m.start([a, b, c])
    pa.receive("members", c, status="training", rnd=100, mids=[a, b, c], mincs=[1, 2, 1])
    assert pa.m.members[b].incarnation == 2 and pa.m.counts(b)  # the table knows; the schedule counts life 1
    assert b not in pa.m.leaves
    schedule = pa.m.schedule_digest()
    pa.receive("ping", b, inc=2, status="training", rnd=3)
    assert pa.m.leaves[b] == 100 + pa.m.timing.leave_margin and pa.m.lives[b] == 1
    assert pa.m.eventual() == {a, c}
    # a's pings carry the new schedule digest: members that differ ask for its lists
    assert pa.m.schedule_digest() != schedule


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
    _keep_alive(me, [a], 0.0, 2.5)
    assert me.excluded == []  # judged 1.5 * dead_after later (a partition that forms looks alike at first)
    _keep_alive(me, [a], 3.0, 3.0)
    assert me.excluded == [(45, a)]
    assert b in me.m.base and b not in me.m.leaves  # our own table never drops ourselves

    # the new life: like a restarted process, it is a joiner the members schedule
    me.status = "waiting"
    me.cp.incarnation = 2
    me.m.new_life(2, target={a})
    # it knows who is alive, not who trains when: it learns that from the cluster it joins
    assert me.m.base == set() and me.m.leaves == {} and me.m.target == {a} and me.m.members[b].incarnation == 2
    other = Plane(a, status="training", rnd=60)
    other.m.heard(b, 1, 0.0, status="training", round=40)
    other.m.start([a, b])
    other.m.remove(b, "silent")  # what its failure detector did during the pause
    other.receive("hello", b, inc=2, base=[a])
    join = other.m.joins[b]
    assert join >= 60 + other.m.timing.join_margin and other.m.at_round(join) == [a, b]
    announced = [m for d, m in other.sent if m.kind == "members"][-1]
    me.receive("members", a, status="training", rnd=60, mids=[a, b], mincs=[1, 2], base=sorted(other.m.base),
               jids=announced.extra["jids"], jrounds=announced.extra["jrounds"], lids=[b], lrounds=[45])
    assert me.m.joins[b] == join and me.m.at_round(join) == [a, b]

    # trained again from its join round: a leave older than that is its previous life's
    me.status = "training"
    me.receive("members", a, status="training", rnd=join + 1, base=[a], jids=[b], jrounds=[join], lids=[b],
               lrounds=[45])
    assert me.excluded == [(45, a)]


def test_a_node_that_stalled_does_not_count_its_own_stall_as_the_members_silence():
    a, b = "10.0.0.1:1", "10.0.0.2:1"
    me = Plane(a, status="training")
    me.m.heard(b, 1, 0.0, status="training")
    assert tick(me.cp, 0.0) == [] and tick(me.cp, 0.5) == []
    assert tick(me.cp, 30.0) == []  # 29.5 s without a tick: we were stopped, not b
    assert b in me.m.members
    # from then on b's silence counts as usual: dead once it is longer than dead_after (2 s)
    assert [tick(me.cp, t) for t in (30.5, 31.0, 31.5, 32.0)] == [[], [], [], [b]]
    # a normal gap is silence as usual
    c = Plane(a, status="training")
    c.m.heard(b, 1, 0.0, status="training")
    for t in (0.0, 0.5, 1.0, 1.5, 2.0):
        assert tick(c.cp, t) == []
    assert tick(c.cp, 2.5) == [b]


def test_a_waiting_node_that_stalled_settles_again_on_what_the_members_say_after_it():
    """Seed 56000445: a starter stalled through the start; the others dropped it and
    started without it, their start announcement going to the members they kept. Awake,
    it must not start on its view from before the stall, nor on what waited in its
    socket meanwhile (pings saying "waiting", sent before they started)."""
    a, b = "10.0.0.1:1", "10.0.0.2:1"

    def stalled() -> Plane:
        me = Plane(a)
        me.cp.now = 0.0
        me.receive("hello", b, mids=[a, b], mincs=[1, 1])
        for t in (0.0, 0.5, 1.0):
            me.cp.now = t
            me.receive("ping", b, digest=me.m.digest())
            tick(me.cp, t)
        assert me.cp.settled(2.5, 1.0) == (True, "")  # without a stall: settled
        tick(me.cp, 30.0)  # 29 s without a tick: this node was stopped
        me.cp.now = 30.0
        me.receive("ping", b, digest=me.m.digest())  # the backlog, drained as it wakes
        assert me.cp.settled(30.0, 1.0)[0] is False
        ok, why = me.cp.settled(31.5, 1.0)
        assert not ok and why == f"{b} has not reported our member set since this node stalled"
        return me

    me = stalled()
    me.cp.now = 31.6
    me.receive("ping", b, status="training", cseq=50, digest=me.m.digest())  # b started without it
    assert me.cp.settled(31.6, 1.0) == (False, f"{b} is training")
    me.cp.now = 31.7
    me.receive("ping", b, cseq=40, digest=me.m.digest())  # "waiting", sent before: older, not taken
    assert me.cp.settled(31.7, 1.0) == (False, f"{b} is training")
    me = stalled()  # had b still waited, a start would settle once it spoke after the stall
    me.cp.now = 31.7
    me.receive("ping", b, digest=me.m.digest())
    assert me.cp.settled(31.7, 1.0) == (True, "")


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
    me.m.new_life(2, target={a, c})  # declared dead while paused: a new life, which joins at an announced round
    assert not me.m.training
    me.receive("members", c, status="training", rnd=40, mids=[a, b, c], mincs=[1, 2, 1], base=[a, c], jids=[b],
               jrounds=[60])
    me.m.members[c].last_seen = 3.0
    assert tick(me.cp, 3.0) == [a]  # a was silent for more than dead_after: removed from the table
    assert a not in me.m.members and a not in me.m.leaves  # but no leave round: we do not train
    me.receive("ping", a, status="training", rnd=45)  # a speaks: it was alive all along
    assert me.m.at_round(60) == [a, b, c]  # the same members a and c train with from round 60

    # a training node's verdict still is a leave round, announced to all
    other = Plane(c, status="training", rnd=40)
    other.m.heard(a, 1, 0.0, status="training", round=40)
    other.m.start([a, c])
    assert tick(other.cp, 3.0) == [a] and a in other.m.leaves


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
                              "lincs", "fids", "fincs", "fends") if k in x}


def test_the_halves_of_a_healed_partition_meet_and_the_smaller_joins_the_larger():
    a1, a2, a3, b1, b2 = (f"10.0.0.{i}:1" for i in range(1, 6))
    everyone = [a1, a2, a3, b1, b2]
    big = _split(a1, everyone, [b1, b2], 60)
    small = _split(b1, everyone, [a1, a2, a3], 80)
    assert big.m.eventual() == {a1, a2, a3} and small.m.eventual() == {b1, b2}
    big_before = (set(big.m.base), dict(big.m.joins), dict(big.m.leaves))
    small_before = (set(small.m.base), dict(small.m.joins), dict(small.m.leaves))

    # the link is back: a1's hello (a probe) reaches b1, b1's answer reaches a1
    small.receive("hello", a1, status="training", rnd=60, **_lists(big))
    big.receive("members", b1, status="training", rnd=80, **_lists(small))
    # b1's cluster is the smaller: it joins a1's; a1's goes on and schedules nothing
    assert small.merges == [(a1, {a1, a2, a3})] and small.excluded == []
    assert big.merges == [] and big.excluded == []
    # neither took the other cluster's lists: they describe another cluster
    assert (set(big.m.base), dict(big.m.joins), dict(big.m.leaves)) == big_before
    assert (set(small.m.base), dict(small.m.joins), dict(small.m.leaves)) == small_before
    # a training node of another cluster that says hello is not a joiner
    big.receive("hello", b2, status="training", rnd=80, **_lists(small))
    assert b2 not in big.m.joins
    # the other cluster's rounds (80) do not move this cluster's leave and join rounds
    assert big.m.max_round() == 60

    # b1's new life joins a1's cluster: it takes lists only from that cluster's members
    small.status = "waiting"
    small.cp.incarnation = 2
    small.m.new_life(2, target={a1, a2, a3})
    assert small.m.base == set() and small.m.leaves == {} and small.m.target == {a1, a2, a3}
    b2_side = _split(b2, everyone, [a1, a2, a3], 81)
    small.receive("members", b2, status="training", rnd=81, **_lists(b2_side))
    assert small.m.base == set()  # b2 still trains in the smaller cluster: not its lists
    big.receive("hello", b1, inc=2, status="waiting", rnd=0, **_lists(small))
    join = big.m.joins[b1]
    assert join >= 60 + big.m.timing.join_margin and big.m.at_round(join) == [a1, a2, a3, b1]
    small.receive("members", a1, status="training", rnd=60, **_lists(big))
    assert small.m.joins[b1] == join and small.m.at_round(join) == [a1, a2, a3, b1]


def _deliver(msg: Message, to: Plane) -> None:
    """``msg`` (as one node sent it) arrives at ``to``, through the wire."""
    from gossip.transport import wire

    to.cp.on_frames(msg.sender.encode(), [bytes(memoryview(f)) for f in wire.encode(msg)])


def test_the_dead_are_probed_with_a_light_hello_and_whoever_answers_gets_the_whole_table_back():
    """A probe of a member declared dead names only the sender (a whole table was 176 KB
    at 4,096 members, to every dead member every few seconds); whoever answers sends its
    whole table and gets this node's back, so the halves of a healed partition each judge
    the other from its lists, as a whole hello let them (explorer seed 8200024619)."""
    a1, a2, a3, b1, b2 = (f"10.0.0.{i}:1" for i in range(1, 6))
    everyone = [a1, a2, a3, b1, b2]
    big = _split(a1, everyone, [b1, b2], 60)
    small = _split(b1, everyone, [a1, a2, a3], 80)
    _keep_alive(big, [a2, a3], 0.0, 3.0)
    probe = [m for d, m in big.sent if d == b1 and m.kind == "hello"]
    assert len(probe) == 1 and probe[0].extra["mids"] == [a1] and "base" not in probe[0].extra
    whole = big.cp._members_message("hello")
    assert set(whole.extra["mids"]) == {a1, a2, a3} and "base" in whole.extra

    _deliver(probe[0], small)  # the link is back: b1 answers with its whole table
    answer = [m for d, m in small.sent if d == a1 and m.kind == "members" and "base" in m.extra]
    assert len(answer) == 1 and {b1, b2} <= set(answer[0].extra["mids"]) and small.merges == []
    before = len(big.sent)
    _deliver(answer[0], big)  # a1 learns b1's cluster (the smaller: a1's goes on) ...
    back = [m for d, m in big.sent[before:] if d == b1 and m.kind == "members" and "base" in m.extra]
    assert big.merges == [] and len(back) == 1
    assert set(back[0].extra["base"]) == {a1, a2, a3, b1, b2} and b1 in back[0].extra["lids"]
    _deliver(back[0], small)  # ... and b1 judges a1's from a1's lists: it joins the larger
    assert small.merges == [(a1, {a1, a2, a3})]
    # one table back for each probe answered: b1's lists again get nothing
    before = len(big.sent)
    big.receive("members", b1, status="training", rnd=81, **_lists(small))
    assert [d for d, m in big.sent[before:] if m.kind == "members" and "base" in m.extra] == []


def test_a_waiting_node_probes_the_dead_with_its_whole_lists_so_another_cluster_does_not_schedule_its_join():
    """A node that waits to join its side of a healed partition again probes the other
    side with its whole lists: they name the cluster it waits for, which the answerer is
    not in. A light hello names no cluster, and a training node takes a waiting sender
    of one for a joiner of its own (explorer seed 9100027799: the waiting node was then
    scheduled to join both sides, and two nodes ended with a member list of their own)."""
    a1, a2, w, b1 = (f"10.0.0.{i}:1" for i in range(1, 5))
    everyone = [a1, a2, w, b1]
    big = _split(a1, everyone, [w, b1], 60)
    small = _split(b1, everyone, [a1, a2], 80)
    waiting = _split(w, everyone, [a1, a2], 80)
    # excluded by its side, w waits to join it again as a new life, which b1 schedules
    waiting.status = "waiting"
    with waiting.cp.lock:
        waiting.cp.new_life(2)
        waiting.m.new_life(2, target=[b1])
    _deliver(waiting.cp._members_message("hello"), small)
    assert small.m.joins.get(w, 0) > 80
    _deliver([m for d, m in small.sent if d == w and "base" in m.extra][-1], waiting)
    assert waiting.m.started and waiting.m.eventual() == {w, b1}
    _keep_alive(waiting, [b1], 0.0, 6.0)
    probe = [m for d, m in waiting.sent if d == a1 and m.kind == "hello"]
    assert probe and all({w, b1} <= set(m.extra["mids"]) and "base" in m.extra for m in probe)
    assert waiting.cp.probed == {}  # (no light hello: its answer gets no table back)
    _deliver(probe[0], big)
    assert w not in big.m.joins and big.m.eventual() == {a1, a2}
    # what the light hello would have done
    _deliver(waiting.cp._probe_message(), big)
    assert w in big.m.joins


def test_a_node_that_trained_alone_joins_the_cluster_its_seed_started_without_it():
    """A seed that answers only after --join-timeout: the node trained alone meanwhile."""
    alone, s1, s2 = "10.0.0.9:1", "10.0.0.1:1", "10.0.0.2:1"
    me = Plane(alone, status="training", rnd=30)
    me.m.start([alone])
    seed = Plane(s1, status="training", rnd=50)
    seed.m.heard(s2, 1, 0.0, status="training", round=50)
    seed.m.start([s1, s2])
    seed.receive("hello", alone, status="training", rnd=30, **_lists(me))
    me.receive("members", s1, status="training", rnd=50, **_lists(seed))
    assert me.merges == [(s1, {s1, s2})] and seed.merges == [] and alone not in seed.m.joins


def test_members_declared_dead_are_asked_now_and_then_whether_they_are_back():
    a, b = "10.0.0.1:1", "10.0.0.2:1"
    me = Plane(a, status="training")
    me.m.heard(b, 1, 0.0, status="training")
    me.m.start([a, b])
    hellos = []
    for i in range(0, 81):  # 40 s of heartbeats
        t = i * 0.5
        before = len(me.sent)
        tick(me.cp, t)
        hellos += [t for d, m in me.sent[before:] if d == b and m.kind == "hello"]
    # declared dead at 2.5 s; hellos after dead_after (2 s), backing off to 8 s apart
    assert hellos == [4.5, 6.5, 10.5, 18.5, 26.5, 34.5]
    me.receive("ping", b, status="training")  # it answered: no more hellos
    before = len(me.sent)
    for t in (40.5, 41.0, 41.5, 42.0, 42.5, 43.0):
        me.m.heard(b, 1, t)
        tick(me.cp, t)
    assert me.cp.probes == {} and [m.kind for d, m in me.sent[before:] if d == b] == ["ping"] * 6


def test_a_restart_seen_before_its_join_is_heard_of_does_not_cancel_the_join():
    """X restarts and says hello to a, which schedules X's old life out and its new
    one in. b sees X's new life (a ping) before a's news: b announces the old life's
    leave. That leave, reaching a after the join, must not cancel the join."""
    a, b, x = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
    pa, pb = Plane(a, status="training", rnd=50), Plane(b, status="training", rnd=50)
    for p, other in ((pa, b), (pb, a)):
        p.m.heard(other, 1, 0.0, status="training", round=50)
        p.m.heard(x, 1, 0.0, status="training", round=50)
        p.m.start([a, b, x])
    pa.receive("hello", x, inc=2, status="waiting")
    join = pa.m.joins[x]
    pb.receive("ping", x, inc=2, status="waiting")
    assert pb.m.leaves[x] == 55  # b: the old life leaves
    pa.receive("members", b, status="training", rnd=50, **_lists(pb))
    assert pa.m.joins[x] == join and pa.m.at_round(join) == [a, b, x]  # the join stands
    pb.receive("members", a, status="training", rnd=50, **_lists(pa))
    # and both agree who trains in every round: the old life until its leave (members may
    # have begun those rounds counting it), then nobody at x until the new life's join
    for r in (52, 54, 55, join - 1, join):
        assert pa.m.at_round(r) == pb.m.at_round(r) == ([a, b] if 55 <= r < join else [a, b, x]), r
    assert pa.m.former[x] == pb.m.former[x] == {1: [-1, 55]}


def test_a_restart_joined_before_its_old_life_leaves_keeps_the_old_life_in_the_rounds_before():
    """X's old life is found dead and leaves at round 55; X restarts, and a schedules
    its new life while b is in round 52 and c still in round 53 of an epoch both began
    counting X. The join must not take X out of rounds that began with it: every member
    keeps the old life to round 55, whichever of the leave and the join it heard first."""
    a, b, c, x = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.4:1", "10.0.0.3:1"
    planes = [Plane(n, status="training", rnd=50) for n in (a, b, c)]
    for p in planes:
        for other in (a, b, c, x):
            if other != p.cp.id:
                p.m.heard(other, 1, 0.0, status="training", round=50)
        p.m.start([a, b, c, x])
    pa, pb, pc = planes
    for p in (pa, pb):  # a and b found the old life dead; c only hears of it after the join
        p.m.remove(x, "silent")
    assert pa.m.leaves[x] == pb.m.leaves[x] == 55 and x not in pc.m.leaves
    pa.receive("hello", x, inc=2, status="waiting")
    join = pa.m.joins[x]
    assert x not in pa.m.leaves and pa.m.former[x] == {1: [-1, 55]}
    for p in (pb, pc):
        p.receive("members", a, status="training", rnd=50, **_lists(pa))
        assert p.m.joins[x] == join and p.m.former[x] == {1: [-1, 55]}, p.cp.id
    for r in (52, 54, 55, join):
        assert pa.m.at_round(r) == pb.m.at_round(r) == pc.m.at_round(r) \
            == sorted([a, b, c] if 55 <= r < join else [a, b, c, x]), r


def test_a_joiner_declared_dead_before_its_join_round_leaves_after_it():
    a, x = "10.0.0.1:1", "10.0.0.3:1"
    me = Plane(a, status="training", rnd=50)
    me.m.start([a])
    me.m.heard(x, 1, 0.0, status="waiting")
    me.m.announce_join(x, 70)
    me.m.remove(x, "silent")
    assert me.m.leaves[x] == 71 and me.m.at_round(70) == [a, x] and me.m.at_round(71) == [a]


def test_a_node_joining_another_cluster_neither_joins_nor_reaches_its_old_partner():
    """After a partition, west node w2 starts a new life to join the east cluster while
    its partner w1 still trains on in the west. w2's lists (it waits, with east's
    bookkeeping and its join round there) describe a cluster w1 is not in: w1 must not
    take w2's join from them. Otherwise w1 counts w2 as its own member, w2 no longer
    sees w1 as another cluster once it trains in the east, takes w1's leaves for the
    east nodes w1 dropped during the cut, and hands them to those nodes: a live east
    node judged itself dropped and left (found by the partition test in a full run)."""
    e1, e2, e3, w1, w2 = (f"10.0.0.{i}:1" for i in range(1, 6))
    everyone = [e1, e2, e3, w1, w2]
    east = _split(e1, everyone, [w1, w2], 1200)
    west = _split(w1, everyone, [e1, e2, e3], 350)
    west.m.heard(w2, 1, 0.0, status="training", round=350)
    joiner = _split(w2, everyone, [e1, e2, e3], 350)  # w2's old life dropped the east nodes too
    joiner.status = "waiting"  # w2 met the east cluster: a new life joins it
    joiner.cp.incarnation = 2
    joiner.m.new_life(2, target={e1, e2, e3})
    joiner.receive("members", e1, status="training", rnd=1200, **_lists(east))
    east.receive("hello", w2, inc=2, status="waiting", **_lists(joiner))
    joiner.receive("members", e1, status="training", rnd=1200, **_lists(east))
    join = joiner.m.joins[w2]
    assert joiner.m.eventual() == {e1, e2, e3, w2} and east.m.eventual() == {e1, e2, e3, w2}

    # w2's new life is seen in the west: its old life leaves, and that is all
    west.receive("ping", w2, inc=2, status="waiting", **_lists(joiner))
    west.receive("members", w2, inc=2, status="waiting", **_lists(joiner))
    west.receive("hello", w2, inc=2, status="waiting", **_lists(joiner))  # (a probe, say): not a join here
    assert w2 not in west.m.joins and west.m.eventual() == {w1}

    # w2 trains in the east from its join round; w1's lists are another cluster's
    joiner.status, joiner.round = "training", join
    joiner.m.training = True
    joiner.m.target.clear()
    joiner.receive("members", w1, status="training", rnd=2600, **_lists(west))
    assert joiner.m.eventual() == {e1, e2, e3, w2}, joiner.m.leaves
    assert joiner.merges == [] and joiner.excluded == []


def test_a_new_life_decides_that_its_cluster_finished_only_from_what_it_heard_since():
    """The verdict "every member of the cluster it joins has finished" (then it trains
    alone instead of waiting for a join round) needs each member's own word "done", or
    its goodbye, heard after the new life began. Before, leftovers read as that
    verdict: a paused node came back while the others trained and trained alone."""
    a, b, c, d, e = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1", "10.0.0.5:1"
    me = Plane(b, status="training", rnd=800)
    for other in (a, c, d):
        me.m.heard(other, 1, 1.0, status="training", round=800)
    me.m.heard(e, 1, 1.0, status="done", round=900)  # of an earlier cluster: finished long ago
    me.m.start([a, b, c, d])
    me.m.remove(d, "said goodbye", departed=True, now=2.0)  # an earlier goodbye
    tick(me.cp, 2.0)
    me.m.members[c].status = "done"  # a leftover status, told before this life
    me.m.members[c].status_at = 2.5
    me.status = "waiting"
    me.m.new_life(2, target={a, c, d}, now=10.0)
    assert not me.m.finished({a, c, d})  # a trains; c's "done" and d's goodbye are from before
    assert not me.m.finished({c, d}) and not me.m.finished({e})  # leftovers only
    assert not me.m.finished(set()) and not me.m.finished({b})  # an empty set is no evidence
    me.m.remove(a, "silent for more than 2 s")  # a silent member is not a finished one
    assert not me.m.finished({a})
    # what this life hears counts
    me.receive("ping", c, status="training", rnd=810)
    me.cp.now = 11.0
    me.receive("ping", c, status="done", rnd=820)
    assert not me.m.finished({c, d})  # d's goodbye is still from before this life
    me.cp.now = 12.0
    me.receive("ping", d, inc=1, status="training", rnd=820)  # departed: that life's last words are dropped
    me.receive("bye", e, status="done", rnd=900)
    assert me.m.finished({c, e})
    assert not me.m.finished({a, c, e})


def test_a_restarted_starter_s_join_heard_before_its_old_life_s_leave_stands():
    """Under churn: x, a starter, restarts; b hears of the new life's join (a's list)
    before it hears of the old life's leave (c's list). Before, b ignored the join (a
    starter needs none), then took the leave, and dropped x for good while a and c
    trained with it: every round between them timed out."""
    a, b, c, x = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"
    planes = {n: Plane(n, status="training", rnd=100) for n in (a, b, c)}
    for n, p in planes.items():
        for other in (a, b, c, x):
            if other != n:
                p.m.heard(other, 1, 0.0, status="training", round=100)
        p.m.start([a, b, c, x])
    pa, pb, pc = planes[a], planes[b], planes[c]
    pc.m.remove(x, "silent for more than 2 s")  # c declares the old life dead: leave at 105
    pa.m.remove(x, "silent for more than 2 s")
    pa.receive("hello", x, inc=2, status="waiting")  # the new life says hello to a: join at 120
    join = pa.m.joins[x]
    assert join > pa.m.leaves.get(x, 0) or x not in pa.m.leaves
    pb.receive("members", a, status="training", rnd=100, **_lists(pa))  # b: the join first
    pb.receive("members", c, status="training", rnd=100, **_lists(pc))  # then the old life's leave
    pc.receive("members", a, status="training", rnd=100, **_lists(pa))
    for r in (101, 110, join - 1, join, join + 50):
        assert pa.m.at_round(r) == pb.m.at_round(r) == pc.m.at_round(r), r
    assert x in pb.m.at_round(join) and pb.m.eventual() == {a, b, c, x}
    assert pa.m.schedule_digest() == pb.m.schedule_digest() == pc.m.schedule_digest()


def test_what_the_lists_said_of_a_previous_life_is_not_judged_in_the_new_one():
    """Between the verdict "dropped" and the new life, lists still carry the old life's
    leave. Before, that evidence was judged 1.5 x dead_after later, when the new life
    already trained: it started a second new life for nothing (a paused-node test
    ended with rejoins 2)."""
    a, b = "10.0.0.1:1", "10.0.0.2:1"
    me = Plane(b, status="training", rnd=40)
    me.m.heard(a, 1, 0.0, status="training", round=60)
    me.m.start([a, b])
    lists = dict(mids=[a], mincs=[1], base=[a, b], lids=[b], lrounds=[45])
    me.receive("members", a, status="training", rnd=60, **lists)
    _keep_alive(me, [a], 0.0, 3.0)
    assert me.excluded == [(45, a)]
    me.cp.now = 3.2
    me.receive("members", a, status="training", rnd=62, **lists)  # before the training thread acts on it
    assert me.cp.excluded_by  # gathered while this life still trains
    me.status = "waiting"
    me.cp.new_life(2)
    me.m.new_life(2, target={a}, now=3.3)
    me.receive("members", a, status="training", rnd=62, mids=[a, b], mincs=[1, 2], base=[a], jids=[b],
               jrounds=[82], jincs=[2])
    assert me.m.joins == {b: 82}
    me.status, me.m.training = "training", True  # joined again
    _keep_alive(me, [a], 3.5, 8.0)
    assert me.excluded == [(45, a)]  # not judged again


def test_a_cluster_whose_starters_all_restarted_still_schedules_joins():
    """Under churn every starter restarts in time and leaves the starting set. Before,
    an empty starting set read as "not started": members sent no schedule and
    scheduled no join, and every node restarted after that waited forever (the
    cluster wedged after ~25 restarts of 5 nodes)."""
    a, b, c = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
    pa = Plane(a, status="training", rnd=100)
    pa.m.heard(b, 1, 0.0, status="training", round=100)
    pa.m.start([a, b])
    pa.receive("hello", b, inc=2, status="waiting")  # b restarted: a new life joins
    assert b not in pa.m.base and b in pa.m.joins
    pa.m.base.discard(a)  # a restarted too (its new life learned the schedule without itself as a starter)
    pa.m.joins[a] = 50
    assert pa.m.base == set()
    pa.receive("hello", c, inc=1, status="waiting")  # a newcomer
    join = pa.m.joins.get(c)
    assert join is not None and join >= 100 + pa.m.timing.join_margin
    reply = [m for d, m in pa.sent if d == c and m.kind == "members" and not m.extra.get("delta")][-1]
    assert reply.extra["base"] == [] and c in reply.extra["jids"]  # the schedule travels
    pc = Plane(c)
    pc.receive("members", a, status="training", rnd=100, **_lists(pa))
    assert pc.m.started and pc.m.joins[c] == join and pc.m.at_round(join) == [a, b, c]


def test_silence_from_a_new_life_read_of_in_a_list_is_no_leave_for_its_join():
    """After a partition heals, the larger side reads of a node's new life in a list,
    does not hear it for dead_after, and declares it dead; then the new life says hello
    and is scheduled a join. That verdict must not become a leave of the new life
    (which trained nowhere yet): the joiner read its own leave and started a second
    new life (found by the partition test)."""
    a, b, x = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
    pa = Plane(a, status="training", rnd=4400)
    pa.m.heard(b, 1, 0.0, status="training", round=4400)
    pa.m.heard(x, 1, 0.0, status="training", round=100)
    pa.m.start([a, b, x])
    pa.m.remove(x, "silent")  # the partition: x's old life leaves
    pa.receive("members", b, status="training", rnd=4400, mids=[a, b, x], mincs=[1, 1, 2])  # x's new life, read of
    assert pa.m.members[x].incarnation == 2
    _keep_alive(pa, [b], 1.0, 3.5)  # x's new life is silent here for more than dead_after
    assert x not in pa.m.members
    pa.cp.now = 4.0
    pa.receive("hello", x, inc=2, status="waiting")  # it says hello: a join
    join = pa.m.joins[x]
    assert x not in pa.m.leaves and pa.m.at_round(join) == [a, b, x]


def test_the_heartbeat_detector_probes_everyone_each_heartbeat_and_declares_the_silent_dead():
    from gossip.protocol.detector import HeartbeatDetector

    a, b, c = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
    m = Membership(a, 1, FP, timing=Timing(dead_after=2.0))
    m.heard(b, 1, 0.0)
    m.heard(c, 1, 0.0)
    d = HeartbeatDetector(m, m.timing, lambda kind, fields: Message(kind, a, 0, 0, 0, None, None, fields, FP))

    def probes(out):
        return [(dst, msg.kind) for dst, msg in out.sends]
    first = d.tick(0.5)
    assert probes(first) == [(b, "ping"), (c, "ping")] and first.dead == [] and not first.stalled
    assert probes(d.tick(0.6)) == []  # not due again before the next heartbeat
    t = 1.0
    while t <= 2.5:
        d.heard(b, t)
        out = d.tick(t)
        t += 0.5
    assert out.dead == [c] and probes(out) == [(b, "ping")]
    stalled = d.tick(30.0)  # 27.5 s without a tick: this node did not run
    assert stalled.stalled > 20 and b not in stalled.dead


def test_the_control_plane_acts_on_its_detector_s_verdicts():
    """The interface a SWIM detector plugs into: its dead become announced leaves, its
    probes are sent as messages of their kind carrying the member digest."""
    from gossip.protocol.effects import Verdicts

    class Scripted:
        def __init__(self):
            self.heard_from: list[tuple[str, float]] = []
            self.next = Verdicts()

        def heard(self, member, now):
            self.heard_from.append((member, now))

        def tick(self, now):
            out, self.next = self.next, Verdicts()
            return out

    a, b, c = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
    p = Plane(a, status="training", rnd=10)
    det = Scripted()
    p.cp.detector = det
    for x in (b, c):
        p.m.heard(x, 1, 0.0, status="training", round=10)
    p.m.start([a, b, c])
    p.cp.now = 1.0
    from gossip.transport import wire

    frames = wire.encode(Message("state", b, 10, 10, 1, None, None, {}, FP))
    p.cp.on_frames(b.encode(), [bytes(memoryview(f)) for f in frames])
    assert det.heard_from == [(b, 1.0)]  # a state message counts as word from b
    det.next = Verdicts(sends=[(b, p.cp._frame("ping", {}))], dead=[c])
    assert tick(p.cp, 1.5) == [c]
    assert c not in p.m.members and p.m.leaves.get(c, 0) > 10  # a leave round, announced
    kinds = [(dst, msg.kind) for dst, msg in p.sent]
    assert (b, "ping") in kinds and (b, "members") in kinds and all(dst != c for dst, _ in kinds)
    ping = next(msg for dst, msg in p.sent if msg.kind == "ping")
    assert ping.extra["digest"] == p.m.digest()


def test_a_leave_is_announced_past_this_node_s_own_round_when_no_other_trainer_is_heard():
    """A node that has just joined, at round 317, hears no trainer yet but a fellow
    joiner still waiting (round 0). Its verdict on a silent member was a leave at
    round 0 + the margin, 5, a round its cluster had long passed (the member read it
    as its own eviction and joined again as a new life). The leave round counts this
    node's own round too."""
    from gossip.protocol.effects import Verdicts

    class Scripted:
        def __init__(self):
            self.next = Verdicts()

        def heard(self, member, now):
            pass

        def tick(self, now):
            out, self.next = self.next, Verdicts()
            return out

    a, b, c, j = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"
    p = Plane(a, status="training", rnd=317)
    p.cp.detector = det = Scripted()
    p.m.heard(c, 1, 0.0)  # a member it heard, round unknown
    p.m.heard(j, 1, 0.0, status="waiting")
    p.m.start([b, c])
    p.m.announce_join(a, 317, 1)
    p.m.announce_join(j, 327, 1)
    det.next = Verdicts(dead=[c])
    assert tick(p.cp, 1.0) == [c]
    assert p.m.leaves[c] == 317 + p.m.timing.leave_margin


def test_a_joiners_jump_to_its_donors_round_is_not_taken_for_its_pace():
    """A joiner waits at round 0, then trains from its donor's round 4,045 at 40 rounds a
    second: its pace is 40, so a join it schedules two seconds later is a few heartbeats of
    rounds ahead. The jump once counted as 4,045 rounds in a second, and such a node put
    the joins and leaves it announced thousands of rounds ahead: a real cluster under
    churn then timed out round after round for minutes."""
    a = Plane("10.0.0.1:1", status="waiting", rnd=0)
    t = 0.0
    while t <= 2.0:
        tick(a.cp, t)
        t += 0.25
    a.status, a.round = "training", 4045
    while t <= 5.0:
        tick(a.cp, t)
        t += 0.25
        a.round += 10  # 40 rounds a second
    assert 30.0 <= a.m.rate <= 50.0, a.m.rate
    assert a.m.announce_margin(a.m.timing.join_margin) < 100


def test_a_start_drops_the_join_and_leave_entries_heard_before_it():
    """(explorer seed 7500022611, --churn) A waiting node takes a running cluster's join
    entries from its lists; the cluster it then starts, or learns the start of, counts
    rounds from 0 afresh. A start kept them: the four members of a new cluster each
    counted, from round 15, a node that an old cluster had scheduled to join at its
    round 15 and that had crashed for good, and waited for it."""
    a, b, c = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
    p = Plane(a)
    # a delta of an old cluster: c joins at its round 15, b's life 1 leaves at its round 9
    p.receive("members", b, status="training", rnd=12, mids=[a, b, c], mincs=[1, 1, 1], delta=True,
              jids=[c], jrounds=[15], jincs=[1], lids=[b], lrounds=[9], lincs=[1])
    assert p.m.joins == {c: 15} and not p.m.started
    # b (a new life of its own now) starts a cluster with a; its list names no join
    p.receive("members", b, inc=2, status="training", rnd=0, mids=[a, b], mincs=[1, 2], base=[a, b], bincs=[1, 2])
    assert p.m.started and p.m.base == {a, b}
    assert p.m.joins == {} and p.m.leaves == {} and p.m.at_round(15) == [a, b]
    # a fresh start of its own drops them too
    q = Plane(a)
    q.receive("members", b, status="training", rnd=12, mids=[a, b, c], mincs=[1, 1, 1], delta=True,
              jids=[c], jrounds=[15], jincs=[1])
    q.m.start([a, b])
    assert q.m.joins == {} and q.m.at_round(15) == [a, b]


def test_a_differing_digest_gets_the_whole_table_only_once_the_difference_outlasts_the_news():
    """Anti-entropy in a running cluster: while news spreads, members differ for a few
    probe periods and the deltas settle it. Only a difference that lasts
    :meth:`Timing.reconcile_after` gets the whole table: the same digest reported for
    that long (by anyone), or one member's every report differing for that long (under
    churn its digest is another at each change). Before, every message with another
    digest got one: 176 KB each at 4,096 members, for every probe during a crash."""
    a, b, c = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
    p = Plane(a, status="training", rnd=100)
    for x in (b, c):
        p.m.heard(x, 1, 0.0, status="training", round=100)
    p.m.start([a, b, c])
    wait, hb = p.m.timing.reconcile_after(3), p.m.timing.heartbeat
    assert wait == 4 * hb

    def tables_at(t: float, sender: str, digest: str) -> list[str]:
        p.sent.clear()
        p.cp.now = t
        p.receive("ping", sender, status="training", rnd=100, digest=digest)
        return [d for d, m in p.sent if m.kind == "members" and not m.extra.get("delta")]

    def other(k: int) -> str:  # a member set a does not see
        return f"{k:016x}|" + p.m.schedule_digest()

    assert tables_at(10.0, b, other(1)) == []  # news that may still be spreading
    assert tables_at(10.0 + wait - 0.01, b, other(1)) == []
    assert tables_at(10.0 + wait, b, other(1)) == [b]  # it lasted: b missed something
    # each clock restarts with the table: c shows the same digest a probe period later
    assert tables_at(10.0 + wait + hb, c, other(1)) == []
    # (and once it has lasted again, c gets one too)
    assert tables_at(10.0 + 2 * wait, c, other(1)) == [c]
    # a member whose digest is another at every report (churn) but never a's own
    t = 30.0
    assert tables_at(t - 1, b, p.m.digest()) == []  # (b agreed with a in between)
    assert tables_at(t, b, other(2)) == [] and tables_at(t + wait / 2, b, other(3)) == []
    assert tables_at(t + wait, b, other(4)) == [b]
    # a report that matches restarts that member's clock
    t = 50.0
    assert tables_at(t - 1, c, p.m.digest()) == []
    assert tables_at(t, c, other(5)) == [] and tables_at(t + wait / 2, c, p.m.digest()) == []
    assert tables_at(t + wait, c, other(6)) == []
    # before the start, whole tables are how a forming cluster agrees: at once
    q = Plane("10.0.0.4:1")
    q.m.heard(b, 1, 0.0)
    q.cp.now = 5.0
    q.receive("ping", b, digest=other(7))
    assert [d for d, m in q.sent if m.kind == "members" and not m.extra.get("delta")] == [b]


# -- first contacts: a sender's word counts once it proved its address -----------------------
def _pump(planes: dict[str, Plane], rounds: int = 10) -> list[Message]:
    """Deliver what the planes sent to each other (through the wire format) until they go
    quiet; returns every message delivered."""
    from gossip.transport import wire

    delivered = []
    for _ in range(rounds):
        batch = [(p, dst, msg) for p in planes.values() for dst, msg in p.sent]
        for p in planes.values():
            p.sent.clear()
        if not batch:
            break
        for _p, dst, msg in batch:
            if dst in planes:
                delivered.append(msg)
                planes[dst].cp.on_frames(msg.sender.encode(), [bytes(memoryview(f)) for f in wire.encode(msg)])
    return delivered


def test_a_stranger_that_does_not_prove_its_address_changes_nothing_and_is_sent_a_token():
    """A hello and a member list from a sender that is neither a member nor proved its address
    (a stranger without keys) name 50 made-up members, a start and joins: none of it counts.
    The sender gets a light hello with this node's token, once a heartbeat at most; a message
    that sends the token back counts, and since the refused message was a hello, the member
    list that answers the token counts as that hello (a joiner is scheduled at once)."""
    a = Plane("10.0.0.1:1", status="training", rnd=100)
    a.m.start(["10.0.0.1:1"])
    stranger, fakes = "10.0.0.9:1", [f"10.9.0.{i}:1" for i in range(50)]
    lists = dict(mids=[stranger, *fakes], mincs=[1] * 51, base=[stranger, *fakes[:10]], jids=fakes[10:],
                 jrounds=[101] * 40)
    a.receive("hello", stranger, proven=False, **lists)
    a.receive("members", stranger, proven=False, status="training", **lists)
    assert set(a.m.members) == {"10.0.0.1:1"} and not a.m.joins and a.cp.contacts.unproven == 2
    assert [(d, m.kind) for d, m in a.sent] == [(stranger, "hello")]  # one token a heartbeat
    token = a.sent[0][1].extra["tok"]
    assert token == a.cp.token(stranger) and a.sent[0][1].extra["mids"] == ["10.0.0.1:1"]  # (light)
    a.sent.clear()
    a.receive("members", stranger, proven=False, echo="0" * 16, mids=[stranger], mincs=[1])  # a wrong token
    assert set(a.m.members) == {"10.0.0.1:1"}
    # it receives at its address: the token comes back, and its list stands for its hello
    a.receive("members", stranger, proven=False, echo=token, mids=[stranger], mincs=[1])
    assert stranger in a.m.members and a.m.joins.get(stranger, 0) > 100
    assert stranger in a.cp.contacts.proven


def test_a_flood_of_made_up_senders_costs_a_bounded_number_of_tokens():
    """2,000 made-up senders at once, then more a second later: tokens go to at most twice
    CHALLENGE_RATE of them at once and CHALLENGE_RATE a second after, the member table
    never changes, and the senders never answered are forgotten (their connections closed)
    after dead_after."""
    from gossip.protocol.contacts import CHALLENGE_RATE

    a = Plane("10.0.0.1:1")
    for i in range(2000):
        a.receive("hello", f"10.8.{i // 250}.{i % 250}:1", proven=False, mids=[f"10.7.0.{i % 250}:1"], mincs=[1])
    assert len(a.sent) == 2 * CHALLENGE_RATE and set(a.m.members) == {"10.0.0.1:1"}
    a.cp.now = 1.0
    for i in range(2000):
        a.receive("ping", f"10.6.{i // 250}.{i % 250}:1", proven=False)
    assert len(a.sent) == 3 * CHALLENGE_RATE and a.cp.contacts.unproven == 4000
    tick(a.cp, 1.0 + a.m.timing.dead_after + 0.1)
    assert a.cp.contacts.challenged == {} and len(a.reconnected) == 3 * CHALLENGE_RATE


def test_two_nodes_prove_their_addresses_in_one_round_trip_and_then_send_no_tokens():
    """Two nodes seeded with each other: the first hellos are refused and answered with
    tokens, the answers count, and both end with both as members; after that no message
    carries a token. A restarted process (a new key, a new life) is a member's id: its
    first hello counts at once, with no round trip."""
    a = Plane("10.0.0.1:1", seeds=("10.0.0.2:1",))
    b = Plane("10.0.0.2:1", seeds=("10.0.0.1:1",))
    planes = {"10.0.0.1:1": a, "10.0.0.2:1": b}
    a.cp.apply(a.cp.hello_all(["10.0.0.2:1"]))
    b.cp.apply(b.cp.hello_all(["10.0.0.1:1"]))
    _pump(planes)
    assert set(a.m.members) == set(b.m.members) == set(planes)
    assert a.cp.contacts.unproven + b.cp.contacts.unproven >= 1  # (the first hello of one side at least)
    a.cp.apply(a.cp.announce_status())
    b.cp.apply(b.cp.tell_status(["10.0.0.1:1"]))
    later = _pump(planes)
    assert later and all("tok" not in m.extra and "echo" not in m.extra for m in later)
    # b restarts: a fresh process, whose key and tokens are new
    b2 = Plane("10.0.0.2:1", inc=2)
    planes["10.0.0.2:1"] = b2
    before = a.cp.contacts.unproven
    b2.cp.apply(b2.cp.hello_all(["10.0.0.1:1"]))  # (b2 knows nobody: a sends its token back)
    _pump(planes)
    assert a.cp.contacts.unproven == before and "10.0.0.1:1" in b2.m.members
