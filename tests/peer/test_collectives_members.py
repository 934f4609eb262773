"""Which members a collective of a training loop of the user's own waits for
(gossip/peer/collectives.py), without sockets: a stand-in peer over a real member table."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from gossip.peer.collectives import Collectives
from gossip.protocol.membership import Membership
from gossip.protocol.timing import Timing


def _peer(members: Membership) -> SimpleNamespace:
    sent: list[str] = []
    node = SimpleNamespace(members=["a:1", "b:1", "c:1"], round=40, step=40)
    cfg = SimpleNamespace(timing=Timing(join_timeout=30.0), timeout=5.0)
    return SimpleNamespace(id="a:1", incarnation=1, fingerprint="f" * 16, node=node, membership=members,
                           lock=threading.RLock(), cfg=cfg, sent=sent,
                           _send_message=lambda dst, msg: sent.append(dst), _service=lambda t: time.sleep(t))


def test_a_call_does_not_wait_for_a_restarted_members_new_life_before_its_join_round():
    """b:1 crashed and restarted: the table holds its new life (2), which waits for its join
    round at 60, while the schedule still has the old life (1) train until its leave at 50.
    Neither can answer a call at round 40: it returns at once with a's and c's values. It
    used to wait ``join_timeout`` (60 s by default) on every call until the join round, and
    in a Lightning run whose epoch ends call a gather, that held the join round back too."""
    m = Membership("a:1", 1, "f" * 16, timing=Timing())
    m.start(["a:1", "b:1", "c:1"], [1, 1, 1])
    for mid, inc in (("a:1", 1), ("b:1", 1), ("c:1", 1)):
        m.heard(mid, inc, 0.0)
    m.announce_leave("b:1", 50, 1)
    m.announce_join("b:1", 60, 2)
    m.heard("b:1", 2, 1.0)  # the new life said hello
    assert m.life_in("b:1", 40) == (True, 1) and m.members["b:1"].incarnation == 2
    peer = _peer(m)
    c = Collectives(peer)
    c.got[("gather", 1)] = {"c:1": torch.tensor([3.0], dtype=torch.float64)}  # c's value came first
    t0 = time.monotonic()
    got = c.gather("gather", torch.tensor([1.0], dtype=torch.float64))
    assert time.monotonic() - t0 < 5.0
    assert sorted(got) == ["a:1", "c:1"] and sorted(peer.sent) == ["b:1", "c:1"]


def test_a_call_waits_for_a_member_in_the_life_it_trains_in():
    """The same table without the restart: b:1's value is awaited (here it comes after a
    few polls), so every member sums the same values."""
    m = Membership("a:1", 1, "f" * 16, timing=Timing())
    m.start(["a:1", "b:1", "c:1"], [1, 1, 1])
    for mid in ("a:1", "b:1", "c:1"):
        m.heard(mid, 1, 0.0)
    peer = _peer(m)
    c = Collectives(peer)
    c.got[("gather", 1)] = {"c:1": torch.tensor([3.0], dtype=torch.float64)}
    polls = []

    def service(t: float) -> None:
        polls.append(t)
        if len(polls) == 3:
            c.got[("gather", 1)]["b:1"] = torch.tensor([2.0], dtype=torch.float64)

    peer._service = service
    got = c.gather("gather", torch.tensor([1.0], dtype=torch.float64))
    assert sorted(got) == ["a:1", "b:1", "c:1"] and len(polls) == 3
