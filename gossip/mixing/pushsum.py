"""Push-sum (Stochastic Gradient Push): averaging on directed and time-varying graphs.

Each node keeps a mass ``w`` (starts at 1). The model the node trains is the
de-biased z = x / w. Each round it keeps share p_ii of its mass and sends
share p_ji to each out-neighbour j (column-stochastic p), then sums what
arrives: w <- p_ii w + sum m_j, z <- (p_ii w z + sum m_j z_j) / w.

Mass is never dropped: a message that misses its round is mixed in whenever
it arrives (the overlap / OSGP behaviour), so delays slow convergence but do
not bias the average.
"""

from __future__ import annotations

from typing import Any

import torch

from gossip.core.message import Packet
from gossip.mixing.base import Inbox, MixingRule, MixReport
from gossip.mixing.gossip import weighted_sum_

__all__ = ["PushSumRule"]


class PushSumRule(MixingRule):
    """SGP. ``synchronous=True`` waits for the round's messages (up to the node's
    timeout); ``False`` mixes whatever has arrived and never waits."""

    name = "push-sum"

    def __init__(self, codec: Any = "none", synchronous: bool = True) -> None:
        super().__init__(codec)
        self.synchronous = synchronous
        self.weight = 1.0
        self._kept = 1.0

    def outgoing(self, x: torch.Tensor, topology: Any, me: int, rnd: int) -> list[tuple[int, Packet]]:
        shares = topology.push_sum_out_weights(me, rnd)
        self._kept = shares.get(me, 0.0) * self.weight
        receivers = [j for j in shares if j != me]
        if not receivers:
            self._kept = self.weight
            return []
        # z travels once; each receiver's share of the mass rides in the packet weight.
        data = self.encode_state(x)
        return [(j, Packet(data, weight=shares[j] * self.weight)) for j in receivers]

    def mix(self, x: torch.Tensor, inbox: Inbox, topology: Any, me: int, rnd: int, progress: int) -> MixReport:
        report = MixReport()
        terms: list[tuple[float, torch.Tensor]] = []
        expected = set(self.expected_senders(topology, me, rnd))
        arrived: set[int] = set()
        for j in sorted(inbox.senders()):
            for msg in inbox.take_upto(j, rnd):
                if msg.weight is None:
                    continue  # not a push-sum message (the node validates kinds; defensive)
                terms.append((msg.weight, self.decode_pieces(msg, x)))
                if msg.round < rnd:
                    report.late += 1
                else:
                    arrived.add(j)
        report.missing = len(expected - arrived)
        report.mixed = len(terms)
        total = self._kept + sum(w for w, _ in terms)
        if terms:
            weighted_sum_(x, self._kept / total, [(w / total, t) for w, t in terms])
        self.weight = total
        return report

    def state_dict(self) -> dict[str, Any]:
        return {"weight": self.weight}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weight = float(state.get("weight", 1.0))
