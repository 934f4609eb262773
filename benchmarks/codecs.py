"""Codec throughput: encode + decode time of a flat float32 tensor, relative to one memcpy.

For each codec, encodes and decodes ``--numel`` Gaussian float32 values ``--repeat``
times and takes the median of each. The memcpy reference is the median time of
``dst.copy_(x)`` into a buffer of the same size already in use (warm: no page
faults), as ``benchmarks/transport.py`` measures it; ``x.clone()`` (a copy into fresh
memory, which also maps and faults in its pages) is timed beside it and reported as
``clone_ms``. Rounds are interleaved (one copy, one clone, then every codec once, per
round) so that load from other processes affects all figures alike.

Prints a table (codec, wire MB, compression ratio, encode ms, decode ms,
(encode + decode) / memcpy) and ends with one JSON line mapping each codec spec to
its (encode + decode) / memcpy ratio, plus ``memcpy_ms``, ``clone_ms`` and
``targets_met`` (fp16, bf16 and int8 within 4 memcpys, top-k within 20).

Unless ``--no-accuracy`` is given, it then trains digits on an 8-node ring
(``gossip-sim --nodes 8 --topology ring --task digits --compression C``, 200 steps,
seed 0) once per codec with ``--algorithm gossip`` (plain D-PSGD uncompressed, CHOCO
with every lossy codec) and once with ``--algorithm naive --compression topk:0.01``
(compressed averaging without error feedback), and prints an accuracy-vs-bytes
table; the JSON line carries those figures under ``"accuracy"``, and the headline
figures of CHOCO top-1% against uncompressed gossip: ``topk_minus_none_pts`` (the
averaged model's accuracy), ``topk_minus_none_node_pts`` (the mean node's), in
points, and ``topk_fewer_bytes``.

Usage::

    python benchmarks/codecs.py [--numel 16777216] [--repeat 5] [--device cpu] [--no-accuracy]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

try:
    from gossip.compression import get_codec
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gossip.compression import get_codec

SPECS = ["identity", "fp16", "bf16", "int8", "topk:0.01", "randk:0.01", "sign"]

#: Largest allowed (encode + decode) / memcpy per codec spec.
TARGETS = {"fp16": 4.0, "bf16": 4.0, "int8": 4.0, "topk:0.01": 20.0}

#: (--algorithm, --compression, --gamma) of the accuracy-vs-bytes table. The last row is a
#: control: CHOCO with gamma 1e-4 barely mixes, so it shows what replicas that (almost)
#: never talk reach on the same data.
ACCURACY_RUNS = [("gossip", "none", None), ("gossip", "fp16", None), ("gossip", "bf16", None),
                 ("gossip", "int8", None), ("gossip", "topk:0.01", None), ("gossip", "randk:0.01", None),
                 ("gossip", "sign", None), ("naive", "topk:0.01", None), ("choco", "topk:0.01", 1e-4)]


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Run ``fn`` once; return (milliseconds, result), waiting for the GPU if there is one."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3, result


def throughput(numel: int, repeat: int, specs: list[str], device: torch.device) -> dict[str, dict[str, float]]:
    """Median encode/decode milliseconds per codec spec, the memcpy reference (a warm
    ``copy_``) under ``"memcpy"`` and a clone (a copy into fresh memory) under ``"clone"``."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
    dst = torch.empty_like(x).copy_(x)  # written once, so its pages are mapped before the timed copies
    codecs = {spec: get_codec(spec) for spec in specs}
    for codec in codecs.values():  # warm up kernels and allocator
        codec.decode(codec.encode(x, seed=1), device=device)
    memcpy: list[float] = []
    clone: list[float] = []
    encode: dict[str, list[float]] = {spec: [] for spec in specs}
    decode: dict[str, list[float]] = {spec: [] for spec in specs}
    wire: dict[str, int] = {}
    for round_ in range(repeat):
        memcpy.append(timed(lambda: dst.copy_(x), device)[0])
        clone.append(timed(x.clone, device)[0])
        for spec, codec in codecs.items():
            ms, enc = timed(lambda: codec.encode(x, seed=round_), device)
            encode[spec].append(ms)
            decode[spec].append(timed(lambda e=enc: codec.decode(e, device=device), device)[0])
            wire[spec] = enc.nbytes
            del enc
    results = {"memcpy": {"ms": statistics.median(memcpy)}, "clone": {"ms": statistics.median(clone)}}
    for spec, codec in codecs.items():
        results[spec] = {
            "wire_mb": wire[spec] / 2**20,
            "ratio": codec.ratio(numel, "float32"),
            "encode_ms": statistics.median(encode[spec]),
            "decode_ms": statistics.median(decode[spec]),
        }
    return results


def accuracy_vs_bytes(nodes: int, steps: int, seed: int) -> dict[str, dict[str, object]]:
    """Train digits on a ring once per row of :data:`ACCURACY_RUNS`; print a table and
    return ``{"ALGORITHM CODEC[ gamma=G]": figures}``."""
    from gossip.api import Simulation

    rows: dict[str, dict[str, object]] = {}
    print(f"\n# digits, {nodes}-node ring, {steps} steps per node, seed {seed} (iid, lr 0.05)")
    header = (f"{'--algorithm':<12} {'--compression':<14} {'rule':<7} {'gamma':>6} {'accuracy':>9} "
              f"{'node acc':>9} {'consensus':>10} {'bytes_sent':>12} {'fewer bytes':>12}")
    print(header)
    print("-" * len(header))
    for algorithm, codec, g in ACCURACY_RUNS:
        sim = Simulation(nodes=nodes, topology="ring", task="digits", algorithm=algorithm, compression=codec,
                         gamma=g, steps=steps, seed=seed, eval_every=steps)
        rule = sim.nodes[0].rule
        s = sim.run().result().summary
        gamma = getattr(rule, "gamma", None)
        name = "naive" if algorithm == "naive" else rule.name
        row = {"rule": name, "gamma": gamma, "final_accuracy": round(s["final_accuracy"], 4),
               "mean_node_accuracy": round(s["mean_node_accuracy"], 4),
               "consensus_distance": round(s["consensus_distance"], 4), "bytes_sent": s["bytes_sent"]}
        base = rows.get("gossip none", row)["bytes_sent"]
        row["ratio"] = round(base / s["bytes_sent"], 2)
        rows[f"{algorithm} {codec}" + ("" if g is None else f" gamma={g:g}")] = row
        print(f"{algorithm:<12} {codec:<14} {name:<7} {'-' if gamma is None else f'{gamma:.3g}':>6} "
              f"{row['final_accuracy']:>9.4f} {row['mean_node_accuracy']:>9.4f} {row['consensus_distance']:>10.3g} "
              f"{row['bytes_sent']:>12} {row['ratio']:>11.2f}x", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=2**24, help="values per tensor (default 16777216)")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds; medians are reported (default 5)")
    parser.add_argument("--device", default="cpu", help="torch device to encode from and decode to (default cpu)")
    parser.add_argument("--codecs", default=",".join(SPECS), help="comma-separated codec specs")
    parser.add_argument("--accuracy", action=argparse.BooleanOptionalAction, default=True,
                        help="also train digits on an 8-node ring per codec (default: on)")
    parser.add_argument("--steps", type=int, default=200, help="local steps of each training run (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the training runs (default 0)")
    args = parser.parse_args(argv)
    if args.numel < 1:
        parser.error(f"--numel must be positive, got {args.numel}")
    if args.repeat < 1:
        parser.error(f"--repeat must be positive, got {args.repeat}")
    device = torch.device(args.device)
    specs = [spec.strip() for spec in args.codecs.split(",") if spec.strip()]

    results = throughput(args.numel, args.repeat, specs, device)
    memcpy_ms = results["memcpy"]["ms"]
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}, "
        f"numel {args.numel} float32 ({args.numel * 4 / 2**20:.0f} MiB), repeat {args.repeat}, "
        f"memcpy (warm copy_) {memcpy_ms:.1f} ms, clone (fresh memory) {results['clone']['ms']:.1f} ms"
    )
    header = f"{'codec':<12} {'wire MB':>9} {'ratio':>7} {'encode ms':>10} {'decode ms':>10} {'(enc+dec)/memcpy':>17}"
    print(header)
    print("-" * len(header))
    summary: dict[str, object] = {}
    for spec in specs:
        row = results[spec]
        relative = (row["encode_ms"] + row["decode_ms"]) / memcpy_ms
        summary[spec] = round(relative, 3)
        print(
            f"{spec:<12} {row['wire_mb']:>9.2f} {row['ratio']:>7.2f} {row['encode_ms']:>10.1f} "
            f"{row['decode_ms']:>10.1f} {relative:>17.2f}"
        )
    checked = {spec: limit for spec, limit in TARGETS.items() if spec in summary}
    summary["memcpy_ms"] = round(memcpy_ms, 2)
    summary["clone_ms"] = round(results["clone"]["ms"], 2)
    summary["targets_met"] = all(summary[spec] <= limit for spec, limit in checked.items())
    if args.accuracy:
        rows = summary["accuracy"] = accuracy_vs_bytes(8, args.steps, args.seed)
        # the headline: CHOCO top-1% against uncompressed gossip, in accuracy points and bytes
        none, topk = rows["gossip none"], rows["gossip topk:0.01"]
        summary["topk_minus_none_pts"] = round(100 * (topk["final_accuracy"] - none["final_accuracy"]), 2)
        summary["topk_minus_none_node_pts"] = round(100 * (topk["mean_node_accuracy"] - none["mean_node_accuracy"]), 2)
        summary["topk_fewer_bytes"] = topk["ratio"]
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
