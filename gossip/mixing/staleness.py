"""Staleness-aware asynchronous gossip: nodes never wait.

Each message carries its sender's progress counter t_j (local steps done).
When node i mixes, for every in-neighbour j with a message it has not used
yet, it takes the newest one, computes the staleness s = max(0, t_i - t_j)
and gives it weight ``W_ij * f(s)``; what the neighbours do not take stays
with self. Older messages from the same neighbour are superseded, and every
message is mixed in at most once. A slow cross-datacenter link thereby still
helps: its messages count, but less the older they are.

Decay functions ``f`` (``--staleness``):

=================  ===========================================
``constant``       f(s) = 1 (plain asynchronous gossip)
``poly:A``         f(s) = (1 + s)^-A
``hinge:A,B``      f(s) = 1 for s <= B, else 1 / (A (s - B) + 1)
``exp:A``          f(s) = exp(-A s)
=================  ===========================================

The default, wherever a decay is not given (``Staleness()``, no ``--staleness``,
a link policy that turns ``async`` without one, a bare ``hinge``), is
``hinge:1,2``: full weight for messages up to 2 local steps old (even an
asynchronous neighbour on a fast link is about one step behind when its
message is mixed), then 1/(s - 1): slow links count less. A bare ``poly`` is
``poly:0.5`` and a bare ``exp`` is ``exp:0.1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gossip.core.message import Packet
from gossip.mixing.base import Inbox, MixingRule, MixReport
from gossip.mixing.gossip import weighted_sum_

__all__ = ["Staleness", "parse_staleness", "AsyncGossipRule", "DECAYS"]

DECAYS = ("constant", "poly", "hinge", "exp")


@dataclass(frozen=True)
class Staleness:
    """A staleness decay f(s) >= 0 with f(0) = 1; the default is ``hinge:1,2``."""

    kind: str = "hinge"
    a: float = 1.0
    b: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in DECAYS:
            raise ValueError(f"unknown staleness decay {self.kind!r}; valid: {', '.join(DECAYS)}")
        if not (math.isfinite(self.a) and self.a >= 0) or not (math.isfinite(self.b) and self.b >= 0):
            raise ValueError(f"staleness parameters must be finite and >= 0, got a={self.a}, b={self.b}")

    def __call__(self, s: float) -> float:
        if self.kind == "constant" or s <= 0:
            return 1.0
        if self.kind == "poly":
            return (1.0 + s) ** -self.a
        if self.kind == "hinge":
            return 1.0 if s <= self.b else 1.0 / (self.a * (s - self.b) + 1.0)
        return math.exp(-self.a * s)

    def __str__(self) -> str:
        if self.kind == "constant":
            return "constant"
        if self.kind == "hinge":
            return f"hinge:{self.a:g},{self.b:g}"
        return f"{self.kind}:{self.a:g}"


def parse_staleness(spec: str | Staleness | Callable[[float], float] | None) -> Any:
    """Parse ``constant``, ``poly:A``, ``hinge:A,B`` or ``exp:A`` (None: the default, ``hinge:1,2``).

    Staleness is measured in local steps; with a long ``period`` raise B.
    """
    if spec is None:
        return Staleness()
    if isinstance(spec, Staleness) or (callable(spec) and not isinstance(spec, str)):
        return spec
    kind, _, args = str(spec).strip().partition(":")
    try:
        nums = [float(a) for a in args.split(",")] if args else []
    except ValueError:
        raise ValueError(f"staleness {spec!r}: parameters must be numbers") from None
    wants = {"constant": 0, "poly": 1, "exp": 1, "hinge": 2}
    if kind not in wants:
        raise ValueError(f"unknown staleness decay {spec!r}; valid: constant, poly:A, hinge:A,B, exp:A")
    if len(nums) != wants[kind]:
        default = Staleness()
        defaults = {"poly": [0.5], "exp": [0.1], "hinge": [default.a, default.b], "constant": []}
        if nums:
            raise ValueError(f"staleness {spec!r}: {kind} takes {wants[kind]} parameter(s)")
        nums = defaults[kind]
    return Staleness(kind, *nums)


class AsyncGossipRule(MixingRule):
    """Asynchronous gossip weighted by staleness (see the module docstring)."""

    name = "async"
    synchronous = False

    def __init__(self, codec: Any = "none", staleness: Any = None) -> None:
        super().__init__(codec)
        self.decay = parse_staleness(staleness)
        self.superseded = 0  # messages replaced by a newer one from the same sender before use
        self.staleness_sum = 0.0
        self.staleness_count = 0

    def outgoing(self, x: torch.Tensor, topology: Any, me: int, rnd: int) -> list[tuple[int, Packet]]:
        self.round_weights(topology, me, rnd)
        if not self.receivers:
            return []
        packet = Packet(self.encode_state(x))  # the progress counter rides in the message header
        return [(j, packet) for j in self.receivers]

    def ready(self, inbox: Inbox, topology: Any, me: int, rnd: int) -> bool:
        return True  # never waits

    def mix(self, x: torch.Tensor, inbox: Inbox, topology: Any, me: int, rnd: int, progress: int) -> MixReport:
        weights = self.round_weights(topology, me, rnd)[0]
        report = MixReport()
        terms: list[tuple[float, torch.Tensor]] = []
        taken = 0.0
        stale_total = 0.0
        for j in sorted(inbox.senders()):
            msgs = inbox.take_all(j)
            w = weights.get(j)
            if w is None or j == me:
                report.late += len(msgs)  # no longer a neighbour (topology changed)
                continue
            newest = max(msgs, key=lambda m: (m.progress, m.seq))
            self.superseded += len(msgs) - 1
            s = max(0, progress - newest.progress)
            wj = w * self.decay(s)
            if wj <= 0:
                continue
            terms.append((wj, self.decode(newest, x)))
            taken += wj
            stale_total += s
        if terms:
            weighted_sum_(x, 1.0 - taken, terms)
            report.mixed = len(terms)
            report.staleness = stale_total / len(terms)
            self.staleness_sum += stale_total
            self.staleness_count += len(terms)
        return report

    def report(self) -> dict[str, Any]:
        mean = self.staleness_sum / self.staleness_count if self.staleness_count else 0.0
        return {"rule": self.name, "staleness": str(self.decay), "mean_staleness": mean, "superseded": self.superseded}
