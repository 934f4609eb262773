"""Hybrid parallelism benchmark: one gossip exchange between two groups of K ranks.

Two groups on this machine, each started by torchrun with K = 1, 2, 4 ranks
(gloo, CPU, ``--intra fsdp``: each rank holds 1/K of the model). Each rank's
connection is emulated at ``--gbit`` Gbit/s (the transport's link emulator,
``bandwidth=1Gbit``), as on GPU servers with one network card per GPU, or WAN
links where one TCP stream is window-bound. Rank r of one group exchanges its
shard with rank r of the other, so the K streams run in parallel.

Per K: ``--warmup`` untimed exchanges first (the first one's memory is
measured: the receive buffers are fresh then), then ``--rounds`` timed ones;
the figure is their median. The time of an exchange is the slowest rank's (the
group's round ends when its last shard is mixed). The second exchange of a
process is the slow one (up to twice the others): the C library serves the
receive frames from a heap that grows, page fault by page fault, once it has
freed the first exchange's mappings; from the third on, memory is reused.
Memory per rank is from the kernel's peak RSS (``VmHWM``, reset just before the
exchange through ``/proc/self/clear_refs``):

- ``peak_over_model``: the rank's peak during the exchange minus its RSS before
  the model was built (torch, FSDP and gloo loaded), over the full model size:
  its shard plus what the exchange needs (the neighbour's shard, received; the
  transport's sockets and threads);
- ``exchange_peak_over_model``: the peak during the exchange minus the RSS just
  before it, over the full model size (what the exchange itself adds).

Ends with one JSON line holding ``exchange_time_k1_over_k4`` (target >= 3) and
the K = 4 memory figures (target <= 1/K + 10%).

    nice -n 10 python benchmarks/hybrid.py [--mib 256] [--ks 1,2,4] [--gbit 1] [--rounds 3] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gossip.transport.ports import free_port, free_ports  # noqa: E402

WIDTH = 4096  # a layer is WIDTH x WIDTH float32: 64 MiB


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def worker(args: argparse.Namespace) -> None:
    """One rank (run by torchrun): build the sharded model, exchange, write figures."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from gossip.groups.group import start_group
    from gossip.groups.member import GroupMember

    torch.set_num_threads(1)
    group = start_group("fsdp", "cpu")
    rss_start = _status("VmRSS")  # the runtime (torch, FSDP, gloo) without the model
    layers = max(1, args.mib // 64)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")  # only this rank's shard is ever allocated
    _, view = group.wrap(model)  # already sharded: wrap re-homes the shards into one vector
    with torch.no_grad():
        view.flat.normal_(generator=torch.Generator().manual_seed(group.rank))
    full_bytes = view.total * 4
    groups = args.groups.split(",")
    member = GroupMember(group, view, args.group, groups, timeout=120.0,
                         emulate=f"bandwidth={args.gbit}Gbit,latency=0")
    out = {"rank": group.rank, "k": group.size, "group": args.group, "full_bytes": full_bytes,
           "shard_bytes": view.flat.numel() * 4, "times": []}
    with member:
        member.connect(120.0)
        rss_before = _status("VmRSS")
        _reset_peak()
        member.exchange(args.period)
        hwm = _status("VmHWM")
        out["peak_over_model"] = (hwm - rss_start) / full_bytes
        out["exchange_peak_over_model"] = (hwm - rss_before) / full_bytes
        for i in range(args.warmup - 1 + args.rounds):
            group.barrier()
            t0 = time.perf_counter()
            member.exchange(args.period * (i + 2))
            if i >= args.warmup - 1:
                out["times"].append(time.perf_counter() - t0)
        s = member.summary()
        out.update(sent_sizes=s["sent_sizes"], missing=s["missing"], timed_out=s["timed_out"])
        group.barrier()
    with open(os.path.join(args.out, f"{args.group.rpartition(':')[2]}-{group.rank}.json"), "w") as f:
        json.dump(out, f)
    group.close()


def run_k(k: int, args: argparse.Namespace, tmp: str) -> dict:
    """Both groups of ``k`` ranks under torchrun; the per-rank figures gathered."""
    groups = [f"127.0.0.1:{free_ports(k, consecutive=True)[0]}" for _ in range(2)]
    procs = []
    for g in groups:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(k),
               "--master-port", str(free_port()), str(Path(__file__).resolve()), "--worker",
               "--group", g, "--groups", ",".join(groups), "--mib", str(args.mib), "--gbit", str(args.gbit),
               "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--out", tmp]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      env=dict(os.environ, PYTHONPATH=str(ROOT))))
    try:
        for p in procs:
            _, err = p.communicate(timeout=args.limit)
            if p.returncode != 0:
                raise RuntimeError(f"a group of {k} failed (exit {p.returncode}):\n{err.decode()[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    ranks = [json.loads((Path(tmp) / f"{g.rpartition(':')[2]}-{r}.json").read_text())
             for g in groups for r in range(k)]
    rounds = len(ranks[0]["times"])
    per_round = [max(r["times"][i] for r in ranks) for i in range(rounds)]  # the slowest rank ends the round
    return {"k": k, "exchange_s": statistics.median(per_round), "rounds_s": per_round,
            "shard_mib": ranks[0]["shard_bytes"] / 2**20, "model_mib": ranks[0]["full_bytes"] / 2**20,
            "max_message_mib": max(max(r["sent_sizes"]) for r in ranks) / 2**20,
            "peak_over_model": max(r["peak_over_model"] for r in ranks),
            "exchange_peak_over_model": max(r["exchange_peak_over_model"] for r in ranks),
            "missing": sum(r["missing"] for r in ranks), "timed_out": sum(r["timed_out"] for r in ranks)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="model size in MiB (a multiple of 64)")
    p.add_argument("--ks", default="1,2,4", help="ranks per group to run")
    p.add_argument("--gbit", type=float, default=1.0, help="emulated bandwidth of each rank's connection")
    p.add_argument("--rounds", type=int, default=3, help="timed exchanges per K (their median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed exchanges before them (the first: memory)")
    p.add_argument("--limit", type=float, default=600.0, help="seconds a K may take")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--group", help=argparse.SUPPRESS)
    p.add_argument("--groups", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--period", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.warmup < 1 or args.rounds < 1:
        p.error(f"--warmup and --rounds must be positive, got {args.warmup} and {args.rounds}")
    ks = [int(k) for k in args.ks.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in ks:
            rows.append(run_k(k, args, tmp))
    ideal = rows[0]["model_mib"] * 2**20 * 8 / (args.gbit * 1e9)
    print(f"two groups, {args.mib} MiB model (fsdp), each rank's link {args.gbit:g} Gbit/s "
          f"(one stream of the whole model: {ideal:.2f} s)")
    print(f"{'K':>3} {'shard MiB':>10} {'message MiB':>12} {'exchange s':>11} {'rounds s':>18} "
          f"{'peak/model':>11} {'exchange peak/model':>20} {'1/K+10%':>8}")
    for r in rows:
        print(f"{r['k']:>3} {r['shard_mib']:>10.1f} {r['max_message_mib']:>12.2f} {r['exchange_s']:>11.2f} "
              f"{' '.join(f'{t:.2f}' for t in r['rounds_s']):>18} {r['peak_over_model']:>11.3f} "
              f"{r['exchange_peak_over_model']:>20.3f} {1 / r['k'] + 0.1:>8.3f}")
    by_k = {r["k"]: r for r in rows}
    summary = {"mib": args.mib, "gbit": args.gbit, "ks": ks,
               "exchange_s": {str(r["k"]): round(r["exchange_s"], 3) for r in rows},
               "exchange_time_k1_over_k4": (round(by_k[1]["exchange_s"] / by_k[4]["exchange_s"], 3)
                                            if 1 in by_k and 4 in by_k else None),
               "peak_over_model": {str(r["k"]): round(r["peak_over_model"], 3) for r in rows},
               "exchange_peak_over_model": {str(r["k"]): round(r["exchange_peak_over_model"], 3) for r in rows},
               "missing": sum(r["missing"] for r in rows), "timed_out": sum(r["timed_out"] for r in rows)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
