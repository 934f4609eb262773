"""Faults, measured: real crashes on loopback, partitions and a misbehaving peer in the simulator.

1. crash (real processes). 8 ``gossip-node`` processes on a ring, synthetic
   task; a clean run and a run where two nodes are killed with SIGKILL once
   node 0 has logged half the steps. Reported: detection time (from the kill
   to the first survivor's "removed: silent" log line, and to the last's), the
   longest pause between two local steps on any survivor, and the mean final
   accuracy of the survivors against the clean run's nodes.
2. partition (simulator). 8 nodes on a ring, digits, split in halves for one
   simulated second: the consensus distance before, at the end of, and after
   the partition.
3. byzantine (simulator). 8 nodes on a ring, digits; node 3 sends its
   parameters x1000. Mean accuracy of the honest nodes without and with
   clipped gossip (``clip="auto"``), and the cost of clipping on a clean run.

    python benchmarks/faults.py [--steps 1500] [--dead-after 2] [--skip-real]

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gossip  # noqa: E402
from tests.cluster import Cluster, free_port, wait_for_step  # noqa: E402

LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*removed: silent")


def _log_times(text: str) -> list[float]:
    out = []
    for line in text.splitlines():
        m = LOG_TIME.match(line)
        if m:
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def crash(steps: int, dead_after: float, n: int = 8) -> dict:
    timing = ["--heartbeat", str(dead_after / 8), "--dead-after", str(dead_after), "--settle", "1",
              "--grace", "5", "--timeout", "5"]
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for run in ("clean", "faulty"):
            ports = [free_port() for _ in range(n)]
            metrics = work / f"{run}.jsonl"
            with Cluster(work) as c:
                nodes = []
                for i in range(n):
                    extra = ["--log", str(metrics), "--eval-every", "50"] if i == 0 else []
                    nodes.append(c.start(f"{run}{i}", ["--peers", f"127.0.0.1:{ports[(i + 1) % n]}", "--topology",
                                                       "ring", "--task", "synthetic", "--steps", str(steps),
                                                       "--json", *timing, *extra], port=ports[i]))
                victims = [nodes[2], nodes[5]]
                killed_at = None
                if run == "faulty":
                    wait_for_step(metrics, steps // 2, 600)
                    killed_at = time.time()
                    for v in victims:
                        v.proc.send_signal(signal.SIGKILL)
                survivors = [x for x in nodes if run == "clean" or x not in victims]
                codes = [x.wait(600) for x in survivors]
                summaries = [x.summary() for x in survivors]
                row = {"exit_codes": sorted(set(codes)),
                       "mean_accuracy": sum(s["final_accuracy"] for s in summaries) / len(summaries),
                       "max_step_gap_s": max(s["max_step_gap_s"] for s in summaries),
                       "members_at_end": sorted({s["members"] for s in summaries}),
                       "train_time_s": max(s["train_time_s"] for s in summaries)}
                if killed_at is not None:
                    firsts = [min(t) - killed_at for t in (_log_times(x.log()) for x in survivors) if t]
                    row.update(detected_by=len(firsts), detect_first_s=min(firsts), detect_last_s=max(firsts))
                out[run] = row
    out["accuracy_change_pts"] = 100 * (out["faulty"]["mean_accuracy"] - out["clean"]["mean_accuracy"])
    return out


def partition() -> dict:
    r = gossip.simulate(nodes=8, topology="ring", task="digits", steps=300, eval_every=10, compute="fixed:0.01",
                        faults=["partition:0-3|4-7@1.0-2.0"], detect=0.2)

    def at(t: float) -> dict:
        return min(r.history, key=lambda h: abs(h["time"] - t))

    return {"consensus_before": at(1.0)["consensus_distance"], "consensus_end_of_split": at(2.0)["consensus_distance"],
            "consensus_final": r.history[-1]["consensus_distance"], "final_accuracy": r.summary["final_accuracy"]}


def byzantine(seeds: int) -> dict:
    rows = []
    for seed in range(seeds):
        common = dict(nodes=8, topology="ring", task="digits", steps=300, eval_every=300, seed=seed)
        acc = {name: gossip.simulate(**common, **kw).summary["mean_node_accuracy"] for name, kw in
               (("clean", {}), ("attack", {"byzantine": "3=1000"}), ("attack_clip", {"byzantine": "3=1000",
                                                                                    "clip": "auto"}),
                ("clean_clip", {"clip": "auto"}))}
        rows.append(acc)
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    return {"per_seed": rows, **{f"mean_{k}": v for k, v in mean.items()},
            "clip_vs_clean_pts": 100 * (mean["attack_clip"] - mean["clean"]),
            "clip_cost_pts": 100 * (mean["clean_clip"] - mean["clean"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--dead-after", type=float, default=2.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--skip-real", action="store_true", help="only the simulator measurements")
    args = ap.parse_args()
    result: dict = {}
    if not args.skip_real:
        result["crash"] = c = crash(args.steps, args.dead_after)
        print(f"crash: detected by {c['faulty']['detected_by']} survivors in {c['faulty']['detect_first_s']:.2f}-"
              f"{c['faulty']['detect_last_s']:.2f} s (dead-after {args.dead_after} s); longest step gap "
              f"{c['faulty']['max_step_gap_s']:.2f} s (clean {c['clean']['max_step_gap_s']:.2f} s); accuracy "
              f"{c['faulty']['mean_accuracy']:.4f} vs clean {c['clean']['mean_accuracy']:.4f}")
    result["partition"] = p = partition()
    print(f"partition: consensus {p['consensus_before']:.3g} before, {p['consensus_end_of_split']:.3g} at the end "
          f"of the split, {p['consensus_final']:.3g} at the end; accuracy {p['final_accuracy']:.4f}")
    result["byzantine"] = b = byzantine(args.seeds)
    print(f"byzantine x1000: honest accuracy clean {b['mean_clean']:.4f}, attacked {b['mean_attack']:.4f}, "
          f"attacked+clip {b['mean_attack_clip']:.4f}, clean+clip {b['mean_clean_clip']:.4f}")
    print(json.dumps(result, default=float))


if __name__ == "__main__":
    main()
