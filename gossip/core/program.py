"""What a peer's driven programs yield besides the node program's actions.

``Poll(timeout)``: "handle what arrives for me, then resume me within ``timeout``
seconds" (a driver may resume it earlier, as soon as something arrived). Drivers
answer every action with the time of their clock (see :mod:`gossip.protocol.lifecycle`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator

__all__ = ["Poll", "POLL0", "Program", "PeerError"]


class PeerError(RuntimeError):
    """The node cannot take part (e.g. every peer runs a different model)."""


@dataclass(frozen=True)
class Poll:
    """Handle arriving messages, resume within ``timeout`` seconds."""

    timeout: float


POLL0 = Poll(0.0)  # "what time is it?": handle what arrived, resume at once
Program = Generator[Any, float, Any]
