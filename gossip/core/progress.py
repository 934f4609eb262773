"""A one-line progress bar for interactive terminals; silent when piped."""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any, TextIO


class ProgressBar:
    """Redraws at most ``fps`` times a second on ``stream`` if it is a TTY."""

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool | None = None,
                 fps: float = 5.0, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        isatty = getattr(self.stream, "isatty", lambda: False)()
        self.enabled = isatty if enabled is None else enabled
        self.total = max(1, total)
        self.width = width
        self.interval = 1.0 / fps
        self._last = 0.0
        self._drawn = False

    def update(self, done: float, text: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        frac = min(1.0, max(0.0, done / self.total))
        filled = int(frac * self.width)
        bar = "=" * filled + (">" if filled < self.width else "") + " " * (self.width - filled - 1)
        self.stream.write(f"\r[{bar}] {frac * 100:5.1f}% {text}\x1b[K")
        self.stream.flush()
        self._drawn = True

    def clear(self) -> None:
        """Erase the bar (before a log line goes to the same terminal); the next update redraws it."""
        if self.enabled and self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False
            self._last = 0.0

    def close(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
        self._drawn = False


class ClearBarBeforeLogging(logging.Filter):
    """Attached to a log handler on the bar's stream: log lines do not land in the middle of the bar."""

    def __init__(self, bar: ProgressBar) -> None:
        super().__init__()
        self.bar = bar

    def filter(self, record: logging.LogRecord) -> bool:
        self.bar.clear()
        return True


class PeerProgress:
    """The progress line of a real node (``gossip-node``): step/steps, round, members, loss, steps/s.

    Set as ``Peer.on_step``; it reads the node after every local step and
    redraws at most ``fps`` times a second.
    """

    def __init__(self, bar: ProgressBar, steps: int) -> None:
        self.bar, self.steps = bar, steps
        self._start: tuple[float, int] | None = None  # (time, step) of the first step seen

    def text(self, step: int, rnd: int, members: int, loss: float, rate: float | None) -> str:
        loss_text = f"{loss:.4f}" if isinstance(loss, float) and math.isfinite(loss) else "-"
        rate_text = f"{rate:.1f}" if rate is not None else "-"
        return (f"step {step}/{self.steps} round {rnd} members {members} loss {loss_text} "
                f"{rate_text} steps/s")

    def __call__(self, peer: Any) -> None:
        node = peer.node
        if node is None or not self.bar.enabled:
            return
        now = time.monotonic()
        if self._start is None:
            self._start = (now, node.step)
        t0, s0 = self._start
        rate = (node.step - s0) / (now - t0) if now > t0 and node.step > s0 else None
        self.bar.update(node.step, self.text(node.step, node.round, len(node.members), node.last_loss, rate),
                        force=node.step >= self.steps)
