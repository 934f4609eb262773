"""How long a fault stalls the survivors, with rounds that go on without a suspect and
with rounds that wait for it until it is declared dead (``--wait-for-suspects``).

The real protocol (``SimCluster``: the same ``Lifecycle`` and ``ControlPlane`` as
``gossip-node``, SWIM detector, on a virtual clock, so the machine's load changes
nothing): eight nodes on a ring, synthetic task, ``--dead-after 2``, steps of
``--step-time`` seconds. Three scenarios, each run twice side by side:

- ``kill``: nodes 2 and 5 crash at 3 s;
- ``stop``: node 2 is suspended at 3 s for 1 s (shorter than ``--dead-after``: it comes
  back in its old life) and again at 6 s for 3 s (longer: it is declared dead and
  joins again);
- ``slow``: node 2 trains 5 times slower than the rest (a slow but steady neighbour:
  it answers every probe, so the rule must never skip it);
- ``wan``: two datacenters of four (hierarchical topology), 160 ms apart one way: SWIM's
  probes across time out (0.2 s) and suspect the far side, but its state messages keep
  coming as often as ever, so the rule must never skip it either (the parameters must
  end bit-identical to the waiting run's).

Reported for each: the survivors' longest stretch between two steps, the virtual
seconds until every survivor finished, rounds skipped (gone on without a suspected
neighbour) and timed out; and the ratios (rule over waiting).

    python benchmarks/patience.py [--steps 600] [--step-time 0.01]

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
from gossip.transport.links import LinkModel  # noqa: E402

VICTIMS = {"kill": (2, 5), "stop": (), "slow": (), "wan": ()}


def run(scenario: str, steps: int, step_time: float, wait: bool) -> dict:
    slow = (lambda i: step_time * (5 if i == 2 else 1)) if scenario == "slow" else step_time
    wan = dict(configure=lambda i: {"dc": "east" if i < 4 else "west"}, topology="hierarchical:4,4",
               inter_link=LinkModel(latency=0.16, bandwidth=1e8)) if scenario == "wan" else {}
    c = SimCluster(8, steps=steps, step_time=slow, wait_for_suspects=wait, dead_after=2.0, **wan)
    if scenario == "kill":
        c.crash(2, at=3.0)
        c.crash(5, at=3.0)
    elif scenario == "stop":
        c.stall(2, at=3.0, until=4.0)
        c.stall(2, at=6.0, until=9.0)
    finished: dict[int, float] = {}
    c.on_step = lambda p: finished.__setitem__(p.index, c.now) if p.life.node.step == steps else None
    c.run(until=3600.0)
    rs = [r for i, r in enumerate(c.results()) if i not in VICTIMS[scenario]]
    assert all(r["exit"] == "done" and r["steps"] == steps for r in rs), rs
    survivors = [r for i, r in enumerate(rs) if scenario != "stop" or i != 2]
    return {"max_step_gap_s": round(max(r["max_step_gap_s"] for r in survivors), 3),
            "finished_s": round(max(finished.values()), 3),
            "skipped_rounds": sum(r["skipped_rounds"] for r in rs),
            "timed_out_rounds": sum(r["timed_out_rounds"] for r in rs),
            "params": sorted(r["params_sha256"] for r in rs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600, help="local steps each node trains (default: 600)")
    ap.add_argument("--step-time", type=float, default=0.01, help="seconds a step takes (default: 0.01)")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    out: dict = {"steps": args.steps, "step_time": args.step_time}
    for scenario in VICTIMS:
        rule, wait = run(scenario, args.steps, args.step_time, False), run(scenario, args.steps, args.step_time, True)
        same = rule.pop("params") == wait.pop("params")
        out[scenario] = {"rule": rule, "wait": wait, "same_parameters": same,
                         "stall_ratio": round(rule["max_step_gap_s"] / wait["max_step_gap_s"], 3),
                         "finish_ratio": round(rule["finished_s"] / wait["finished_s"], 3)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
