"""The deadline rule, measured: how long a kill stalls its neighbours, with and without it.

The real protocol (``SimCluster``: the same ``Lifecycle`` and ``ControlPlane`` as
``gossip-node``, on a virtual clock, so the machine's load changes nothing): eight
nodes on a ring, synthetic task, ``--dead-after 2``; nodes 2 and 5 are killed at 3 s.
Two runs side by side:

- ``rule``: the default ``--min-wait 0.5`` (gossip/protocol/patience.py): a round
  stops waiting for a neighbour silent for 4x its usual gap, at least 0.5 s;
- ``without``: ``--min-wait`` equal to ``--timeout`` (5 s), so a round waits for a
  silent neighbour until the failure detector removes it (the rule before).

Reported for each: the survivors' longest stretch between two steps, the virtual
seconds until every survivor finished, rounds skipped and timed out; and the ratios.

    python benchmarks/patience.py [--steps 600]

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gossip.sim.cluster import SimCluster  # noqa: E402


def run(steps: int, min_wait: float) -> dict:
    c = SimCluster(8, steps=steps, min_wait=min_wait)
    c.crash(2, at=3.0)
    c.crash(5, at=3.0)
    finished: dict[int, float] = {}
    c.on_step = lambda p: finished.__setitem__(p.index, c.now) if p.life.node.step == steps else None
    c.run(until=600.0)
    rs = [r for i, r in enumerate(c.results()) if i not in (2, 5)]
    assert all(r["exit"] == "done" and r["steps"] == steps for r in rs), rs
    return {"max_step_gap_s": round(max(r["max_step_gap_s"] for r in rs), 3),
            "finished_s": round(max(finished.values()), 3),
            "skipped_rounds": sum(r["skipped_rounds"] for r in rs),
            "timed_out_rounds": sum(r["timed_out_rounds"] for r in rs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600, help="local steps each node trains (default: 600)")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    rule, without = run(args.steps, 0.5), run(args.steps, 5.0)
    out = {"steps": args.steps, "rule": rule, "without": without,
           "stall_ratio": round(rule["max_step_gap_s"] / without["max_step_gap_s"], 3),
           "finish_ratio": round(rule["finished_s"] / without["finished_s"], 3)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
