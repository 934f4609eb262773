"""Many real ``gossip-node`` processes on this machine form one cluster and finish.

``--nodes`` processes (64 by default), each a real ``gossip-node`` with one torch thread,
``gossip-node``'s default timings and detector (SWIM), a ring, the synthetic task, each
seeded only with the next (a chain: node i knows node i+1's address and nothing else).
They start together (from the tests' fork server, which imported torch once: a process
costs its fork, not torch's imports); the run checks that every node reports the whole
cluster when it starts training ("training as k of n"), that every one finishes all its
steps with no timed-out round, and that the summaries agree on the member count.

Reported, from the nodes' own logs (wall seconds on this machine, whose load they
include):

- ``listen_s``: from the first node listening to the last (process start-up);
- ``form_s``: from the last node listening to the last node's first step (discovery
  over the chain and the fresh start's agreement, ``--settle`` of it);
- ``start_wait_s``: each node's own seconds from its first hello to its first step
  (worst and median);
- ``finish_s``: from the first node listening to the last node's exit.

    python benchmarks/real_scale.py [--nodes 64] [--steps 60]

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cluster import Cluster, free_port  # noqa: E402

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def stamps(log: str, needle: str) -> list[float]:
    """The times (seconds since the epoch) of the node log lines that hold ``needle``."""
    return [datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for line in log.splitlines() if needle in line and (m := STAMP.match(line))]


def stamp(log: str, needle: str) -> float:
    """The time of the first log line that holds ``needle``."""
    times = stamps(log, needle)
    if not times:
        raise ValueError(f"no log line holds {needle!r}")
    return times[0]


def run(work: Path, n: int, steps: int, limit: float) -> dict:
    ports = [free_port() for _ in range(n)]
    with Cluster(work) as c:
        nodes = [c.start(f"n{i}", ["--peers", f"127.0.0.1:{ports[(i + 1) % n]}", "--topology", "ring", "--task",
                                   "synthetic", "--steps", str(steps), "--json"], port=ports[i]) for i in range(n)]
        end = time.monotonic() + limit
        codes = [x.wait(max(1.0, end - time.monotonic())) for x in nodes]
        bad = [(x.name, code, x.log()[-1500:]) for x, code in zip(nodes, codes) if code != 0]
        if bad:
            raise RuntimeError(f"{len(bad)} of {n} nodes failed; the first: {bad[0]}")
        logs = [x.log() for x in nodes]
        summaries = [x.summary() for x in nodes]
    listening = [stamp(log, ": listening") for log in logs]
    training = [stamp(log, ": training as ") for log in logs]
    sizes = {int(re.search(r": training as \d+ of (\d+)", log).group(1)) for log in logs}  # type: ignore[union-attr]
    problems = []
    if sizes != {n}:
        problems.append(f"nodes started training in clusters of {sorted(sizes)}, not one of {n}")
    if any(s["steps"] != steps for s in summaries):
        problems.append(f"steps {sorted({s['steps'] for s in summaries})}, not {steps} each")
    if any(s["timed_out_rounds"] for s in summaries):
        problems.append(f"{sum(s['timed_out_rounds'] for s in summaries)} rounds timed out")
    if problems:
        raise RuntimeError("; ".join(problems))
    waits = sorted(s["start_wait_s"] for s in summaries)
    return {"benchmark": "real_scale", "nodes": n, "steps": steps,
            "listen_s": round(max(listening) - min(listening), 2),
            "form_s": round(max(training) - max(listening), 2),
            "start_wait_s_max": round(waits[-1], 2), "start_wait_s_median": round(statistics.median(waits), 2),
            "finish_s": round(max(s["wall_time_s"] for s in summaries), 1),
            "members": sorted({s["members"] for s in summaries}),
            "steps_per_s_median": round(statistics.median(s["steps_per_s"] for s in summaries), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--limit", type=float, default=900.0, help="seconds the whole run may take")
    ap.add_argument("--keep", help="keep the nodes' logs in this folder")
    args = ap.parse_args()
    if args.nodes < 2 or args.steps < 1:
        ap.error("--nodes must be at least 2 and --steps at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        r = run(work, args.nodes, args.steps, args.limit)
    print(f"{r['nodes']} real nodes: all listening within {r['listen_s']} s, every node training {r['form_s']} s "
          f"after the last listened (start wait: worst {r['start_wait_s_max']} s, median "
          f"{r['start_wait_s_median']} s), all {r['steps']} steps done in {r['finish_s']} s; members at the end "
          f"{r['members']}")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
