"""The SWIM failure detector (gossip/protocol/swim.py) on a tiny virtual network and clock.

Every scenario is deterministic: one seed draws the nodes' rngs, latencies and
losses, and the clock is virtual, so each runs in well under a second and a
failure replays exactly.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from typing import Callable

import pytest

from gossip.protocol.swim import (
    ALIVE,
    DEAD,
    LEFT,
    SUSPECT,
    MemberEvent,
    Swim,
    SwimMessage,
    SwimOptions,
    from_message,
    to_message,
)
from gossip.transport import wire
from tests.helpers import tick

TICK = 0.1  # the control plane's tick


class Net:
    """n SWIM nodes on one event queue: a tick per node every TICK s (own phase),
    messages after ``latency(u, v)`` s, lost with probability ``loss`` or when a
    partition or a cut link separates them. Crashed nodes neither tick nor receive."""

    def __init__(self, n: int, seed: int = 0, *, loss: float = 0.0, options: SwimOptions | None = None,
                 latency: Callable[[int, int], float] = lambda u, v: 0.002) -> None:
        self.ids = [f"10.0.0.{i}:5555" for i in range(n)]
        self.index = {m: i for i, m in enumerate(self.ids)}
        self.nodes = [Swim(self.ids[i], 1, random.Random(seed * 7919 + i), options,
                           members=[(m, 1) for m in self.ids if m != self.ids[i]]) for i in range(n)]
        self.rng = random.Random(seed)
        self.loss = loss
        self.latency = latency
        self.now = 0.0
        self.queue: list = []
        self.order = 0
        self.crashed: set[int] = set()
        self.paused: set[int] = set()
        self.group: dict[int, int] = {}
        self.cut: Callable[[int, int], bool] = lambda u, v: False
        self.trace: list[tuple[float, str, str, str, int]] = []  # (t, node, member, state, incarnation)
        self.events: list[tuple[int, MemberEvent]] = []
        self.sent = Counter()
        for i in range(n):
            self._push(self.rng.uniform(0, TICK), ("tick", i, None))

    def _push(self, t: float, item: tuple) -> None:
        heapq.heappush(self.queue, (t, self.order, item))
        self.order += 1

    def partition(self, *groups: list[int]) -> None:
        self.group = {i: g for g, members in enumerate(groups) for i in members}

    def heal(self) -> None:
        self.group = {}

    def send(self, out: list[SwimMessage], u: int) -> None:
        for m in out:
            self.sent[u] += 1
            v = self.index[m.to]
            if self.group and self.group.get(u) != self.group.get(v):
                continue
            if self.cut(u, v) or (self.loss and self.rng.random() < self.loss):
                continue
            self._push(self.now + self.latency(u, v), ("msg", v, m))

    def run(self, until: float) -> None:
        while self.queue and self.queue[0][0] <= until:
            self.now, _, (kind, i, m) = heapq.heappop(self.queue)
            if kind == "tick":
                self._push(self.now + TICK, ("tick", i, None))
            if i in self.crashed or i in self.paused:
                continue
            node = self.nodes[i]
            out = node.tick(self.now) if kind == "tick" else node.receive(m, self.now)
            self.send(out, i)
            for ev in node.take_events():
                self.events.append((i, ev))
                self.trace.append((round(self.now, 9), node.id, ev.member, ev.state, ev.incarnation))
        self.now = until

    def live(self) -> list[int]:
        return [i for i in range(len(self.nodes)) if i not in self.crashed]

    def learned(self, member: int, state: str) -> dict[int, float]:
        """When each node first recorded ``member`` in ``state``."""
        out: dict[int, float] = {}
        for i, ev in self.events:
            if ev.member == self.ids[member] and ev.state == state:
                out.setdefault(i, ev.at)
        return out


def test_crash_is_dead_everywhere_within_the_bound():
    # defaults at n = 48: suspicion 0.5 * log10(48) = 0.84 s; a crash is found by the
    # first probe of it (about one a period), suspected at the end of that period,
    # dead after the suspicion timeout, and spread in a few gossip ticks
    for seed in range(3):
        net = Net(48, seed)
        net.run(3.0)
        victim = 5 + seed
        net.crashed.add(victim)
        net.run(9.0)
        dead = net.learned(victim, DEAD)
        assert sorted(dead) == net.live(), seed
        assert max(dead.values()) - 3.0 <= 5.0, (seed, max(dead.values()))
        assert all(net.nodes[i].state(net.ids[victim]) == (DEAD, 1) for i in net.live())
        # nobody else died, and nobody was even suspected before the crash
        assert {ev.member for _, ev in net.events if ev.state == DEAD} == {net.ids[victim]}
        assert all(ev.at >= 3.0 for _, ev in net.events)


def test_slow_member_answering_indirect_probes_is_not_declared_dead():
    # member 0's links to members 1..7 take 0.4 s each way: their direct acks miss the
    # period, but the indirect probes through the other members come back in time
    slow = set(range(1, 8))

    def latency(u: int, v: int) -> float:
        return 0.4 if {u, v} & {0} and {u, v} & slow else 0.002

    def run(options: SwimOptions | None) -> Net:
        net = Net(24, 3, options=options, latency=latency)
        net.run(30.0)
        return net

    net = run(None)
    assert not net.learned(0, DEAD)
    assert all(net.nodes[i].state(net.ids[0])[0] == ALIVE for i in range(1, 24))
    relayed = sum(x.sent["ping-req"] for x in net.nodes)
    assert relayed > 0
    # each suspicion costs member 0 a refutation. Without indirect probes it is suspected
    # at nearly every probe from the slow side; with them, only when all 3 relays are slow
    bare = run(SwimOptions(indirect=0))
    refuted, refuted_bare = net.nodes[0].incarnation - 1, bare.nodes[0].incarnation - 1
    assert refuted <= 2 and refuted_bare >= 8, (refuted, refuted_bare)
    assert not bare.learned(0, DEAD)


def test_falsely_suspected_member_refutes_with_a_higher_incarnation():
    # member 4 hears nothing for 1 s (its inbound link drops all): probes of it fail, it
    # is suspected; then it hears the suspicion and refutes before the (here 1.8 s)
    # suspicion timeout
    net = Net(16, 1, options=SwimOptions(suspicion_mult=3.0))
    net.run(2.0)
    net.cut = lambda u, v: v == 4 and 2.0 <= net.now < 3.0
    net.run(10.0)
    suspected = net.learned(4, SUSPECT)
    assert len(suspected) >= 8
    assert not net.learned(4, DEAD)
    assert net.nodes[4].incarnation >= 2
    for i in range(16):
        if i != 4:
            state, inc = net.nodes[i].state(net.ids[4])
            assert state == ALIVE and inc == net.nodes[4].incarnation
    # each node that suspected it saw the refutation: alive again, at the new incarnation
    back = [(i, ev) for i, ev in net.events if ev.member == net.ids[4] and ev.state == ALIVE]
    assert {i for i, _ in back} == set(suspected)
    assert all(ev.previous == SUSPECT and ev.incarnation >= 2 for _, ev in back)


def test_partition_suspects_then_kills_the_other_half_and_the_heal_revives_it():
    n = 16
    left, right = list(range(8)), list(range(8, 16))
    net = Net(n, 2)
    net.run(2.0)
    net.partition(left, right)
    net.run(10.0)
    for side, other in ((left, right), (right, left)):
        for i in side:
            node = net.nodes[i]
            assert all(node.state(net.ids[j]) == (DEAD, 1) for j in other), i
            assert all(node.state(net.ids[j])[0] == ALIVE for j in side if j != i), i
            # suspected before dead
            for j in other:
                kinds = [ev.state for k, ev in net.events if k == i and ev.member == net.ids[j]]
                assert kinds == [SUSPECT, DEAD], (i, j, kinds)
    net.heal()
    net.run(40.0)
    for i in range(n):
        node = net.nodes[i]
        assert node.incarnation >= 2  # each refuted its death
        for j in range(n):
            if j != i:
                state, inc = node.state(net.ids[j])
                assert state == ALIVE and inc == net.nodes[j].incarnation, (i, j, state, inc)


@pytest.mark.parametrize("loss", [0.1, 0.2])
def test_message_loss_causes_no_false_deaths_at_the_defaults(loss):
    net = Net(32, 4, loss=loss)
    net.run(40.0)
    states = Counter(ev.state for _, ev in net.events)
    assert states[DEAD] == 0, states
    assert states[SUSPECT] > 0  # the loss did make probes fail: the suspicions were refuted
    for i in range(32):
        assert net.nodes[i].members() == sorted(m for m in net.ids if m != net.ids[i])


def test_messages_per_node_and_period_do_not_grow_with_n():
    rates = {}
    for n in (16, 128):
        net = Net(n, 5)
        net.run(20.0)
        periods = 20.0 / SwimOptions().period
        rates[n] = sum(net.sent.values()) / n / periods
    # one ping and, on average, one ack per node and period, whatever n
    assert abs(rates[16] - rates[128]) < 0.05, rates
    assert 1.9 < rates[128] < 2.1, rates


def test_same_seed_gives_the_same_trace():
    def trace(seed: int) -> list:
        net = Net(20, seed, loss=0.1)
        net.run(2.0)
        net.crashed.add(3)
        net.run(8.0)
        return net.trace

    a, b, c = trace(7), trace(7), trace(8)
    assert a == b and len(a) > 19
    assert a != c


def test_join_spreads_and_leave_is_not_death():
    net = Net(12, 6)
    net.run(2.0)
    # a newcomer, admitted by member 0 alone (it said hello there); it has the member
    # list from member 0's reply (the control plane's members message)
    new = "10.0.1.1:5555"
    net.ids.append(new)
    net.index[new] = 12
    net.nodes.append(Swim(new, 5, random.Random(99), members=[(m, 1) for m in net.ids[:12]]))
    net._push(net.now, ("tick", 12, None))
    net.nodes[0].join(new, 5, net.now)
    net.run(6.0)
    assert all(net.nodes[i].state(new) == (ALIVE, 5) for i in range(12))
    assert net.nodes[12].members() == sorted(net.ids[:12])
    joined = [ev for _, ev in net.events if ev.member == new]
    assert len(joined) == 12 and all(ev.previous is None for ev in joined)
    # member 2 leaves: everyone records it as left, nobody as dead
    net.send(net.nodes[2].leave(net.now), 2)
    net.run(7.0)
    net.crashed.add(2)  # and then it is gone
    net.run(15.0)
    assert all(net.nodes[i].state(net.ids[2]) == (LEFT, 1) for i in net.live())
    assert not net.learned(2, DEAD) and not net.learned(2, SUSPECT)


def test_precedence_of_updates():
    node = Swim("a", 1, random.Random(0), members=[("b", 3), ("c", 1)])

    def say(state: str, inc: int) -> tuple[str, int]:
        node.receive(SwimMessage("a", "c", {"op": "gossip", "inc": 1, "uid": ["b"], "ust": [state],
                                            "uinc": [inc]}), 1.0)
        return node.state("b")

    assert say(SUSPECT, 2) == (ALIVE, 3)   # older incarnation: ignored
    assert say(DEAD, 2) == (ALIVE, 3)
    assert say(ALIVE, 3) == (ALIVE, 3)
    assert say(SUSPECT, 3) == (SUSPECT, 3)
    assert say(ALIVE, 3) == (SUSPECT, 3)   # suspicion beats alive at the same incarnation
    assert say(ALIVE, 4) == (ALIVE, 4)     # a refutation
    assert say(DEAD, 4) == (DEAD, 4)
    assert say(ALIVE, 4) == (DEAD, 4)
    assert say(SUSPECT, 5) == (DEAD, 4)    # dead is not suspected
    assert say(ALIVE, 5) == (ALIVE, 5)     # a rejoin
    assert say(LEFT, 5) == (LEFT, 5)
    assert say(DEAD, 6) == (LEFT, 5)       # left is final for that life
    assert say(ALIVE, 6) == (ALIVE, 6)
    assert [(e.state, e.incarnation) for e in node.take_events()] == [
        (SUSPECT, 3), (ALIVE, 4), (DEAD, 4), (ALIVE, 5), (LEFT, 5), (ALIVE, 6)]
    assert node.rejected == Counter()


def test_updates_about_this_node_are_refuted():
    node = Swim("a", 4, random.Random(0), members=[("c", 1)])
    out = node.receive(SwimMessage("a", "c", {"op": "gossip", "inc": 1, "uid": ["a"], "ust": [SUSPECT],
                                              "uinc": [4]}), 1.0)
    assert node.incarnation == 5
    # the refutation goes straight back to whoever said it
    assert [m.to for m in out] == ["c"] and out[0].fields["uid"][0] == "a" and out[0].fields["ust"][0] == ALIVE
    node.receive(SwimMessage("a", "c", {"op": "gossip", "inc": 1, "uid": ["a"], "ust": [DEAD], "uinc": [3]}), 1.0)
    assert node.incarnation == 5  # about a life already refuted
    node.receive(SwimMessage("a", "c", {"op": "gossip", "inc": 1, "uid": ["a"], "ust": [DEAD], "uinc": [9]}), 1.0)
    assert node.incarnation == 10


def test_messages_travel_in_the_wire_header():
    net = Net(4, 0)
    net.run(1.0)
    node = net.nodes[0]
    node._apply(net.ids[2], SUSPECT, 1, 1.0)  # so that messages carry updates
    out = node.tick(1.6) + node.tick(1.7)
    assert out and any("uid" in m.fields for m in out)
    for m in out:
        msg = to_message(m, fingerprint="f" * 16)
        assert msg.kind == "swim" and msg.sender == m.sender
        assert "swim" in wire.KINDS
        back = from_message(wire.decode(wire.encode(msg)), m.to)
        assert back == m


def _snapshot(node: Swim) -> tuple:
    return (node.incarnation, {k: tuple(v) for k, v in node._table.items()}, dict(node._timers),
            {k: (u.state, u.inc) for k, u in node._queue.items()}, node.left, node._probe)


def test_hostile_and_malformed_messages_are_counted_and_change_nothing():
    rng = random.Random(11)
    me, peer, other = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
    node = Swim(me, 7, random.Random(1), members=[(peer, 3), (other, 2)])
    node.tick(0.0)
    good = {"op": "gossip", "inc": 3, "uid": [other], "ust": [DEAD], "uinc": [2]}
    bad_int = [None, True, False, -1, 2**63, 2**63, 1.5, math.nan, "1", [1], {}]
    invalid = {  # values that are wrong for that field whatever the others hold
        "op": [None, True, 1, "", "pong", "PING", ["ping"], b"ping"],
        "inc": bad_int, "seq": bad_int,
        "target": [None, 1, "", "x" * 257, ["a"], True, b"a"],
        "uid": ["a", 1, [1], [""], ["x" * 257], [], [other, other], [None]],
        "ust": ["dead", [None], ["DEAD"], ["zombie"], [1], [], [DEAD, DEAD]],
        "uinc": [5, [True], [-1], [2**63], [1.5], ["1"], [], [1, 1]],
    }
    bad_messages: list = [
        "not a message", SwimMessage(me, peer, "fields"), SwimMessage(me, peer, []),  # type: ignore[arg-type]
        SwimMessage(me, me, dict(good)), SwimMessage("elsewhere", peer, dict(good)),
        SwimMessage(me, "", dict(good)), SwimMessage(me, 5, dict(good)),  # type: ignore[arg-type]
        SwimMessage(me, "y" * 257, dict(good)),
        # the same member twice in one message, lists of equal length
        SwimMessage(me, peer, {"op": "gossip", "inc": 3, "uid": [other, other], "ust": [DEAD, ALIVE],
                               "uinc": [2, 3]}),
        SwimMessage(me, peer, {"op": "gossip", "inc": 3, "uid": [other], "ust": [DEAD]}),  # uinc missing
    ]
    for _ in range(3000):
        x = dict(good)
        x["op"] = rng.choice(["ping", "ping-req", "ack", "gossip"])
        required = ["op", "inc"] + (["seq"] if x["op"] != "gossip" else []) \
            + (["target"] if x["op"] in ("ping-req", "ack") else [])
        if x["op"] != "gossip":
            x["seq"] = 1
        if x["op"] in ("ping-req", "ack"):
            x["target"] = other
        key = rng.choice([*required, "uid", "ust", "uinc"])
        if key in required and rng.random() < 0.2:
            del x[key]
        else:
            x[key] = rng.choice(invalid[key])
        bad_messages.append(SwimMessage(me, peer, x))
    for _ in range(1000):  # and shapeless maps
        bad_messages.append(SwimMessage(me, peer, {k: rng.choice(invalid[k]) for k in
                                                   rng.sample(sorted(invalid), rng.randint(0, 4))}))
    before = _snapshot(node)
    for m in bad_messages:
        count = sum(node.rejected.values())
        out = node.receive(m, 1.0)
        assert sum(node.rejected.values()) == count + 1, m
        assert _snapshot(node) == before and out == [] and not node.take_events(), m
    assert {"op", "inc", "seq", "target", "updates", "self", "misdirected", "sender", "type",
            "fields"} <= set(node.rejected)
    assert not node.ignored
    # a well-formed message still works afterwards
    node.receive(SwimMessage(me, peer, dict(good)), 2.0)
    assert node.state(other) == (DEAD, 2)


def test_a_node_that_missed_a_refutation_is_corrected():
    # a holds b suspect; c heard b refute (b is alive at 2 there) long ago: nothing of it
    # is left in c's queue. a's messages name its suspects; c answers with what it knows
    a = Swim("a", 1, random.Random(0), members=[("b", 1), ("c", 1)])
    a.receive(SwimMessage("a", "c", {"op": "gossip", "inc": 1, "uid": ["b"], "ust": [SUSPECT], "uinc": [1]}), 0.0)
    assert a.state("b") == (SUSPECT, 1)
    c = Swim("c", 1, random.Random(1), members=[("a", 1), ("b", 2)])
    t = 0.0
    while "b" in a._queue:  # the news goes out, as often as the limit says
        t += 0.05
        a.tick(t)
    assert a.state("b") == (SUSPECT, 1) and t < 0.5  # (before its suspicion times out)
    # a message a sends now still names b as suspect
    to_c = a._send("c", "gossip")
    assert to_c.fields["uid"] == ["b"] and to_c.fields["ust"] == [SUSPECT]
    replies = c.receive(to_c, t + 0.001)
    assert [m.to for m in replies] == ["a"]
    a.receive(replies[0], t + 0.002)
    assert a.state("b") == (ALIVE, 2)
    # and the other way round: news older than the record is answered with the record
    out = c.receive(SwimMessage("c", "a", {"op": "gossip", "inc": 1, "uid": ["b"], "ust": [ALIVE], "uinc": [1]}), 1.0)
    assert [(m.to, m.fields["uid"][0], m.fields["ust"][0], m.fields["uinc"][0]) for m in out] == [("a", "b", ALIVE, 2)]


def test_strangers_are_answered_but_not_believed():
    node = Swim("a", 1, random.Random(0), members=[("b", 1)])
    out = node.receive(SwimMessage("a", "z", {"op": "ping", "inc": 1, "seq": 4, "uid": ["b"], "ust": [DEAD],
                                              "uinc": [1]}), 1.0)
    assert [(m.to, m.op, m.fields["seq"]) for m in out] == [("z", "ack", 4)] and "uid" not in out[0].fields
    assert node.state("b") == (ALIVE, 1) and node.state("z") is None
    assert node.ignored["not-member"] == 1 and not node.rejected
    node.receive(SwimMessage("a", "z", {"op": "ping-req", "inc": 1, "seq": 4, "target": "b"}), 1.0)
    assert node.ignored["not-member"] == 2 and not node._relays


def test_bad_options_name_the_option():
    for kwargs, name in [({"period": 0}, "period"), ({"period": math.inf}, "period"),
                         ({"probe_timeout": 0.5}, "probe_timeout"), ({"indirect": -1}, "indirect"),
                         ({"gossip_nodes": 0}, "gossip_nodes"), ({"retransmit_mult": 1.5}, "retransmit_mult"),
                         ({"max_piggyback": 0}, "max_piggyback"), ({"suspicion_mult": -1}, "suspicion_mult"),
                         ({"indirect": True}, "indirect")]:
        with pytest.raises(ValueError, match=name):
            SwimOptions(**kwargs)
    with pytest.raises(ValueError, match="node_id"):
        Swim("", 1, random.Random(0))
    with pytest.raises(ValueError, match="incarnation"):
        Swim("a", -1, random.Random(0))


def test_timeouts_scale_with_log_n():
    opt = SwimOptions()
    assert opt.suspicion_timeout(10) == opt.period
    assert opt.suspicion_timeout(1000) == pytest.approx(3 * opt.period)
    assert opt.retransmit_limit(9) == 4 and opt.retransmit_limit(99) == 8 and opt.retransmit_limit(1024) == 16


def test_a_node_that_stalled_does_not_blame_the_members():
    def probing(node: Swim) -> float:
        t = 0.0
        while not any(m.op == "ping" for m in node.tick(t)):
            t += TICK
        return t

    # a probe left unanswered fails at the end of its period...
    node = Swim("a", 1, random.Random(0), members=[("b", 1), ("c", 1)])
    t = probing(node)
    target = node._probe.target
    node.tick(t + 0.2)
    node.tick(t + 0.4)
    node.tick(t + 0.6)
    assert node.state(target) == (SUSPECT, 1)
    # ...but not when this node itself did not run meanwhile (its acks may be waiting unread)
    node = Swim("a", 1, random.Random(0), members=[("b", 1), ("c", 1)])
    t = probing(node)
    node.tick(t + 3.0)
    assert node.state(target) == (ALIVE, 1) and not node.take_events()
    # and a suspicion gets the stalled time back
    node.receive(SwimMessage("a", "c", {"op": "gossip", "inc": 1, "uid": ["b"], "ust": [SUSPECT], "uinc": [1]}),
                 t + 3.0)
    node.tick(t + 3.1)
    node.tick(t + 6.0)
    assert node.state("b") == (SUSPECT, 1)
    for k in range(1, 6):
        node.tick(t + 6.0 + k * TICK)
    assert node.state("b") == (DEAD, 1)


def test_membership_scale_benchmark_runs_and_ends_with_its_json_line(capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "membership_scale.py"
    spec = importlib.util.spec_from_file_location("membership_scale", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--sizes", "16,32", "--seeds", "1", "--crashes", "2", "--warmup", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert set(result["msgs_per_node_s"]) == set(result["detect_s"]) == {"16", "32"}
    for n in ("16", "32"):
        assert 0 < result["detect_s"][n] <= 5.0
        assert result["false_deaths"][n] == 0
        # all-to-all sends n - 1 pings per heartbeat; SWIM about 2 messages per period
        assert result["all_to_all"]["msgs_per_node_s"][n] == (int(n) - 1) / 0.5
        assert 3.5 < result["steady_msgs_per_node_s"][n] < 4.5
    assert result["crashes"] == 2


def test_fields_of_the_control_plane_ride_along_unread():
    node = Swim("a", 1, random.Random(0), members=[("b", 1)])
    out = node.receive(SwimMessage("a", "b", {"op": "ping", "inc": 1, "seq": 9, "status": "training",
                                              "digest": "x" * 40, "round": 12}), 1.0)
    assert [(m.to, m.op, m.fields["seq"]) for m in out] == [("b", "ack", 9)]
    assert not node.rejected and not node.ignored


def test_malformed_swim_frames_reaching_a_control_plane_are_counted_and_change_nothing():
    """Fuzz: swim frames with one field broken each (SWIM's, the control plane's, the
    header's), from a member and from strangers, reach a control plane running SWIM
    through ``on_frames``; each is counted once and changes neither the member table
    nor the detector. A well-formed one is taken (so the check can fail)."""
    import threading

    import msgpack

    from gossip.core.message import Message
    from gossip.protocol.control import ControlPlane
    from gossip.protocol.membership import Membership

    me, peer = "127.0.0.1:7000", "127.0.0.1:7001"
    m = Membership(me, 1000, "fp")
    sent: list = []
    cp = ControlPlane(me, 1000, "fp", "", m, threading.RLock(), lambda d, msg: sent.append((d, msg)),
                      lambda msg: None, lambda: ("waiting", 0, 0), timing=m.timing, detector="swim")

    def frames(sender: str, x: dict, **header) -> list:
        return wire.encode(Message("swim", sender, 0, 0, 0, None, header.get("w"), x, "fp"))

    good = {"op": "ping", "inc": 2000, "seq": 1, "life": 2000, "status": "waiting"}
    cp.on_frames(peer.encode(), frames(peer, {**good, "echo": cp.token(peer)}))  # (it proved its address)
    tick(cp, 1.0)
    assert set(m.members) == {me, peer} and cp.rejected == Counter() and sent, sent
    state = (dict((k, (v.incarnation, v.status)) for k, v in m.members.items()), cp.detector.state(peer))
    bad_values = {
        "op": ["pong", 3, None, ""], "inc": [-1, True, "1", 2**63, 1.5], "seq": [None, -5, "x", False],
        "life": [None, -1, "2000", True, 2**63], "status": ["sleeping", 1, None],
        "target": ["", 7, "x" * 300], "uid": [[""], [1], "a", ["x" * 300], [me, me]], "ust": [["zombie"], [1]],
        "uinc": [[-1], ["1"], [True]], "dc": ["x" * 100, 3], "seeding": ["yes", 1],
    }
    rng = random.Random(5)
    sent.clear()
    count = 0
    for _ in range(400):
        key = rng.choice(sorted(bad_values))
        # (a gossip has no seq, only a ping-req and an ack a target)
        ops = {"seq": ["ping", "ping-req", "ack"], "target": ["ping-req", "ack"]}.get(
            key, ["ping", "ping-req", "ack", "gossip"])
        x = dict(good, op=rng.choice(ops), target=peer, uid=[me], ust=["alive"], uinc=[1000])
        if key in ("uid", "ust", "uinc"):
            x[key] = rng.choice(bad_values[key])
        elif rng.random() < 0.5 or key in ("op", "life", "status", "dc", "seeding"):
            x[key] = rng.choice(bad_values[key])
        else:
            x.pop(key)
        if x.get(key, "") is None:
            x.pop(key)
        sender = rng.choice([peer, "127.0.0.1:7999"])
        before = sum(cp.rejected.values()) + cp.contacts.unproven
        cp.on_frames(sender.encode(), frames(sender, x))
        count += 1
        # (a stranger's fields past the wire format's are not read: its message counts as
        # unproven, see ControlPlane._admit)
        assert sum(cp.rejected.values()) + cp.contacts.unproven == before + 1, (key, x)
    # header-level: a tensor or a weight on a swim message, an undecodable x map
    h = msgpack.packb({"kind": "swim", "from": peer, "x": {"op": "ping", "inc": 1, "seq": 1, "life": 1,
                                                          "status": "waiting"}, "w": 0.5})
    cp.on_frames(peer.encode(), [wire.TAG, h])
    h = msgpack.packb({"kind": "swim", "from": peer, "x": {"op": "ping", "inc": 1}})
    cp.on_frames(peer.encode(), [wire.TAG, h, b"\0" * 8])
    count += 2
    assert sum(cp.rejected.values()) + cp.contacts.unproven == count and cp.contacts.unproven > 50, (cp.rejected, cp.contacts.unproven)
    assert set(cp.rejected) <= {"control", "swim", "header", "frames"}, cp.rejected
    assert (dict((k, (v.incarnation, v.status)) for k, v in m.members.items()), cp.detector.state(peer)) == state
    # nothing reached SWIM itself; the stranger was sent this node's token (a light hello), no more
    assert cp.detector.swim.rejected == Counter()
    assert sent and all(d == "127.0.0.1:7999" and msg.kind == "hello" and "tok" in msg.extra for d, msg in sent), sent


def test_a_member_the_owner_misses_is_probed_next_out_of_turn():
    """A neighbour's messages stopped: the owner has it probed at once, not when the probe
    order (a random pass over all members) meets it, which can be seconds at hundreds."""
    members = [(f"m{i}", 1) for i in range(50)]
    node = Swim("a", 1, random.Random(0), members=members)
    node.tick(0.0)
    t = node._next_probe + 1e-6
    node.tick(t)  # the probe of this period goes to the order's next member
    first = node._probe.target
    target = next(m for m, _ in members if m != first and m not in node._order[:node._pos + 1])
    assert node.probe_soon(target, t) is True
    assert node.probe_soon(target, t + 0.01) is False  # once a period at most
    assert node.probe_soon("nobody", t) is False
    # the pending probe runs out at the period's end; the next goes to the member urged
    sent = node.tick(node._next_probe + 1e-6)
    assert node._probe.target == target and target in [m.to for m in sent if m.op == "ping"]
    # with no probe pending, an urged member is probed at the next tick
    node2 = Swim("a", 1, random.Random(1), members=members)
    node2.tick(0.0)
    assert node2._probe is None and node2.probe_soon("m7", 0.05)
    assert [m.to for m in node2.tick(0.05) if m.op == "ping"] == ["m7"]
