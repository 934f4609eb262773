"""The life of one peer, as a program that a driver advances.

Discovery, a fresh start, a join (the join round, the state pull), training,
a new life after the cluster dropped this node (or after it met a stronger
cluster), and the finish are generators here, like :meth:`gossip.training.node.Node.program`.
They never sleep, never read a clock and never touch a socket: they yield
what they need and the driver answers with the time of its clock.

``Poll(timeout)``
    "handle what arrives for me (control messages, state messages, state
    requests and replies), then resume me, after at most ``timeout`` seconds".
    A driver may resume it earlier, as soon as something arrived.
``Compute()``, ``Send(messages)``, ``Release(lease, timeout)``
    passed through from the node program (see :mod:`gossip.training.node`); its
    ``Wait`` becomes ``Poll`` s here (a wait also ends when every neighbour
    still awaited was declared dead, or when this node must start a new life).

The real driver (:class:`gossip.peer.driver.Peer`) answers with ``time.monotonic`` and
a ZeroMQ I/O thread; the simulated one (:mod:`gossip.sim.cluster`) with a
virtual clock over a simulated network. Messages that arrive for the
training side go to :meth:`Lifecycle.handle`.

Parts, each owning its state: :class:`Lifecycle` (status, the node, new lives,
the training loop), :class:`~gossip.protocol.joining.Joining` (the join round, the
state pull, ``--resume``), :class:`~gossip.protocol.control.ControlPlane` (member lists,
with its failure detector) over the :class:`~gossip.protocol.membership.Membership` table.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any, Callable

import torch

from gossip.compression import get_codec
from gossip.core.actions import POLL0, Compute, Poll, Program, Wait
from gossip.core.checkpoint import (
    checkpoint_step,
    latest_checkpoint,
    load_members,
    save_checkpoint,
    save_members,
)
from gossip.core.message import Message
from gossip.core.state import sha256_of
from gossip.mixing.settings import build_rules
from gossip.protocol.config import PeerConfig
from gossip.protocol.control import ControlPlane
from gossip.protocol.errors import PeerError
from gossip.protocol.joining import ClusterGone, Joining
from gossip.protocol.membership import RUNNING, Membership, out_of_step, topology_for
from gossip.training.node import Node, NodeConfig
from gossip.transport.addresses import parse_address

__all__ = ["Lifecycle", "LATE_ROUNDS"]

log = logging.getLogger("gossip.peer")

LATE_ROUNDS = 3  # synchronous rounds timed out in a row before the node looks for a neighbour out of step
AHEAD = 4  # state messages held for a member list not adopted yet (see Lifecycle.ahead)
SILENT_GAPS = 4  # a suspect silent for this many of its usual gaps between state messages is not waited for
POLL = 0.05  # seconds between looks at the member table while waiting (a driver may wake earlier)


def _is_address(text: str) -> bool:
    try:
        return parse_address(text) == text
    except ValueError:
        return False


class Lifecycle:
    """What one peer does, and the state that belongs to it (sans-IO).

    Parameters
    ----------
    cfg : the peer's settings
    task, device, fingerprint : the node's task (None with a user ``model``), device, model fingerprint
    incarnation : this process's first life
    send : ``send(dst, Message)``: control traffic, never blocks
    reconnect : ``reconnect(peer)``: open a fresh connection towards a member that came back
    new_incarnation : ``new_incarnation(previous) -> int``, larger than ``previous`` (a new life)
    live_sends : whether the driver's transport holds sent tensors until sent (see NodeConfig)
    origin : the driver time the node program counts from
    clock : the driver's clock, which the control plane reads when a message arrives
        (the one the driver answers with; see :class:`~gossip.protocol.control.ControlPlane`)
    secret : the key of the control plane's tokens (default: random; a simulated peer's is
        its own, so that a run replays exactly)
    """

    def __init__(self, cfg: PeerConfig, *, task: Any, device: torch.device, fingerprint: str, incarnation: int,
                 send: Callable[[str, Message], None], reconnect: Callable[[str], None],
                 new_incarnation: Callable[[int], int], live_sends: bool = False,
                 origin: float = 0.0, clock: Callable[[], float] | None = None,
                 model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, secret: bytes | None = None) -> None:
        self.cfg = cfg
        self.id = cfg.node_id
        self.task, self.device, self.fingerprint = task, device, fingerprint
        self.incarnation = incarnation
        self.origin = origin
        self.live_sends = live_sends
        self.user_model, self.user_optimizer = model, optimizer
        # the run ends after cfg.steps local steps (a task's, a group's), so a join past the end
        # holds the final state; a training loop of the user's own (GossipNode) has no budget
        self.step_budget = model is None
        self.send_message = send
        self.new_incarnation = new_incarnation
        self.lock = threading.RLock()  # the member table, shared with the driver's I/O side
        self.stop = threading.Event()  # set by the driver (a signal): end after the current step
        self.membership = Membership(self.id, incarnation, fingerprint, cfg.dc, timing=cfg.timing)
        self.control = ControlPlane(self.id, incarnation, fingerprint, cfg.dc, self.membership, self.lock, send,
                                    self._to_node, self.progress, timing=cfg.timing,
                                    seeds=tuple(parse_address(p) for p in cfg.peers), reconnect=reconnect,
                                    excluded=self.on_excluded, clock=clock,
                                    detector=cfg.detector, secret=secret)
        self.to_node: Callable[[Message], None] = self.handle  # the real driver queues them for its thread
        self.status = "waiting"
        self.node: Node | None = None
        self.interrupted = False
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
        self.rank: int | None = None
        self.world_size: int | None = None
        self.train_seconds = 0.0
        self.trained_steps = 0
        self.max_step_gap = 0.0
        self.timed_out_rounds = 0  # synchronous rounds that waited --timeout in vain
        self.skipped_rounds = 0  # synchronous rounds that went on without a suspected neighbour (see gone)
        self.late = 0  # of which in a row (reset by a round that completed)
        self.beyond: set[str] = set()  # neighbours whose messages of the awaited rounds cannot come (see _beyond)
        self.node_rejected: Counter[str] = Counter()
        self.topologies: dict[tuple, Any] = {}
        self.dcs: dict[str, str] = {}  # datacenter label of every member we trained with (bytes by link class)
        # state messages that arrived before our node existed, with their sender's life then
        self.early: list[tuple[Message, int | None]] = []
        # state messages of this or the next round from a live node not (yet) in the node's
        # member list: a joiner's first round can arrive before this node adopts the list
        # that has it (see apply_members); a few at most, each holds a model
        self.ahead: list[Message] = []
        self.incarnations: dict[str, int | None] = {}  # sender -> the life whose sequence numbers we track
        self.on_average: Any = None  # GossipNode's collectives: called with each "average" message
        self.serving = False  # done, but still taking part in rounds for the members that train (GossipNode)
        self.last_step_at: float | None = None
        # driver times: when this process began to look for its peers, and when it first trained
        self.looked_at: float | None = None
        self.trained_at: float | None = None
        # with ``audit`` (the simulator's checks): (member, sha256) of every state handed over
        # to a joiner, and (donor, sha256) of the state this life took
        self.audit = False
        self.handed: list[tuple[str, str]] = []
        self.on_node: Callable[[Node], None] | None = None  # called with each life's node once built
        # a group of several ranks (gossip.protocol.group): a joiner's state request waits for the
        # group's next exchange, where every rank hands its shard over at once (take_handovers)
        self.group_size = 1
        self.handovers: list[str] = []
        # a group's rank 0 may hand over at once instead (gossip.peer.group): called with the joiner
        self.on_state_request: Callable[[str], None] | None = None
        self.handover_limit: int | None = None  # bytes a state reply may take (the peers' size cap)
        # a training loop of the user's own hands a joiner its state between two of its steps,
        # where the optimizer, the schedulers and the data position agree (see answer_requests);
        # until then the requests wait here (the state-request messages)
        self.defer_requests = False
        self.requests: list[Message] = []
        self.prepared: tuple | None = None  # (round, step, payload, extra, note) kept for that round's joiners
        self.joining = Joining(self)  # joins: the round, the state pulled, --resume

    # the join's outcome, as the reports read it
    joined = property(lambda self: self.joining.joined)
    state_from = property(lambda self: self.joining.state_from)
    resumed_from = property(lambda self: self.joining.resumed_from)
    took = property(lambda self: self.joining.took)

    # -- what the control plane asks --------------------------------------------------------
    @property
    def start_wait(self) -> float | None:
        """Seconds from this process's first hello to its first training step (None: it never trained)."""
        return None if self.trained_at is None or self.looked_at is None else self.trained_at - self.looked_at

    def progress(self) -> tuple[str, int, int]:
        node = self.node
        return self.status, (node.round if node else 0), (node.step if node else self.resume_step)

    def _to_node(self, msg: Message) -> None:
        self.to_node(msg)

    def on_excluded(self, rnd: int, by: str, cluster: set[str], merge: bool) -> None:
        """The control plane's verdict: this node, alive and training, must join
        ``cluster`` as a new life (the training side sees it after its current step).
        Checked and set under the lock: :meth:`rejoin` ends the life under it too, so a
        second verdict on the life that ends (two members of the other cluster, heard
        a moment apart) finds it ended, not a fresh life to end again."""
        with self.lock:
            if self.excluded is not None or self.stop.is_set() or self.status != "training":
                return
            if merge:
                ours = len(self.membership.eventual())
                # (``cluster``: the members of the other that this node's does not count; the
                # other's own view may still count some of ours, so it may be the larger with fewer)
                log.warning("%s: %s trains in another cluster, which counts %d members that this node's (of %d) "
                            "does not: the halves of a partition that healed, or clusters started apart, met. "
                            "The larger goes on (equal sizes: the one with the smallest id), here the other; "
                            "this node joins it as a new life, with a member's state", self.id, by, len(cluster), ours)
            else:
                log.warning("%s: %s announces that this node leaves at round %d: the cluster declared it dead "
                            "while it was alive (silent for more than --dead-after %g s, e.g. a paused "
                            "process); joining again as a new life", self.id, by, rnd, self.cfg.timing.dead_after)
            self.excluded, self.rejoin_via, self.merging = rnd, by, merge
            self.rejoin_cluster = set(cluster)

    # -- the whole life ---------------------------------------------------------------------
    def program(self) -> Program:
        """Discover, start, train (and train again after each new life), finish.
        Returns False if stopped before starting."""
        if not (yield from self.start()):
            return False
        yield from self.train()
        while self.excluded is not None and not self.stop.is_set():
            yield from self.rejoin()
            yield from self.train()
        yield from self.finish()
        return True

    def start(self) -> Program:
        """Discover and begin training (a fresh cluster, or a join); returns False if
        stopped first. Raises :class:`~gossip.protocol.joining.ClusterFinished` when the
        cluster it would join has finished training."""
        mode = yield from self.discover()
        if mode is None:
            return False
        while True:
            try:
                yield from self.begin(mode)
                return True
            except ClusterGone as e:
                # the cluster it waited to join is gone (every member that trained died or
                # restarted): its schedule describes nothing now; discover afresh, as a new life
                log.warning("%s: %s; looking for a cluster again", self.id, e)
                yield from self.start_over()
                mode = yield from self.discover()
                if mode is None:
                    return False

    def discover(self) -> Program:
        """Wait until we can start; returns "fresh", "member" or "join" (None if stopped)."""
        cfg = self.cfg
        start = yield POLL0
        self.looked_at = start if self.looked_at is None else self.looked_at
        seeds = [parse_address(p) for p in cfg.peers]
        self.control.apply(self.control.hello_all([s for s in seeds if s != self.id]))
        # a restarted process also asks the members it last trained with: its seeds may be
        # restarting too while the cluster trains on elsewhere (they hold no start back)
        former = [m for m in load_members(cfg.checkpoint_dir) if m != self.id and m not in seeds
                  and _is_address(m)] if cfg.resume and cfg.checkpoint_dir else []
        warned = False
        refused_at: float | None = None  # when every seed had refused this node
        last_note = asked = last_former = start
        seen: tuple[int, int] | None = None  # the (version, running_changes) ``running`` is of
        running: list[str] = []  # the other members that train or finished
        self.control.apply(self.control.hello_all(former))
        while not self.stop.is_set():
            now = yield Poll(POLL)
            if former and now - last_former >= max(1.0, 2 * cfg.timing.heartbeat) and now - start < cfg.timing.join_timeout:
                last_former = now
                with self.lock:
                    unheard = [m for m in former if m not in self.membership.members]
                self.control.apply(self.control.hello_all(unheard))
            with self.lock:
                # (looked for again only when the table or a status changed: a simulator
                # wakes this loop on every message, and a cluster of thousands sends many)
                others = len(self.membership.members) - 1
                key = (self.membership.version, self.membership.running_changes)
                if seen is None or key[1] != seen[1]:  # a member began or stopped training: look at all
                    running = [m for m in self.membership.others() if self.membership.members[m].status in RUNNING]
                elif key != seen:  # members came or went (a new record has no status yet, and the
                    # status it takes counts as a change): the ones still there
                    running = [m for m in running if (r := self.membership.members.get(m)) is not None
                               and r.status in RUNNING]
                seen = key
                base_known = self.membership.started
                in_base = self.id in self.membership.base
                # a schedule none of whose other members counts in the life it has now:
                # they all restarted or died before this node trained (it may have slept
                # through the start, then taken the announcement from its backlog)
                gone = not running and self.membership.orphaned()
                spent = self.membership.spent
            if gone:
                log.warning("%s: no member of the cluster it would start with counts in it any more (they "
                            "restarted or died before it trained); looking for a cluster again", self.id)
                yield from self.start_over()
                seen = None
                continue
            if spent:
                log.warning("%s: the cluster started with this node and dropped it before it trained (silent "
                            "for more than --dead-after s); joining it as a new life", self.id)
                yield from self.start_over()
                seen = None
                continue
            if running:
                if base_known:
                    return "member" if in_base else "join"
                if now - asked >= cfg.timing.heartbeat:
                    # a ping said "training" before the start announcement (with the starting
                    # member set) got here, e.g. over a slower link: ask for the member set
                    asked = now
                    self.control.apply(self.control.hello_all(running[:1]))
                continue
            if others:
                # a seed that has not answered holds the start of those that did back for
                # start_hold at most: it joins the running cluster when it comes
                ok, why = self.control.settled(now, cfg.timing.settle, seeds=now - start < cfg.timing.start_hold)
                if ok:
                    return "fresh"
                if now - last_note >= 2.0:
                    last_note = now
                    log.info("%s: waiting to start with %d member(s): %s", self.id, others + 1, why)
            if not others and seeds and not self.control.conflicts and now - last_note >= 2.0:
                last_note = now  # a lone node says what it waits for, not only when join_timeout ends
                log.info("%s: no peer has answered yet (%s); training alone in %.0f s (join_timeout) if "
                         "none does", self.id, ", ".join(seeds), max(0.0, cfg.timing.join_timeout - (now - start)))
            if not others and not seeds and now - start >= cfg.timing.settle:
                return "fresh"  # nobody to wait for: the first node of a cluster
            if not others and now - start >= cfg.timing.join_timeout:
                if self.control.conflicts:
                    raise PeerError("; ".join(sorted(set(self.control.conflicts.values()))))
                log.warning("%s: no peer answered within %.0f s; training alone (late peers will join)",
                            self.id, cfg.timing.join_timeout)
                return "fresh"
            if not others and seeds and all(sd in self.control.conflicts for sd in seeds):
                # every seed answered, and refuses us (another model, another version): nothing
                # to wait for. A moment for the peer's goodbye that names the difference
                refused_at = now if refused_at is None else refused_at
                named = all("runs another model" in self.control.conflicts[sd] or not
                            self.control.conflicts[sd].startswith("fingerprint") for sd in seeds)
                if named or now - refused_at >= max(1.0, 4 * cfg.timing.heartbeat):
                    raise PeerError("; ".join(sorted({self.control.conflicts[sd] for sd in seeds})))
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
        self.joining.took_from = None
        if mode == "join":
            start_round = yield from self.joining.await_round()
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
        self.ahead = []  # held for the node of an earlier life
        self.node = Node(self.id, members, topology, self.task, rule, node_cfg, seed=cfg.seed,
                         split=cfg.split, rank=rank, world_size=world, device=self.device, model=self.user_model,
                         optimizer=self.user_optimizer, policies=policies)
        self.node.handover_limit = self.handover_limit
        if self.on_node is not None:
            self.on_node(self.node)
        if mode == "join":
            self.joining.joined = True
            yield from self.joining.pull_state(start_round)
        if cfg.resume and not self.rejoins:  # a new life takes the cluster's state, not its own past
            self.joining.resume()
        if (cfg.resume or self.resume_step) and mode in ("fresh", "member"):  # (a framework's own checkpoint too)
            self.joining.align_start(mode)
        self.status = "training"
        now = yield POLL0
        self.trained_at = now if self.trained_at is None else self.trained_at
        with self.lock:
            self.membership.begin_training(now)
            self.membership.target.clear()
        if mode == "fresh":
            # tell the others whom we started with (as an epidemic: every starter does
            # so): a member that has not noticed the settle yet then starts as one of us
            # instead of asking to join
            self.control.apply(self.control.announce_members())
        early, self.early = self.early, []
        for msg, inc in early:
            # a member that started a new life since (after a partition, say) numbers its
            # messages afresh: one from its old life would make the new life's look replayed
            if inc == self.incarnation_of(msg.sender):
                self.handle(msg)
        log.info("%s: training as %d of %d (%s start, round %d, step %d)", self.id, rank, world, mode,
                 self.node.round, self.node.step)

    def start_over(self) -> Program:
        """Begin a new life before training: a new incarnation, no schedule, no node."""
        now = yield POLL0
        with self.lock:
            self.incarnation = self.new_incarnation(self.incarnation)
            self.control.new_life(self.incarnation)
            self.membership.new_life(self.incarnation, now=now)
            self.status = "waiting"
            self.node = None
            self.joining.replies.clear()
            self.joining.joined = False

    def rejoin(self) -> Program:
        """Start a new life and join the running cluster again (or the stronger
        cluster met after a partition), as a restarted process would: a new
        incarnation, a join round the members announce, and a neighbour's state
        (this node's own drifted while it was out). If no member of that cluster
        schedules the join within ``join_timeout``, it trains on alone instead."""
        now = yield POLL0
        with self.lock:  # (see on_excluded: the life ends here, before the verdict is cleared)
            self.status = "waiting"
            self.excluded = None
            self.rejoins += 1
            self.merges += self.merging
            self.incarnation = self.new_incarnation(self.incarnation)
            self.control.new_life(self.incarnation)
            self.membership.new_life(self.incarnation, target=self.rejoin_cluster, now=now)
            self.status = "waiting"
            prior, self.node = self.node, None
            self.joining.replies.clear()
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

    # -- training ---------------------------------------------------------------------------
    def topology_for(self, members: list[str]) -> Any:
        key = tuple(members)
        topo = self.topologies.get(key)
        if topo is None:
            with self.lock:
                table = self.membership.members
                # a member already gone from the table keeps the label last known for it; only
                # the table's labels are remembered (a guess recorded here would outlive it:
                # the link emulator reads these labels for members no longer in the table)
                dcs = [table[m].dc if m in table else self.membership.labels.get(m) or self.dcs.get(m, self.cfg.dc)
                       for m in members]
                self.dcs.update({m: table[m].dc for m in members if m in table and table[m].dc})
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
            # joiners whose first round is the next: they pull a member's state once one is
            # this far (see Joining.pull_state), and the round waits for them. Told at once,
            # not at the next probe that happens to meet them
            due = [j for j, r in self.membership.joins.items()
                   if r == node.round + 1 and j != self.id and j in self.membership.members]
        if due:
            self.control.apply(self.control.tell_status(due))
        if self.id not in members:
            members = sorted([*members, self.id], key=self.membership.order_key)
        if members != node.members:
            log.info("%s: round %d: %d members", self.id, node.round, len(members))
            node.set_members(members, self.topology_for(members))
        if self.ahead:  # messages held for a member list that has their sender now, or not yet
            held, self.ahead = self.ahead, []
            for msg in held:
                if msg.sender in node.index_of or msg.round < node.round:
                    if not node.deliver(msg):  # (from a non-member whose round passed: rejected as such)
                        self.node_rejected_from(msg)
                else:
                    self.ahead.append(msg)

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
                awaited = node.awaited()
                if all(self.gone(e, node.round) or self._beyond(e) for e in awaited):
                    # mix without the dead and the suspects; a live neighbour's message is worth its wait
                    if any(e in self.membership.members and self.membership.trains_in(e, node.round)
                           for e in awaited):
                        self.skipped_rounds += 1  # (one still in the table: suspected, or a new life)
                    return now
                # a neighbour silent for SILENT_GAPS of its usual gaps: its detector probes it
                # next, rather than when its probe order happens to meet it (SWIM)
                for e in awaited:
                    m = self.membership.members.get(e)
                    if m is not None and self._silent(m):
                        self.control.detector.urge(e, self.control.now)
            now = yield Poll(min(remaining, POLL))
        self.late = 0
        return now

    def gone(self, mid: str, rnd: int) -> bool:
        """Whether round ``rnd`` waits for ``mid`` no longer (call with the lock held): it
        is dead, or the schedule no longer has it train in that round, or it has a new life
        (a restart at the same address, which may answer every probe before its old life
        is declared dead), or it is *silent* (unless ``--wait-for-suspects``): the failure
        detector suspects it (it did not answer a probe, direct or through others) and
        nothing at all came from it for :data:`SILENT_GAPS` times its usual gap between
        two state messages. Both are needed. A live process answers probes on its I/O
        thread whatever its training does, so a neighbour that is slow, or waits for a
        dead neighbour of its own, is not suspected and is waited for. A neighbour behind
        a slow link may be suspected (its answers come later than the probe timeout), but
        its messages keep coming as often as ever, so it is waited for too. A crashed or
        stopped one is both, within about a probe period."""
        m = self.membership.members.get(mid)
        trains, life = self.membership.life_in(mid, rnd)
        return m is None or not trains or (life is not None and m.incarnation != life) \
            or (not self.cfg.wait_for_suspects and self.control.detector.suspected(mid) and self._silent(m))

    def _beyond(self, mid: str) -> bool:
        """Whether ``mid``'s message of the round this node waits in cannot come, however
        long it waits (``node.out_of_reach``: a whole inbox of rounds apart, after a
        stopped process came back, say). Logged when a neighbour first is."""
        node = self.node
        assert node is not None
        # the latest round it sent is of the life it trains in only if its last state messages
        # came from the life the table has now: a restarted member's new life joins rounds
        # after its old life's last message (a Hugging Face Trainer killed and resumed: its
        # neighbours skipped its first rounds, and it ended 7 steps short of them)
        m = self.membership.members.get(mid)
        why = node.out_of_reach(mid, behind=m is not None and self.incarnations.get(mid) == m.incarnation)
        if why is None:
            self.beyond.discard(mid)
            return False
        if mid not in self.beyond:
            self.beyond.add(mid)
            log.info("%s: round %d goes on without %s: it is %s by an inbox or more (its latest round %s), and "
                     "its message of this round cannot come", self.id, node.round, mid, why,
                     node.newest_round.get(mid, "unknown"))
        return True

    def _silent(self, m: Any) -> bool:
        """Whether nothing came from member record ``m`` for :data:`SILENT_GAPS` times its
        usual gap between two state messages."""
        return self.control.now - m.last_seen > SILENT_GAPS * m.state_gap

    def out_of_step(self, awaited: list[str]) -> None:
        """Rounds keep timing out while the neighbours waited for are alive: say so, and
        act on what their pings report. A neighbour far behind this node's round trains
        in a world of its own (it counts rounds that this cluster finished long ago):
        drop it, as a death, so that it learns it and joins again as a new life. When
        this node is the one far behind, it starts a new life itself."""
        node = self.node
        assert node is not None
        with self.lock:  # (the margins this node announces changes with)
            margin = self.cfg.timing.join_margin + self.membership.death_margin()
            alive = {j: (m.status, m.round) for j in awaited if (m := self.membership.members.get(j)) is not None}
            cluster = self.membership.eventual()
            why = "; ".join(self._awaited_view(j, node.round) for j in sorted(alive))
        if self.late == LATE_ROUNDS or self.late & (self.late - 1) == 0:  # 3, 4, 8, 16 ...: not every round
            log.warning("%s: %d synchronous rounds in a row timed out waiting for %s (alive: %s); this node is at "
                        "round %d (%s)", self.id, self.late, ", ".join(awaited) or "nobody",
                        ", ".join(f"{j} {st} at round {r}" for j, (st, r) in sorted(alive.items())) or "none",
                        node.round, why or "no schedule entry")
        behind, ahead = out_of_step(node.round, alive, margin)
        for j in behind:
            self.control.apply(self.control.drop(j, f"out of step: it trains in round {alive[j][1]}, this "
                                                    f"cluster in round {node.round}"))
        if ahead is not None and self.excluded is None:
            log.warning("%s: %s trains in round %d, far ahead of this node's round %d: this node is out of step "
                        "with its cluster; joining again as a new life", self.id, ahead, alive[ahead][1], node.round)
            self.excluded, self.rejoin_via, self.merging = alive[ahead][1], ahead, False
            self.rejoin_cluster = set(cluster) - {self.id}
            return
        self.control.apply(self.control.hello_all(sorted(alive)))  # their member lists, in case ours and theirs differ

    def _awaited_view(self, mid: str, rnd: int) -> str:
        """Why round ``rnd`` waits for ``mid``, as this node's tables say (call with the
        lock held): the life its member table holds, the life the schedule has train
        then, its join and leave rounds, and the detector's suspicion. A wait that lasts
        says which of these the members disagree on (the log of a wedged run is all
        there is to go by)."""
        m = self.membership
        _, life = m.life_in(mid, rnd)
        member = m.members.get(mid)
        entry = "a starter" if mid in m.base else f"its latest life joins at {m.joins.get(mid)}"
        return (f"{mid}: life {member.incarnation if member is not None else None} in the table, life {life} in "
                f"the schedule of round {rnd}, {entry} and leaves at {m.leaves.get(mid)}, "
                f"{'suspected' if self.control.detector.suspected(mid) else 'not suspected'}")

    def finish(self) -> Program:
        """Keep serving until every other member is done (or gone), or ``grace`` passes."""
        self.status = "done"
        self.answer_requests(every=True)  # joiners waiting for a state between two steps: there are no more
        if self.interrupted:
            return
        self.control.apply(self.control.announce_status())
        now = yield POLL0
        end = now + self.cfg.timing.grace
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
            if msg.sender not in node.index_of and node.round <= msg.round <= node.round + 1 \
                    and len(self.ahead) < AHEAD:  # (a round further ahead is no joiner's first)
                with self.lock:
                    alive = msg.sender in self.membership.members
                if alive:
                    self.ahead.append(msg)
                    return
            if not node.deliver(msg):
                self.node_rejected_from(msg)
        elif msg.kind == "state-request":
            if node is None or self.status == "waiting":
                return
            if self.group_size > 1:
                if self.on_state_request is not None:
                    self.on_state_request(str(msg.sender))
                elif msg.sender not in self.handovers and len(self.handovers) < AHEAD:
                    self.handovers.append(str(msg.sender))
                return
            if self.defer_requests and self.status == "training" and not self.serving \
                    and not (self.prepared is not None and self.prepared[0] == msg.round):
                self.requests = [r for r in self.requests if r.sender != msg.sender][-7:] + [msg]
                return
            self.answer(msg)
        elif msg.kind == "average":  # a collective of a training loop of the user's own (GossipNode)
            if self.on_average is not None:
                self.on_average(msg)
        elif msg.kind == "state-reply":
            # wanted only while a joiner pulls a state, and a few at most: each holds a whole model
            if not self.joining.offer(msg):
                self.control.reject(str(msg.sender), "unsolicited", "a state-reply nobody asked for")

    def answer_requests(self, every: bool = False) -> None:
        """Between two steps of a training loop of the user's own (see :attr:`defer_requests`):
        answer the deferred state requests of joiners whose first round this node has
        reached (``every``: all of them); the state is then the one the cluster starts that
        round with. At the start of a round that a joiner joins, keep that state too: the
        joiner's request may arrive while this node waits for the joiner in that round."""
        node = self.node
        if node is None:
            return
        boundary = node.step % node.channels[0].period == 0
        if self.prepared is not None and self.prepared[0] < node.round:
            self.prepared = None
        if self.defer_requests and boundary and (self.prepared is None or self.prepared[0] != node.round):
            with self.lock:
                starting = any(r == node.round and j != self.id for j, r in self.membership.joins.items())
            if starting:
                self.prepared = (node.round, node.step, *node.handover(), node.handover_note)
        if not self.requests:
            return
        due = [r for r in self.requests if every or (r.round <= node.round and boundary)]
        self.requests = [r for r in self.requests if r not in due]
        for msg in due:
            self.answer(msg)

    def answer(self, msg: Message) -> None:
        """Send the joiner that sent state-request ``msg`` this node's state (the one kept
        for its first round, if any)."""
        self.send_message(msg.sender, self.state_reply(str(msg.sender), msg.round))

    def state_reply(self, to: str, first_round: int | None = None) -> Message:
        """This node's state for joiner ``to``: the parameters, outer momentum, optimizer state
        and the driver's extras (those kept for the joiner's ``first_round``, if any)."""
        node = self.node
        assert node is not None
        prepared = self.prepared if self.prepared is not None and self.prepared[0] == first_round else None
        if prepared is not None:
            rnd, step, snap, extra, note = prepared
        else:
            (snap, extra), rnd, step = node.handover(), node.round, node.step
            note = node.handover_note
        if self.audit:
            self.handed.append((to, sha256_of(snap[:node.numel])))
        log.info("%s: handed its state of step %d to %s (%s)", self.id, step, to, note)
        return Message("state-reply", self.id, rnd, step, 0, get_codec("none").encode(snap.cpu()),
                       node.rule.weight, {"inc": self.incarnation, **extra}, self.fingerprint)

    def take_handovers(self) -> list[str]:
        """The joiners whose state requests wait for the group's next exchange (and forget them)."""
        out, self.handovers = self.handovers, []
        return out

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
