"""The control plane of a real peer: discovery, member lists, heartbeats, goodbyes.

It runs on the transport's I/O thread, so liveness never waits for a long
training step. It answers ``hello`` with the member list, spreads member lists
(``members``), sends ``ping`` heartbeats carrying status, round and a member
digest, declares silent members dead, and announces joins: when a new node
says hello to a training cluster, the first member to hear it schedules the
round from which it takes part (far enough ahead that every member hears of it)
and tells everyone. It keeps saying hello to members declared dead, so that the
two halves of a partition that healed meet again: then the smaller cluster's
members join the larger one as new lives (see ``foreign`` in ``_control``).

A sender's word counts only once this node has reason to take it: it is a member
(or was one: a member declared dead, one that left), or it proved that it receives at
its address by sending back a token (see :mod:`gossip.protocol.contacts`). A stranger
that makes up ids, or lists of them, without receiving at those addresses, cannot
become a member nor make anyone one (see docs/PROTOCOL.md, "Strangers").

Every field of every control message is checked before use; a bad one is
counted and logged once per peer and reason, and changes nothing. State
messages (and state requests and replies) from a sender that is not a member
are refused here, on the I/O thread, so a flood of them never queues up for
the training thread. What is kept per unknown sender is capped, so senders
cycling through made-up ids cannot grow this node's memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import random
import threading
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable

from gossip.core.message import Message
from gossip.core.state import first_difference
from gossip.protocol.contacts import BadToken, Contacts
from gossip.protocol.detector import FailureDetector, Frame, HeartbeatDetector
from gossip.protocol.effects import Effects
from gossip.protocol.membership import RUNNING, Membership, cluster_after, stronger
from gossip.protocol.swim_detector import SwimDetector
from gossip.protocol.timing import DEFAULT_DETECTOR, DETECTORS, Timing
from gossip.transport import wire

__all__ = ["ControlPlane", "ControlFields", "Effects", "parse_control", "make_detector"]

log = logging.getLogger("gossip.control")

NODE_KINDS = frozenset({"state", "state-request", "state-reply", "average"})  # handled by the node thread
MAX_CONFLICTS = 64  # peers we remember (and answer) for refusing to mix: each costs a connection
MAX_LOGGED = 10_000  # (peer, reason) pairs logged once each
PACE_WINDOWS = 10  # seconds of this node's pace (rounds a second, measured each second) kept
MAX_PROBED = 64  # members declared dead we keep saying hello to (the most recent); lists that drop us kept
DELTA_IDS = 256  # members in one delta message (see ControlPlane._delta_messages): about 11 KB
MAX_MEMBERS = wire.MAX_LIST  # entries in one list of a control message (SWIM remembers as many, SwimOptions.max_members)
MAX_AGREE_BYTES = MAX_MEMBERS // 8  # an agreement bitmap: a bit per member, as many as a member list holds
MAX_DIFFERING = 64  # digests, and members, whose difference from this node's anti-entropy times (see _reconcile)
BACKOFF_MAX = 8.0  # seconds between hellos to a seed that does not answer or a member declared dead, at most


def _str_list(x: dict, key: str, limit: int = MAX_MEMBERS, min_len: int = 1) -> list[str] | None:
    v = x.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > limit or not all(
            isinstance(e, str) and min_len <= len(e) <= 256 for e in v):
        raise ValueError(key)
    return v


_BITS = bytes.maketrans(b"01", b"\x00\x01")


def set_bits(bits: bytes, ids: list[str]) -> list[str]:
    """The ids whose bit is set in the bitmap ``bits`` (bit ``i & 7`` of byte ``i >> 3`` for
    ``ids[i]``), in C loops: a start's agreement bitmaps arrive with most messages, and at
    thousands of members a loop over the ids in Python was a tenth of the start's time.

    >>> set_bits(bytes([0b101, 0b1]), list("abcdefghij"))
    ['a', 'c', 'i']
    """
    flags = format(int.from_bytes(bits, "little"), "b")[::-1].encode().translate(_BITS)  # flags[i]: bit i
    return list(itertools.compress(ids, flags))


def _int_list(x: dict, key: str, n: int) -> list[int] | None:
    v = x.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != n or not all(isinstance(e, int) and not isinstance(e, bool)
                                                         and 0 <= e < 2**63 for e in v):
        raise ValueError(key)
    return v


@dataclass(frozen=True)
class ControlFields:
    """The checked fields of a control message's ``x`` map (None: absent)."""

    inc: int
    status: str
    dc: str
    seeding: bool
    mids: list[str] | None
    mincs: list[int] | None
    mdcs: list[str] | None
    base: list[str] | None
    jids: list[str] | None
    jrounds: list[int] | None
    lids: list[str] | None
    lrounds: list[int] | None
    bincs: list[int] | None  # the lives the entries are about (absent or 0: not known)
    jincs: list[int] | None
    lincs: list[int] | None
    digest: str | None
    reason: Any
    # the leave rounds of lives that a newer one replaced (see Membership.former)
    fids: list[str] | None = None
    fincs: list[int] | None = None
    fends: list[int] | None = None
    seq: int | None = None  # the sender's count of control messages in this process (None: not said)
    # before the start: a member digest and two bitmaps over its sorted ids, the members
    # the sender knows to report that digest while waiting, and those of them whose seeds
    # all answered (see ControlPlane.agree)
    agree: tuple[str, bytes, bytes] | None = None
    # the lists hold only the entries of members that changed (see ControlPlane._delta_messages)
    delta: bool = False


def parse_control(msg: Message) -> ControlFields:
    """Check every field a control message may carry; ValueError names a bad one."""
    x = msg.extra
    inc = x.get("inc")
    if not isinstance(inc, int) or isinstance(inc, bool) or inc < 0:
        raise ValueError("inc")
    status = x.get("status")
    if status not in ("waiting", "training", "done"):
        raise ValueError("status")
    dc = x.get("dc", "")
    if not isinstance(dc, str) or len(dc) > 64:
        raise ValueError("dc")
    seeding = x.get("seeding", False)
    if not isinstance(seeding, bool):
        raise ValueError("seeding")
    seq = x.get("cseq")
    if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool) or seq < 0 or seq >= 2**63):
        raise ValueError("cseq")
    if msg.kind == "bye":
        return ControlFields(inc, status, dc, seeding, *([None] * 11), None, x.get("reason", "left"), seq=seq)
    agree = x.get("agree")
    if agree is not None:
        try:  # [digest, the two bitmaps in hex]
            if not (isinstance(agree, list) and len(agree) == 3 and isinstance(agree[0], str) and len(agree[0]) <= 64
                    and all(isinstance(a, str) and len(a) <= 2 * MAX_AGREE_BYTES for a in agree[1:])):
                raise ValueError
            agree = (agree[0], bytes.fromhex(agree[1]), bytes.fromhex(agree[2]))
        except ValueError:
            raise ValueError("agree") from None
    mids = _str_list(x, "mids")
    mincs = _int_list(x, "mincs", len(mids)) if mids is not None else None
    mdcs = _str_list(x, "mdcs", min_len=0) if mids is not None else None
    base = _str_list(x, "base")
    jids = _str_list(x, "jids")
    jrounds = _int_list(x, "jrounds", len(jids)) if jids is not None else None
    lids = _str_list(x, "lids")
    lrounds = _int_list(x, "lrounds", len(lids)) if lids is not None else None
    bincs = _int_list(x, "bincs", len(base)) if base is not None and "bincs" in x else None
    jincs = _int_list(x, "jincs", len(jids)) if jids is not None and "jincs" in x else None
    lincs = _int_list(x, "lincs", len(lids)) if lids is not None and "lincs" in x else None
    fids = _str_list(x, "fids")
    fincs = _int_list(x, "fincs", len(fids)) if fids is not None else None
    fends = _int_list(x, "fends", len(fids)) if fids is not None else None
    digest = x.get("digest")
    delta = x.get("delta", False)
    if not isinstance(delta, bool) or (delta and base is not None):
        raise ValueError("delta")
    return ControlFields(inc, status, dc, seeding, mids, mincs, mdcs, base, jids, jrounds, lids, lrounds, bincs,
                         jincs, lincs, digest if isinstance(digest, str) else None, x.get("reason"), fids, fincs, fends,
                         seq, agree, delta)


class ControlPlane:
    """Membership protocol of one peer (I/O thread side).

    Parameters
    ----------
    node_id, incarnation, fingerprint, dc : who this node is
    membership : the shared member table (guarded by ``lock``)
    send : ``send(dst_id, Message)`` through the transport
    to_node : hands node-thread messages (state, state requests and replies) over
    progress : returns this node's (status, round, step)
    timing : the protocol's timings (:class:`~gossip.protocol.timing.Timing`)
    seeds : ``HOST:PORT`` ids to contact until they answer
    reconnect : ``reconnect(peer)`` when a member came back: open a fresh connection
    excluded : ``excluded(round, by, cluster, merge)`` when this node, alive and
        training, must join ``cluster`` (the members ``by`` trains with) as a new
        life. Either ``by`` announces that this node leaves at ``round``: it was
        declared dead (silent for longer than ``dead_after``, e.g. a paused
        process; ``merge`` False). Or ``by`` trains in another cluster that does
        not count this node while this node's does not count ``by``, and that
        cluster is the stronger (``merge`` True; ``round`` is ``by``'s round): two
        halves of a partition that healed, or clusters started apart, meet
    clock : when given, read on every incoming message, so a message is timed when
        it is handled (otherwise ``now`` is the last tick's time)
    secret : the key of this node's tokens (default: random, per process; a simulated
        peer passes one of its own, so that a run replays exactly)
    detector : the failure detector, or its name (``"swim"``, the default
        (:data:`~gossip.protocol.detector.DEFAULT_DETECTOR`): :class:`~gossip.protocol.swim_detector.SwimDetector`;
        ``"heartbeat"``: :class:`~gossip.protocol.detector.HeartbeatDetector`, every member pings
        every other each ``heartbeat``)
    """

    def __init__(self, node_id: str, incarnation: int, fingerprint: str, dc: str, membership: Membership,
                 lock: threading.RLock, send: Callable[[str, Message], None], to_node: Callable[[Message], None],
                 progress: Callable[[], tuple[str, int, int]], *, timing: Timing,
                 seeds: tuple[str, ...] = (), reconnect: Callable[[str], None] | None = None,
                 excluded: Callable[[int, str], None] | None = None,
                 clock: Callable[[], float] | None = None, detector: FailureDetector | str | None = None,
                 secret: bytes | None = None) -> None:
        self.id, self.incarnation, self.fingerprint, self.dc = node_id, incarnation, fingerprint, dc
        self.contacts = Contacts(timing, secret)  # first contacts (see _admit)
        self.m = membership
        self.lock = lock
        self.send = send
        self.to_node = to_node
        self.progress = progress
        self.timing = timing
        self.reconnect = reconnect
        self.excluded = excluded
        self.seeds = {s: [0.0, timing.heartbeat] for s in seeds if s != node_id}  # id -> [next try, backoff]
        self.probes: dict[str, list[float]] = {}  # member declared dead -> [next hello, backoff]
        self.probed: dict[str, float] = {}  # member said a light hello to (see _probe) -> when
        # training members whose lists drop us: who -> (its cluster, our leave round), since when
        # (the evidence of one life: a new life starts without it, see new_life)
        self.excluded_by: dict[str, tuple[set[str], int]] = {}
        self.excluded_since = 0.0
        self.rejected: Counter[str] = Counter()
        self.conflicts: dict[str, str] = {}  # peer -> why we refuse it (fingerprint, version)
        # "name|shape|dtype" of each tensor the fingerprint hashes: sent to a peer with another
        # fingerprint, so that each side names the first difference (set by the driver)
        self.model_spec: list[str] | None = None
        self._logged: set[tuple[str, str]] = set()
        self._reject_lock = threading.Lock()  # the I/O thread and the node thread both count
        self.digests: dict[str, str] = {}  # member -> the member digest it last reported
        # before the start: the members known to report this node's member digest while
        # waiting, each in a message of its own or in another member's bitmap of such
        # members (an epidemic: a fresh start need not hear from every member itself), and
        # those of them whose ``--peers`` seeds all answered
        self.agree: set[str] = set()
        self.ready: set[str] = set()
        self._agreed_on = ""  # the digest they are about (a change of the member set empties them)
        self._agree_bits: tuple[bool, list[str]] | None = None  # (ready itself, the field it sends)
        self.last_change = 0.0
        self.woke = -math.inf  # when this process last ran again after a stall of its own
        self.last_ping = 0.0
        # news not spread yet: the member-table version before it (None: none), and when
        # this node last spread news (see _news)
        self._unspread: int | None = None
        self._spread_at = -math.inf
        self.now = 0.0
        self.clock = clock
        # who is alive: told of every message, asked every tick (see gossip.protocol.detector)
        self._pace = (-math.inf, 0)  # (when, round) this node's pace was last measured from
        self._paces: deque[float] = deque(maxlen=PACE_WINDOWS)  # rounds a second, one a second
        self._digest = ""  # the member digest the detector's messages carry (set before each call to it)
        # anti-entropy (see _reconcile): since when each digest other than this node's was
        # reported, and since when each member's reports have differed from it
        self._stale_digests: dict[str, float] = {}
        self._stale_members: dict[str, float] = {}
        self._seq = itertools.count(1)  # numbers this process's control messages (next() is atomic)
        self._rng = random.Random(f"spread|{node_id}|{incarnation}")  # whom a change is told to (see _spread)
        self.detector: FailureDetector = make_detector(detector, membership, timing, self._frame)
        membership.suspected = self.detector.suspected  # (see Membership.round_now)

    # -- helpers ---------------------------------------------------------------------------
    def reject(self, peer: str, reason: str, detail: str = "", *, count: bool = True) -> None:
        """Count a refused message under ``reason`` (unless ``count`` is False: counted
        elsewhere) and log it once per peer and reason."""
        with self._reject_lock:
            if count:
                self.rejected[reason] += 1
            if (peer, reason) in self._logged or len(self._logged) >= MAX_LOGGED:
                return
            self._logged.add((peer, reason))
        log.warning("%s: rejected a message from %s: %s%s", self.id, peer[:64], reason,
                    f" ({detail})" if detail else "")

    def _conflict(self, peer: str, why: str, *, replace: bool = True) -> bool:
        """Remember that we refuse ``peer`` (bounded); False if it was not remembered."""
        if peer not in self.conflicts and len(self.conflicts) >= MAX_CONFLICTS:
            return False
        if replace or peer not in self.conflicts:
            self.conflicts[peer] = why
        return True

    # -- first contacts ----------------------------------------------------------------------
    def token(self, peer: str) -> str:
        """This process's token for ``peer`` (see :meth:`Contacts.token`)."""
        return self.contacts.token(peer)

    def vouched(self, peer: str) -> bool:
        """Whether ``peer``'s word counts without a token: a member (admitted on a member's
        word or its own), a member declared dead or gone, or an id that proved its address."""
        m = self.m
        return peer in m.members or peer in self.contacts.proven or peer in m.dead or peer in m.departed

    def _expected(self, peer: str) -> bool:
        """Whether this node has a reason to hear from ``peer`` before it counts: a seed, an
        id it said hello to, a member declared dead that it probes."""
        return peer in self.seeds or peer in self.contacts.greeted or peer in self.probes

    def _admit(self, peer: str, msg: Message) -> Message | None:
        """``msg`` (a control message) if its sender's word counts (:meth:`vouched`), or if
        it sends this node's token back (then ``peer`` proved its address). Otherwise None:
        ``peer`` gets a light hello with the token (see :meth:`Contacts.challenge` for how
        often), and the message changes nothing. A sender whose refused message was a hello
        answers the token with its member list: that list counts as the hello it stands for
        (a joiner's join is scheduled on it, not a seed retry later)."""
        c = self.contacts
        try:
            tok, echo = c.take(msg)
        except BadToken as e:
            self.reject(peer, "token", str(e))
            return None
        with self.lock:
            vouched = self.vouched(peer)
            if not vouched:
                vouched, answered_hello = c.prove(peer, echo)
                if answered_hello and msg.kind == "members":
                    msg = dataclasses.replace(msg, kind="hello")
            if vouched:
                c.heard(peer, tok)
                return msg
            # (its fields are not read: a flood of made-up lists costs their decoding only)
            c.unproven += 1  # (not a rejection: every first contact of an honest peer is one)
            if msg.kind == "bye" or not c.challenge(peer, msg.kind == "hello", self._expected(peer), self.now):
                return None
            reply = self._probe_message()
        self.send(peer, c.challenge_message(peer, reply, tok))
        return None

    def _expire_contacts(self, now: float, fx: Effects) -> None:
        """Forget the senders that never sent their token back within ``dead_after`` (and
        close the connections this node opened to them), and the ids said hello to
        unasked ``join_timeout`` ago."""
        with self.lock:
            old = self.contacts.expire(now)
            fx.reconnect += [p for p in old if not self.vouched(p) and not self._expected(p) and p != self.id]

    def _message(self, kind: str, **extra: Any) -> Message:
        status, rnd, step = self.progress()
        # seq: this process's count of control messages, so that a receiver tells the
        # latest word on this node's status, round and digest from an older message that
        # arrived late (a slow link, reordering, a socket of its own; see Membership.latest)
        x = {"inc": self.incarnation, "status": status, "dc": self.dc, "seeding": bool(self.seeds),
             "cseq": next(self._seq), **extra}
        if status == "waiting" and kind != "bye":
            agree = self._agree_field()
            if agree is not None:
                x["agree"] = agree
        return Message(kind, self.id, rnd, step, 0, None, None, x, self.fingerprint)

    def _delta_messages(self, since: int) -> list[Message]:
        """The entries of the members whose entries changed after member-table version
        ``since`` (their rows, joins, leaves and former lives), as ``members`` messages
        marked ``delta`` of at most :data:`DELTA_IDS` members each: news of a change costs
        what changed, not the whole table (which travels in a hello's answer and when
        two members' digests differ, see :meth:`handle`). A receiver takes a delta's
        schedule entries only from a member its own schedule counts: a delta does not
        say which cluster its sender is in."""
        with self.lock:
            ids = sorted(self.m.changed_since(since))
            out = []
            for i in range(0, len(ids), DELTA_IDS):
                out.append(self._entries(ids[i:i + DELTA_IDS]))
        return [self._message("members", **x) for x in out]

    def _entries(self, ids: list[str] | None) -> dict[str, Any]:
        """The ``x`` fields of a member list: the whole table (``ids`` None) or the entries
        of ``ids`` only, a delta (call with ``lock`` held)."""
        m = self.m
        if ids is None:
            report = m.report()
        else:
            report = [[mid, m.members[mid].incarnation] for mid in ids if mid in m.members]
        x: dict[str, Any] = {"mids": [r[0] for r in report], "mincs": [r[1] for r in report],
                             "mdcs": [m.members[r[0]].dc for r in report]}
        if ids is not None:
            x["delta"] = True
        if m.started:
            if ids is None:
                base = sorted(m.base)
                joins = sorted(m.joins.items())
                leaves = sorted(m.leaves.items())
                formed = m.former.items()
            else:
                base = None
                joins = [(j, m.joins[j]) for j in ids if j in m.joins]
                leaves = [(j, m.leaves[j]) for j in ids if j in m.leaves]
                formed = [(j, m.former[j]) for j in ids if j in m.former]
            x.update(jids=[j for j, _ in joins], jrounds=[r for _, r in joins],
                     lids=[j for j, _ in leaves], lrounds=[r for _, r in leaves])
            # the life each entry is about, so that every node applies them alike in any
            # order (0: not known, e.g. this node's own life is its incarnation)
            life = m.lives.get
            x.update(jincs=[self.incarnation if j == self.id else life(j, 0) for j, _ in joins],
                     lincs=[life(j, 0) for j, _ in leaves])
            if base is not None:  # (a delta carries no base: a receiver learns a start from whole lists)
                x.update(base=base, bincs=[self.incarnation if b == self.id else life(b, 0) for b in base])
            # the leaves of lives a newer one replaced (a member that hears the new
            # life's join before the old one's leave keeps the old one's rounds right)
            former = sorted((j, inc, rec[1]) for j, lives in formed for inc, rec in lives.items() if rec[1] is not None)
            if former:
                x.update(fids=[j for j, _, _ in former], fincs=[i for _, i, _ in former],
                         fends=[r for _, _, r in former])
        # the digest of the whole table: each change reaches every member with the
        # sender's digest, so a fresh start need not wait for a probe to meet each
        # member to learn that it agrees (see settled)
        x["digest"] = m.digest()
        return x

    def _members_message(self, kind: str = "members") -> Message:
        with self.lock:
            return self._message(kind, **self._entries(None))

    def _probe_message(self) -> Message:
        """A hello to a member declared dead (see :meth:`_probe`), and the one that carries
        this node's token to a sender not vouched for (see :meth:`_admit`): this node and its
        digest only. A hello with the whole table, every few seconds to each member found
        dead, cost 176 KB a hello at 4,096 members: after one crash about 22 KB per
        survivor per second, for as long as the dead one stays dead."""
        with self.lock:
            me = self.m.members[self.id]
            return self._message("hello", mids=[self.id], mincs=[me.incarnation], mdcs=[me.dc],
                                 digest=self.m.digest())

    def _agreement(self) -> str:
        """This node's member digest, with ``agree`` and ``ready`` emptied if they are
        about another (call with ``lock`` held)."""
        mine = self.m.digest()
        if mine != self._agreed_on:
            self._agreed_on, self.agree, self.ready, self._agree_bits = mine, set(), set(), None
        return mine

    def _agree_field(self) -> list | None:
        """``[digest, agree, ready]``, the two sets as bitmaps over the sorted ids in hex,
        this node in both (in ``ready`` once its own seeds answered)."""
        with self.lock:
            if self.m.started:
                return None
            mine = self._agreement()
            me = not self.seeds
            if self._agree_bits is None or self._agree_bits[0] != me:
                agree, ready = bytearray((len(self.m.members) + 7) // 8), bytearray((len(self.m.members) + 7) // 8)
                for i, mid in enumerate(self.m.ids()):
                    if mid in self.agree or mid == self.id:
                        agree[i >> 3] |= 1 << (i & 7)
                    if mid in self.ready or (me and mid == self.id):
                        ready[i >> 3] |= 1 << (i & 7)
                self._agree_bits = (me, [mine, agree.hex(), ready.hex()])
            return self._agree_bits[1]

    def _learn_agreement(self, peer: str, f: ControlFields, latest: bool, now: float) -> None:
        """What ``peer``'s message says of who reports this node's digest (lock held). Not
        a message handled as this node wakes from a stall: it waited in the socket, and
        says what held before the stall."""
        if now <= self.woke:
            return
        mine = self._agreement()
        before = len(self.agree), len(self.ready)
        if latest and f.digest == mine and f.status == "waiting" and peer in self.m.members:
            self.agree.add(peer)
            if not f.seeding:
                self.ready.add(peer)
        if f.agree is not None and f.agree[0] == mine:
            ids = self.m.ids()
            for bits, into in zip(f.agree[1:], (self.agree, self.ready)):
                if len(bits) == (len(ids) + 7) // 8:
                    into.update(set_bits(bits, ids))
                    into.discard(self.id)
        self.ready &= self.agree
        if (len(self.agree), len(self.ready)) != before:
            self._agree_bits = None

    def _frame(self, kind: str, fields: dict) -> Message:
        """A detector's message of ``kind``, framed as this node's (see gossip.protocol.detector)."""
        return self._message(kind, digest=self._digest, **fields)

    def _note_round(self, now: float) -> None:
        """This node's round into its own record of the member table (call with ``lock``
        held). Leave and join rounds are announced past the furthest round a member
        reports (``Membership.max_round``), this node's included: a node that has just
        joined may hear no trainer but itself, and a leave it announces then must not
        be for a round its cluster has passed. Also this node's pace: the most rounds a
        second it ran in any of its last :data:`PACE_WINDOWS` seconds (a stall of its own,
        a wait for a dead neighbour, does not make it guess that the others stalled too):
        see ``Membership.round_now``. Only rounds trained count: a joiner's round jumps to
        its donor's, thousands at once, and taken for a pace that jump put the joins and
        leaves it announced in the next seconds thousands of rounds ahead (a real cluster
        under churn then waited out a round timeout per round for minutes)."""
        status, rnd, _ = self.progress()
        me = self.m.members[self.id]
        me.round, me.round_at, self.m.clock = rnd, now, now
        if status != "training":
            self._pace = (-math.inf, rnd)  # measured afresh from its first round trained
            return
        since, then = self._pace
        if now - since >= 1.0:
            if math.isfinite(since):
                self._paces.append(max(0.0, (rnd - then) / (now - since)))
                self.m.rate = max(self._paces)
            self._pace = (now, rnd)

    def announce_status(self) -> Effects:
        """A ping to every member now, with this node's status (it just changed). With
        SWIM a member hears another only when a probe meets it, once per pass of the
        probe order (n - 1 periods): a finished node would wait that long to learn that
        all the others finished too."""
        with self.lock:
            digest = self.m.digest()
        return Effects(broadcasts=[self._message("ping", digest=digest)])

    def tell_status(self, peers: list[str]) -> Effects:
        """A ping to each of ``peers`` now, with this node's status and round."""
        with self.lock:
            digest = self.m.digest()
        return Effects(sends=[(p, self._message("ping", digest=digest)) for p in peers])

    def announce_members(self) -> Effects:
        """This node's whole member list (and schedule) to :meth:`Timing.spread` random
        members now, who pass on what is news to them (as deltas, see :meth:`_news`)."""
        fx = Effects()
        self._spread(fx, [self._members_message()])
        return fx

    # -- incoming --------------------------------------------------------------------------
    def on_frames(self, ident: bytes, frames: list) -> None:
        """Decode, check and dispatch one incoming multipart (the shell: it carries out
        the effects that :meth:`handle` returns)."""
        peer = ident.decode(errors="replace")
        if self.clock is not None:
            self.now = self.clock()
        try:
            msg = wire.decode(frames)
        except wire.WireError as e:
            if e.reason == "version":
                self._conflict(peer, e.detail, replace=False)
            self.reject(peer, e.reason, e.detail)
            return
        if msg.sender != peer:
            self.reject(peer, "sender-mismatch", f"header says {str(msg.sender)[:64]!r}")
            return
        if not isinstance(msg.sender, str):
            self.reject(peer, "header", "sender id must be a string")
            return
        if msg.kind in NODE_KINDS:
            with self.lock:
                member = self.m.members.get(peer)
                if member is not None:
                    self.detector.heard(peer, self.now)
                    if msg.kind == "state":
                        member.heard_state(self.now)
            if member is None:
                self.reject(peer, "not-member", f"{msg.kind} from a node that is not a member")
                return
            self.to_node(msg)  # the node thread checks membership, fingerprint, payload
            return
        admitted = self._admit(peer, msg)
        if admitted is None:
            return
        try:
            effects = self.handle(admitted, self.now)
        except (ValueError, TypeError, KeyError) as e:
            self.reject(peer, "control", f"bad field {e}")
            return
        self.apply(effects)

    def apply(self, fx: Effects) -> None:
        """Carry out what a message, a tick or a command decided (the shell: the only
        place, with :meth:`on_frames`, where the control plane reaches the transport)."""
        if fx.verdict is not None and self.excluded is not None:
            self.excluded(*fx.verdict)
        for mid in fx.reconnect if self.reconnect is not None else ():
            # a fresh connection: one that kept retrying a dead life backs off for seconds, one
            # towards a member that says hello while it trains may deliver nothing (see handle)
            self.reconnect(mid)
        with self.lock:  # (the tokens: see Contacts.stamp)
            stamp = self.contacts.stamp
            sends = [(dst, stamp(dst, msg, self.vouched(dst))) for dst, msg in fx.sends]
            if fx.broadcasts:
                others = self.m.others()
                sends += [(peer, stamp(peer, msg, self.vouched(peer))) for msg in fx.broadcasts for peer in others]
        for dst, msg in sends:
            self.send(dst, msg)

    def handle(self, msg: Message, now: float) -> Effects:
        """One control message (hello, members, ping, pong, bye, swim) from ``msg.sender`` at
        ``now``: updates the member table and returns what to send, whom to
        reconnect, and any verdict on this node. Raises ValueError (TypeError,
        KeyError) naming a bad field; then nothing changed."""
        if msg.kind == "swim":
            return self._on_swim(msg, now)
        f = parse_control(msg)
        peer = msg.sender
        fx = Effects()
        if msg.kind == "bye":
            self._on_bye(peer, f, msg, now, fx)
            return fx
        if msg.fingerprint != self.fingerprint:
            why = (f"fingerprint mismatch: {peer} has model fingerprint {msg.fingerprint[:32]!r}, this node "
                   f"{self.fingerprint!r}; refusing to mix with it")
            remembered = self._conflict(peer, why, replace=False)  # (keep a difference named already)
            self.reject(peer, "fingerprint", self.conflicts.get(peer, why))
            if msg.kind == "hello" and remembered:  # bounded: each answer opens a connection
                fx.sends.append((peer, self._fingerprint_bye()))
            self.seeds.pop(peer, None)
            return fx
        self.seeds.pop(peer, None)  # it answered: stop retrying it as a seed
        with self.lock:
            self._note_round(now)
            before = self.m.version
            was = self.m.members.get(peer)
            was = None if was is None else was.incarnation
            new_member, reply, scheduled = self._update(msg, f, now, fx)
            fx.reconnect = self.m.take_renewed()
            if msg.kind == "hello" and f.status == "training" and was == f.inc and peer not in fx.reconnect:
                # a member that trains, in the life this node knows, says hello: its rounds keep
                # timing out waiting for this node (Lifecycle.out_of_step), or it doubts this
                # node's lists. The connection from here to it may deliver nothing while its own
                # towards here does (a link broken one way: 61 rounds of --timeout in a row in a
                # real run, benchmarks/RESULTS.md): a fresh one before the answer goes
                fx.reconnect.append(peer)
            # the sender itself is the news (a node, or a life, this node had not heard of): it
            # may be the only member that knows of it yet, and may crash within the tick
            firsthand = peer in self.m.members and (was is None or was < self.m.members[peer].incarnation)
        if reply:
            fx.sends.append((peer, self._members_message()))
        elif msg.kind == "members" and self.probed.pop(peer, None) is not None:
            # the answer to a light probe (see _probe): the other side gets this node's
            # whole table back, as a whole hello gave it, so that both sides of a healed
            # partition judge the other from its lists (explorer seed 8200024619: with the
            # answerer's side judging alone, the sides joined each other piecewise)
            fx.sends.append((peer, self._members_message()))
        if scheduled:  # (a join or a restart's leave it scheduled: every member must hear of it in time)
            fx.broadcasts += self._delta_messages(before)
        elif new_member:  # news to this node: passed on as an epidemic
            self._news(fx, before, now, at_once=firsthand)
        elif msg.kind == "ping" and f.digest is not None:
            self._reconcile(peer, f.digest, now, fx)
        return fx

    def _reconcile(self, peer: str, digest: str, now: float, fx: Effects) -> None:
        """Anti-entropy: ``peer`` reports member digest ``digest``. One other than this
        node's gets this node's whole table, so that a member that missed some news
        learns it. Before a start at once: tables are how a forming cluster agrees. In
        a running cluster, only once the difference has lasted
        :meth:`Timing.reconcile_after`: that digest reported to this node for that long,
        or every report of ``peer``'s differing for that long. While news spreads (a
        crash, a join) members differ for a few probe periods and the deltas and SWIM's
        news settle it; each probe between two of them carried a whole table (176 KB at
        4,096 members), and the tables, not the news, made a crash dear. Each clock
        restarts with the table it sent: at most one table a wait for each digest. A
        member behind for good is still answered under churn, when every change makes
        its digest another (the member clock), and at once when its digest is an old
        one other members showed too (the digest clock)."""
        with self.lock:
            if digest == self.m.digest():
                self._stale_members.pop(peer, None)
                return
            if self.m.started:
                wait = self.timing.reconcile_after(len(self.m.members))
                clocks = [(self._stale_digests, digest), (self._stale_members, peer)]
                for clock, key in clocks:
                    if key not in clock:
                        if len(clock) >= MAX_DIFFERING:  # (the oldest goes)
                            del clock[next(iter(clock))]
                        clock[key] = now
                if all(now - clock[key] < wait for clock, key in clocks):
                    return
                for clock, key in clocks:
                    clock.pop(key)
                    clock[key] = now
        fx.sends.append((peer, self._members_message()))

    def _on_swim(self, msg: Message, now: float) -> Effects:
        """A failure detector's own message (SWIM): every field checked first, read as
        a ping of the sender's life (status, round, member digest), then handed to
        the detector, whose replies go back framed as this node's messages."""
        fx = self.handle(self.detector.control_view(msg), now)  # ValueError: not the detector's kind
        with self.lock:
            member = self.m.members.get(msg.sender)
            if msg.fingerprint != self.fingerprint or member is None or member.incarnation > msg.extra["life"]:
                return fx  # refused as a ping, or from an older life
            self._digest = self.m.digest()
            return fx.add(self.detector.receive(msg, now))

    def _fingerprint_bye(self) -> Message:
        """The goodbye to a peer with another model: this node's tensors go with it (as
        many as fit a header), so that the peer can name the first difference."""
        spec, size = [], 0
        for entry in self.model_spec or []:
            size += len(entry) + 8
            if size > 40_000:
                break
            spec.append(entry[:1024])
        return self._message("bye", reason="fingerprint mismatch: another model", spec=spec)

    def _on_bye(self, peer: str, f: ControlFields, msg: Message, now: float, fx: Effects) -> None:
        reason = str(f.reason or "left")
        mismatch = reason.startswith("fingerprint")
        with self.lock:
            m = self.m.members.get(peer)
            if m is not None and f.inc >= m.incarnation:
                self.m.remove(peer, f"said goodbye ({reason[:200]})", departed=True, now=now)
                self.last_change = now
        if mismatch:
            # said from the peer's side: its words name it "this node". Ours, named from here
            spec = msg.extra.get("spec")
            if isinstance(spec, list) and self.model_spec is not None and all(isinstance(e, str) for e in spec):
                why = (f"fingerprint mismatch: {peer} runs another model (first difference: "
                       f"{first_difference(self.model_spec, spec)}); refusing to mix with it")
            else:
                why = f"fingerprint mismatch: {peer} runs another model; refusing to mix with it"
            told = peer in self.conflicts
            if self.conflicts.get(peer) != why:
                log.warning("%s: %s", self.id, why)
            if self._conflict(peer, why) and not told:
                fx.sends.append((peer, self._fingerprint_bye()))  # its turn to name the difference
        self.seeds.pop(peer, None)

    def _update(self, msg: Message, f: ControlFields, now: float, fx: Effects) -> tuple[bool, bool, bool]:
        """The member table learns what ``msg`` says (call with the lock held).
        Returns (whether the member set or schedule changed, whether to reply, whether
        this node scheduled a join or a leave of its own on it)."""
        peer, inc, status = msg.sender, f.inc, f.status
        before = self.m.version
        old = self.m.members.get(peer)
        if old is None and self.m.departed.get(peer, -1) >= inc:
            # that life said goodbye: what it sent before (late, or a duplicate) says nothing
            # now. A node that starts afresh meanwhile (its cluster finished) would take the
            # finished cluster's schedule from it, and then settle with nobody
            return False, False, False
        restarted = old is not None and inc > old.incarnation  # a new life of a node we knew
        # the peer's life this node's schedule counts (else the table's) ended when a newer
        # one speaks, whether the table learned of the newer life from the peer itself or,
        # before, from a member list (merge takes a newer life silently: its first direct
        # message is then no restart, and the old life would stay counted for good)
        counted = self.m.lives.get(peer, old.incarnation if old is not None else None)
        ended = counted if counted is not None and counted < inc else None
        # the peer's cluster (as it will be once its announced changes take effect)
        theirs = None if f.base is None else cluster_after(f.base, f.jids or (), f.lids or ())
        ours = self.m.eventual()
        # the peer's lists describe another cluster when neither cluster counts the other
        # node: they change nothing here. A node that waits to join a cluster this node
        # is not in says so too; its join round there is not one here.
        # (a new life of a member counts as that member only once its own join is heard)
        other = theirs is not None and self.m.started and self.id not in theirs \
            and not (peer in ours and self.m.counts(peer, inc))
        # another cluster that trains, met by a node that trains: the halves of a
        # partition that healed meet so (each side announced the other's leaves), and so
        # do clusters started apart (a seed that answered late). The stronger goes on;
        # each member of the other joins it as a new life.
        foreign = other and status == "training" and self.progress()[0] == "training"
        if foreign and stronger(theirs, ours):  # type: ignore[arg-type]
            # (its view may still count some of ours: we join its own members)
            fx.verdict = (msg.round, peer, theirs - ours, True)  # type: ignore[operator]
        # while joining another cluster, only its members' lists count
        lists = not other and (not self.m.target or peer in self.m.target)
        if f.delta and self.m.started and not self.m.counts(peer, inc):
            lists = False  # (a delta does not say the sender's cluster: only a member's counts, see _delta_messages)
        latest = self.m.latest(peer, inc, f.seq)
        self.m.heard(peer, inc, now, status=status, round=msg.round, step=msg.progress, dc=f.dc,
                     fingerprint=msg.fingerprint, seq=f.seq)
        if f.mids is not None and f.mincs is not None:
            self.m.merge(zip(f.mids, f.mincs), now)
            if f.mdcs is not None and len(f.mdcs) == len(f.mids):
                for mid, mdc in zip(f.mids, f.mdcs):
                    if mid in self.m.members and not self.m.members[mid].dc:
                        self.m.set_label(mid, mdc)
        if lists and f.base is not None and not self.m.started and status in RUNNING:
            self._learn_start(f)
        # leaves before joins: a restarted member's old life leaves before its new one joins
        if lists and f.lids is not None and f.lrounds is not None:
            self._learn_leaves(peer, f, theirs, now)
        if lists and f.jids is not None and f.jrounds is not None:
            for j, r, ji in zip(f.jids, f.jrounds, f.jincs or [0] * len(f.jids)):
                self.m.announce_join(j, r, ji or None)
        if lists and f.fids is not None and f.fincs is not None and f.fends is not None:
            for j, fi, r in zip(f.fids, f.fincs, f.fends):
                if fi:
                    self.m.announce_leave(j, r, fi)  # (an old life's: see Membership.former)
        if lists and self.m.started:  # the lives of scheduled members this node knows no life of
            if f.base is not None and f.bincs is not None:
                self.m.fill_lives(zip(f.base, f.bincs))
            if f.jids is not None and f.jincs is not None:
                self.m.fill_lives(zip(f.jids, f.jincs))
        if latest:  # (an older message's digest and seeds are older news)
            if f.digest is not None:
                self.digests[peer] = f.digest
        if not self.m.started:
            self._learn_agreement(peer, f, latest, now)
        new_member = self.m.version != before
        my_status, my_round, _ = self.progress()
        if new_member:
            self.last_change = now
        scheduled = False
        if ended is not None and my_status == "training" and self.m.started and peer in self.m.eventual():
            # a new life of a member we train with: its old life sends no more. It leaves
            # at an announced round (its new life joins when it says hello to someone,
            # maybe in another cluster, see foreign above)
            scheduled = self.m.announce_leave(
                peer, self.m.max_round() + self.m.announce_margin(self.timing.leave_margin), ended)
        if msg.kind != "hello":
            return new_member, False, scheduled
        active = self.m.counts(peer, inc)
        # (a hello from a training node that is not active here comes from another
        # cluster: not a joiner; nor is a node that waits to join another cluster; nor
        # a hello that waited in the socket while this process stalled: the sender may
        # train elsewhere by now, and says hello again if it still waits (explorer seed
        # 9303028181: a node woke from a stall of 3.5 s, scheduled the join of a restarted
        # member that had since started a cluster of its own with the third node, and the
        # three ended with two member lists)
        if my_status == "training" and self.m.started and status == "waiting" and (restarted or not active) \
                and not other and now > self.woke:
            # a node joins a running cluster (a new one, or a new life of a member):
            # everyone adopts it from the same future round, after its old life left
            eff = max(max(my_round, self.m.max_round()) + self.m.announce_margin(self.timing.join_margin),
                      self.m.leaves.get(peer, 0))
            self.m.announce_join(peer, eff, inc)
            log.info("%s: %s joins the running cluster from round %d", self.id, peer, eff)
            new_member = scheduled = True
        return new_member, True, scheduled

    def _learn_start(self, f: ControlFields) -> None:
        """We learn how the running cluster started; if it started with an earlier
        life of ours (it lists another incarnation of us, or our leave), we are not
        one of its starters any more but a node that joins."""
        base = f.base or []
        listed = dict(zip(f.mids, f.mincs)) if f.mids is not None and f.mincs is not None else {}
        former = listed.get(self.id, self.incarnation) != self.incarnation or self.id in (f.lids or ())
        if f.bincs is not None and self.id in base and f.bincs[base.index(self.id)] not in (0, self.incarnation):
            former = True  # it started with an earlier life of ours
        elif self.id in base and self.id in (f.lids or ()) and listed.get(self.id, self.incarnation) == self.incarnation:
            # it started with this very life, which left before it trained: that life
            # cannot join again (the schedule holds one life per member); a new one can
            lincs = dict(zip(f.lids or (), f.lincs or [0] * len(f.lids or ())))
            self.m.spent = lincs.get(self.id) in (0, self.incarnation)
        starters = [(b, i) for b, i in zip(base, f.bincs or [0] * len(base)) if not (former and b == self.id)]
        self.m.start([b for b, _ in starters], [i or None for _, i in starters])

    def _learn_leaves(self, peer: str, f: ControlFields, theirs: set[str] | None, now: float) -> None:
        rejoining = set(f.jids or ())
        for j, r, li in zip(f.lids or [], f.lrounds or [], f.lincs or [0] * len(f.lids or [])):
            if j == self.id:
                # a leave not after our own first round, or of another life, is an
                # earlier life's, long done
                if f.status != "waiting" and self.progress()[0] == "training" and theirs is not None \
                        and r > self.m.joins.get(self.id, 0) and li in (0, self.incarnation) \
                        and len(self.excluded_by) < MAX_PROBED:
                    self.excluded_since = self.excluded_since if self.excluded_by else now
                    self.excluded_by[peer] = (theirs, r)  # judged in tick()
                continue
            member = self.m.members.get(j)
            # take another node's word for a death only if we have not heard from it
            # lately ourselves (one false suspicion must not evict a live member), or
            # when the same list schedules its new life (a restart, not a suspicion),
            # or when we join the sender's cluster (we take its lists as they are)
            if member is None or now - member.last_seen > self.timing.dead_after / 2 or j in rejoining \
                    or peer in self.m.target or (li and member.incarnation > li):
                self.m.announce_leave(j, r, li or None)

    # -- timers ----------------------------------------------------------------------------
    def tick(self, now: float) -> Effects:
        """Heartbeats, seed retries and the failure detector: what to send now, the members
        just declared dead (``dead``), and any verdict on this node."""
        self.now = now
        fx = Effects()
        with self.lock:
            self._digest = self.m.digest()
            verdicts = self.detector.tick(now)
        if verdicts.stalled:
            # this process did not run (suspended, swapped out): the detector did not count
            # that as the members' silence
            log.warning("%s: this node stalled for %.1f s; not counting that as the members' silence",
                        self.id, verdicts.stalled)
            # what it knew of the others is that old now, and what waited in its socket
            # too: a start must settle again on what they say from now on (see settled)
            self.woke = self.last_change = now
            with self.lock:
                self.agree, self.ready, self._agree_bits = set(), set(), None
        # suspicions come and go under load (SWIM refutes them): the verdicts that matter, a
        # removal, are logged by the member table
        for mid in verdicts.suspected:
            log.debug("%s: member %s is suspected", self.id, mid)
        for mid in verdicts.alive:
            log.debug("%s: member %s is alive again", self.id, mid)
        for seed, state in list(self.seeds.items()):
            if now >= state[0]:
                if state[1] > self.timing.heartbeat:  # (a seed not up yet: the usual start of a cluster)
                    log.info("%s: peer %s does not answer; retrying in %.1f s", self.id, seed, state[1])
                fx.sends.append((seed, self._members_message("hello")))
                state[0] = now + state[1]
                state[1] = min(state[1] * 2, BACKOFF_MAX)  # exponential backoff, capped
        with self.lock:
            self._note_round(now)
            before = self.m.version
            for mid in verdicts.dead:
                if self.m.remove(mid, f"silent for more than {self.timing.dead_after:g} s"):
                    fx.dead.append(mid)
            for mid in verdicts.left:  # as its goodbye would have (see _on_bye)
                if self.m.remove(mid, "left (another member heard its goodbye)", departed=True, now=now):
                    self.last_change = now
            confirmed = self.m.confirm_dead(now) if self.m.suspects else []
            digest = self.m.digest()
        if confirmed:
            log.warning("%s: members it found dead before it trained are still silent; their leaves are "
                        "announced: %s", self.id, ", ".join(confirmed))
        if fx.dead or confirmed:
            self.last_change = now
            # the leave rounds, so all adopt them together (the others' detectors find the
            # death too: passed on as an epidemic, see _spread)
            self._news(fx, before, now)
        self._flush_news(fx, now)
        for _, msg in verdicts.sends:  # the detector's messages carry the digest after the removals
            msg.extra["digest"] = digest
        fx.sends += verdicts.sends
        if now - self.last_ping >= self.timing.heartbeat:
            self.last_ping = now
            with self.lock:
                lost = [d for d in self.m.dead if d not in self.m.members][-MAX_PROBED:]
            self._probe(now, lost, fx)
        if self.excluded_by and now - self.excluded_since >= 1.5 * self.timing.dead_after:
            self._judge_exclusion(now, fx)
        self._expire_contacts(now, fx)
        return fx

    def _news(self, fx: Effects, since: int, now: float, *, at_once: bool = False) -> None:
        """The member table changed after version ``since``: spread the change now, or
        with the next tick's news if this node spread news within the last tick (a
        start, a merge: news arrives in bursts, each piece of it from several members;
        one delta a tick carries the burst, where a delta per message would cost each
        member ``spread(n)`` messages for every one it receives). News heard firsthand
        (``at_once``: the sender is a node or life this node had not heard of) goes at
        once: this node may be the only one that knows it, and may crash within the
        tick (explorer seed 2000006351: two starters crashed holding the news that
        joined the two others, who trained apart for good)."""
        self._unspread = since if self._unspread is None else min(self._unspread, since)
        if at_once or now - self._spread_at >= self.timing.tick:
            self._flush_news(fx, now)

    def _flush_news(self, fx: Effects, now: float) -> None:
        """Spread the news not spread yet (see :meth:`_news`)."""
        if self._unspread is None:
            return
        since, self._unspread, self._spread_at = self._unspread, None, now
        self._spread(fx, self._delta_messages(since))

    def _spread(self, fx: Effects, msgs: list[Message]) -> None:
        """``msgs``, news of a change to the member table, to :meth:`Timing.spread` random
        other members: each that learns something from it passes on what was news to it
        so, and the probes' digests catch a member it missed. A change costs each member
        ``spread(n)`` messages of the changed entries."""
        if not msgs:
            return
        with self.lock:
            others = self.m.others()
            k = self.timing.spread(len(self.m.members))
        fx.sends += [(p, msg) for p in (others if k >= len(others) else self._rng.sample(others, k)) for msg in msgs]

    def _to_all(self, fx: Effects, msg: Message) -> None:
        """``msg`` to every other member as the table stands now."""
        with self.lock:
            others = self.m.others()
        fx.sends += [(peer, msg) for peer in others]

    def _judge_exclusion(self, now: float, fx: Effects) -> None:
        """Training members' lists dropped this node ``1.5 * dead_after`` ago: the
        cluster declared it dead while it was alive (silent for too long, e.g. a
        paused process). It joins again as a new life if that still holds now for
        one of them: the member is alive, and every other member this node trains
        with trains on in that member's cluster. Judged after a wait, not at once:
        as a partition forms, one side's lists may reach the other for a moment;
        by now this node has declared that side dead too, and the clusters meet
        later as foreign ones (see ``foreign`` in _control).

        It joins again too when the members whose lists dropped it are the stronger
        side (``stronger``) against this node and the others it trains with: two
        nodes paused at once are both declared dead, and neither is in the other's
        excluders' cluster (explorer seed 3000206 with ``--churn``: two nodes stalled
        past ``--dead-after`` together each dropped the six others and trained as a
        cluster of two). Else a member that is alive, that this node still trains
        with, and whose lists drop this node while others this node trains with are
        not in its cluster, is the one out of line (it dropped members that the rest
        still count): this node drops it in turn. Otherwise the two would stay apart
        for good, neither sending to the other (its lists never take this node back, and
        each node it dropped would wait for the others to be counted first). Once
        dropped, it sees this node's cluster as another one, and of the two the
        stronger goes on (see ``foreign``)."""
        evidence, self.excluded_by = self.excluded_by, {}
        with self.lock:
            ours = self.m.eventual() - {self.id}
            alive = {k for k, m in self.m.members.items() if now - m.last_seen <= self.timing.dead_after}
        # the members whose lists dropped this node, against this node and the others it
        # trains with (two nodes paused at once are both declared dead: the larger side
        # goes on). One member's lists alone are that member's view, not its cluster's
        excluders = {by for by in evidence if by in alive and by in ours}
        most = stronger(excluders, {self.id} | (ours - excluders))
        for by, (theirs, rnd) in sorted(evidence.items()):
            if by in excluders and (ours <= theirs or most):
                if self.progress()[0] == "training":
                    fx.verdict = (rnd, by, theirs, False)
                return
        if self.progress()[0] != "training":
            return
        for by, (theirs, _) in sorted(evidence.items()):
            if by in alive and by in ours:
                self._drop(by, f"its member lists drop this node and {', '.join(sorted(ours - theirs))}, "
                               "which the others train with", fx)

    def _probe(self, now: float, lost: list[str], fx: Effects) -> None:
        """Say hello now and then (backing off) to members declared dead for their
        silence. A crashed one never answers; one behind a partition that healed
        answers, and the two clusters meet again (see ``foreign`` in _control).

        A training node's hello is light (:meth:`_probe_message`): whoever answers sends
        its whole table, and this node then sends its own (see ``probed`` in handle), a
        push-pull with one peer for each probe answered. So a dead member costs each
        survivor a small message every ``BACKOFF_MAX`` s, whatever the cluster's size.
        A node that waits (to join, or to start) says its whole lists: they name the
        cluster it waits for, and a training node that reads no such cluster in a hello
        of a waiting node takes it for a joiner of its own (explorer seed 9100027799: a
        node excluded by its side of a partition, waiting to join that side again, sent
        light probes across the healed partition, and the other side scheduled its join
        too; in two clusters at once, it and another ended with a member list of their
        own)."""
        probes = {}
        keep = BACKOFF_MAX + self.timing.dead_after  # (an answer later than that is no answer to it)
        self.probed = {mid: t for mid, t in self.probed.items() if now - t < keep}
        light = self.progress()[0] != "waiting"
        for mid in lost:
            state = self.probes.get(mid) or [now + self.timing.dead_after, self.timing.dead_after]
            if now >= state[0]:
                if light:
                    fx.sends.append((mid, self._probe_message()))
                    self.probed[mid] = now
                else:
                    fx.sends.append((mid, self._members_message("hello")))
                state[0] = now + state[1]
                state[1] = min(state[1] * 2, BACKOFF_MAX)
            probes[mid] = state
        self.probes = probes

    def drop(self, mid: str, reason: str) -> Effects:
        """Remove a live member as if it had died (e.g. it trains out of step with this
        cluster) and tell everyone its leave round. It hears of it from the lists and
        joins again as a new life, see ``excluded``."""
        fx = Effects()
        self._drop(mid, reason, fx)
        return fx

    def _drop(self, mid: str, reason: str, fx: Effects) -> None:
        with self.lock:
            self._note_round(self.now)
            before = self.m.version
            if not self.m.remove(mid, reason):
                return
            self.last_change = self.now
        for msg in self._delta_messages(before):
            self._to_all(fx, msg)
        fx.sends.append((mid, self._members_message()))  # (whole: it learns which cluster dropped it)

    def new_life(self, incarnation: int) -> None:
        """This node starts a new life (call with ``lock`` held, with the membership's
        new_life): what the lists said of its previous life is no evidence about it."""
        self.incarnation = incarnation
        self.excluded_by = {}
        self._unspread = None  # (the old life's news: its table is gone)
        self._stale_digests, self._stale_members = {}, {}
        self.detector.new_life(incarnation)  # each life's detector starts afresh

    def hello_all(self, peers: list[str]) -> Effects:
        """A hello (with this node's member list) to each of ``peers``."""
        with self.lock:
            self.contacts.greet(peers, self.now)
        return Effects(sends=[(p, self._members_message("hello")) for p in peers])

    def goodbye(self, reason: str) -> Effects:
        """A goodbye to every member: nobody waits for this node's silence."""
        return Effects(broadcasts=[self._message("bye", reason=reason)])

    def settled(self, now: float, settle: float, *, seeds: bool = True) -> tuple[bool, str]:
        """Whether a fresh cluster may start: every known member waits for the start and
        reports our member set (itself, or in the bitmaps of another that reports it:
        ``agree``), and the set has not changed for ``settle`` seconds. With ``seeds``,
        also every ``--peers`` seed of every member has answered (``ready``): two halves
        of a cluster that came up at different speeds must not start apart. After a stall
        of this process, each member's agreement must be heard again: the rest may have
        started without it meanwhile. The second value says what is still awaited (for
        the log)."""
        with self.lock:
            if now - self.last_change < settle:
                return False, f"member set changed {now - self.last_change:.1f} s ago"
            if seeds and self.seeds:
                return False, f"seed {next(iter(self.seeds))} has not answered"
            self._agreement()
            for mid, member in self.m.members.items():
                if mid == self.id:
                    continue
                if member.status in RUNNING:
                    return False, f"{mid} is {member.status}"
                if seeds and mid in self.agree and mid not in self.ready:
                    return False, f"{mid} waits for one of its seeds"
                if mid not in self.agree:
                    since = " since this node stalled" if math.isfinite(self.woke) else ""
                    return False, f"{mid} has not reported our member set{since}"
            return True, ""


def make_detector(detector: FailureDetector | str | None, membership: Membership, timing: Timing,
                  frame: Frame) -> FailureDetector:
    """The detector named ``detector`` (one of :data:`~gossip.protocol.timing.DETECTORS`; None:
    the default) for ``membership``, framing its messages with ``frame``, or ``detector``
    itself when it is one already."""
    if detector is None:
        detector = DEFAULT_DETECTOR
    if detector == "heartbeat":
        return HeartbeatDetector(membership, timing, frame)
    if detector == "swim":
        return SwimDetector(membership, timing, frame)
    if isinstance(detector, str):
        raise ValueError(f"detector must be one of {', '.join(DETECTORS)}, got {detector!r}")
    return detector
