"""SWIM as the control plane's failure detector (gossip/protocol/swim_detector.py).

Unit tests run real :class:`~gossip.protocol.control.ControlPlane` objects that exchange
real encoded wire frames on a virtual clock (deterministic, well under a second
each); the simulated cluster runs the whole peer (gossip.sim.cluster); the last
tests run real ``gossip-node --detector swim`` processes on loopback.
"""

from __future__ import annotations

import heapq
import json
import random
import signal
import threading
from collections import Counter

import pytest
import torch

import gossip
from gossip.core.checkpoint import latest_checkpoint, load_checkpoint
from gossip.core.message import Message
from gossip.protocol.config import PeerConfig
from gossip.protocol.control import ControlPlane
from gossip.protocol.detector import HeartbeatDetector
from gossip.protocol.membership import Membership
from gossip.protocol.swim import ALIVE, DEAD
from gossip.protocol.swim_detector import SwimDetector
from gossip.protocol.timing import Timing
from gossip.sim.cluster import SimCluster, node_id
from gossip.transport import wire
from tests.cluster import Cluster, free_port, wait_for_step
from tests.helpers import tick

torch.set_num_threads(1)

FP = "fp"
TICK = 0.1  # the transport's tick (min(0.1, heartbeat / 2))


class Net:
    """``n`` control planes (waiting to start, all ids known through a ring of seeds)
    on one event queue: a tick each TICK s (own phase), frames after ``latency``,
    lost with probability ``loss``. Crashed and paused nodes neither tick nor receive."""

    def __init__(self, n: int, *, detector: str = "swim", seed: int = 0, loss: float = 0.0,
                 heartbeat: float = 0.5, dead_after: float = 3.0, latency: float = 0.002) -> None:
        self.ids = [f"127.0.0.1:{7000 + i}" for i in range(n)]
        self.rng = random.Random(seed)
        self.loss, self.latency = loss, latency
        self.now = 0.0
        self.queue: list = []
        self.order = 0
        self.down: set[int] = set()
        self.dead_at: dict[int, list[tuple[float, str]]] = {i: [] for i in range(n)}  # tick() verdicts, when
        self.kinds: Counter[str] = Counter()
        self.planes: list[ControlPlane] = []
        for i, me in enumerate(self.ids):
            timing = Timing(heartbeat=heartbeat, dead_after=dead_after)
            m = Membership(me, 1000 * (i + 1), FP, timing=timing)
            cp = ControlPlane(me, m.incarnation, FP, "", m, threading.RLock(), self._sender(i), lambda msg: None,
                              lambda: ("waiting", 0, 0), timing=timing, seeds=(self.ids[(i + 1) % n],),
                              clock=lambda: self.now, detector=detector)
            self.planes.append(cp)
            self._push(self.rng.uniform(0, TICK), ("tick", i, None))

    def _push(self, t: float, item: tuple) -> None:
        heapq.heappush(self.queue, (t, self.order, item))
        self.order += 1

    def _sender(self, i: int):
        def send(dst: str, msg: Message) -> None:
            self.kinds[msg.kind] += 1
            if self.loss and self.rng.random() < self.loss:
                return
            self._push(self.now + self.latency, ("frames", self.ids.index(dst), (self.ids[i], wire.encode(msg))))
        return send

    def run(self, until: float) -> None:
        while self.queue and self.queue[0][0] <= until:
            self.now, _, (kind, i, item) = heapq.heappop(self.queue)
            if kind == "tick":
                self._push(self.now + TICK, ("tick", i, None))
            if i in self.down:
                continue
            if kind == "tick":
                for mid in tick(self.planes[i], self.now):
                    self.dead_at[i].append((self.now, mid))
            else:
                sender, frames = item
                self.planes[i].on_frames(sender.encode(), frames)
        self.now = until

    def members(self, i: int) -> set[str]:
        return set(self.planes[i].m.members)


def test_a_crashed_member_becomes_a_removal_within_the_bound():
    n, heartbeat, dead_after = 5, 0.5, 3.0
    net = Net(n, heartbeat=heartbeat, dead_after=dead_after)
    net.run(10.0)
    assert all(net.members(i) == set(net.ids) for i in range(n))
    assert all(isinstance(p.detector, SwimDetector) for p in net.planes)
    net.down.add(n - 1)  # a crash: it sends nothing more
    crashed = 10.0
    # every survivor probes it within two passes of its probe order, the probe fails at
    # the end of its period, and the suspicion runs out; a second of slack for the spread
    opts = Timing(heartbeat=heartbeat, dead_after=dead_after).swim()
    bound = 2 * (n - 1) * heartbeat + heartbeat + opts.suspicion_timeout(n) + 1.0
    net.run(crashed + bound)
    for i in range(n - 1):
        when = [t for t, mid in net.dead_at[i] if mid == net.ids[-1]]
        assert len(when) == 1, (i, net.dead_at[i])
        # no sooner than a failed probe plus the suspicion: it is not declared on a whim
        assert crashed + opts.suspicion_timeout(n) <= when[0] <= crashed + bound, when
        assert net.ids[-1] not in net.members(i)
        assert net.planes[i].detector.state(net.ids[-1])[0] == DEAD
    assert all(not d for i, d in net.dead_at.items() if i < n - 1 for t, mid in d if mid != net.ids[-1])


@pytest.mark.parametrize("loss", [0.0, 0.1])
def test_members_that_answer_are_never_removed(loss):
    net = Net(6, seed=3, loss=loss)
    net.run(60.0)
    assert all(net.members(i) == set(net.ids) for i in range(6)), [net.members(i) for i in range(6)]
    assert all(not d for d in net.dead_at.values()), net.dead_at
    assert all(p.rejected == Counter() for p in net.planes)


def test_swim_sends_no_all_to_all_pings_and_its_traffic_does_not_grow_with_n():
    per_node = {}
    for n in (4, 16):
        for det in ("heartbeat", "swim"):
            net = Net(n, detector=det)
            net.run(20.0)  # settled: every member known
            assert all(net.members(i) == set(net.ids) for i in range(n))
            before = sum(net.kinds.values())
            if det == "swim":
                assert net.kinds["ping"] == 0
            net.run(40.0)
            per_node[det, n] = (sum(net.kinds.values()) - before) / n / 20.0
    # heartbeat: n - 1 pings per heartbeat; SWIM: a ping and about an ack per period
    assert per_node["heartbeat", 16] > 3.5 * per_node["heartbeat", 4]
    assert per_node["swim", 16] < 1.5 * per_node["swim", 4] and per_node["swim", 16] < 6, per_node


def test_status_round_and_member_digest_ride_on_the_swim_messages():
    net = Net(3)
    progress = {"s": ("training", 7, 70)}
    net.planes[0].progress = lambda: progress["s"]
    net.run(10.0)
    for i in (1, 2):
        m = net.planes[i].m.members[net.ids[0]]
        assert (m.status, m.round, m.step) == ("training", 7, 70)
        assert net.planes[i].digests[net.ids[0]] == net.planes[0].m.digest()
    assert net.kinds["ping"] == 0
    progress["s"] = ("done", 9, 90)
    net.run(16.0)
    assert all(net.planes[i].m.members[net.ids[0]].status == "done" for i in (1, 2))


def _swim_plane(me: str = "127.0.0.1:7000", inc: int = 1000):
    m = Membership(me, inc, FP)
    sent: list[tuple[str, Message]] = []
    cp = ControlPlane(me, inc, FP, "", m, threading.RLock(), lambda d, msg: sent.append((d, msg)),
                      lambda msg: None, lambda: ("waiting", 0, 0), timing=m.timing, detector="swim")
    return cp, m, sent


def _swim(sender: str, life: int, **fields) -> Message:
    return Message("swim", sender, 0, 0, 0, None, None,
                   {"status": "waiting", "life": life, "inc": life, **fields}, FP)


@pytest.mark.parametrize("restart", [False, True])
def test_events_about_an_older_life_of_a_member_are_ignored(restart):
    cp, m, _ = _swim_plane()
    b, x = "127.0.0.1:7001", "127.0.0.1:7002"
    for peer, life in ((b, 2000), (x, 3000)):
        cp.apply(cp.handle(_swim(peer, life, op="ping", seq=1), 1.0))
    tick(cp, 1.0)
    assert set(m.members) == {cp.id, b, x} and cp.detector.state(x) == (ALIVE, 3000)
    # b says x's life 3000 is dead (after x last spoke to this node more than dead_after / 2
    # ago): an event of SWIM's, taken at the next tick
    tick(cp, 2.0)
    cp.apply(cp.handle(_swim(b, 2000, op="gossip", uid=[x], ust=["dead"], uinc=[3000]), 2.6))
    if restart:  # meanwhile the member table learns x's new life (its hello, a member list)
        m.heard(x, 4000, 2.65)
    dead = tick(cp, 2.7)
    if restart:
        assert dead == [] and x in m.members and m.members[x].incarnation == 4000
        assert cp.detector.ignored_events == 1
        assert cp.detector.state(x) == (ALIVE, 4000)  # the new life joined SWIM
    else:
        assert dead == [x] and x not in m.members


def test_a_death_heard_of_a_member_that_talks_to_this_node_is_doubted_until_it_falls_silent():
    """SWIM's news that x is dead, while x spoke to this node itself within dead_after / 2,
    evicts nobody (after a partition cut and healed at different moments on each side, a
    node of one side spread the death of a member the other side heard again: it was
    removed, its leave announced, and it had to join again as a new life). x refutes and
    is alive; or it falls silent, and is dead dead_after after it last spoke."""
    b, x = "127.0.0.1:7001", "127.0.0.1:7002"
    for refutes in (False, True):
        cp, m, _ = _swim_plane()  # dead_after 3 s
        for t in (1.0, 2.0):
            for peer, life in ((b, 2000), (x, 3000)):
                cp.apply(cp.handle(_swim(peer, life, op="ping", seq=int(t)), t))
            tick(cp, t)
        cp.apply(cp.handle(_swim(b, 2000, op="gossip", uid=[x], ust=["dead"], uinc=[3000]), 2.1))
        assert tick(cp, 2.2) == [] and x in m.members and cp.detector.doubted == {x}
        assert cp.detector.state(x) == (DEAD, 3000)  # SWIM's view: the doubt is the member table's
        if refutes:  # x heard it is dead (SWIM's buddy system) and says it is alive, above that
            cp.apply(cp.handle(_swim(x, 3000, op="ping", seq=3, inc=3001), 2.5))
            assert tick(cp, 2.6) == [] and not cp.detector.doubted and cp.detector.state(x) == (ALIVE, 3001)
        t = 2.6
        while t < 4.95:  # b keeps talking; x is silent from 2.0 (or 2.5)
            cp.apply(cp.handle(_swim(b, 2000, op="ping", seq=int(10 * t)), t))
            assert x not in tick(cp, t + 0.05), t
            t += 0.5
        if not refutes:
            assert tick(cp, 5.0) == [x] and x not in m.members  # silent for dead_after: dead after all
        else:
            assert x in m.members  # alive again: only its own silence, through SWIM's suspicion, removes it


def test_a_member_declared_dead_that_speaks_again_is_readmitted():
    net = Net(3)
    net.run(10.0)
    net.down.add(2)  # paused: silent, but alive
    net.run(20.0)
    assert all(net.ids[2] not in net.members(i) for i in (0, 1))
    net.down.clear()  # it runs again: it hears it is dead, refutes, and speaks
    net.run(30.0)
    assert all(net.members(i) == set(net.ids) for i in range(3)), [net.members(i) for i in range(3)]
    for i in (0, 1):
        state, inc = net.planes[i].detector.state(net.ids[2])
        assert state == ALIVE and inc > net.planes[2].m.incarnation  # refuted above its death


def test_a_new_life_of_this_node_starts_a_fresh_detector():
    cp, m, _ = _swim_plane()
    cp.apply(cp.handle(_swim("127.0.0.1:7001", 2000, op="ping", seq=1), 1.0))
    tick(cp, 1.0)
    old = cp.detector.swim
    with cp.lock:
        cp.new_life(5000)
        m.new_life(5000)
    assert cp.detector.swim is not old and cp.detector.swim.incarnation == 5000
    tick(cp, 1.1)
    assert cp.detector.state("127.0.0.1:7001") == (ALIVE, 2000)  # members joined again from the table


def test_the_default_is_the_swim_detector_and_a_bad_name_is_refused():
    from gossip.api import SimConfig
    from gossip.cli import build_node_parser, build_sim_parser
    from gossip.sim.explore import run_schedule

    def plane(**kw):
        m = Membership("127.0.0.1:7000", 1, FP)
        return m, ControlPlane("127.0.0.1:7000", 1, FP, "", m, threading.RLock(), lambda d, msg: None,
                               lambda msg: None, lambda: ("waiting", 0, 0), timing=m.timing, **kw)

    assert isinstance(plane()[1].detector, SwimDetector)
    assert PeerConfig(listen="127.0.0.1:7000").detector == "swim" and SimConfig().detector == "swim"
    assert build_node_parser().parse_args(["--listen", "tcp://127.0.0.1:7000"]).detector == "swim"
    assert build_sim_parser().parse_args([]).detector == "swim"
    assert run_schedule.__defaults__ == ("swim",)
    with pytest.raises(ValueError, match="detector must be one of heartbeat, swim, got 'gossipy'"):
        PeerConfig(listen="127.0.0.1:7000", detector="gossipy")
    # a heartbeat node counts a swim message as a bad control message and changes nothing
    m, cp = plane(detector="heartbeat")
    assert isinstance(cp.detector, HeartbeatDetector)
    cp.on_frames(b"127.0.0.1:7001", wire.encode(_swim("127.0.0.1:7001", 5, op="ping", seq=1,
                                                      echo=cp.token("127.0.0.1:7001"))))
    assert cp.rejected == Counter({"control": 1}) and set(m.members) == {"127.0.0.1:7000"}


def test_gossip_node_detector_flag_bad_value_exits_2(capsys):
    from gossip.cli import node_main

    with pytest.raises(SystemExit) as e:
        node_main(["--listen", f"tcp://127.0.0.1:{free_port()}", "--detector", "gossipy"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--detector" in err and "'heartbeat', 'swim'" in err


# -- the whole peer, simulated (gossip.sim.cluster) ------------------------------------------------

def test_simulated_crash_with_swim_is_detected_and_the_others_finish(caplog):
    steps = 600
    c = SimCluster(4, steps=steps, detector="swim")
    c.crash(3, at=3.0)
    with caplog.at_level("WARNING", logger="gossip.protocol.membership"):
        c.run(until=120.0)
    # the detector's verdict, not a round timeout, removed it
    assert caplog.text.count(f"member {node_id(3)} removed: silent") == 3, caplog.text[-3000:]
    rs = c.results()
    assert rs[3]["exit"] == "crashed"
    for r in rs[:3]:
        assert r["exit"] == "done" and r["steps"] == steps and r["members"] == 3, r
        assert node_id(3) not in r["member_ids"] and r["rejected"] == {}, r


def test_simulated_run_with_swim_ends_where_heartbeat_does():
    out = {}
    for det in ("heartbeat", "swim"):
        c = SimCluster(3, steps=40, detector=det)
        c.run(until=60.0)
        rs = c.results()
        assert all(r["exit"] == "done" and r["members"] == 3 for r in rs), rs
        out[det] = [r["params_sha256"] for r in rs]
    assert out["swim"] == out["heartbeat"] and None not in out["swim"]


# -- real processes --------------------------------------------------------------------------------

FAST = ["--heartbeat", "0.25", "--dead-after", "2", "--settle", "1", "--grace", "5", "--timeout", "5"]


def ring(ports, i, steps, *extra):
    return ["--peers", f"127.0.0.1:{ports[(i + 1) % len(ports)]}", "--topology", "ring", "--algorithm", "gossip",
            "--task", "synthetic", "--steps", str(steps), "--seed", "0", "--json", *FAST, *extra]


@pytest.mark.slow
def test_real_nodes_with_swim_detect_a_kill_and_finish_without_it(tmp_path):
    n, steps = 4, 600
    ports = [free_port() for _ in range(n)]
    metrics = tmp_path / "n0.jsonl"
    with Cluster(tmp_path) as c:
        nodes = [c.start(f"n{i}", ring(ports, i, steps, "--detector", "swim",
                                       *(["--log", str(metrics), "--eval-every", "25"] if i == 0 else [])),
                         port=ports[i]) for i in range(n)]
        wait_for_step(metrics, 100, 240)
        victim = nodes[2]
        victim.proc.send_signal(signal.SIGKILL)  # no goodbye: a crash
        assert victim.proc.wait(10) == -signal.SIGKILL
        survivors = [x for x in nodes if x is not victim]
        for x in survivors:
            assert x.wait(240) == 0, x.log()[-3000:]
        summaries = [x.summary() for x in survivors]
        logs = [x.log() for x in survivors]
    gone = f"member {victim.addr} removed: silent"
    assert any(gone in log for log in logs), logs[0][-3000:]
    # the rounds went on without the suspect (the survivors may finish before its leave
    # round, with it still in their topology): none waited out --timeout for it
    for s in summaries:
        assert s["steps"] == steps and s["timed_out_rounds"] == 0 and s["rejected"] == {}, s
    assert sum(s["skipped_rounds"] for s in summaries) >= 1, summaries


@pytest.mark.slow
def test_real_nodes_with_swim_end_where_heartbeat_nodes_do(tmp_path):
    """Synchronous rounds, same seed and ranks: the same parameters whatever the detector."""
    steps, n = 6, 3
    flats = {}
    for det in ("heartbeat", "swim"):
        ports = sorted(free_port() for _ in range(n))  # sorted ids = the same ranks in both runs
        with Cluster(tmp_path) as c:
            nodes = [c.start(f"{det}{i}", ring(ports, i, steps, "--detector", det, "--checkpoint-dir",
                                               str(tmp_path / f"{det}-ck{i}")), port=ports[i]) for i in range(n)]
            assert c.wait_all(120) == [0] * n, [x.log()[-2000:] for x in nodes]
            assert all(x.summary()["members"] == n for x in nodes)
        flats[det] = [load_checkpoint(latest_checkpoint(tmp_path / f"{det}-ck{i}"))["flat"] for i in range(n)]
    sim = gossip.simulate(nodes=n, topology="ring", algorithm="gossip", task="synthetic", steps=steps, seed=0,
                          eval_every=steps)
    for rank in range(n):
        assert torch.equal(flats["heartbeat"][rank], flats["swim"][rank])
        torch.testing.assert_close(flats["swim"][rank], sim.params[rank], rtol=1e-5, atol=1e-6)


def test_detector_traffic_benchmark_runs_and_ends_with_its_json_line(capsys):
    from benchmarks.detector_traffic import main

    assert main(["--nodes", "4", "--warmup", "6", "--seconds", "4"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for det in ("heartbeat", "swim"):
        assert 0 < result["msgs_per_node_s"][det]["4"] < 10 and 0 < result["detect_s"][det]["4"] < 10, result


def test_the_docstring_examples_of_the_detectors_hold():
    import doctest

    import gossip.protocol.swim
    import gossip.protocol.timing

    for module in (gossip.protocol.timing, gossip.protocol.swim):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, (module.__name__, result)


def test_members_the_control_plane_lists_are_no_swim_news():
    """A start of n: each node's SWIM admits the n - 1 others from the member lists, which
    tell every member of them already. Were each admission news, every node would push
    n - 1 joins, each ``retransmit_limit`` times, in SWIM's gossip: at 1,024 members, 30
    messages per node per second for the first 17 s of training."""
    n = 24
    net = Net(n)
    net.run(10.0)
    assert all(net.members(i) == set(net.ids) for i in range(n))
    queued = sum(len(p.detector.swim._queue) for p in net.planes)
    pushes = sum(p.detector.swim.sent["gossip"] for p in net.planes)
    # (news of one's own life, and of a suspicion now and then: far below one push of
    # joins per member each, let alone (n - 1) * retransmit_limit / max_piggyback)
    assert queued <= n and pushes < n, (queued, pushes)
