"""Seeded exploration of fault schedules over the real control plane (``gossip.simcluster``).

Each run draws, from its own seed, a small cluster (3 to 5 nodes) and a fault
schedule (crashes, restarts with and without a checkpoint, stalls longer than
``--dead-after``, partitions and heals, message loss, delay jitter), runs it on
the virtual clock, and checks invariants:

- every process alive at the end finishes (exit "done", all its steps);
- parameters stay finite;
- no synchronous round mixes a message of another round, or from a sender that
  is not the member its index names in the node's member list;
- every joiner's first parameters equal the state its donor handed over;
- after the last fault, the survivors form one cluster: every survivor ends
  with the same member list, holding exactly the survivors (the schedule keeps
  the last fault at least ``SETTLE_S`` virtual seconds before training ends,
  the bound this check allows the protocol).

A run that breaks one prints its seed; ``--replay SEED`` runs exactly that
schedule again. The last line is one JSON object: ``runs``, ``violations``,
``schedules_per_cpu_minute`` (and the failing seeds).

    python -m gossip.explore --runs 20 --seed 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from gossip.simcluster import SimCluster
from gossip.transport.sim import LinkModel

__all__ = ["Schedule", "draw", "run_schedule", "check", "main"]

STEP_S = 0.05  # virtual seconds per local step
STEPS = 400    # 20 virtual seconds of training
FAULTS_END = 6.0  # every fault (and heal, and restart) is over by then
SETTLE_S = STEP_S * STEPS - FAULTS_END  # training left after the last fault, at least (14 s)
TASK = "synthetic:dim=8,classes=4,samples=512,test_samples=64,hidden=8,batch_size=8"


@dataclass
class Schedule:
    """One drawn run: cluster size, link model, and the faults in time order."""

    seed: int
    n: int
    loss: float
    jitter: float
    faults: list[tuple] = field(default_factory=list)  # (time, kind, args...)
    trace: str = ""  # a hash of the run's outcome, once run

    def describe(self) -> str:
        return (f"seed {self.seed} (trace {self.trace}): {self.n} nodes, loss {self.loss:.3f}, jitter {self.jitter * 1e3:.1f} ms; "
                + "; ".join(" ".join(map(_fmt, f)) for f in self.faults))


def _fmt(x: Any) -> str:
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def draw(seed: int) -> Schedule:
    """The schedule of run ``seed`` (the same seed, the same schedule)."""
    rng = random.Random(seed)
    n = rng.randint(3, 5)
    s = Schedule(seed, n, loss=rng.choice([0.0, 0.0, 0.005, 0.02]), jitter=rng.choice([0.0, 0.002, 0.02]))
    busy: set[int] = set()  # a node gets one fault per run (a crash and its restart are one)
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["crash", "restart", "restart-ck", "stall", "partition"])
        t = round(rng.uniform(1.5, 3.5), 2)
        if kind == "partition":
            if busy:
                continue
            cut = rng.randint(1, n - 1)
            ids = list(range(n))
            rng.shuffle(ids)
            heal = round(min(FAULTS_END, t + rng.uniform(0.5, 4.0)), 2)
            s.faults.append((t, "partition", sorted(ids[:cut]), sorted(ids[cut:]), heal))
            busy.update(range(n))
            continue
        free = [i for i in range(n) if i not in busy]
        if not free or (kind == "crash" and len(free) < 2):
            continue
        i = rng.choice(free)
        busy.add(i)
        if kind == "crash":
            s.faults.append((t, "crash", i))
        elif kind in ("restart", "restart-ck"):
            s.faults.append((t, kind, i, round(min(FAULTS_END, t + rng.uniform(0.2, 2.5)), 2)))
        else:
            s.faults.append((t, "stall", i, round(min(FAULTS_END, t + rng.uniform(0.5, 3.5)), 2)))
    s.faults.sort()
    return s


def run_schedule(s: Schedule, workdir: str) -> SimCluster:
    """Run schedule ``s`` (checkpoints under ``workdir``)."""
    link = LinkModel(latency=1e-3, bandwidth=1e9, loss=s.loss, jitter=s.jitter)
    ck = {f[2] for f in s.faults if f[1] == "restart-ck"}  # only they read checkpoints: only they write them
    c = SimCluster(s.n, steps=STEPS, seed=s.seed, link=link, step_time=STEP_S, task=TASK, join_margin=10,
                   timeout=2.0, checkpoint_every=25,
                   checkpoint_dir=lambda i: f"{workdir}/ck{i}" if i in ck else None)
    for f in s.faults:
        t, kind = f[0], f[1]
        if kind == "crash":
            c.crash(f[2], at=t)
        elif kind in ("restart", "restart-ck"):
            c.crash(f[2], at=t)
            c.start(f[2], at=f[3], resume=kind == "restart-ck")
        elif kind == "stall":
            c.stall(f[2], at=t, until=f[3])
        elif kind == "partition":
            c.partition([f[2], f[3]], at=t, until=f[4])
    c.run(until=STEP_S * STEPS * 10 + 60.0)
    return c


def check(c: SimCluster) -> list[str]:
    """The invariants a finished run must hold; the violations, in words."""
    out: list[str] = []
    results = c.results()
    survivors = [r for p, r in zip(c.procs, results) if p.exit != "crashed"]
    handed = {(p.id, to, sha) for p in c.procs for life in [*p.lives, c._result(p)]
              for to, sha in life["handed"]}
    for p, r in zip(c.procs, results):
        for life in [*p.lives, r]:
            if not life["finite"]:
                out.append(f"{life['node']}: non-finite parameters")
            if life["took"] is not None:
                donor, sha = life["took"]
                if (donor, life["node"], sha) not in handed:
                    out.append(f"{life['node']}: took a state from {donor} that {donor} did not hand over")
        out.extend(p.mix_violations)
        if p.exit == "crashed":
            continue
        if r["exit"] != "done" or r["steps"] != STEPS:
            out.append(f"{r['node']}: did not finish (exit {r['exit']}, step {r['steps']} of {STEPS})")
    ids = sorted(r["node"] for r in survivors)
    views = {tuple(sorted(r["member_ids"])) for r in survivors}
    if views != {tuple(ids)}:
        out.append(f"survivors {ids} end in clusters {sorted(views)}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gossip.explore", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="schedules to draw and run")
    ap.add_argument("--seed", type=int, default=0, help="run k uses seed SEED * 1000003 + k")
    ap.add_argument("--replay", type=int, default=None, help="run only the schedule of this run seed")
    ap.add_argument("-v", "--verbose", action="store_true", help="log the protocol (INFO)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, format="%(message)s")
    torch.set_num_threads(1)
    seeds = [args.replay] if args.replay is not None else [args.seed * 1000003 + k for k in range(args.runs)]
    failed: list[int] = []
    cpu0 = time.process_time()
    for seed in seeds:
        s = draw(seed)
        with tempfile.TemporaryDirectory(prefix="gossip-explore-") as work:
            c = run_schedule(s, work)
            bad = check(c)
        # what the run did, in one hash: equal on every replay of the seed
        trace = hashlib.sha256(repr(([r["params_sha256"] for r in c.results()], c.frames_sent)).encode()).hexdigest()
        s.trace = trace[:16]
        if bad:
            failed.append(seed)
            print(f"VIOLATION {s.describe()}", file=sys.stderr)
            for b in bad:
                print(f"  {b}", file=sys.stderr)
            print(f"  replay: python -m gossip.explore --replay {seed}", file=sys.stderr)
        elif args.replay is not None or args.verbose:
            print(f"ok {s.describe()}", file=sys.stderr)
    cpu = time.process_time() - cpu0
    print(json.dumps({"runs": len(seeds), "violations": len(failed), "failing_seeds": failed,
                      "schedules_per_cpu_minute": round(len(seeds) / (cpu / 60), 2) if cpu > 0 else None}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
