"""Compressed pseudo-gradients with error feedback, mixed, then one outer step (SparseLoCo).

``--outer SPEC,exchange=pseudograd``. Node i, at the end of a period of H inner steps
(phi_i its anchor, theta_i its parameters, Delta_i = phi_i - theta_i, e_i its residual,
zero at the start, C the codec and D its decoder)::

    v_i = Delta_i + e_i;   q_i = C(v_i);   e_i <- v_i - D(q_i)        (error feedback)
    send q_i to the out-neighbours
    g_i = sum_j W_ij D(q_j)                                           (the mix of what was sent)
    phi_i <- outer step on g_i;   theta_i <- phi_i

What one round's codec drops stays in e_i and goes out with a later round, so over
rounds the sum of what was sent plus the residual is the sum of the pseudo-gradients
(exactly: ``sum_t D(q_i^t) + e_i^T = sum_t Delta_i^t``). The outer momentum acts on the
decoded, mixed pseudo-gradients, after compression, so a codec only ever has to carry
H inner steps' worth of motion, never the up to 1/(1-M) times larger outer step that
defeats CHOCO's consensus step (docs/OUTER.md).

Exact averaging only. With W_ij = 1/n for every pair (a complete graph, synchronous)
every node mixes the same g and the anchors, started equal, stay equal: this is DiLoCo
with compressed pseudo-gradients (SparseLoCo; with the identity codec, DiLoCo itself).
On a sparse graph each node mixes a different g_i; the mean anchor still follows the
outer step on the mean of the D(q_j), but the disagreement phi_i - mean(phi) gains
sum_j (W_ij - 1/n) D(q_j) (scaled by the outer step) every round and nothing ever
takes it away: the anchors random-walk apart. Keeping them together needs a consensus
term on the anchors, which needs the neighbours' anchors, a second vector per exchange
(and, compressed, exactly the CHOCO tracking that fails under an outer momentum). So
sparse graphs are refused (:func:`check_pseudograd`); use ``exchange=params`` there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gossip.compression import Codec, get_codec
from gossip.core.message import Packet
from gossip.mixing.base import Inbox, MixingRule, MixReport, take_round_messages
from gossip.mixing.gossip import weighted_sum_
from gossip.mixing.outer import MomentumHandover, OuterSpec, outer_step_

__all__ = ["PseudoGradientRule", "check_pseudograd", "exact_averaging"]


def exact_averaging(topology: Any) -> bool:
    """Whether every node of ``topology`` mixes every node with weight 1/n in every round."""
    n = topology.n
    for r in range(max(1, int(getattr(topology, "period", 1) or 1))):
        for i in range(n):
            w = topology.in_weights(i, r)
            if len(w) != n or any(abs(v - 1.0 / n) > 1e-9 for v in w.values()):
                return False
    return True


def check_pseudograd(spec: OuterSpec, *, algorithm: str, asynchronous: bool, gamma: Any, clip: Any,
                     topology: Any = None) -> None:
    """Refuse ``exchange=pseudograd`` where it is not correct (see the module docstring);
    ``topology`` None: the graph is checked when one is given."""
    forms = "valid: exchange=pseudograd with algorithm gossip, synchronous, on a complete graph; else exchange=params"
    if algorithm != "gossip":
        raise ValueError(f"outer {spec}: exchange=pseudograd replaces the mixing rule, so algorithm must be gossip, "
                         f"got {algorithm!r}; {forms}")
    if asynchronous:
        raise ValueError(f"outer {spec}: exchange=pseudograd needs every node to mix the same pseudo-gradients, "
                         f"which asynchronous mixing does not; {forms}")
    if gamma is not None or clip is not None:
        raise ValueError(f"outer {spec}: exchange=pseudograd takes no {'gamma' if gamma is not None else 'clip'} "
                         f"(no consensus step, no robust mixing); {forms}")
    if topology is not None and not exact_averaging(topology):
        raise ValueError(f"outer {spec}: exchange=pseudograd needs exact averaging (every node mixes every node "
                         f"with weight 1/n: topology complete); on {getattr(topology, 'spec', 'this graph')!r} the "
                         f"anchors would drift apart with nothing to pull them together; {forms}")


class PseudoGradientRule(MomentumHandover, MixingRule):
    """Send ``C(Delta_i + e_i)``, keep the residual, mix the decoded pseudo-gradients, take
    the outer step (see the module docstring).

    State: ``anchor`` (phi_i), ``momentum`` (b_i), ``residual`` (e_i), all checkpointed;
    """

    name = "pseudograd"
    synchronous = True

    def __init__(self, codec: Codec | str, spec: OuterSpec) -> None:
        super().__init__(get_codec(codec) if isinstance(codec, str) else codec)
        self.spec = spec
        self.anchor: torch.Tensor | None = None
        self.momentum: torch.Tensor | None = None
        self.residual: torch.Tensor | None = None
        self._own: dict[int, torch.Tensor] = {}    # D(q_i) of each round not mixed yet
        self._sent: dict[int, torch.Tensor] = {}   # overlap: theta_i as it was when the round was sent
        self.outer_steps = 0

    def on_adopt(self, x: torch.Tensor) -> None:
        self.anchor = x.detach().clone()
        self.momentum = None
        self.residual = None
        self._own.clear()
        self._sent.clear()

    def _on(self, x: torch.Tensor) -> torch.Tensor:
        if self.anchor is None or self.anchor.shape != x.shape:
            self.on_adopt(x)
        elif self.anchor.device != x.device or self.anchor.dtype != x.dtype:  # restored from a CPU checkpoint
            move = {"device": x.device, "dtype": x.dtype}
            self.anchor = self.anchor.to(**move)
            self.momentum = None if self.momentum is None else self.momentum.to(**move)
            self.residual = None if self.residual is None else self.residual.to(**move)
        assert self.anchor is not None
        return self.anchor

    def outgoing(self, x: torch.Tensor, topology: Any, me: int, rnd: int) -> list[tuple[int, Packet]]:
        anchor = self._on(x)
        self.round_weights(topology, me, rnd)
        v = anchor - x  # Delta_i, a fresh tensor: the codec may keep a view of it
        if self.residual is not None:
            v.add_(self.residual)
        enc = self.codec.encode(v)
        if enc.source is not None and enc.source.data_ptr() == v.data_ptr():
            sent = v  # a zero-copy codec (identity): D(C(v)) is v, nothing left over
            self.residual = None
        else:
            sent = self.codec.decode(enc, device=x.device)
            sent = sent if sent.dtype == x.dtype else sent.to(x.dtype)
            self.residual = v.sub_(sent)  # e_i <- v - D(q_i)
            enc = dataclasses.replace(enc, source=sent)  # in-process receivers read the decoded values
        self._own[rnd] = sent
        if self.overlap:
            self._sent[rnd] = x.detach().clone()
        if not self.receivers:
            return []
        packet = Packet(enc)
        return [(j, packet) for j in self.receivers]

    def mix(self, x: torch.Tensor, inbox: Inbox, topology: Any, me: int, rnd: int, progress: int) -> MixReport:
        anchor = self._on(x)
        weights = self.round_weights(topology, me, rnd)[0]
        report = MixReport()
        own = self._own.pop(rnd, None)
        if own is None:  # nothing sent this round (a node that adopted a state since): no step
            return report
        self_w, received = take_round_messages(inbox, weights, me, rnd, report)
        terms = [(w, self.decode_pieces(msg, x)) for w, msg in received]
        report.mixed = len(terms)
        g = weighted_sum_(own.clone(), self_w, terms)  # sum_j W_ij D(q_j)
        theta_sent = self._sent.pop(rnd, None) if self.overlap else None
        self.momentum = outer_step_(self.spec, anchor, self.momentum, g)
        if theta_sent is None:
            x.copy_(anchor)
        else:  # the inner steps made since the round was sent are kept: x += phi(new) - theta_sent
            x.add_(anchor).sub_(theta_sent)
        self.outer_steps += 1
        return report

    def neighbor_models(self) -> dict[int, torch.Tensor]:
        """None: what neighbours send are pseudo-gradients, not models (no distance to measure)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        cpu = (lambda t: None if t is None else t.detach().cpu().clone())
        return {"outer": str(self.spec), "anchor": cpu(self.anchor), "momentum": cpu(self.momentum),
                "residual": cpu(self.residual), "outer_steps": self.outer_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        clone = (lambda t: None if t is None else t.clone())
        if state.get("anchor") is not None:
            self.anchor = state["anchor"].clone()
        self.momentum = clone(state.get("momentum"))
        self.residual = clone(state.get("residual"))
        self.outer_steps = int(state.get("outer_steps", 0))

    def report(self) -> dict[str, Any]:
        return {"rule": self.name, "outer": str(self.spec), "outer_steps": self.outer_steps,
                "codec": self.codec.spec}
