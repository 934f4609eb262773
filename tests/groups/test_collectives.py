"""The collectives across members in groups (gossip.groups.collectives), in one process: each
rank a thread, the group's own collectives over a thread barrier, its channel a real
StoreLink over an in-memory store, and rank 0's part the real members' Collectives of
gossip/peer/collectives.py whose messages go through the real wire encoding. A group and
a single-process member take part in one collective alike. The real processes under
torchrun are in test_user_loop_real.py."""

from __future__ import annotations

import queue
import threading
import time
from fractions import Fraction
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from gossip.groups.collectives import GroupCollectives, follower_wait
from gossip.groups.link import StoreLink
from gossip.peer.collectives import Collectives
from gossip.protocol.membership import Membership
from gossip.transport import wire

LIMIT = 60.0


class Net:
    """Members' "average" messages between fake peers, through the wire encoding."""

    def __init__(self, members: list[str]) -> None:
        self.members = members
        self.peers: dict[str, FakePeer] = {}
        self.delay: dict[str, float] = {}  # seconds a member's messages are held back


class FakePeer:
    """What Collectives uses of a Peer: its id, the round's members, the alive table, a
    send, and a service that hands inbound "average" messages to it."""

    def __init__(self, net: Net, mid: str) -> None:
        self.net, self.id = net, mid
        self.incarnation, self.fingerprint = 1, "shards-of-2"
        self.node = SimpleNamespace(members=list(net.members), step=0, round=0)
        self.lock = threading.Lock()
        self.membership = Membership(mid, 1, "f" * 16)  # every member started, in its first life
        self.membership.start(list(net.members), [1] * len(net.members))
        for m in net.members:
            self.membership.heard(m, 1, 0.0)
        self.cfg = SimpleNamespace(timing=SimpleNamespace(join_timeout=LIMIT), timeout=1.0)
        self.control = SimpleNamespace(reject=lambda *a: self.rejected.append(a))
        self.rejected: list[Any] = []
        self.inbound: queue.SimpleQueue = queue.SimpleQueue()
        self.on_average: Callable[[Any], None] | None = None
        net.peers[mid] = self

    def _send_message(self, dst: str, msg: Any) -> None:
        frames = [f if isinstance(f, bytes) else bytes(memoryview(f).cast("B")) for f in wire.encode(msg)]
        time.sleep(self.net.delay.get(self.id, 0.0))
        self.net.peers[dst].inbound.put(wire.decode(frames))

    def _service(self, block: float) -> None:
        try:
            msg = self.inbound.get(timeout=block)
        except queue.Empty:
            return
        assert self.on_average is not None
        self.on_average(msg)


class ThreadIntra:
    """A group's own collectives between its ranks' threads."""

    def __init__(self, shared: dict[str, Any], rank: int) -> None:
        self.shared, self.rank = shared, rank

    def all_gather(self, values: torch.Tensor) -> list[torch.Tensor]:
        slots = self.shared["slots"]
        slots[self.rank] = values.clone()
        self.shared["barrier"].wait(LIMIT)
        out = [s.clone() for s in slots]
        self.shared["barrier"].wait(LIMIT)
        return out

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        return sum(self.all_gather(values))  # (in rank order: the same float on every rank)

    def barrier(self) -> None:
        self.shared["barrier"].wait(LIMIT)


def cluster(groups: dict[str, int], singles: list[str]) -> tuple[Net, dict[str, list[Any]]]:
    """Members: groups (id -> K ranks, each rank a GroupCollectives) and single nodes (a
    Collectives each). Returns the net and, per member, its ranks' collectives."""
    net = Net(sorted([*groups, *singles]))
    out: dict[str, list[Any]] = {}
    for mid, k in groups.items():
        store = dist.HashStore()
        shared = {"barrier": threading.Barrier(k), "slots": [None] * k}
        across = Collectives(FakePeer(net, mid))
        out[mid] = [GroupCollectives(r, k, StoreLink(store, r, k), ThreadIntra(shared, r),
                                     across if r == 0 else None, wait=LIMIT) for r in range(k)]
    for mid in singles:
        out[mid] = [Collectives(FakePeer(net, mid))]
    return net, out


def run_all(calls: dict[tuple[str, int], Callable[[], Any]]) -> dict[tuple[str, int], Any]:
    """Run every (member, rank)'s call in a thread of its own; their results (or errors)."""
    results: dict[tuple[str, int], Any] = {}

    def one(key: tuple[str, int], fn: Callable[[], Any]) -> None:
        try:
            results[key] = fn()
        except Exception as e:  # noqa: BLE001 - handed back to the test
            results[key] = e

    threads = [threading.Thread(target=one, args=(k, fn), daemon=True) for k, fn in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LIMIT)
    assert not any(t.is_alive() for t in threads), "a collective hung"
    return results


A, B, S = "127.0.0.1:7000", "127.0.0.1:7100", "127.0.0.1:7200"


def test_average_in_a_mixed_cluster_is_the_weighted_mean_over_every_rank_and_the_single_node():
    """Two groups of 2 and a single-process member: every rank's weight * value is counted,
    the single node's too, and everyone gets the very same float (exact here: dyadic values)."""
    net, members = cluster({A: 2, B: 2}, [S])
    net.delay[B] = 0.3  # rank 0 of A waits on B; A's rank 1 waits on the store, not in a collective
    values = {(A, 0): (0.5, 1.0), (A, 1): (1.25, 3.0), (B, 0): (-2.0, 2.0), (B, 1): (4.75, 0.5), (S, 0): (8.0, 1.5)}
    got = run_all({key: (lambda key=key: members[key[0]][key[1]].average(*values[key])) for key in values})
    exact = sum(Fraction(v) * Fraction(w) for v, w in values.values()) / sum(Fraction(w) for _, w in values.values())
    assert {type(g) for g in got.values()} == {float}, got
    assert set(got.values()) == {float(exact)}, (got, float(exact))


def test_average_keeps_the_values_form_and_counts_each_collective_alike():
    _, members = cluster({A: 2, B: 2}, [])
    ranks = [(m, r) for m in (A, B) for r in range(2)]
    got = run_all({(m, r): (lambda m=m, r=r: members[m][r].average(torch.tensor([[float(r)], [10.0 * (m == B)]])))
                   for m, r in ranks})
    for g in got.values():
        assert isinstance(g, torch.Tensor) and g.shape == (2, 1) and g.dtype == torch.float32, g
        assert g.flatten().tolist() == [0.5, 5.0]
    got = run_all({(m, r): (lambda m=m, r=r: members[m][r].average([1.0, float(r)], weight=2.0)) for m, r in ranks})
    assert all(g == [1.0, 0.5] for g in got.values()), got
    assert {members[m][r].calls for m, r in ranks} == {2}
    assert {members[m][0].across.calls for m in (A, B)} == {2}  # the members' numbering, as a single node's


def test_all_gather_gives_every_rank_of_every_member_in_member_then_rank_order():
    _, members = cluster({B: 2, A: 2}, [])
    ranks = [(m, r) for m in (A, B) for r in range(2)]
    got = run_all({(m, r): (lambda m=m, r=r: members[m][r].all_gather(torch.tensor([100 * (m == B) + r, 7])))
                   for m, r in ranks})
    for g in got.values():
        assert [t.tolist() for t in g] == [[0, 7], [1, 7], [100, 7], [101, 7]], g
        assert all(t.dtype == torch.int64 for t in g)


def test_barrier_returns_on_no_rank_before_every_rank_of_every_member_reached_it():
    _, members = cluster({A: 2, B: 2}, [])
    arrived: list[tuple[str, int]] = []
    left: dict[tuple[str, int], int] = {}

    def call(m: str, r: int) -> None:
        if (m, r) == (B, 1):
            time.sleep(0.5)  # the last to arrive
        arrived.append((m, r))
        members[m][r].barrier()
        left[(m, r)] = len(arrived)

    run_all({(m, r): (lambda m=m, r=r: call(m, r)) for m in (A, B) for r in range(2)})
    assert left == {(m, r): 4 for m in (A, B) for r in range(2)}, left


def test_an_error_on_rank_0_reaches_the_other_ranks_instead_of_a_wait():
    """Members gathering tensors of different sizes: rank 0's members' part fails, and its
    rank 1 raises the same error at once rather than waiting out its bound."""
    _, members = cluster({A: 2, B: 2}, [])
    t0 = time.monotonic()
    got = run_all({(m, r): (lambda m=m, r=r: members[m][r].all_gather(torch.zeros(1 + (m == B))))
                   for m in (A, B) for r in range(2)})
    assert time.monotonic() - t0 < LIMIT / 2
    assert all(isinstance(g, ValueError) for (m, r), g in got.items() if r == 0), got
    assert all(isinstance(g, RuntimeError) and "failed on rank 0: ValueError: all_gather" in str(g)
               for (m, r), g in got.items() if r == 1), got


def test_only_rank_0_speaks_for_the_group_and_the_others_wait_a_bounded_time():
    store = dist.HashStore()
    with pytest.raises(ValueError, match="rank 0"):
        GroupCollectives(1, 2, StoreLink(store, 1, 2), ThreadIntra({}, 1), Collectives(FakePeer(Net([A]), A)), 1.0)
    assert follower_wait(60.0, 10.0) == 2 * 60.0 + 60.0
    lone = GroupCollectives(1, 2, StoreLink(store, 1, 2),
                            SimpleNamespace(all_reduce_sum=lambda t: t, barrier=lambda: None), None, wait=0.2)
    with pytest.raises(RuntimeError, match="rank 0 published no result in 0.2 s"):
        lone.barrier()
