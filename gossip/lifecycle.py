"""The life of one peer, as a program that a driver advances.

Discovery, a fresh start, a join (the join round, the state pull), training,
a new life after the cluster dropped this node (or after it met a stronger
cluster), and the finish are generators here, like :meth:`gossip.node.Node.program`.
They never sleep, never read a clock and never touch a socket: they yield
what they need and the driver answers with the time of its clock.

``Poll(timeout)``
    "handle what arrives for me (control messages, state messages, state
    requests and replies), then resume me, after at most ``timeout`` seconds".
    A driver may resume it earlier, as soon as something arrived.
``Compute()``, ``Send(messages)``, ``Release(lease, timeout)``
    passed through from the node program (see :mod:`gossip.node`); its
    ``Wait`` becomes ``Poll`` s here (a wait also ends when every neighbour
    still awaited was declared dead, or when this node must start a new life).

The real driver (:class:`gossip.peer.Peer`) answers with ``time.monotonic`` and
a ZeroMQ I/O thread; the simulated one (:mod:`gossip.simcluster`) with a
virtual clock over a simulated network. Messages that arrive for the
training side go to :meth:`Lifecycle.handle`.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Generator

import torch

from gossip.checkpoint import checkpoint_step, latest_checkpoint, load_checkpoint, load_members, save_checkpoint, save_members
from gossip.compression import get_codec
from gossip.control import ControlPlane
from gossip.membership import Membership, out_of_step, parse_address, topology_for
from gossip.message import Message
from gossip.mixing.base import all_finite, decode_payload
from gossip.mixing.settings import build_rules
from gossip.node import Compute, Node, NodeConfig, Wait

__all__ = ["Poll", "Lifecycle", "PeerError", "LATE_ROUNDS"]

log = logging.getLogger("gossip.peer")

LATE_ROUNDS = 3  # synchronous rounds timed out in a row before the node looks for a neighbour out of step
POLL = 0.05  # seconds between looks at the member table while waiting (a driver may wake earlier)


class PeerError(RuntimeError):
    """The node cannot take part (e.g. every peer runs a different model)."""


@dataclass(frozen=True)
class Poll:
    """Handle arriving messages, resume within ``timeout`` seconds."""

    timeout: float


POLL0 = Poll(0.0)
Program = Generator[Any, float, Any]


def _is_address(text: str) -> bool:
    try:
        return parse_address(text) == text
    except ValueError:
        return False


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class Lifecycle:
    """What one peer does, and the state that belongs to it (sans-IO).

    Parameters
    ----------
    cfg : a :class:`gossip.peer.PeerConfig`
    task, device, fingerprint : the node's task (None with a user ``model``), device, model fingerprint
    incarnation : this process's first life
    send : ``send(dst, Message)``: control traffic, never blocks
    reconnect : ``reconnect(peer)``: open a fresh connection towards a member that came back
    new_incarnation : ``new_incarnation(previous) -> int``, larger than ``previous`` (a new life)
    live_sends : whether the driver's transport holds sent tensors until sent (see NodeConfig)
    origin : the driver time the node program counts from
    clock : the driver's clock, which the control plane reads when a message arrives
        (the one the driver answers with; see :class:`~gossip.control.ControlPlane`)
    """

    def __init__(self, cfg: Any, *, task: Any, device: torch.device, fingerprint: str, incarnation: int,
                 send: Callable[[str, Message], None], reconnect: Callable[[str], None],
                 new_incarnation: Callable[[int], int], cap_bytes: int = 0, live_sends: bool = False,
                 origin: float = 0.0, clock: Callable[[], float] | None = None,
                 model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.cfg = cfg
        self.id = cfg.node_id
        self.task, self.device, self.fingerprint = task, device, fingerprint
        self.incarnation = incarnation
        self.origin = origin
        self.live_sends = live_sends
        self.user_model, self.user_optimizer = model, optimizer
        self.send_message = send
        self.new_incarnation = new_incarnation
        self.lock = threading.RLock()  # the member table, shared with the driver's I/O side
        self.stop = threading.Event()  # set by the driver (a signal): end after the current step
        self.membership = Membership(self.id, incarnation, fingerprint, cfg.dc, dead_after=cfg.dead_after,
                                     join_margin=cfg.join_margin)
        self.control = ControlPlane(self.id, incarnation, fingerprint, cfg.dc, self.membership, self.lock, send,
                                    self._to_node, self.progress, heartbeat=cfg.heartbeat,
                                    seeds=tuple(parse_address(p) for p in cfg.peers), reconnect=reconnect,
                                    excluded=self.on_excluded, clock=clock,
                                    detector=getattr(cfg, "detector", "heartbeat"))
        self.to_node: Callable[[Message], None] = self.handle  # the real driver queues them for its thread
        self.status = "waiting"
        self.node: Node | None = None
        self.interrupted = False
        self.joined = False
        self.rejoins = 0  # new lives started after the cluster declared this node dead while it was alive
        self.merges = 0  # of which: joining a stronger cluster met after a partition
        self.excluded: int | None = None  # the leave round the cluster announced for this (live) node
        self.rejoin_via: str | None = None  # the member that announced it (asked first to take us back)
        self.rejoin_cluster: set[str] = set()  # the members of the cluster to join
        self.merging = False  # it is another cluster (met after a partition), not ours
        # the step this node resumes from (--resume), told to the others while it waits: a
        # cluster restarted as a whole starts at the furthest of its members' checkpoints
        ck = latest_checkpoint(cfg.checkpoint_dir) if cfg.resume and cfg.checkpoint_dir else None
        self.resume_step = checkpoint_step(ck) if ck is not None else 0
        self.state_from: str | None = None
        self.state_step = 0  # the step of the member state taken (state_from's)
        self.resumed_from: str | None = None
        self.rank: int | None = None
        self.world_size: int | None = None
        self.train_seconds = 0.0
        self.trained_steps = 0
        self.max_step_gap = 0.0
        self.timed_out_rounds = 0  # synchronous rounds that waited --timeout in vain
        self.late = 0  # of which in a row (reset by a round that completed)
        self.node_rejected: Counter[str] = Counter()
        self.topologies: dict[tuple, Any] = {}
        self.dcs: dict[str, str] = {}  # datacenter label of every member we trained with (bytes by link class)
        self.state_replies: list[Message] = []
        # state messages that arrived before our node existed, with their sender's life then
        self.early: list[tuple[Message, int | None]] = []
        self.incarnations: dict[str, int | None] = {}  # sender -> the life whose sequence numbers we track
        self.on_average: Any = None  # GossipNode's collectives: called with each "average" message
        self.serving = False  # done, but still taking part in rounds for the members that train (GossipNode)
        self.last_step_at: float | None = None
        # with ``audit`` (the simulator's checks): (member, sha256) of every state handed over
        # to a joiner, and (donor, sha256) of the state this life took
        self.audit = False
        self.on_node: Callable[[Node], None] | None = None  # called with each life's node once built
        self.handed: list[tuple[str, str]] = []
        self.took: tuple[str, str] | None = None

    # -- what the control plane asks --------------------------------------------------------
    def progress(self) -> tuple[str, int, int]:
        node = self.node
        return self.status, (node.round if node else 0), (node.step if node else self.resume_step)

    def _to_node(self, msg: Message) -> None:
        self.to_node(msg)

    def on_excluded(self, rnd: int, by: str, cluster: set[str], merge: bool) -> None:
        """The control plane's verdict: this node, alive and training, must join
        ``cluster`` as a new life (the training side sees it after its current step)."""
        if self.excluded is None and not self.stop.is_set() and self.status == "training":
            if merge:
                with self.lock:
                    ours = len(self.membership.eventual())
                log.warning("%s: %s trains in another cluster, of %d members (this node's has %d): the halves "
                            "of a partition that healed, or clusters started apart, met. The larger goes on "
                            "(equal sizes: the one with the smallest id); this node joins it as a new life, "
                            "with a member's state", self.id, by, len(cluster), ours)
            else:
                log.warning("%s: %s announces that this node leaves at round %d: the cluster declared it dead "
                            "while it was alive (silent for more than --dead-after %g s, e.g. a paused "
                            "process); joining again as a new life", self.id, by, rnd, self.cfg.dead_after)
            self.excluded, self.rejoin_via, self.merging = rnd, by, merge
            self.rejoin_cluster = set(cluster)

    # -- the whole life ---------------------------------------------------------------------
    def program(self) -> Program:
        """Discover, start, train (and train again after each new life), finish.
        Returns False if stopped before starting."""
        mode = yield from self.discover()
        if mode is None:
            return False
        yield from self.begin(mode)
        yield from self.train()
        while self.excluded is not None and not self.stop.is_set():
            yield from self.rejoin()
            yield from self.train()
        yield from self.finish()
        return True

    def discover(self) -> Program:
        """Wait until we can start; returns "fresh", "member" or "join" (None if stopped)."""
        cfg = self.cfg
        start = yield POLL0
        seeds = [parse_address(p) for p in cfg.peers]
        self.control.hello_all([s for s in seeds if s != self.id])
        # a restarted process also asks the members it last trained with: its seeds may be
        # restarting too while the cluster trains on elsewhere (they hold no start back)
        former = [m for m in load_members(cfg.checkpoint_dir) if m != self.id and m not in seeds
                  and _is_address(m)] if cfg.resume and cfg.checkpoint_dir else []
        warned = False
        last_note = asked = last_former = start
        self.control.hello_all(former)
        while not self.stop.is_set():
            now = yield Poll(POLL)
            if former and now - last_former >= max(1.0, 2 * cfg.heartbeat) and now - start < cfg.join_timeout:
                last_former = now
                with self.lock:
                    unheard = [m for m in former if m not in self.membership.members]
                self.control.hello_all(unheard)
            with self.lock:
                others = self.membership.others()
                running = [m for m in others if self.membership.members[m].status in ("training", "done")]
                base_known = self.membership.started
                in_base = self.id in self.membership.base
            if running:
                if base_known:
                    return "member" if in_base else "join"
                if now - asked >= cfg.heartbeat:
                    # a ping said "training" before the start announcement (with the starting
                    # member set) got here, e.g. over a slower link: ask for the member set
                    asked = now
                    self.control.hello_all(running[:1])
                continue
            if others:
                # a seed that never answers stops holding the start back after join_timeout
                ok, why = self.control.settled(now, cfg.settle, seeds=now - start < cfg.join_timeout)
                if ok:
                    return "fresh"
                if now - last_note >= 2.0:
                    last_note = now
                    log.info("%s: waiting to start with %d member(s): %s", self.id, len(others) + 1, why)
            if not others and seeds and now - last_note >= 2.0:
                last_note = now  # a lone node says what it waits for, not only when join_timeout ends
                log.info("%s: no peer has answered yet (%s); training alone in %.0f s (join_timeout) if "
                         "none does", self.id, ", ".join(seeds), max(0.0, cfg.join_timeout - (now - start)))
            if not others and not seeds and now - start >= cfg.settle:
                return "fresh"  # nobody to wait for: the first node of a cluster
            if not others and now - start >= cfg.join_timeout:
                if self.control.conflicts:
                    raise PeerError("; ".join(sorted(set(self.control.conflicts.values()))))
                log.warning("%s: no peer answered within %.0f s; training alone (late peers will join)",
                            self.id, cfg.join_timeout)
                return "fresh"
            if not others and self.control.conflicts and not warned:
                warned = True
                log.error("%s: %s", self.id, "; ".join(sorted(set(self.control.conflicts.values()))))
        return None

    def begin(self, mode: str) -> Program:
        """Build the node and start training: ``fresh`` (a new cluster of the members
        known now), ``member`` (one of a running cluster's starters), ``join`` (a
        running cluster schedules us), or ``alone`` (a cluster of this node only)."""
        cfg = self.cfg
        with self.lock:
            if mode in ("fresh", "alone"):
                self.membership.start(self.membership.ids() if mode == "fresh" else [self.id])
        start_round = 0
        if mode == "join":
            start_round = yield from self.await_join_round()
        with self.lock:
            members = self.membership.at_round(start_round)
            if self.id not in members:
                members = sorted([*members, self.id], key=self.membership.order_key)
        rank, world = (cfg.rank, cfg.world_size) if cfg.world_size is not None else (members.index(self.id),
                                                                                     len(members))
        topology = self.topology_for(members)
        rule, policies = build_rules(cfg.mixing, topology)  # checked on this graph, on every link class
        node_cfg = NodeConfig(cfg.steps, cfg.mixing.period, float(cfg.timeout), check_payloads=True,
                              overlap=cfg.mixing.overlap, live_sends=self.live_sends)
        self.rank, self.world_size = rank, world
        self.late = 0  # timeouts of an earlier life say nothing about this one's neighbours
        self.node = Node(self.id, members, topology, self.task, rule, node_cfg, seed=cfg.seed,
                         split=cfg.split, rank=rank, world_size=world, device=self.device, model=self.user_model,
                         optimizer=self.user_optimizer, policies=policies)
        if self.on_node is not None:
            self.on_node(self.node)
        if mode == "join":
            self.joined = True
            yield from self.pull_state(start_round)
        if cfg.resume and not self.rejoins:  # a new life takes the cluster's state, not its own past
            self.resume()
        if cfg.resume and mode in ("fresh", "member"):
            self.align_start(mode)
        self.status = "training"
        with self.lock:
            self.membership.training = True
            self.membership.target.clear()
        if mode == "fresh":
            # tell everyone whom we started with: a member that has not noticed the
            # settle yet then starts as one of us instead of asking to join
            self.control.broadcast(self.control._members_message())
        early, self.early = self.early, []
        for msg, inc in early:
            # a member that started a new life since (after a partition, say) numbers its
            # messages afresh: one from its old life would make the new life's look replayed
            if inc == self.incarnation_of(msg.sender):
                self.handle(msg)
        log.info("%s: training as %d of %d (%s start, round %d, step %d)", self.id, rank, world, mode,
                 self.node.round, self.node.step)

    def rejoin(self) -> Program:
        """Start a new life and join the running cluster again (or the stronger
        cluster met after a partition), as a restarted process would: a new
        incarnation, a join round the members announce, and a neighbour's state
        (this node's own drifted while it was out). If no member of that cluster
        schedules the join within ``join_timeout``, it trains on alone instead."""
        now = yield POLL0
        self.excluded = None
        self.rejoins += 1
        self.merges += self.merging
        with self.lock:
            self.incarnation = self.new_incarnation(self.incarnation)
            self.control.new_life(self.incarnation)
            self.membership.new_life(self.incarnation, target=self.rejoin_cluster, now=now)
            self.status = "waiting"
            prior, self.node = self.node, None
            self.state_replies.clear()
        try:
            yield from self.begin("join")
        except PeerError as e:
            if prior is None or self.stop.is_set():
                raise
            # cut off from the cluster it joins (a partition that formed again, say): train on
            # from where this node was, as a cluster of its own; when the two meet again, the
            # larger goes on (see ControlPlane) and this node joins it then
            log.warning("%s: %s; training alone from step %d until it meets a cluster again", self.id, e,
                        prior.step)
            state = prior.state_dict()
            yield from self.begin("alone")
            node = self.node
            assert node is not None
            node.adopt(state["flat"].to(self.device))
            node.jump_to(state["step"])
            if node.optimizer is not None and state["optimizer"] is not None:
                node.optimizer.load_state_dict(state["optimizer"])

    def await_join_round(self) -> Program:
        """The round the cluster scheduled for us (it answers our hello with it)."""
        now = yield POLL0
        deadline = now + max(self.cfg.join_timeout, 5 * self.cfg.heartbeat)
        while now < deadline and not self.stop.is_set():
            with self.lock:
                m = self.membership
                if self.id in m.joins:
                    return m.joins[self.id]
                others = m.others()
                if m.target:  # joining another cluster: ask only its members
                    others = [o for o in others if o in m.target]
                # only a training member schedules a join: when all have finished (or said
                # goodbye), nobody will, and waiting --join-timeout would only idle. Only what
                # they said in this life counts (see Membership.finished)
                if m.finished(m.target or others):
                    raise PeerError("every member of the cluster it joins has finished training ("
                                    + ", ".join(sorted(m.target or others)) + ")")
            if self.rejoin_via is not None:  # the member that dropped us knows the running cluster
                others = [self.rejoin_via, *(o for o in others if o != self.rejoin_via)]
            self.control.hello_all(others[:3])
            end = now + self.cfg.heartbeat
            while now < end and self.id not in self.membership.joins:
                now = yield Poll(end - now)
        raise PeerError("the running cluster did not schedule our join (no answer to hello)")

    def pull_state(self, start_round: int) -> Program:
        """Wait until the cluster reaches our first round, then copy a member's state."""
        node, cfg = self.node, self.cfg
        assert node is not None
        while not self.stop.is_set():
            with self.lock:  # the members we train with (after a partition, others may count other rounds)
                rounds = [m.round for k, m in self.membership.members.items() if k != self.id and k in node.members]
            if not rounds or max(rounds) >= start_round - 1:
                break
            yield Poll(cfg.heartbeat / 2)
        for attempt in range(6):
            donors = [j for j in node.topology.in_weights(node.index, start_round) if j != node.index]
            candidates = [node.members[j] for j in donors] or [m for m in node.members if m != self.id]
            if not candidates:
                break
            donor = candidates[attempt % len(candidates)]
            self.send_message(donor, Message("state-request", self.id, start_round, 0, 0, None, None,
                                             {"inc": self.incarnation}, self.fingerprint))
            now = yield POLL0
            deadline = now + max(2.0, cfg.timeout)
            while now < deadline and not self.state_replies:
                now = yield Poll(min(POLL, deadline - now))
            for reply in self.state_replies:
                if reply.sender == donor and reply.data is not None \
                        and reply.data.numel == node.handover_numel(reply.extra):
                    values = decode_payload(reply, node.state.flat)
                    if all_finite(values):
                        node.adopt_handover(values, reply.extra)  # parameters, and any outer momentum
                        if self.audit:
                            self.took = (donor, _sha(node.state.flat))
                        # a joiner that fell behind (slow start, a busy machine) starts at the
                        # donor's round: the cluster went on without it, and its members drop
                        # messages of rounds they have finished
                        start_round = max(start_round, reply.round)
                        node.jump_to(start_round * cfg.period)
                        if reply.weight is not None and hasattr(node.rule, "weight"):
                            node.rule.weight = 1.0  # a newcomer brings its own unit of push-sum mass
                        self.state_from, self.state_step = donor, reply.progress
                        log.info("%s: took the state of %s (its step %d); joining at round %d", self.id, donor,
                                 reply.progress, start_round)
                        self.state_replies.clear()
                        return
            self.state_replies.clear()
            log.warning("%s: no state from %s yet; asking another member", self.id, donor)
        node.jump_to(start_round * cfg.period)
        log.warning("%s: no member sent its state; joining with a fresh model", self.id)

    def align_start(self, mode: str) -> None:
        """With --resume, start where the starters are: a cluster restarted as a whole
        (each member from its own checkpoint, of different steps) at the furthest step
        any of them reported while waiting; a starter that noticed the start late at
        the earliest step the others train at (they wait for it in their round).
        Synchronous rounds need every member in the same round. (Without --resume
        everyone starts at step 0 and a late starter's neighbours wait for it there.)"""
        node = self.node
        assert node is not None
        with self.lock:
            steps = [m.step for k, m in self.membership.members.items() if k in node.members and k != self.id
                     and (mode == "fresh" or m.status == "training")]
        if not steps:
            return
        step = max([node.step, *steps]) if mode == "fresh" else min(steps)
        if step != node.step:
            log.info("%s: starting at step %d with the other starters (this node was at step %d)", self.id, step,
                     node.step)
            node.jump_to(step)

    def resume(self) -> None:
        """``--resume``: continue from the newest checkpoint. A node that joined a running
        cluster keeps the cluster's round and step whatever the checkpoint says (its
        members wait for this node's messages of their rounds, not of the checkpoint's);
        it takes the checkpoint's parameters and optimizer state only when no member
        sent a state, or the member's is older."""
        node, cfg = self.node, self.cfg
        assert node is not None and cfg.checkpoint_dir
        path = latest_checkpoint(cfg.checkpoint_dir)
        if path is None:
            log.info("%s: --resume: no checkpoint in %s, starting fresh", self.id, cfg.checkpoint_dir)
            return
        state = load_checkpoint(path)
        if state.get("fingerprint") != node.fingerprint:
            raise ValueError(f"checkpoint {path} is for model fingerprint {state.get('fingerprint')!r}, "
                             f"this node's model is {node.fingerprint!r}")
        if not self.joined:
            node.load_state_dict(state)
            self.resumed_from = str(path)
            log.info("%s: resumed from %s at step %d", self.id, path, node.step)
            return
        if self.state_from is not None and int(state["step"]) <= self.state_step:
            log.info("%s: the member state (step %d) is newer than checkpoint %s (step %d); keeping it",
                     self.id, self.state_step, path.name, state["step"])
            return
        node.adopt(state["flat"].to(self.device))
        if node.optimizer is not None and state.get("optimizer") is not None:
            node.optimizer.load_state_dict(state["optimizer"])
        self.resumed_from = str(path)
        log.info("%s: took the parameters of checkpoint %s (step %d, %s); training in the cluster's round %d",
                 self.id, path.name, state["step"], "no member state" if self.state_from is None else
                 f"the member state was of step {self.state_step}", node.round)

    # -- training ---------------------------------------------------------------------------
    def topology_for(self, members: list[str]) -> Any:
        key = tuple(members)
        topo = self.topologies.get(key)
        if topo is None:
            with self.lock:
                dcs = [self.membership.members[m].dc if m in self.membership.members else self.cfg.dc
                       for m in members]
                self.dcs.update(zip(members, dcs))
            # every member derives the same graph from the same ordered list (and labels)
            topo = topology_for(self.cfg.topology, len(members), seed=self.cfg.seed,
                                dcs=dcs if any(dcs) else None)
            self.topologies = {key: topo}  # only the current one is needed
        return topo

    def apply_members(self) -> None:
        """Adopt the member list of the node's round (changes take effect between rounds)."""
        node = self.node
        assert node is not None
        with self.lock:
            members = self.membership.at_round(node.round)
        if self.id not in members:
            members = sorted([*members, self.id], key=self.membership.order_key)
        if members != node.members:
            log.info("%s: round %d: %d members", self.id, node.round, len(members))
            node.set_members(members, self.topology_for(members))

    def train(self) -> Program:
        """Run the task's training program to the end, until stopped, or until this
        node must start a new life."""
        node = self.node
        assert node is not None and node.stream is not None, "train() needs a task; use step() for your own loop"
        first_step = node.step
        t_start = self.last_step_at = yield POLL0
        yield from self.drive(node.program(), self._after_step)
        t_end = yield POLL0
        self.train_seconds += t_end - t_start
        self.trained_steps += node.step - first_step
        if self.cfg.checkpoint_dir and self.excluded is None:  # not the state of a life the cluster dropped
            self.save_checkpoint()

    def save_checkpoint(self) -> None:
        node = self.node
        assert node is not None
        save_checkpoint(node.state_dict(), self.cfg.checkpoint_dir, node.step)
        save_members(self.cfg.checkpoint_dir, [m for m in node.members if m != self.id])

    def _after_step(self, now: float) -> bool:
        node = self.node
        assert node is not None
        if self.last_step_at is not None:
            self.max_step_gap = max(self.max_step_gap, now - self.last_step_at)  # the longest stall
        self.last_step_at = now
        if self.cfg.checkpoint_dir and self.cfg.checkpoint_every and node.step % self.cfg.checkpoint_every == 0:
            self.save_checkpoint()
        if self.stop.is_set():
            log.warning("%s: stopping at step %d on request", self.id, node.step)
            return False
        return self.excluded is None

    def exchange(self, ch: Any) -> Program:
        """One round on channel ``ch`` of a training loop of the caller's own."""
        yield from self.drive(self.node.exchange(ch))  # type: ignore[union-attr]

    def drive(self, program: Any, after_step: Callable[[float], bool] | None = None) -> Program:
        """Advance a node program: its ``Wait`` becomes polls (see :meth:`wait`); after
        each ``Compute``, ``after_step(now)`` says whether to go on."""
        node = self.node
        assert node is not None
        try:
            action = next(program)
        except StopIteration:
            return
        while True:
            kind = type(action)
            if kind is Wait:
                now = yield from self.wait(action.timeout)
            else:
                now = yield action
                if kind is Compute:
                    if after_step is not None and not after_step(now):
                        return
                    if any(node.step % ch.period == 0 for ch in node.channels):
                        self.apply_members()  # membership changes take effect between rounds
            del action  # nothing here may keep a sent message alive (see NodeConfig.live_sends)
            try:
                action = program.send(now - self.origin)
            except StopIteration:
                return

    def wait(self, timeout: float) -> Program:
        """Poll for the round's messages until ready, timeout, or every neighbour still
        awaited was declared dead. Returns the time it ends."""
        node = self.node
        assert node is not None
        now = yield POLL0
        deadline = now + timeout
        while not node.ready():
            remaining = deadline - now
            if remaining <= 0:
                self.timed_out_rounds += 1
                self.late += 1
                awaited = node.awaited()
                log.info("%s: round %d timed out waiting for neighbours (%s)", self.id, node.round,
                         ", ".join(map(str, awaited)))
                if self.late >= LATE_ROUNDS:
                    self.out_of_step(awaited)
                return now
            if self.stop.is_set() or self.excluded is not None:
                return now
            with self.lock:
                alive = self.membership.members
                if all(e not in alive for e in node.awaited()):
                    return now  # mix without the dead; a live neighbour's message is worth its wait
            now = yield Poll(min(remaining, POLL))
        self.late = 0
        return now

    def out_of_step(self, awaited: list[str]) -> None:
        """Rounds keep timing out while the neighbours waited for are alive: say so, and
        act on what their pings report. A neighbour far behind this node's round trains
        in a world of its own (it counts rounds that this cluster finished long ago):
        drop it, as a death, so that it learns it and joins again as a new life. When
        this node is the one far behind, it starts a new life itself."""
        node = self.node
        assert node is not None
        margin = self.membership.join_margin + self.membership.leave_margin
        with self.lock:
            alive = {j: (m.status, m.round) for j in awaited if (m := self.membership.members.get(j)) is not None}
            cluster = self.membership.eventual()
        if self.late == LATE_ROUNDS or self.late & (self.late - 1) == 0:  # 3, 4, 8, 16 ...: not every round
            log.warning("%s: %d synchronous rounds in a row timed out waiting for %s (alive: %s); this node is at "
                        "round %d", self.id, self.late, ", ".join(awaited) or "nobody",
                        ", ".join(f"{j} {st} at round {r}" for j, (st, r) in sorted(alive.items())) or "none",
                        node.round)
        behind, ahead = out_of_step(node.round, alive, margin)
        for j in behind:
            self.control.drop(j, f"out of step: it trains in round {alive[j][1]}, this cluster in round "
                                 f"{node.round}")
        if ahead is not None and self.excluded is None:
            log.warning("%s: %s trains in round %d, far ahead of this node's round %d: this node is out of step "
                        "with its cluster; joining again as a new life", self.id, ahead, alive[ahead][1], node.round)
            self.excluded, self.rejoin_via, self.merging = alive[ahead][1], ahead, False
            self.rejoin_cluster = set(cluster) - {self.id}
            return
        self.control.hello_all(sorted(alive))  # their member lists, in case ours and theirs differ

    def finish(self) -> Program:
        """Keep serving until every other member is done (or gone), or ``grace`` passes."""
        self.status = "done"
        if self.interrupted:
            return
        now = yield POLL0
        end = now + self.cfg.grace
        while now < end and not self.stop.is_set():
            with self.lock:
                busy = [m for k, m in self.membership.members.items() if k != self.id and m.status != "done"]
            if not busy:
                return
            now = yield Poll(min(POLL, end - now))

    # -- messages for the training side -----------------------------------------------------
    def handle(self, msg: Message) -> None:
        """A state message, state request or reply, or collective, from a member."""
        node = self.node
        if msg.kind == "state":
            if node is None:
                # neighbours that started a moment earlier already sent round 0: keep it
                if len(self.early) < 1024:
                    self.early.append((msg, self.incarnation_of(msg.sender)))
                return
            if self.status == "done" and not self.serving:
                return  # finished: nothing to mix into
            self.note_incarnation(msg.sender)
            if not node.deliver(msg):
                self.node_rejected_from(msg)
        elif msg.kind == "state-request":
            if node is None or self.status == "waiting":
                return
            snap, extra = node.handover()  # the parameters, and any outer optimizer's momentum
            if self.audit:
                self.handed.append((str(msg.sender), _sha(node.state.flat)))
            weight = getattr(node.rule, "weight", None)
            reply = Message("state-reply", self.id, node.round, node.step, 0, get_codec("none").encode(snap.cpu()),
                            weight, {"inc": self.incarnation, **extra}, self.fingerprint)
            self.send_message(msg.sender, reply)
        elif msg.kind == "average":  # a collective of a training loop of the user's own (GossipNode)
            if self.on_average is not None:
                self.on_average(msg)
        elif msg.kind == "state-reply":
            # wanted only while a joiner pulls a state, and a few at most: each holds a whole model
            if node is not None and self.status == "waiting" and msg.fingerprint == self.fingerprint \
                    and len(self.state_replies) < 8:
                self.state_replies.append(msg)
            else:
                self.control.reject(str(msg.sender), "unsolicited", "a state-reply nobody asked for")

    def incarnation_of(self, sender: str) -> int | None:
        with self.lock:
            member = self.membership.members.get(sender)
        return member.incarnation if member is not None else None

    def note_incarnation(self, sender: str) -> None:
        """A member that restarted (new incarnation) numbers its messages afresh."""
        inc = self.incarnation_of(sender)
        if self.incarnations.get(sender, inc) != inc and self.node is not None:
            self.node.forget_sender(sender)
        self.incarnations[sender] = inc

    def node_rejected_from(self, msg: Message) -> None:
        node = self.node
        assert node is not None
        for reason, n in node.rejected.items():
            if n > self.node_rejected[reason]:
                self.node_rejected[reason] = n
                self.control.reject(str(msg.sender), reason, count=False)  # counted by the node already
