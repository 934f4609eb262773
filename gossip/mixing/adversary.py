"""A misbehaving node, for robustness experiments in the simulator.

:class:`ScaledSender` trains and mixes like everyone else but sends its
parameters multiplied by ``factor`` (x1000 is the classic "large-norm" attack):
what a buggy or hostile peer does to its neighbours, short of sending NaN
(which every node rejects). Robust mixing (``GossipRule(clip=...)``) is what
keeps honest nodes on course.
"""

from __future__ import annotations

from typing import Any

import torch

from gossip.core.message import Packet
from gossip.mixing.gossip import GossipRule

__all__ = ["ScaledSender", "parse_byzantine"]


class ScaledSender(GossipRule):
    """Sends ``factor * x`` instead of x."""

    name = "scaled-sender"

    def __init__(self, factor: float, codec: Any = "none") -> None:
        super().__init__(codec)
        self.factor = float(factor)

    def outgoing(self, x: torch.Tensor, topology: Any, me: int, rnd: int) -> list[tuple[int, Packet]]:
        self.round_weights(topology, me, rnd)
        if not self.receivers:
            return []
        packet = Packet(self.codec.encode(x * self.factor))
        return [(j, packet) for j in self.receivers]


def parse_byzantine(spec: Any, n: int) -> dict[int, float]:
    """``3=1000,5=-10``: node 3 sends x1000, node 5 sends x-10."""
    if not spec:
        return {}
    if isinstance(spec, dict):
        items = spec.items()
    else:
        items = []
        for item in str(spec).split(","):
            node, eq, factor = item.partition("=")
            if not eq:
                raise ValueError(f"byzantine spec {spec!r}: expected NODE=FACTOR items, e.g. 3=1000")
            items.append((node, factor))
    out = {}
    for node, factor in items:
        try:
            i, f = int(node), float(factor)
        except (TypeError, ValueError):
            raise ValueError(f"byzantine spec {spec!r}: NODE must be an integer and FACTOR a number") from None
        if not 0 <= i < n:
            raise ValueError(f"byzantine node {i} does not exist (nodes are 0..{n - 1})")
        out[i] = f
    return out
