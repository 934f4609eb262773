"""The ranks of a group as programs (sans-IO): what rank 0 decides and how the others follow.

A driver runs a group's training loop on every rank (the group's local steps are
its collectives, DDP or FSDP, so the ranks go step by step together) and, on each
rank, runs these programs around the steps: ``start()`` (returns where training
starts), ``after_step(step)`` (an exchange when one is due), ``complete_pending()``
and ``finish()``. They yield the actions of :mod:`gossip.core.actions` (``Poll``,
``Send``, ``Release``) and never touch a clock or a socket, so the wall-clock
driver (:mod:`gossip.peer.group`) and the simulator (:mod:`gossip.sim.cluster`)
run the very same decisions.

:class:`GroupLead` (rank 0) runs the peer's :class:`~gossip.protocol.lifecycle.Lifecycle`
over its shard and publishes a :class:`~gossip.protocol.group.Decision` at every
point where the other ranks must act alike: a life's start, each exchange (with the
round's members and the joiners to hand over to), a stop, a new life, serving after
the end, the exit. :class:`GroupFollow` (rank r > 0) reads them in order and runs
its :class:`~gossip.protocol.group.ShardFollower` accordingly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from gossip.core.actions import POLL0, Poll, Program, Wait
from gossip.core.message import Message
from gossip.protocol.errors import PeerError
from gossip.protocol.group import Decision, GroupLink, News, ShardFollower, bind_shard, group_of, rank_address
from gossip.protocol.joining import ClusterFinished, ClusterGone

__all__ = ["Start", "GroupLead", "GroupFollow", "POLL", "LISTEN", "NEWS_EVERY"]

log = logging.getLogger("gossip.group")

DEAD_ROUNDS = 8  # the rounds before rank 0's that its news says the dead of (a rank lags a round or two)
POLL = 0.05  # seconds between looks at the link (acks, a decision) and at a waiting round's dead
LISTEN = 0.2  # seconds a follower waits for a decision before looking at rank 0's news again
NEWS_EVERY = 0.2  # seconds between a training follower's looks at rank 0's news
HANDOVERS = 64  # joiners queued for the next exchange at most (as Lifecycle's own queue)


@dataclass(frozen=True)
class Start:
    """Where a life of the group starts training: its local step, and its data shard (the
    group's index among the members, of how many)."""

    step: int
    rank: int
    world: int


class GroupLead:
    """Rank 0 of a group: the member's whole protocol over its shard, publishing its decisions.

    Parameters
    ----------
    life : rank 0's lifecycle over a :class:`~gossip.protocol.group.ShardModule` of ``shard``,
        its fingerprint rank 0's layout
    size : the group's ranks
    link : the group's channel to ranks 1..K-1
    shard : rank 0's shard: every node the lifecycle builds mixes it in place
    """

    def __init__(self, life: Any, size: int, link: GroupLink, shard: Any) -> None:
        self.life = life
        self.size = size
        self.link = link
        life.group_size = size  # every rank hands its shard to a joiner at once (see state_request)
        life.step_budget = True  # the group's loop runs cfg.steps steps
        life.on_state_request = self.state_request
        then = life.on_node

        def on_node(node: Any) -> None:
            bind_shard(node, shard, life.fingerprint)
            if then is not None:
                then(node)

        life.on_node = on_node
        self.seq = 0
        self.starts = 0  # start decisions published (a life's, or a start asked again)
        self.stopped = False
        self._alive_version: tuple[int, int | None] | None = None  # (member table version, round) last looked at
        self._dead: tuple[tuple[int, tuple[str, ...]], ...] = ()
        self._known: tuple[tuple[str, int], ...] = ()
        self._mid: list[tuple[int, str, int, int]] = []  # hand-overs in the middle of a round (News)
        self._mid_number = 0
        self._open: int | None = None  # the round of the exchange under way, until its mix
        self._first = 0  # this life's first step, and when it began training
        self._started = 0.0

    @property
    def id(self) -> str:
        return self.life.id

    @property
    def node(self) -> Any:
        return self.life.node

    def publish(self, kind: str, **fields: Any) -> Decision:
        self.seq += 1
        d = Decision(self.seq, kind, **fields)
        self.starts += kind == "start"
        self.link.publish(d)
        return d

    def publish_alive(self) -> None:
        """After each control tick (a real driver's I/O thread): the members rank 0 counts
        alive, when they changed (a rank waiting in a round stops waiting for one rank 0 no
        longer counts; a rank connects early to a member it has not met)."""
        life = self.life
        with life.lock:
            node = life.node
            suspects = tuple(m for m in node.members if life.control.detector.suspected(m)) if node is not None else ()
            version = (life.membership.version, node.round if node is not None else None, suspects)
            if version == self._alive_version:
                return
            self._alive_version = version
            table = life.membership.members
            # (a member may be gone for this round and train again from a later one: a new life;
            # a rank may still wait in a round before rank 0's for the old one)
            dead: tuple[tuple[int, tuple[str, ...]], ...] = ()
            if node is not None:
                rounds = range(max(0, node.round - DEAD_ROUNDS), node.round + 1)
                dead = tuple((q, ids) for q in rounds
                             if (ids := tuple(m for m in (node.members if q == node.round
                                                          else life.membership.at_round(q)) if life.gone(m, q))))
            known = tuple((m, x.incarnation) for m, x in sorted(table.items()) if m != self.id)
            if (dead, known) == (self._dead, self._known):
                return
            self._dead, self._known = dead, known
            news = News(self._dead, tuple(self._mid), self._known)
        self.link.publish_news(news)

    def state_request(self, joiner: str) -> None:
        """A joiner asks for the state (as the request is handled). Between rounds it waits
        for the next decision; in a round (from its decision until its mix), which may wait
        for this very joiner (its first round), every rank hands over its shard of the round
        now. (A request read as the round's own message goes out, after its decision took
        the hand-overs, is in the round too: queued, it waited out the round's --timeout on
        every member, CI on a loaded machine.)"""
        life, node = self.life, self.life.node
        in_round = node is not None and (node.waiting is not None or self._open == node.round)
        if not in_round:
            if joiner not in life.handovers and len(life.handovers) < HANDOVERS:
                life.handovers.append(joiner)
            return
        rnd = node.waiting[1] if node.waiting is not None else node.round
        self.hand_over(joiner)
        with life.lock:
            self._mid_number += 1
            self._mid = [*self._mid[-7:], (self._mid_number, joiner, rnd, node.step)]
            news = News(self._dead, tuple(self._mid), self._known)
        self.link.publish_news(news)

    def hand_over(self, joiner: str) -> None:
        self.life.send_message(joiner, self.life.state_reply(joiner))

    def members(self) -> dict[str, tuple]:
        """The node's members as a decision carries them: ids, labels and lives."""
        life, node = self.life, self.life.node
        with life.lock:
            m = life.membership
            dcs = tuple(m.label(x) or life.dcs.get(x, "") for x in node.members)
            lives = tuple(life.incarnation if x == self.id else (m.life_of(x) or m.lives.get(x) or 0)
                          for x in node.members)
        return {"members": tuple(node.members), "dcs": dcs, "lives": lives}

    # -- the start of a life ---------------------------------------------------------------------
    def start(self, origin: float = 0.0) -> Program:
        """Find the cluster and start (or join) it; every rank then starts alike. Returns the
        :class:`Start`, or None when stopped before training (the ranks are told to exit).
        ``origin``: the group's start on the driver's clock (the ranks' emulated links)."""
        life = self.life
        try:
            mode = yield from life.discover()
            while mode is not None:
                try:
                    yield from life.begin(mode)
                    break
                except ClusterGone as e:  # as Lifecycle.program: the cluster it waited for is gone
                    log.warning("%s: %s; looking for a cluster again", self.id, e)
                    yield from life.start_over()
                    mode = yield from life.discover()
        except BaseException as e:  # the ranks wait for rank 0's start: they end too, and know why
            self.publish("exit", why=str(e) or type(e).__name__, finished=isinstance(e, ClusterFinished))
            raise
        if mode is None:
            self.publish("exit", why="stopped before training started")
            return None
        start = yield from self.announce_start(origin)
        self._first, self._started = self.node.step, (yield POLL0)
        return start

    def announce_start(self, origin: float = 0.0) -> Program:
        """Publish this life's start; a joining life waits until every rank holds its shard
        from the same donor round (asking the donor again while one is missing)."""
        life, node = self.life, self.life.node
        members = self.members()
        joining = life.joining
        rank, world = life.rank or 0, life.world_size or len(members["members"])
        self._origin = origin
        while True:
            donor = joining.took_from
            d = self.publish("start", round=node.round, step=node.step, **members,
                             donor=donor[0] if donor else None, donor_round=donor[1] if donor else -1,
                             rank=rank, world=world, origin=origin)
            if donor is None:
                break
            acks = self.link.acks(d.seq, 0.0)
            while acks is None:
                yield Poll(POLL)
                acks = self.link.acks(d.seq, 0.0)
            if all(acks):
                self.publish("go", round=node.round, step=node.step)
                break
            log.warning("%s: rank(s) %s of the group did not get their shard of round %d from %s; asking again",
                        self.id, ", ".join(str(r + 1) for r, ok in enumerate(acks) if not ok), donor[1], donor[0])
            if not (yield from joining.pull_again(donor[0], donor[1])):
                self.publish("go", round=node.round, step=node.step)  # (each rank trains with what it holds)
                break
        return Start(node.step, rank, world)

    # -- training --------------------------------------------------------------------------------
    def after_step(self, step: int) -> Program:
        """After local step ``step`` of every rank: an exchange when one is due, with the
        round's decision published first; a new life when the cluster dropped this group.
        Returns whether the shard changed (an exchange, or a new life's shards taken)."""
        life, node = self.life, self.life.node
        node.step = step
        now = yield POLL0
        if life.last_step_at is not None:
            life.max_step_gap = max(life.max_step_gap, now - life.last_step_at)
        life.last_step_at = now
        due = [ch for ch in node.channels if step % ch.period == 0]
        if not due:
            return False
        if life.stop.is_set():
            self.publish("stop", round=node.round, step=step)
            self.stopped = True
            return False
        if life.excluded is not None:
            self.publish("life", round=node.round, step=step)
            self.account(now)
            yield from life.rejoin()  # until the cluster takes this group back, with a member's shards
            yield from self.announce_start(self._origin)
            self._first, self._started = self.node.step, (yield POLL0)
            return True
        life.apply_members()
        self._open = node.round  # (a joiner's request from now on: see state_request)
        joiners = tuple(life.take_handovers())
        self.publish("round", round=node.round, step=step, **self.members(), handover=joiners)
        for j in joiners:  # before the round: the joiner's first round may be this one, which waits for it
            self.hand_over(j)
        try:
            for ch in due:
                yield from life.exchange(ch)
        finally:
            self._open = None
        return True

    def account(self, now: float) -> None:
        """This life's training time and steps into the lifecycle's figures."""
        life = self.life
        life.train_seconds += now - self._started
        life.trained_steps += self.node.step - self._first
        self._first, self._started = self.node.step, now

    def complete_pending(self) -> Program:
        """With overlap, mix the rounds still in flight (the last exchange has none after it)."""
        node = self.node
        for ch in node.channels:
            if ch.pending is not None:
                yield from self.life.drive(node.complete(ch))

    def finish(self) -> Program:
        """Serve the members still training (a joiner's shards too), then tell the ranks to exit."""
        life = self.life
        life.status = "done"
        now = yield POLL0
        self.account(now)
        if not life.interrupted:
            life.control.apply(life.control.announce_status())
            end = now + life.cfg.timing.grace
            while now < end and not life.stop.is_set():
                joiners = tuple(life.take_handovers())
                if joiners:
                    node = self.node
                    self.publish("serve", round=node.round, step=node.step, handover=joiners)
                    for j in joiners:
                        self.hand_over(j)
                with life.lock:
                    busy = [m for k, m in life.membership.members.items() if k != self.id and m.status != "done"]
                if not busy:
                    break
                now = yield Poll(min(POLL, end - now))
        self.publish("exit")


class GroupFollow:
    """Rank ``follower.rank`` (> 0) of a group: its :class:`ShardFollower`, following rank 0.

    Parameters
    ----------
    follower : this rank's node over its shard
    link : the group's channel from rank 0
    send : ``send(dst, Message)``: a hand-over to rank r of a joiner (never blocks, never dropped)
    connect : ``connect(addresses)``: a fresh connection (and hello) to each of these rank-r
        addresses, before any round sends state on it (the driver's; may do nothing)
    timeout : how long a joining life waits for its shard before rank 0 asks again
    origin : the driver time the node program counts from
    """

    def __init__(self, follower: ShardFollower, link: GroupLink, *, send: Callable[[str, Message], None],
                 connect: Callable[[list[str]], None] = lambda addresses: None, timeout: float = 5.0,
                 origin: float = 0.0) -> None:
        self.f = follower
        self.link = link
        self.send = send
        self.connect_to = connect
        self.timeout = float(timeout)
        self.origin = origin
        self.seq = 0
        self.starts = 0  # start decisions taken
        self.waiting_for: int | None = None  # the decision it waits for (a driver may block on the link)
        self.stopped = False
        self.exited = False
        self.dcs: dict[str, str] = {}  # member -> its datacenter label, from rank 0's decisions
        self.group_origin: float | None = None  # rank 0's start, from its start decision
        self.connected: dict[str, int] = {}  # rank-r address -> the life its connection was opened for
        self._news_at = -1e18

    @property
    def id(self) -> str:
        return self.f.id

    @property
    def node(self) -> Any:
        return self.f.node

    def next(self) -> Program:
        """Rank 0's next decision (waiting as long as rank 0 takes, looking at its news meanwhile)."""
        self.seq += 1
        self.waiting_for = self.seq
        try:
            while True:
                d = self.link.next(self.seq, 0.0)
                if d is not None:
                    return d
                self.look()
                yield Poll(LISTEN)
        finally:
            self.waiting_for = None

    def look(self) -> News:
        """Rank 0's news: connections to open, hand-overs to make now."""
        news = self.link.news()
        self._connect((rank_address(m, self.f.rank), life) for m, life in news.known)
        for dst, msg in self.f.news_handovers(news):
            self.send(dst, msg)
        return news

    def _learn(self, d: Decision) -> None:
        for m, dc in zip(d.members, d.dcs):
            if dc:
                self.dcs[m] = dc

    def link_class(self, u: str, v: str, own: str) -> str:
        """intra or inter: whether two rank-r addresses' groups carry different datacenter
        labels (``own``: this group's)."""
        du = self.dcs.get(group_of(u, self.f.rank), own) if u != self.id else own
        dv = self.dcs.get(group_of(v, self.f.rank), own) if v != self.id else own
        return "inter" if du != dv else "intra"

    def _connect(self, pairs: Iterable[tuple[str, int]]) -> None:
        """A fresh connection to each ``(address, life)`` not yet connected for that life (rank r
        of a member new to this rank, or of a member's new life): each is up before any round
        sends state on it (state is not held for a connection that is not up)."""
        fresh = []
        for a, life in pairs:
            if a == self.id or (a in self.connected and (not life or self.connected[a] == life)):
                continue
            self.connected[a] = life
            fresh.append(a)
        if fresh:
            self.connect_to(fresh)

    def _apply(self, d: Decision) -> None:
        self.f.apply(d)
        self._learn(d)
        self._connect(zip(self.f.addresses(d.members), d.lives or [0] * len(d.members)))

    # -- the start of a life ---------------------------------------------------------------------
    def start(self) -> Program:
        d = yield from self.next()
        return (yield from self.take_start(d))

    def take_start(self, d: Decision) -> Program:
        while True:
            if d.kind == "exit":
                self.exited = True
                if d.finished:
                    raise ClusterFinished(d.why)
                raise PeerError(f"rank 0 stopped before training started: {d.why or 'stopped'}")
            if d.kind != "start":
                raise RuntimeError(f"{self.id}: expected rank 0's start, got {d.kind!r}")
            self.starts += 1
            self.group_origin = d.origin
            self._apply(d)
            if d.donor is None:
                break
            ok = yield from self._take(d)
            self.link.ack(d.seq, ok)
            nxt = yield from self.next()
            if nxt.kind == "go":  # every rank holds its shard of one donor round (or rank 0 gave up asking)
                self.f.begin()
                break
            d = nxt  # a new start: rank 0 asked the donor again
        return Start(d.step, d.rank, d.world)

    def _take(self, d: Decision) -> Program:
        now = yield POLL0
        deadline = now + max(2.0, self.timeout)
        while now < deadline:
            if self.f.take(d):
                return True
            now = yield Poll(POLL)
        return self.f.take(d)

    # -- training --------------------------------------------------------------------------------
    def after_step(self, step: int) -> Program:
        node = self.f.node
        node.step = step
        now = yield POLL0
        if now - self._news_at >= NEWS_EVERY:
            self.look()
            self._news_at = now
        due = [ch for ch in node.channels if step % ch.period == 0]
        if not due:
            return False
        d = yield from self.next()
        if d.kind == "stop":
            self.stopped = True
            return False
        if d.kind == "life":
            self.f.status = "waiting"
            yield from self.take_start((yield from self.next()))
            return True
        if d.kind != "round":
            raise RuntimeError(f"{self.id}: expected rank 0's round decision, got {d.kind!r}")
        self._apply(d)
        for dst, msg in self.f.hand_over(d.handover):  # before the round, as rank 0 does
            self.send(dst, msg)
        for ch in due:
            yield from self.drive(node.exchange(ch))
        return True

    def drive(self, program: Any) -> Program:
        """Advance a node program: its ``Wait`` becomes polls (see :meth:`wait`)."""
        try:
            action = next(program)
        except StopIteration:
            return
        while True:
            if type(action) is Wait:
                now = yield from self.wait(action.timeout)
            else:
                now = yield action
            del action  # nothing here may keep a sent message alive (see NodeConfig.live_sends)
            try:
                action = program.send(now - self.origin)
            except StopIteration:
                return

    def wait(self, timeout: float) -> Program:
        """Poll for the round's messages until ready, timeout, or every neighbour still
        awaited belongs to a member rank 0 holds dead. Returns the time it ends."""
        f = self.f
        node = f.node
        now = yield POLL0
        deadline = now + timeout
        while not node.ready():
            if now >= deadline:
                f.timed_out_rounds += 1
                log.info("%s: round %d timed out waiting for %s", self.id, node.round, ", ".join(node.awaited()))
                return now
            if now - self._news_at >= POLL:
                news, self._news_at = self.look(), now
                if f.awaited_dead(news.dead_in(node.round)):
                    f.skipped_waits += 1
                    return now
            now = yield Poll(min(POLL, deadline - now))
        return now

    def complete_pending(self) -> Program:
        node = self.f.node
        for ch in node.channels:
            if ch.pending is not None:
                yield from self.drive(node.complete(ch))

    def finish(self) -> Program:
        """Serve rank 0's hand-overs until it says the group is done."""
        while not self.exited:
            d = yield from self.next()
            if d.kind == "exit":
                self.exited = True
            elif d.kind == "serve":
                for dst, msg in self.f.hand_over(d.handover):
                    self.send(dst, msg)
