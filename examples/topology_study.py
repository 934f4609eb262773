"""Topology study: how the communication graph shapes consensus and accuracy.

Trains the same task on ring, 2-D torus, exponential, one-peer exponential
(push-sum, a time-varying graph), complete (the all-reduce baseline) and star
(the parameter-server-like baseline) graphs in the simulator, writes one JSONL
metrics file per topology, and plots consensus distance, accuracy, loss and
bytes against steps and simulated time with :mod:`gossip.plot`.

The default task, digits with a Dirichlet(0.1) split, gives every node a skewed
handful of classes: replicas pull apart between exchanges, and how fast a graph
pulls them back together (its spectral gap) decides how close they stay.

    python examples/topology_study.py                      # 16 nodes, 300 steps
    python examples/topology_study.py --short              # CI: few steps, checks the plot
    python examples/topology_study.py --out-dir runs/topo --task synthetic --split iid

Results: ``OUT_DIR/<topology>.jsonl`` and ``OUT_DIR/topology_study.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Sequence

import gossip
import topologies as T
from gossip.plot import plot_runs, read_metrics
from gossip.training.node import resolve_device

# (topology spec, mixing rule): one-peer exponential changes every round, which needs push-sum
STUDY = (
    ("ring", "gossip"),
    ("torus", "gossip"),
    ("exponential", "gossip"),
    ("one-peer-exponential", "push-sum"),
    ("complete", "gossip"),
    ("star", "gossip"),
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SHORT_MIN_PNG_BYTES = 20_000  # a figure with curves and labels; an empty canvas is a few kB


def spectral_gap(spec: str, nodes: int) -> float | None:
    """1 - |second eigenvalue| of the mixing matrix; None for a time-varying graph."""
    topology = T.build(spec, nodes)
    if topology.time_varying:
        return None
    return float(T.spectral_gap(topology.mixing_matrix()))



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="the quick CI form; checks the plot file")
    p.add_argument("--nodes", type=int, default=None, help="simulated nodes (default: 16, short: 8)")
    p.add_argument("--steps", type=int, default=None, help="local steps per node (default: 300, short: 30)")
    p.add_argument("--task", default="digits:lr=0.1", help="task spec (default: digits:lr=0.1)")
    p.add_argument("--split", default="dirichlet:0.1", help="iid or dirichlet:ALPHA (default: dirichlet:0.1)")
    p.add_argument("--topologies", default=",".join(t for t, _ in STUDY),
                   help=f"comma-separated subset of: {', '.join(t for t, _ in STUDY)}")
    p.add_argument("--link", default="lan", help="link model, as gossip-sim --link (default: lan)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=str(resolve_device("auto")),
                   help="cpu, cuda, cuda:N (default: cuda when available)")
    p.add_argument("--out-dir", default="runs/topology_study", help="where the JSONL files and the PNG go")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the study; returns ``{"png": path, "runs": {topology: figures}}``."""
    args = build_parser().parse_args(argv)
    nodes = args.nodes or (8 if args.short else 16)
    steps = args.steps if args.steps is not None else (30 if args.short else 300)
    rules = dict(STUDY)
    chosen = [t.strip() for t in args.topologies.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in rules]
    if unknown:
        raise SystemExit(f"unknown topology {unknown[0]!r}; this study knows {', '.join(rules)}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{nodes} nodes, task {args.task}, split {args.split}, {steps} steps")
    print(f"{'topology':<22} {'rule':<9} {'gap':>6} {'accuracy':>9} {'node acc':>9} {'consensus':>10} "
          f"{'MB sent':>8} {'sim s':>6} {'wall s':>7}")
    rows: dict[str, dict[str, Any]] = {}
    files = []
    for spec in chosen:
        path = out_dir / f"{spec}.jsonl"
        t0 = time.perf_counter()
        s = gossip.simulate(nodes=nodes, topology=spec, algorithm=rules[spec], task=args.task, split=args.split,
                            steps=steps, seed=args.seed, link=args.link, device=args.device, out=path,
                            eval_every=max(1, steps // 20)).summary
        gap = spectral_gap(spec, nodes)
        rows[spec] = {"algorithm": rules[spec], "spectral_gap": gap, "final_accuracy": s["final_accuracy"],
                      "mean_node_accuracy": s["mean_node_accuracy"], "consensus_distance": s["consensus_distance"],
                      "bytes_sent": s["bytes_sent"], "sim_time_s": s["sim_time_s"], "jsonl": str(path)}
        files.append(path)
        print(f"{spec:<22} {rules[spec]:<9} {'-' if gap is None else f'{gap:.3f}':>6} {s['final_accuracy']:>9.4f} "
              f"{s['mean_node_accuracy']:>9.4f} {s['consensus_distance']:>10.3g} {s['bytes_sent'] / 1e6:>8.1f} "
              f"{s['sim_time_s']:>6.2f} {time.perf_counter() - t0:>7.1f}")
    try:
        png: Path | None = plot_runs([read_metrics(f) for f in files], out_dir / "topology_study.png",
                                     title=f"{nodes} nodes, {args.task}, {args.split}")
        print(f"plot: {png}")
    except ImportError:
        png = None
        print("no plot: matplotlib is not installed (pip install 'gossip-trainer[plot]')")
    print(json.dumps({"png": str(png) if png else None, "runs": rows}))
    if args.short and png is not None:
        data = png.read_bytes()
        if data[:8] != PNG_MAGIC or len(data) < SHORT_MIN_PNG_BYTES:
            raise SystemExit(f"short form failed: {png} is not a PNG of at least {SHORT_MIN_PNG_BYTES} bytes")
    return {"png": str(png) if png else None, "runs": rows}


if __name__ == "__main__":
    main()
