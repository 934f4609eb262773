"""A group of K ranks as one member, on the wall clock: rank 0 leads, the others follow.

Rank 0 (:class:`GroupLeader`) runs a :class:`~gossip.peer.driver.Peer`, the
same protocol as ``gossip-node``, over its own shard: discovery, joins, the
control plane and its failure detector, new lives, merges, the finish. At each
exchange it publishes its :class:`~gossip.protocol.group.Decision` on the
group's link before mixing, so every rank mixes with the same members in the
same round. Ranks 1..K-1 (:class:`GroupFollower`) each run a
:class:`~gossip.protocol.group.ShardFollower` on a ZeroMQ transport of their own
at ``HOST:PORT+r``, exchanging only with rank r of the neighbour groups.

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
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gossip.core.actions import Release, Send, Wait
from gossip.core.message import Message
from gossip.peer.driver import Peer
from gossip.protocol.config import PeerConfig
from gossip.protocol.errors import PeerError
from gossip.protocol.group import (
    Decision,
    GroupLink,
    News,
    ShardFollower,
    group_of,
    rank_address,
)
from gossip.transport import wire
from gossip.transport.addresses import parse_address
from gossip.transport.links import SimNetwork, emulated_links
from gossip.transport.security import load_curve
from gossip.transport.zmq import ZmqTransport

__all__ = ["GroupLeader", "GroupFollower", "Start", "WAIT_FOREVER"]

log = logging.getLogger("gossip.group")

WAIT_FOREVER = 10 ** 9  # seconds: a follower waits as long as rank 0 does (its discovery, its joins)
LISTEN = 0.2  # seconds a follower waits for a decision before looking at its transport and rank 0's news
NEWS_EVERY = 0.2  # seconds between a training follower's looks at rank 0's news (more often while it waits)
POLL = 0.05  # seconds between a waiting follower's looks at its inbound messages and rank 0's dead


@dataclass(frozen=True)
class Start:
    """Where a life of the group starts training: its local step, and its data shard (the
    group's index among the members, of how many)."""

    step: int
    rank: int
    world: int


class _Shard(nn.Module):
    """A shard as a one-parameter module, so a node can take it as its model."""

    def __init__(self, flat: torch.Tensor) -> None:
        super().__init__()
        self.shard = nn.Parameter(flat, requires_grad=False)


class GroupLeader:
    """Rank 0 of a group: the member's whole protocol over its shard, publishing its decisions.

    Parameters
    ----------
    cfg : the peer's settings (``cfg.listen`` is the group's member id)
    shard : rank 0's shard (the node mixes it in place); ``fingerprint`` its layout
    link : the group's channel to ranks 1..K-1; ``size`` the group's ranks
    """

    def __init__(self, cfg: PeerConfig, shard: torch.Tensor, fingerprint: str, link: GroupLink, size: int) -> None:
        self.cfg = cfg
        self.shard = shard
        self.link = link
        self.size = size
        self.peer = Peer(cfg, model=_Shard(shard), fingerprint=fingerprint)
        self.life = self.peer.life
        self.life.group_size = size  # every rank hands its shard to a joiner at once (see _state_request)
        self.life.on_node = self._on_node
        self.life.on_state_request = self._state_request
        self.peer.on_tick = self._publish_alive
        self.seq = 0
        self.stopped = False
        self.resumed: tuple[str, dict] | None = None  # (path, state) of the group checkpoint resumed from
        self._alive_version = -1
        self._dead: tuple[str, ...] = ()
        self._known: tuple[tuple[str, int], ...] = ()
        self._mid: list[tuple[int, str, int, int]] = []  # hand-overs in the middle of a round (News)
        self._mid_number = 0

    def __enter__(self) -> "GroupLeader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peer.close()

    @property
    def joined(self) -> bool:
        return self.life.joined

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

    def _on_node(self, node: Any) -> None:
        node.state.rehome(into=self.shard)  # the node's flat state is the shard itself
        node.fingerprint = self.life.fingerprint  # the group's layout, not the one-parameter module's
        node._good = None  # the group's optimizer steps, not the node: no NaN-guard copy of the shard

    def _publish(self, kind: str, **fields: Any) -> Decision:
        self.seq += 1
        d = Decision(self.seq, kind, **fields)
        self.link.publish(d)
        return d

    def _publish_alive(self) -> None:
        """On the I/O thread, after each tick: the members rank 0 counts alive, when they changed
        (a rank waiting in a round stops waiting for one rank 0 no longer counts)."""
        with self.life.lock:
            version = self.life.membership.version
            if version == self._alive_version:
                return
            self._alive_version = version
            table = self.life.membership.members
            node = self.node
            self._dead = tuple(m for m in (node.members if node is not None else ()) if m not in table)
            self._known = tuple((m, x.incarnation) for m, x in sorted(table.items()) if m != self.id)
            news = News(self._dead, tuple(self._mid), self._known)
        self.link.publish_news(news)

    def _state_request(self, joiner: str) -> None:
        """A joiner asks for the state (the training thread, as the request is handled). Between
        rounds it waits for the next decision; in the middle of a round, which may wait for
        this very joiner (its first round), every rank hands over its shard of the round now."""
        node = self.node
        if node is None or node.waiting is None:
            if joiner not in self.life.handovers:
                self.life.handovers.append(joiner)
            return
        self._hand_over(joiner)
        with self.life.lock:
            self._mid_number += 1
            self._mid = [*self._mid[-7:], (self._mid_number, joiner, node.waiting[1], node.step)]
            news = News(self._dead, tuple(self._mid), self._known)
        self.link.publish_news(news)

    def _members(self) -> dict[str, tuple]:
        """The node's members as a decision carries them: ids, labels and lives."""
        node = self.node
        with self.life.lock:
            m = self.life.membership
            dcs = tuple(m.label(x) or self.life.dcs.get(x, "") for x in node.members)
            lives = tuple(self.life.incarnation if x == self.id else (m.life_of(x) or m.lives.get(x) or 0)
                          for x in node.members)
        return {"members": tuple(node.members), "dcs": dcs, "lives": lives}

    # -- the start of a life ---------------------------------------------------------------------
    def start(self) -> Start:
        """Find the cluster and start (or join) it; every rank then starts alike."""
        self.peer.transport.start()
        log.info("%s: rank 0 of a group of %d: listening (incarnation %d, model %s)", self.id, self.size,
                 self.peer.incarnation, self.peer.fingerprint)
        self.peer.report.open(self.cfg.log, self.cfg.tensorboard)
        mode = self.peer._run(self.life.discover())
        if mode is None:
            self._publish("exit")
            raise PeerError("stopped before training started")
        self.peer._start(mode)
        start = self._announce_start()
        self.peer.report.start_training(self.peer.clock() - self.peer.t0)
        self._started = self.peer.clock()
        self._first = self.node.step
        return start

    def _announce_start(self) -> Start:
        """Publish this life's start; a joining life waits until every rank holds its shard
        from the same donor round (asking the donor again while one is missing)."""
        node = self.node
        members = self._members()
        joining = self.life.joining
        rank, world = self.life.rank or 0, self.life.world_size or len(members["members"])
        while True:
            donor = joining.took_from
            d = self._publish("start", round=node.round, step=node.step, **members,
                              donor=donor[0] if donor else None, donor_round=donor[1] if donor else -1,
                              rank=rank, world=world, origin=self.peer.t0)
            if donor is None:
                break
            acks = self.link.acks(d.seq, WAIT_FOREVER)
            if acks is not None and all(acks):
                self._publish("go", round=node.round, step=node.step)
                break
            log.warning("%s: rank(s) %s of the group did not get their shard of round %d from %s; asking again",
                        self.id, ", ".join(str(r + 1) for r, ok in enumerate(acks or []) if not ok), donor[1],
                        donor[0])
            self.peer._run(joining.pull_again(donor[0], donor[1]))
        return Start(node.step, rank, world)

    # -- training --------------------------------------------------------------------------------
    def step(self, step: int) -> bool:
        """After local step ``step`` of every rank: an exchange when one is due, with the
        round's decision published first; a new life when the cluster dropped this group.
        Returns whether the shard changed (an exchange, or a new life's shards taken)."""
        peer, life = self.peer, self.life
        peer._service(0.0)
        node = self.node
        node.step = step
        now = peer.clock()
        if life.last_step_at is not None:
            life.max_step_gap = max(life.max_step_gap, now - life.last_step_at)
        life.last_step_at = now
        peer._after_compute()
        due = [ch for ch in node.channels if step % ch.period == 0]
        if not due:
            return False
        if life.stop.is_set():
            self._publish("stop", round=node.round, step=step)
            self.stopped = True
            return False
        if life.excluded is not None:
            self._publish("life", round=node.round, step=step)
            self._account()
            peer._rejoin()  # blocks until the cluster takes this group back, with a member's shards
            self._announce_start()
            self._first, self._started = self.node.step, peer.clock()
            return True
        life.apply_members()
        joiners = tuple(life.take_handovers())
        self._publish("round", round=node.round, step=step, **self._members(), handover=joiners)
        for j in joiners:  # before the round: the joiner's first round may be this one, which waits for it
            self._hand_over(j)
        for ch in due:
            peer._run(life.exchange(ch))
        return True

    def _account(self) -> None:
        """This life's training time and steps into the peer's figures."""
        life = self.life
        life.train_seconds += self.peer.clock() - self._started
        life.trained_steps += self.node.step - self._first
        self._first, self._started = self.node.step, self.peer.clock()

    def complete_pending(self) -> None:
        """With overlap, mix the rounds still in flight (the last exchange has none after it)."""
        self.peer.complete_pending()

    def record(self, evaluation: dict[str, Any]) -> None:
        """A metrics record of the group's evaluation (every rank evaluated the whole model)."""
        if self.peer.report.metrics is not None:
            self.peer.report.log_metrics("eval", time=self.peer.clock() - self.peer.t0, evaluation=evaluation)

    def _hand_over(self, joiner: str) -> None:
        msg = self.life.state_reply(joiner)
        self.peer._send_message(joiner, msg)

    @property
    def new_step(self) -> int:
        """The local step the node is at (after a new life, the donor's)."""
        return self.node.step

    def finish(self) -> None:
        """Serve the members still training (a joiner's shards too), then tell the ranks to exit."""
        life = self.life
        life.status = "done"
        if not life.interrupted:
            life.control.apply(life.control.announce_status())
            end = time.monotonic() + self.cfg.timing.grace
            while time.monotonic() < end and not life.stop.is_set():
                self.peer._service(POLL)
                joiners = tuple(life.take_handovers())
                if joiners:
                    node = self.node
                    self._publish("serve", round=node.round, step=node.step, handover=joiners)
                    for j in joiners:
                        self._hand_over(j)
                with life.lock:
                    busy = [m for k, m in life.membership.members.items() if k != self.id and m.status != "done"]
                if not busy:
                    break
        self._publish("exit")

    def summary(self, evaluation: dict[str, Any] | None = None) -> dict[str, Any]:
        self._account()
        out = self.peer.summary()
        out.update(group_size=self.size, rank=0, resumed_from=self.resumed[0] if self.resumed else out["resumed_from"])
        if evaluation:
            out.update(final_loss=evaluation.get("loss"), final_accuracy=evaluation.get("accuracy"))
        return out


class GroupFollower:
    """Rank ``rank`` (> 0) of a group: a :class:`ShardFollower` on its own transport, following rank 0."""

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
        self.dcs: dict[str, str] = {}  # member -> its datacenter label, from rank 0's decisions
        shard_bytes = shard.numel() * shard.element_size()
        host = parse_address(cfg.listen, "--listen").rpartition(":")[0]
        links = emulated_links(cfg.emulate)  # the same emulated links as rank 0's, from the same start
        self.shaper = None if links is None else SimNetwork(links, self._link_class, seed=cfg.seed + rank,
                                                             origin=self.t0, cache_classes=False)
        # CurveZMQ: this rank's own key pair (gossip-keys for every rank's address)
        self.security = load_curve(cfg.curve_keys, self.id) if cfg.curve_keys else None
        self.transport = ZmqTransport(self.id, f"tcp://{host}:{self.id.rpartition(':')[2]}",
                                      on_frames=self._on_frames, max_message_size=3 * shard_bytes + 2**20,
                                      shaper=self.shaper, curve=self.security)
        self.seq = 0
        self.stopped = False
        self.exited = False
        self.rejected: dict[str, int] = {}
        self.loss = math.nan
        self._news_at = -1.0
        self.connected: dict[str, int] = {}  # rank-r address -> the life its connection was opened for

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

    def record(self, evaluation: dict[str, Any]) -> None:
        pass  # rank 0 writes the group's records

    def complete_pending(self) -> None:
        node = self.follower.node
        for ch in node.channels:
            if ch.pending is not None:
                self._drive(node.complete(ch))

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

    def _next(self) -> Decision:
        """Rank 0's next decision (waiting as long as rank 0 takes, handling what arrives and
        rank 0's news meanwhile)."""
        self.seq += 1
        while True:
            d = self.link.next(self.seq, LISTEN)
            if d is not None:
                return d
            self._pump(0.0)
            self._look()

    # -- the start of a life ---------------------------------------------------------------------
    def start(self) -> Start:
        self.transport.start()
        d = self._next()
        return self._take_start(d)

    def _take_start(self, d: Decision) -> Start:
        while True:
            if d.kind == "exit":
                self.exited = True
                raise PeerError("rank 0 stopped before training started")
            if d.kind != "start":
                raise RuntimeError(f"{self.id}: expected rank 0's start, got {d.kind!r}")
            self.follower.apply(d)
            self._learn(d)
            if self.shaper is not None:  # the member's emulated links count from rank 0's start
                self.shaper.origin = d.origin
            self._connect(self._pairs(d))
            if d.donor is None:
                break
            ok = self._take(d)
            self.link.ack(d.seq, ok)
            nxt = self._next()
            if nxt.kind == "go":  # every rank holds its shard of one donor round
                break
            d = nxt  # a new start: rank 0 asked the donor again
        return Start(d.step, d.rank, d.world)

    def _take(self, d: Decision) -> bool:
        deadline = self.clock() + max(2.0, self.cfg.timeout)
        while self.clock() < deadline:
            self._pump(POLL)
            if self.follower.take(d):
                return True
        return self.follower.take(d)

    def _link_class(self, u: str, v: str) -> str:
        """intra or inter: whether the two ranks' groups carry different datacenter labels."""
        own = self.cfg.dc
        du = self.dcs.get(group_of(u, self.rank), own) if u != self.id else own
        dv = self.dcs.get(group_of(v, self.rank), own) if v != self.id else own
        return "inter" if du != dv else "intra"

    def _learn(self, d: Decision) -> None:
        for m, dc in zip(d.members, d.dcs):
            if dc:
                self.dcs[m] = dc

    def _pairs(self, d: Decision) -> list[tuple[str, int]]:
        """Rank r of each member of ``d``, with its member's life (0: not known)."""
        return list(zip(self.follower.addresses(d.members), d.lives or [0] * len(d.members)))

    def _connect(self, pairs: Any) -> None:
        """A fresh connection and a hello to each ``(address, life)`` not yet connected for that
        life (rank r of a member new to this rank, or of a member's new life): each is up
        before any round sends state on it (state is not held for a connection that is not
        up, and one that kept retrying an earlier life may reconnect only seconds later)."""
        fresh = []
        for a, life in pairs:
            if a == self.id or (a in self.connected and (not life or self.connected[a] == life)):
                continue
            self.connected[a] = life
            fresh.append(a)
        if not fresh:
            return
        hello = Message("hello", self.id, 0, 0, 0, None, None, {"group": self.cfg.node_id, "rank": self.rank},
                        self.follower.fingerprint)
        frames = wire.encode(hello)
        for a in fresh:
            self.transport.forget(a)
            self.transport.send(a, frames, droppable=False)

    def _look(self) -> News:
        """Rank 0's news: connections to open, hand-overs to make now."""
        news = self.link.news()
        self._connect((rank_address(m, self.rank), life) for m, life in news.known)
        for dst, msg in self.follower.news_handovers(news):
            self.transport.send(dst, wire.encode(msg), droppable=False)
        return news

    # -- training --------------------------------------------------------------------------------
    def step(self, step: int) -> bool:
        node = self.follower.node
        assert node is not None
        self._pump(0.0)
        now = self.clock()
        if now - self._news_at >= NEWS_EVERY:
            self._look()
            self._news_at = now
        node.step = step
        due = [ch for ch in node.channels if step % ch.period == 0]
        if not due:
            return False
        d = self._next()
        if d.kind == "stop":
            self.stopped = True
            return False
        if d.kind == "life":
            self.follower.status = "waiting"
            self._take_start(self._next())
            return True
        if d.kind != "round":
            raise RuntimeError(f"{self.id}: expected rank 0's round decision, got {d.kind!r}")
        self.follower.apply(d)
        self._learn(d)
        self._connect(self._pairs(d))
        for dst, msg in self.follower.hand_over(d.handover):  # before the round, as rank 0 does
            self.transport.send(dst, wire.encode(msg), droppable=False)
        for ch in due:
            self._drive(node.exchange(ch))
        return True

    def _drive(self, program: Any) -> None:
        try:
            action = next(program)
            while True:
                kind = type(action)
                if kind is Send:
                    self._send(action.messages)
                elif kind is Wait:
                    self._wait(action.timeout)
                elif kind is Release:
                    action.lease.wait(action.timeout)
                del action
                action = program.send(self.clock() - self.t0)
        except StopIteration:
            return

    def _send(self, messages: list) -> None:
        # (a function of its own: the frames, which hold the shard sent in place, are let go at
        # its return, so the transport alone decides when the shard is free again)
        encoded: dict[int, list] = {}
        for dst, msg in messages:
            frames = encoded.get(id(msg))
            if frames is None:  # one encoding per distinct message, shared by its receivers
                frames = encoded[id(msg)] = wire.encode(msg)
            self.transport.send(dst, frames)

    def _wait(self, timeout: float) -> None:
        node = self.follower.node
        assert node is not None
        deadline = self.clock() + timeout
        while not node.ready():
            now = self.clock()
            if now >= deadline:
                self.follower.timed_out_rounds += 1
                log.info("%s: round %d timed out waiting for %s", self.id, node.round, ", ".join(node.awaited()))
                return
            if now - self._news_at >= POLL:
                news, self._news_at = self._look(), now
                if self.follower.awaited_dead(news.dead):
                    self.follower.skipped_waits += 1
                    return
            self._pump(min(POLL, deadline - now))

    def finish(self) -> None:
        """Serve rank 0's handovers until it says the group is done."""
        while not self.exited:
            d = self._next()
            if d.kind == "exit":
                self.exited = True
            elif d.kind == "serve":
                for dst, msg in self.follower.hand_over(d.handover):
                    self.transport.send(dst, wire.encode(msg), droppable=False)

    def summary(self, evaluation: dict[str, Any] | None = None) -> dict[str, Any]:
        f = self.follower
        node = f.node
        return {"node": self.id, "group": self.cfg.node_id, "rank": self.rank,
                "steps": node.step if node else 0, "round": node.round if node else 0,
                "members": list(f.members), "timed_out_rounds": f.timed_out_rounds,
                "skipped_waits": f.skipped_waits, "handed": list(f.handed), "took": f.took,
                "rejected": {**f.rejected, **self.rejected, **(dict(node.rejected) if node else {})},
                "bytes_sent": sum(self.transport.bytes_sent.values()),
                "bytes_received": sum(self.transport.bytes_received.values())}
