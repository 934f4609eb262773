"""Rank 0's control plane of a group: who the neighbour groups are, which are alive, who joins.

Only rank 0 of a group runs one (:class:`GroupControl`); the group's other ranks
learn everything from rank 0's :class:`~gossip.groups.group.Decision` at each round
and, while a round waits, from its *down notices* (below). Between groups there
is no master: each group's rank 0 keeps its own view, with the project's
member table (:class:`gossip.protocol.membership.Membership`, keyed by group id, which
is rank 0's gossip address) and failure detector
(:class:`gossip.protocol.detector.HeartbeatDetector`).

Messages (rank 0 to rank 0, on rank 0's own connection; kinds of :mod:`gossip.transport.wire`):

``ping``
    every ``heartbeat`` seconds to every known group: ``x = {group, inc, status}``
    (``inc``: this life's incarnation; ``status``: ``waiting`` or ``training``).
    Any message from a group's rank 0 (hello, state, ping) counts as a heartbeat.
``bye``
    a group that finished: ``x = {group, inc, round}``, ``round`` being the first
    round it no longer sends.
``state-request``
    a new life asks to join: ``x = {group, inc}`` (resent until it is taken in).
``members``
    ``x = {op: "joined", group, inc, round}``: a donor tells the other groups
    that a joiner takes part from ``round`` on.

Failure handling: a group silent for ``dead_after`` seconds (checked every
``heartbeat``), one whose rank 0 speaks with a new incarnation (it restarted),
and one that said goodbye are dropped from the members at once; the next
decision leaves them out on every rank. A round already under way on some rank
must not keep waiting for them either: rank 0 sends each rank of its own group
(itself included) a ``members`` message ``x = {op: "down", groups, lo, hi}``,
and a rank's synchronous wait ends as soon as every sender it still waits for
belongs to a group that is down for the round it waits in (``lo <= round <= hi``;
a death: ``lo = 0`` and ``hi`` rank 0's current round, which no rank of the
group is past; a goodbye: ``lo`` its last round + 1, ``hi`` unbounded). So no
rank waits for a dead group longer than the detection time, ``dead_after +
heartbeat``.

Joining (a restarted group, or one started late): see :mod:`gossip.groups.member`
(``connect`` and ``join``) and docs/GROUPS.md. Here: a ``state-request`` from a
live group's new life is queued; the next decision names it in ``handover``, so
after that round's mix every rank r sends its shard to rank r of the joiner, and
from the next round on the joiner is a member.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from gossip.core.message import Message
from gossip.groups.group import Decision, rank_address
from gossip.protocol.detector import HeartbeatDetector
from gossip.protocol.membership import Membership, stronger
from gossip.protocol.timing import Timing
from gossip.transport import wire

if TYPE_CHECKING:
    from gossip.groups.member import GroupMember

__all__ = ["GroupControl", "new_incarnation"]

log = logging.getLogger("gossip.group")

UNBOUNDED = 2**62  # a round no run reaches


def new_incarnation() -> int:
    """An incarnation for a new life: later lives of the same group get larger ones
    (microseconds of the wall clock: a restart takes longer than that)."""
    return time.time_ns() // 1000


class GroupControl:
    """Rank 0's view of the other groups, for :class:`~gossip.groups.member.GroupMember`.

    Parameters
    ----------
    member : rank 0's :class:`~gossip.groups.member.GroupMember` (its connection is shared)
    heartbeat : seconds between pings (and between checks for silent groups)
    dead_after : a group silent for this long is dead
    incarnation : this life's (default: :func:`new_incarnation`)
    on_event : ``on_event(kind, fields)`` for what happened (``dropped``, ``admitted``,
        ``handover``), e.g. to trace it; called with the lock held, so keep it short
    """

    def __init__(self, member: "GroupMember", *, timing: Timing = Timing(),
                 incarnation: int | None = None, on_event: Callable[[str, dict], None] | None = None) -> None:
        if member.rank != 0:
            raise ValueError("only rank 0 of a group runs its control plane")
        self.member = member
        self.group_id = member.group_id
        self.timing = timing
        self.heartbeat = timing.heartbeat
        self.dead_after = timing.dead_after
        self.incarnation = new_incarnation() if incarnation is None else int(incarnation)
        self.lock = threading.RLock()
        self.membership = Membership(self.group_id, self.incarnation, member.view.fingerprint, timing=timing)
        self.detector = HeartbeatDetector(self.membership, timing, self._ping)
        self.status = "waiting"
        self.active: dict[str, int] = {}  # the groups this one mixes with -> the life that trains
        self.requests: dict[str, int] = {}  # joiners asking for a handover -> their life
        self.handed_over: dict[str, int] = {}  # joiners given a handover -> the life (its requests resent are old)
        self.handed_at: dict[str, float] = {}  # joiner -> when its last handover was decided
        self.rehand_after = max(3.0, 8 * self.heartbeat)  # a joiner still asking this long after: hand over anew
        self.stop_requested = False
        self.dropped_lives: dict[str, int] = {}  # groups dropped for silence -> that life (alive after all?)
        self.told: dict[str, float] = {}  # group -> when we last told it that we dropped it
        self.rejoin_via: str | None = None  # the group whose shards this one takes at the next decision
        self.admit: dict[str, tuple[int, int]] = {}  # joiners another group took in -> (life, first round)
        self.final_round: int | None = None
        self.on_event = on_event
        self.events: list[dict[str, Any]] = []
        self.clock = time.monotonic
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"group-control-{self.group_id}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * self.heartbeat + 1.0)
            self._thread = None

    def _loop(self) -> None:
        period = min(0.05, self.heartbeat / 4)
        while not self._stop.wait(period):
            try:
                self.tick(self.clock())
            except Exception:  # the plane must outlive a bad tick (it is logged)
                log.exception("%s: control tick failed", self.group_id)

    # -- what the member tells us ---------------------------------------------------------------
    def training(self, members: Any) -> None:
        """This group trains from now on with ``members`` (group ids; self may be included)."""
        with self.lock:
            self.status = "training"
            self.membership.training = False  # deaths are adopted at once, not at announced rounds
            me = self.membership.members[self.group_id]
            me.status = "training"
            for g in members:
                if g != self.group_id:
                    self.active[g] = self.membership.life_of(g) or 0

    def incarnation_fields(self) -> dict[str, Any]:
        """What rank 0's hellos carry about this life."""
        return {"inc": self.incarnation, "status": self.status}

    def saw(self, msg: Message) -> None:
        """Any message arrived at rank 0 (I/O thread): a heartbeat from a group's rank 0,
        and the news in a hello or ping (a new life, a status)."""
        sender = msg.sender
        if not isinstance(sender, str) or sender == self.group_id:
            return
        x = msg.extra if isinstance(msg.extra, dict) else {}
        now = self.clock()
        with self.lock:
            if msg.kind in ("hello", "ping") and x.get("group") == sender and type(x.get("inc")) is int:
                status = x.get("status") if x.get("status") in ("waiting", "training", "done") else None
                self.membership.heard(sender, x["inc"], now, status=status, round=msg.round)
                life = self.active.get(sender)
                if life is not None and life and x["inc"] > life:
                    self._drop(sender, "restarted (a new life)")
                elif self.dropped_lives.get(sender) == x["inc"] and status == "training" \
                        and self.status == "training" and now - self.told.get(sender, -1e9) >= self._tell_every():
                    # declared dead, yet it trains: tell it, so that one of us rejoins the other
                    self.told[sender] = now
                    note = {"op": "dropped", "group": self.group_id, "inc": self.incarnation,
                            "members": list(self.members())}
                    self._send(sender, Message("members", self.group_id, 0, 0, 0, extra=note))
            else:
                self.detector.heard(sender, now)

    def receive(self, msg: Message) -> None:
        """A control message for rank 0 (I/O thread)."""
        x = msg.extra if isinstance(msg.extra, dict) else {}
        sender = msg.sender
        if x.get("group") != sender or type(x.get("inc")) is not int:
            self.member.rejected["control"] += 1
            return
        with self.lock:
            if msg.kind == "ping":
                return  # a heartbeat: taken by saw()
            if msg.kind in ("bye", "members") and self.active.get(sender, x["inc"]) != x["inc"]:
                return  # from a life of it other than the one we mix with (sent before it rejoined)
            if msg.kind == "bye":
                last = x.get("round")
                self.membership.remove(sender, "said goodbye", departed=True)
                self._drop(sender, "said goodbye", lo=last if type(last) is int else 0, hi=UNBOUNDED)
            elif msg.kind == "state-request":
                m = self.membership.members.get(sender)
                if self.status != "training" or self.stop_requested or m is None or m.incarnation != x["inc"]:
                    return  # not ours to serve (yet): it asks again
                if self.handed_over.get(sender) == x["inc"]:
                    if self.clock() - self.handed_at.get(sender, 0.0) < self.rehand_after:
                        return  # taken in already; the handover is on its way
                    # it asks long after: some rank of it did not get its shard (it keeps asking
                    # until all have one of one round); hand over again, at a round of its own
                    log.warning("%s: group %s asks again for its shards; handing them over anew", self.group_id, sender)
                if sender in self.active:  # an older life, or one that took itself for a joiner: it waits
                    self._drop(sender, "asks to join (a new life)")
                self.requests[sender] = x["inc"]
            elif msg.kind == "members" and x.get("op") == "dropped" and isinstance(x.get("members"), list):
                if self.status != "training" or self.rejoin_via is not None:
                    return
                theirs = {g for g in x["members"] if isinstance(g, str)} | {sender}
                if stronger(theirs, set(self.members())):  # ours goes on in theirs: a new life, via them
                    self._rejoin(sender)
                elif sender in self.active:  # theirs rejoins ours once we tell it (we hear it train)
                    life = self.active[sender]
                    self._drop(sender, "it dropped this group")
                    self.dropped_lives[sender] = life
            elif msg.kind == "members" and x.get("op") == "joined":
                g, inc, first = x.get("joiner"), x.get("joiner_inc"), x.get("round")
                if isinstance(g, str) and type(inc) is int and type(first) is int and g != self.group_id \
                        and self.status == "training":
                    self.admit[g] = (inc, first)  # a member from that round on (not before: it sends nothing)
            else:
                self.member.rejected["control"] += 1

    # -- the plane's own clock ------------------------------------------------------------------
    def tick(self, now: float) -> None:
        with self.lock:
            verdicts = self.detector.tick(now)
            for g in verdicts.dead:
                life = self.active.get(g)
                self.membership.remove(g, f"silent for more than {self.dead_after:g} s")
                self._drop(g, f"silent for more than {self.dead_after:g} s")
                if life is not None:
                    self.dropped_lives[g] = life
        for g, msg in verdicts.sends:
            self._send(g, msg)

    def _ping(self, kind: str, fields: dict) -> Message:
        """The detector's probe, framed as this group's (call with the lock held)."""
        node = self.member.node
        rnd = node.round if node is not None else 0
        x = {"group": self.group_id, "inc": self.incarnation, "status": self.status, **fields}
        return Message(kind, self.group_id, rnd, 0, 0, extra=x)

    # -- the group's decision ---------------------------------------------------------------------
    def decide(self, rnd: int) -> Decision:
        """Rank 0's decision for round ``rnd`` (main thread)."""
        with self.lock:
            if self.stop_requested:
                self.final_round = rnd
                return Decision(rnd, self.members(), "stop")
            if self.rejoin_via is not None:
                donor, self.rejoin_via = self.rejoin_via, None
                return Decision(rnd, (self.group_id,), "join", donor=donor)
            for g, (inc, first) in sorted(self.admit.items()):
                if first <= rnd:
                    del self.admit[g]
                    self.active[g] = inc
                    self._event("admitted", group=g, round=first)
            members = self.members()
            handover = tuple(sorted(g for g, inc in self.requests.items()
                                    if (m := self.membership.members.get(g)) is not None and m.incarnation == inc))
            for g in handover:
                inc = self.requests.pop(g)
                self.active[g] = inc
                self.handed_over[g] = inc
                self.handed_at[g] = self.clock()
                self._event("handover", group=g, round=rnd + 1)
                note = {"op": "joined", "group": self.group_id, "inc": self.incarnation, "joiner": g,
                        "joiner_inc": inc, "round": rnd + 1}
                for other in members:
                    if other not in (self.group_id, g):
                        self._send(other, Message("members", self.group_id, rnd, 0, 0, extra=note))
            self.requests.clear()  # the others were stale lives
            return Decision(rnd, members, "mix", handover=handover)

    def members(self) -> tuple[str, ...]:
        with self.lock:
            return tuple(sorted({self.group_id, *self.active}))

    def request_stop(self) -> None:
        with self.lock:
            self.stop_requested = True

    def bye(self, final_round: int) -> None:
        """This group finished: tell every group we know (it stops waiting for us)."""
        with self.lock:
            self.status = "done"
            targets = self.membership.others()
            x = {"group": self.group_id, "inc": self.incarnation, "round": int(final_round)}
        for g in targets:
            self._send(g, Message("bye", self.group_id, final_round, 0, 0, extra=x))

    def ask_to_join(self, donor: str) -> None:
        self._send(donor, Message("state-request", self.group_id, 0, 0, 0,
                                  extra={"group": self.group_id, "inc": self.incarnation}))

    # -- internals -------------------------------------------------------------------------------
    def _tell_every(self) -> float:
        return max(1.0, 4 * self.heartbeat)

    def _rejoin(self, donor: str) -> None:
        """This group was dropped by a stronger cluster (lock held): it leaves its own and
        joins theirs as a new life at the next decision (:meth:`GroupMember.join`)."""
        for g in list(self.active):
            self._drop(g, f"rejoining through {donor}")
        self.requests.clear()
        self.dropped_lives.clear()
        self.incarnation = new_incarnation()
        self.membership.incarnation = self.incarnation
        me = self.membership.members[self.group_id]
        me.incarnation, me.status = self.incarnation, "waiting"
        self.status = "waiting"
        self.rejoin_via = donor
        self._event("rejoin", group=donor)
        log.warning("%s: dropped by the cluster of %s; rejoining it as a new life", self.group_id, donor)


    def _drop(self, g: str, reason: str, lo: int = 0, hi: int | None = None) -> None:
        """Stop mixing with ``g`` (lock held): out of the next decision, and every rank of
        this group stops waiting for it in the rounds ``lo..hi`` (default: up to now)."""
        self.requests.pop(g, None)
        self.admit.pop(g, None)
        if self.active.pop(g, None) is None:
            return
        node = self.member.node
        if hi is None:
            hi = node.round if node is not None else 0
        self._event("dropped", group=g, reason=reason)
        log.warning("%s: group %s dropped: %s", self.group_id, g, reason)
        note = Message("members", self.group_id, hi, 0, 0, extra={"op": "down", "groups": [g], "lo": lo, "hi": hi})
        self.member.inbound.put(note)  # rank 0 itself, maybe waiting for g right now
        for r in range(1, self.member.group.size):
            self.member.send_control(rank_address(self.group_id, r), note)

    def _event(self, kind: str, **fields: Any) -> None:
        e = {"event": kind, "t": self.clock(), **fields}
        self.events.append(e)
        if self.on_event is not None:
            self.on_event(kind, e)

    def _send(self, dst: str, msg: Message) -> None:
        self.member.transport.send(dst, wire.encode(msg), droppable=False)
