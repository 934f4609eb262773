"""The membership protocol of one peer, without sockets: starting together, restarts,
and fresh connections towards members that come back."""

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
        self.status, self.round = status, rnd
        self.m = Membership(me, 1, FP, dead_after=2.0)
        self.m.heard(me, 1, 0.0)
        self.cp = ControlPlane(me, 1, FP, "", self.m, threading.RLock(), lambda d, m: self.sent.append((d, m)),
                               lambda m: None, lambda: (self.status, self.round, 0), heartbeat=0.5, seeds=seeds,
                               reconnect=self.reconnected.append)

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
