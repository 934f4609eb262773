"""A group of K ranks as one member, on the wall clock: rank 0 leads, the others follow.

Rank 0 (:class:`GroupLeader`) runs a :class:`~gossip.peer.driver.Peer`, the
same protocol as ``gossip-node``, over its own shard, and drives the programs of
:class:`~gossip.protocol.ranks.GroupLead` with it: at each exchange rank 0
publishes its :class:`~gossip.protocol.group.Decision` on the group's link before
mixing, so every rank mixes with the same members in the same round. Ranks
1..K-1 (:class:`GroupFollower`) each drive :class:`~gossip.protocol.ranks.GroupFollow`
over a :class:`~gossip.protocol.group.ShardFollower` on a ZeroMQ transport of
their own at ``HOST:PORT+r``, exchanging only with rank r of the neighbour groups.
The simulator runs the same programs (:mod:`gossip.sim.cluster`).

Both have one interface, called on every rank by the group's training loop
(whose local steps are the group's collectives, DDP or FSDP, so the ranks go
step by step together): :meth:`start` (returns where training starts),
:meth:`step` after every local step (an exchange when one is due), and
:meth:`finish`, :meth:`close`. The link (:class:`~gossip.protocol.group.GroupLink`)
is torchrun's store in a real group; nothing here waits in a collective while
rank 0 alone waits (discovery, a join), so no collective times out.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from typing import Any, Iterable, Sequence

import torch

from gossip.core.actions import Poll, Release, Send
from gossip.core.message import Message
from gossip.peer.driver import Peer
from gossip.protocol.config import PeerConfig
from gossip.protocol.errors import PeerError
from gossip.protocol.group import GroupLink, ShardFollower, ShardModule
from gossip.protocol.ranks import GroupFollow, GroupLead, Start
from gossip.transport import wire
from gossip.transport.addresses import parse_address
from gossip.transport.links import SimNetwork, emulated_links, emulation_origin
from gossip.transport.security import load_curve
from gossip.transport.zmq import ZmqTransport

__all__ = ["GroupLeader", "GroupFollower", "Start", "rank_counts"]

log = logging.getLogger("gossip.group")


class GroupLeader:
    """Rank 0 of a group on the wall clock: a :class:`~gossip.peer.driver.Peer` over its shard,
    running :class:`~gossip.protocol.ranks.GroupLead`'s programs.

    Parameters
    ----------
    cfg : the peer's settings (``cfg.listen`` is the group's member id)
    shard : rank 0's shard (the node mixes it in place); ``fingerprint`` its layout
    link : the group's channel to ranks 1..K-1; ``size`` the group's ranks
    """

    def __init__(self, cfg: PeerConfig, shard: torch.Tensor, fingerprint: str, link: GroupLink, size: int) -> None:
        self.cfg = cfg
        self.size = size
        self.peer = Peer(cfg, model=ShardModule(shard), fingerprint=fingerprint)
        self.life = self.peer.life
        self.lead = GroupLead(self.life, size, link, shard)
        self.peer.on_tick = self.lead.publish_alive
        self.resumed: tuple[str, dict] | None = None  # (path, state) of the group checkpoint resumed from

    def __enter__(self) -> "GroupLeader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peer.close()

    @property
    def joined(self) -> bool:
        return self.life.joined

    @property
    def stopped(self) -> bool:
        return self.lead.stopped

    @property
    def loss(self) -> float:
        return self.node.last_loss if self.node is not None else math.nan

    @loss.setter
    def loss(self, value: float) -> None:
        node = self.node
        node.last_loss = value
        node.loss_sum += value
        node.loss_count += 1

    @property
    def id(self) -> str:
        return self.peer.id

    @property
    def node(self) -> Any:
        return self.peer.node

    def listen(self) -> None:
        """Bind this rank's socket (before rank 0 says hello anywhere, every rank listens:
        see :func:`gossip.groups.run.run_group`)."""
        if not self.peer.transport.listening:
            self.peer.transport.start()

    def start(self) -> Start:
        """Find the cluster and start (or join) it; every rank then starts alike."""
        self.listen()
        log.info("%s: rank 0 of a group of %d: listening (incarnation %d, model %s)", self.id, self.size,
                 self.peer.incarnation, self.peer.fingerprint)
        self.peer.report.open(self.cfg.log, self.cfg.tensorboard)
        start = self.peer._run(self.lead.start(origin=self.peer.t0))
        if start is None:
            raise PeerError("stopped before training started")
        self.peer.report.start_training(self.peer.clock() - self.peer.t0, evaluate=False)  # (see record)
        return start

    def step(self, step: int) -> bool:
        """After local step ``step`` of every rank: see :meth:`GroupLead.after_step`."""
        if self.peer.on_step is not None:  # the progress bar (the group's loop records its evaluations)
            self.peer.on_step(self.peer)
        return self.peer._run(self.lead.after_step(step))

    def complete_pending(self) -> None:
        self.peer._run(self.lead.complete_pending())

    @property
    def round_counts(self) -> tuple[int, int]:
        """(rounds this rank timed out, rounds it mixed without a suspected neighbour)."""
        return self.peer.life.timed_out_rounds, self.peer.life.skipped_rounds

    def record(self, evaluation: dict[str, Any]) -> None:
        """A metrics record of the group's evaluation (every rank evaluated the whole model)."""
        if self.peer.report.metrics is not None:
            self.peer.report.log_metrics("eval", time=self.peer.clock() - self.peer.t0, evaluation=evaluation)

    def finish(self) -> None:
        self.peer._run(self.lead.finish())

    def summary(self, evaluation: dict[str, Any] | None = None) -> dict[str, Any]:
        out = self.peer.summary(evaluation)
        out.update(group_size=self.size, rank=0, resumed_from=self.resumed[0] if self.resumed else out["resumed_from"])
        return out


class GroupFollower:
    """Rank ``rank`` (> 0) of a group on the wall clock: :class:`~gossip.protocol.ranks.GroupFollow`'s
    programs over a :class:`ShardFollower`, on a ZeroMQ transport of its own."""

    def __init__(self, cfg: PeerConfig, rank: int, shard: torch.Tensor, fingerprint: str, link: GroupLink) -> None:
        self.cfg = cfg
        self.rank = rank
        self.link = link
        self.follower = ShardFollower(rank, cfg.node_id, shard, fingerprint, mixing=cfg.mixing,
                                      topology=cfg.topology, timeout=cfg.timeout, seed=cfg.seed)
        self.id = self.follower.id
        self.inbound: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.clock = time.monotonic
        self.t0 = self.clock()
        self.follow = GroupFollow(self.follower, link, send=self._send_one, connect=self._connect,
                                  timeout=cfg.timeout, origin=self.t0)
        shard_bytes = shard.numel() * shard.element_size()
        host = parse_address(cfg.listen, "--listen").rpartition(":")[0]
        links = emulated_links(cfg.emulate)  # the same emulated links as rank 0's, from the same start
        self.shaper = None if links is None else SimNetwork(
            links, self._link_class, seed=cfg.seed + rank, origin=emulation_origin(cfg.emulate_origin, self.t0),
            cache_classes=False)
        # CurveZMQ: this rank's own key pair (gossip-keys for every rank's address)
        self.security = load_curve(cfg.curve_keys, self.id) if cfg.curve_keys else None
        self.transport = ZmqTransport(self.id, f"tcp://{host}:{self.id.rpartition(':')[2]}",
                                      on_frames=self._on_frames, max_message_size=3 * shard_bytes + 2**20,
                                      shaper=self.shaper, curve=self.security)
        self.rejected: dict[str, int] = {}
        self.loss = math.nan

    def __enter__(self) -> "GroupFollower":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.transport.close()

    @property
    def node(self) -> Any:
        return self.follower.node

    @property
    def joined(self) -> bool:
        return self.follower.took is not None

    @property
    def stopped(self) -> bool:
        return self.follow.stopped

    @property
    def round_counts(self) -> tuple[int, int]:
        """(rounds this rank timed out, round waits it ended because rank 0 holds the awaited dead)."""
        return self.follower.timed_out_rounds, self.follower.skipped_waits

    def record(self, evaluation: dict[str, Any]) -> None:
        pass  # rank 0 writes the group's records

    def _on_frames(self, ident: bytes, frames: list) -> None:  # the I/O thread
        try:
            msg = wire.decode(frames)
        except wire.WireError as e:
            self.rejected[e.reason] = self.rejected.get(e.reason, 0) + 1
            return
        if msg.sender != ident.decode(errors="replace"):
            self.rejected["sender-mismatch"] = self.rejected.get("sender-mismatch", 0) + 1
            return
        self.inbound.put(msg)

    def _pump(self, block: float) -> None:
        try:
            msg = self.inbound.get(timeout=block) if block > 0 else self.inbound.get_nowait()
        except queue.Empty:
            return
        while True:
            self.follower.handle(msg)
            try:
                msg = self.inbound.get_nowait()
            except queue.Empty:
                return

    def _link_class(self, u: str, v: str) -> str:
        return self.follow.link_class(u, v, self.cfg.dc)

    def _send_one(self, dst: str, msg: Message) -> None:
        self.transport.send(dst, wire.encode(msg), droppable=False)

    def _connect(self, addresses: list[str]) -> None:
        """A fresh connection and a hello to each address (one that kept retrying an earlier
        life may reconnect only seconds later)."""
        if self.shaper is not None and self.follow.group_origin is not None and self.cfg.emulate_origin is None:
            self.shaper.origin = self.follow.group_origin  # the member's emulated links count from rank 0's start
        hello = Message("hello", self.id, 0, 0, 0, None, None, {"group": self.cfg.node_id, "rank": self.rank},
                        self.follower.fingerprint)
        frames = wire.encode(hello)
        for a in addresses:
            self.transport.forget(a)
            self.transport.send(a, frames, droppable=False)

    def _run(self, program: Any) -> Any:
        """Advance a follower program with the wall clock. Returns what the program returns."""
        started = False
        while True:
            try:
                action = program.send(self.clock()) if started else next(program)
            except StopIteration as e:
                return e.value
            started = True
            self._pump(0.0)
            kind = type(action)
            if kind is Poll:
                if action.timeout > 0:
                    want = self.follow.waiting_for
                    if want is not None:  # rank 0's next decision: wake as soon as it is there
                        self.link.next(want, action.timeout)
                    else:
                        self._pump(action.timeout)
            elif kind is Send:
                self._send(action.messages)
            elif kind is Release:
                action.lease.wait(action.timeout)
            del action  # nothing here may keep a sent message alive (see NodeConfig.live_sends)

    def _send(self, messages: list) -> None:
        # (a function of its own: the frames, which hold the shard sent in place, are let go at
        # its return, so the transport alone decides when the shard is free again)
        encoded: dict[int, list] = {}
        for dst, msg in messages:
            frames = encoded.get(id(msg))
            if frames is None:  # one encoding per distinct message, shared by its receivers
                frames = encoded[id(msg)] = wire.encode(msg)
            self.transport.send(dst, frames)

    def listen(self) -> None:
        """Bind this rank's socket (see :meth:`GroupLeader.listen`)."""
        if not self.transport.listening:
            self.transport.start()

    def start(self) -> Start:
        self.listen()
        return self._run(self.follow.start())

    def step(self, step: int) -> bool:
        return self._run(self.follow.after_step(step))

    def complete_pending(self) -> None:
        self._run(self.follow.complete_pending())

    def finish(self) -> None:
        self._run(self.follow.finish())

    def summary(self, evaluation: dict[str, Any] | None = None) -> dict[str, Any]:
        f = self.follower
        node = f.node
        return {"node": self.id, "group": self.cfg.node_id, "rank": self.rank,
                "steps": node.step if node else 0, "round": node.round if node else 0,
                "members": list(f.members), "joined": self.joined, "timed_out_rounds": f.timed_out_rounds,
                "skipped_waits": f.skipped_waits, "handed": list(f.handed), "took": f.took,
                "rejected": {**f.rejected, **self.rejected, **(dict(node.rejected) if node else {})},
                "bytes_sent": sum(self.transport.bytes_sent.values()),
                "bytes_received": sum(self.transport.bytes_received.values())}


def rank_counts(counts: Iterable[Sequence[int]]) -> dict[str, list[int]]:
    """A group summary's round counters, one per rank (rank 0's are its ``timed_out_rounds``
    and ``skipped_rounds``): a rank other than 0 that timed out a round, or ended a round's
    wait because rank 0 holds the awaited neighbour dead, mixed its shard otherwise than
    the others."""
    return {"rank_timed_out_rounds": [int(c[0]) for c in counts], "rank_skipped_rounds": [int(c[1]) for c in counts]}
