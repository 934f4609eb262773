"""Synchronous gossip averaging (D-PSGD): x_i <- sum_j W_ij x_j each round."""

from __future__ import annotations

from typing import Any

import torch

from gossip.message import Packet
from gossip.mixing.base import Inbox, MixingRule, MixReport

__all__ = ["GossipRule", "weighted_sum_"]


def weighted_sum_(x: torch.Tensor, self_weight: float, terms: list[tuple[float, torch.Tensor]]) -> torch.Tensor:
    """In place: ``x <- self_weight * x + sum_k w_k t_k``.

    Computed as a chain of ``lerp_``: after each term ``x`` holds the weighted
    mean of the terms so far, ``x += (w_k / W_k) (t_k - x)`` with ``W_k`` the
    running total. That is one kernel per neighbour and no temporary, and each
    step is a convex combination (no growth of rounding error). When the weights
    do not sum to 1 the mean is rescaled at the end.
    """
    total = self_weight
    for w, t in terms:
        if w == 0.0:
            continue
        total += w
        x.lerp_(t, w / total)
    if abs(total - 1.0) > 1e-9:
        x.mul_(total)
    return x


class GossipRule(MixingRule):
    """D-PSGD: send the parameters to out-neighbours, wait for the in-neighbours'
    messages of the same round, replace x_i by the W-weighted average.

    A neighbour whose message misses the round (timeout, death, loss) is treated
    as absent: its weight goes to self, so W stays row-stochastic.
    """

    name = "gossip"
    synchronous = True

    def outgoing(self, x: torch.Tensor, topology: Any, me: int, rnd: int) -> list[tuple[int, Packet]]:
        self.round_weights(topology, me, rnd)
        receivers = self.receivers
        if not receivers:
            return []
        packet = Packet(self.codec.encode(x.clone()))  # one snapshot shared by every receiver
        return [(j, packet) for j in receivers]

    def mix(self, x: torch.Tensor, inbox: Inbox, topology: Any, me: int, rnd: int, progress: int) -> MixReport:
        weights = self.round_weights(topology, me, rnd)[0]
        report = MixReport()
        self_w = weights.get(me, 0.0)
        terms: list[tuple[float, torch.Tensor]] = []
        for j in sorted(weights):
            if j == me:
                continue
            msg, stale = inbox.take_round(j, rnd)
            report.late += stale
            if msg is None:
                self_w += weights[j]  # an absent neighbour's weight goes to self: W stays row-stochastic
                report.missing += 1
                continue
            terms.append((weights[j], self.decode(msg, x)))
        if terms:
            report.mixed = len(terms)
            weighted_sum_(x, self_w, terms)
        return report
