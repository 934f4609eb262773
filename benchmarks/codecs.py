"""Codec throughput: encode + decode time of a flat float32 tensor, relative to one memcpy.

For each codec, encodes and decodes ``--numel`` Gaussian float32 values ``--repeat``
times and takes the median of each; the memcpy reference is the median time of
``x.clone()`` on the same tensor. Rounds are interleaved (one clone, then every codec
once, per round) so that load from other processes affects all figures alike.

Prints a table (codec, wire MB, compression ratio, encode ms, decode ms,
(encode + decode) / memcpy) and ends with one JSON line mapping each codec spec to
its (encode + decode) / memcpy ratio, plus ``memcpy_ms`` and ``targets_met``
(fp16, bf16 and int8 within 4 memcpys, top-k within 20).

Usage::

    python benchmarks/codecs.py [--numel 16777216] [--repeat 5] [--device cpu]
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
    """Median encode/decode milliseconds per codec spec, and the memcpy reference under ``"memcpy"``."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
    codecs = {spec: get_codec(spec) for spec in specs}
    for codec in codecs.values():  # warm up kernels and allocator
        codec.decode(codec.encode(x, seed=1), device=device)
    memcpy: list[float] = []
    encode: dict[str, list[float]] = {spec: [] for spec in specs}
    decode: dict[str, list[float]] = {spec: [] for spec in specs}
    wire: dict[str, int] = {}
    for round_ in range(repeat):
        memcpy.append(timed(x.clone, device)[0])
        for spec, codec in codecs.items():
            ms, enc = timed(lambda: codec.encode(x, seed=round_), device)
            encode[spec].append(ms)
            decode[spec].append(timed(lambda: codec.decode(enc, device=device), device)[0])
            wire[spec] = enc.nbytes
            del enc
    results = {"memcpy": {"ms": statistics.median(memcpy)}}
    for spec, codec in codecs.items():
        results[spec] = {
            "wire_mb": wire[spec] / 2**20,
            "ratio": codec.ratio(numel, "float32"),
            "encode_ms": statistics.median(encode[spec]),
            "decode_ms": statistics.median(decode[spec]),
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=2**24, help="values per tensor (default 16777216)")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds; medians are reported (default 5)")
    parser.add_argument("--device", default="cpu", help="torch device to encode from and decode to (default cpu)")
    parser.add_argument("--codecs", default=",".join(SPECS), help="comma-separated codec specs")
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
        f"memcpy (x.clone) {memcpy_ms:.1f} ms"
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
    summary["targets_met"] = all(summary[spec] <= limit for spec, limit in checked.items())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
