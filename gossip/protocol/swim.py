"""SWIM failure detection and membership dissemination, as a sans-IO state machine.

One :class:`Swim` object is one node's failure detector (Das, Gupta and Motivala,
"SWIM", DSN 2002; with the refinements of hashicorp memberlist). It owns no
socket, reads no clock and starts no thread: the driver hands it the time and
the messages that arrived, and sends what it returns::

    det = Swim("10.0.0.1:5555", incarnation, random.Random(seed), members=[("10.0.0.2:5555", inc2)])
    out = det.tick(now)                 # every ~0.1 s: probes, indirect probes, gossip
    out += det.receive(incoming, now)   # every SwimMessage addressed to this node
    for ev in det.take_events():        # MemberEvent: member X alive / suspect / dead / left
        ...

What it does, per protocol period (``period``, default 0.5 s, the project's heartbeat):

- **Probe one member**: round-robin over a list of the members, shuffled with the
  rng passed in and reshuffled at each pass. A ``ping`` that is not acknowledged
  within ``probe_timeout`` makes it ask ``indirect`` other members to probe the
  target for it (``ping-req``); relays forward the target's ``ack``. No ack by
  the end of the period: the target becomes *suspect*, and is told so at once.
- **Suspicion before death**: a suspect member that does not refute within
  ``suspicion_timeout(n)`` (``suspicion_mult * max(1, log10 n) * period``, as
  memberlist scales it) is declared *dead*. A member that hears it is suspected
  (or declared dead, or said to have left) refutes by raising its incarnation
  above the one named and spreading ``alive`` with it.
- **Dissemination**: every change (alive, which is also a join; suspect; dead;
  left) is piggybacked on pings and acks and, while there is news, on ``gossip``
  messages to ``gossip_nodes`` random members every ``gossip_interval``. Each
  update goes out ``retransmit_mult * ceil(log10(n + 1))`` times from each node
  that adopted it (memberlist's limit), the least sent first. With no news a node
  sends one ping and about one ack per period, whatever the cluster size.
- **Corrections**: a node lists the members it holds suspect in its messages
  (when there is room), and a node that receives news older than its own record
  answers with the record. So a node that missed a refutation cannot time a
  live member out, and one that missed a death learns it from the next node it
  talks to, after the retransmissions have stopped.
- **Rejoin after a partition**: every ``reconnect_interval`` a node pings one
  member it declared dead (the most recent 64). Each message to a member this
  node holds suspect or dead carries that verdict first (memberlist's "buddy
  system"), so a live member on the far side of a healed partition learns of
  its death, refutes with a higher incarnation, and is alive again everywhere.

Precedence of updates about member M (``i``: incarnation in the update, ``j``:
the one recorded): ``alive i`` wins if ``i > j``; ``suspect i`` over alive if
``i >= j``, over suspect if ``i > j``; ``dead i`` over alive or suspect if
``i >= j``; ``left i`` over anything but left if ``i >= j``. Suspect, dead and
left of a member this node does not know are ignored; an alive of one is a join.
The sender of any message is alive at the incarnation it states (``inc``).

Incoming messages are checked field by field before anything is used; a bad one
is counted in :attr:`Swim.rejected` by reason and changes nothing. Messages from
a sender that is not in the member table are not taken as evidence (only a
``ping`` is answered, with a bare ``ack``): members come in through
:meth:`Swim.join` (the owner's own admission, e.g. a ``hello``) or through the
alive updates of members.

Messages are :class:`SwimMessage`: a destination, a sender and ``fields``, a flat
map of strings, integers and lists of those, which is exactly what the wire's
``x`` header map carries (see docs/PROTOCOL.md, "Failure detector (SWIM)").
:func:`to_message` and :func:`from_message` convert to and from
:class:`gossip.core.message.Message` (kind ``"swim"``).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

from gossip.core.message import Message

__all__ = ["KIND", "OPS", "ALIVE", "SUSPECT", "DEAD", "LEFT", "STATES", "SwimOptions", "SwimMessage",
           "MemberEvent", "Swim", "to_message", "from_message", "check"]

KIND = "swim"  # the wire message kind that carries every SWIM message
OPS = ("ping", "ping-req", "ack", "gossip")
ALIVE, SUSPECT, DEAD, LEFT = "alive", "suspect", "dead", "left"
STATES = (ALIVE, SUSPECT, DEAD, LEFT)
MAX_INT = 2**63 - 1
MAX_ID = 256          # node ids are 1..256 characters, as the wire's senders
MAX_UPDATES_IN = 1024  # updates accepted in one incoming message
MAX_RELAYS = 4096      # indirect probes relayed for others at once
RECONNECT_RECENT = 64  # dead members a node keeps pinging now and then (the most recent)


@dataclass(frozen=True)
class SwimOptions:
    """Timing and fan-out of the detector (seconds, counts).

    The defaults make a crash known to every member of a 1024-node cluster
    within 5 s (docs/PROTOCOL.md, "Failure detector (SWIM)", has the reckoning)
    at about 4-5 control messages per node per second.
    """

    period: float = 0.5            # protocol period: one probe each (the heartbeat)
    probe_timeout: float = 0.2     # wait for a direct ack before asking others
    indirect: int = 3              # members asked to probe for us (k)
    suspicion_mult: float = 1.0    # suspicion timeout = mult * max(1, log10 n) * period
    suspicion_min: float = 0.0     # ... and at least this many seconds (a control plane's --dead-after)
    gossip_interval: float = 0.1   # how often news is pushed, while there is any
    gossip_nodes: int = 3          # members each push goes to
    retransmit_mult: int = 4       # each update is sent mult * ceil(log10(n + 1)) times by each node
    max_piggyback: int = 32        # updates carried by one message at most
    reconnect_interval: float = 5.0  # seconds between pings to one member declared dead
    max_members: int = 65536       # members (any state) remembered at most; further joins are refused

    def __post_init__(self) -> None:
        for name in ("period", "probe_timeout", "suspicion_mult", "gossip_interval", "reconnect_interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if isinstance(self.suspicion_min, bool) or not isinstance(self.suspicion_min, (int, float)) \
                or not (math.isfinite(self.suspicion_min) and self.suspicion_min >= 0):
            raise ValueError(f"suspicion_min must be a finite number >= 0, got {self.suspicion_min!r}")
        if self.probe_timeout >= self.period:
            raise ValueError(f"probe_timeout must be in (0, period={self.period}) seconds, got {self.probe_timeout!r}")
        for name, lo, hi in (("indirect", 0, 64), ("gossip_nodes", 1, 64), ("retransmit_mult", 1, 64),
                             ("max_piggyback", 1, MAX_UPDATES_IN), ("max_members", 2, 2**31)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an integer in {lo}..{hi}, got {v!r}")

    def suspicion_timeout(self, n: int) -> float:
        """Seconds a member of an ``n``-node cluster stays suspect before it is declared dead.

        >>> SwimOptions().suspicion_timeout(1000)
        1.5
        """
        return max(self.suspicion_min, self.suspicion_mult * max(1.0, math.log10(max(n, 1))) * self.period)

    def retransmit_limit(self, n: int) -> int:
        """How many times each node sends one update in an ``n``-node cluster.

        >>> SwimOptions().retransmit_limit(16), SwimOptions().retransmit_limit(1024)
        (8, 16)
        """
        return self.retransmit_mult * max(1, math.ceil(math.log10(n + 1)))


@dataclass(frozen=True)
class SwimMessage:
    """One SWIM message: ``fields`` is the flat map that travels as the wire's ``x``."""

    to: str
    sender: str
    fields: dict[str, Any]

    @property
    def op(self) -> str:
        return self.fields.get("op", "")


@dataclass(frozen=True)
class MemberEvent:
    """Member ``member`` is now ``state`` at ``incarnation`` (``previous``: its former
    state here, None for a member first heard of); ``at`` is the driver's time."""

    member: str
    state: str
    incarnation: int
    previous: str | None
    at: float


def to_message(msg: SwimMessage, *, fingerprint: str = "", round: int = 0, progress: int = 0) -> Message:
    """``msg`` as a :class:`~gossip.core.message.Message` of kind ``"swim"`` for :func:`gossip.transport.wire.encode`."""
    return Message(KIND, msg.sender, round, progress, 0, None, None, dict(msg.fields), fingerprint)


def from_message(msg: Message, to: str) -> SwimMessage:
    """A decoded wire message of kind ``"swim"`` addressed to ``to`` as a :class:`SwimMessage`
    (:meth:`Swim.receive` checks its fields)."""
    return SwimMessage(to, msg.sender, msg.extra)


def _is_id(x: Any) -> bool:
    return isinstance(x, str) and 0 < len(x) <= MAX_ID


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_INT


def _wins(state: str, inc: int, old: str, j: int) -> bool:
    """Whether news "``state`` at ``inc``" replaces a record "``old`` at ``j``"."""
    if state == ALIVE:
        return inc > j
    if state == SUSPECT:
        return (old == ALIVE and inc >= j) or (old == SUSPECT and inc > j)
    if state == DEAD:
        return (old in (ALIVE, SUSPECT) and inc >= j) or (old == DEAD and inc > j)
    return (old != LEFT and inc >= j) or (old == LEFT and inc > j)


class _Bad(Exception):
    """An incoming message that fails a check; ``args[0]`` is the counter key."""


def _parse(msg: Any, me: str) -> tuple[str, str, int, int, str | None, list[tuple[str, str, int]]]:
    """(op, sender, inc, seq, target, updates) of ``msg``, every field checked; raises _Bad."""
    if not isinstance(msg, SwimMessage):
        raise _Bad("type")
    if not _is_id(msg.sender):
        raise _Bad("sender")
    if msg.sender == me:
        raise _Bad("self")
    if msg.to != me:
        raise _Bad("misdirected")
    x = msg.fields
    if not isinstance(x, dict):
        raise _Bad("fields")
    op = x.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise _Bad("op")
    inc = x.get("inc")
    if not _is_int(inc):
        raise _Bad("inc")
    seq, target = 0, None
    if op != "gossip":
        seq = x.get("seq")
        if not _is_int(seq):
            raise _Bad("seq")
    if op in ("ping-req", "ack"):
        target = x.get("target")
        if not _is_id(target):
            raise _Bad("target")
    uid, ust, uinc = x.get("uid"), x.get("ust"), x.get("uinc")
    updates: list[tuple[str, str, int]] = []
    if uid is not None or ust is not None or uinc is not None:
        if not (isinstance(uid, list) and isinstance(ust, list) and isinstance(uinc, list)
                and len(uid) == len(ust) == len(uinc) <= MAX_UPDATES_IN):
            raise _Bad("updates")
        if not (all(_is_id(u) for u in uid) and all(isinstance(s, str) and s in STATES for s in ust)
                and all(_is_int(i) for i in uinc)):
            raise _Bad("updates")
        if len(set(uid)) != len(uid):
            raise _Bad("updates")  # one update per member and message: no order to argue about
        updates = list(zip(uid, ust, uinc))
    return op, msg.sender, inc, seq, target, updates


def check(msg: SwimMessage, me: str) -> None:
    """Raise ValueError naming the reason (as :attr:`Swim.rejected` counts it) when
    :meth:`Swim.receive` on node ``me`` would reject ``msg``; nothing else is done."""
    try:
        _parse(msg, me)
    except _Bad as e:
        raise ValueError(e.args[0]) from None


@dataclass
class _Probe:
    target: str
    seq: int
    start: float
    deadline: float  # the end of its period: no ack by then, the target is suspect
    relays: tuple[str, ...] = ()
    acked: bool = False


@dataclass
class _Update:
    state: str
    inc: int
    sent: int
    order: int  # newer updates first among the equally sent


class Swim:
    """The SWIM failure detector of node ``node_id``.

    Parameters
    ----------
    node_id : this node's id (its address, as the wire's ``from``)
    incarnation : this node's starting incarnation; refutations raise it by one
        (a control plane passes the life's incarnation, its start time in µs:
        a later life starts above any count of refutations)
    rng : draws the probe order, indirect relays, gossip targets, first-probe
        phase; the same seed and inputs give the same messages and events
    options : :class:`SwimOptions`
    members : ``(id, incarnation)`` of the members known at the start, alive
        (introduced without an event or announcement, as a shared starting list)
    """

    def __init__(self, node_id: str, incarnation: int, rng: random.Random, options: SwimOptions | None = None,
                 members: Iterable[tuple[str, int]] = ()) -> None:
        if not _is_id(node_id):
            raise ValueError(f"node_id must be a string of 1..{MAX_ID} characters, got {node_id!r}")
        if not _is_int(incarnation):
            raise ValueError(f"incarnation must be an integer in 0..2**63-1, got {incarnation!r}")
        self.id = node_id
        self.incarnation = incarnation
        self.rng = rng
        self.opt = options if options is not None else SwimOptions()
        self.rejected: Counter[str] = Counter()  # malformed incoming messages by reason (nothing changed)
        self.ignored: Counter[str] = Counter()   # well-formed ones not acted on: not-member, unknown-target, full
        self.sent: Counter[str] = Counter()      # outgoing messages by op
        self.unexpected_acks = 0                 # late or duplicate acks (normal, not hostile)
        self.left = False
        self._table: dict[str, list] = {}        # member -> [state, incarnation]
        self._live: list[str] = []               # alive and suspect members (not self), for O(1) draws
        self._live_at: dict[str, int] = {}
        self._dead: dict[str, None] = {}         # members declared dead, oldest first (for reconnects)
        self._timers: dict[str, float] = {}      # suspect member -> when it is declared dead
        self._queue: dict[str, _Update] = {}     # updates to disseminate, by member (self included)
        self._order: list[str] = []              # round-robin probe order
        self._pos = 0
        self._probe: _Probe | None = None
        self._relays: dict[int, tuple[str, int, str, float]] = {}  # our seq -> (origin, its seq, target, expiry)
        self._urged: dict[str, float] = {}  # member -> when the owner last had it probed out of turn
        self._events: list[MemberEvent] = []
        self._seq = 0
        self._news = 0
        self._last_tick: float | None = None
        self._next_probe = self._next_gossip = self._next_reconnect = 0.0
        for mid, inc in members:
            if not (_is_id(mid) and _is_int(inc)):
                raise ValueError(f"members must be (id, incarnation) pairs, got {(mid, inc)!r}")
            if mid != node_id and mid not in self._table:
                self._table[mid] = [ALIVE, inc]
                self._add_live(mid)

    # -- views ---------------------------------------------------------------------------
    def state(self, member: str) -> tuple[str, int] | None:
        """(state, incarnation) of ``member`` as this node sees it, None if unknown."""
        if member == self.id:
            return (LEFT if self.left else ALIVE), self.incarnation
        rec = self._table.get(member)
        return (rec[0], rec[1]) if rec is not None else None

    def members(self, states: Iterable[str] = (ALIVE, SUSPECT)) -> list[str]:
        """Sorted ids of the other members in one of ``states``."""
        want = set(states)
        return sorted(m for m, rec in self._table.items() if rec[0] in want)

    def size(self) -> int:
        """n: the members alive or suspect, this node included (what timeouts scale with)."""
        return len(self._live) + 1

    def take_events(self) -> list[MemberEvent]:
        """The member events since the last call, in the order they happened (they are
        kept until taken: call it after every tick and receive)."""
        out, self._events = self._events, []
        return out

    def wakeup(self) -> float:
        """The earliest time at which :meth:`tick` has something to do (a driver may sleep until then)."""
        t = [self._next_probe, self._next_gossip if self._queue else math.inf,
             self._next_reconnect if self._dead else math.inf, *self._timers.values()]
        p = self._probe
        if p is not None and not p.acked:
            t.append(p.start + self.opt.probe_timeout if not p.relays else p.deadline)
        return min(t)

    # -- the owner's word ------------------------------------------------------------------
    def join(self, member: str, incarnation: int, now: float, *, spread: bool = True) -> None:
        """Admit ``member`` at ``incarnation`` (the owner heard from it, e.g. a hello) and
        spread the join. A member known at a lower incarnation, or suspect, dead or left
        at a lower one, is alive again at this one; otherwise nothing changes.

        ``spread`` False: a member first heard of is admitted without news (an owner
        whose own protocol tells every member of it, as a control plane's member lists
        do: a start of ``n`` would otherwise queue ``n`` joins on every node, each sent
        :meth:`SwimOptions.retransmit_limit` times). A new life is news either way: the
        members that suspect the old one learn that it is alive."""
        if not (_is_id(member) and _is_int(incarnation)):
            raise ValueError(f"join needs a node id and an incarnation in 0..2**63-1, got {(member, incarnation)!r}")
        if member != self.id:
            self._apply(member, ALIVE, incarnation, now, news=spread)

    def probe_soon(self, member: str, now: float) -> bool:
        """Probe ``member`` next, out of its turn in the probe order, and at once if no
        probe is pending (the owner has evidence of its own: a neighbour's messages stopped
        coming). Each member is probed so at most once a period. The probe order meets a
        member at a random time after a crash: a gap between two probes of one member
        is about exponential, mean ``period`` times ``n / (n - 1)``, and at 128 members one
        crash waited 2.7 s for its first probe. Returns whether a probe was brought forward."""
        if member not in self._live_at or self.left or (self._probe is not None and self._probe.target == member):
            return False
        if now - self._urged.get(member, -math.inf) < self.opt.period:
            return False
        if len(self._urged) >= 4096:
            self._urged.clear()
        self._urged[member] = now
        self._order.insert(self._pos, member)
        if self._probe is None and self._last_tick is not None:
            self._next_probe = min(self._next_probe, now)
        return True

    def remove(self, member: str) -> None:
        """The owner dropped ``member`` for reasons of its own (it said goodbye, or it
        left the owner's member table): it is recorded as left at its incarnation,
        no longer probed, without an event or an announcement (a later life, at a
        higher incarnation, is alive again). Unknown or already left: nothing."""
        rec = self._table.get(member)
        if rec is None or rec[0] == LEFT:
            return
        rec[0] = LEFT
        self._timers.pop(member, None)
        self._queue.pop(member, None)
        self._drop_live(member)
        self._dead.pop(member, None)

    def leave(self, now: float) -> list[SwimMessage]:
        """This node leaves: it spreads ``left`` about itself (sent now to ``gossip_nodes``
        members and on later ticks), stops probing and answers no more pings."""
        if not self.left:
            self.left = True
            self._enqueue(self.id, LEFT, self.incarnation)
        return self._gossip(now)

    # -- time --------------------------------------------------------------------------------
    def tick(self, now: float) -> list[SwimMessage]:
        """Advance to ``now``: suspicion timeouts, the probe of this period, news, reconnects."""
        out: list[SwimMessage] = []
        opt = self.opt
        if self._last_tick is None:
            # nodes that start together should not probe in lockstep
            self._next_probe = now + self.rng.uniform(0, opt.period)
            self._next_gossip = now
            self._next_reconnect = now + opt.reconnect_interval
        elif now - self._last_tick > opt.period:
            # this node did not run (suspended, overloaded): acks and refutations may wait
            # unread. Its own silence is not the members': a pending probe is abandoned,
            # not failed, and suspicions get the time back.
            gap = now - self._last_tick
            self._probe = None
            for mid in self._timers:
                self._timers[mid] += gap
        self._last_tick = now
        for mid, deadline in list(self._timers.items()):
            if now >= deadline:
                rec = self._table[mid]
                self._apply(mid, DEAD, rec[1], now)
        if self.left:
            return out + (self._gossip(now) if now >= self._next_gossip else [])
        p = self._probe
        if p is not None and not p.acked:
            if not p.relays and now >= p.start + opt.probe_timeout:
                p.relays = tuple(self._pick(opt.indirect, exclude=p.target)) or ("",)
                for r in p.relays:
                    if r:
                        out.append(self._send(r, "ping-req", seq=p.seq, target=p.target))
                # and once more directly: a lost ping or ack is the likeliest cause (memberlist
                # retries over TCP here); the one answer that comes back, by any path, suffices
                out.append(self._send(p.target, "ping", seq=p.seq))
            if now >= p.deadline:  # the period is over (the next probe is due)
                self._probe = None
                rec = self._table.get(p.target)
                if rec is not None and rec[0] == ALIVE:
                    self._apply(p.target, SUSPECT, rec[1], now)
                    out.append(self._send(p.target, "gossip"))  # tell it at once: it may refute
        if now >= self._next_probe:
            self._next_probe = max(self._next_probe + opt.period, now)
            target = self._next_target()
            if target is not None:
                self._seq += 1
                self._probe = _Probe(target, self._seq, now, self._next_probe)
                out.append(self._send(target, "ping", seq=self._seq))
        if self._dead and now >= self._next_reconnect:
            self._next_reconnect = now + opt.reconnect_interval
            recent = list(self._dead)[-RECONNECT_RECENT:]
            self._seq += 1
            out.append(self._send(self.rng.choice(recent), "ping", seq=self._seq))
        while self._relays:  # expiries grow with insertion: the oldest is first
            seq, (_, _, _, expiry) = next(iter(self._relays.items()))
            if expiry > now:
                break
            del self._relays[seq]
        if now >= self._next_gossip:
            out += self._gossip(now)
        return out

    # -- messages in ---------------------------------------------------------------------
    def receive(self, msg: SwimMessage, now: float) -> list[SwimMessage]:
        """Handle one message addressed to this node; returns the replies."""
        try:
            op, sender, inc, seq, target, updates = _parse(msg, self.id)
        except _Bad as e:
            self.rejected[e.args[0]] += 1
            return []
        out: list[SwimMessage] = []
        rec = self._table.get(sender)
        if rec is None or (rec[0] == LEFT and inc <= rec[1]):
            # not a member here (or a life that left): no evidence. A ping is answered,
            # so that a joiner we have not heard of yet is not suspected meanwhile
            self.ignored["not-member"] += 1
            if op == "ping" and not self.left:
                out.append(self._send(sender, "ack", seq=seq, target=self.id, piggyback=False))
            return out
        self._apply(sender, ALIVE, inc, now)  # it speaks: alive at the incarnation it states
        refuted = False
        fix: list[str] = []  # members the sender holds older news of: it gets ours
        for mid, st, i in updates:
            if mid == self.id:
                refuted = self._refute(st, i) or refuted
            elif not self._apply(mid, st, i, now):
                rec = self._table.get(mid)
                if rec is not None and _wins(rec[0], rec[1], st, i):
                    fix.append(mid)
        replied = False
        if op == "ping":
            if not self.left:
                out.append(self._send(sender, "ack", seq=seq, target=self.id, first=fix))
                replied = True
        elif op == "ping-req" and target is not None:  # (_parse guarantees a target)
            if target == self.id:
                out.append(self._send(sender, "ack", seq=seq, target=self.id, first=fix))
                replied = True
            elif target not in self._table:
                self.ignored["unknown-target"] += 1
            elif not self.left and len(self._relays) < MAX_RELAYS:
                self._seq += 1
                self._relays[self._seq] = (sender, seq, target, now + self.opt.period)
                out.append(self._send(target, "ping", seq=self._seq))
        elif op == "ack":
            out += self._ack(sender, seq, target, now)
        rec = self._table[sender]
        if not replied and (refuted or fix or (rec[0] in (SUSPECT, DEAD) and rec[1] >= inc)):
            # it should hear our refutation, our newer news, or that it is suspected or dead here
            out.append(self._send(sender, "gossip", first=fix))
        return out

    def _ack(self, sender: str, seq: int, target: str | None, now: float) -> list[SwimMessage]:
        p = self._probe
        if p is not None and p.seq == seq and p.target == target and (sender == target or sender in p.relays):
            p.acked = True
            return []
        relay = self._relays.get(seq)
        if relay is not None and sender == relay[2] == target:
            del self._relays[seq]
            return [self._send(relay[0], "ack", seq=relay[1], target=target)]
        self.unexpected_acks += 1
        return []

    # -- state changes -------------------------------------------------------------------
    def _refute(self, state: str, inc: int) -> bool:
        """Someone says this node is ``state`` at ``inc``: raise the incarnation above it
        unless it is true (alive at no higher incarnation, or left while leaving)."""
        if (state == ALIVE and inc <= self.incarnation) or (state == LEFT and self.left):
            return False
        if state != ALIVE and inc < self.incarnation:
            return False  # about an incarnation already refuted
        if self.left:
            self._enqueue(self.id, LEFT, self.incarnation)
            return True
        self.incarnation = min(inc + 1, MAX_INT)
        self._enqueue(self.id, ALIVE, self.incarnation)
        return True

    def _apply(self, mid: str, state: str, inc: int, now: float, *, news: bool = True) -> bool:
        """Take the update ``mid`` is ``state`` at ``inc`` if it wins over the record;
        True when it changed the record (``news`` False: a member first heard of is not
        queued as news, see :meth:`join`)."""
        rec = self._table.get(mid)
        if rec is None:
            if state != ALIVE:
                return False
            if len(self._table) >= self.opt.max_members:
                self.ignored["full"] += 1
                return False
            rec = self._table[mid] = [ALIVE, inc]
            self._add_live(mid)
            self._events.append(MemberEvent(mid, ALIVE, inc, None, now))
            if news:
                self._enqueue(mid, ALIVE, inc)
            return True
        old, j = rec
        if not _wins(state, inc, old, j):
            return False
        rec[0], rec[1] = state, inc
        self._timers.pop(mid, None)
        if state == SUSPECT:
            self._timers[mid] = now + self.opt.suspicion_timeout(self.size())
        if state in (ALIVE, SUSPECT):
            self._add_live(mid)
            self._dead.pop(mid, None)
        else:
            self._drop_live(mid)
            self._dead.pop(mid, None)
            if state == DEAD:
                self._dead[mid] = None
        if state != old:
            self._events.append(MemberEvent(mid, state, inc, old, now))
        self._enqueue(mid, state, inc)
        return True

    def _add_live(self, mid: str) -> None:
        if mid not in self._live_at:
            self._live_at[mid] = len(self._live)
            self._live.append(mid)
            if self._order:  # a newcomer is probed in this pass too, at a random place
                self._order.insert(self.rng.randint(self._pos, len(self._order)), mid)

    def _drop_live(self, mid: str) -> None:
        i = self._live_at.pop(mid, None)
        if i is not None:
            last = self._live.pop()
            if last != mid:
                self._live[i] = last
                self._live_at[last] = i

    def _next_target(self) -> str | None:
        """The next member in the shuffled round-robin order (alive or suspect)."""
        for _ in range(2):
            while self._pos < len(self._order):
                mid = self._order[self._pos]
                self._pos += 1
                if mid in self._live_at:
                    return mid
            self._order = sorted(self._live)
            self.rng.shuffle(self._order)
            self._pos = 0
        return None

    def _pick(self, k: int, exclude: str) -> list[str]:
        """Up to ``k`` distinct random live members other than ``exclude``."""
        draw = self.rng.sample(self._live, min(len(self._live), k + 1))
        return [m for m in draw if m != exclude][:k]

    # -- messages out --------------------------------------------------------------------
    def _enqueue(self, mid: str, state: str, inc: int) -> None:
        self._news += 1
        self._queue[mid] = _Update(state, inc, 0, self._news)

    def _piggyback(self, to: str, first: Iterable[str] = ()) -> tuple[list[str], list[str], list[int]]:
        """The updates one message to ``to`` carries, at most ``max_piggyback``:

        1. the records named in ``first`` (corrections for the recipient) and what we
           hold against ``to`` (suspect or dead: it may refute), as they stand here;
        2. this node's own news, then the queue's least sent; each counts one
           transmission, and an update sent ``retransmit_limit`` times leaves the queue;
        3. the members this node holds suspect (while there is room): a recipient that
           knows better (they refuted, or are dead) answers with a correction, so a
           node that missed the news cannot time a live member out.
        """
        cap = self.opt.max_piggyback
        uid: list[str] = []
        ust: list[str] = []
        uinc: list[int] = []

        def add(m: str, state: str, inc: int) -> None:
            uid.append(m)
            ust.append(state)
            uinc.append(inc)

        rec = self._table.get(to)
        fixed = dict.fromkeys([*first, *((to,) if rec is not None and rec[0] in (SUSPECT, DEAD) else ())])
        for m in list(fixed)[:cap]:
            add(m, *self._table[m])
        keys = [m for m in self._queue if m != self.id and m not in fixed]
        room = cap - len(uid) - (self.id in self._queue)
        if len(keys) > room:
            q = self._queue
            keys = heapq.nsmallest(max(room, 0), keys, key=lambda m: (q[m].sent, -q[m].order))
        if self.id in self._queue and len(uid) < cap:
            keys.insert(0, self.id)
        limit = self.opt.retransmit_limit(self.size())
        for m in keys:
            u = self._queue[m]
            add(m, u.state, u.inc)
            u.sent += 1
            if u.sent >= limit:
                del self._queue[m]
        if len(uid) < cap and self._timers:
            have = set(uid)
            for m in self._timers:
                if m not in have:
                    add(m, *self._table[m])
                    if len(uid) >= cap:
                        break
        return uid, ust, uinc

    def _send(self, to: str, op: str, *, seq: int | None = None, target: str | None = None,
              piggyback: bool = True, first: Iterable[str] = ()) -> SwimMessage:
        x: dict[str, Any] = {"op": op, "inc": self.incarnation}
        if seq is not None:
            x["seq"] = seq
        if target is not None:
            x["target"] = target
        if piggyback:
            uid, ust, uinc = self._piggyback(to, first)
            if uid:
                x.update(uid=uid, ust=ust, uinc=uinc)
        self.sent[op] += 1
        return SwimMessage(to, self.id, x)

    def _gossip(self, now: float) -> list[SwimMessage]:
        """Push news to ``gossip_nodes`` random members (nothing when there is none)."""
        self._next_gossip = now + self.opt.gossip_interval
        out = []
        for to in self._pick(self.opt.gossip_nodes, exclude=self.id):
            if not self._queue:
                break
            out.append(self._send(to, "gossip"))
        return out
