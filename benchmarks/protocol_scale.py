"""The whole control plane at 16 to thousands of members: what one node sends, how long a
cluster takes to form, to learn of a crash and to take in a joiner.

Unlike ``membership_scale.py`` (the bare SWIM objects), this runs the protocol that
``gossip-node`` runs: ``SimCluster`` processes each run the same ``Lifecycle`` and
``ControlPlane`` (discovery, the start, member lists, SWIM, leave and join rounds, state
pulls), exchanging real wire frames, on a virtual clock, so the machine's load changes no
figure but the wall time. ``gossip-node``'s default timings (``Timing()``: probes every
0.5 s, dead after 3 s) and detector (SWIM), a ring, a tiny synthetic task (the model is
a few hundred bytes: this measures the control plane, not the model exchange), a step
of ``--step-time`` virtual seconds, each node seeded only with the next (a chain), and
``--loss`` of the control messages lost (the model's messages arrive, as over ZeroMQ's
TCP: a lost one would hold its round up to ``--timeout``).

One run per cluster size ``n``:

- ``form_s``: virtual seconds from the start until every node has taken a step;
- ``ctrl_msgs_per_node_s``, ``ctrl_bytes_per_node_s``: control messages (every kind but
  the node thread's model traffic, ``gossip.protocol.control.NODE_KINDS``) and their
  bytes on the wire, sent per node per second over ``--steady`` seconds of training
  after formation; with ``biggest_ctrl_msg_bytes`` by kind over the whole run;
- ``detect_s``: for each of ``--crashes`` crashes in turn, the seconds until every
  survivor has removed the crashed node from its member table (the worst; each crash's
  in ``detect_each_s``);
- ``crash_ctrl_bytes_per_node_s``, ``crash_tables``: the control bytes each survivor sent
  per second from a crash until every survivor removed it (the worst crash), and the
  whole member tables (``members`` messages that are not deltas) sent over all crashes'
  windows: anti-entropy while a crash's news spreads (every SWIM message between two
  survivors whose digests differ is answered with one);
- ``join_s``: a node started late, seeded with node 0: seconds until its first step;
- ``false_deaths``: removals of a node that never crashed, summed over all nodes' tables
  (their ``member ... removed: silent`` verdicts);
- ``wall_s_per_member_s``: the machine's seconds per simulated member-second, and
  ``wall_s_start`` those until every node trained (the start is the dearest part: each
  node learns every member, and the agreement bitmaps are a bit per member).

Each figure is also printed to stderr as soon as it is measured, with the wall seconds
so far (a run of thousands takes hours).

    python benchmarks/protocol_scale.py [--nodes 16,64,256] [--loss 0.01]

Ends with one JSON line: each figure a map from node count to value.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from collections import Counter
from typing import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from gossip.protocol.control import NODE_KINDS  # noqa: E402
from gossip.protocol.timing import Timing  # noqa: E402
from gossip.sim.cluster import SimCluster, node_id  # noqa: E402
from gossip.transport.links import LinkModel  # noqa: E402


def task(n: int) -> str:
    """A tiny synthetic task with enough samples for ``n`` nodes."""
    return f"synthetic:dim=4,classes=2,samples={max(64, 4 * n)},test_samples=16,hidden=4,batch_size=4"


REMOVED = re.compile(r"member (\S+) removed: silent")


class _Verdicts(logging.Handler):
    """Counts each node's ``removed: silent`` verdicts, by the member removed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.removed: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        m = REMOVED.search(record.getMessage())
        if m:
            self.removed[m.group(1)] += 1


def run(n: int, *, loss: float = 0.01, step_time: float = 0.1, steady: float = 10.0, crashes: int = 3,
        gap: float = 10.0, seed: int = 0, progress: Callable[[str], None] | None = None) -> dict:
    """The figures of one cluster of ``n`` (see the module docstring); ``progress`` gets a
    line with each figure as it is measured (a run of thousands takes hours)."""
    if n < crashes + 3:
        raise ValueError(f"--nodes: {n} is too few for {crashes} crashes and a joiner's seed")
    verdicts = _Verdicts()
    logging.getLogger("gossip").addHandler(verdicts)
    joiner = n  # one more process, started late, seeded with node 0
    c = SimCluster(n + 1, steps=10**9, seed=seed, step_time=step_time, late=[joiner], task=task(n + 1),
                   timing=Timing(), timeout=5.0, link=LinkModel(latency=1e-3, bandwidth=1e9), control_loss=loss,
                   peers=lambda i: [0] if i == joiner else [(i + 1) % n])
    first: dict[int, float] = {}
    c.on_step = lambda p: first.setdefault(p.index, c.now)
    t0 = time.perf_counter()
    # formation: until every node has stepped (virtual time; a cap keeps a wedged run finite)
    t = 0.0
    while len([i for i in first if i < n]) < n and t < 600.0:
        t += 1.0
        c.run(until=t)
    if len([i for i in first if i < n]) < n:
        raise RuntimeError(f"{n} nodes: only {len(first)} trained within 600 virtual s")
    form_s = max(first[i] for i in range(n))
    t_form = time.perf_counter()
    _say(progress, n, t0, f"form_s {form_s:.3f}")
    # steady training: control traffic over a window after formation (a few seconds after,
    # so that the start's own messages are over)
    c.run(until=t + 5.0)
    sent0, bytes0 = Counter(c.traffic), Counter(c.traffic_bytes)
    c.run(until=t + 5.0 + steady)
    msgs = sum(v - sent0[k] for k, v in c.traffic.items() if k not in NODE_KINDS)
    nbytes = sum(v - bytes0[k] for k, v in c.traffic_bytes.items() if k not in NODE_KINDS)
    t = c.now
    _say(progress, n, t0, f"ctrl_msgs_per_node_s {msgs / (n * steady):.2f}, ctrl_bytes_per_node_s {nbytes / (n * steady):.1f}")
    # crashes, one at a time: seconds until no survivor's table holds the crashed node
    victims = [n // 2 + k * max(1, n // (2 * crashes)) for k in range(crashes)]
    victims = sorted({min(v, n - 1) for v in victims} - {0})
    detect: list[float] = []
    crash_rates: list[float] = []
    dead: set[int] = set()
    tables = [0, False]  # whole members messages sent in a crash's window; counting now
    send = c._send

    def counting(p, dst, msg, droppable):
        if tables[1] and msg.kind == "members" and not msg.extra.get("delta"):
            tables[0] += 1
        send(p, dst, msg, droppable)

    c._send = counting
    for v in victims:
        bytes0 = sum(b for k, b in c.traffic_bytes.items() if k not in NODE_KINDS)
        tables[1] = True
        c.crash(v, at=t)
        dead.add(v)
        vid, at = node_id(v), t
        while t < at + 60.0:
            t = round(t + 0.05, 6)
            c.run(until=t)
            if all(vid not in c.procs[i].life.membership.members for i in range(n) if i not in dead):
                break
        detect.append(t - at)
        tables[1] = False
        sent = sum(b for k, b in c.traffic_bytes.items() if k not in NODE_KINDS) - bytes0
        crash_rates.append(sent / ((n - len(dead)) * max(t - at, 1e-9)))
        _say(progress, n, t0, f"crash of node {v}: known to all survivors {t - at:.2f} s after it")
        t += gap
        c.run(until=t)
    # a late joiner: seconds until its first step
    c.start(joiner, at=t)
    at = t
    while joiner not in first and t < at + 120.0:
        t += 0.1
        c.run(until=t)
    join_s = first[joiner] - at if joiner in first else None
    _say(progress, n, t0, f"join_s {'none' if join_s is None else f'{join_s:.3f}'}")
    wall = time.perf_counter() - t0
    logging.getLogger("gossip").removeHandler(verdicts)
    crashed = {node_id(v) for v in victims}
    return {
        "form_s": round(form_s, 3),
        "ctrl_msgs_per_node_s": round(msgs / (n * steady), 2),
        "ctrl_bytes_per_node_s": round(nbytes / (n * steady), 1),
        "ctrl_bytes_per_msg": round(nbytes / max(1, msgs), 1),
        "detect_s": round(max(detect), 3),
        "detect_each_s": [round(d, 3) for d in detect],
        "crash_ctrl_bytes_per_node_s": round(max(crash_rates), 1),
        "crash_tables": tables[0],
        "join_s": None if join_s is None else round(join_s, 3),
        "false_deaths": sum(k for mid, k in verdicts.removed.items() if mid not in crashed),
        "wall_s_per_member_s": round(wall / (n * c.now), 6),
        "wall_s_start": round(t_form - t0, 1),
        "wall_s": round(wall, 1),
        "virtual_s": round(c.now, 1),
        "traffic_by_kind": {k: v for k, v in sorted(c.traffic.items()) if k not in NODE_KINDS},
        "biggest_ctrl_msg_bytes": {k: v for k, v in sorted(c.traffic_max.items()) if k not in NODE_KINDS},
    }


def _say(progress: Callable[[str], None] | None, n: int, t0: float, what: str) -> None:
    if progress is not None:
        progress(f"{n:>5} nodes, {time.perf_counter() - t0:.0f} s: {what}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="16,64,256", help="comma-separated cluster sizes")
    ap.add_argument("--loss", type=float, default=0.01, help="probability that a control message is lost")
    ap.add_argument("--step-time", type=float, default=0.1, help="virtual seconds per local step")
    ap.add_argument("--steady", type=float, default=10.0, help="virtual seconds of steady training measured")
    ap.add_argument("--crashes", type=int, default=3, help="crashes, one at a time (detect_s is the worst)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.nodes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--nodes: comma-separated integers, got {args.nodes!r}")
    if not sizes or min(sizes) < 6:
        ap.error(f"--nodes: sizes of at least 6, got {args.nodes!r}")
    if not 0 <= args.loss < 1:
        ap.error(f"--loss: a probability in [0, 1), got {args.loss}")
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)  # a tiny model: more threads only fight each other (as in the explorer)
    out: dict[str, dict[int, object]] = {}
    for n in sizes:
        r = run(n, loss=args.loss, step_time=args.step_time, steady=args.steady, crashes=args.crashes,
                seed=args.seed, progress=lambda line: print(line, file=sys.stderr, flush=True))
        print(f"{n:>5} nodes: {json.dumps(r)}", flush=True)
        for k, v in r.items():
            out.setdefault(k, {})[n] = v
    print(json.dumps({"benchmark": "protocol_scale", "loss": args.loss, "step_time": args.step_time, **out}))


if __name__ == "__main__":
    main()
