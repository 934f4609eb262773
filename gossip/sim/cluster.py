"""Real peers in the simulator: the control plane and lifecycle of ``gossip-node``
over a simulated network, on a virtual clock.

Each simulated process runs the same :class:`~gossip.protocol.lifecycle.Lifecycle`
(discovery, joins, state pulls, new lives, merges, the finish) and
:class:`~gossip.protocol.control.ControlPlane` (member lists, heartbeats, the failure
detector, leave and join rounds) as a real node. They exchange the real encoded
wire frames, so decoding and validation run too. Faults act only on processes
and links, the way they do on real machines:

``crash``      the process is gone (no goodbye); its state is lost
``start``      a process starts (a late joiner, or a restart; ``resume`` reads its checkpoints)
``stall``      the process does not run for a while (SIGSTOP): it neither sends nor reads;
               what arrived meanwhile is read when it runs again
``partition``  groups of processes cannot reach each other; ``heal`` ends it
``spike``      the messages on one link take longer for a while (a congested or rerouted path)
``clock``      a process's clock runs fast or slow (``drift``) from its own origin (``offset``):
               its control plane and lifecycle read only that clock

and, for every message (``duplicate``, ``reorder``): a message arrives twice, or is
held back behind later ones on its link.

Detection, leave rounds, joins, state transfer and merges come from the protocol.
A run is deterministic for its seed: the same faults and seed give the same
messages, the same parameters, the same outcome.

>>> c = SimCluster(3, steps=40)
>>> c.run(until=60.0)
>>> [r["steps"] for r in c.results()]
[40, 40, 40]
"""

from __future__ import annotations

import heapq
import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from gossip.core.actions import Compute, Poll, Release, Send
from gossip.core.message import Message
from gossip.core.state import FlatState
from gossip.protocol.config import PeerConfig
from gossip.protocol.control import NODE_KINDS
from gossip.protocol.group import ShardFollower, ShardModule, group_of, rank_address
from gossip.protocol.ranks import GroupFollow, GroupLead
from gossip.protocol.errors import PeerError
from gossip.protocol.lifecycle import Lifecycle
from gossip.protocol.timing import Timing
from gossip.training.node import init_model
from gossip.training.tasks import get_task
from gossip.transport import wire
from gossip.sim.groups import BARRIER, SimGroup, SimLink, follow_program, lead_program
from gossip.transport.links import LinkModel, SimNetwork

__all__ = ["SimCluster", "SimProcess", "FAST", "node_id"]

log = logging.getLogger("gossip.simcluster")

#: the settings of the real-process fault tests (tests/peer/test_faults_real.py ``FAST``)
FAST: dict[str, Any] = dict(timing=Timing.fast(), timeout=5.0)

RESUME, FRAMES, TICK, FAULT, LINK = range(5)


def node_id(i: int) -> str:
    """The id of simulated process ``i`` (an address, as real ids are: 10.0.0.0/8 holds
    16,777,215 of them).

    >>> node_id(0), node_id(254), node_id(4095)
    ('10.0.0.1:7000', '10.0.0.255:7000', '10.0.16.0:7000')
    """
    if not 0 <= i < (1 << 24) - 1:
        raise ValueError(f"a simulated process index must be in [0, {(1 << 24) - 2}], got {i!r}")
    n = i + 1
    return f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}:7000"


@dataclass
class SimProcess:
    """One simulated process: its peer's lifecycle and what the driver tracks."""

    index: int
    id: str
    cfg: PeerConfig
    life: Lifecycle | None = None
    program: Any = None
    up: bool = False
    epoch: int = 0            # a new process (restart) or a crash: events of an older one are void
    token: int = 0            # the resume the program waits for (a poll woken early voids its timer)
    primed: bool = False
    polling: bool = False
    stalled: bool = False
    resume_due: bool = False  # a resume fell due while stalled
    backlog: list = field(default_factory=list)  # frames that arrived while stalled
    started_at: float = 0.0
    exit: str | None = None   # "done", "crashed", "error: ..." once the process is gone
    lives: list[dict[str, Any]] = field(default_factory=list)  # the results of earlier processes
    mix_violations: list[str] = field(default_factory=list)  # see SimCluster._audit_mixing
    after_finish: bool = False  # it began a life (a start, a new one before training), or said hello while
    #                             waiting to join, when another process had finished or was a join margin from it
    drift: float = 0.0        # its clock runs at (1 + drift) times virtual time ...
    offset: float = 0.0       # ... from this reading at virtual time 0
    member: int = -1          # a rank of a group: the member's index (rank 0 is the member's process)
    rank: int = 0             # ... and its rank
    lead: Any = None          # rank 0 of a group: its GroupLead; rank r > 0: its GroupFollow is ``follow``
    follow: Any = None
    group: Any = None         # the group's current life (gossip.sim.groups.SimGroup)
    rounds: dict = field(default_factory=dict)  # (start count, round) -> the members it mixed with (groups)

    def local(self, t: float) -> float:
        """Its clock's reading at virtual time ``t``."""
        return t * (1.0 + self.drift) + self.offset

    def span(self, d: float) -> float:
        """Virtual seconds for ``d`` seconds of its clock to pass."""
        return d / (1.0 + self.drift)


class SimCluster:
    """``n`` peers, each configured as ``gossip-node`` would be, on one virtual clock.

    Parameters
    ----------
    n : processes, ids ``node_id(0..n-1)``
    steps : local steps each trains
    seed : the run's seed (link jitter and loss draws; the peers' ``--seed`` is ``model_seed``)
    link : the model of every link
    step_time : virtual seconds one local step takes (a number, or ``f(i) -> seconds``)
    peers : ``peers(i)`` the indices process ``i`` names as ``--peers`` (default: the next one, a ring)
    late : indices that do not start at time 0 (start them with :meth:`start`)
    checkpoint_dir : ``checkpoint_dir(i)`` a directory for process ``i``'s checkpoints, or None
    duplicate : probability that a message arrives twice (the copy up to ``reorder_by`` later)
    control_loss : probability that a control-plane message (hello, member list, SWIM probe,
        goodbye) is lost, over the link's own ``loss``: a lossy control network (SWIM over
        UDP elsewhere) under model traffic that arrives, as over ZeroMQ's TCP
    reorder : probability that a message is held back by up to ``reorder_by`` seconds
        (so later messages on its link overtake it)
    options : further :class:`~gossip.protocol.config.PeerConfig` fields (default :data:`FAST`, ring, synthetic)
    configure : ``configure(i)`` further PeerConfig fields of process ``i`` only (its ``rank``,
        ``world_size``, ``dc``), over ``options``
    inter_link : the model of links between processes of different ``dc`` labels (default: none;
        every link is ``link``, of class intra)
    device : the device every process trains on
    group : ranks per member (default 1: single-process nodes). With K > 1 each member is
        a group of K processes (:mod:`gossip.sim.groups`): rank 0 leads, rank r exchanges
        its slice with rank r of the other members; faults by member index act on every
        rank, :meth:`crash` and :meth:`stall` take ``rank=`` for one rank only
    restart_after : a group's launcher starts every rank again this many seconds after one
        of them died (``crash(i, rank=r)``)
    """

    def __init__(self, n: int, *, steps: int = 200, seed: int = 0, link: LinkModel | None = None,
                 step_time: float | Callable[[int], float] = 0.01,
                 peers: Callable[[int], Sequence[int]] | None = None, late: Sequence[int] = (),
                 checkpoint_dir: Callable[[int], str | None] | None = None, model_seed: int = 0,
                 duplicate: float = 0.0, reorder: float = 0.0, reorder_by: float = 0.05, control_loss: float = 0.0,
                 configure: Callable[[int], dict[str, Any]] | None = None, inter_link: LinkModel | None = None,
                 device: str = "cpu", group: int = 1, restart_after: float = 1.0, **options: Any) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise ValueError(f"group must be a positive integer (ranks per member), got {group!r}")
        if not restart_after > 0:
            raise ValueError(f"restart_after must be > 0 seconds, got {restart_after!r}")
        self.group, self.restart_after, self.model_seed = group, float(restart_after), model_seed
        for name, prob in (("duplicate", duplicate), ("reorder", reorder), ("control_loss", control_loss)):
            if not 0 <= prob < 1:
                raise ValueError(f"{name} must be a probability in [0, 1), got {prob!r}")
        if not reorder_by > 0:
            raise ValueError(f"reorder_by must be > 0 seconds, got {reorder_by!r}")
        self.duplicate, self.reorder, self.reorder_by = duplicate, reorder, reorder_by
        self.control_loss = control_loss
        self.rng = random.Random(seed * 2654435761 + 0xD0B1E)  # duplicate and reorder draws only
        self.control_rng = random.Random(seed * 40503 + 0xC0DE)  # control_loss draws only
        self.spikes: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        self.broken: set[tuple[str, str]] = set()  # connections that deliver nothing (see break_connection)
        self._up = 0       # processes up
        self._faults = 0   # fault events still queued
        self.now = 0.0
        self.events: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        links = {"intra": link or LinkModel(latency=1e-3, bandwidth=1e9)}
        if inter_link is None:
            self.network = SimNetwork(links, lambda u, v: "intra", seed=seed)
        else:  # links between datacenter labels are inter
            def link_class(u: str, v: str) -> str:
                a, b = self.by_id.get(u), self.by_id.get(v)
                return "intra" if a is None or b is None or a.cfg.dc == b.cfg.dc else "inter"

            self.network = SimNetwork({**links, "inter": inter_link}, link_class, seed=seed)
        self.device = torch.device(device)
        self.step_time = step_time if callable(step_time) else (lambda i, t=float(step_time): t)
        settings = {**FAST, "topology": "ring", "task": "synthetic", **options}
        peers = peers or (lambda i: [(i + 1) % n] if n > 1 else [])
        self.task = get_task(settings["task"])
        probe = FlatState(init_model(self.task, model_seed, "cpu"))
        self.fingerprint, self.model_bytes = probe.fingerprint, probe.nbytes
        del probe
        self.procs: list[SimProcess] = []
        for i in range(n):
            ck = checkpoint_dir(i) if checkpoint_dir is not None else None
            own = {**settings, **configure(i)} if configure is not None else settings
            cfg = PeerConfig(listen=node_id(i), peers=tuple(node_id(j) for j in peers(i) if j != i), steps=steps,
                             seed=model_seed, checkpoint_dir=ck, **own)
            self.procs.append(SimProcess(i, node_id(i), cfg, member=i))
        self.all = list(self.procs)  # every process (a group's ranks 1..K-1 after the members)
        self.ranks: list[list[SimProcess]] = [[p] for p in self.procs]  # each member's processes, by rank
        if group > 1:
            self.fingerprints = [SimGroup.fingerprint(self.task, model_seed, group, r) for r in range(group)]
            self.fingerprint = self.fingerprints[0]
            for i, p in enumerate(self.procs):
                for r in range(1, group):
                    q = SimProcess(len(self.all), rank_address(p.id, r), p.cfg, member=i, rank=r)
                    self.all.append(q)
                    self.ranks[i].append(q)
        self.by_id = {p.id: p for p in self.all}
        self.frames_sent = 0
        self.frames_lost = 0
        # messages sent and their bytes on the wire, by kind (control traffic is every kind
        # but the node thread's: see gossip.protocol.control.NODE_KINDS)
        self.traffic: Counter[str] = Counter()
        self.traffic_bytes: Counter[str] = Counter()
        self.traffic_max: Counter[str] = Counter()  # the biggest message of each kind
        self.log: list[tuple[float, str]] = []  # the faults applied, when
        self.on_step: Callable[[SimProcess], None] | None = None  # after each local step of any process
        for i in range(n):
            if i not in late:
                self.start(i, at=0.0)

    # -- the schedule ------------------------------------------------------------------------
    def _push(self, t: float, kind: int, index: int, data: Any) -> None:
        self._seq += 1
        if kind == FAULT:
            self._faults += 1
        heapq.heappush(self.events, (t, self._seq, kind, index, data))

    def at(self, t: float, what: str, action: Callable[[], None]) -> None:
        """Run ``action`` at virtual time ``t`` (logged as ``what``)."""
        self._push(t, FAULT, -1, (what, action))

    def start(self, i: int, *, at: float, resume: bool = False) -> None:
        """Start process ``i`` at ``at``: a late joiner, or a restart of a crashed one
        (``resume``: with ``--resume``, reading its checkpoint directory)."""
        self.at(at, f"start {i}" + (" --resume" if resume else ""), lambda: self._start(i, resume))

    def crash(self, i: int, *, at: float, rank: int | None = None, restart_after: float | None = None) -> None:
        """Process ``i`` dies at ``at`` (SIGKILL: no goodbye); every rank of a group. With
        ``rank``: that rank of group ``i`` dies, which takes the group down, and its launcher
        starts every rank again ``restart_after`` seconds later (default: the cluster's; with
        ``--resume`` as configured)."""
        if rank is None:
            self.at(at, f"crash {i}", lambda: self._crash(i))
            return
        if not 0 <= rank < self.group:
            raise ValueError(f"rank must be in 0..{self.group - 1}, got {rank!r}")
        back = self.restart_after if restart_after is None else float(restart_after)
        if not back > 0:
            raise ValueError(f"restart_after must be > 0 seconds, got {restart_after!r}")
        self.at(at, f"crash {i} rank {rank}", lambda: self._crash(i))
        self.at(at + back, f"launcher restarts {i}", lambda: self._start(i, self.procs[i].cfg.resume))

    def stall(self, i: int, *, at: float, until: float, rank: int | None = None) -> None:
        """Process ``i`` does not run from ``at`` to ``until`` (SIGSTOP, then SIGCONT); every
        rank of a group, or only ``rank`` (whose group then waits for it at its next step)."""
        which = range(self.group) if rank is None else [rank]
        what = f"{i}" if rank is None else f"{i} rank {rank}"
        self.at(at, f"stall {what}", lambda: [self._stall(self.ranks[i][r]) for r in which])
        self.at(until, f"continue {what}", lambda: [self._continue(self.ranks[i][r]) for r in which])

    def stop(self, i: int, *, at: float) -> None:
        """Process ``i`` is asked to stop at ``at`` (SIGTERM: after its current step, with a goodbye)."""
        def act() -> None:
            p = self.procs[i]  # (a group's launcher passes the signal on: rank 0 decides the stop)
            if p.up and p.life is not None:
                p.life.interrupted = True
                p.life.stop.set()
        self.at(at, f"stop {i}", act)

    def partition(self, groups: Sequence[Sequence[int]], *, at: float, until: float | None = None) -> None:
        """From ``at`` (to ``until``, if given) the groups cannot reach each other."""
        ids = [[q.id for i in g for q in self.ranks[i]] for g in groups]
        self.at(at, f"partition {[list(g) for g in groups]}", lambda: self.network.partition(ids))
        if until is not None:
            self.heal(at=until)

    def heal(self, *, at: float) -> None:
        self.at(at, "heal", lambda: self.network.partition(None))

    def cut(self, src: Sequence[int], dst: Sequence[int], *, at: float, until: float) -> None:
        """Messages from any of ``src`` to any of ``dst`` are lost from ``at`` to ``until``;
        the other way they pass (a real node's ``--emulate inter:down=`` drops what it
        sends, from its own start: the two sides of such a cut begin and end apart)."""
        if not until > at:
            raise ValueError(f"cut needs until > at, got at={at!r}, until={until!r}")
        pairs = [(a.id, b.id) for i in src for j in dst if i != j for a in self.ranks[i] for b in self.ranks[j]]
        what = f"{list(src)} -> {list(dst)}"
        self.at(at, f"cut {what}", lambda: self.network.cut(pairs))
        self.at(until, f"uncut {what}", lambda: self.network.cut(pairs, on=False))

    def break_connection(self, i: int, j: int, *, at: float) -> None:
        """From ``at`` what ``i`` sends ``j`` is lost until ``i`` opens a fresh connection to
        ``j`` (its control plane's ``reconnect``, or a new process): a ZeroMQ connection that
        stopped delivering one way while the other way works, as one did in a real churn
        run (benchmarks/RESULTS.md: 61 rounds of ``--timeout`` in a row)."""
        pair = (self.procs[i].id, self.procs[j].id)

        def act() -> None:
            if pair not in self.broken:
                self.broken.add(pair)
                self.network.cut([pair])
        self.at(at, f"break connection {i} -> {j}", act)

    def _reconnect(self, p: SimProcess, peer: str) -> None:
        """``p`` opens a fresh connection to ``peer``: one that had broken delivers again."""
        if (p.id, peer) in self.broken:
            self.broken.discard((p.id, peer))
            self.network.cut([(p.id, peer)], on=False)

    def spike(self, i: int, j: int, *, at: float, until: float, delay: float) -> None:
        """Messages sent between ``i`` and ``j`` (both ways) from ``at`` to ``until`` take
        ``delay`` seconds longer (a congested path: later ones may overtake them)."""
        if not (delay >= 0 and until > at):
            raise ValueError(f"spike needs delay >= 0 and until > at, got delay={delay!r}, at={at!r}, until={until!r}")
        for a in self.ranks[i]:
            for b in self.ranks[j]:
                for pair in ((a.id, b.id), (b.id, a.id)):
                    self.spikes.setdefault(pair, []).append((at, until, delay))

    def clock(self, i: int, *, drift: float = 0.0, offset: float = 0.0) -> None:
        """Process ``i``'s clock runs at ``1 + drift`` times virtual time and reads ``offset``
        at virtual time 0 (set before it starts; a restart runs on the same machine's clock)."""
        if not (-0.5 < drift < 0.5):
            raise ValueError(f"drift must be in (-0.5, 0.5), got {drift!r}")
        if not offset >= 0:
            raise ValueError(f"offset must be >= 0 seconds, got {offset!r}")
        self.procs[i].drift, self.procs[i].offset = float(drift), float(offset)

    # -- processes ---------------------------------------------------------------------------
    def _start(self, i: int, resume: bool) -> None:
        p = self.procs[i]
        if any(q.up for q in self.ranks[i]):
            return
        cfg = p.cfg
        if resume != cfg.resume:
            import dataclasses

            cfg = dataclasses.replace(cfg, resume=resume)
        for q in self.ranks[i]:
            if q.life is not None or q.follow is not None:
                q.lives.append(self._result(q))
            q.epoch += 1
            self._up += 1
            q.up, q.stalled, q.polling, q.primed, q.resume_due = True, False, False, False, False
            q.backlog, q.exit, q.started_at, q.rounds = [], None, self.now, {}
        p.after_finish = self._near_finish(p)
        for pair in [x for x in self.broken if x[0] == p.id]:  # (a new process: new connections)
            self._reconnect(p, pair[1])
        local = p.local
        first = 10**6 + int(local(self.now) * 1e6) + p.epoch  # later processes have later lives, as on a wall clock
        group = None
        if self.group > 1:  # a group's life: its model, its store, its K processes
            group = SimGroup(i, self.group, self.task, self.model_seed,
                             SimLink(self.group, lambda: self.now, lambda r, d, i=i: self._wake_rank(i, r, d)),
                             split=cfg.split)
        p.life = Lifecycle(cfg, task=self.task if group is None else None, device=self.device,
                           fingerprint=self.fingerprint, incarnation=first,
                           send=lambda dst, msg, p=p: self._send(p, dst, msg, False),
                           reconnect=lambda peer, p=p: self._reconnect(p, peer), origin=local(self.now),
                           clock=lambda: local(self.now),
                           new_incarnation=lambda prev, p=p: self._new_life(p, prev),
                           model=None if group is None else ShardModule(group.views[0].flat),
                           secret=f"{p.id}/{first}".encode())
        p.life.audit = True  # record the states handed over and taken (gossip.sim.explore checks them)
        p.life.on_node = lambda node, p=p: self._audit_mixing(p, node)
        if group is None:
            p.program = p.life.program()
        else:
            p.group = group
            p.lead = GroupLead(p.life, self.group, group.link.rank(0), group.views[0].flat)
            p.program = lead_program(p.lead, group, cfg.steps, origin=local(self.now))
            for q in self.ranks[i][1:]:
                r = q.rank
                f = ShardFollower(r, p.id, group.views[r].flat, self.fingerprints[r], mixing=cfg.mixing,
                                  topology=cfg.topology, timeout=cfg.timeout, seed=cfg.seed)
                f.on_node = lambda node, q=q: self._audit_mixing(q, node)
                q.group, q.life = group, None
                q.follow = GroupFollow(f, group.link.rank(r), send=lambda dst, msg, q=q: self._send(q, dst, msg, False),
                                       timeout=cfg.timeout, origin=q.local(self.now))
                q.program = follow_program(q.follow, group, cfg.steps)
        for q in self.ranks[i]:
            self._push(self.now, RESUME, q.index, (q.epoch, q.token))
        self._push(self.now, TICK, i, p.epoch)

    def _near_finish(self, p: SimProcess) -> bool:
        """Whether another process has finished, or trains within a join margin of its end."""
        return any(q.exit == "done" or (q.up and q.life is not None and self._finishing(q))
                   for q in self.procs if q is not p)

    def _new_life(self, p: SimProcess, prev: int) -> int:
        """``p``'s next incarnation (later lives are later on its clock, as on a wall clock).
        A life begun near another's finish may find its cluster finished before its join
        round, as one started then: a join that a false death sent back to discovery, or a
        rejoin, near the end."""
        p.after_finish = p.after_finish or self._near_finish(p)
        return max(10**6 + int(p.local(self.now) * 1e6), prev + 1)

    @staticmethod
    def _finishing(q: SimProcess) -> bool:
        """Whether ``q`` has finished, or trains within a join margin of its last round
        (a join scheduled now would fall after the end)."""
        life = q.life
        assert life is not None
        if life.status == "done":
            return True
        node, cfg = life.node, q.cfg
        return life.status == "training" and node is not None \
            and node.round + life.membership.announce_margin(cfg.timing.join_margin) >= cfg.steps // cfg.mixing.period

    def _crash(self, i: int) -> None:
        for p in self.ranks[i]:  # a group: torchrun ends every rank when one dies
            if p.up:
                self._up -= 1
                p.up, p.exit = False, "crashed"
                p.epoch += 1
                p.program = None

    def _stall(self, p: SimProcess | int) -> None:
        p = self.procs[p] if isinstance(p, int) else p
        if p.up:
            p.stalled = True

    def _continue(self, p: SimProcess | int) -> None:
        p = self.procs[p] if isinstance(p, int) else p
        if not (p.up and p.stalled):
            return
        p.stalled = False
        if p.life is not None:
            p.life.control.apply(p.life.control.tick(p.local(self.now)))  # it runs again: first it sees the gap
        backlog, p.backlog = p.backlog, []
        for sender, frames in backlog:
            self._receive(p, sender, frames)
        if p.rank == 0:
            self._push(self.now, TICK, p.index, p.epoch)
        if p.resume_due:
            p.resume_due = False
            self._wake(p)
        elif p.group is not None and p.rank in p.group.parked:
            self._collective(p.group)  # the group waited for this rank at its next step

    def _exit(self, p: SimProcess, how: str) -> None:
        if how == "done" and p.life is not None:  # Peer.close: a goodbye, so nobody waits for a timeout
            p.life.control.apply(p.life.control.goodbye("done" if not p.life.interrupted else "stopped"))
        self._up -= 1
        p.up, p.exit, p.program = False, how, None
        p.epoch += 1
        if p.group is not None:
            p.group.done.add(p.rank)
            if how != "done":  # a rank failed: torchrun ends the group (no restart for an error)
                for q in self.ranks[p.member]:
                    if q.up:
                        self._exit(q, how)
            else:
                self._collective(p.group)

    # -- groups ------------------------------------------------------------------------------
    def _wake_rank(self, i: int, r: int, delay: float) -> None:
        """Something rank ``r`` of group ``i`` may wait for was written to the group's store;
        readable ``delay`` seconds from now: a rank that polls then is resumed."""
        q = self.ranks[i][r]
        self._push(self.now + delay, LINK, q.index, q.epoch)

    def _park(self, p: SimProcess, what: Any) -> None:
        """Rank ``p`` reached a collective (a step's, or the barrier before the goodbye)."""
        p.group.parked[p.rank] = what
        self._collective(p.group)

    def _collective(self, g: SimGroup) -> None:
        """When every running rank of ``g`` waits in the same collective (none stalled), it
        completes: the group's model steps once, and every rank resumes after the step."""
        ranks = [q for q in self.ranks[g.index] if q.group is g and q.rank not in g.done]
        if not g.parked or any(q.rank not in g.parked or q.stalled or not q.up for q in ranks):
            return
        kinds = set(g.parked.values())
        if len(kinds) > 1:
            raise RuntimeError(f"group {g.index}: ranks wait in different collectives {g.parked}")
        step = kinds.pop() is not BARRIER
        g.parked = {}
        if step:
            g.train_step()
            if self.on_step is not None:
                self.on_step(self.procs[g.index])
        delay = self.step_time(g.index) if step else 0.0
        for q in ranks:
            q.token += 1
            self._push(self.now + delay, RESUME, q.index, (q.epoch, q.token))

    def _audit_mixing(self, p: SimProcess, node: Any) -> None:
        """Check every message a synchronous round of ``node`` takes to mix: it is of
        that round, from the member its index names in the node's member list."""
        for ch in node.channels:
            if not ch.rule.synchronous:
                continue
            take = ch.inbox.take_round

            def audited(src: int, rnd: int, take=take, ch=ch) -> tuple[Message | None, int]:
                msg, stale = take(src, rnd)
                if msg is not None:
                    who = node.members[src] if 0 <= src < len(node.members) else None
                    if msg.round != rnd or msg.sender != who:
                        p.mix_violations.append(f"{p.id} round {rnd}: mixed a message of round {msg.round} "
                                                f"from {msg.sender} as member {src} ({who})")
                return msg, stale

            ch.inbox.take_round = audited

    # -- the network -------------------------------------------------------------------------
    def _send(self, p: SimProcess, dst: Any, msg: Message, droppable: bool) -> None:
        if not p.up or p.stalled:
            return  # a stalled process sends nothing (its I/O thread does not run either)
        frames = [bytes(memoryview(f).cast("B")) for f in wire.encode(msg)]  # on the wire: copies
        self.frames_sent += 1
        size = sum(len(f) for f in frames)
        self.traffic[msg.kind] += 1
        self.traffic_bytes[msg.kind] += size
        if size > self.traffic_max[msg.kind]:
            self.traffic_max[msg.kind] = size
        arrival = self.network.transmit(p.id, dst, size, self.now, droppable=droppable)
        target = self.by_id.get(dst) if isinstance(dst, str) else None
        # (a state request or reply goes the control plane's way, yet is the model's traffic)
        if self.control_loss and not droppable and msg.kind not in NODE_KINDS \
                and self.control_rng.random() < self.control_loss:
            arrival = None
        if arrival is None or target is None:
            self.frames_lost += 1
            return
        if msg.kind == "hello" and not p.after_finish and p.life is not None and p.life.status == "waiting" \
                and target.up and target.life is not None and self._finishing(target):
            # a joiner whose first word to a trainer comes a join margin from the trainer's
            # end (its seeds were dead, say): its join round falls after the end, as for
            # one started then
            p.after_finish = True
        spikes = self.spikes.get((p.id, dst)) if self.spikes else None
        if spikes:
            arrival += sum(d for t0, t1, d in spikes if t0 <= self.now < t1)
        if self.reorder and self.rng.random() < self.reorder:
            arrival += self.rng.uniform(0.0, self.reorder_by)
        self._push(arrival, FRAMES, target.index, (p.id, frames))
        if self.duplicate and self.rng.random() < self.duplicate:
            self._push(arrival + self.rng.uniform(0.0, self.reorder_by), FRAMES, target.index, (p.id, frames))

    def _receive(self, p: SimProcess, sender: str, frames: list[bytes]) -> None:
        if p.life is not None:
            p.life.control.on_frames(sender.encode(), frames)
        elif p.follow is not None:  # a group's rank r > 0: shard traffic only (GroupFollower._on_frames)
            try:
                msg = wire.decode(frames)
            except wire.WireError:
                return
            if msg.sender != sender:
                return
            p.follow.f.handle(msg)
        if p.polling:
            self._wake(p)

    def _wake(self, p: SimProcess) -> None:
        p.token += 1
        p.polling = False
        self._push(self.now, RESUME, p.index, (p.epoch, p.token))

    # -- running -----------------------------------------------------------------------------
    def _advance(self, p: SimProcess) -> None:
        """Run process ``p``'s program until it needs time to pass."""
        program = p.program
        while True:
            try:
                action = program.send(p.local(self.now)) if p.primed else next(program)
                p.primed = True
            except StopIteration:
                self._exit(p, "done")
                return
            except PeerError as e:
                log.warning("%s: %s", p.id, e)
                self._exit(p, f"error: {e}")
                return
            if p.rounds is not None and p.group is not None:
                self._audit_rounds(p)
            kind = type(action)
            if kind is Poll:
                if action.timeout <= 0:
                    continue
                p.polling = True
                p.token += 1
                self._push(self.now + p.span(action.timeout), RESUME, p.index, (p.epoch, p.token))
                return
            if p.group is not None and (kind is Compute or action is BARRIER):
                self._park(p, action)
                return
            if kind is Compute:
                if self.on_step is not None:
                    self.on_step(p)
                    if not p.up or p.program is not program:
                        return
                p.token += 1
                self._push(self.now + self.step_time(p.index), RESUME, p.index, (p.epoch, p.token))
                return
            if kind is Send:
                for dst, msg in action.messages:
                    self._send(p, dst, msg, True)
            elif kind is not Release:
                raise TypeError(f"{p.id} yielded {action!r}")

    def run(self, until: float) -> None:
        """Process events until every process has exited or virtual time ``until``."""
        events = self.events
        while events:
            if events[0][0] > until:
                self.now = until
                return
            t, _, kind, i, data = heapq.heappop(events)
            if kind == FAULT:
                self._faults -= 1
                self.now = t
                what, action = data
                self.log.append((t, what))
                action()
                continue
            p = self.all[i]
            if not p.up:
                continue
            if kind == FRAMES:
                self.now = t
                if p.stalled:
                    p.backlog.append(data)
                else:
                    self._receive(p, *data)
            elif kind == LINK:  # the group's store: what a polling rank waits for may be there
                if data == p.epoch and p.polling and not p.stalled:
                    self.now = t
                    self._wake(p)
            elif kind == TICK:
                if data != p.epoch or p.stalled:
                    continue  # a stalled process ticks again when it runs again
                self.now = t
                assert p.life is not None
                p.life.control.apply(p.life.control.tick(p.local(t)))
                if p.lead is not None:
                    p.lead.publish_alive()  # as a real rank 0 does after each tick
                self._push(t + p.span(p.cfg.timing.tick), TICK, i, p.epoch)
            else:  # RESUME
                epoch, token = data
                if epoch != p.epoch or token != p.token:
                    continue
                self.now = t
                if p.stalled:
                    p.resume_due = True
                    continue
                p.polling = False
                self._advance(p)
            if not self._up and not self._faults:
                return

    # -- outcomes ----------------------------------------------------------------------------
    def _result(self, p: SimProcess) -> dict[str, Any]:
        if p.follow is not None and p.life is None:
            return self._rank_result(p)
        life = p.life
        node = life.node if life is not None else None
        return {"node": p.id, "exit": p.exit if not p.up else None, "status": life.status if life else None,
                "steps": node.step if node else 0, "rounds": node.round if node else 0,
                "members": len(node.members) if node else 0, "member_ids": list(node.members) if node else [],
                "joined": life.joined if life else False, "rejoins": life.rejoins if life else 0,
                "merges": life.merges if life else 0, "state_from": life.state_from if life else None,
                "resumed_from": life.resumed_from if life else None,
                "timed_out_rounds": life.timed_out_rounds if life else 0,
                "skipped_rounds": life.skipped_rounds if life else 0,
                "max_step_gap_s": life.max_step_gap if life else 0.0,
                "start_wait_s": life.start_wait if life else None,
                "neighbor_distance": node.neighbor_distance() if node else float("nan"),
                "params_sha256": node.state.sha256() if node else None,
                "finite": bool(torch.isfinite(node.state.flat).all()) if node else True,
                "rejected": self._rejected(life), "took": life.took if life else None,
                "handed": list(life.handed) if life else [], "rounds_seen": dict(p.rounds)}

    @staticmethod
    def _rejected(life: Lifecycle | None) -> dict[str, int]:
        """Refused messages by reason: the control plane's and the node's checks."""
        if life is None:
            return {}
        out = Counter(life.control.rejected)
        if life.node is not None:
            out.update(life.node.rejected)
        return {k: v for k, v in sorted(out.items()) if v}

    def results(self) -> list[dict[str, Any]]:
        """Each member's outcome (the current or last process at each index; a group's rank 0)."""
        return [self._result(p) for p in self.procs]

    def rank_results(self) -> list[list[dict[str, Any]]]:
        """Each member's outcome by rank (one entry for a single-process member)."""
        return [[self._result(q) for q in ranks] for ranks in self.ranks]

    def _rank_result(self, p: SimProcess) -> dict[str, Any]:
        f = p.follow.f
        node = f.node
        return {"node": p.id, "rank": p.rank, "exit": p.exit if not p.up else None, "status": f.status,
                "steps": node.step if node else 0, "rounds": node.round if node else 0,
                "members": len(node.members) if node else 0, "member_ids": list(node.members) if node else [],
                "timed_out_rounds": f.timed_out_rounds, "skipped_waits": f.skipped_waits,
                "params_sha256": node.state.sha256() if node else None,
                "finite": bool(torch.isfinite(node.state.flat).all()) if node else True,
                "rejected": dict(f.rejected), "took": f.took, "handed": list(f.handed),
                "starts": p.follow.starts, "rounds_seen": dict(p.rounds)}

    def _audit_rounds(self, p: SimProcess) -> None:
        """Record the members rank ``p`` mixes with in its node's current round (as member ids),
        keyed by the starts of its life it took: every rank of a group must agree."""
        if p.lead is not None:
            node, starts = p.life.node, p.lead.starts
        else:
            node, starts = p.follow.f.node, p.follow.starts
        if node is not None and node.waiting is not None and (starts, node.waiting[1]) not in p.rounds:
            p.rounds[(starts, node.waiting[1])] = tuple(group_of(a, p.rank) for a in node.members)
