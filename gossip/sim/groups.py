"""Groups of K ranks in the simulator: the ranks' own programs, a modelled store, a modelled collective.

A simulated group is K processes (:class:`~gossip.sim.cluster.SimProcess`): rank 0
runs :class:`~gossip.protocol.ranks.GroupLead` over a real
:class:`~gossip.protocol.lifecycle.Lifecycle`, ranks 1..K-1 run
:class:`~gossip.protocol.ranks.GroupFollow`, exactly the programs a real group's
ranks run (:mod:`gossip.peer.group`). What is modelled:

- the group's model: one replica whose flat vector rank r sees a slice of
  (:class:`~gossip.training.shards.ReplicaSlice`, as a DDP group), trained one
  step whenever every rank of the group reached the step (the collective: a rank
  that waits in a round, or a stalled rank, holds the whole group's next step);
- the group's store (:class:`SimLink`): rank 0's decisions, the ranks' acks and
  rank 0's news reach the other ranks ``latency`` seconds after they are written;
- torchrun: a rank that dies takes its group down; the launcher starts every
  rank again after a delay (see :meth:`~gossip.sim.cluster.SimCluster.crash`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from gossip.core.actions import COMPUTE, Program
from gossip.core.state import FlatState
from gossip.protocol.group import Decision, News
from gossip.protocol.ranks import GroupFollow, GroupLead
from gossip.training.node import init_model
from gossip.training.shards import ReplicaSlice, SlicePlace

__all__ = ["SimLink", "RankLink", "SimGroup", "BARRIER", "lead_program", "follow_program"]

#: what a rank's program yields to wait for the group's other ranks outside a step
#: (the real loop's ``group.barrier()`` before the goodbye); ``COMPUTE`` is a step's
BARRIER = object()


class SimLink:
    """A group's store on the virtual clock: what is written is readable ``latency`` later.

    ``now()`` reads the virtual time; ``wake(rank, delay)`` is called when something a rank
    may wait for is written, readable ``delay`` seconds later (the driver then resumes the
    rank if it polls). :meth:`rank` gives rank
    r's side of it (a :class:`~gossip.protocol.group.GroupLink`)."""

    def __init__(self, size: int, now: Callable[[], float], wake: Callable[[int, float], None],
                 latency: float = 2e-4) -> None:
        self.size = size
        self.now = now
        self.wake = wake
        self.latency = latency
        self.decisions: dict[int, tuple[float, Decision]] = {}
        self.acked: dict[int, dict[int, tuple[float, bool]]] = {}
        self.newsfeed: list[tuple[float, News]] = []

    def rank(self, r: int) -> "RankLink":
        return RankLink(self, r)


class RankLink:
    """Rank ``r``'s side of a :class:`SimLink`."""

    def __init__(self, link: SimLink, r: int) -> None:
        self.shared, self.r = link, r

    def publish(self, decision: Decision) -> None:
        link = self.shared
        link.decisions[decision.seq] = (link.now() + link.latency, decision)
        for r in range(1, link.size):
            link.wake(r, link.latency)

    def next(self, seq: int, timeout: float) -> Decision | None:
        got = self.shared.decisions.get(seq)
        return got[1] if got is not None and got[0] <= self.shared.now() else None

    def ack(self, seq: int, ok: bool) -> None:
        link = self.shared
        link.acked.setdefault(seq, {})[self.r] = (link.now() + link.latency, ok)
        link.wake(0, link.latency)

    def acks(self, seq: int, timeout: float) -> list[bool] | None:
        link = self.shared
        now, got = link.now(), link.acked.get(seq, {})
        if any(r not in got or got[r][0] > now for r in range(1, link.size)):
            return None
        return [got[r][1] for r in range(1, link.size)]

    def publish_news(self, news: News) -> None:
        link = self.shared
        link.newsfeed = [*link.newsfeed[-3:], (link.now() + link.latency, news)]
        for r in range(1, link.size):
            link.wake(r, link.latency)

    def news(self) -> News:
        now = self.shared.now()
        for t, news in reversed(self.shared.newsfeed):
            if t <= now:
                return news
        return News()


@dataclass
class SimGroup:
    """One life of a simulated group (a start of its K processes): its model, its views,
    its store, its collective."""

    index: int
    size: int
    task: Any
    model_seed: int
    link: SimLink
    split: str = "iid"
    model: Any = None
    state: FlatState | None = None
    views: list[ReplicaSlice] = field(default_factory=list)
    optimizer: Any = None
    stream: Any = None
    parked: dict[int, Any] = field(default_factory=dict)  # rank -> what it waits for (COMPUTE or BARRIER)
    done: set[int] = field(default_factory=set)  # ranks whose program ended

    def __post_init__(self) -> None:
        self.model = init_model(self.task, self.model_seed, "cpu")
        self.state = FlatState(self.model)
        self.views = [ReplicaSlice(self.state, SlicePlace(r, self.size)) for r in range(self.size)]
        self.optimizer = self.task.optimizer(self.model.parameters())

    @staticmethod
    def fingerprint(task: Any, model_seed: int, size: int, rank: int) -> str:
        """Rank ``rank``'s layout in a group of ``size`` (equal on rank r of every such group)."""
        state = FlatState(init_model(task, model_seed, "cpu"))
        return ReplicaSlice(state, SlicePlace(rank, size)).fingerprint

    def begin(self, rank: int, world: int, seed: int) -> None:
        """The group's data for a life that trains as member ``rank`` of ``world``."""
        self.stream = self.task.stream(rank, world, self.split, seed, torch.device("cpu"))

    def train_step(self) -> float:
        """One step of the group's model (every rank took part)."""
        self.optimizer.zero_grad(set_to_none=True)
        out = self.task.loss(self.model, self.stream.next())
        out.backward()
        self.optimizer.step()
        return float(out.detach())

    def bind(self, node: Any, rank: int) -> None:
        """After an exchange: rank ``rank``'s node mixes the group's slice itself (a send held
        in place may have moved it to fresh memory, as a real group's loop puts it back)."""
        view = self.views[rank]
        if node.state.flat.data_ptr() != view.flat.data_ptr():
            node.state.rehome(into=view.flat)


def lead_program(lead: GroupLead, group: SimGroup, steps: int, origin: float) -> Program:
    """Rank 0's whole run, as a real group's training loop runs it (gossip.groups.run)."""
    start = yield from lead.start(origin=origin)
    if start is None:
        return False
    group.begin(start.rank, start.world, lead.life.cfg.seed)
    step = lead.node.step
    while step < steps:
        yield COMPUTE
        step += 1
        if (yield from lead.after_step(step)):
            group.bind(lead.node, 0)
        if lead.stopped:
            break
        step = lead.node.step
    yield from lead.complete_pending()
    yield BARRIER
    yield from lead.finish()
    return True


def follow_program(follow: GroupFollow, group: SimGroup, steps: int) -> Program:
    """Rank r's whole run (r > 0), as a real group's training loop runs it."""
    yield from follow.start()
    rank = follow.f.rank
    group.bind(follow.node, rank)
    step = follow.node.step
    while step < steps:
        yield COMPUTE
        step += 1
        if (yield from follow.after_step(step)):
            group.bind(follow.node, rank)
        if follow.stopped:
            break
        step = follow.node.step
    yield from follow.complete_pending()
    yield BARRIER
    yield from follow.finish()
    return True
