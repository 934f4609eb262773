"""SWIM (``gossip/protocol/swim.py``) as the control plane's failure detector.

The default (``PeerConfig(detector="swim")``, ``gossip-node --detector swim``;
``--detector heartbeat`` runs the all-to-all pings instead); every member of a
cluster must use the same detector. Instead of every member
pinging every other each ``heartbeat``, each member probes one member per
``heartbeat`` (indirectly through 3 others when it does not answer), and
deaths spread piggybacked on the probes, so control traffic per node stays
constant as the cluster grows.

What rides where. A SWIM message travels as a wire message of kind ``swim``
whose ``x`` map holds SWIM's fields (``op``, ``inc``: SWIM's incarnation,
``seq``, ``target``, ``uid``/``ust``/``uinc``) and, framed by the control
plane as any of its messages, what today's pings carry: ``life`` (the
sender's life, its incarnation in the member table: kept apart from SWIM's
``inc``, which refutations raise), ``status``, ``dc``, ``seeding``, ``digest``
(the member digest, for anti-entropy and the start), and the sender's round
and progress in the header. The control plane reads each one as a ``ping``
from that life first (:meth:`SwimDetector.control_view`), so status, round
and member digest reach members as before, each time two members exchange a
probe (at least once per pass of the probe order, ``n - 1`` periods).

Lives. The detector of each life of this node is a fresh :class:`Swim` at
that life's incarnation (its start time in µs, far above any count of
refutations). Members enter it from the member table (hellos, member lists,
restarts: a member's new life is joined at its incarnation); members that
said goodbye leave it. An event about a member is acted on only when it is
about the life in the member table: ``dead`` becomes a removal (its leave
round announced, as for a silent member today), ``left`` a removal as its
goodbye would have made (the goodbye itself was lost), ``suspect`` is logged,
``alive`` after a suspicion or death is reported alive (the member table
re-admits a member declared dead on direct contact, as it does today).

Deaths against direct contact. SWIM's verdict that a member is dead (its own
suspicion ran out, or the news came from another node) is doubted, not acted
on, when this node heard from that member itself within ``dead_after / 2``:
one node's word must not evict a member that talks to this one, as with a
leave in another node's member list (``ControlPlane._learn_leaves``). After a
partition whose sides were cut and rejoined at different moments, a node of one
side may still spread the death of a member the other side hears again; the
member refutes it (SWIM's buddy system tells it) and is alive again
everywhere, with no leave round. A doubted member that then stays silent for
``dead_after`` is dead after all.

Timing: the probe period is ``heartbeat``; a suspect member is declared dead
after ``max(dead_after - heartbeat, max(1, log10 n) * heartbeat)`` seconds
(SWIM's own timeout, memberlist's scaling, is the second term), so a crash
becomes a removal about ``dead_after`` after the first probe it fails to
answer, at any size up to 10^5 members at the defaults.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from gossip.core.message import Message
from gossip.protocol.detector import Frame, mark_heard, own_stall
from gossip.protocol.effects import Verdicts
from gossip.protocol.membership import Membership
from gossip.protocol.swim import (
    ALIVE,
    DEAD,
    KIND,
    LEFT,
    SUSPECT,
    Swim,
    SwimOptions,
    check,
    from_message,
)
from gossip.protocol.timing import Timing

__all__ = ["SwimDetector"]

log = logging.getLogger("gossip.detector")

MAX_INT = 2**63 - 1


class SwimDetector:
    """The failure detector of the member table ``membership`` by SWIM (see the module docstring).

    Parameters
    ----------
    membership : the member table (read and written with the control plane's lock held)
    timing : the protocol's timings (the probe period is ``heartbeat``)
    frame : ``frame(kind, fields)``: this node's control message of that kind (the control
        plane's framing: life, status, round, member digest)
    options : SWIM's own timing; default ``timing.swim()``
    seed : seeds each life's rng with (seed, node id, life): the same inputs, the same probes
    """

    def __init__(self, membership: Membership, timing: Timing, frame: Frame, *,
                 options: SwimOptions | None = None, seed: Any = 0) -> None:
        self.m = membership
        self.timing = timing
        self.frame = frame
        self.options = options if options is not None else timing.swim()
        self.seed = seed
        self.ignored_events = 0  # events about a member's older life, or a non-member
        self._last_tick: float | None = None
        self.new_life(membership.incarnation)

    @property
    def id(self) -> str:
        return self.m.self_id

    def new_life(self, incarnation: int) -> None:
        """A new life of this node: a fresh SWIM at its incarnation, members joined again."""
        self.life = incarnation
        self.swim = Swim(self.id, incarnation, random.Random(f"{self.seed}|{self.id}|{incarnation}"), self.options)
        self._synced: int | None = None
        self.doubted: set[str] = set()  # dead by SWIM, heard from lately: see the module docstring

    # -- the interface of gossip.protocol.detector ------------------------------------------------------
    def heard(self, member: str, now: float) -> None:
        # SWIM needs its own messages; the member table's last_seen is read elsewhere too
        mark_heard(self.m, member, now)

    def urge(self, member: str, now: float) -> None:
        """The training side misses ``member``'s messages: probe it next, out of turn
        (see :meth:`Swim.probe_soon`), so that a crash of a neighbour is suspected
        within a period of its silence, not when some member's probe order meets it."""
        if member in self.m.members:
            self.swim.probe_soon(member, now)

    def suspected(self, member: str) -> bool:
        """Whether SWIM holds the table's life of ``member`` suspect (or dead, while that
        verdict is doubted): it did not answer a probe, direct or indirect, since."""
        m, rec = self.m.members.get(member), self.swim.state(member)
        return m is not None and rec is not None and rec[0] in (SUSPECT, DEAD) and rec[1] >= m.incarnation

    def tick(self, now: float) -> Verdicts:
        out = Verdicts()
        # a stall of this process: SWIM gives its suspicions the time back itself
        out.stalled, self._last_tick = own_stall(self.m, self.timing, self._last_tick, now), now
        self._sync(now)
        out.sends = [self._frame(sm) for sm in self.swim.tick(now)]
        for ev in self.swim.take_events():
            member = self.m.members.get(ev.member)
            if member is None or ev.incarnation < member.incarnation:
                self.ignored_events += 1  # not a member, or about an older life than the table's
                continue
            if ev.state == DEAD:
                if now - member.last_seen < self.timing.dead_after / 2:
                    self.doubted.add(ev.member)  # it spoke to this node lately: judged by its silence
                else:
                    out.dead.append(ev.member)
            elif ev.state == SUSPECT:
                out.suspected.append(ev.member)
            elif ev.state == ALIVE and ev.previous in (SUSPECT, DEAD):
                self.doubted.discard(ev.member)
                out.alive.append(ev.member)
            elif ev.state == LEFT:
                # its goodbye did not reach this node (lost), the news of it did; SWIM
                # probes it no more, so without this it would stay a member for good
                out.left.append(ev.member)
        for mid in sorted(self.doubted):
            member, rec = self.m.members.get(mid), self.swim.state(mid)
            if member is None or rec is None or rec[0] != DEAD:
                self.doubted.discard(mid)  # it refuted, or left the table otherwise
            elif now - member.last_seen >= self.timing.dead_after:
                self.doubted.discard(mid)
                out.dead.append(mid)
        return out

    def control_view(self, msg: Message) -> Message:
        """A ``swim`` message as the control plane reads it: a ``ping`` of the sender's
        life (``inc`` = its ``life``) with its status, datacenter and member digest.
        ValueError names a bad field (SWIM's, or ``life``); then nothing changed."""
        if msg.kind != KIND:
            raise ValueError("kind")
        life = msg.extra.get("life")
        if isinstance(life, bool) or not isinstance(life, int) or not 0 <= life <= MAX_INT:
            raise ValueError("life")
        try:
            check(from_message(msg, self.id), self.id)
        except ValueError as e:
            raise ValueError(f"swim {e}") from None
        return Message("ping", msg.sender, msg.round, msg.progress, msg.seq, None, None,
                       {**msg.extra, "inc": life}, msg.fingerprint)

    def receive(self, msg: Message, now: float) -> Verdicts:
        """A ``swim`` message (checked by :meth:`control_view`): the verdicts carry its replies."""
        self._sync(now)
        out = Verdicts()
        out.sends = [self._frame(sm) for sm in self.swim.receive(from_message(msg, self.id), now)]
        return out

    # -- helpers -------------------------------------------------------------------------------
    def _frame(self, sm: Any) -> tuple[str, Message]:
        return sm.to, self.frame(KIND, {**sm.fields, "life": self.life})

    def _sync(self, now: float) -> None:
        """SWIM learns the member table's changes: members (and new lives) join at their
        life's incarnation; members that said goodbye leave."""
        if self._synced == self.m.version:
            return
        self._synced = self.m.version
        for mid, member in self.m.members.items():
            if mid == self.id:
                continue
            rec = self.swim.state(mid)
            if rec is None or rec[1] < member.incarnation:
                # (the control plane's lists tell every member of a newcomer: see Swim.join)
                self.swim.join(mid, member.incarnation, now, spread=False)
        for mid in self.m.departed:
            if mid not in self.m.members:
                rec = self.swim.state(mid)
                if rec is not None and rec[0] != LEFT:
                    self.swim.remove(mid)

    def state(self, member: str) -> tuple[str, int] | None:
        """(SWIM state, SWIM incarnation) of ``member`` here."""
        return self.swim.state(member)
