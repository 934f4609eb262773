"""The protocol's timings in one object, checked once and passed to every part that reads them.

Like memberlist's ``Config``: :class:`Timing` holds every timing of the
membership protocol (how often a node probes, how long a silence means death,
how long a start settles, how far ahead joins and leaves are announced, ...),
with named presets, and the member table, the control plane, the failure
detectors, the joins and the peer's life all take it explicitly. Each default
is written here and nowhere else; ``gossip-node``'s flags, its TOML keys,
``PeerConfig`` and :class:`~gossip.peer.user_loop.GossipNode` keywords, and the
simulator's ``detect`` all become one of these.

>>> Timing().dead_after, Timing.fast().heartbeat, Timing.from_detect(0.4).heartbeat
(3.0, 0.25, 0.1)
>>> Timing(heartbeat=3.0, dead_after=2.0)
Traceback (most recent call last):
...
ValueError: heartbeat (3 s) must be shorter than dead_after (2 s): a member would be declared dead between two probes
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from gossip.core.options import flat_options
from gossip.protocol.swim import SwimOptions

__all__ = ["Timing", "TIMING_OPTIONS", "timing_from", "with_timing_options", "DETECTORS", "DEFAULT_DETECTOR"]

DETECTORS = ("heartbeat", "swim")  # the failure detectors a node may run (gossip-node --detector)
DEFAULT_DETECTOR = "swim"  # gossip-node's, the simulator's and the explorer's


@dataclass(frozen=True)
class Timing:
    """Every timing of the membership protocol, in seconds of the driver's clock
    (rounds for the margins).

    heartbeat : a node probes one member (SWIM) or pings every member (the heartbeat
        detector) this often; also the pace of its hellos while it discovers
    dead_after : a member silent this long is declared dead
    settle : a fresh start waits until the member set has been stable this long
    grace : a finished node keeps serving the members still training at most this long
    join_timeout : a node that no peer answers (or whose join the cluster never
        schedules) waits this long at most, then trains on alone
    start_hold : a ``--peers`` seed that has not answered holds a fresh start of the
        members that did answer back this long at most (measured from each node's
        start); it joins the running cluster when it comes
    join_margin : rounds between announcing a join and adopting it (every member
        must hear of it first)
    leave_margin : rounds between announcing a death or goodbye and adopting it (a
        death's at least the rounds ``dead_after`` lasts: see ``Membership.death_margin``)
    fanout : the members a node tells of a change to its member table that it learned
        or found itself (each of them that learns something from it tells as many in
        turn); 0: ``3 + ceil(log2 n)`` in a cluster of ``n`` (see :meth:`spread`). A join
        is told to every member by the member that schedules it
    """

    heartbeat: float = 0.5
    dead_after: float = 3.0
    settle: float = 2.0
    grace: float = 10.0
    join_timeout: float = 60.0
    start_hold: float = 10.0
    join_margin: int = 20
    leave_margin: int = 5
    fanout: int = 0

    def __post_init__(self) -> None:
        for name in ("heartbeat", "dead_after", "join_timeout", "start_hold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        for name in ("settle", "grace"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        for name in ("join_margin", "leave_margin", "fanout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        if self.heartbeat >= self.dead_after:
            raise ValueError(f"heartbeat ({self.heartbeat:g} s) must be shorter than dead_after "
                             f"({self.dead_after:g} s): a member would be declared dead between two probes")

    # -- presets ----------------------------------------------------------------------------
    @classmethod
    def fast(cls) -> "Timing":
        """Quick detection for tests and simulated clusters: probes every 0.25 s, dead after 2 s."""
        return cls(heartbeat=0.25, dead_after=2.0, settle=1.0, grace=5.0, start_hold=5.0)

    @classmethod
    def from_detect(cls, detect: float, round_seconds: float = 0.0) -> "Timing":
        """The simulator's timing for a failure-detection delay of ``detect`` seconds
        (``gossip-sim --detect``), with rounds of ``round_seconds``: probes every
        ``detect / 4``, a start that settles in one probe period, a grace of
        ``2.5 * detect``, a join timeout of ``20 * detect`` (at least 1 s), a start hold of
        five probe periods, and joins announced the rounds one probe period lasts ahead
        (2 to 20)."""
        if isinstance(detect, bool) or not isinstance(detect, (int, float)) or not (detect > 0 and math.isfinite(detect)):
            raise ValueError(f"detect must be a positive number of seconds (the failure detector's dead_after), "
                             f"got {detect!r}")
        heartbeat = detect / 4
        margin = int(min(cls.join_margin, max(2, math.ceil(heartbeat / max(round_seconds, 1e-9)))))
        return cls(heartbeat=heartbeat, dead_after=float(detect), settle=heartbeat, grace=2.5 * detect,
                   join_timeout=max(1.0, 20.0 * detect), start_hold=5 * heartbeat, join_margin=margin)

    def replace(self, **changes: Any) -> "Timing":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # -- what the parts derive from it ------------------------------------------------------
    def swim(self) -> SwimOptions:
        """SWIM's timing: the probe period is ``heartbeat``, and a suspect member is declared
        dead after ``max(dead_after - heartbeat, max(1, log10 n) * heartbeat)`` seconds, so
        that a crash becomes a removal about ``dead_after`` after the first probe it fails.

        >>> o = Timing().swim()
        >>> o.period, o.probe_timeout, o.suspicion_timeout(4), o.suspicion_timeout(1024), o.suspicion_timeout(10**6)
        (0.5, 0.2, 2.5, 2.5, 3.0)
        """
        return SwimOptions(period=self.heartbeat, probe_timeout=min(0.2, 0.4 * self.heartbeat),
                           suspicion_min=max(0.0, self.dead_after - self.heartbeat),
                           gossip_interval=min(0.1, self.heartbeat))

    def spread(self, n: int) -> int:
        """How many of the other members of a cluster of ``n`` a node tells of a change
        (``fanout``, or ``3 + ceil(log2 n)``): a push that every node forwards once to
        ``log2 n + c`` random members reaches all ``n`` with probability about
        ``exp(-exp(-c))`` (Erdos and Renyi; 0.95 for ``c = 3``), in ``log n`` hops of a
        message's latency; a member it misses learns it from the next probe that meets a
        member that knows it (the digests differ, and the two exchange member lists).
        Every member in clusters of up to 7 with the default.

        >>> [Timing().spread(n) for n in (4, 8, 16, 1024, 4096)], Timing(fanout=2).spread(16)
        ([3, 6, 7, 13, 15], 2)
        """
        k = self.fanout or 3 + math.ceil(math.log2(max(n, 1)))
        return max(0, min(n - 1, k))

    def reconcile_after(self, n: int) -> float:
        """How long a difference of member digests must last before a member of a
        running cluster of ``n`` answers it with its whole member table (anti-entropy,
        see ``ControlPlane._reconcile``): ``2 + ceil(log2 n)`` probe periods, longer
        than news takes to reach every member as deltas (``log n`` hops of a tick, see
        :meth:`spread`) or in SWIM's messages, so that members that differ only while a
        change spreads exchange no table. That bound holds for the default fanout only:
        a push forwarded to fewer members may miss some for good, and the tables are
        then how they learn it, at once (no wait).

        >>> [Timing().reconcile_after(n) for n in (2, 16, 1024, 4096)]
        [1.5, 3.0, 6.0, 7.0]
        >>> Timing(fanout=1).reconcile_after(12), Timing(fanout=20).reconcile_after(1024), Timing(fanout=2).reconcile_after(3)
        (0.0, 6.0, 2.0)
        """
        hops = math.ceil(math.log2(max(n, 1)))
        if self.spread(n) < min(n - 1, 3 + hops):  # (a fanout below the default's: no bound)
            return 0.0
        return self.heartbeat * (2 + hops)

    @property
    def stall(self) -> float:
        """A gap between two of a node's own ticks longer than this means the node itself did
        not run (suspended, swapped out): its silence, not its members'."""
        return max(self.dead_after / 2, 4 * self.heartbeat)

    @property
    def tick(self) -> float:
        """How often a driver ticks the control plane, at most."""
        return min(0.1, self.heartbeat / 2)

    def detection_bound(self, detector: str, n: int) -> float:
        """The longest a crash of one member of ``n`` takes to become a removal on a live
        member that can reach it, with detector ``detector`` (messages taking no time).

        ``heartbeat``: the member is pinged every ``heartbeat`` and removed once silent for
        ``dead_after``, checked at ticks of at most ``heartbeat / 2``. ``swim``: each node
        probes every member once per pass of its probe order (reshuffled at each pass), so
        at most ``2n - 2`` periods pass before its probe of the crashed member, one more
        before it is suspect, then the suspicion timeout (SWIM's time-bounded completeness;
        news from other members can only make it sooner). On average SWIM is far quicker:
        some member probes it within about one period.

        >>> Timing().detection_bound("heartbeat", 8), Timing().detection_bound("swim", 8)
        (3.25, 10.0)
        """
        if detector == "heartbeat":
            return self.dead_after + self.heartbeat / 2
        if detector == "swim":
            return (2 * n - 1) * self.heartbeat + self.swim().suspicion_timeout(n)
        raise ValueError(f"detector must be one of {', '.join(DETECTORS)}, got {detector!r}")


TIMING_OPTIONS = tuple(f.name for f in dataclasses.fields(Timing))


def timing_from(base: Timing | None, flat: Mapping[str, Any]) -> Timing:
    """``base`` (or the defaults) with the flat options in ``flat`` applied."""
    if base is not None and not isinstance(base, Timing):
        raise ValueError(f"timing must be a Timing, got {type(base).__name__}")
    return (base or Timing()).replace(**flat) if flat else (base or Timing())


with_timing_options = flat_options("timing", TIMING_OPTIONS, timing_from)
"""Class decorator for a dataclass with a ``timing: Timing`` field: the timings are also
accepted as flat keywords (``PeerConfig(listen=..., dead_after=2.0)``) and read back flat
(``cfg.dead_after``); see :func:`gossip.core.options.flat_options`."""
