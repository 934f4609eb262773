"""A real gossip node: the same :class:`~gossip.training.node.Node` program, driven by the
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

import logging
import math
import queue
import time
from typing import Any

import torch

from gossip.core.actions import Compute, Poll, Release, Send
from gossip.core.message import Message
from gossip.core.state import FlatState, fingerprint_of, model_spec
from gossip.peer.report import Reporter
from gossip.protocol.config import PeerConfig
from gossip.protocol.lifecycle import Lifecycle
from gossip.training.node import Node, init_model, resolve_device
from gossip.training.tasks import get_task
from gossip.transport import wire
from gossip.transport.addresses import parse_address
from gossip.transport.links import SimNetwork, emulated_links, emulation_origin
from gossip.transport.security import load_curve
from gossip.transport.zmq import ZmqTransport

__all__ = ["Peer"]

log = logging.getLogger("gossip.peer")

def _wall_incarnation(previous: int) -> int:
    """A new life's incarnation: microseconds of the wall clock, above the previous one."""
    return max(time.time_ns() // 1000, previous + 1)


class Peer:
    """One real node: the wall-clock driver of a :class:`~gossip.protocol.lifecycle.Lifecycle`
    over ZeroMQ. ``Peer(cfg).run()`` returns the final summary dict.

    The lifecycle (discovery, joins, training, new lives, the finish) and its control
    plane hold the protocol; this class owns the sockets and threads, answers the
    lifecycle's actions with ``time.monotonic`` and hands what the I/O thread
    received for the training side over through a queue.
    """

    def __init__(self, config: PeerConfig, task: Any = None, *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, fingerprint: str | None = None) -> None:
        if config.tensorboard:
            from gossip.peer.tensorboard_log import require_tensorboard

            require_tensorboard()  # the install command, before anything starts
        self.cfg = config
        self.id = config.node_id
        # the first life's incarnation is the wall-clock time of the driver's origin t0 (what a
        # node's log says it started at; --emulate down windows count from t0)
        incarnation = time.time_ns() // 1000
        self.clock = time.monotonic
        self.t0 = self.clock()
        if model is not None:  # a training loop of the caller's own (gossip.peer.user_loop.GossipNode)
            the_task = None
            device = next(model.parameters()).device
            fingerprint = fingerprint or fingerprint_of(model)  # (a group's: its shard layout)
            spec = model_spec(model)
            self.model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        else:
            the_task = get_task(config.task if task is None else task)
            device = resolve_device(config.device)
            # the model fingerprint is needed before the node exists (hello carries it)
            probe_model = init_model(the_task, config.seed, "cpu")
            probe = FlatState(probe_model)
            fingerprint = probe.fingerprint
            spec = model_spec(probe_model)
            self.model_bytes = probe.nbytes
            # The first optimizer makes torch import its compiler stack (seconds on a busy
            # machine): pay that now, before peers can be kept waiting for us to start.
            the_task.optimizer(probe_model.parameters())
            del probe, probe_model
        self.task, self.device, self.fingerprint = the_task, device, fingerprint
        self.inbound: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.on_step: Any = None  # called with this peer after every training step (gossip-node's progress bar)
        self.on_tick: Any = None  # called on the I/O thread after every tick of the control plane
        self.life = Lifecycle(config, task=the_task, device=device, fingerprint=fingerprint,
                              incarnation=incarnation, send=self._send_message,
                              reconnect=self._reconnect, new_incarnation=_wall_incarnation, origin=self.t0,
                              clock=self.clock, model=model, optimizer=optimizer)
        self.life.to_node = self.inbound.put  # the I/O thread hands them to the training thread
        self.control.model_spec = spec  # a peer with another model is told which tensor differs
        # a state-reply carries the parameters, each outer optimizer's momentum and the inner
        # optimizer's state (two copies for Adam; a larger state travels without it, see Node.handover)
        mixing = config.mixing
        momenta = sum(1 for c in ("intra", "inter") if mixing.for_link(c).outer.momentum > 0) \
            if mixing.link_policy else int(mixing.outer.momentum > 0)
        copies = 3 + momenta
        cap = config.max_message_mb * 2**20 if config.max_message_mb else copies * self.model_bytes + 2**20
        self.life.handover_limit = int(cap) - 2**17  # (the header and framing)
        listen = "tcp://" + parse_address(config.listen, "--listen")
        links = emulated_links(config.emulate)
        self.shaper = None if links is None else SimNetwork(
            links, self._link_class, seed=config.seed, origin=emulation_origin(config.emulate_origin, self.t0),
            cache_classes=False)
        # CurveZMQ: a bad key directory is a ValueError naming what is wrong (gossip-node exits 2)
        self.security = load_curve(config.curve_keys, self.id) if config.curve_keys else None
        self.transport = ZmqTransport(self.id, listen, on_frames=self.control.on_frames, on_tick=self._tick,
                                      tick=config.timing.tick, max_message_size=int(cap),
                                      shaper=self.shaper, curve=self.security)
        self.life.live_sends = self.transport.holds_sends
        self.report = Reporter(self.life, self.transport, security=self.security, shaper=self.shaper)

    # -- the parts' state, as the training loops of the callers' own read it ----------------
    @property
    def node(self) -> Node | None:
        return self.life.node

    @property
    def control(self) -> Any:
        return self.life.control

    @property
    def membership(self) -> Any:
        return self.life.membership

    @property
    def lock(self) -> Any:
        return self.life.lock

    @property
    def stop(self) -> Any:
        return self.life.stop

    @property
    def incarnation(self) -> int:
        return self.life.incarnation

    @property
    def status(self) -> str:
        return self.life.status

    @status.setter
    def status(self, value: str) -> None:
        self.life.status = value

    @property
    def serving(self) -> bool:
        return self.life.serving

    @serving.setter
    def serving(self, value: bool) -> None:
        self.life.serving = value

    @property
    def on_average(self) -> Any:
        return self.life.on_average

    @on_average.setter
    def on_average(self, value: Any) -> None:
        self.life.on_average = value

    @property
    def interrupted(self) -> bool:
        return self.life.interrupted

    @property
    def _excluded(self) -> int | None:
        return self.life.excluded

    joined = property(lambda self: self.life.joined)
    rejoins = property(lambda self: self.life.rejoins)
    merges = property(lambda self: self.life.merges)
    state_from = property(lambda self: self.life.state_from)
    resumed_from = property(lambda self: self.life.resumed_from)
    rank = property(lambda self: self.life.rank)
    world_size = property(lambda self: self.life.world_size)

    # -- shared with the I/O thread --------------------------------------------------------
    def _send_message(self, dst: str, msg: Message) -> None:
        self.transport.send(dst, wire.encode(msg), droppable=False)  # control traffic

    def _reconnect(self, peer: str) -> None:
        if peer != self.id:
            self.transport.forget(peer)

    def _on_excluded(self, rnd: int, by: str, cluster: set[str], merge: bool) -> None:
        self.life.on_excluded(rnd, by, cluster, merge)

    def _tick(self, now: float) -> None:
        fx = self.control.tick(now)
        self.control.apply(fx)
        for d in fx.dead:
            self.transport.forget(d)
        if self.on_tick is not None:
            self.on_tick()

    def _link_class(self, u: str, v: str) -> str:
        """intra or inter: whether the two members carry different datacenter labels.

        Asked for every message (labels arrive as members are heard). A member
        removed from the table (declared dead, gone), or learned again from a
        list without its label, keeps the label it had when this node trained
        with it: the hellos that probe it must cross the same emulated link as
        before, or a cut between datacenters would let them through. Only a peer
        never labelled counts as this node's own.
        """
        with self.lock:
            du = self._dc_of(u) or self.cfg.dc
            dv = self._dc_of(v) or du
        return "inter" if du != dv else "intra"

    def _dc_of(self, mid: str) -> str:
        """The datacenter label of ``mid``: the member table's, else the last one this
        node trained with ("" if never known). Call with ``lock`` held."""
        m = self.membership.members.get(mid)
        return (m.dc if m is not None else "") or self.life.dcs.get(mid, "")

    def request_stop(self) -> None:
        """Stop after the current step (signal handlers call this)."""
        self.life.interrupted = True
        self.life.stop.set()

    # -- lifecycle -------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Discover, train the task, finish; returns the summary (see :meth:`summary`)."""
        try:
            if self.start():
                self.train()
                while self.life.excluded is not None and not self.stop.is_set():
                    self._rejoin()
                    self.train()
                self.finish()
            return self.summary()
        finally:
            self.close()

    def start(self) -> bool:
        """Bind, find the cluster and build the node; False if stopped before starting.

        Raises :class:`~gossip.transport.zmq.BindError` if the address is taken,
        :class:`PeerError` if no peer will mix with us, and its subclass
        :class:`~gossip.protocol.joining.ClusterFinished` if the cluster it would join
        has finished training.
        """
        self.transport.start()
        log.info("%s: listening (incarnation %d, model %s)", self.id, self.incarnation, self.fingerprint)
        self.report.open(self.cfg.log, self.cfg.tensorboard)
        return bool(self._run(self.life.start()))

    def _start(self, mode: str) -> None:
        self._run(self.life.begin(mode))

    def _rejoin(self) -> None:
        self._run(self.life.rejoin())

    def close(self) -> None:
        """Say goodbye and release the sockets (idempotent)."""
        if self.transport._thread is not None:
            self.control.apply(self.control.goodbye("done" if not self.interrupted else "stopped"))
            time.sleep(0.05)  # let the I/O thread flush the goodbye
            self.transport.close()
        self.report.close()

    def train(self) -> None:
        """Run the task's training program to the end (or until stopped)."""
        assert self.node is not None and self.node.stream is not None, \
            "train() needs a task; use step() for your own loop"
        self.report.start_training(self.clock() - self.t0)
        self._run(self.life.train(), self._after_compute)

    def _after_compute(self) -> None:
        if self.on_step is not None:
            self.on_step(self)
        self.report.after_step(self.clock() - self.t0)

    def step(self) -> None:
        """For a training loop of your own: call once after each ``optimizer.step()``.

        Counts a local step; every ``period`` steps it exchanges with the
        neighbours and mixes (blocking for a synchronous round, as D-PSGD does).
        """
        if self.node is None:
            raise RuntimeError("call start() before step()")
        self._service(0.0)
        if self.life.excluded is not None and not self.stop.is_set():
            self._rejoin()  # blocks until the cluster takes us back, with a neighbour's state
        node = self.node
        assert node is not None
        node.step += 1
        due = [ch for ch in node.channels if node.step % ch.period == 0]
        if due:
            self.life.apply_members()
            for ch in due:
                self._run(self.life.exchange(ch))

    def complete_pending(self) -> None:
        """With overlap, mix the rounds still in flight (the end of a loop of your own)."""
        node = self.node
        if node is not None:
            for ch in node.channels:
                if ch.pending is not None:
                    self._run(self.life.drive(node.complete(ch)))

    def finish(self) -> None:
        """Keep serving until every other member is done (or gone), or ``grace`` passes."""
        self._run(self.life.finish())

    def _apply_members(self) -> None:
        self.life.apply_members()

    def _drive(self, program: Any, after_step: Any) -> None:
        """Advance a node program with the wall clock (``after_step()`` after each
        local step says whether to go on)."""
        self._run(self.life.drive(program, lambda now: after_step()))

    def _run(self, program: Any, after_compute: Any = None) -> Any:
        """Advance a lifecycle program with the wall clock: the real-world driver.
        Returns what the program returns."""
        started = False
        while True:
            now = self.clock()
            try:
                action = program.send(now) if started else next(program)
            except StopIteration as e:
                return e.value
            started = True
            self._service(0.0)
            kind = type(action)
            if kind is Poll:
                if action.timeout > 0:
                    self._service(action.timeout)
            elif kind is Compute:
                if after_compute is not None:
                    after_compute()
            elif kind is Send:
                self._send(action.messages)
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

    def _service(self, block: float) -> None:
        """Handle what the I/O thread handed over: state messages, state requests and replies."""
        try:
            msg = self.inbound.get(timeout=block) if block > 0 else self.inbound.get_nowait()
        except queue.Empty:
            return
        while True:
            self.life.handle(msg)
            try:
                msg = self.inbound.get_nowait()
            except queue.Empty:
                return

    # -- outputs ---------------------------------------------------------------------------
    def neighbor_distance(self) -> float:
        node = self.node
        return node.neighbor_distance() if node is not None else math.nan

    def summary(self, evaluation: dict[str, Any] | None = None) -> dict[str, Any]:
        """The final figures (``gossip-node --json``); ``evaluation``: the model's, when the
        caller evaluated it (a group's whole model), else the task's of the node's own."""
        return self.report.summary(self.clock() - self.t0, evaluation)
