"""Failure detection behind a small interface, so that the detector can change
(today's all-to-all heartbeats; SWIM's probes, see ``gossip/protocol/swim.py``) without the
control plane changing.

What a detector is told, and what it says (sans-IO: no clock, no socket):

``heard(member, now)``
    a message (any kind) from ``member`` arrived at ``now``
``tick(now) -> Verdicts``
    called every few tens of milliseconds of the driver's clock; returns the
    probes to send now (``(destination, kind)``: the control plane builds and
    sends each, carrying its member digest) and the members it now holds
    ``suspected``, ``dead`` or ``alive`` again (after a suspicion)

The control plane acts on the verdicts: a dead member is removed (its leave
round announced), a suspected one is only logged, and a probe is a ``ping``.

A detector with messages of its own (SWIM, see ``gossip/protocol/swim_detector.py``) also has

``receive(msg, now) -> Verdicts``
    a message of its kind (``swim``) from a member, its fields checked: the
    verdicts carry only ``sends`` (the replies); what the message taught about
    members is said at the next tick
``control_view(msg) -> Message``
    that message as the control plane reads it: the member's status, round,
    life and member digest, as a ``ping`` would carry them
``new_life(incarnation)``
    this node starts a new life: the detector starts afresh at it

and its verdicts carry ``sends``: ``(destination, kind, fields)``, which the
control plane frames as its own messages (life, status, datacenter, member
digest, round and progress) with ``fields`` added over them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from gossip.protocol.membership import Membership

__all__ = ["Verdicts", "FailureDetector", "HeartbeatDetector", "DETECTORS", "DEFAULT_DETECTOR", "make_detector",
           "detection_bound", "mark_heard", "own_stall"]

DETECTORS = ("heartbeat", "swim")  # the names PeerConfig.detector and gossip-node --detector take
DEFAULT_DETECTOR = "swim"  # gossip-node's, the simulator's and the explorer's

log = logging.getLogger("gossip.detector")


@dataclass
class Verdicts:
    """What a detector says at one tick."""

    probes: list[tuple[str, str]] = field(default_factory=list)  # (destination, message kind) to send now
    suspected: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    alive: list[str] = field(default_factory=list)  # suspected before, heard from since
    left: list[str] = field(default_factory=list)  # said goodbye, as another node heard (SWIM's news)
    stalled: float = 0.0  # seconds this node itself did not run (0: it ran)
    sends: list[tuple[str, str, dict]] = field(default_factory=list)  # (destination, kind, fields) to send now


class FailureDetector(Protocol):
    """The interface the control plane uses (see the module docstring)."""

    def heard(self, member: str, now: float) -> None: ...

    def tick(self, now: float) -> Verdicts: ...


def mark_heard(membership: Membership, member: str, now: float) -> None:
    """A message from ``member`` arrived at ``now``: the member table's ``last_seen``."""
    m = membership.members.get(member)
    if m is not None:
        m.last_seen = now


def own_stall(membership: Membership, heartbeat: float, last_tick: float | None, now: float) -> float:
    """Seconds this process did not run since its last tick (0: it ran).

    A gap longer than ``max(dead_after / 2, 4 * heartbeat)`` means this process was
    suspended or swapped out: everyone would look silent, but the silence is its own,
    so the gap is credited back to every member's ``last_seen``.
    """
    gap = now - (last_tick if last_tick is not None else now)
    if gap <= max(membership.dead_after / 2, 4 * heartbeat):
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

    def __init__(self, membership: Membership, heartbeat: float) -> None:
        self.m = membership
        self.heartbeat = heartbeat
        self.last_ping = 0.0
        self._last_tick: float | None = None

    def heard(self, member: str, now: float) -> None:
        mark_heard(self.m, member, now)

    def tick(self, now: float) -> Verdicts:
        out = Verdicts()
        out.stalled, self._last_tick = own_stall(self.m, self.heartbeat, self._last_tick, now), now
        if now - self.last_ping >= self.heartbeat:
            self.last_ping = now
            out.dead = [mid for mid, m in self.m.members.items()
                        if mid != self.m.self_id and now - m.last_seen > self.m.dead_after]
            out.probes = [(mid, "ping") for mid in self.m.others() if mid not in out.dead]
        return out


def detection_bound(detector: str, n: int, heartbeat: float, dead_after: float) -> float:
    """The longest a crash of one member of ``n`` takes to become a removal on a live
    member that can reach it, with detector ``detector`` (messages taking no time).

    ``heartbeat``: the member is pinged every ``heartbeat`` and removed once silent for
    ``dead_after``, checked at ticks of at most ``heartbeat / 2``. ``swim``: each node
    probes every member once per pass of its probe order (reshuffled at each pass), so
    at most ``2n - 2`` periods pass before its probe of the crashed member, one more
    before it is suspect, then the suspicion timeout (SWIM's time-bounded completeness;
    news from other members can only make it sooner). On average SWIM is far quicker:
    some member probes it within about one period.

    >>> detection_bound("heartbeat", 8, 0.5, 3.0), detection_bound("swim", 8, 0.5, 3.0)
    (3.25, 10.0)
    """
    if detector == "heartbeat":
        return dead_after + heartbeat / 2
    if detector == "swim":
        from gossip.protocol.swim_detector import swim_options

        return (2 * n - 1) * heartbeat + swim_options(heartbeat, dead_after).suspicion_timeout(n)
    raise ValueError(f"detector must be one of {', '.join(DETECTORS)}, got {detector!r}")


def make_detector(detector: "FailureDetector | str | None", membership: Membership,
                  heartbeat: float) -> FailureDetector:
    """The detector named ``detector`` (one of :data:`DETECTORS`; None: :data:`DEFAULT_DETECTOR`)
    for ``membership``, or ``detector`` itself when it is one already."""
    if detector is None:
        detector = DEFAULT_DETECTOR
    if detector == "heartbeat":
        return HeartbeatDetector(membership, heartbeat)
    if detector == "swim":
        from gossip.protocol.swim_detector import SwimDetector

        return SwimDetector(membership, heartbeat)
    if isinstance(detector, str):
        raise ValueError(f"detector must be one of {', '.join(DETECTORS)}, got {detector!r}")
    return detector
