"""A one-line progress bar for interactive terminals; silent when piped."""

from __future__ import annotations

import sys
import time
from typing import TextIO


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

    def close(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
