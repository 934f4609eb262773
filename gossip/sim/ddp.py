"""The data-parallel reference: what DDP and Horovod compute, for comparisons.

n workers start from the same model; at every step each computes the gradient of
its own minibatch (its shard and batch stream, exactly as a gossip node of the
same run would draw them), the gradients are averaged exactly (an all-reduce),
and every worker applies the same optimizer step. The replicas stay identical, so
one model stands for all of them; the inner optimizer (AdamW, SGD with momentum)
sees the averaged gradient, which parameter averaging does not reproduce.

>>> r = ddp_reference(gossip.SimConfig(nodes=4, task="synthetic", steps=20))  # doctest: +SKIP
>>> r.summary["final_loss"]  # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from gossip.core.state import FlatState
from gossip.sim.config import SimConfig, torch_threads
from gossip.sim.record import SimulationResult
from gossip.training.node import init_model
from gossip.training.tasks import get_task

__all__ = ["ddp_reference", "allreduce_bytes"]


def allreduce_bytes(numel: int, nodes: int, itemsize: int = 4) -> float:
    """Bytes each worker sends per step in a ring all-reduce: 2 (n - 1) / n of the model."""
    return 2.0 * (nodes - 1) / nodes * numel * itemsize if nodes > 1 else 0.0


def ddp_reference(config: SimConfig, *, fused: bool = False) -> SimulationResult:
    """Train ``config.steps`` data-parallel steps of ``config.nodes`` workers.

    ``fused=True`` runs the workers' minibatches as one batch (one forward and
    backward): the same gradient when the task's loss is a mean over samples and
    the workers' batches have one size (checked each step), and much faster.

    Uses the config's task, split, seed, device and ``eval_every`` (the mixing
    options do not apply). The result has the simulator's shape: ``history`` (one
    record per evaluation: ``step``, ``loss``, ``accuracy``, ``bytes_sent``),
    ``summary`` (``final_loss``, ``final_accuracy``, ``bytes_sent``: what a ring
    all-reduce sends, summed over workers) and ``params`` (one tensor: every worker's).
    """
    cfg = config
    task = get_task(cfg.task)
    n = cfg.nodes
    wall = time.perf_counter()
    every = cfg.eval_every or max(1, cfg.steps // 20)
    with torch_threads(cfg.threads):
        model = init_model(task, cfg.seed, cfg.device)
        opt = task.optimizer(model.parameters())
        streams = [task.stream(i, n, cfg.split, cfg.seed, torch.device(cfg.device)) for i in range(n)]
        numel = FlatState(model).numel
        per_step = allreduce_bytes(numel, n) * n
        history: list[dict[str, Any]] = []

        def record(step: int, train: float) -> None:
            ev = task.evaluate(model, cfg.device)
            history.append({"event": "eval", "step": step, "loss": ev["loss"], "accuracy": ev.get("accuracy", math.nan),
                            "train_loss": train, "bytes_sent": per_step * step,
                            **({"perplexity": ev["perplexity"]} if "perplexity" in ev else {})})

        record(0, math.nan)
        train = math.nan
        for step in range(1, cfg.steps + 1):
            opt.zero_grad(set_to_none=True)
            batches = [stream.next() for stream in streams]
            if fused and _same_sizes(batches):
                loss = task.loss(model, tuple(torch.cat(parts) for parts in zip(*batches)))
                loss.backward()
                train = float(loss.detach())
            else:
                total = 0.0
                for batch in batches:
                    loss = task.loss(model, batch)
                    (loss / n).backward()  # the mean of the workers' gradients, as the all-reduce gives
                    total += float(loss.detach())
                train = total / n
            opt.step()
            if step % every == 0 or step == cfg.steps:
                record(step, train)
    last = history[-1]
    summary = {"nodes": n, "algorithm": "ddp", "steps": cfg.steps, "seed": cfg.seed,
               "final_loss": last["loss"], "final_accuracy": last["accuracy"], "train_loss": train,
               "bytes_sent": per_step * cfg.steps, "consensus_distance": 0.0,
               "wall_time_s": time.perf_counter() - wall}
    if "perplexity" in last:
        summary["final_perplexity"] = last["perplexity"]
    return SimulationResult(cfg, history, summary, [FlatState(model).snapshot().cpu()])


def _same_sizes(batches: list[Any]) -> bool:
    """Whether every batch is a tuple of tensors with one leading size, the same for all."""
    sizes = set()
    for b in batches:
        if not isinstance(b, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in b):
            return False
        sizes.update(t.shape[0] for t in b)
    return len(sizes) == 1
