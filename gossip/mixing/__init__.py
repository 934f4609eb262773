"""Mixing rules: how a node combines its parameters with its neighbours'.

Rules never touch sockets or clocks; see :class:`gossip.mixing.base.MixingRule`.
"""

from __future__ import annotations

from typing import Any

from gossip.mixing.base import Inbox, MixingRule, MixReport
from gossip.mixing.gossip import GossipRule, weighted_sum_
from gossip.mixing.pushsum import PushSumRule

__all__ = ["Inbox", "MixingRule", "MixReport", "GossipRule", "PushSumRule", "weighted_sum_", "make_rule", "ALGORITHMS"]

ALGORITHMS = ("gossip", "push-sum")


def make_rule(algorithm: str, codec: Any = "none") -> MixingRule:
    """Build the mixing rule named by ``algorithm`` (one of :data:`ALGORITHMS`)."""
    if algorithm == "gossip":
        return GossipRule(codec)
    if algorithm == "push-sum":
        return PushSumRule(codec)
    raise ValueError(f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
