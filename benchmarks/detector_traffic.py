"""Control traffic and crash detection of the whole peer, heartbeat against SWIM.

Runs the real peer (lifecycle, control plane, failure detector, wire frames) of
``n`` nodes in the simulator (:class:`gossip.sim.cluster.SimCluster`) on a
virtual clock, training a synthetic task, once with ``detector="heartbeat"``
and once with ``detector="swim"``. Counts the control messages (every kind but
the node thread's state, state-request, state-reply and average) sent per node
per second between ``--warmup`` and ``--warmup + --seconds``; then one node
crashes and ``detect_s`` is the time until the last survivor has removed it.

    python benchmarks/detector_traffic.py --nodes 8,16,32

Ends with one JSON line: ``msgs_per_node_s`` and ``detect_s``, each a map
detector -> node count -> figure.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from gossip.sim.cluster import SimCluster, node_id  # noqa: E402

NODE_KINDS = {"state", "state-request", "state-reply", "average"}


class _Removals(logging.Handler):
    """Records (virtual time, message) of the member table's removals."""

    def __init__(self, cluster: SimCluster) -> None:
        super().__init__(logging.WARNING)
        self.cluster = cluster
        self.seen: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((self.cluster.now, record.getMessage()))


def measure(n: int, detector: str, *, warmup: float, seconds: float, heartbeat: float,
            dead_after: float) -> tuple[float, float]:
    """(control messages per node per second, seconds from the crash to its last removal)."""
    kinds: Counter[str] = Counter()
    c = SimCluster(n, steps=10**6, detector=detector, heartbeat=heartbeat, dead_after=dead_after, step_time=0.05)
    send = c._send
    window = (warmup, warmup + seconds)

    def counting(p, dst, msg, droppable):  # noqa: ANN001
        if window[0] <= c.now < window[1]:
            kinds[msg.kind] += 1
        send(p, dst, msg, droppable)

    c._send = counting  # type: ignore[method-assign]
    crash = window[1]
    victim = n - 1
    c.crash(victim, at=crash)
    removals = _Removals(c)
    members_log = logging.getLogger("gossip.membership")
    members_log.addHandler(removals)
    try:
        c.run(until=crash + 4 * dead_after + 2 * n * heartbeat)
    finally:
        members_log.removeHandler(removals)
    ctrl = sum(v for k, v in kinds.items() if k not in NODE_KINDS)
    needle = f"member {node_id(victim)} removed"
    times = [t for t, text in removals.seen if needle in text and t >= crash]
    if len(times) < n - 1:
        raise SystemExit(f"{detector} n={n}: only {len(times)} of {n - 1} survivors removed the crashed node")
    return ctrl / n / seconds, max(times) - crash


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="8,16,32", help="node counts, comma-separated (default: 8,16,32)")
    ap.add_argument("--warmup", type=float, default=10.0, help="virtual seconds before counting (default: 10)")
    ap.add_argument("--seconds", type=float, default=10.0, help="virtual seconds counted (default: 10)")
    ap.add_argument("--heartbeat", type=float, default=0.5)
    ap.add_argument("--dead-after", type=float, default=3.0)
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.nodes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--nodes must be integers separated by commas, got {args.nodes!r}")
    if not sizes or min(sizes) < 3:
        ap.error("--nodes: each count must be at least 3")
    torch.set_num_threads(1)
    logging.getLogger("gossip").setLevel(logging.WARNING)
    out: dict[str, dict] = {"msgs_per_node_s": {}, "detect_s": {}}
    for det in ("heartbeat", "swim"):
        for key in out:
            out[key][det] = {}
        for n in sizes:
            rate, detect = measure(n, det, warmup=args.warmup, seconds=args.seconds, heartbeat=args.heartbeat,
                                   dead_after=args.dead_after)
            out["msgs_per_node_s"][det][str(n)] = round(rate, 2)
            out["detect_s"][det][str(n)] = round(detect, 2)
            print(f"{det:9s} n={n:4d}  {rate:7.2f} control msg/node/s  crash removed by all after {detect:.2f} s",
                  file=sys.stderr)
    out.update(heartbeat=args.heartbeat, dead_after=args.dead_after)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
