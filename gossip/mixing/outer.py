"""Outer optimizers (the DiLoCo family) over any mixing rule.

Node i trains H = ``period`` inner steps with its own optimizer (state that stays
local), then exchanges. With an outer optimizer the exchange becomes an outer
step. Notation, for one node i and one exchange:

* phi_i: the anchor, node i's parameters right after its previous exchange
  (DiLoCo's "outer" or "global" parameters);
* theta_i: its parameters after the H inner steps; Delta_i = phi_i - theta_i is
  its own pseudo-gradient;
* the mixing rule mixes the parameters as it always does (D-PSGD, CHOCO,
  asynchronous, push-sum, over any topology): theta~_i = sum_j W_ij theta_j;
* the pseudo-gradient of the mixed parameters, g_i = phi_i - theta~_i, goes to the
  outer optimizer, momentum b_i (zero at the start)::

      sgd:lr=L,momentum=M       b_i <- M b_i + g_i;   phi_i <- phi_i - L b_i
      nesterov:lr=L,momentum=M  b_i <- M b_i + g_i;   phi_i <- phi_i - L (g_i + M b_i)
      noloco:lr=L,momentum=M    as sgd (see below), with NoLoCo's defaults

  and the node goes on from theta_i <- phi_i.

What travels is what the mixing rule sends today: the parameters (one vector, the
same bytes); a lossy codec under CHOCO sends C(theta_i - theta^_i), theta^_i being the
public copy, which right after an exchange is about the anchor: so what travels is
about the compressed pseudo-gradient, and what the codec drops stays in
theta_i - theta^_i and is sent later (error feedback by construction). Where CHOCO's
copies cannot follow the outer step (top-k under Nesterov), ``exchange=pseudograd``
mixes the compressed pseudo-gradients themselves, with a residual of their own, and
steps on that mix (:mod:`gossip.mixing.pseudograd`; exact averaging only);
``fragments=F`` exchanges one of F parameter fragments per round
(:mod:`gossip.mixing.fragments`). Both are built by
:func:`gossip.mixing.settings.build_rules`, not by :class:`OuterRule`.

Why the average follows the outer optimizer. W is doubly stochastic (sync and
asynchronous gossip, CHOCO), so the mean over nodes of theta~_i is the mean of
theta_i, and the mean of g_i is mean(phi) - mean(theta) = mean(Delta): the mean
anchor and the mean momentum evolve exactly as the outer optimizer applied to the
mean pseudo-gradient, DiLoCo's update. On a complete graph with exact averaging,
theta~_i is the same for every node, so anchors and momenta stay identical: DiLoCo
itself (its all-reduce of Delta_i, then Nesterov). ``sgd:lr=1`` (the default) gives
phi_i = theta~_i: plain gossip, and no wrapper is built at all. Mixing contracts
the anchors' disagreement like the parameters' (with lr=0.7, momentum=0.9 the factor
on phi_i - mean(phi) from the outer step is |1 - 0.7 x 1.9| = 0.33).

NoLoCo (Kolehmainen et al., 2025) mixes each replica with one random peer and
uses delta_i <- a delta_i - b mean_G(Delta) - c (phi_i - mean_G(phi)),
phi_i <- phi_i + delta_i over the pair G. With c = b, as in the authors' code, the
two terms add up to -b (phi_i - mean_G(theta)) = -b g_i: heavy-ball momentum on the
pseudo-gradient of the mixed parameters, which needs no anchors from the peer.
That is ``noloco`` (= ``sgd`` with momentum; defaults lr=0.7, momentum=0.5);
pair it with ``--topology one-peer-exponential`` for one peer per round.

Push-sum moves mass: the average it keeps is mass-weighted, and an outer state
(anchor, momentum) does not travel with the mass. The average follows the outer
optimizer exactly only where the masses stay 1, on graphs whose push-sum shares are
also row-stochastic (every node as many in- as out-neighbours: ring, torus,
exponential, one-peer-exponential, complete); other graphs are refused.

Overlap (``--overlap``): a round's messages are mixed one exchange later, while
the next H inner steps have run from the unmixed theta_i. The outer step then
uses theta~_i = sent_i + (the rule's correction) and moves the current parameters
by phi_i(new) - theta~_i, keeping the inner steps made since (a one-round-delayed
outer step, like Streaming / one-step-delayed DiLoCo).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["OuterSpec", "parse_outer", "OuterRule", "OUTER_KINDS", "EXCHANGES", "check_outer_pairing", "outer_step_", "MomentumHandover"]

#: kind: (default lr, default momentum)
OUTER_KINDS = {"sgd": (1.0, 0.0), "nesterov": (0.7, 0.9), "noloco": (0.7, 0.5)}
#: what the outer step exchanges: the parameters (mixed by the rule, CHOCO for a lossy codec) or
#: the compressed pseudo-gradients with error feedback (SparseLoCo; see gossip.mixing.pseudograd)
EXCHANGES = ("params", "pseudograd")
_FORMS = ("sgd:lr=L[,momentum=M], nesterov:lr=L,momentum=M, noloco:lr=L,momentum=M (L in (0, 2], M in [0, 1)), "
          "each optionally with ,exchange=params|pseudograd and ,fragments=F (an integer >= 1)")


@dataclass(frozen=True)
class OuterSpec:
    """An outer optimizer: ``kind`` (sgd, nesterov, noloco), learning rate, momentum (None:
    the kind's defaults, :data:`OUTER_KINDS`, written there only).

    exchange : ``params`` (the rule mixes the parameters) or ``pseudograd`` (compressed
        pseudo-gradients with error feedback are mixed; :mod:`gossip.mixing.pseudograd`)
    fragments : the exchange covers one of this many parameter fragments per round, in
        turn (Streaming DiLoCo; :mod:`gossip.mixing.fragments`)
    """

    kind: str = "sgd"
    lr: float | None = None
    momentum: float | None = None
    exchange: str = "params"
    fragments: int = 1

    def __post_init__(self) -> None:
        if self.kind not in OUTER_KINDS:
            raise ValueError(f"outer: unknown optimizer {self.kind!r}; valid: {_FORMS}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"outer: exchange must be one of {', '.join(EXCHANGES)}, got {self.exchange!r}; "
                             f"valid: {_FORMS}")
        f = self.fragments
        if isinstance(f, float) and f.is_integer():
            f = int(f)
        if isinstance(f, bool) or not isinstance(f, int) or f < 1:
            raise ValueError(f"outer: fragments must be an integer >= 1, got {self.fragments!r}; valid: {_FORMS}")
        object.__setattr__(self, "fragments", f)
        lr, momentum = OUTER_KINDS[self.kind]
        if self.lr is None:
            object.__setattr__(self, "lr", lr)
        if self.momentum is None:
            object.__setattr__(self, "momentum", momentum)
        for name, lo, hi, closed in (("lr", 0.0, 2.0, True), ("momentum", 0.0, 1.0, False)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"outer: {name} must be a number, got {v!r}; valid: {_FORMS}")
            ok = (lo < v <= hi) if name == "lr" else (lo <= v < hi)
            if not ok:
                rng = "(0, 2]" if name == "lr" else "[0, 1)"
                raise ValueError(f"outer: {self.kind} {name}={v:g} is out of range {rng}; valid: {_FORMS}")
            object.__setattr__(self, name, float(v))

    @property
    def is_identity(self) -> bool:
        """Plain gossip: ``phi <- theta~`` (sgd, lr 1, no momentum)."""
        return (self.lr == 1.0 and self.momentum == 0.0 and self.kind != "nesterov"
                and self.exchange == "params" and self.fragments == 1)

    @property
    def nesterov(self) -> bool:
        return self.kind == "nesterov"

    def __str__(self) -> str:
        text = f"{self.kind}:lr={self.lr:g},momentum={self.momentum:g}"
        if self.exchange != "params":
            text += f",exchange={self.exchange}"
        if self.fragments != 1:
            text += f",fragments={self.fragments}"
        return text


def parse_outer(spec: Any) -> OuterSpec:
    """``sgd:lr=1`` (default), ``nesterov:lr=0.7,momentum=0.9``, ``noloco[:lr=..,momentum=..]``;
    an :class:`OuterSpec` or None (the default) pass through."""
    if spec is None:
        return OuterSpec()
    if isinstance(spec, OuterSpec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"outer must be a spec such as 'nesterov:lr=0.7,momentum=0.9', got {spec!r}")
    kind, _, rest = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in OUTER_KINDS:
        raise ValueError(f"outer: unknown optimizer {kind!r} in {spec!r}; valid: {_FORMS}")
    values: dict[str, Any] = {"lr": None, "momentum": None, "exchange": "params", "fragments": 1}
    for item in filter(None, (i.strip() for i in rest.split(","))):
        key, eq, text = item.partition("=")
        key, text = key.strip(), text.strip()
        if not eq or key not in values:
            raise ValueError(f"outer {spec!r}: bad option {item!r}; valid: {_FORMS}")
        if key == "exchange":
            values[key] = text.lower()
            continue
        try:
            values[key] = int(text) if key == "fragments" else float(text)
        except ValueError:
            kind_of = "an integer" if key == "fragments" else "a number"
            raise ValueError(f"outer {spec!r}: {key} must be {kind_of}, got {text!r}; "
                             f"valid: {_FORMS}") from None
    return OuterSpec(kind, values["lr"], values["momentum"], values["exchange"], values["fragments"])


def outer_step_(spec: OuterSpec, anchor: torch.Tensor, momentum: torch.Tensor | None,
                g: torch.Tensor) -> torch.Tensor | None:
    """In place: the outer optimizer's step on ``anchor`` (phi) for the pseudo-gradient ``g``
    (consumed: it may be overwritten); returns the momentum buffer (b, created when needed)."""
    if spec.momentum > 0.0:
        if momentum is None:
            momentum = torch.zeros_like(g)
        b = momentum.mul_(spec.momentum).add_(g)
        update = g.add_(b, alpha=spec.momentum) if spec.nesterov else b
    else:
        update = g
    anchor.sub_(update, alpha=spec.lr)
    return momentum


def check_outer_pairing(spec: OuterSpec, algorithm: str, topology: Any = None) -> None:
    """Refuse an outer optimizer with push-sum on a graph whose push-sum masses drift
    (see the module docstring); ``topology`` None: checked when one is given."""
    if spec.is_identity or algorithm != "push-sum" or topology is None:
        return
    n = topology.n
    for r in range(max(1, getattr(topology, "period", 1))):
        inflow = [0.0] * n
        for i in range(n):
            for j, share in topology.push_sum_out_weights(i, r).items():
                inflow[j] += share
        if any(abs(v - 1.0) > 1e-9 for v in inflow):
            raise ValueError(f"outer {spec} with push-sum needs a graph whose push-sum masses stay 1 (every node "
                             f"as many in- as out-neighbours: ring, exponential, one-peer-exponential, complete); "
                             f"{getattr(topology, 'spec', 'this one')!r} is not; use gossip, or --outer sgd:lr=1")


class MomentumHandover:
    """A joiner takes the outer momentum with the parameters (its anchor is what it
    adopts; anything else of the outer state, such as a residual, starts afresh)."""

    momentum: torch.Tensor | None

    def outer_state(self) -> dict[str, Any]:
        return {"momentum": None if self.momentum is None else self.momentum.detach().cpu().clone()}

    def load_outer_state(self, state: dict[str, Any]) -> None:
        m = state.get("momentum")
        self.momentum = None if m is None else m.clone()


class OuterRule(MomentumHandover):
    """A mixing rule with an outer optimizer on top (see the module docstring).

    Wraps ``inner`` (any mixing rule): sends what it sends, mixes as it mixes,
    then takes the outer step. Everything else (readiness, reports, counters)
    is the inner rule's. The node only tells it, by exchanging, that a period ended.
    """

    def __init__(self, inner: Any, spec: OuterSpec) -> None:
        self.inner = inner
        self.spec = spec
        self.anchor: torch.Tensor | None = None    # phi_i
        self.momentum: torch.Tensor | None = None  # b_i (created at the first step that needs it)
        self._sent: dict[int, torch.Tensor] = {}   # overlap: theta_i as sent, per round not mixed yet
        self.outer_steps = 0

    # what is not the outer optimizer's own is the inner rule's: the node reads and sets
    # (overlap, sends_live, a push-sum weight) the rule's attributes through the wrapper
    _OWN = frozenset({"inner", "spec", "anchor", "momentum", "_sent", "outer_steps"})

    def __getattr__(self, name: str) -> Any:  # synchronous, ready, round_weights, clipped, neighbor_models ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in OuterRule._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def on_adopt(self, x: torch.Tensor) -> None:
        """The node's parameters were replaced (start, a neighbour's state): they are the anchor now."""
        self.anchor = x.detach().clone()
        self.momentum = None
        self._sent.clear()
        self.inner.on_adopt(x)

    def _on(self, x: torch.Tensor) -> torch.Tensor:
        if self.anchor is None or self.anchor.shape != x.shape:
            self.on_adopt(x)
        elif self.anchor.device != x.device or self.anchor.dtype != x.dtype:  # restored from a CPU checkpoint
            self.anchor = self.anchor.to(device=x.device, dtype=x.dtype)
            if self.momentum is not None:
                self.momentum = self.momentum.to(device=x.device, dtype=x.dtype)
        assert self.anchor is not None
        return self.anchor

    def outgoing(self, x: torch.Tensor, topology: Any, me: int, rnd: int) -> list:
        self._on(x)
        if self.inner.overlap:
            self._sent[rnd] = x.detach().clone()
        return self.inner.outgoing(x, topology, me, rnd)

    def mix(self, x: torch.Tensor, inbox: Any, topology: Any, me: int, rnd: int, progress: int) -> Any:
        anchor = self._on(x)
        sent = self._sent.pop(rnd, None) if self.inner.overlap else None
        before = x.clone() if sent is not None else None
        report = self.inner.mix(x, inbox, topology, me, rnd, progress)
        if sent is None:
            mixed = x
        else:  # theta~_i: what we sent plus the rule's correction
            mixed = sent.add_(x).sub_(before)
            del before
        g = anchor - mixed  # the pseudo-gradient of the mixed parameters
        self.momentum = outer_step_(self.spec, anchor, self.momentum, g)
        if sent is None:
            x.copy_(anchor)
        else:
            x.add_(anchor).sub_(mixed)  # keep the inner steps made since the round was sent
        self.outer_steps += 1
        return report

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "outer": str(self.spec),
                "anchor": None if self.anchor is None else self.anchor.detach().cpu().clone(),
                "momentum": None if self.momentum is None else self.momentum.detach().cpu().clone(),
                "outer_steps": self.outer_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "inner" not in state:  # a checkpoint from a run without an outer optimizer
            self.inner.load_state_dict(state)
            return
        self.inner.load_state_dict(state["inner"] or {})
        if state.get("anchor") is not None:
            self.anchor = state["anchor"].clone()
        self.momentum = state["momentum"].clone() if state.get("momentum") is not None else None
        self.outer_steps = int(state.get("outer_steps", 0))

    def report(self) -> dict[str, Any]:
        return {**self.inner.report(), "outer": str(self.spec), "outer_steps": self.outer_steps}
