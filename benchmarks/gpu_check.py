"""GPU check: two gossip nodes on one CUDA device, exchanging over loopback vs. not exchanging.

Run on a machine with an NVIDIA GPU (one command, under 5 minutes):

    python benchmarks/gpu_check.py [--steps 200] [--warmup 20] [--repeat 3] [--hidden 4096]

It trains a wide MLP (512 -> 4096 -> 4096 -> 16: 18,948,112 parameters, 72.3 MiB
of float32 with the default ``--hidden``) on generated data, in two worker
processes that share the GPU, three ways:

  off      both nodes train, no exchange (``period`` beyond the last step):
           the step time to beat, with the GPU shared as in the others
  gossip   D-PSGD over loopback every step
  period4  the same with an exchange every 4 local steps

The two workers (each with half the machine's cores as torch threads) start
once (torch, CUDA) and run the configurations interleaved, in a rotated order
in each of ``--repeat`` rounds, each as a fresh pair of nodes. A run's step
time is its mean over the steps after the first ``--warmup`` (timed with the
GPU synchronised at both ends of that window, a whole number of exchange
periods), the slower of the two nodes; the figures are medians over the
rounds. Prints a table and one JSON line. On a machine
without CUDA it says so and exits 0; ``--dry-run`` runs the same measurement
on the CPU with a small model, to check the script itself.

It also checks a group of one on the GPU (``group_check``): two groups, each
started by ``torchrun --nproc-per-node 1 -m gossip.groups.run`` with the default
``--device auto``, FSDP inside, must train on ``cuda:0`` and mix every round
(on the CPU in a dry run).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gossip.transport.ports import free_port  # noqa: E402

#: name -> local steps between exchanges (off: never within a run)
CONFIGS = {"off": 10**9, "gossip": 1, "period4": 4}


class WideTask:
    """Synthetic regression with a wide MLP: enough parameters to make communication matter."""

    def __init__(self, hidden: int, dim: int = 512) -> None:
        import torch

        self.hidden, self.dim = hidden, dim
        g = torch.Generator().manual_seed(0)
        self.X = torch.randn(8192, dim, generator=g)
        self.W = torch.randn(dim, 16, generator=g) / dim**0.5
        self.y = torch.tanh(self.X @ self.W)

    def model(self):
        from torch import nn

        return nn.Sequential(nn.Linear(self.dim, self.hidden), nn.ReLU(), nn.Linear(self.hidden, self.hidden),
                             nn.ReLU(), nn.Linear(self.hidden, 16))

    def optimizer(self, params):
        import torch

        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    def stream(self, rank, world_size, split, seed, device="cpu"):
        from gossip.training.data import BatchStream, node_seed

        idx = range(rank, len(self.y), world_size)
        return BatchStream((self.X, self.y), list(idx), 256, node_seed(seed, rank, 1), device)

    def loss(self, model, batch):
        import torch.nn.functional as F

        x, y = batch
        return F.mse_loss(model(x), y)

    def evaluate(self, model, device="cpu"):
        import torch
        import torch.nn.functional as F

        with torch.no_grad():
            return {"loss": float(F.mse_loss(model(self.X[:1024].to(device)), self.y[:1024].to(device)))}


def parameter_count(hidden: int, dim: int = 512, out: int = 16) -> int:
    """Parameters of :class:`WideTask`'s MLP (weights and biases), by formula.

    >>> parameter_count(4096)
    18948112
    """
    return dim * hidden + hidden + hidden * hidden + hidden + hidden * out + out


def _worker(device: str, hidden: int, jobs, out) -> None:
    """One node's process: runs a fresh Peer for each job until it gets None."""
    import torch

    from gossip.peer.driver import Peer
    from gossip.protocol.config import PeerConfig

    # the two nodes share the machine: half its cores each for the CPU side of the exchange (check, mix)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    task = WideTask(hidden)
    cuda = device == "cuda"
    while (job := jobs.get()) is not None:
        port, peer, steps, warmup, period = job
        marks: dict[int, float] = {}

        def on_step(p, first=warmup, last=steps) -> None:
            if p.node.step in (first, last):  # the timed window: the GPU's work done at both ends
                if cuda:
                    torch.cuda.synchronize()
                marks[p.node.step] = time.perf_counter()

        cfg = PeerConfig(listen=f"127.0.0.1:{port}", peers=(f"127.0.0.1:{peer}",), steps=steps, period=period,
                         device=device, settle=1.0, heartbeat=0.2, dead_after=10.0, timeout=30.0, grace=1.0)
        p = Peer(cfg, task=task)
        try:
            if not p.start():
                raise RuntimeError("the node stopped before training")
            p.on_step = on_step
            p.train()
            p.finish()
            s = p.summary()
        finally:
            p.close()
        if set(marks) != {warmup, steps}:
            raise RuntimeError(f"timed steps {sorted(marks)}, expected {warmup} and {steps}")
        out.put({"step_ms": (marks[steps] - marks[warmup]) / (steps - warmup) * 1e3,
                 "neighbor_distance": s["neighbor_distance"], "bytes_sent": s["bytes_sent"],
                 "params": sum(q.numel() for q in p.node.model.parameters()), "device": s["device"]})


def measure(device: str, steps: int, warmup: int, repeat: int, hidden: int, timeout: float) -> dict:
    """Run every configuration ``repeat`` times, interleaved; per configuration the
    median step time (ms) over the rounds, and every round's."""
    ctx = mp.get_context("spawn")
    jobs, out = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(device, hidden, jobs[i], out), daemon=True) for i in range(2)]
    for w in workers:
        w.start()
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    deadline = time.monotonic() + timeout
    try:
        names = list(CONFIGS)
        for r in range(repeat):
            for name in names[r % len(names):] + names[:r % len(names)]:  # each config first in turn
                ports = [free_port(), free_port()]
                for i in range(2):
                    jobs[i].put((ports[i], ports[1 - i], steps, warmup, CONFIGS[name]))
                pair: list[dict] = []
                while len(pair) < 2:
                    try:
                        pair.append(out.get(timeout=1.0))
                    except queue.Empty:
                        dead = [w.exitcode for w in workers if w.exitcode is not None]
                        if dead:  # its traceback is on stderr
                            raise RuntimeError(f"gpu_check: a worker exited ({dead}) during {name}, round {r + 1}")
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"gpu_check: {name} (round {r + 1}) did not finish within "
                                               f"{timeout:.0f} s of the start") from None
                runs[name].append({"step_ms": max(x["step_ms"] for x in pair),
                                   "neighbor_distance": max(x["neighbor_distance"] for x in pair),
                                   "bytes_sent": sum(x["bytes_sent"] for x in pair), "params": pair[0]["params"],
                                   "device": pair[0]["device"]})
        for j in jobs:
            j.put(None)
        for w in workers:
            w.join(timeout=30)
    finally:
        for w in workers:  # only the two workers this run started
            if w.is_alive():
                w.kill()
                w.join(timeout=10)
    return {name: {"step_ms": statistics.median(x["step_ms"] for x in rs), "runs_ms": [x["step_ms"] for x in rs],
                   "neighbor_distance": rs[-1]["neighbor_distance"], "bytes_sent": rs[-1]["bytes_sent"],
                   "params": rs[0]["params"], "device": rs[0]["device"]} for name, rs in runs.items()}


def group_check(timeout: float = 120.0, steps: int = 4, period: int = 2) -> dict:
    """Two groups of one, each started by torchrun running ``gossip.node`` with the default
    ``--device auto`` (``cuda:LOCAL_RANK`` where CUDA is present), FSDP inside, gossiping
    shard to shard; returns rank 0's summary of each (device, rounds mixed, bytes)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    ports = [free_port() for _ in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                               "--master-port", str(free_port()), "-m", "gossip.node",
                               "--listen", f"tcp://127.0.0.1:{port}", "--peers", f"127.0.0.1:{ports[1 - i]}",
                               "--intra", "fsdp", "--steps", str(steps), "--period", str(period), "--json",
                               "--settle", "0.5", "--heartbeat", "0.25", "--dead-after", "2"],
                              cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i, port in enumerate(ports)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"gpu_check: a group of one failed (exit {p.returncode}):\n{err.decode()[-2000:]}")
            outs.append(out.decode())
    finally:
        for p in procs:  # only the launchers this check started
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    ranks = [json.loads(next(ln for ln in reversed(o.splitlines()) if ln.startswith("{"))) for o in outs]
    for r in ranks:
        if r["rounds"] != steps // period or r["missing_neighbors"] or r["timed_out_rounds"]:
            raise RuntimeError(f"gpu_check: group {r['node']} mixed {r['rounds']} of {steps // period} rounds "
                               f"({r['missing_neighbors']} missing, {r['timed_out_rounds']} timed out)")
    return {"device": sorted({r["device"] for r in ranks}), "mixed": [r["rounds"] for r in ranks],
            "bytes_sent": [r["bytes_sent"] for r in ranks]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="local steps of each run (default 200)")
    ap.add_argument("--warmup", type=int, default=20, help="first steps of each run left out of its time (default 20)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the three configurations (default 3)")
    ap.add_argument("--hidden", type=int, default=4096, help="width of the MLP's hidden layers (default 4096)")
    ap.add_argument("--timeout", type=float, default=270.0, help="seconds for the whole measurement (default 270)")
    ap.add_argument("--dry-run", action="store_true",
                    help="the same measurement on the CPU, small (hidden 64, 24 steps, warm-up 4, 2 rounds)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.steps, args.warmup, args.repeat, args.hidden = 24, 4, 2, 64
    if args.hidden < 1:
        ap.error(f"--hidden must be positive, got {args.hidden}")
    if args.repeat < 1:
        ap.error(f"--repeat must be positive, got {args.repeat}")
    if not (0 < args.warmup < args.steps and (args.steps - args.warmup) % 4 == 0):
        ap.error(f"--warmup must be in (0, --steps) and --steps - --warmup a multiple of 4 (whole exchange "
                 f"periods of period4), got --steps {args.steps} --warmup {args.warmup}")
    import torch

    if args.dry_run:
        device, name = "cpu", "cpu (dry run)"
    elif torch.cuda.is_available():
        device, name = "cuda", torch.cuda.get_device_name(0)
    else:
        print("gpu_check: no CUDA device on this machine; nothing to measure (--dry-run checks the script on "
              "the CPU).")
        print(json.dumps({"cuda": False}))
        return 0
    params = parameter_count(args.hidden)
    print(f"device: {name}, torch {torch.__version__}; model {params:,} parameters ({params * 4 / 2**20:.1f} MiB)")
    r = measure(device, args.steps, args.warmup, args.repeat, args.hidden, args.timeout)
    if r["off"]["params"] != params:
        raise RuntimeError(f"the model has {r['off']['params']} parameters, the formula says {params}")
    if r["off"]["device"].split(":")[0] != device:
        raise RuntimeError(f"the nodes trained on {r['off']['device']}, not {device}")
    for key in CONFIGS:  # each configuration moved the bytes it claims: a model per node and exchange, or none
        exchanges = 0 if CONFIGS[key] > args.steps else args.steps // CONFIGS[key]
        low, sent = 2 * exchanges * params * 4, r[key]["bytes_sent"]
        if not (low <= sent < low + params * 4):
            raise RuntimeError(f"{key}: the two nodes sent {sent} bytes; {exchanges} exchanges of the model each "
                               f"is {low} bytes plus control messages")
    group = group_check()
    want = "cuda:0" if device == "cuda" else "cpu"
    if group["device"] != [want]:
        raise RuntimeError(f"a group of one with --device auto trained on {group['device']}, not {want}")
    print(f"group of one under torchrun, --device auto: {want}, {sum(group['mixed'])} shard rounds mixed")
    off = r["off"]["step_ms"]
    print(f"median over {args.repeat} rounds of the mean step time, steps {args.warmup + 1}-{args.steps} of "
          f"{args.steps}, slower node of two:")
    for key, label in (("off", "no exchange"), ("gossip", "gossip every step"), ("period4", "gossip every 4")):
        runs = ", ".join(f"{x:.2f}" for x in r[key]["runs_ms"])
        print(f"  {label:<18} {r[key]['step_ms']:8.2f} ms   x{r[key]['step_ms'] / off:.2f}   (rounds: {runs})")
    print(json.dumps({"cuda": device == "cuda", "device": name, "params": params, "model_mib": params * 4 / 2**20,
                      "steps": args.steps, "warmup": args.warmup, "repeat": args.repeat,
                      "off_ms": round(off, 3), "gossip_ms": round(r["gossip"]["step_ms"], 3),
                      "period4_ms": round(r["period4"]["step_ms"], 3),
                      "gossip_over_off": round(r["gossip"]["step_ms"] / off, 3),
                      "period4_over_off": round(r["period4"]["step_ms"] / off, 3),
                      "runs_ms": {k: [round(x, 3) for x in v["runs_ms"]] for k, v in r.items()},
                      "bytes_sent": {k: v["bytes_sent"] for k, v in r.items()},
                      "neighbor_distance": r["gossip"]["neighbor_distance"], "group": group}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
