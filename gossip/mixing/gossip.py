"""Synchronous gossip averaging (D-PSGD): x_i <- sum_j W_ij x_j each round."""

from __future__ import annotations

from typing import Any

import torch

from gossip.core.buffers import Pieces, pooled_copy
from gossip.core.message import Packet
from gossip.mixing.base import Inbox, MixingRule, MixReport, take_round_messages

__all__ = ["GossipRule", "weighted_sum_"]


def weighted_sum_(x: torch.Tensor, self_weight: float, terms: list[tuple[float, torch.Tensor | Pieces]]) -> torch.Tensor:
    """In place: ``x <- self_weight * x + sum_k w_k t_k``.

    Computed as a chain of ``lerp_``: after each term ``x`` holds the weighted
    mean of the terms so far, ``x += (w_k / W_k) (t_k - x)`` with ``W_k`` the
    running total. That is one kernel per neighbour and no temporary, and each
    step is a convex combination (no growth of rounding error). When the weights
    do not sum to 1 the mean is rescaled at the end. A term given as
    :class:`~gossip.core.buffers.Pieces` (a payload still in its wire frames) is
    applied part by part.
    """
    total = self_weight
    for w, t in terms:
        if w == 0.0:
            continue
        total += w
        if type(t) is Pieces:
            for off, part in t:
                x[off:off + part.numel()].lerp_(part, w / total)
        else:
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

    def __init__(self, codec: Any = "none", clip: float | str | None = None) -> None:
        super().__init__(codec)
        self._sent: dict[int, torch.Tensor] = {}  # overlap: snapshots of rounds not mixed yet
        if clip is not None and clip != "auto" and not (isinstance(clip, (int, float)) and clip > 0):
            raise ValueError(f"clip must be a positive radius or 'auto', got {clip!r}")
        self.clip = clip
        self.clipped = 0  # neighbour differences shortened so far

    def outgoing(self, x: torch.Tensor, topology: Any, me: int, rnd: int) -> list[tuple[int, Packet]]:
        self.round_weights(topology, me, rnd)
        receivers = self.receivers
        if not receivers:
            return []
        if self.overlap:
            # the mix of this round happens later, against the values sent now
            snap = self._sent[rnd] = pooled_copy(x)
            packet = Packet(self.codec.encode(snap))
        else:
            packet = Packet(self.encode_state(x))  # one encoding shared by every receiver
        return [(j, packet) for j in receivers]

    def mix(self, x: torch.Tensor, inbox: Inbox, topology: Any, me: int, rnd: int, progress: int) -> MixReport:
        weights = self.round_weights(topology, me, rnd)[0]
        report = MixReport()
        self_w, terms = take_round_messages(inbox, weights, me, rnd, report)
        ref = self._sent.pop(rnd, None) if self.overlap else None
        if ref is None and self.clip is None:
            terms = [(w, self.decode_pieces(m, x)) for w, m in terms]  # read in place, frame by frame
        else:
            terms = [(w, self.decode(m, x)) for w, m in terms]
        if terms and self.clip is not None:
            self._clipped_mix(x, terms, ref)
            report.mixed = len(terms)
        elif terms:
            report.mixed = len(terms)
            if ref is None:
                weighted_sum_(x, self_w, terms)
            else:
                # overlap: local steps ran since we sent ``ref``; keep them and apply the
                # averaging correction computed on the snapshots: x += sum_j w_ij (x_j - ref)
                taken = 0.0
                for w, t in terms:
                    x.add_(t, alpha=w)
                    taken += w
                x.add_(ref, alpha=-taken)
        return report

    def _clipped_mix(self, x: torch.Tensor, terms: list[tuple[float, torch.Tensor]], ref: torch.Tensor | None) -> None:
        """Clipped gossip (He et al., 2022): x += sum_j w_ij clip(x_j - x_i, tau).

        No neighbour can move us further than ``w_ij * tau``, whatever it sends.
        ``tau="auto"`` is the lower median of the neighbours' distances, so a
        minority of misbehaving neighbours cannot choose it.
        """
        base = x if ref is None else ref
        diffs = [(w, t - base) for w, t in terms]
        norms = [float(torch.linalg.vector_norm(d)) for _, d in diffs]
        if self.clip == "auto":
            tau = sorted(norms)[(len(norms) - 1) // 2]
        else:
            tau = float(self.clip)
        for (w, d), n in zip(diffs, norms):
            scale = 1.0
            if n > tau:
                scale = tau / n if n > 0 else 0.0
                self.clipped += 1
            x.add_(d, alpha=w * scale)

    def report(self) -> dict[str, Any]:
        out = {"rule": self.name}
        if self.clip is not None:
            out.update(clip=self.clip, clipped=self.clipped)
        return out
