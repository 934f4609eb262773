"""A real gossip node: the same :class:`~gossip.node.Node` program, driven by the
wall clock over ZeroMQ.

Lifecycle of ``Peer.run()``:

1. bind the listen address (a clear :class:`~gossip.transport.zmq.BindError` if taken);
2. discover: say hello to the ``--peers`` seeds (retrying with backoff) and
   exchange member lists until either every known member waits for the start
   and reports the same member set for ``settle`` seconds (a fresh cluster:
   all start at round 0 with the same sorted member list), or some member is
   already training (a late join: the cluster schedules the round we take part
   from, we pull a full state from a member just before it, and start there);
3. train: advance the node program; ``Send`` goes to the I/O thread, ``Wait``
   polls for the round's messages up to the timeout (ending early if an
   expected neighbour is declared dead); member changes are adopted at round
   boundaries; optional checkpoints and JSON-lines metrics;
4. finish: everyone trains the same number of local steps. A node that is done
   keeps serving (heartbeats, state requests) until every other member is done
   or ``grace`` seconds pass, then says goodbye so nobody waits for a timeout.

SIGINT/SIGTERM (``request_stop``) end training after the current step, write a
final checkpoint if configured, and say goodbye.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gossip import wire
from gossip.checkpoint import checkpoint_step, latest_checkpoint, load_checkpoint, load_members, save_checkpoint, save_members
from gossip.compression import get_codec
from gossip.control import ControlPlane
from gossip.membership import Membership, out_of_step, parse_address, topology_for
from gossip.message import Message
from gossip.mixing.settings import MixingSettings, build_rules, with_mixing_options
from gossip.mixing.base import all_finite, decode_payload
from gossip.node import Compute, Node, NodeConfig, Release, Send, Wait, init_model, resolve_device
from gossip.security import load_curve
from gossip.state import FlatState, fingerprint_of
from gossip.tasks import get_task
from gossip.transport.sim import LinkModel, SimNetwork, parse_link
from gossip.transport.zmq import ZmqTransport

__all__ = ["PeerConfig", "Peer", "PeerError", "resolve_device"]

log = logging.getLogger("gossip.peer")

LATE_ROUNDS = 3  # synchronous rounds timed out in a row before the node looks for a neighbour out of step


class PeerError(RuntimeError):
    """The node cannot take part (e.g. every peer runs a different model)."""


UNSHAPED = LinkModel(latency=0.0, bandwidth=math.inf)


def emulated_links(specs: tuple[str, ...] | list[str]) -> dict[str, LinkModel] | None:
    """Parse ``--emulate CLASS:SPEC`` entries (CLASS: intra, inter or all) into link models."""
    if not specs:
        return None
    links = {"intra": UNSHAPED, "inter": UNSHAPED}
    for entry in specs:
        cls, sep, spec = str(entry).partition(":")
        cls = cls.strip()
        if not sep or cls not in ("intra", "inter", "all"):
            raise ValueError(f"--emulate {entry!r}: expected CLASS:SPEC with CLASS intra, inter or all, "
                             "e.g. inter:latency=50ms,bandwidth=100Mbit")
        model = parse_link(spec, UNSHAPED)
        for c in (("intra", "inter") if cls == "all" else (cls,)):
            links[c] = model
    return links


@with_mixing_options
@dataclass(frozen=True)
class PeerConfig:
    """Everything a real node needs; :mod:`gossip.cli` fills it from flags or a TOML file."""

    listen: str                          # tcp://HOST:PORT (or HOST:PORT) to bind
    peers: tuple[str, ...] = ()          # seeds HOST:PORT: any existing members
    advertise: str | None = None         # HOST:PORT others reach us at (default: listen)
    topology: str = "ring"
    # how the node mixes: one MixingSettings; its options (algorithm, compression, gamma, period,
    # asynchronous, staleness, overlap, clip, link_policy) are also accepted as flat keywords
    # (and the older options={"gamma": ...}) and read back flat (cfg.period)
    mixing: MixingSettings | None = None
    task: Any = "synthetic"
    split: str = "iid"
    steps: int = 200
    seed: int = 0
    rank: int | None = None              # explicit data shard; default: index in the sorted member list
    world_size: int | None = None
    device: str = "auto"
    dc: str = ""                         # datacenter label (links between different labels are "inter")
    timeout: float = 5.0                 # synchronous round timeout (s)
    heartbeat: float = 0.5               # ping interval (s)
    dead_after: float = 3.0              # silence before a member is declared dead (s)
    settle: float = 2.0                  # member set stable this long before a fresh start (s)
    join_timeout: float = 60.0           # give up waiting for peers after this long (s)
    join_margin: int = 20                # rounds between announcing a join and adopting it
    grace: float = 10.0                  # how long a finished node keeps serving (s)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0            # local steps between checkpoints (0: only at the end)
    resume: bool = False
    log: str | None = None               # JSON-lines metrics file
    eval_every: int = 0                  # local steps between evaluations in the metrics log (0: steps/10)
    max_message_mb: float = 0.0          # incoming size cap in MiB (0: twice the model + 1 MiB)
    emulate: tuple[str, ...] = ()        # link emulation: "CLASS:latency=50ms,bandwidth=100Mbit,loss=0,drop=N"
    curve_keys: str | None = None        # CurveZMQ key directory (see gossip.security); None: no encryption
    tensorboard: str | None = None       # TensorBoard directory: scalars of the metrics in DIR/<node id>/

    def __post_init__(self) -> None:
        parse_address(self.listen, "--listen")
        if self.advertise is not None:
            parse_address(self.advertise, "--advertise")
        for p in self.peers:
            parse_address(p, "--peers entry")
        for name in ("steps", "checkpoint_every", "eval_every", "join_margin"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        for name in ("timeout", "heartbeat", "dead_after", "join_timeout"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        for name in ("settle", "grace", "max_message_mb"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        if (self.rank is None) != (self.world_size is None):
            raise ValueError("--rank and --world-size go together")
        if self.world_size is not None:
            if not (isinstance(self.world_size, int) and self.world_size >= 1):
                raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
            if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
                raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")
        if not isinstance(self.dc, str) or len(self.dc) > 64:
            raise ValueError("dc must be a short string")
        emulated_links(self.emulate)  # fails early on a bad spec
        if self.tensorboard:
            from gossip.tensorboard_log import require_tensorboard

            require_tensorboard()  # the install command, before anything starts
        from gossip.data import parse_split
        from topologies import SPEC_NAMES

        parse_split(self.split)
        name = self.topology.split(":", 1)[0].strip().lower().replace("_", "-") if isinstance(self.topology, str) else ""
        if isinstance(self.topology, str) and name not in SPEC_NAMES:
            raise ValueError(f"unknown topology {self.topology!r}; valid: {', '.join(SPEC_NAMES)}")
        if isinstance(self.topology, str):
            # the rules checked against the graph now (CHOCO needs a static one), not at the first round;
            # the cluster's size is not known yet, so on the graph of world_size members, or of 8
            from topologies import build

            try:
                probe = build(self.topology, self.world_size or 8, seed=self.seed)
            except ValueError:
                probe = None  # a spec for a fixed size (hierarchical:4,4, torus:3x3): checked at the start
            if probe is not None:
                build_rules(self.mixing, probe)

    @property
    def node_id(self) -> str:
        listen = parse_address(self.listen, "--listen")
        node_id = parse_address(self.advertise, "--advertise") if self.advertise else listen
        if node_id.split(":")[0] in ("0.0.0.0", "*", "[::]"):
            raise ValueError(f"listening on {listen} needs --advertise HOST:PORT (the address peers can reach)")
        return node_id


class Peer:
    """One real node. ``Peer(cfg).run()`` returns the final summary dict."""

    def __init__(self, config: PeerConfig, task: Any = None, *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.cfg = config
        self.id = config.node_id
        self.incarnation = time.time_ns() // 1000
        self.clock = time.monotonic
        self.t0 = self.clock()
        self.user_model, self.user_optimizer = model, optimizer
        if model is not None:  # a training loop of the caller's own (gossip.user_loop.GossipNode)
            self.task = None
            self.device = next(model.parameters()).device
            self.fingerprint = fingerprint_of(model)
            self.model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        else:
            self.task = get_task(config.task if task is None else task)
            self.device = resolve_device(config.device)
            # the model fingerprint is needed before the node exists (hello carries it)
            probe_model = init_model(self.task, config.seed, "cpu")
            probe = FlatState(probe_model)
            self.fingerprint = probe.fingerprint
            self.model_bytes = probe.nbytes
            # The first optimizer makes torch import its compiler stack (seconds on a busy
            # machine): pay that now, before peers can be kept waiting for us to start.
            self.task.optimizer(probe_model.parameters())
            del probe, probe_model
        self.status = "waiting"
        self.node: Node | None = None
        self.lock = threading.RLock()
        self.membership = Membership(self.id, self.incarnation, self.fingerprint, config.dc,
                                     dead_after=config.dead_after, join_margin=config.join_margin)
        self.inbound: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.interrupted = False
        self.joined = False
        self.rejoins = 0  # new lives started after the cluster declared this node dead while it was alive
        self.merges = 0  # of which: joining a stronger cluster met after a partition
        self._excluded: int | None = None  # the leave round the cluster announced for this (live) node
        self._rejoin_via: str | None = None  # the member that announced it (asked first to take us back)
        self._rejoin_cluster: set[str] = set()  # the members of the cluster to join
        self._merging = False  # it is another cluster (met after a partition), not ours
        # the step this node resumes from (--resume), told to the others while it waits: a
        # cluster restarted as a whole starts at the furthest of its members' checkpoints
        ck = latest_checkpoint(config.checkpoint_dir) if config.resume and config.checkpoint_dir else None
        self._resume_step = checkpoint_step(ck) if ck is not None else 0
        self.state_from: str | None = None
        self._state_step = 0  # the step of the member state taken (state_from's)
        self.resumed_from: str | None = None
        self.rank: int | None = None
        self.world_size: int | None = None
        self.train_seconds = 0.0
        self.trained_steps = 0
        self.max_step_gap = 0.0
        self.timed_out_rounds = 0  # synchronous rounds that waited --timeout in vain
        self._late = 0  # of which in a row (reset by a round that completed)
        self.node_rejected: Counter[str] = Counter()
        self._topologies: dict[tuple, Any] = {}
        self._dcs: dict[str, str] = {}  # datacenter label of every member we trained with (bytes by link class)
        self._state_replies: list[Message] = []
        # state messages that arrived before our node existed, with their sender's life then
        self._early: list[tuple[Message, int | None]] = []
        self._incarnations: dict[str, int | None] = {}  # sender -> the life whose sequence numbers we track
        self._metrics = None
        self.on_step: Any = None  # called with this peer after every training step (gossip-node's progress bar)
        self.on_average: Any = None  # GossipNode's collectives: called with each "average" message
        self.serving = False  # done, but still taking part in rounds for the members that train (GossipNode)
        # a state-reply carries the parameters and each outer optimizer's momentum
        mixing = config.mixing
        momenta = sum(1 for c in ("intra", "inter") if mixing.for_link(c).outer.momentum > 0) \
            if mixing.link_policy else int(mixing.outer.momentum > 0)
        copies = max(2, 1 + momenta)
        cap = config.max_message_mb * 2**20 if config.max_message_mb else copies * self.model_bytes + 2**20
        self.control = ControlPlane(self.id, self.incarnation, self.fingerprint, config.dc, self.membership,
                                    self.lock, self._send_message, self.inbound.put, self._progress,
                                    heartbeat=config.heartbeat, seeds=tuple(parse_address(p) for p in config.peers),
                                    reconnect=self._reconnect, excluded=self._on_excluded, clock=self.clock)
        listen = "tcp://" + parse_address(config.listen, "--listen")
        links = emulated_links(config.emulate)
        self.shaper = None if links is None else SimNetwork(links, self._link_class, seed=config.seed,
                                                             origin=self.t0)
        # CurveZMQ: a bad key directory is a ValueError naming what is wrong (gossip-node exits 2)
        self.security = load_curve(config.curve_keys, self.id) if config.curve_keys else None
        self.transport = ZmqTransport(self.id, listen, on_frames=self.control.on_frames, on_tick=self._tick,
                                      tick=min(0.1, config.heartbeat / 2), max_message_size=int(cap),
                                      shaper=self.shaper, curve=self.security)

    # -- shared with the I/O thread --------------------------------------------------------
    def _progress(self) -> tuple[str, int, int]:
        node = self.node
        return self.status, (node.round if node else 0), (node.step if node else self._resume_step)

    def _send_message(self, dst: str, msg: Message) -> None:
        self.transport.send(dst, wire.encode(msg), droppable=False)  # control traffic

    def _reconnect(self, peer: str) -> None:
        if peer != self.id:
            self.transport.forget(peer)

    def _on_excluded(self, rnd: int, by: str, cluster: set[str], merge: bool) -> None:
        # I/O thread: the training thread sees the flag after its current step
        if self._excluded is None and not self.stop.is_set() and self.status == "training":
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
            self._excluded, self._rejoin_via, self._merging = rnd, by, merge
            self._rejoin_cluster = set(cluster)

    def _tick(self, now: float) -> None:
        dead = self.control.tick(now)
        for d in dead:
            self.transport.forget(d)

    def _link_class(self, u: str, v: str) -> str:
        """intra or inter: whether the two members carry different datacenter labels."""
        with self.lock:
            mu, mv = self.membership.members.get(u), self.membership.members.get(v)
        du = mu.dc if mu else self.cfg.dc
        dv = mv.dc if mv else du
        return "inter" if du != dv else "intra"

    def request_stop(self) -> None:
        """Stop after the current step (signal handlers call this)."""
        self.interrupted = True
        self.stop.set()

    # -- lifecycle -------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Discover, train the task, finish; returns the summary (see :meth:`summary`)."""
        try:
            if self.start():
                self.train()
                while self._excluded is not None and not self.stop.is_set():
                    self._rejoin()
                    self.train()
                self.finish()
            return self.summary()
        finally:
            self.close()

    def start(self) -> bool:
        """Bind, find the cluster and build the node; False if stopped before starting.

        Raises :class:`~gossip.transport.zmq.BindError` if the address is taken and
        :class:`PeerError` if no peer will mix with us.
        """
        self.transport.start()
        log.info("%s: listening (incarnation %d, model %s)", self.id, self.incarnation, self.fingerprint)
        if self.cfg.log or self.cfg.tensorboard:
            from gossip.tensorboard_log import open_metrics, run_name

            self._metrics = open_metrics(self.cfg.log, self.cfg.tensorboard and
                                         Path(self.cfg.tensorboard) / run_name(self.id))
        mode = self._discover()
        if mode is None:
            return False
        self._start(mode)
        return True

    def close(self) -> None:
        """Say goodbye and release the sockets (idempotent)."""
        if self.transport._thread is not None:
            self.control.goodbye("done" if not self.interrupted else "stopped")
            time.sleep(0.05)  # let the I/O thread flush the goodbye
            self.transport.close()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    def _discover(self) -> str | None:
        """Wait until we can start; returns "fresh", "member" or "join" (None if stopped)."""
        cfg, start = self.cfg, self.clock()
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
            self._service(0.05)
            now = self.clock()
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

    def _start(self, mode: str) -> None:
        """Build the node and start training: ``fresh`` (a new cluster of the members
        known now), ``member`` (one of a running cluster's starters), ``join`` (a
        running cluster schedules us), or ``alone`` (a cluster of this node only)."""
        cfg = self.cfg
        with self.lock:
            if mode in ("fresh", "alone"):
                self.membership.start(self.membership.ids() if mode == "fresh" else [self.id])
            start_round = 0
            if mode == "join":
                start_round = self._await_join_round()
            members = self.membership.at_round(start_round)
            if self.id not in members:
                members = sorted([*members, self.id], key=self.membership.order_key)
        rank, world = (cfg.rank, cfg.world_size) if cfg.world_size is not None else (members.index(self.id),
                                                                                     len(members))
        topology = self._topology_for(members)
        rule, policies = build_rules(cfg.mixing, topology)  # checked on this graph, on every link class
        node_cfg = NodeConfig(cfg.steps, cfg.mixing.period, float(cfg.timeout), check_payloads=True,
                              overlap=cfg.mixing.overlap, live_sends=self.transport.holds_sends)
        self.rank, self.world_size = rank, world
        self._late = 0  # timeouts of an earlier life say nothing about this one's neighbours
        self.node = Node(self.id, members, topology, self.task, rule, node_cfg, seed=cfg.seed,
                         split=cfg.split, rank=rank, world_size=world, device=self.device, model=self.user_model,
                         optimizer=self.user_optimizer, policies=policies)
        if mode == "join":
            self.joined = True
            self._pull_state(start_round)
        if cfg.resume and not self.rejoins:  # a new life takes the cluster's state, not its own past
            self._resume()
        if cfg.resume and mode in ("fresh", "member"):
            self._align_start(mode)
        self.status = "training"
        with self.lock:
            self.membership.training = True
            self.membership.target.clear()
        if mode == "fresh":
            # tell everyone whom we started with: a member that has not noticed the
            # settle yet then starts as one of us instead of asking to join
            self.control.broadcast(self.control._members_message())
        early, self._early = self._early, []
        for msg, inc in early:
            # a member that started a new life since (after a partition, say) numbers its
            # messages afresh: one from its old life would make the new life's look replayed
            if inc == self._incarnation_of(msg.sender):
                self._handle(msg)
        log.info("%s: training as %d of %d (%s start, round %d, step %d)", self.id, rank, world, mode,
                 self.node.round, self.node.step)

    def _rejoin(self) -> None:
        """Start a new life and join the running cluster again (or the stronger
        cluster met after a partition), as a restarted process would: a new
        incarnation, a join round the members announce, and a neighbour's state
        (this node's own drifted while it was out). If no member of that cluster
        schedules the join within ``join_timeout``, it trains on alone instead."""
        self._excluded = None
        self.rejoins += 1
        self.merges += self._merging
        with self.lock:
            self.incarnation = max(time.time_ns() // 1000, self.incarnation + 1)
            self.control.new_life(self.incarnation)
            self.membership.new_life(self.incarnation, target=self._rejoin_cluster, now=self.clock())
            self.status = "waiting"
            prior, self.node = self.node, None
            self._state_replies.clear()
        try:
            self._start("join")
        except PeerError as e:
            if prior is None or self.stop.is_set():
                raise
            # cut off from the cluster it joins (a partition that formed again, say): train on
            # from where this node was, as a cluster of its own; when the two meet again, the
            # larger goes on (see ControlPlane) and this node joins it then
            log.warning("%s: %s; training alone from step %d until it meets a cluster again", self.id, e,
                        prior.step)
            state = prior.state_dict()
            self._start("alone")
            node = self.node
            assert node is not None
            node.adopt(state["flat"].to(self.device))
            node.jump_to(state["step"])
            if node.optimizer is not None and state["optimizer"] is not None:
                node.optimizer.load_state_dict(state["optimizer"])

    def _await_join_round(self) -> int:
        """The round the cluster scheduled for us (it answers our hello with it)."""
        deadline = self.clock() + max(self.cfg.join_timeout, 5 * self.cfg.heartbeat)
        while self.clock() < deadline and not self.stop.is_set():
            if self.id in self.membership.joins:
                return self.membership.joins[self.id]
            m = self.membership
            others = m.others()
            if m.target:  # joining another cluster: ask only its members
                others = [o for o in others if o in m.target]
            # only a training member schedules a join: when all have finished (or said
            # goodbye), nobody will, and waiting --join-timeout would only idle. Only what
            # they said in this life counts (see Membership.finished)
            if m.finished(m.target or others):
                raise PeerError("every member of the cluster it joins has finished training ("
                                + ", ".join(sorted(m.target or others)) + ")")
            self.lock.release()
            try:
                if self._rejoin_via is not None:  # the member that dropped us knows the running cluster
                    others = [self._rejoin_via, *(o for o in others if o != self._rejoin_via)]
                self.control.hello_all(others[:3])
                self._service(self.cfg.heartbeat)
            finally:
                self.lock.acquire()
        raise PeerError("the running cluster did not schedule our join (no answer to hello)")

    def _pull_state(self, start_round: int) -> None:
        """Wait until the cluster reaches our first round, then copy a member's state."""
        node, cfg = self.node, self.cfg
        assert node is not None
        while not self.stop.is_set():
            with self.lock:  # the members we train with (after a partition, others may count other rounds)
                rounds = [m.round for k, m in self.membership.members.items() if k != self.id and k in node.members]
            if not rounds or max(rounds) >= start_round - 1:
                break
            self._service(cfg.heartbeat / 2)
        for attempt in range(6):
            donors = [j for j in node.topology.in_weights(node.index, start_round) if j != node.index]
            candidates = [node.members[j] for j in donors] or [m for m in node.members if m != self.id]
            if not candidates:
                break
            donor = candidates[attempt % len(candidates)]
            self._send_message(donor, Message("state-request", self.id, start_round, 0, 0, None, None,
                                              {"inc": self.incarnation}, self.fingerprint))
            deadline = self.clock() + max(2.0, cfg.timeout)
            while self.clock() < deadline and not self._state_replies:
                self._service(0.05)
            for reply in self._state_replies:
                if reply.sender == donor and reply.data is not None \
                        and reply.data.numel == node.handover_numel(reply.extra):
                    values = decode_payload(reply, node.state.flat)
                    if all_finite(values):
                        node.adopt_handover(values, reply.extra)  # parameters, and any outer momentum
                        # a joiner that fell behind (slow start, a busy machine) starts at the
                        # donor's round: the cluster went on without it, and its members drop
                        # messages of rounds they have finished
                        start_round = max(start_round, reply.round)
                        node.jump_to(start_round * cfg.period)
                        if reply.weight is not None and hasattr(node.rule, "weight"):
                            node.rule.weight = 1.0  # a newcomer brings its own unit of push-sum mass
                        self.state_from, self._state_step = donor, reply.progress
                        log.info("%s: took the state of %s (its step %d); joining at round %d", self.id, donor,
                                 reply.progress, start_round)
                        self._state_replies.clear()
                        return
            self._state_replies.clear()
            log.warning("%s: no state from %s yet; asking another member", self.id, donor)
        node.jump_to(start_round * cfg.period)
        log.warning("%s: no member sent its state; joining with a fresh model", self.id)

    def _align_start(self, mode: str) -> None:
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

    def _resume(self) -> None:
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
        if self.state_from is not None and int(state["step"]) <= self._state_step:
            log.info("%s: the member state (step %d) is newer than checkpoint %s (step %d); keeping it",
                     self.id, self._state_step, path.name, state["step"])
            return
        node.adopt(state["flat"].to(self.device))
        if node.optimizer is not None and state.get("optimizer") is not None:
            node.optimizer.load_state_dict(state["optimizer"])
        self.resumed_from = str(path)
        log.info("%s: took the parameters of checkpoint %s (step %d, %s); training in the cluster's round %d",
                 self.id, path.name, state["step"], "no member state" if self.state_from is None else
                 f"the member state was of step {self._state_step}", node.round)

    # -- the training driver (this thread) -------------------------------------------------
    def _topology_for(self, members: list[str]) -> Any:
        key = tuple(members)
        topo = self._topologies.get(key)
        if topo is None:
            with self.lock:
                dcs = [self.membership.members[m].dc if m in self.membership.members else self.cfg.dc
                       for m in members]
                self._dcs.update(zip(members, dcs))
            # every member derives the same graph from the same ordered list (and labels)
            topo = topology_for(self.cfg.topology, len(members), seed=self.cfg.seed,
                                dcs=dcs if any(dcs) else None)
            self._topologies = {key: topo}  # only the current one is needed
        return topo

    def _apply_members(self) -> None:
        node = self.node
        assert node is not None
        with self.lock:
            members = self.membership.at_round(node.round)
        if self.id not in members:
            members = sorted([*members, self.id], key=self.membership.order_key)
        if members != node.members:
            log.info("%s: round %d: %d members", self.id, node.round, len(members))
            node.set_members(members, self._topology_for(members))

    def train(self) -> None:
        """Run the task's training program to the end (or until stopped)."""
        node = self.node
        assert node is not None and node.stream is not None, "train() needs a task; use step() for your own loop"
        last_eval = node.step
        if self._metrics is not None:
            self._log_metrics("eval")  # the starting point of every curve
        every = self.cfg.eval_every or max(1, self.cfg.steps // 10)

        last_step_at = self.clock()

        def after_step() -> bool:
            nonlocal last_eval, last_step_at
            now = self.clock()
            self.max_step_gap = max(self.max_step_gap, now - last_step_at)  # the longest stall
            last_step_at = now
            if self.on_step is not None:
                self.on_step(self)
            if self._metrics is not None and node.step - last_eval >= every:
                last_eval = node.step
                self._log_metrics("eval")
            if self.cfg.checkpoint_dir and self.cfg.checkpoint_every and node.step % self.cfg.checkpoint_every == 0:
                save_checkpoint(node.state_dict(), self.cfg.checkpoint_dir, node.step)
                save_members(self.cfg.checkpoint_dir, [m for m in node.members if m != self.id])
            if self.stop.is_set():
                log.warning("%s: stopping at step %d on request", self.id, node.step)
                return False
            return self._excluded is None

        first_step, t_start = node.step, self.clock()
        self._drive(node.program(), after_step)
        self.train_seconds += self.clock() - t_start
        self.trained_steps += node.step - first_step
        if self.cfg.checkpoint_dir and self._excluded is None:  # not the state of a life the cluster dropped
            save_checkpoint(node.state_dict(), self.cfg.checkpoint_dir, node.step)
            save_members(self.cfg.checkpoint_dir, [m for m in node.members if m != self.id])

    def step(self) -> None:
        """For a training loop of your own: call once after each ``optimizer.step()``.

        Counts a local step; every ``period`` steps it exchanges with the
        neighbours and mixes (blocking for a synchronous round, as D-PSGD does).
        """
        if self.node is None:
            raise RuntimeError("call start() before step()")
        self._service(0.0)
        if self._excluded is not None and not self.stop.is_set():
            self._rejoin()  # blocks until the cluster takes us back, with a neighbour's state
        node = self.node
        node.step += 1
        due = [ch for ch in node.channels if node.step % ch.period == 0]
        if due:
            self._apply_members()
            for ch in due:
                self._drive(node.exchange(ch), lambda: True)

    def complete_pending(self) -> None:
        """With overlap, mix the rounds still in flight (the end of a loop of your own)."""
        node = self.node
        if node is not None:
            for ch in node.channels:
                if ch.pending is not None:
                    self._drive(node.complete(ch), lambda: True)

    def _drive(self, program: Any, after_step: Any) -> None:
        """Advance a node program with the wall clock: the real-world driver."""
        node = self.node
        assert node is not None
        started = False
        while True:
            now = self.clock() - self.t0
            try:
                action = program.send(now) if started else next(program)
            except StopIteration:
                return
            started = True
            self._service(0.0)
            kind = type(action)
            if kind is Compute:
                if not after_step():
                    return
                if any(node.step % ch.period == 0 for ch in node.channels):
                    self._apply_members()  # membership changes take effect between rounds
            elif kind is Send:
                self._send(action.messages)
            elif kind is Wait:
                self._wait(action.timeout)
            elif kind is Release:
                action.lease.wait(action.timeout)
            del action  # nothing here may keep a sent message alive (see NodeConfig.live_sends)

    def _send(self, messages: list) -> None:
        encoded: dict[int, list] = {}
        for dst, msg in messages:
            frames = encoded.get(id(msg))
            if frames is None:  # one encoding per distinct message, shared by its receivers
                frames = encoded[id(msg)] = wire.encode(msg)
            self.transport.send(dst, frames)

    def _wait(self, timeout: float) -> None:
        """Poll for the round's messages until ready, timeout, or every neighbour still
        awaited was declared dead."""
        node = self.node
        assert node is not None
        deadline = self.clock() + timeout
        while not node.ready():
            remaining = deadline - self.clock()
            if remaining <= 0:
                self.timed_out_rounds += 1
                self._late += 1
                awaited = node.awaited()
                log.info("%s: round %d timed out waiting for neighbours (%s)", self.id, node.round,
                         ", ".join(map(str, awaited)))
                if self._late >= LATE_ROUNDS:
                    self._out_of_step(awaited)
                return
            if self.stop.is_set() or self._excluded is not None:
                return
            with self.lock:
                alive = self.membership.members
                if all(e not in alive for e in node.awaited()):
                    return  # mix without the dead; a live neighbour's message is worth its wait
            self._service(min(remaining, 0.05))
        self._late = 0

    def _out_of_step(self, awaited: list[str]) -> None:
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
        if self._late == LATE_ROUNDS or self._late & (self._late - 1) == 0:  # 3, 4, 8, 16 ...: not every round
            log.warning("%s: %d synchronous rounds in a row timed out waiting for %s (alive: %s); this node is at "
                        "round %d", self.id, self._late, ", ".join(awaited) or "nobody",
                        ", ".join(f"{j} {st} at round {r}" for j, (st, r) in sorted(alive.items())) or "none",
                        node.round)
        behind, ahead = out_of_step(node.round, alive, margin)
        for j in behind:
            self.control.drop(j, f"out of step: it trains in round {alive[j][1]}, this cluster in round "
                                 f"{node.round}")
        if ahead is not None and self._excluded is None:
            log.warning("%s: %s trains in round %d, far ahead of this node's round %d: this node is out of step "
                        "with its cluster; joining again as a new life", self.id, ahead, alive[ahead][1], node.round)
            self._excluded, self._rejoin_via, self._merging = alive[ahead][1], ahead, False
            self._rejoin_cluster = set(cluster) - {self.id}
            return
        self.control.hello_all(sorted(alive))  # their member lists, in case ours and theirs differ

    def _service(self, block: float) -> None:
        """Handle what the I/O thread handed over: state messages, state requests and replies."""
        try:
            msg = self.inbound.get(timeout=block) if block > 0 else self.inbound.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self.inbound.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: Message) -> None:
        node = self.node
        if msg.kind == "state":
            if node is None:
                # neighbours that started a moment earlier already sent round 0: keep it
                if len(self._early) < 1024:
                    self._early.append((msg, self._incarnation_of(msg.sender)))
                return
            if self.status == "done" and not self.serving:
                return  # finished: nothing to mix into
            self._note_incarnation(msg.sender)
            if not node.deliver(msg):
                self.node_rejected_from(msg)
        elif msg.kind == "state-request":
            if node is None or self.status == "waiting":
                return
            snap, extra = node.handover()  # the parameters, and any outer optimizer's momentum
            weight = getattr(node.rule, "weight", None)
            reply = Message("state-reply", self.id, node.round, node.step, 0, get_codec("none").encode(snap.cpu()),
                            weight, {"inc": self.incarnation, **extra}, self.fingerprint)
            self._send_message(msg.sender, reply)
        elif msg.kind == "average":  # a collective of a training loop of the user's own (GossipNode)
            if self.on_average is not None:
                self.on_average(msg)
        elif msg.kind == "state-reply":
            # wanted only while a joiner pulls a state, and a few at most: each holds a whole model
            if node is not None and self.status == "waiting" and msg.fingerprint == self.fingerprint \
                    and len(self._state_replies) < 8:
                self._state_replies.append(msg)
            else:
                self.control.reject(str(msg.sender), "unsolicited", "a state-reply nobody asked for")

    def _incarnation_of(self, sender: str) -> int | None:
        with self.lock:
            member = self.membership.members.get(sender)
        return member.incarnation if member is not None else None

    def _note_incarnation(self, sender: str) -> None:
        """A member that restarted (new incarnation) numbers its messages afresh."""
        inc = self._incarnation_of(sender)
        if self._incarnations.get(sender, inc) != inc and self.node is not None:
            self.node.forget_sender(sender)
        self._incarnations[sender] = inc

    def node_rejected_from(self, msg: Message) -> None:
        node = self.node
        assert node is not None
        for reason, n in node.rejected.items():
            if n > self.node_rejected[reason]:
                self.node_rejected[reason] = n
                self.control.reject(str(msg.sender), reason, count=False)  # counted by the node already

    def finish(self) -> None:
        """Keep serving until every other member is done (or gone), or ``grace`` passes."""
        self.status = "done"
        if self.interrupted:
            return
        end = self.clock() + self.cfg.grace
        while self.clock() < end and not self.stop.is_set():
            with self.lock:
                busy = [m for k, m in self.membership.members.items() if k != self.id and m.status != "done"]
            if not busy:
                return
            self._service(0.05)

    # -- outputs ---------------------------------------------------------------------------
    def neighbor_distance(self) -> float:
        node = self.node
        return node.neighbor_distance() if node is not None else math.nan

    def _log_metrics(self, event: str, extra: dict | None = None) -> dict[str, Any]:
        node = self.node
        assert node is not None
        ev = self.task.evaluate(node.model, self.device) if self.task is not None else {}
        rec = {"event": event, "node": self.id, "time": self.clock() - self.t0, "step": node.step,
               "round": node.round, "train_loss": node.pop_mean_loss(), "loss": ev.get("loss"),
               "accuracy": ev.get("accuracy"), "neighbor_distance": node.neighbor_distance(),
               "bytes_sent": sum(self.transport.bytes_sent.values()),
               "bytes_received": sum(self.transport.bytes_received.values()), **(extra or {})}
        if "perplexity" in ev:
            rec["perplexity"] = ev["perplexity"]
        if self._metrics is not None:
            self._metrics.write(json.dumps(rec, default=_jsonable) + "\n")
            self._metrics.flush()
        return rec

    def summary(self) -> dict[str, Any]:
        """The final figures (``gossip-node --json``)."""
        node = self.node
        sent, received = self.transport.bytes_sent, self.transport.bytes_received
        by_class: Counter[str] = Counter()
        with self.lock:  # members that said goodbye are gone from the table, not from the byte counts
            dcs = {**self._dcs, **{k: m.dc for k, m in self.membership.members.items()}}
        for peer, n in sent.items():
            by_class["inter" if dcs.get(peer, self.cfg.dc) != self.cfg.dc else "intra"] += n
        rejected = Counter(self.control.rejected)
        rejected.update(self.transport.rejected)
        if node is not None:
            rejected.update(node.rejected)
        out: dict[str, Any] = {"node": self.id, "steps": node.step if node else 0, "rounds": node.round if node else 0}
        if node is not None:
            ev = self.task.evaluate(node.model, self.device) if self.task is not None else {}
            out.update(final_loss=ev.get("loss"), final_accuracy=ev.get("accuracy"),
                       params_sha256=node.state.sha256(), neighbor_distance=node.neighbor_distance(),
                       missing_neighbors=node.mix_totals.missing, members=len(node.members))
            if "perplexity" in ev:
                out["final_perplexity"] = ev["perplexity"]
        if node is not None:
            report = node.rule.report()
            if "copies_sha" in report:  # indices -> member ids, comparable across nodes
                report["copies_sha"] = {node.members[j]: h for j, h in report["copies_sha"].items()
                                        if j < len(node.members)}
            out["mixing"] = report
        if self.shaper is not None:
            out["emulated_losses"] = self.transport.emulated_losses
        if self.security is not None:
            out["curve"] = self.security.report()
        out.update(bytes_sent=sum(sent.values()), bytes_received=sum(received.values()),
                   bytes_intra=by_class.get("intra", 0), bytes_inter=by_class.get("inter", 0),
                   dropped=sum(self.transport.dropped.values()),
                   rejected={k: v for k, v in sorted(rejected.items()) if v},
                   # ROUTER connection events; a message above max_message_bytes is dropped by
                   # ZeroMQ, which closes the sender's connection: it shows up as "disconnected"
                   connections=dict(sorted(self.transport.events.items())),
                   max_message_bytes=self.transport.max_message_size, joined=self.joined, rejoins=self.rejoins,
                   merges=self.merges,
                   state_from=self.state_from, resumed_from=self.resumed_from, interrupted=self.interrupted,
                   device=str(self.device), wall_time_s=self.clock() - self.t0, train_time_s=self.train_seconds,
                   max_step_gap_s=self.max_step_gap, timed_out_rounds=self.timed_out_rounds, recoveries=node.recoveries if node is not None else 0,
                   held_sends=node.held_sends if node is not None else 0,
                   steps_per_s=self.trained_steps / self.train_seconds if self.train_seconds > 0 else None)
        if self._metrics is not None and node is not None:
            self._metrics.write(json.dumps({"event": "summary", **out}, default=_jsonable) + "\n")
        return out


def _is_address(text: str) -> bool:
    try:
        return parse_address(text) == text
    except ValueError:
        return False


def _jsonable(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)
