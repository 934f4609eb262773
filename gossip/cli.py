"""Command-line entry points: ``gossip-sim`` (and, with the ZeroMQ peer, ``gossip-node``).

Thin by design: parse, build a config, call the library, print. Bad input
prints one line naming the problem and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from typing import Any, Sequence

__all__ = ["sim_main", "build_sim_parser"]

EXIT_USAGE = 2


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v

    return parse


def _nonneg_int(name: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {v}")
        return v

    return parse


def _positive_float(name: str):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not (v > 0 and math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"{name} must be a positive number, got {text}")
        return v

    return parse


def add_training_args(p: argparse.ArgumentParser) -> None:
    """Options shared by gossip-sim and gossip-node."""
    from gossip.mixing import ALGORITHMS

    p.add_argument("--topology", default="ring", metavar="SPEC",
                   help="graph: ring, torus[:RxC], exponential, one-peer-exponential, complete, star, "
                        "random-regular[:D], small-world[:K,P], hierarchical:S1,S2[,intra=..,inter=..], file:PATH "
                        "(default: ring)")
    p.add_argument("--algorithm", default="gossip", choices=ALGORITHMS,
                   help="mixing rule: synchronous gossip (D-PSGD) or push-sum (SGP) (default: gossip)")
    p.add_argument("--compression", default="none", metavar="CODEC",
                   help="codec: none, fp16, bf16, int8[:BLOCK], topk:RATIO, randk:RATIO, sign (default: none)")
    p.add_argument("--period", type=_positive_int("--period"), default=1, metavar="K",
                   help="local steps between exchanges (default: 1)")
    p.add_argument("--task", default="synthetic", metavar="TASK",
                   help="synthetic, digits (needs scikit-learn), or module:attr; built-ins take options, "
                        "e.g. digits:lr=0.1,batch_size=64 (default: synthetic)")
    p.add_argument("--split", default="iid", metavar="SPLIT", help="iid or dirichlet:ALPHA (default: iid)")
    p.add_argument("--steps", type=_nonneg_int("--steps"), default=200, metavar="S",
                   help="local steps per node (default: 200)")
    p.add_argument("--seed", type=int, default=0, metavar="X", help="run seed (default: 0)")
    p.add_argument("--timeout", type=_positive_float("--timeout"), default=30.0, metavar="SEC",
                   help="how long a synchronous round waits for a neighbour (default: 30)")
    p.add_argument("--device", default="cpu", metavar="DEV", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON line with the final figures")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")


def build_sim_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gossip-sim",
        description="Simulate decentralized gossip training of N nodes on one machine, on a virtual clock "
                    "with modelled links and compute.")
    p.add_argument("--nodes", type=_positive_int("--nodes"), default=8, metavar="N", help="number of nodes (default: 8)")
    add_training_args(p)
    p.add_argument("--link", default="lan", metavar="SPEC",
                   help="intra-datacenter link: lan, wan, or latency=0.1ms,bandwidth=10Gbit,jitter=0,loss=0 "
                        "(default: lan = 0.1 ms, 10 Gbit/s)")
    p.add_argument("--inter-link", default="wan", metavar="SPEC",
                   help="inter-datacenter link, same syntax (default: wan = 50 ms, 100 Mbit/s)")
    p.add_argument("--compute", default="fixed:0.01", metavar="MODEL",
                   help="step time: fixed:SEC, lognormal:MEAN,CV, exponential:MEAN, measured[:SCALE] "
                        "(default: fixed:0.01)")
    p.add_argument("--slow", default=None, metavar="NODE=FACTOR,...", help="slow nodes, e.g. 3=5 (node 3 five times slower)")
    p.add_argument("--eval-every", type=_nonneg_int("--eval-every"), default=0, metavar="S",
                   help="local steps between evaluations (default: 0 = about 20 per run)")
    p.add_argument("--out", default=None, metavar="FILE.jsonl", help="write metrics as JSON lines")
    bar = p.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="always draw the progress bar")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="never draw it")
    return p


def setup_logging(verbosity: int, node: str | None = None) -> None:
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    prefix = f"[{node}] " if node else ""
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s",
                        stream=sys.stderr)


def _fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


def sim_main(argv: Sequence[str] | None = None) -> int:
    """``gossip-sim``: run one simulation; exit 0 on success, 2 on bad input."""
    args = build_sim_parser().parse_args(argv)
    setup_logging(args.verbose)
    from gossip.api import SimConfig, simulate

    try:
        cfg = SimConfig(nodes=args.nodes, topology=args.topology, algorithm=args.algorithm,
                        compression=args.compression, period=args.period, task=args.task, split=args.split,
                        steps=args.steps, seed=args.seed, link=args.link, inter_link=args.inter_link,
                        compute=args.compute, slow=args.slow, timeout=args.timeout, eval_every=args.eval_every,
                        device=args.device)
        result = simulate(cfg, out=args.out, progress=args.progress)
    except ValueError as e:
        return _fail("gossip-sim", str(e))
    except OSError as e:
        return _fail("gossip-sim", f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
    if args.json:
        print(json.dumps(result.summary, default=_json_default))
    elif not args.out:
        s = result.summary
        print(f"{s['nodes']} nodes, {s['topology']}, {s['algorithm']}: averaged-model accuracy "
              f"{s['final_accuracy']:.4f}, mean node accuracy {s['mean_node_accuracy']:.4f}, "
              f"consensus distance {s['consensus_distance']:.3g}, {s['bytes_sent'] / 1e6:.2f} MB sent, "
              f"{s['sim_time_s']:.2f} s simulated in {s['wall_time_s']:.2f} s")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(sim_main())
