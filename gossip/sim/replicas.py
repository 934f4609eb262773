"""Replicas as rows: many copies of one model as the rows of one ``[n, P]`` matrix.

The simulator's batched engine (:mod:`gossip.sim.batched`) keeps every node's
parameters as one row of :class:`ReplicaRows`. Each node's
:class:`~gossip.core.state.FlatState` is re-homed onto its row, so its model, its
mixing rules and the node program read and write that row exactly as they did
their own vector, while a local step of many nodes is one vectorised call and
one :class:`StackedOptimizer` step over their rows.

Optimizers. An update that is element-wise given the row's own state is the same
for a stack of rows as for one optimizer per replica: ``torch.optim.SGD`` (with
momentum, dampening, Nesterov, weight decay, maximize), ``Adam`` and ``AdamW``
(amsgrad too, bias correction counted per row, since rows step different numbers
of times). :func:`stacked_optimizer` recognises those and says why it refuses any
other: LBFGS (a line search over the whole vector), optimizers whose update
depends on a norm over a whole parameter tensor (LARS, LAMB) or on its matrix
shape (Adafactor, Shampoo, Muon), which on a stack would mix replicas, and any
element-wise one not written here (RMSprop, Adagrad ...). Those run on the
per-node engine. One difference remains by design: ``torch.optim`` skips a
parameter whose gradient is None (a parameter the loss never used), while a
vectorised gradient is zero there, so weight decay and momentum still move it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["ReplicaRows", "StackedOptimizer", "stacked_optimizer"]


class ReplicaRows:
    """The ``[n, P]`` matrix whose row ``r`` holds the parameters of replica ``r``.

    Parameters
    ----------
    states : the replicas' :class:`~gossip.core.state.FlatState` objects, all of one
        size, dtype and device; state ``r`` is moved onto row ``r`` (values kept)

    Examples
    --------
    >>> from torch import nn
    >>> from gossip.core.state import FlatState
    >>> states = [FlatState(nn.Linear(2, 1)) for _ in range(3)]
    >>> rows = ReplicaRows(states)
    >>> rows.matrix.shape
    torch.Size([3, 3])
    >>> rows.matrix[1].data_ptr() == states[1].flat.data_ptr()
    True
    """

    def __init__(self, states: Sequence[Any]) -> None:
        if not states:
            raise ValueError("ReplicaRows needs at least one replica")
        first = states[0].flat
        for s in states:
            if s.flat.shape != first.shape or s.flat.dtype != first.dtype or s.flat.device != first.device:
                raise ValueError("replicas as rows must all have the same parameter count, dtype and device")
        self.matrix = torch.empty(len(states), first.numel(), dtype=first.dtype, device=first.device)
        for r, s in enumerate(states):
            self.bind(r, s)

    def bind(self, row: int, state: Any) -> None:
        """Move ``state`` (a fresh replica, say a node that rejoined) onto ``row``, keeping its values."""
        state.rehome(into=self.matrix[row])

    def is_bound(self, row: int, state: Any) -> bool:
        """Whether ``state`` still lives on ``row`` (``FlatState.rehome`` elsewhere breaks it)."""
        return state.flat.data_ptr() == self.matrix[row].data_ptr()


@dataclass(frozen=True)
class _Hyper:
    """One parameter group's settings, as ``torch.optim`` names them."""

    lr: float
    weight_decay: float
    maximize: bool
    momentum: float = 0.0       # SGD
    dampening: float = 0.0
    nesterov: bool = False
    beta1: float = 0.9          # Adam, AdamW
    beta2: float = 0.999
    eps: float = 1e-8
    amsgrad: bool = False
    decoupled: bool = False     # AdamW's weight decay


def _float(v: Any) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


class StackedOptimizer:
    """One optimizer over the rows of a ``[n, P]`` matrix: each row steps as its own
    ``torch.optim`` optimizer would.

    kind : ``"sgd"`` or ``"adam"`` (AdamW is Adam with decoupled weight decay)
    groups : ``(columns, settings)`` pairs: which columns (a list of ``slice``) take
        which settings; columns in no group (frozen parameters) are not updated
    """

    def __init__(self, kind: str, n: int, numel: int, groups: list[tuple[list[slice], _Hyper]],
                 dtype: torch.dtype, device: torch.device) -> None:
        if kind not in ("sgd", "adam"):
            raise ValueError(f"kind must be 'sgd' or 'adam', got {kind!r}")
        self.kind = kind
        self.groups = groups
        # one group over every column (the usual case) runs on whole rows: fewer, larger kernels
        self._whole = len(groups) == 1 and groups[0][0] == [slice(0, numel)]
        zeros = lambda: torch.zeros(n, numel, dtype=dtype, device=device)  # noqa: E731
        if kind == "sgd":
            self.buf = zeros() if any(h.momentum for _, h in groups) else None
            self.started = torch.zeros(n, dtype=torch.bool, device=device)  # torch starts a momentum buffer at the gradient
        else:
            self.exp_avg, self.exp_avg_sq = zeros(), zeros()
            self.max_sq = zeros() if any(h.amsgrad for _, h in groups) else None
            self.steps = torch.zeros(n, dtype=torch.float64, device=device)  # per row: bias correction counts its own steps

    def reset(self, row: int) -> None:
        """Forget ``row``'s state, as a fresh optimizer (the NaN guard, a node that restarts)."""
        if self.kind == "sgd":
            self.started[row] = False
            if self.buf is not None:
                self.buf[row].zero_()
        else:
            self.steps[row] = 0
            self.exp_avg[row].zero_()
            self.exp_avg_sq[row].zero_()
            if self.max_sq is not None:
                self.max_sq[row].zero_()

    def step(self, x: torch.Tensor, grad: torch.Tensor | list[tuple[int, torch.Tensor]],
             rows: slice | torch.Tensor) -> None:
        """Update ``x`` (the ``[k, P]`` parameters of ``rows``) in place with ``grad``.

        grad : ``[k, P]``, or its columns in pieces ``(offset, [k, width])`` that cover
            them all (a vectorised step's gradient per parameter, not copied into one
            matrix first: the same element-wise update, a piece at a time)
        rows : a ``slice`` of the matrix's rows (the state is read in place) or a
            1-D index tensor (the state is gathered and written back)
        """
        if not isinstance(grad, torch.Tensor) and not self._whole:
            grad = torch.cat([g for _, g in sorted(grad, key=lambda p: p[0])], dim=1)
        pieces = None if isinstance(grad, torch.Tensor) else [(slice(o, o + g.shape[1]), g) for o, g in grad]
        contiguous = isinstance(rows, slice)
        names = ("buf",) if self.kind == "sgd" else ("exp_avg", "exp_avg_sq", "max_sq")
        full = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        state = {k: (t[rows] if contiguous else t.index_select(0, rows)) for k, t in full.items()}
        if self.kind == "sgd":
            fresh = ~self.started[rows]
            self.started[rows] = True
            extra: Any = fresh if bool(fresh.any()) else None
        else:
            self.steps[rows] += 1
            steps = self.steps[rows]
            lo, hi = float(steps.min()), float(steps.max())
            extra = lo if lo == hi else steps.unsqueeze(1)  # one count for all rows: torch's scalar arithmetic
        for cols, h in self.groups:
            cuts = pieces if pieces is not None else [(c, grad[:, c]) for c in ([slice(None)] if self._whole else cols)]
            for c, g in cuts:
                part = {k: t[:, c] for k, t in state.items()}
                if self.kind == "sgd":
                    _sgd(x[:, c], g, part.get("buf"), extra, h)
                else:
                    _adam(x[:, c], g, part["exp_avg"], part["exp_avg_sq"], part.get("max_sq"), extra, h)
        if not contiguous:
            for k, t in full.items():
                t.index_copy_(0, rows, state[k])


def _sgd(x: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None, fresh: torch.Tensor | None, h: _Hyper) -> None:
    """torch.optim.SGD's update (``_single_tensor_sgd``) on rows; ``fresh`` marks rows without a buffer yet."""
    if h.maximize:
        g = -g
    if h.weight_decay != 0:
        g = g.add(x, alpha=h.weight_decay)
    if h.momentum != 0:
        assert buf is not None
        buf.mul_(h.momentum).add_(g, alpha=1 - h.dampening)
        if fresh is not None:  # torch's first step: the buffer is the gradient itself
            buf[fresh] = g[fresh]
        g = g.add(buf, alpha=h.momentum) if h.nesterov else buf
    x.add_(g, alpha=-h.lr)


def _adam(x: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, vmax: torch.Tensor | None,
          step: float | torch.Tensor, h: _Hyper) -> None:
    """torch.optim.Adam's update (``_single_tensor_adam``) on rows; ``step`` is the step
    count of every row (a float) or of each row (a float64 ``[k, 1]`` tensor)."""
    if h.maximize:
        g = -g
    if h.weight_decay != 0:
        if h.decoupled:
            x.mul_(1 - h.lr * h.weight_decay)
        else:
            g = g.add(x, alpha=h.weight_decay)
    m.lerp_(g, 1 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    bc1 = 1 - h.beta1 ** step
    bc2_sqrt = (1 - h.beta2 ** step) ** 0.5
    if vmax is not None and h.amsgrad:
        torch.maximum(vmax, v, out=vmax)
        v = vmax
    if isinstance(step, float):
        denom = (v.sqrt() / bc2_sqrt).add_(h.eps)
        x.addcdiv_(m, denom, value=-(h.lr / bc1))
    else:
        denom = (v.sqrt() / bc2_sqrt.to(v.dtype)).add_(h.eps)
        x.sub_(m / denom * (h.lr / bc1).to(v.dtype))


def stacked_optimizer(optimizer: Any, slots: Sequence[Any], n: int, numel: int, dtype: torch.dtype,
                      device: torch.device) -> StackedOptimizer | str:
    """The :class:`StackedOptimizer` equivalent to ``optimizer`` (one replica's), or
    the reason there is none.

    slots : the replica's ``FlatState.slots`` (which columns hold which parameter)
    """
    kinds = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}
    kind = kinds.get(type(optimizer))
    if kind is None:
        return (f"optimizer {type(optimizer).__name__} has no stacked form (SGD, Adam and AdamW have one; "
                "see gossip.sim.replicas)")
    column = {}
    for s in slots:
        if s.is_param:
            column[id(getattr(s.module, s.attr))] = slice(s.offset, s.offset + s.numel)
    groups: list[tuple[list[slice], _Hyper]] = []
    for g in optimizer.param_groups:
        if g.get("differentiable") or g.get("capturable"):
            return "an optimizer with differentiable=True or capturable=True has no stacked form"
        cols = []
        for p in g["params"]:
            if id(p) not in column:
                return "the optimizer updates a tensor that is not part of the model's flat parameters"
            cols.append(column[id(p)])
        common = dict(lr=_float(g["lr"]), weight_decay=_float(g.get("weight_decay", 0.0)),
                      maximize=bool(g.get("maximize", False)))
        if kind == "sgd":
            h = _Hyper(**common, momentum=_float(g.get("momentum", 0.0)), dampening=_float(g.get("dampening", 0.0)),
                       nesterov=bool(g.get("nesterov", False)))
        else:
            b1, b2 = g["betas"]
            decoupled = type(optimizer) is torch.optim.AdamW or bool(g.get("decoupled_weight_decay", False))
            h = _Hyper(**common, beta1=_float(b1), beta2=_float(b2), eps=_float(g["eps"]),
                       amsgrad=bool(g.get("amsgrad", False)), decoupled=decoupled)
        for known_cols, known in groups:  # groups of equal settings merge: fewer kernels per step
            if known == h:
                known_cols.extend(cols)
                break
        else:
            groups.append((cols, h))
    for cols, _ in groups:  # adjacent parameters' columns join into one range
        cols.sort(key=lambda c: c.start)
        merged = cols[:1]
        for c in cols[1:]:
            if c.start == merged[-1].stop:
                merged[-1] = slice(merged[-1].start, c.stop)
            else:
                merged.append(c)
        cols[:] = merged
    return StackedOptimizer(kind, n, numel, groups, dtype, device)
