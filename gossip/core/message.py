"""The unit nodes exchange: what a mixing rule sends plus who, when and how far along."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Message", "Packet", "STATE", "STATE_KINDS"]

STATE = "state"  # a mixing payload; other kinds are control traffic (see gossip.transport.wire)
STATE_KINDS = frozenset({STATE})


@dataclass(frozen=True)
class Packet:
    """What a mixing rule hands to one neighbour.

    ``data`` is an :class:`gossip.compression.Encoded` tensor; ``weight`` is the
    push-sum mass travelling with it; ``extra`` holds small rule-specific scalars
    (e.g. a CHOCO sequence number or a "full snapshot" flag).
    """

    data: Any
    weight: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Message:
    """A packet stamped by the sending node.

    ``progress`` is the sender's local step count (the staleness clock),
    ``round`` its exchange number, ``seq`` a per-sender counter that detects
    replays and reordering, ``fingerprint`` the model hash that must match.
    ``tensor`` caches the decoded payload once a receiver has decoded it (it
    never travels).
    """

    kind: str
    sender: Any
    round: int = 0
    progress: int = 0
    seq: int = 0
    data: Any = None
    weight: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    fingerprint: str = ""
    tensor: Any = field(default=None, compare=False, repr=False)
