"""How long a synchronous round waits for a neighbour that has gone silent.

A round that waits for a neighbour's state message used to wait the fixed
``--timeout`` (5 s) whenever the neighbour sent nothing: a crashed, paused or cut
off neighbour cost each of its neighbours a stall until the failure detector
removed it (``--dead-after``), and a join's first round could cost a whole timeout.
The rule here tells *slow* from *gone* by the neighbour's own rhythm:

- every neighbour's state messages arrive at a rhythm of its own (one per round
  it trains, per channel); :class:`Patience` keeps the gaps between its last
  :data:`WINDOW` of them;
- a round waits for a neighbour as long as the neighbour keeps to that rhythm: it
  gives up on it once the neighbour has been *silent* (no message of any kind,
  state or control) for ``margin`` times the 95th percentile of its gaps, bounded
  below by ``floor`` (``--min-wait``) and above by ``--timeout``; then the round
  mixes without it, its weight to self, as for any missing message;
- with fewer than :data:`MIN_GAPS` gaps known (a neighbour just met, a joiner's
  first rounds) there is no rhythm to go by, and the round waits ``--timeout``.

A slow but steady neighbour (a slow link, a slower GPU, a large model's long
transfers) is never silent that long: its messages keep coming once per round
of its own, and those gaps set its bound. A neighbour that stopped sends
nothing: after the bound, rounds stop waiting for it at once until it speaks
again or the failure detector removes it (and its leave round comes). A
neighbour that was only paused for longer than its bound (a long evaluation, a
hiccup of the machine) misses those rounds' mixing, as with a timeout, and is
waited for again from its next message on.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["Patience", "WINDOW", "MIN_GAPS", "MARGIN", "DEFAULT_FLOOR"]

WINDOW = 32  # gaps kept per neighbour
MIN_GAPS = 8  # gaps needed before a neighbour has a rhythm to go by
MARGIN = 4.0  # a neighbour silent for this many times its 95th-percentile gap is given up on for the round
DEFAULT_FLOOR = 0.5  # seconds of silence (--min-wait) a round waits at least


class Patience:
    """The rhythm of each neighbour's state messages, and the silence after which a
    synchronous round stops waiting for it.

    >>> p = Patience(floor=0.5, ceiling=5.0)
    >>> for t in range(10):
    ...     p.heard("b", 0.1 * t)
    >>> round(p.bound("b"), 3), p.bound("c")  # 4 x 0.1 s is below the floor; c: no rhythm yet
    (0.5, None)
    >>> for t in range(10, 50):
    ...     p.heard("b", 1.0 * t - 9.0)  # now one message a second: a slow neighbour
    >>> p.bound("b")
    4.0
    """

    def __init__(self, floor: float = DEFAULT_FLOOR, ceiling: float = 5.0, margin: float = MARGIN) -> None:
        if not (isinstance(floor, (int, float)) and not isinstance(floor, bool) and math.isfinite(floor)
                and floor > 0):
            raise ValueError(f"min_wait must be a positive number of seconds, got {floor!r}")
        self.floor, self.ceiling, self.margin = float(floor), float(ceiling), float(margin)
        self.gaps: dict[str, deque[float]] = {}
        self.last: dict[str, float] = {}
        self._bounds: dict[str, float | None] = {}

    def heard(self, member: str, now: float) -> None:
        """A state message from ``member`` arrived at ``now``."""
        last = self.last.get(member)
        self.last[member] = now
        if last is None or now < last:
            return
        gaps = self.gaps.get(member)
        if gaps is None:
            gaps = self.gaps[member] = deque(maxlen=WINDOW)
        gaps.append(now - last)
        self._bounds.pop(member, None)

    def bound(self, member: str) -> float | None:
        """Seconds of silence after which a round stops waiting for ``member`` (None: it
        has no rhythm yet, the round waits ``--timeout``)."""
        if member in self._bounds:
            return self._bounds[member]
        gaps = self.gaps.get(member)
        if gaps is None or len(gaps) < MIN_GAPS:
            return None
        ordered = sorted(gaps)
        p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
        out = self._bounds[member] = min(self.ceiling, max(self.floor, self.margin * p95))
        return out

    def forget(self, member: str) -> None:
        """``member`` started a new life (or left): its rhythm starts afresh."""
        self.gaps.pop(member, None)
        self.last.pop(member, None)
        self._bounds.pop(member, None)
