"""What a simulated run records: evaluation points, the summary, the result."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from gossip.core.progress import ProgressBar
from gossip.core.state import FlatState
from gossip.mixing.adversary import parse_byzantine
from gossip.sim.config import SimConfig
from gossip.sim.engine import Simulator
from gossip.training.data import parse_split
from gossip.training.node import Node, init_model
from gossip.transport.links import SimNetwork

__all__ = ["SimulationResult", "Recorder", "summarize", "average_params", "consensus_distance", "open_out"]


@dataclass
class SimulationResult:
    """What a simulation produced.

    history : one record per evaluation point (time, mean step, losses,
        consensus distance, accuracies, bytes)
    summary : the final figures (what ``gossip-sim --json`` prints)
    params : final flat parameters of each node (a list of CPU tensors; with faults, of
        each node's last life: a node that crashed for good holds its parameters then)
    """

    config: SimConfig
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    params: list[torch.Tensor] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        summary = self.__dict__.get("summary", {})
        if name in summary:
            return summary[name]
        raise AttributeError(name)


_BLOCK = 256  # nodes stacked at a time: a copy of every replica at once would cost more than the replicas


def average_params(flats: list[torch.Tensor]) -> torch.Tensor:
    """The exact average x_bar of the nodes' parameters."""
    if len(flats) <= _BLOCK:
        return torch.stack([f.detach() for f in flats]).mean(0)
    total = torch.zeros_like(flats[0], dtype=torch.float64)
    for lo in range(0, len(flats), _BLOCK):
        total += torch.stack([f.detach() for f in flats[lo:lo + _BLOCK]]).sum(0, dtype=torch.float64)
    return (total / len(flats)).to(flats[0].dtype)


def consensus_distance(flats: list[torch.Tensor]) -> float:
    """(1/n) sum_i ||x_i - x_bar||^2, computed in float64."""
    if len(flats) <= _BLOCK:
        X = torch.stack([f.detach().double() for f in flats])
        return float(((X - X.mean(0)) ** 2).sum(1).mean())
    mean = torch.zeros_like(flats[0], dtype=torch.float64)
    for lo in range(0, len(flats), _BLOCK):
        mean += torch.stack([f.detach() for f in flats[lo:lo + _BLOCK]]).sum(0, dtype=torch.float64)
    mean /= len(flats)
    total = 0.0
    for lo in range(0, len(flats), _BLOCK):
        X = torch.stack([f.detach() for f in flats[lo:lo + _BLOCK]]).double()
        total += float(((X - mean) ** 2).sum())
    return total / len(flats)


class Recorder:
    """Samples a run every ``every`` mean local steps: the history records.

    Both engines use it: :class:`Simulation` (``sample``, from the simulator's
    ``on_step``) and the fault runs of :mod:`gossip.sim.fault_runs` (``record`` with the
    nodes of the processes that are up)."""

    def __init__(self, cfg: SimConfig, task: Any, network: SimNetwork, out: IO[str] | None,
                 bar: ProgressBar, wall_start: float) -> None:
        self.cfg, self.task, self.network, self.out, self.bar = cfg, task, network, out, bar
        self.n = cfg.nodes
        self.every = cfg.eval_every or max(1, cfg.steps // 20)
        self.history: list[dict[str, Any]] = []
        self.wall_start = wall_start
        self.scratch = init_model(task, cfg.seed, cfg.device)
        self.scratch_state = FlatState(self.scratch)
        self.last_sample = -1
        self.bad = parse_byzantine(cfg.byzantine, cfg.nodes)  # honest figures only

    def honest(self, nodes: list[Node]) -> list[Node]:
        """The nodes that count: byzantine ones are out."""
        return [n for i, n in enumerate(nodes) if i not in self.bad] or nodes

    def record(self, now: float, mean_step: float, live: list[Node], bytes_sent: int,
               batched: Any = None) -> dict[str, Any]:
        """The record of one evaluation point over the nodes ``live`` (written to ``out``)."""
        self.scratch_state.load_(average_params([n.state.flat for n in live]))
        avg = self.task.evaluate(self.scratch, self.cfg.device)
        # the batched engine evaluates every row in a few vectorised calls
        per_node = (batched.evaluate(live) if batched is not None else None) \
            or [self.task.evaluate(n.model, self.cfg.device) for n in live]
        train = [n.pop_mean_loss() for n in live]
        train = [x for x in train if not math.isnan(x)]
        rec = {
            "event": "eval",
            "time": now,
            "step": mean_step,
            "train_loss": sum(train) / len(train) if train else math.nan,
            "loss": avg["loss"],
            "accuracy": avg.get("accuracy", math.nan),
            "mean_node_loss": sum(p["loss"] for p in per_node) / len(per_node),
            "mean_node_accuracy": sum(p.get("accuracy", math.nan) for p in per_node) / len(per_node),
            "consensus_distance": consensus_distance([n.state.flat for n in live]),
            "nodes_up": len(live),
            "bytes_sent": bytes_sent,
            **{f"bytes_{cls}": b for cls, b in sorted(self.network.bytes_by_class.items())},
            "wall": time.perf_counter() - self.wall_start,
        }
        for k in ("perplexity",):
            if k in avg:
                rec[k] = avg[k]
        self.history.append(rec)
        if self.out is not None:
            self.out.write(json.dumps(rec) + "\n")
        return rec

    def sample(self, sim: Simulator) -> dict[str, Any]:
        return self.record(sim.now, sim.steps_done / self.n, self.honest(sim.nodes), sum(sim.bytes_sent),
                           getattr(sim, "batched", None))

    def progress(self, step: float, now: float, rec: dict[str, Any] | None = None) -> None:
        """Draw the progress bar at mean step ``step`` (with the accuracy of a record just taken)."""
        if rec is not None:
            self.bar.update(step, f"step {rec['step']:.0f}/{self.cfg.steps} sim {now:.2f}s "
                            f"acc {rec['accuracy']:.3f}", force=True)
        elif self.bar.enabled:
            self.bar.update(step, f"step {step:.0f}/{self.cfg.steps} sim {now:.2f}s")

    def on_step(self, sim: Simulator) -> None:
        done = sim.steps_done
        if done % (self.every * self.n) == 0:
            if done != self.last_sample:
                self.last_sample = done
                self.progress(done / self.n, sim.now, self.sample(sim))
        else:
            self.progress(done / self.n, sim.now)


def summarize(cfg: SimConfig, topology: str, last: dict[str, Any], nodes: list[Node], network: SimNetwork,
              bytes_sent: int, **figures: Any) -> dict[str, Any]:
    """The summary of a run (what ``gossip-sim --json`` prints): the config, the last
    record ``last``, the mixing figures of ``nodes``, and ``figures`` (faults, engine,
    engine_note, sim_time_s, wall_time_s, ...) in that order."""
    summary = {
        "nodes": cfg.nodes,
        "topology": topology,
        "algorithm": cfg.algorithm,
        "compression": cfg.compression,
        "period": cfg.period,
        "asynchronous": cfg.asynchronous,
        "overlap": cfg.overlap,
        "outer": str(cfg.mixing.outer),
        "task": cfg.task if isinstance(cfg.task, str) else type(cfg.task).__name__,
        "split": str(parse_split(cfg.split)),
        "steps": cfg.steps,
        "seed": cfg.seed,
        "final_accuracy": last["accuracy"],
        "mean_node_accuracy": last["mean_node_accuracy"],
        "final_loss": last["loss"],
        "mean_node_loss": last["mean_node_loss"],
        "train_loss": last["train_loss"],
        "consensus_distance": last["consensus_distance"],
        "bytes_sent": bytes_sent,
        "bytes_intra": network.bytes_by_class.get("intra", 0),
        "bytes_inter": network.bytes_by_class.get("inter", 0),
        "messages_lost": network.lost,
        "clipped": sum(ch.rule.clipped for n in nodes for ch in n.channels),
        "faults": [],
        "missing_neighbors": sum(n.mix_totals.missing for n in nodes),
        "rejected": sum(sum(n.rejected.values()) for n in nodes),
        **figures,
    }
    if "perplexity" in last:
        summary["final_perplexity"] = last["perplexity"]
    for ch_index, ch in enumerate(nodes[0].channels):
        prefix = "" if ch.name == "all" else f"{ch.name}_"
        report = ch.rule.report()
        summary[prefix + "rule"] = report["rule"]
        if "gamma" in report:
            summary[prefix + "gamma"] = report["gamma"]
        for key in ("gaps", "resyncs", "superseded"):
            if key in report:
                summary[prefix + key] = sum(n.channels[ch_index].rule.report()[key] for n in nodes)
        if "mean_staleness" in report:
            summary[prefix + "mean_staleness"] = sum(
                n.channels[ch_index].rule.report()["mean_staleness"] for n in nodes) / len(nodes)
    return summary


def open_out(out: str | Path | IO[str] | None) -> tuple[IO[str] | None, bool]:
    """The metrics file (an open one, or one opened from a path) and whether to close it."""
    if out is None or hasattr(out, "write"):
        return out, False  # type: ignore[return-value]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    return open(out, "w"), True
