"""Simulator overhead: gossip-sim's wall time over a plain loop training the same models.

For N nodes on a ring (digits, its default small MLP, D-PSGD every step) we time

  sim    what ``gossip-sim`` runs (gossip.Simulation): setup, event queue, local
         steps, gossip rounds, final evaluation of every node and of the averaged
         model;
  plain  the same N models, optimizers and data shards trained round-robin for the
         same number of steps with no communication, then the same evaluations.

These machines are shared and their speed drifts by tens of percent within a
minute, so the two sides are interleaved in short chunks inside one process
(plain 1/K of the steps, sim 1/K of the simulated time, plain, sim, ...) and
each side's time is the sum of its chunks: a slow spell hits both alike. The
whole comparison is repeated and the median ratio is reported.

Ends with one JSON line: ``{"ratio_32": ..., "ratio_128": ..., ...}``.

    python benchmarks/sim_overhead.py [--steps 100] [--repeat 3] [--sizes 32,128] [--chunks 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from gossip.api import SimConfig, Simulation, average_params  # noqa: E402
from gossip.node import init_model  # noqa: E402
from gossip.simulator import parse_compute  # noqa: E402
from gossip.state import FlatState  # noqa: E402
from gossip.tasks import get_task  # noqa: E402


class PlainRun:
    """N independent replicas trained with no communication at all."""

    def __init__(self, nodes: int, seed: int) -> None:
        self.task = get_task("digits")
        self.seed = seed
        self.models = [init_model(self.task, seed) for _ in range(nodes)]
        self.states = [FlatState(m) for m in self.models]
        self.opts = [self.task.optimizer(m.parameters()) for m in self.models]
        self.streams = [self.task.stream(i, nodes, "iid", seed) for i in range(nodes)]

    def steps(self, k: int) -> None:
        task = self.task
        for _ in range(k):
            for m, opt, s in zip(self.models, self.opts, self.streams):
                batch = s.next()
                opt.zero_grad(set_to_none=True)
                loss = task.loss(m, batch)
                float(loss.detach())
                loss.backward()
                opt.step()

    def finish(self) -> None:
        for m in self.models:
            self.task.evaluate(m)
        avg = init_model(self.task, self.seed)
        FlatState(avg).load_(average_params([s.flat for s in self.states]))
        self.task.evaluate(avg)


def compare(nodes: int, steps: int, seed: int, chunks: int) -> tuple[float, float]:
    """Interleaved (plain seconds, sim seconds) for one configuration."""
    cfg = SimConfig(nodes=nodes, topology="ring", algorithm="gossip", task="digits", steps=steps, seed=seed,
                    eval_every=steps)
    t_plain = t_sim = 0.0
    t0 = time.perf_counter()
    plain = PlainRun(nodes, seed)
    t1 = time.perf_counter()
    sim = Simulation(cfg)
    t2 = time.perf_counter()
    t_plain += t1 - t0
    t_sim += t2 - t1
    step_time = parse_compute(cfg.compute).mean
    done = 0
    for k in range(1, chunks + 1):
        target = steps * k // chunks
        t0 = time.perf_counter()
        plain.steps(target - done)
        t1 = time.perf_counter()
        sim.run(until=target * step_time)  # a synchronous ring step takes slightly more than compute
        t2 = time.perf_counter()
        done = target
        t_plain += t1 - t0
        t_sim += t2 - t1
    t0 = time.perf_counter()
    plain.finish()
    t1 = time.perf_counter()
    result = sim.result()  # runs what is left, evaluates, summarises
    t2 = time.perf_counter()
    t_plain += t1 - t0
    t_sim += t2 - t1
    assert result.summary["steps"] == steps and sim.done
    return t_plain, t_sim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sizes", default="32,128")
    ap.add_argument("--chunks", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the simulator runs single-threaded by default; give the baseline the same
    compare(2, 5, 0, 2)  # warm up imports and allocator on both paths
    result: dict[str, float] = {}
    print(f"{'nodes':>6} {'steps':>6} {'plain s':>9} {'sim s':>9} {'ratio':>7}  per repeat")
    for n in (int(s) for s in args.sizes.split(",")):
        runs = [compare(n, args.steps, r, args.chunks) for r in range(args.repeat)]
        ratios = [s / p for p, s in runs]
        ratio = statistics.median(ratios)
        result[f"ratio_{n}"] = round(ratio, 3)
        print(f"{n:>6} {args.steps:>6} {statistics.median(p for p, _ in runs):>9.3f} "
              f"{statistics.median(s for _, s in runs):>9.3f} {ratio:>7.3f}  "
              + " ".join(f"{x:.3f}" for x in ratios), flush=True)
    result["steps"] = args.steps
    result["target"] = 1.25
    print(json.dumps(result))


if __name__ == "__main__":
    main()
