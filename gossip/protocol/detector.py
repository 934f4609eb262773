"""Failure detection behind a small interface, so that the detector can change
(the all-to-all heartbeat here; SWIM's probes, see ``gossip/protocol/swim_detector.py``)
without the control plane changing.

What a detector is told, and what it says (sans-IO: no clock, no socket; what it
says is :class:`~gossip.protocol.effects.Verdicts`, effects like the control plane's):

``heard(member, now)``
    a message (any kind) from ``member`` arrived at ``now``
``tick(now) -> Verdicts``
    called every few tens of milliseconds of the driver's clock; returns the
    messages to send now (its probes, framed as this node's messages by the
    ``frame`` function the control plane gave it: life, status, datacenter, round,
    progress and member digest) and the members it now holds ``suspected``,
    ``dead``, ``alive`` again (after a suspicion) or ``left``
``receive(msg, now) -> Verdicts``
    a message of its own kind (SWIM's ``swim``) from a member, its fields checked:
    the verdicts carry only ``sends`` (the replies); what the message taught about
    members is said at the next tick. A detector without messages of its own
    refuses every one (``ValueError``).
``control_view(msg) -> Message``
    such a message as the control plane reads it: the member's status, round,
    life and member digest, as a ``ping`` would carry them
``new_life(incarnation)``
    this node starts a new life: the detector starts afresh at it
``suspected(member) -> bool``
    whether the detector holds the member's current life unreachable now (SWIM: it
    failed a direct probe and the indirect ones, or another member said so, and has
    not refuted it yet): a synchronous round stops waiting for it (see
    ``Lifecycle.gone``). The heartbeat detector suspects nobody.

The control plane acts on the verdicts: a dead member is removed (its leave
round announced), a suspected one is only logged.
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol

from gossip.core.message import Message
from gossip.protocol.effects import Verdicts
from gossip.protocol.membership import Membership
from gossip.protocol.timing import Timing

__all__ = ["FailureDetector", "Frame", "HeartbeatDetector", "mark_heard", "own_stall"]

log = logging.getLogger("gossip.detector")


Frame = Callable[[str, dict], Message]  # (kind, fields) -> this node's control message of that kind


class FailureDetector(Protocol):
    """The interface the control plane uses (see the module docstring)."""

    def heard(self, member: str, now: float) -> None: ...

    def tick(self, now: float) -> Verdicts: ...

    def receive(self, msg: Message, now: float) -> Verdicts: ...

    def control_view(self, msg: Message) -> Message: ...

    def new_life(self, incarnation: int) -> None: ...

    def suspected(self, member: str) -> bool: ...

    def urge(self, member: str, now: float) -> None: ...


def mark_heard(membership: Membership, member: str, now: float) -> None:
    """A message from ``member`` arrived at ``now``: the member table's ``last_seen``."""
    m = membership.members.get(member)
    if m is not None:
        m.last_seen = now


def own_stall(membership: Membership, timing: Timing, last_tick: float | None, now: float) -> float:
    """Seconds this process did not run since its last tick (0: it ran).

    A gap longer than ``timing.stall`` (``max(dead_after / 2, 4 * heartbeat)``) means
    this process was suspended or swapped out: everyone would look silent, but the
    silence is its own, so the gap is credited back to every member's ``last_seen``.
    """
    gap = now - (last_tick if last_tick is not None else now)
    if gap <= timing.stall:
        return 0.0
    for m in membership.members.values():
        m.last_seen = min(now, m.last_seen + gap)
    return gap


class HeartbeatDetector:
    """Every member pings every other member each ``heartbeat`` seconds; a member
    silent for ``dead_after`` seconds is dead (no suspicion stage). Its memory is
    the member table's ``last_seen``, which the member lists also read.

    A gap between two ticks longer than ``max(dead_after / 2, 4 * heartbeat)``
    means this process did not run (suspended, swapped out): everyone would look
    silent, but the silence is its own, so it is not counted against them.
    """

    def __init__(self, membership: Membership, timing: Timing, frame: Frame) -> None:
        self.m = membership
        self.timing = timing
        self.frame = frame
        self.last_ping = 0.0
        self._last_tick: float | None = None

    def heard(self, member: str, now: float) -> None:
        mark_heard(self.m, member, now)

    def receive(self, msg: Message, now: float) -> Verdicts:
        raise ValueError("kind (this node's failure detector takes no messages of its own)")

    def control_view(self, msg: Message) -> Message:
        raise ValueError("kind (this node's failure detector takes no messages of its own)")

    def new_life(self, incarnation: int) -> None:
        pass  # its memory is the member table's last_seen, which a new life keeps

    def suspected(self, member: str) -> bool:
        return False  # silence is all it knows, and a silent member is waited for until removed

    def urge(self, member: str, now: float) -> None:
        """Nothing to do: every member is pinged each heartbeat anyway."""

    def tick(self, now: float) -> Verdicts:
        out = Verdicts()
        out.stalled, self._last_tick = own_stall(self.m, self.timing, self._last_tick, now), now
        if now - self.last_ping >= self.timing.heartbeat:
            self.last_ping = now
            out.dead = [mid for mid, m in self.m.members.items()
                        if mid != self.m.self_id and now - m.last_seen > self.timing.dead_after]
            targets = [mid for mid in self.m.others() if mid not in out.dead]
            if targets:
                ping = self.frame("ping", {})  # one message, to each
                out.sends = [(mid, ping) for mid in targets]
        return out
