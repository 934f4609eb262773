"""Two-datacenter study: what asynchrony, staleness weighting and compression buy across a slow link.

One cluster spans two datacenters: a ring of nodes inside each (10 Gbit/s,
0.2 ms links) and one WAN link per node to its twin in the other datacenter
(100 Mbit/s, 160 ms by default: 16 local steps of 10 ms). The study trains the
same task from the same seed four ways and compares them side by side:

1. ``sync``: synchronous gossip (D-PSGD). Every round waits for the WAN message.
2. ``async``: asynchronous gossip with constant weights. Nobody waits; messages
   from the other datacenter arrive ~16 steps old and count fully.
3. ``async+staleness``: the same, with staleness-aware weights (``hinge:1,2``):
   old messages count less.
4. ``async+staleness+compressed``: the same, plus a link policy that compresses
   the inter-datacenter links only (CHOCO with top-k 5% by default); intra
   links stay exact.
5. ``sync+outer``: DiLoCo across the WAN. Exact synchronous gossip inside each
   datacenter every step; across, an exchange every ``--outer-period`` steps (16)
   that is an outer optimizer step (``--outer``, default
   ``nesterov:lr=0.5,momentum=0.8``) on the pseudo-gradient of the mixed parameters.

The question: how much simulated time does not waiting on the WAN save, what
does it cost in accuracy and consensus, how much of that cost do staleness
weights win back, and how many WAN bytes can compression save on top.

    python examples/two_dc_study.py                    # 2 x 8 nodes, 300 steps
    python examples/two_dc_study.py --short            # CI: 2 x 4 nodes, 80 steps, checks its outcome
    python examples/two_dc_study.py --inter-latency 50 --inter-codec int8 --out-dir runs/two_dc

Results: ``OUT_DIR/<config>.jsonl`` and ``OUT_DIR/two_dc_study.png`` (loss,
accuracy, consensus distance and bytes per link class against steps and
simulated time).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any, Sequence

import gossip
from gossip.compression import get_codec
from gossip.plot import plot_runs, read_metrics
from gossip.training.node import resolve_device

INTRA_LINK = "latency=0.2ms,bandwidth=10Gbit"
INTER_BANDWIDTH = "100Mbit"
COMPUTE = "fixed:0.01"  # 10 ms per local step
STALENESS = "hinge:1,2"
OUTER = "nesterov:lr=0.5,momentum=0.8"  # DiLoCo's Nesterov, milder for the SGD inner steps of digits
OUTER_PERIOD = 16
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SHORT_MIN_PNG_BYTES = 20_000  # a figure with curves and labels; an empty canvas is a few kB
SHORT_MIN_ACCURACY = 0.6  # averaged model, every config; chance is 0.1 on digits
TARGET_GAP = 0.02  # "time to target": first time within 2 points of the sync run's final accuracy


def configs(inter_codec: str, outer: str = OUTER, outer_period: int = OUTER_PERIOD) -> dict[str, dict[str, Any]]:
    """The five runs, as overrides of the shared :func:`gossip.simulate` settings."""
    return {
        "sync": {},
        "async": {"asynchronous": True, "staleness": "constant"},
        "async+staleness": {"asynchronous": True, "staleness": STALENESS},
        "async+staleness+compressed": {"asynchronous": True, "staleness": STALENESS,
                                       "link_policy": {"inter": f"codec={inter_codec}"}},
        "sync+outer": {"link_policy": {"inter": f"period={outer_period},outer={outer}"}},
    }


def time_to(history: list[dict[str, Any]], target: float) -> float | None:
    """Simulated time of the first evaluation at or above ``target`` accuracy (None if never)."""
    return next((h["time"] for h in history if h["accuracy"] >= target), None)



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="the quick CI form; checks its own outcome")
    p.add_argument("--nodes-per-dc", type=int, default=None, help="nodes in each datacenter (default: 8, short: 4)")
    p.add_argument("--steps", type=int, default=None, help="local steps per node (default: 300, short: 80)")
    p.add_argument("--task", default="digits", help="task spec (default: digits)")
    p.add_argument("--split", default="iid", help="iid or dirichlet:ALPHA (default: iid)")
    p.add_argument("--inter-latency", type=float, default=160.0,
                   help="one-way latency of the inter-datacenter links in ms (default: 160)")
    p.add_argument("--inter-codec", default="topk:0.05",
                   help="codec of the inter-datacenter links in the compressed config (default: topk:0.05)")
    p.add_argument("--outer", default=OUTER,
                   help=f"outer optimizer of the sync+outer config's WAN exchanges (default: {OUTER})")
    p.add_argument("--outer-period", type=int, default=OUTER_PERIOD,
                   help=f"local steps between the sync+outer config's WAN exchanges (default: {OUTER_PERIOD})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=str(resolve_device("auto")),
                   help="cpu, cuda, cuda:N (default: cuda when available)")
    p.add_argument("--out-dir", default="runs/two_dc_study", help="where the JSONL files and the PNG go")
    return p


def short_form_problems(runs: dict[str, dict[str, Any]], png: Path | None) -> list[str]:
    """What the short form's outcome misses (empty when it passes)."""
    problems = [f"{name}: final accuracy {row['final_accuracy']:.4f} < {SHORT_MIN_ACCURACY}"
                for name, row in runs.items() if not row["final_accuracy"] >= SHORT_MIN_ACCURACY]
    sync_time = runs["sync"]["sim_time_s"]
    problems += [f"{name}: {row['sim_time_s']:.2f} simulated s, not less than sync's {sync_time:.2f}"
                 for name, row in runs.items() if row["asynchronous"] and not row["sim_time_s"] < sync_time]
    if png is not None:
        data = png.read_bytes()
        if data[:8] != PNG_MAGIC or len(data) < SHORT_MIN_PNG_BYTES:
            problems.append(f"{png} is not a PNG of at least {SHORT_MIN_PNG_BYTES} bytes")
    return problems


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the study; returns ``{"png": path, "setup": {...}, "runs": {config: figures}}``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    per_dc = args.nodes_per_dc if args.nodes_per_dc is not None else (4 if args.short else 8)
    steps = args.steps if args.steps is not None else (80 if args.short else 300)
    if per_dc < 1:
        parser.error(f"--nodes-per-dc must be >= 1, got {per_dc}")
    if steps < 1:
        parser.error(f"--steps must be >= 1, got {steps}")
    if not (math.isfinite(args.inter_latency) and args.inter_latency >= 0):
        parser.error(f"--inter-latency must be a number of ms >= 0, got {args.inter_latency}")
    try:
        get_codec(args.inter_codec)
    except ValueError as e:
        parser.error(f"--inter-codec: {e}")
    try:
        gossip.MixingSettings(outer=args.outer, period=max(1, args.outer_period))
    except ValueError as e:
        parser.error(str(e).replace("outer", "--outer", 1))
    if args.outer_period < 1:
        parser.error(f"--outer-period must be >= 1, got {args.outer_period}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # a ring inside each datacenter, node k of one DC linked to node k of the other
    common = dict(nodes=2 * per_dc, topology=f"hierarchical:{per_dc},{per_dc},intra=ring,inter=matched",
                  task=args.task, split=args.split, steps=steps, seed=args.seed, link=INTRA_LINK,
                  inter_link=f"latency={args.inter_latency:g}ms,bandwidth={INTER_BANDWIDTH}", compute=COMPUTE,
                  device=args.device, eval_every=max(1, steps // 20))
    setup = {"nodes_per_dc": per_dc, "steps": steps, "task": args.task, "split": args.split, "seed": args.seed,
             "intra_link": INTRA_LINK, "inter_link": common["inter_link"], "compute": COMPUTE,
             "staleness": STALENESS, "inter_codec": args.inter_codec, "outer": args.outer,
             "outer_period": args.outer_period}
    print(f"2 datacenters x {per_dc} nodes, task {args.task}, split {args.split}, {steps} steps; "
          f"inter-DC {common['inter_link']}, intra-DC {INTRA_LINK}, {COMPUTE} s per step")
    print(f"{'config':<28} {'accuracy':>9} {'node acc':>9} {'consensus':>10} {'sim s':>7} {'to target':>10} "
          f"{'MB intra':>9} {'MB inter':>9} {'wall s':>7}")
    rows: dict[str, dict[str, Any]] = {}
    files = []
    target = None
    for name, overrides in configs(args.inter_codec, args.outer, args.outer_period).items():
        path = out_dir / f"{name}.jsonl"
        t0 = time.perf_counter()
        r = gossip.simulate(**common, **overrides, out=path)
        s = r.summary
        if target is None:  # sync runs first: it sets the bar
            target = s["final_accuracy"] - TARGET_GAP
        reached = time_to(r.history, target)
        rows[name] = {"asynchronous": s["asynchronous"], "staleness": overrides.get("staleness"),
                      "inter_codec": args.inter_codec if name.endswith("compressed") else "none",
                      "outer": args.outer if name == "sync+outer" else None,
                      "final_accuracy": s["final_accuracy"], "mean_node_accuracy": s["mean_node_accuracy"],
                      "consensus_distance": s["consensus_distance"], "sim_time_s": s["sim_time_s"],
                      "time_to_target_s": reached, "bytes_intra": s["bytes_intra"], "bytes_inter": s["bytes_inter"],
                      "jsonl": str(path)}
        files.append((path, name.replace("compressed", args.inter_codec)))
        print(f"{name:<28} {s['final_accuracy']:>9.4f} {s['mean_node_accuracy']:>9.4f} "
              f"{s['consensus_distance']:>10.3g} {s['sim_time_s']:>7.2f} "
              f"{'never' if reached is None else f'{reached:.2f}':>10} {s['bytes_intra'] / 1e6:>9.2f} "
              f"{s['bytes_inter'] / 1e6:>9.2f} {time.perf_counter() - t0:>7.1f}")
    setup["target_accuracy"] = target
    print(f"to target: simulated s until the averaged model first reaches {target:.4f} "
          f"(sync's final accuracy - {TARGET_GAP:g})")
    try:
        png: Path | None = plot_runs([read_metrics(f, label) for f, label in files], out_dir / "two_dc_study.png",
                                     title=f"2 DCs x {per_dc} nodes, {args.task}, inter-DC "
                                           f"{args.inter_latency:g} ms / {INTER_BANDWIDTH}/s")
        print(f"plot: {png}")
    except ImportError:
        png = None
        print("no plot: matplotlib is not installed (pip install 'gossip-trainer[plot]')")
    out = {"png": str(png) if png else None, "setup": setup, "runs": rows}
    print(json.dumps(out))
    if args.short:
        problems = short_form_problems(rows, png)
        if problems:
            raise SystemExit("short form failed: " + "; ".join(problems))
    return out


if __name__ == "__main__":
    main()
