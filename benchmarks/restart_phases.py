"""Where a restart's time goes: real ``gossip-node`` processes killed and started again.

``--nodes`` nodes on a ring (``benchmarks/churn.py``'s flags: synthetic task,
``--dead-after 2``, a checkpoint every 200 steps), each seeded with the next; every
``--every`` seconds one of nodes 1..n-1 (seeded choice) gets SIGKILL and, ``--down``
seconds later, starts again with the same flags and ``--resume``, as a fresh process
(it pays Python's and torch's imports, as on a real machine). Node 0 is never killed:
its longest pause between two steps says what the restarts cost a survivor.

For each restart, from the timestamps of the nodes' own log lines (one machine, one
clock):

- ``start_s``: from the spawn to "listening" (interpreter, imports, model, checkpoint);
- ``discover_s``: from "listening" to a member scheduling its join ("... joins the
  running cluster from round R"): hellos, and the old life's leave when the detector
  has not removed it yet;
- ``join_s``: from the scheduling to "took the state of" (the join round's margin,
  then the state pull);
- ``first_step_s``: from the state taken to "training as" (its first step);
- ``total_s``: spawn to first step (``down`` not included).

Reported: the median and worst of each over the restarts, node 0's longest pause,
and the rounds that timed out in any node's log.

    python benchmarks/restart_phases.py [--nodes 5] [--restarts 6] [--every 8] [--down 1]

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.churn import _args  # noqa: E402
from benchmarks.real_scale import stamps  # noqa: E402
from tests.cluster import Cluster, NodeProc, free_port  # noqa: E402

PHASES = ("start_s", "discover_s", "join_s", "first_step_s", "total_s")


def first_after(logs: list[str], needle: str, after: float) -> float | None:
    """The earliest time (seconds since the epoch) after ``after`` of a line holding
    ``needle`` in any of ``logs``."""
    times = [t for log in logs for t in stamps(log, needle) if t >= after - 0.001]
    return min(times, default=None)


def measure(work: Path, n: int, restarts: int, every: float, down: float, seed: int) -> dict:
    ports = [free_port() for _ in range(n)]
    ck = work / "ck"
    rng = random.Random(seed)
    spawns: list[tuple[int, float, NodeProc]] = []
    with Cluster(work) as c:
        current = [c.start(f"n{i}.0", _args(ports, i, 10**9, ck, []), port=ports[i]) for i in range(n)]
        for x in current:
            x.wait_for_log("training as", 300)
        time.sleep(every)
        for k in range(restarts):
            i = rng.randrange(1, n)
            current[i].proc.send_signal(signal.SIGKILL)
            current[i].proc.wait(30)
            time.sleep(down)
            spawned = time.time()
            current[i] = c.start(f"n{i}.{k + 1}", _args(ports, i, 10**9, ck, ["--resume"]), port=ports[i])
            spawns.append((i, spawned, current[i]))
            current[i].wait_for_log("training as", 120)
            time.sleep(every)
        for x in current:
            x.proc.send_signal(signal.SIGTERM)
        codes = [x.wait(120) for x in current]
        survivor = current[0].summary()
        logs = [x.log() for x in c.nodes]
    rows = []
    for i, spawned, proc in spawns:
        own = [proc.log()]
        listening = first_after(own, ": listening", spawned)
        scheduled = first_after(logs, f"127.0.0.1:{ports[i]} joins the running cluster", listening or spawned)
        took = first_after(own, "took the state of", scheduled or spawned)
        trains = first_after(own, "training as", took or spawned)
        if None in (listening, scheduled, took, trains):
            raise RuntimeError(f"restart of node {i} at {spawned}: a phase is missing from the logs "
                               f"(listening {listening}, scheduled {scheduled}, took {took}, trains {trains})")
        rows.append({"node": i, "start_s": listening - spawned, "discover_s": scheduled - listening,
                     "join_s": took - scheduled, "first_step_s": trains - took, "total_s": trains - spawned})
    out: dict = {"benchmark": "restart_phases", "nodes": n, "restarts": len(rows), "down_s": down}
    for key in PHASES:
        values = [r[key] for r in rows]
        out[f"{key}_median"] = round(statistics.median(values), 3)
        out[f"{key}_max"] = round(max(values), 3)
    out["survivor_max_step_gap_s"] = round(survivor["max_step_gap_s"], 3)
    out["timed_out_rounds"] = sum(log.count("timed out waiting") for log in logs)
    out["exit_codes"] = sorted(set(codes))
    out["restarts_detail"] = [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--restarts", type=int, default=6)
    ap.add_argument("--every", type=float, default=8.0, help="seconds between a restarted node's first step and the next kill")
    ap.add_argument("--down", type=float, default=1.0, help="seconds between a kill and the restart")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", help="keep the nodes' logs in this folder")
    args = ap.parse_args()
    if args.nodes < 3 or args.restarts < 1:
        ap.error("--nodes must be at least 3 and --restarts at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        r = measure(work, args.nodes, args.restarts, args.every, args.down, args.seed)
    print("restart phases (median / worst, s): " + ", ".join(
        f"{k[:-2]} {r[k + '_median']:.2f} / {r[k + '_max']:.2f}" for k in PHASES)
          + f"; survivor's longest pause {r['survivor_max_step_gap_s']:.2f} s; rounds timed out {r['timed_out_rounds']}")
    print(json.dumps(r))


if __name__ == "__main__":
    os.environ.setdefault("GOSSIP_TEST_FORK", "0")  # a restart pays its imports, as on a real machine
    main()
