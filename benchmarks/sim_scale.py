"""Simulator scale: 1024 nodes x 1000 steps of the digits MLP, and the most nodes that fit in 8 GiB.

Two measurements of what ``gossip-sim --task digits --topology ring`` runs
(gossip.Simulation with its default evaluations; engine ``auto``, which is
``lockstep`` for this run):

  time    N nodes x S local steps, wall seconds from building the nodes to the
          final summary (``--engine``, default lockstep), and the CPU seconds
          the process spent on it (``cpu_s``: on a shared machine wall time is
          mostly the load); the per-node, batched
          and lockstep engines' rates are measured alongside on the same nodes for
          a few steps (``--per-node-steps``), interleaved, so the speed-ups are
          side by side;
  memory  the peak resident memory of a fresh process that builds M nodes and
          runs a few steps, at two sizes; per-node memory is the slope between
          them, and ``max_nodes_8gib`` the node count whose fitted peak reaches
          8 GiB. ``--verify`` then runs that many nodes and reports the peak
          it really took. Digits has 1437 training images, too few for more
          nodes than that, so the memory runs train the digits model (64-64-10
          MLP, the same optimizer) on generated 64-feature data, two samples
          per node.

Ends with one JSON line: ``{"wall_s_1024x1000": ..., "max_nodes_8gib": ..., ...}``
(the key names the nodes and steps run).

    python benchmarks/sim_scale.py [--nodes 1024] [--steps 1000] [--memory-sizes 2048,8192] [--verify]
        [--engine lockstep|batched]
    python benchmarks/sim_scale.py --quick        # a smoke test: 64 nodes x 20 steps, memory at 128 and 1024
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 1 << 30
LIMIT = 8 * GIB


def config(nodes: int, steps: int, engine: str, topology: str, task: str = "digits", eval_every: int = 0):
    from gossip.api import SimConfig

    return SimConfig(nodes=nodes, topology=topology, algorithm="gossip", task=task, steps=steps, seed=0,
                     engine=engine, eval_every=eval_every)


def memory_task(nodes: int) -> str:
    """The digits model (64 inputs, 64 hidden, 10 classes, the same optimizer) on generated
    data with two samples per node: digits itself has 1437 training images, one per node at most."""
    return f"synthetic:dim=64,classes=10,samples={2 * nodes},test_samples=360"


def time_run(nodes: int, steps: int, topology: str, engine: str = "lockstep") -> dict:
    """Wall seconds of one simulation, setup to summary."""
    from gossip.api import Simulation

    t0, c0 = time.perf_counter(), time.process_time()
    sim = Simulation(config(nodes, steps, engine, topology))
    t1 = time.perf_counter()
    result = sim.run().result()
    t2, c2 = time.perf_counter(), time.process_time()
    assert result.summary["engine"] == engine and result.summary["steps"] == steps
    return {"wall_s": t2 - t0, "setup_s": t1 - t0, "cpu_s": c2 - c0, "accuracy": result.summary["final_accuracy"],
            "flushes": sim.batched.flushes}


ENGINES = ("per-node", "batched", "lockstep")


def engine_rates(nodes: int, steps: int, topology: str) -> dict[str, float]:
    """Seconds per mean local step of each engine, run interleaved in chunks of one
    step on the same configuration (setup excluded)."""
    from gossip.api import Simulation

    # one evaluation, at the end: the default (every 1/20 of a short run) would time the evaluations
    sims = {e: Simulation(config(nodes, steps, e, topology, eval_every=steps)) for e in ENGINES}
    spent = dict.fromkeys(sims, 0.0)
    step_time = 0.0101  # the default compute model's 10 ms per step, and a LAN round trip
    for k in range(1, steps + 1):
        for e, sim in sims.items():
            t0 = time.perf_counter()
            sim.run(until=k * step_time)
            spent[e] += time.perf_counter() - t0
    for e, sim in sims.items():
        t0 = time.perf_counter()
        sim.run()  # what is left of the last round
        spent[e] += time.perf_counter() - t0
    assert len({sim.sim.now for sim in sims.values()}) == 1, "the engines disagree on the virtual time"
    return {e: spent[e] / steps for e in ENGINES}


def peak_rss(nodes: int, steps: int, topology: str, engine: str = "lockstep") -> int:
    """Peak resident bytes of a fresh process that builds ``nodes`` nodes and runs ``steps`` steps."""
    code = ("import resource, sys, torch; sys.path[:0] = [%r, %r]; torch.set_num_threads(1)\n"
            "from sim_scale import config, memory_task\n"
            "from gossip.api import Simulation\n"
            "r = Simulation(config(%d, %d, %r, %r, memory_task(%d))).run().result()\n"
            "assert r.summary['engine'] == %r\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n") % (str(ROOT), str(ROOT / "benchmarks"), nodes, steps, engine, topology, nodes, engine)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1]) * 1024  # Linux reports KiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--topology", default="ring")
    ap.add_argument("--engine", default="lockstep", choices=("lockstep", "batched"),
                    help="the engine of the timed run and the memory fit (default: lockstep)")
    ap.add_argument("--per-node-steps", type=int, default=10, help="steps of the side-by-side engine comparison")
    ap.add_argument("--memory-sizes", default="2048,8192", help="two node counts for the memory fit")
    ap.add_argument("--memory-steps", type=int, default=3)
    ap.add_argument("--verify", action="store_true", help="also run max_nodes_8gib nodes and report their peak")
    ap.add_argument("--quick", action="store_true", help="a fast smoke test (small sizes)")
    args = ap.parse_args()
    if args.quick:
        args.nodes, args.steps, args.per_node_steps, args.memory_sizes, args.memory_steps = 64, 20, 3, "128,1024", 2
    sizes = sorted(int(s) for s in args.memory_sizes.split(","))
    if len(sizes) != 2 or sizes[0] == sizes[1] or sizes[0] < 1:
        ap.error("--memory-sizes takes two different positive node counts, e.g. 2048,8192")
    import torch

    torch.set_num_threads(1)  # the simulator's default (SimConfig.threads)
    load = os.getloadavg()[0]
    run = time_run(args.nodes, args.steps, args.topology, args.engine)
    print(f"{args.nodes} nodes x {args.steps} steps ({args.topology}, {args.engine}): {run['wall_s']:.1f} s wall "
          f"({run['setup_s']:.1f} s setup, {run['flushes']} vectorised steps), {run['cpu_s']:.1f} s CPU, "
          f"accuracy {run['accuracy']:.3f}",
          flush=True)
    rates = engine_rates(args.nodes, args.per_node_steps, args.topology)
    per_node, batched, lockstep = (rates[e] for e in ENGINES)
    print(f"per mean step of all nodes, {args.per_node_steps} steps interleaved: per-node engine "
          f"{per_node * 1e3:.0f} ms, batched {batched * 1e3:.0f} ms, lockstep {lockstep * 1e3:.0f} ms "
          f"(lockstep {per_node / lockstep:.1f}x per-node, {batched / lockstep:.1f}x batched)", flush=True)
    peaks = [peak_rss(n, args.memory_steps, args.topology, args.engine) for n in sizes]
    per_node_bytes = (peaks[1] - peaks[0]) / (sizes[1] - sizes[0])
    if per_node_bytes <= 0:
        sys.exit(f"peak memory did not grow from {sizes[0]} to {sizes[1]} nodes ({peaks}); use larger --memory-sizes")
    base = peaks[0] - per_node_bytes * sizes[0]
    max_nodes = int((LIMIT - base) // per_node_bytes)
    print(f"peak memory: {sizes[0]} nodes {peaks[0] / GIB:.2f} GiB, {sizes[1]} nodes {peaks[1] / GIB:.2f} GiB: "
          f"{per_node_bytes / 1024:.1f} KiB per node + {base / GIB:.2f} GiB -> {max_nodes} nodes in 8 GiB", flush=True)
    result = {
        f"wall_s_{args.nodes}x{args.steps}": round(run["wall_s"], 2),
        "max_nodes_8gib": max_nodes,
        "nodes": args.nodes,
        "steps": args.steps,
        "topology": args.topology,
        "engine": args.engine,
        "setup_s": round(run["setup_s"], 2),
        "cpu_s": round(run["cpu_s"], 2),  # CPU seconds of that run (this process): less sensitive to load than wall_s
        "final_accuracy": round(run["accuracy"], 4),
        "per_node_ms_per_step": round(per_node * 1e3, 2),
        "batched_ms_per_step": round(batched * 1e3, 2),
        "lockstep_ms_per_step": round(lockstep * 1e3, 2),
        "kib_per_node": round(per_node_bytes / 1024, 2),
        "memory_sizes": sizes,
        "peak_gib": [round(p / GIB, 3) for p in peaks],
        "load_avg_1min": [round(load, 2), round(os.getloadavg()[0], 2)],  # at the start and the end
    }
    if args.verify:
        peak = peak_rss(max_nodes, args.memory_steps, args.topology, args.engine)
        result["verified_peak_gib"] = round(peak / GIB, 3)
        result["verified_fits_8gib"] = peak <= LIMIT  # the fit is linear; the last few percent may not be
        print(f"verified: {max_nodes} nodes peaked at {peak / GIB:.2f} GiB "
              f"({'within' if peak <= LIMIT else 'over'} 8 GiB)", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
