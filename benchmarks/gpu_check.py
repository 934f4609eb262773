"""GPU check: two gossip nodes on CUDA over loopback vs. the same training alone.

Run on a machine with an NVIDIA GPU:

    python benchmarks/gpu_check.py [--steps 300] [--hidden 4096]

It trains a wide MLP (about 4096^2 * 3 parameters) on generated data for a few
hundred steps three ways, in one run:

  alone    one process, no communication (the step time to beat)
  gossip   two processes on the same GPU, D-PSGD over loopback every step
  period4  the same with an exchange every 4 local steps

and prints the mean step time of each, the ratios, and one JSON line. On a
machine without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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
        from gossip.data import BatchStream, node_seed

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(port: int, peer: int | None, steps: int, hidden: int, period: int, out) -> None:
    import torch

    from gossip.peer import Peer, PeerConfig

    cfg = PeerConfig(listen=f"127.0.0.1:{port}", peers=(f"127.0.0.1:{peer}",) if peer else (), steps=steps,
                     period=period, device="cuda", settle=1.0, heartbeat=0.2, timeout=30.0, grace=5.0)
    p = Peer(cfg, task=WideTask(hidden))
    try:
        assert p.start()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        p.train()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        p.finish()
        s = p.summary()
    finally:
        p.close()
    out.put({"step_ms": elapsed / steps * 1e3, "neighbor_distance": s["neighbor_distance"],
             "bytes_sent": s["bytes_sent"], "params": p.model_bytes})


def measure(n: int, steps: int, hidden: int, period: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = [free_port() for _ in range(n)]
    procs = [ctx.Process(target=_node, args=(ports[i], ports[(i + 1) % n] if n > 1 else None, steps, hidden,
                                             period, out)) for i in range(n)]
    for p in procs:
        p.start()
    results = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return {"step_ms": max(r["step_ms"] for r in results), "neighbor_distance": results[0]["neighbor_distance"],
            "model_mib": results[0]["params"] / 2**20}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--hidden", type=int, default=4096)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine; nothing to measure.")
        print(json.dumps({"cuda": False}))
        return 0
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    alone = measure(1, args.steps, args.hidden, 10**9)
    gossip = measure(2, args.steps, args.hidden, 1)
    period4 = measure(2, args.steps, args.hidden, 4)
    print(f"model {alone['model_mib']:.1f} MiB; mean step time over {args.steps} steps:")
    for name, r in (("alone", alone), ("gossip every step", gossip), ("gossip every 4", period4)):
        print(f"  {name:<20} {r['step_ms']:8.2f} ms   x{r['step_ms'] / alone['step_ms']:.2f}")
    print(json.dumps({"cuda": True, "device": torch.cuda.get_device_name(0), "model_mib": alone["model_mib"],
                      "alone_ms": alone["step_ms"], "gossip_ms": gossip["step_ms"],
                      "period4_ms": period4["step_ms"], "gossip_over_alone": gossip["step_ms"] / alone["step_ms"],
                      "period4_over_alone": period4["step_ms"] / alone["step_ms"],
                      "neighbor_distance": gossip["neighbor_distance"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
