"""Who is in the cluster, without a master.

Every node keeps a member table. It learns members from ``hello`` and
``members`` messages, treats any message as a heartbeat, and declares a member
dead when it has been silent for ``dead_after`` seconds. The topology is built
from the sorted list of member ids, so nodes that know the same members build
the same graph; changes are adopted at round boundaries through *epochs*: a
join is scheduled for a round far enough ahead that every member hears about
it first, so synchronous rounds stay aligned. Deaths are adopted at once by
whoever detects them (a neighbour that vanished cannot be waited for anyway).

This module holds only the bookkeeping; the peer runtime moves the messages.
Times come from the caller (``now``), never from a clock read here.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from gossip.protocol.timing import Timing

__all__ = ["Member", "Membership", "cluster_after", "stronger", "out_of_step", "topology_for"]

log = logging.getLogger("gossip.membership")

ID_HASH_MASK = 2**64 - 1


def _id_hash(mid: str) -> int:
    """A member id's 64-bit hash: the member digest is the sum of its members' (see
    :meth:`Membership.digest`)."""
    return int.from_bytes(hashlib.blake2b(mid.encode(), digest_size=8).digest(), "little")


RUNNING = ("training", "done")  # the statuses of a member of a running cluster
MAX_FORMER_LIVES = 4  # earlier lives of one member whose rounds are kept (see Membership.former)


def cluster_after(base: Iterable[str], joins: Iterable[str], leaves: Iterable[str]) -> set[str]:
    """Who trains once every announced join and leave has taken effect: the
    starters and joiners, less those announced to leave.

    >>> sorted(cluster_after(["a", "b", "c"], ["d"], ["b"]))
    ['a', 'c', 'd']
    """
    return (set(base) | set(joins)) - set(leaves)


def stronger(a: set[str], b: set[str]) -> bool:
    """Whether cluster ``a`` goes on and ``b`` joins it when two clusters meet
    (the halves of a partition that healed, or clusters started apart): the
    larger one, and between equal sizes the one that holds the smallest id the
    two do not share. Exactly one of ``stronger(a, b)`` and ``stronger(b, a)``
    holds for different clusters, so both sides reach the same verdict.

    >>> stronger({"a", "b"}, {"c"}), stronger({"c"}, {"a", "b"})
    (True, False)
    >>> stronger({"b"}, {"c"}), stronger({"c"}, {"b"})
    (True, False)
    """
    if len(a) != len(b):
        return len(a) > len(b)
    differ = a ^ b
    return bool(differ) and min(differ) in a


def out_of_step(my_round: int, awaited: dict[str, tuple[str, int]], margin: int) -> tuple[list[str], str | None]:
    """Which live neighbours a node that keeps timing out waits for in vain because
    their rounds are far from its own: ``awaited`` maps each to (status, round) as
    its pings report them. Returns the training ones more than ``margin`` rounds
    behind (they train in a world of their own: drop them) and the first one more
    than ``margin`` ahead (then this node is the one out of step), if any.

    >>> out_of_step(5000, {"a": ("training", 1200), "b": ("training", 4999), "c": ("waiting", 0)}, 25)
    (['a'], None)
    >>> out_of_step(1200, {"a": ("training", 1201), "b": ("training", 5000)}, 25)
    ([], 'b')
    """
    behind = [j for j, (st, r) in sorted(awaited.items()) if st == "training" and r < my_round - margin]
    ahead = [j for j, (st, r) in sorted(awaited.items()) if st == "training" and r > my_round + margin]
    return behind, (ahead[0] if ahead else None)


@dataclass(slots=True)
class Member:
    """What a node knows about one member (slots: a simulated cluster of n holds n^2)."""

    id: str
    incarnation: int          # changes when a node restarts: tells a new life from a stale report
    last_seen: float          # when we last heard from it directly (any message)
    status: str = "unknown"   # waiting | training | done
    round: int = 0
    step: int = 0
    dc: str = ""
    fingerprint: str = ""
    status_at: float = -math.inf  # when it last told us its status itself (a control message)
    round_at: float = -math.inf   # when it last told us its round
    state_at: float = -math.inf   # when its last state message arrived
    state_gap: float = math.inf   # its usual time between two state messages (a moving average)
    seq: int = -1  # the number of the latest control message taken from it (see Membership.latest)

    def heard_state(self, now: float) -> None:
        """A state message from this member arrived at ``now``."""
        gap = now - self.state_at
        if math.isfinite(gap) and gap >= 0:
            self.state_gap = gap if not math.isfinite(self.state_gap) else 0.8 * self.state_gap + 0.2 * gap
        self.state_at = now


@dataclass
class Membership:
    """The member table of node ``self_id``.

    Parameters
    ----------
    timing : the protocol's timings (``dead_after``: silence after which a member is
        declared dead; ``join_margin`` / ``leave_margin``: rounds between announcing a
        join or leave and adopting it)
    """

    self_id: str
    incarnation: int
    fingerprint: str
    dc: str = ""
    timing: Timing = field(default_factory=Timing)
    members: dict[str, Member] = field(default_factory=dict)
    dead: dict[str, int] = field(default_factory=dict)  # id -> incarnation declared dead
    departed: dict[str, int] = field(default_factory=dict)  # id -> incarnation that said goodbye
    departed_at: dict[str, float] = field(default_factory=dict)  # id -> when it said goodbye
    version: int = 0
    # who trains in which round: the members the cluster started with, plus
    # announced joins (id -> first round it takes part in)
    base: set[str] = field(default_factory=set)
    # whether this node knows the schedule of a cluster that started (base alone cannot
    # tell: once every starter has restarted, no starter is left in it)
    started: bool = False
    joins: dict[str, int] = field(default_factory=dict)
    leaves: dict[str, int] = field(default_factory=dict)  # id -> first round it no longer takes part in
    # the life (incarnation) that id's entries above are about. A join or leave of an
    # older life than the one recorded is stale; of a newer life, it replaces the record.
    # So the order in which announcements arrive does not matter (see announce_join)
    lives: dict[str, int] = field(default_factory=dict)
    # leaves announced for a life whose join has not arrived yet: id -> (incarnation, round)
    early_leaves: dict[str, tuple[int, int]] = field(default_factory=dict)
    # the lives of a member that a newer one replaced: id -> incarnation -> [first round
    # (-1: a starter; None: its join not heard), leave round (None: not heard)]. Such a
    # life trains from its first round up to its leave or the join of a newer life,
    # whichever comes first: a restart's join does not take the old life out of rounds
    # before its leave, which some members may have begun already counting it (an
    # epoch's data plan does). Joins and leaves of old lives heard late are kept here,
    # the earliest of each wins, so every order of the announcements gives one schedule
    former: dict[str, dict[int, list[int | None]]] = field(default_factory=dict)
    # members that appeared or came back (a new life, or re-admitted) since the last
    # take_renewed(): a connection kept towards an earlier life must be opened afresh
    renewed: set[str] = field(default_factory=set)
    # whether this node trains (the peer sets it when it starts; a new life clears it).
    # Only a training node's death verdicts become leave rounds, see remove().
    training: bool = False
    # the members of the cluster this node joins as a new life (see new_life): until it
    # trains there, only their lists are taken; and the life each had then
    target: set[str] = field(default_factory=set)
    target_lives: dict[str, int] = field(default_factory=dict)
    # when this node's current life began (see new_life): evidence from before it
    # describes a cluster this life may not be joining
    life_began: float = -math.inf
    # this life was a starter of the cluster whose schedule it learned, and left it before
    # it trained (dropped while silent, e.g. behind a slow link): a life that left never
    # joins again, so it must begin a new one to join (see ControlPlane._learn_start)
    spent: bool = False
    # when each member removed for its silence was last heard; and the suspects of
    # begin_training (id -> when it began)
    silent_since: dict[str, float] = field(default_factory=dict)
    suspects: dict[str, float] = field(default_factory=dict)
    # the datacenter label of members no longer in the table: a member found dead stays
    # in the schedule until its leave round, and every member must order it (and build
    # a hierarchical graph) as those that have not found it dead yet do
    labels: dict[str, str] = field(default_factory=dict)
    # the control plane's clock at its last tick, and this node's rounds a second then
    # (see round_now)
    clock: float = -math.inf
    rate: float = 0.0
    # the failure detector's suspicion of a member (set by the control plane): a suspect
    # is not taken to have run on past when it was last heard (see round_now)
    suspected: Callable[[str], bool] = field(default=lambda mid: False, repr=False, compare=False)
    # the members each change was about, by the version it made (oldest first): what a
    # node tells others of a change is the entries of the members it touched since a
    # version (see changed_since), not the whole table
    touched: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    # a count of the members' status changes into or out of training or done (see
    # ``Lifecycle.discover``, which looks at every member's status again only then)
    running_changes: int = field(default=0, repr=False, compare=False)
    # (version, sorted ids) and (version, digest): every change to the table or the
    # schedule bumps version, and every ping carries the digest (see digest)
    _views: tuple[int, tuple[str, ...]] = field(default=(-1, ()), repr=False, compare=False)
    _digest: tuple[int, str] = field(default=(-1, ""), repr=False, compare=False)
    # the sum of the members' id hashes (mod 2^64), kept as members come and go: the member
    # half of the digest without sorting thousands of ids at every change
    _idsum: int = field(default=0, repr=False, compare=False)
    # datacenter labels given to members already in the table (see set_label), and the
    # last at_round: ((version, relabels), first round, end round, members)
    relabels: int = field(default=0, repr=False, compare=False)
    _at_round: tuple[tuple[int, int], int, int, list[str]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.members[self.self_id] = Member(self.self_id, self.incarnation, 0.0, "waiting", dc=self.dc,
                                            fingerprint=self.fingerprint)
        self._idsum = sum(map(_id_hash, self.members)) & ID_HASH_MASK

    def _put(self, mid: str, member: Member) -> Member:
        """``member`` is the record of ``mid`` from now on (a new member, or a new life)."""
        if mid not in self.members:
            self._idsum = (self._idsum + _id_hash(mid)) & ID_HASH_MASK
        self.members[mid] = member
        return member

    def _changed(self, *mids: str) -> None:
        """Bump :attr:`version` for a change to the entries of ``mids`` (the member
        row, the schedule's entries and lives), remembering which."""
        self.version += 1
        for mid in mids:
            self.touched.pop(mid, None)
            self.touched[mid] = self.version

    def changed_since(self, version: int) -> list[str]:
        """The members whose entries changed after ``version``, the latest first.

        >>> m = Membership("a:1", 1, "f")
        >>> v = m.version
        >>> _ = m.merge([("b:1", 1), ("c:1", 1)], 0.0), m.heard("b:1", 2, 0.0)
        >>> m.changed_since(v), m.changed_since(m.version)
        (['b:1', 'c:1'], [])
        """
        out = []
        for mid, v in reversed(self.touched.items()):
            if v <= version:
                break
            out.append(mid)
        return out

    # -- views ------------------------------------------------------------------------------
    def ids(self) -> list[str]:
        """Sorted ids of the members believed alive (self included)."""
        return list(self._sorted())

    def _sorted(self) -> tuple[str, ...]:
        """The sorted ids, computed once per :attr:`version` (every change to the table
        bumps it; a control plane asks for them, and for the digest, on every message)."""
        version, ids = self._views
        if version != self.version or len(ids) != len(self.members):
            ids = tuple(sorted(self.members))
            self._views = (self.version, ids)
        return ids

    def others(self) -> list[str]:
        return [m for m in self._sorted() if m != self.self_id]

    def digest(self) -> str:
        """A string equal on nodes that agree on the member set and on who trains in
        which round (the schedule: starters, joins and leaves, with their lives): a
        hash of each, 33 characters whatever the cluster's size (every ping carries it).
        The members' is the sum of their ids' hashes, kept as they come and go: a start
        of thousands changes the table with most messages, and sorting and hashing every
        id at each change was a third of its time. (A sum can be collided on purpose; a
        collision only hides a difference from anti-entropy, as any hash of the set could.)

        >>> a, b = Membership("a:1", 1, "f"), Membership("b:1", 1, "f")
        >>> _ = a.merge([("b:1", 1), ("c:1", 1)], 0.0), b.merge([("c:1", 1), ("a:1", 1)], 0.0)
        >>> a.digest() == b.digest()
        True
        >>> _ = a.remove("c:1", "test")
        >>> a.digest() == b.digest()
        False
        """
        version, digest = self._digest
        if version != self.version:
            digest = f"{self._idsum:016x}|{self.schedule_digest()}"
            self._digest = (self.version, digest)
        return digest

    def schedule_digest(self) -> str:
        """A short hash of the schedule ("" before the cluster starts)."""
        if not self.started:
            return ""
        lives = self.lives
        if self.counts(self.self_id) and lives.get(self.self_id) != self.incarnation:
            # this node's own life: the others record the life they scheduled (a joiner's
            # own join records none, see announce_join), and a digest that differs for it
            # alone would make every probe between it and a member carry whole lists
            lives = {**lives, self.self_id: self.incarnation}
        text = repr((sorted(self.base), sorted(self.joins.items()), sorted(self.leaves.items()),
                     sorted(lives.items())))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def order_key(self, mid: str) -> tuple[str, str]:
        """Members are ordered by (datacenter, id): the same order on every node,
        with each datacenter's members contiguous (hierarchical topologies)."""
        return (self.label(mid), mid)

    def label(self, mid: str) -> str:
        """``mid``'s datacenter label: the table's, else the last one known ("" if never)."""
        m = self.members.get(mid)
        return m.dc if m is not None and m.dc else self.labels.get(mid, "")

    def set_label(self, mid: str, dc: str) -> None:
        """Give member ``mid`` the datacenter label ``dc`` (it orders the members)."""
        m = self.members[mid]
        if m.dc != dc:
            m.dc = dc
            self.relabels += 1

    def any_training(self) -> bool:
        return any(m.status in RUNNING for k, m in self.members.items() if k != self.self_id)

    def eventual(self) -> set[str]:
        """This node's cluster once every announced join and leave has taken effect."""
        return cluster_after(self.base, self.joins, self.leaves)

    def max_round(self) -> int:
        """The furthest round a member of this node's cluster reports (a member of
        another cluster, met after a partition, counts rounds of its own)."""
        ours = self.eventual() | {self.self_id}
        return max((m.round for k, m in self.members.items() if k in ours), default=0)

    def round_now(self) -> int:
        """The furthest round a training member of this node's cluster may be in now: what
        each last reported, plus the rounds this node ran since (its own pace, ``rate``
        rounds a second as of ``clock``; both set by the control plane). Rounds that go on
        without a suspected member split the ring into stretches that no longer wait for
        each other, and a stretch may run far past what its last report said. A member
        the failure detector suspects ran on at most until it was last heard: two nodes
        that die together must not push each other's leave rounds seconds ahead."""
        ours = self.eventual() | {self.self_id}
        late = [m.round + (self.rate * max(0.0, (min(self.clock, m.last_seen) if self.suspected(k) else self.clock)
                                        - m.round_at) if m.status == "training" else 0.0)
                for k, m in self.members.items() if k in ours]
        return max(math.ceil(max(late, default=0)), self.max_round())

    def death_margin(self) -> int:
        """How many rounds ahead to announce the leave of a member this node found dead:
        ``leave_margin``, and at least the rounds this node runs in half of ``dead_after``
        at its pace (``rate``). The leave must reach every member before its round, which takes
        time, not rounds: a small model runs a hundred rounds a second or more, and 5
        rounds then last a few milliseconds. A member that adopts the leave after its
        round has passed already ran that round with the dead one in its topology
        (skipped), while those that adopted it in time wait in that round for a
        message it will never send: each side's rounds then time out. A heartbeat's
        worth of rounds was not enough on a loaded machine (CI: two nodes of an 8-node
        ring, 3 rounds of 5 s each). The whole of ``dead_after`` was too much: it put a
        restarted node's old life's leave, and so its join, past the end of a run it
        came back to before the end (explorer seed 303001020), and it let a paused
        node's exclusion be judged before its leave round came (seed 3000206 with
        ``--churn``). The dead member is skipped meanwhile (see ``Lifecycle.gone``).

        >>> m = Membership("a", 1, "f", timing=Timing(heartbeat=0.25, dead_after=2.0))
        >>> m.death_margin()
        5
        >>> m.rate = 180.0  # rounds a second
        >>> m.death_margin()
        180
        """
        return max(self.timing.leave_margin, math.ceil(self.rate * self.timing.dead_after / 2))

    def announce_margin(self, rounds: int) -> int:
        """How many rounds ahead to schedule a join, or a restarted member's old life's
        leave (``rounds``: ``join_margin`` or ``leave_margin``): that many, and at least
        the rounds this node runs in two heartbeats at its pace (``rate``). The member
        that schedules it tells every member at once (one hop), and all must hear it
        before its round: members run in step, a few rounds apart, but a small model
        runs a hundred rounds a second, and 20 rounds then last 0.2 s, not always
        enough on a loaded machine (a member that adopts a change after its round
        builds another ring than the rest for the rounds between, and rounds time out).
        The joiner waits for its round, so slow rounds keep the configured count.
        Members that schedule the same joiner at once may pick different rounds (each
        counts its own pace): the earliest wins, and a joiner starts no later than its
        neighbours' round (see ``Joining``).

        >>> m = Membership("a", 1, "f", timing=Timing(heartbeat=0.25, dead_after=2.0))
        >>> m.announce_margin(m.timing.join_margin), m.announce_margin(m.timing.leave_margin)
        (20, 5)
        >>> m.rate = 180.0  # rounds a second
        >>> m.announce_margin(m.timing.join_margin), m.announce_margin(m.timing.leave_margin)
        (90, 90)
        """
        return max(rounds, math.ceil(self.rate * 2 * self.timing.heartbeat))

    # -- updates ----------------------------------------------------------------------------
    def latest(self, sender: str, incarnation: int, seq: int | None) -> bool:
        """Whether control message ``seq`` of ``sender``'s life ``incarnation`` is the latest
        word from it: no message of that life with a higher number was taken. Messages
        arrive late and out of order (a slow link, a socket of their own). A delayed one,
        taken, made a trainer look waiting again (explorer seed 24000246: a joiner saw
        nobody train and gave up its join) or its round fall back (and changes were
        announced for rounds it had passed). A message without a number counts as new.

        >>> m = Membership("a", 1, "f")
        >>> _ = m.heard("b", 1, 1.0, status="training", round=6, seq=9)
        >>> m.latest("b", 1, 7), m.latest("b", 1, 10), m.latest("b", 2, 1)
        (False, True, True)
        >>> _ = m.heard("b", 1, 1.1, status="waiting", round=0, seq=7)  # sent before it trained
        >>> m.members["b"].status, m.members["b"].round, m.members["b"].last_seen
        ('training', 6, 1.1)
        """
        m = self.members.get(sender)
        return m is None or incarnation > m.incarnation or (incarnation == m.incarnation
                                                              and (seq is None or seq > m.seq))

    def heard(self, sender: str, incarnation: int | None, now: float, *, status: str | None = None,
              round: int | None = None, step: int | None = None, dc: str | None = None,
              fingerprint: str | None = None, seq: int | None = None) -> bool:
        """Direct contact from ``sender``, by its control message number ``seq`` (see
        :meth:`latest`); returns True if the member set changed."""
        changed = False
        m = self.members.get(sender)
        inc = incarnation if incarnation is not None else (m.incarnation if m else 0)
        # what a message older than one taken already says of its sender's status, round
        # and step is older news: it is alive, no more
        older = not self.latest(sender, inc, seq)
        if m is None and self.departed.get(sender, -1) >= inc:
            return False  # that life said goodbye; its last messages may still be in flight
        if m is None or inc > m.incarnation:
            if m is None:
                if self.dead.get(sender, -1) >= inc:
                    # declared dead, yet it speaks: it was only silent (a pause, a slow link).
                    # Direct contact beats our guess; second-hand reports (merge) do not.
                    log.warning("member %s is alive after all; re-admitting it", sender)
                else:
                    log.info("member %s joined (incarnation %d)", sender, inc)
                changed = True
            else:
                log.info("member %s restarted (incarnation %d -> %d)", sender, m.incarnation, inc)
                changed = True
            m = self._put(sender, Member(sender, inc, now))
            self.renewed.add(sender)
            self.dead.pop(sender, None)
        elif inc < m.incarnation:
            return False  # stale: from an older life of that node
        m.last_seen = now
        if seq is not None and not older:
            m.seq = seq
        if status is not None and not older:
            if status != m.status and (status in RUNNING or m.status in RUNNING):
                self.running_changes += 1
            m.status = status
            m.status_at = now
        if round is not None and not older:
            m.round, m.round_at = round, now
        if step is not None and not older:
            m.step = step
        if dc is not None:
            self.set_label(sender, dc)
        if fingerprint is not None:
            m.fingerprint = fingerprint
        if changed:
            self._changed(sender)
        return changed

    def merge(self, reported: Iterable[tuple[str, int]], now: float) -> bool:
        """Add members another node reports (``(id, incarnation)`` pairs).

        A reported member counts as heard ``now`` (its reporter heard it
        recently); if it is really gone, our own detector removes it again.
        """
        changed = []
        for mid, inc in reported:
            if mid == self.self_id:
                continue
            m = self.members.get(mid)
            if m is not None and inc <= m.incarnation:
                continue
            if self.dead.get(mid, -1) >= inc or self.departed.get(mid, -1) >= inc:
                continue
            self._put(mid, Member(mid, inc, now))
            self.renewed.add(mid)
            self.dead.pop(mid, None)
            log.info("member %s learned from a member list", mid)
            changed.append(mid)
        if changed:
            self._changed(*changed)
        return bool(changed)

    def remove(self, mid: str, reason: str, *, departed: bool = False, now: float | None = None) -> bool:
        """Drop ``mid``; returns True if it was a member.

        ``departed`` (it said goodbye) is final for that incarnation. Otherwise
        (silence) it is our guess: direct contact from it re-admits it, while
        second-hand member lists cannot.
        """
        m = self.members.pop(mid, None)
        if m is None or mid == self.self_id:
            if m is not None:
                self.members[mid] = m
            return False
        self._idsum = (self._idsum - _id_hash(mid)) & ID_HASH_MASK
        (self.departed if departed else self.dead)[mid] = m.incarnation
        if not departed and (len(self.silent_since) < 4096 or mid in self.silent_since):
            self.silent_since[mid] = m.last_seen
        if m.dc and (len(self.labels) < 4096 or mid in self.labels):
            self.labels[mid] = m.dc
        if departed:
            self.departed_at[mid] = m.last_seen if now is None else now
        # it leaves the topology at a round everyone adopts (announced to all), so
        # synchronous rounds stay aligned; until then its weight goes to self. A node
        # that does not train (it waits for its join round or for a neighbour's state)
        # announces nothing: its silence is often its own, and the member it would
        # drop ignores the word of a node that is not training, so the two views
        # would never meet again. It learns the running members' leaves from them.
        if self.training:  # (after a join still pending: see announce_leave)
            self._leave_of_dead(mid, m.incarnation)
        self._changed(mid)
        # a goodbye is the normal end of a life; silence is what a user may need to look at
        (log.info if departed else log.warning)("member %s removed: %s", mid, reason)
        return True

    def _leave_of_dead(self, mid: str, incarnation: int | None) -> bool:
        """Announce this node's own death verdict on ``mid``: it leaves a margin ahead."""
        return self.announce_leave(mid, max(self.round_now() + self.death_margin(),
                                            self.joins.get(mid, -1) + 1),
                                   incarnation, early=False)

    def orphaned(self) -> bool:
        """Whether this node knows a schedule in which no other member counts in the life
        it has now: they all restarted or died before this node trained with them, and
        nobody will ever schedule a round of that cluster again."""
        return self.started and not any(self.counts(m, self.members[m].incarnation) for m in self.others())

    def begin_training(self, now: float) -> None:
        """This node trains from now on, and its death verdicts count (see :meth:`remove`).
        Members the schedule still counts that it heard in this life and then removed
        while it waited are suspects: if none speaks to it within ``dead_after`` (see
        :meth:`confirm_dead`), their leaves are announced then. The trainers that would
        have announced them may have died too, and then nobody ever would, and the
        dead would stay in the topology to the end. (The wait: a member removed while
        this node was cut off from it, say, speaks again once this node trains with it.)"""
        self.training = True
        self.suspects = {mid: now for mid in self.eventual() if mid not in self.members and mid in self.dead
                         and self.silent_since.get(mid, -math.inf) >= self.life_began
                         and self.counts(mid, self.dead[mid])}

    def confirm_dead(self, now: float) -> list[str]:
        """Announce the leaves of the suspects of :meth:`begin_training` still silent
        ``dead_after`` seconds after it; returns them."""
        out = []
        for mid, since in list(self.suspects.items()):
            if mid in self.members or mid not in self.dead:
                del self.suspects[mid]  # it spoke again (or left by itself)
            elif now - since >= self.timing.dead_after:
                del self.suspects[mid]
                if self.counts(mid, self.dead[mid]) and self._leave_of_dead(mid, self.dead[mid]):
                    out.append(mid)
        return out

    def new_life(self, incarnation: int, target: Iterable[str] = (), now: float = -math.inf) -> None:
        """This node starts a new life under ``incarnation``, as a restarted process
        would: it still knows who is alive, but no longer who trains in which
        round. It joins the cluster ``target`` (the members of the cluster that
        dropped it, or of a stronger one it met) at a round they announce, and
        takes those lists from them only (from anyone if ``target`` is empty):
        its own may describe a cluster it is no longer part of (a partition's
        other half, the leaves it announced there). ``now`` is when the life
        begins: what members said before it is no evidence about that cluster
        (see :meth:`finished`)."""
        self.incarnation = incarnation
        self.life_began = now
        me = self.members[self.self_id]
        me.incarnation, me.status = incarnation, "waiting"
        self.training = False
        self._forget_schedule()
        self.started = False
        self.spent = False
        self.suspects = {}
        self.target = set(target) - {self.self_id}
        self.target_lives = {t: self.members[t].incarnation for t in self.target if t in self.members}
        self.touched = {}  # (the changes it spreads are those of this life's table)
        self._changed(self.self_id)

    def target_gone(self) -> bool:
        """Whether the cluster this new life set out to join is gone: every member of
        :attr:`target` died or began a new life of its own since. Those new lives went
        wherever their own verdicts sent them; the schedule taken from the target (maybe
        while its members still trained there) counts rounds that nobody trains.

        >>> m = Membership("a", 1, "f")
        >>> _ = m.heard("b", 1, 0.0), m.heard("c", 1, 0.0)
        >>> m.new_life(2, target=["b", "c"])
        >>> _ = m.heard("b", 5, 1.0)
        >>> m.target_gone()
        False
        >>> _ = m.heard("c", 6, 1.0)
        >>> m.target_gone()
        True
        """
        return bool(self.target) and all(
            t not in self.members or self.members[t].incarnation != self.target_lives.get(t, self.members[t].incarnation)
            for t in self.target)

    def leave_target(self) -> None:
        """Stop joining :attr:`target` (it is gone, see :meth:`target_gone`): this life
        waits as a restarted process does, knowing who is alive but no schedule, and
        takes the lists of whichever training member schedules its join."""
        self.target, self.target_lives = set(), {}
        self._forget_schedule()
        self.started = False
        self._changed(self.self_id)

    def finished(self, ids: Iterable[str]) -> bool:
        """Whether every member in ``ids`` has finished training, judged only from
        what this life heard (since :attr:`life_began`): the member's own word
        "done", or its goodbye. An empty set, a member that is unknown, silent or
        dead, and anything said before this life began are no evidence: a cluster
        that will never schedule a join must prove it, or the join is waited for.

        >>> m = Membership("a", 1, "f")
        >>> _ = m.heard("b", 1, 5.0, status="done")
        >>> m.new_life(2, target=["b"], now=6.0)
        >>> m.finished(["b"])  # said before this life began
        False
        >>> _ = m.heard("b", 1, 7.0, status="done")
        >>> m.finished(["b"]), m.finished([])
        (True, False)
        """
        ids = [i for i in ids if i != self.self_id]
        if not ids:
            return False
        for mid in ids:
            m = self.members.get(mid)
            if m is not None:
                if m.status != "done" or m.status_at < self.life_began:
                    return False
            elif mid not in self.departed_at or self.departed_at[mid] < self.life_began:
                return False
        return True

    def take_renewed(self) -> list[str]:
        """The ids that (re)appeared since the last call."""
        out, self.renewed = sorted(self.renewed), set()
        return out

    def expire(self, now: float) -> list[str]:
        """Declare members silent for ``dead_after`` seconds dead; returns their ids."""
        gone = [mid for mid, m in self.members.items()
                if mid != self.self_id and now - m.last_seen > self.timing.dead_after]
        for mid in gone:
            self.remove(mid, f"silent for more than {self.timing.dead_after:g} s")
        return gone

    def report(self) -> list[list]:
        """The member list as it travels: ``[[id, incarnation], ...]``."""
        return [[mid, m.incarnation] for mid, m in sorted(self.members.items())]

    # -- who trains in which round -------------------------------------------------------
    def life_of(self, mid: str) -> int | None:
        """The incarnation of ``mid`` this node knows (its member table), if any."""
        m = self.members.get(mid)
        return m.incarnation if m is not None else None

    def start(self, ids: Iterable[str], incarnations: Iterable[int | None] | None = None) -> None:
        """The cluster starts training with members ``ids`` from round 0 (each in the
        life ``incarnations`` names; default: the one in the member table). Join and
        leave entries heard before are dropped: they count the rounds of another
        cluster (a waiting node takes them from a running cluster's lists; explorer
        seed 7500022611: a start carried an old cluster's "joins from round 15" of a
        node crashed for good, and at round 15 all four members of the new cluster
        waited for it). A start learned from a list applies that list's own entries
        after it (``ControlPlane._learn_start``)."""
        ids = list(ids)
        incs = list(incarnations) if incarnations is not None else [self.life_of(i) for i in ids]
        self._forget_schedule()
        self.base = set(ids)
        self.started = True
        for mid, inc in zip(ids, incs):
            if inc is not None:
                self.lives[mid] = inc
        self._changed(*ids)

    def _forget_schedule(self) -> None:
        """No starters, joins, leaves or lives (a new life, or a start that counts rounds afresh)."""
        self.base, self.joins, self.leaves, self.former = set(), {}, {}, {}
        self.lives, self.early_leaves = {}, {}

    def fill_lives(self, entries: Iterable[tuple[str, int]]) -> bool:
        """Record the lives a member list names for scheduled members whose life this
        node does not know (it started, or heard the join, before it knew their life; 0:
        the list does not know either). Known lives are kept: a different one is a
        restart, which comes with a join of its own. Returns True if any was recorded.

        >>> m = Membership("a:1", 1, "f")
        >>> m.start(["a:1", "b:1"], [1, None])
        >>> m.fill_lives([("b:1", 7), ("c:1", 3)]), m.lives["b:1"], "c:1" in m.lives
        (True, 7, False)
        """
        filled = {mid: inc for mid, inc in entries if inc and mid != self.self_id and mid not in self.lives
                  and (mid in self.base or mid in self.joins)}
        self.lives.update(filled)
        if filled:
            self._changed(*filled)
        return bool(filled)

    def counts(self, mid: str, incarnation: int | None = None) -> bool:
        """Whether ``mid`` (in life ``incarnation``, when given) is a starter or an
        announced joiner without an announced leave."""
        if incarnation is not None and mid in self.lives and self.lives[mid] != incarnation:
            return False
        return (mid in self.base or mid in self.joins) and mid not in self.leaves

    def _life(self, mid: str, inc: int | None) -> str:
        """How a join or leave of life ``inc`` relates to ``mid``'s record: "same"
        (or unknown: legacy lists without lives), "stale" or "newer"."""
        if mid == self.self_id:
            return "same" if inc is None or inc == self.incarnation else "stale"
        known = self.lives.get(mid)
        if inc is None or known is None or inc == known:
            return "same"
        return "stale" if inc < known else "newer"

    def announce_join(self, mid: str, round: int, incarnation: int | None = None) -> bool:
        """``mid`` takes part from ``round`` on; the earliest announcement wins
        (every node keeps the same one once all have heard both).

        ``incarnation`` names the life that joins (default: the one in the member
        table). A join of a newer life than the one recorded replaces the record
        (the restarted node's old life trains no more); of an older life, it is
        stale and changes nothing. So a node that hears the old life's leave only
        after the new life's join keeps the join, as one that heard them in order.
        """
        inc = incarnation if incarnation is not None else (self.lives.get(mid) or self.life_of(mid))
        relation = self._life(mid, inc)
        if relation == "stale":
            return self._former_life(mid, inc, first=round)
        left = self.leaves.get(mid)
        if relation == "newer" or (left is not None and left <= round and (incarnation is None
                                                                           or mid not in self.lives)):
            # a restarted node: a new life, announced afresh; the old one is kept (see former)
            known = self.lives.get(mid)
            if known is not None and known != inc:
                self._former_life(mid, known, first=-1 if mid in self.base else self.joins.get(mid), leave=left)
            early = self.early_leaves.get(mid)
            if early is not None and inc is not None and early[0] < inc:  # an older life's, heard before its join
                del self.early_leaves[mid]
                self._former_life(mid, early[0], leave=early[1])
            self.base.discard(mid)
            self.joins.pop(mid, None)
            self.leaves.pop(mid, None)
        old = self.joins.get(mid)
        if mid in self.base or (old is not None and old <= round):
            return False
        self.joins[mid] = round
        if inc is not None and mid != self.self_id:
            self.lives[mid] = inc
        early = self.early_leaves.get(mid)
        if early is not None and early[0] == inc:
            del self.early_leaves[mid]
            self.announce_leave(mid, early[1], inc)
        self._changed(mid)
        return True

    def announce_leave(self, mid: str, round: int, incarnation: int | None = None, *, early: bool = True) -> bool:
        """``mid`` no longer takes part from ``round`` on; the earliest announcement wins.

        ``incarnation`` names the life that leaves (default: the one recorded). A
        leave of an older life is stale; of a newer life whose join has not arrived
        yet, it waits for that join. Without a life, a leave at or before the round
        a joiner is scheduled for is its previous life's (a member that saw the
        restart before it heard of the join): the join stands. A death verdict on a
        joiner is announced after its join. ``early`` False (this node's own death
        verdict) keeps no leave for a life this node does not count: that is silence
        from a node it only read of in a list, not a leave of a life that trained.
        """
        if mid == self.self_id:
            return False
        relation = self._life(mid, incarnation)
        if relation == "stale":
            return self._former_life(mid, incarnation, leave=round)
        if relation == "newer" or (mid not in self.base and mid not in self.joins):
            if early and incarnation is not None and (mid not in self.early_leaves or self.early_leaves[mid][0] < incarnation
                                            or self.early_leaves[mid][1] > round):
                if len(self.early_leaves) < 4096 or mid in self.early_leaves:
                    self.early_leaves[mid] = (incarnation, round)
            return False  # it never trained with us (in that life): nothing to take effect yet
        old = self.leaves.get(mid)
        if mid not in self.base:
            if self.joins[mid] >= round:
                if incarnation is None:
                    return False
                round = self.joins[mid] + 1  # that life's own leave: after its join, as everyone puts it
        if old is not None and old <= round:
            return False
        self.leaves[mid] = round
        self._changed(mid)
        return True

    def _former_life(self, mid: str, incarnation: int | None, *, first: int | None = None,
                     leave: int | None = None) -> bool:
        """Record the first round and the leave of a life of ``mid`` that a newer one
        replaced (see :attr:`former`); the earliest of each wins."""
        if incarnation is None or mid == self.self_id:
            return False
        lives = self.former.setdefault(mid, {})
        if incarnation not in lives:
            if len(lives) >= MAX_FORMER_LIVES:  # the oldest lives are long over
                del lives[min(lives)]
            lives[incarnation] = [None, None]
        rec, changed = lives[incarnation], False
        for i, value in ((0, first), (1, leave)):
            if value is not None and (rec[i] is None or value < rec[i]):
                rec[i], changed = value, True
        if changed:
            self._changed(mid)
        return changed

    def life_in(self, mid: str, rnd: int) -> tuple[bool, int | None]:
        """Whether the schedule has ``mid`` train in round ``rnd``, and in which life
        (None: not known).

        >>> m = Membership("a:1", 1, "f")
        >>> m.start(["a:1", "x:1"], [1, 1])
        >>> _ = m.announce_leave("x:1", 55, 1), m.announce_join("x:1", 70, 2)
        >>> [m.life_in("x:1", r) for r in (54, 55, 70)]  # the old life to its leave, the new one from its join
        [(True, 1), (False, None), (True, 2)]
        """
        start = -1 if mid in self.base else self.joins.get(mid)
        if start is not None and start <= rnd < self.leaves.get(mid, rnd + 1):
            return True, self.lives.get(mid)
        lives = self.former.get(mid)
        if lives:
            for inc, (first, leave) in lives.items():
                if first is None or rnd < first:
                    continue
                ends = [e for e in (leave, start if start is not None and start >= 0 else None) if e is not None]
                ends += [f for k, (f, _) in lives.items() if k > inc and f is not None]
                if rnd < max(first + 1, min(ends, default=rnd + 1)):
                    return True, inc
        return False, None

    def trains_in(self, mid: str, rnd: int) -> bool:
        """Whether the schedule has ``mid`` train in round ``rnd`` (in any life)."""
        return self.life_in(mid, rnd)[0]

    def at_round(self, rnd: int) -> list[str]:
        """The ordered members that train in round ``rnd``.

        A member that died or left stays listed until its announced leave round
        (its messages are simply missing until then); a joiner appears from its
        announced join round.
        """
        key = (self.version, self.relabels)
        cached = self._at_round
        if cached is not None and cached[0] == key and cached[1] <= rnd < cached[2]:
            return list(cached[3])
        ids = {m for m in (*self.base, *self.joins, *self.former) if self.trains_in(m, rnd)}
        members = sorted(ids, key=self.order_key)
        # the list holds until the next round at which a life starts or ends (each
        # bound, and the round after it, as life_in compares them)
        edges = {e + d for e in (*self.joins.values(), *self.leaves.values(),
                                 *(x for lives in self.former.values() for rec in lives.values() for x in rec
                                   if x is not None)) for d in (0, 1)}
        first = max((e for e in edges if e <= rnd), default=-(2 ** 62))
        end = min((e for e in edges if e > rnd), default=2 ** 62)
        self._at_round = (key, first, end, members)
        return list(members)


def topology_for(spec: Any, n: int, *, seed: int = 0, dcs: list[Any] | None = None) -> Any:
    """The topology for ``n`` members, as every member computes it.

    ``hierarchical`` takes its datacenter sizes from ``dcs`` (the members' labels,
    in member order) when given, keeping its intra=/inter= options. A spec that
    does not fit ``n`` members (``torus:4x4`` after a death) falls back to a
    ring, with a warning: a cluster that shrinks keeps training.
    """
    if isinstance(spec, str):
        name, _, args = spec.partition(":")
        if name.strip() == "hierarchical" and dcs is not None:
            sizes = [sum(1 for d in dcs if d == label) for label in dict.fromkeys(dcs)]
            options = [a for a in args.split(",") if "=" in a]
            spec = "hierarchical:" + ",".join([*map(str, sizes), *options]) if len(sizes) > 1 else "complete"
        return _built(spec, n, seed)
    return _build(spec, n, seed)


@functools.lru_cache(maxsize=32)
def _built(spec: str, n: int, seed: int) -> Any:
    """One topology per spec, size and seed in a process, shared by whoever asks: a topology
    never changes once built, and the simulator's n members each building their own graph
    of n nodes held n squared graph entries (22 GB at 4,096 members)."""
    return _build(spec, n, seed)


def _build(spec: Any, n: int, seed: int) -> Any:
    from topologies import build

    try:
        return build(spec, n, seed=seed)
    except ValueError as e:
        log.warning("topology %r does not fit %d members (%s); using a ring", spec if isinstance(spec, str)
                    else "custom graph", n, e)
        return build("ring", n, seed=seed)
