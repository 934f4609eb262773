"""The simulator's batched engine: local steps of many nodes as one vectorised call.

In the per-node engine a simulated node runs its own forward, backward and
optimizer step, one small model at a time; for models this small the cost is
per-call dispatch, not arithmetic. The batched engine keeps every replica's
parameters as a row of one matrix (:class:`gossip.sim.replicas.ReplicaRows`) and
runs the steps that are due together as one ``torch.func.vmap`` of
``grad(functional_call(...))`` and one :class:`~gossip.sim.replicas.StackedOptimizer`
step over their rows.

The node program does not change. With ``node.stepper`` set,
:meth:`Node.local_step <gossip.training.node.Node.local_step>` only asks for its step
(:meth:`BatchedSteps.defer`) and yields ``Compute`` as before; the step runs at
the next :meth:`BatchedSteps.flush`, which the simulator calls before any asking
node is resumed (after its compute time), before it lets anyone observe the nodes,
and when it stops. Between asking and resuming nothing reads or writes a node's
parameters (arriving messages wait in its inbox), so a deferred step computes
exactly what the immediate one would have, only together with the others: the
two engines differ by float rounding (a batched matmul sums in another order).

A task opts in with ``batchable = True``: its ``loss(model, batch)`` is a pure
function of the parameters and the batch that ``torch.func`` can transform (no
random numbers, no in-place updates of buffers, no ``.item()``), and its
``stream`` yields tuples of tensors of one shape per node. :func:`batch_support`
checks the rest and says why a run cannot batch; ``engine="auto"`` then runs
the per-node engine.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Sequence

import torch
from torch import nn

from gossip.sim.replicas import ReplicaRows, StackedOptimizer, stacked_optimizer
from gossip.training.data import BatchStream, StackedDraws

__all__ = ["ENGINES", "parse_engine", "batch_support", "BatchedSteps", "choose_engine"]

log = logging.getLogger("gossip.batched")

#: ``auto`` runs in lockstep when :func:`gossip.sim.lockstep.lockstep_refusal` allows it,
#: else batches when :func:`batch_support` allows it, else runs per node.
ENGINES = ("auto", "lockstep", "batched", "per-node")


def parse_engine(engine: Any) -> str:
    """Validate an engine name: one of :data:`ENGINES`."""
    if not isinstance(engine, str) or engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; valid: {', '.join(ENGINES)}")
    return engine


class _Loss(nn.Module):
    """``task.loss(model, batch)`` as a module, so ``functional_call`` can swap in a row's parameters."""

    def __init__(self, task: Any, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.task = task

    def forward(self, batch: Any) -> torch.Tensor:
        return self.task.loss(self.model, batch)


def _shared_tensors(streams: Sequence[Any]) -> bool:
    """Whether every stream is a :class:`BatchStream` over the same tensors (one gather serves all)."""
    first = streams[0]
    return all(type(s) is BatchStream and len(s.tensors) == len(first.tensors)
               and all(a is b for a, b in zip(s.tensors, first.tensors)) and s.device == first.device
               for s in streams)


def batch_support(task: Any, nodes: Sequence[Any], measured: bool = False) -> str | None:
    """Why ``nodes`` cannot run their local steps batched, or None when they can.

    measured : the compute model times each node's own step (``measured``), which
        a batched step cannot give
    """
    name = getattr(task, "name", type(task).__name__)
    if not getattr(task, "batchable", False):
        return f"task {name!r} does not declare batchable = True"
    # the batched engine draws batches by index and computes the loss functionally:
    # a subclass that changes how batches or losses are made must say it still batches
    mro = type(task).__mro__
    declared = next((i for i, c in enumerate(mro) if "batchable" in vars(c)), len(mro))
    for method in ("stream", "loss"):
        defined = next((i for i, c in enumerate(mro) if method in vars(c)), len(mro))
        if defined < declared:
            return (f"task {name!r} overrides {method}() without declaring batchable itself "
                    f"({mro[declared].__name__} declared it)")
    if measured:
        return "the measured compute model times each node's own step"
    if not nodes:
        return "no nodes"
    first = nodes[0]
    for i, node in enumerate(nodes):
        if node.id != i or node.stream is None or node.optimizer is None:
            return "every node needs id i, a task stream and an optimizer"
        if "next" in vars(node.stream):  # a stream whose batches someone replaced: only next() gives them
            return f"node {i}'s stream has its own next(), which the batched engine would bypass"
        if node.fingerprint != first.fingerprint or node.device != first.device:
            return "the nodes' models differ"
    if any(not s.is_param for s in first.state.slots):
        return "the model has floating-point buffers (e.g. BatchNorm statistics), which a vectorised step cannot update"
    opt = stacked_optimizer(first.optimizer, first.state.slots, 1, first.numel, first.state.dtype, first.device)
    if isinstance(opt, str):
        return opt
    # one trial step on a copy of node 0's stream: the loss must vectorise
    try:
        batch = copy.deepcopy(first.stream).next()
        grad = torch.func.vmap(torch.func.grad_and_value(_functional_loss(task, first.model)), randomness="error")
        params = {f"model.{s.name}": first.state.flat[s.offset:s.offset + s.numel].view(1, *s.shape)
                  for s in first.state.slots}
        grad(params, _stack([batch]))
    except Exception as e:  # any failure here means: run per node
        return f"task {name!r}: its loss does not vectorise with torch.func ({type(e).__name__}: {e})"
    return None


def _functional_loss(task: Any, model: nn.Module) -> Any:
    wrapper = _Loss(task, copy.deepcopy(model))

    def loss(params: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
        return torch.func.functional_call(wrapper, params, (batch,))

    return loss


def _stack(batches: list[Any]) -> Any:
    """Per-node batches (tuples of tensors, or tensors) stacked along a new first dimension."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(batches)
    if isinstance(first, (tuple, list)):
        return tuple(torch.stack([b[j] for b in batches]) for j in range(len(first)))
    raise TypeError(f"a batchable task's stream must yield tensors or tuples of tensors, got {type(first).__name__}")


def _signature(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return tuple(batch.shape)
    return tuple(tuple(t.shape) for t in batch)


class BatchedSteps:
    """Runs the local steps of many simulated nodes together (see the module docstring).

    Parameters
    ----------
    task : the nodes' task (``batchable = True``)
    nodes : node i has id i; their parameters move onto the rows of one matrix
        (rows ordered by batch size, so the nodes of one batch size are one block)

    Raises ValueError, naming the reason, when :func:`batch_support` refuses.
    """

    def __init__(self, task: Any, nodes: Sequence[Any]) -> None:
        reason = batch_support(task, nodes)
        if reason is not None:
            raise ValueError(f"the batched engine cannot run this simulation: {reason}")
        self.task = task
        self.nodes = list(nodes)
        first = self.nodes[0]
        self.fast = _shared_tensors([n.stream for n in self.nodes])
        self.tensors = first.stream.tensors if self.fast else ()
        self.device = first.device
        size = (lambda n: n.stream.batch_size) if self.fast else (lambda n: 0)  # noqa: E731
        order = sorted(range(len(self.nodes)), key=lambda i: (size(self.nodes[i]), i))
        self.row_of = [0] * len(self.nodes)
        for r, i in enumerate(order):
            self.row_of[i] = r
        self.slots = [(f"model.{s.name}", s.offset, s.numel, tuple(s.shape)) for s in first.state.slots]
        self._grad = torch.func.vmap(torch.func.grad_and_value(_functional_loss(task, first.model)),
                                     randomness="error")
        self._eval_model = copy.deepcopy(first.model).eval()  # its parameters are swapped for the rows'
        self.rows = ReplicaRows([self.nodes[i].state for i in order])
        opt = stacked_optimizer(first.optimizer, first.state.slots, len(self.nodes), first.numel,
                                first.state.dtype, first.device)
        assert isinstance(opt, StackedOptimizer)
        self.optimizer = opt
        self.asked = [False] * len(self.nodes)  # node i has asked for a step not run yet
        self.pending: list[Any] = []
        self._groups_all: list[tuple[list[int], list[Any], StackedDraws]] | None = None  # step_nodes of everyone
        self._scratch: torch.Tensor | None = None  # [n, P], reused: the lockstep engine's mixing product
        self.flushes = 0
        self.steps = 0
        for node in self.nodes:
            node.stepper = self

    @property
    def matrix(self) -> torch.Tensor:
        """The ``[n, P]`` parameters; node i's are row ``row_of[i]``."""
        return self.rows.matrix

    def defer(self, node: Any) -> None:
        """``node`` asks for one local step (called by :meth:`Node.local_step`)."""
        self.asked[node.id] = True
        self.pending.append(node)

    def flush(self) -> None:
        """Run every step asked for so far, one vectorised call per batch shape."""
        pending = self.pending
        if not pending:
            return
        self.pending = []
        self.flushes += 1
        self.steps += len(pending)
        groups: dict[Any, list[tuple[int, Any, Any]]] = {}
        for node in pending:
            self.asked[node.id] = False
            if self.fast:
                draw = node.stream.next_indices()
                key: Any = draw.shape[0]
            else:
                draw = node.stream.next()
                key = _signature(draw)
            groups.setdefault(key, []).append((self.row_of[node.id], node, draw))
        results: list[tuple[list[Any], list[float]]] = []
        for members in groups.values():
            members.sort(key=lambda m: m[0])
            draws = [d for _, _, d in members]
            batch = self._gather(torch.stack(draws)) if self.fast else _stack(draws)
            results.append(([m[1] for m in members], self._run([m[0] for m in members], batch)))
        for nodes, values in results:
            self._count(nodes, values)

    def step_nodes(self, ids: Sequence[int]) -> None:
        """One local step of each node in ``ids`` now: what :meth:`defer` of each and a
        :meth:`flush` do, with the work per node vectorised where the streams allow
        (:class:`gossip.training.data.StackedDraws`). The lockstep engine steps this way."""
        if self.pending:
            self.flush()
        if not self.fast:
            for i in ids:
                self.defer(self.nodes[i])
            self.flush()
            return
        if len(ids) == 0:
            return
        self.flushes += 1
        self.steps += len(ids)
        if len(ids) == len(self.nodes):
            if self._groups_all is None:
                self._groups_all = self._groups(range(len(self.nodes)))
            groups = self._groups_all
        else:
            groups = self._groups(ids)
        results = [(nodes, self._run(rows, self._gather(draws.draw()))) for rows, nodes, draws in groups]
        for nodes, values in results:
            self._count(nodes, values)

    def _groups(self, ids: Any) -> list[tuple[list[int], list[Any], StackedDraws]]:
        """``ids`` by batch size: each group's rows in order, its nodes in that order, their draws."""
        by_size: dict[int, list[tuple[int, Any]]] = {}
        for i in ids:
            node = self.nodes[i]
            by_size.setdefault(node.stream.batch_size, []).append((self.row_of[i], node))
        out = []
        for members in by_size.values():
            members.sort(key=lambda m: m[0])
            nodes = [nd for _, nd in members]
            out.append(([r for r, _ in members], nodes, StackedDraws([nd.stream for nd in nodes])))
        return out

    def _gather(self, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t[idx].to(self.device, non_blocking=True) for t in self.tensors)

    def _count(self, nodes: list[Any], values: list[float]) -> None:
        for node, value in zip(nodes, values):
            if node.count_step(value):
                node.after_update()
            else:  # the NaN guard put the last good parameters back; the optimizer starts afresh
                self.optimizer.reset(self.row_of[node.id])

    def scratch(self, rows: int) -> torch.Tensor:
        """A ``[rows, P]`` work buffer of the matrix's dtype, kept between calls rather than
        allocated afresh each round (20 MB at 1024 digits nodes); its contents are not kept."""
        matrix = self.rows.matrix
        if self._scratch is None or self._scratch.shape[0] < rows:
            self._scratch = torch.empty(matrix.shape[0], matrix.shape[1], dtype=matrix.dtype, device=matrix.device)
        return self._scratch[:rows]

    def evaluate(self, nodes: Sequence[Any], block: int = 256) -> list[dict[str, float]] | None:
        """``task.evaluate`` of each of ``nodes``, computed for ``block`` rows at a time by
        the task's ``evaluate_stacked`` (None when the task has none: evaluate per node)."""
        stacked = getattr(self.task, "evaluate_stacked", None)
        if stacked is None:
            return None
        self.flush()
        matrix = self.rows.matrix
        model = self._eval_model
        out: list[dict[str, float]] = []
        for lo in range(0, len(nodes), block):
            rows = torch.tensor([self.row_of[n.id] for n in nodes[lo:lo + block]], device=matrix.device)
            x = matrix.index_select(0, rows)
            k = x.shape[0]
            params = {name[len("model."):]: x[:, off:off + numel].view(k, *shape)
                      for name, off, numel, shape in self.slots}

            def forward(inputs: torch.Tensor, params: dict[str, torch.Tensor] = params) -> torch.Tensor:
                call = lambda p: torch.func.functional_call(model, p, (inputs,))  # noqa: E731
                return torch.func.vmap(call)(params)

            out.extend(stacked(forward, self.device))
        return out

    def _run(self, rows: list[int], batch: Any) -> list[float]:
        """One vectorised step over ``rows`` (ascending), which share a batch shape; returns their losses."""
        matrix = self.rows.matrix
        k = len(rows)
        if rows[-1] - rows[0] + 1 == k:  # a block of rows: work on it in place
            sel: slice | torch.Tensor = slice(rows[0], rows[-1] + 1)
            x = matrix[sel]
        else:
            sel = torch.tensor(rows, device=matrix.device)
            x = matrix.index_select(0, sel)
        params = {name: x[:, off:off + numel].view(k, *shape) for name, off, numel, shape in self.slots}
        grads, losses = self._grad(params, batch)
        # the gradient of each parameter as its columns: the optimizer steps them in place, uncopied
        self.optimizer.step(x, [(off, grads[name].reshape(k, -1)) for name, off, *_ in self.slots], sel)
        if not isinstance(sel, slice):
            matrix.index_copy_(0, sel, x)
        return losses.tolist()


def choose_engine(engine: str, task: Any, nodes: Sequence[Any], measured: bool = False) -> tuple[BatchedSteps | None, str]:
    """The engine a simulation runs: ``(BatchedSteps or None for per-node, why)``.

    ``"batched"`` and ``"lockstep"`` (which steps through the batched engine) raise
    ValueError, with the reason, when the run cannot batch; ``"auto"`` then falls
    back to the per-node engine and says why. Whether a batched run goes on in
    lockstep is :func:`gossip.sim.lockstep.choose_lockstep`'s to say.
    """
    engine = parse_engine(engine)
    if engine == "per-node":
        return None, "per-node engine asked for"
    reason = batch_support(task, nodes, measured)
    if reason is None:
        return BatchedSteps(task, nodes), "batched"
    if engine in ("batched", "lockstep"):
        raise ValueError(f"engine {engine!r} cannot run this simulation: {reason} (use engine auto or per-node)")
    log.info("running the per-node engine: %s", reason)
    return None, reason
