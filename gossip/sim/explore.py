"""Seeded exploration of fault schedules over the real control plane (``gossip.sim.cluster``).

Each run draws, from its own seed, a small cluster (3 to 5 members; in half the
schedules each member is a group of 2 or 3 ranks) and a fault schedule, runs it on
the virtual clock, and checks invariants. The faults:
crashes, restarts with and without a checkpoint, late starts (joins), stalls
longer than ``--dead-after``, partitions and heals, delay spikes on one link for
a while; on every message loss, jitter, duplication and reordering; and a clock
per node that drifts (up to 5%) from its own offset. Fault times fall anywhere
from startup to ``FAULTS_END``, or, in one schedule of four, around the finish.

The nodes train a 30-parameter model on a tiny synthetic task, a step per round:
what is explored is the protocol, and its invariants do not depend on the model:

- every process alive at the end finishes (exit "done", all its steps); one
  started when another had finished, or was within ``join_margin`` rounds of its
  end (a join scheduled then falls after the end), may instead exit with the
  error that says its cluster finished or nobody will schedule its join;
- parameters stay finite;
- no synchronous round mixes a message of another round, or from a sender that
  is not the member its index names in the node's member list;
- every joiner's first parameters equal the state its donor handed over;
- groups: every rank of a group mixes with the same members in each round; each
  rank's first shard of a joining life is exactly the shard rank r of its donor
  handed over; every rank of a group that finishes finishes (a rank crash or stall
  acts on one rank: torchrun restarts the whole group, a stalled rank holds its
  group's next step);
- after the last fault, the survivors form one cluster: every survivor ends
  with the same member list, holding exactly the survivors (checked when the
  last fault is over ``SETTLE_S`` virtual seconds before training ends, the
  bound this check allows the protocol; not for faults around the finish).
  Survivors that cannot find each other (restarted without a checkpoint, their
  only seeds dead for good, nobody remembering them) are held to this in the
  sets that can (``_can_meet``).

``--churn`` draws dense-fault schedules instead (:func:`draw_churn`): 6 to 16 nodes, a
fault every 0.3 to 1.5 s up to ``FAULTS_END`` (5 to 25 of them), a node faulted again
once its last fault is over (restarted twice, stalled while it joins, a donor restarted
while a joiner pulls its state), under the same invariants.

``--mixed`` draws both in one exploration: every fourth run seed a dense-fault schedule,
the others as by default (one exploration at one commit then covers both kinds).

A run that breaks one prints its seed; ``--replay SEED`` runs exactly that
schedule again. The last line is one JSON object: ``runs``, ``violations``,
``schedules_per_cpu_minute``, the failing seeds, and ``code``: where the ``gossip``
package that ran was imported from and a hash of its sources (under ``python -m``
the working directory comes first on ``sys.path``, so a run started in a checkout
explores that checkout's files, whatever ``PYTHONPATH`` says; the hash tells two
explorations of the same code from two of different code).

    python -m gossip.sim.explore --runs 20 --seed 1
    python -m gossip.sim.explore --runs 20 --seed 1 --detector swim
    python -m gossip.sim.explore --runs 20 --seed 1 --churn
    python -m gossip.sim.explore --runs 20 --seed 1 --mixed
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from gossip.protocol.timing import DEFAULT_DETECTOR, DETECTORS
from gossip.sim.cluster import SimCluster
from gossip.transport.links import LinkModel

__all__ = ["Schedule", "draw", "draw_churn", "run_schedule", "check", "trace", "main"]

STEP_S = 0.2   # virtual seconds per local step (and round): few rounds, each one a full round
STEPS = 100    # 20 virtual seconds of training
FAULTS_END = 8.0  # every fault (and heal, and restart) of a settling schedule is over by then
SETTLE_S = STEP_S * STEPS - FAULTS_END  # training left after the last fault, at least (12 s)
FINISH = (STEP_S * STEPS - 4.0, STEP_S * STEPS + 3.0)  # where faults fall in a schedule around the finish
# how a process started after its cluster finished may end: nobody will schedule its join
AFTER_FINISH = ("error: the running cluster did not schedule our join (no answer to hello)",
                "error: every member of the cluster it joins has finished training (")
TASK = "synthetic:dim=4,classes=2,samples=64,test_samples=16,hidden=4,batch_size=4"  # 30 parameters


@dataclass
class Schedule:
    """One drawn run: cluster size, link model, and the faults in time order."""

    seed: int
    n: int
    loss: float
    jitter: float
    duplicate: float = 0.0
    reorder: float = 0.0
    reorder_by: float = 0.05
    clocks: list[tuple[float, float]] = field(default_factory=list)  # (drift, offset) per node
    settles: bool = True  # the last fault ends SETTLE_S before training does (the one-cluster check applies)
    group: int = 1  # ranks per member: every member is a group of this many processes
    fanout: int = 0  # members told of each change to a member table (Timing.fanout; 0: the default, all here)
    churn: bool = False  # a dense-fault schedule (draw_churn)
    faults: list[tuple] = field(default_factory=list)  # (time, kind, args...)
    trace: str = ""  # a hash of the run's outcome, once run

    def describe(self) -> str:
        drifts = ", ".join(f"{d * 100:+.2f}%" for d, _ in self.clocks) if any(d for d, _ in self.clocks) else "none"
        return (f"seed {self.seed} (trace {self.trace}): {self.n} "
                f"{'nodes' if self.group == 1 else f'groups of {self.group} ranks'}, loss {self.loss:.3f}, "
                f"jitter {self.jitter * 1e3:.1f} ms, duplicate {self.duplicate:.3f}, reorder {self.reorder:.3f} "
                f"(by {self.reorder_by * 1e3:.0f} ms), drift {drifts}, "
                f"{'dense faults' if self.churn else 'settling' if self.settles else 'around the finish'}, "
                f"fanout {self.fanout or 'default'}; "
                + "; ".join(" ".join(map(_fmt, f)) for f in self.faults))


def _fmt(x: Any) -> str:
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def draw(seed: int, groups: bool = True) -> Schedule:
    """The schedule of run ``seed`` (the same seed, the same schedule). ``groups=False``:
    single-process nodes always, the schedule ``seed`` had before groups were drawn (the
    seeds found then replay as they were found)."""
    rng = random.Random(seed)  # the only source of the schedule: no hash() of anything, no clock
    n = rng.randint(3, 5)
    s = Schedule(seed, n, loss=rng.choice([0.0, 0.0, 0.005, 0.02]), jitter=rng.choice([0.0, 0.002, 0.02]),
                 duplicate=rng.choice([0.0, 0.0, 0.01, 0.05]), reorder=rng.choice([0.0, 0.0, 0.01, 0.05]),
                 reorder_by=rng.choice([0.01, 0.1, 0.5]))
    if rng.random() < 0.5:  # clocks that drift, each from its own offset
        s.clocks = [(rng.choice([0.0, 1e-4, -1e-4, 0.01, -0.01, 0.05, -0.05]), round(rng.uniform(0.0, 1000.0), 3))
                    for _ in range(n)]
    s.settles = rng.random() < 0.75
    lo, hi = (0.0, FAULTS_END) if s.settles else FINISH
    end = (lambda t: round(min(FAULTS_END, t), 2)) if s.settles else (lambda t: round(t, 2))
    busy: set[int] = set()  # a node gets one fault per run (a crash and its restart are one)
    late = 0
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(["crash", "restart", "restart-ck", "stall", "partition", "late", "spike"])
        t = round(rng.uniform(lo, hi), 2)
        if kind == "spike":  # a link, not a node: any number of them
            _draw_spike(rng, s, t, end)
            continue
        if kind == "partition":
            if busy:
                continue
            cut = rng.randint(1, n - 1)
            ids = list(range(n))
            rng.shuffle(ids)
            heal = end(t + rng.uniform(0.5, 4.0))
            if heal > t:
                s.faults.append((t, "partition", sorted(ids[:cut]), sorted(ids[cut:]), heal))
                busy.update(range(n))
            continue
        free = [i for i in range(n) if i not in busy]
        if not free or (kind in ("crash", "late") and len(free) < 2) or (kind == "late" and late):
            continue
        i = rng.choice(free)
        busy.add(i)
        if kind == "crash":
            s.faults.append((t, "crash", i))
        elif kind == "late":  # it starts at t; its seed is a node that starts at 0
            late += 1
            s.faults.append((t, "late", i))
        elif kind in ("restart", "restart-ck"):
            back = end(t + rng.uniform(0.2, 2.5))
            if back > t:
                s.faults.append((t, kind, i, back))
        else:
            until = end(t + rng.uniform(0.5, 3.5))
            if until > t:
                s.faults.append((t, "stall", i, until))
    if groups:
        _draw_group(s, busy, lo, hi, end)
        # news of a change told to 1 or 2 members instead of all (the default in clusters
        # this small), so that the epidemic and the probes' digests carry it the rest of
        # the way, as in large clusters (a generator of its own: the faults stay)
        s.fanout = random.Random(s.seed * 104729 + 0xFA0).choice([0, 0, 1, 2])
    s.faults.sort()
    if s.settles:  # a fault that would end after FAULTS_END was cut there; a start at it is not a fault
        assert all(max(x for x in f if isinstance(x, float)) <= FAULTS_END for f in s.faults), s.faults
    return s


def _draw_spike(rng: random.Random, s: Schedule, t: float, end: Any) -> None:
    """A delay spike on a link drawn at ``t`` (none when its window, cut by ``end``, is empty:
    a window drawn at FAULTS_END itself)."""
    i, j = rng.sample(range(s.n), 2)
    until, delay = end(t + rng.uniform(0.2, 3.0)), rng.choice([0.05, 0.3, 1.0, 2.5])
    if until > t:
        s.faults.append((t, "spike", min(i, j), max(i, j), until, delay))


def draw_churn(seed: int) -> Schedule:
    """The dense-fault schedule of run ``seed`` (``--churn``): 6 to 16 single-process
    nodes and a fault every 0.3 to 1.5 virtual seconds from the start to ``FAULTS_END``
    (5 to 25 of them): crashes (at most a third of the nodes for good), restarts with and
    without a checkpoint, stalls, partitions, late starts and delay spikes, a node
    faulted again once its last fault is over (a node restarted twice, a stall during its
    own join, a donor restarted while a joiner pulls its state), and the same message
    loss, jitter, duplication, reordering and clock drift as the settling schedules. The
    invariants are the same, the one-cluster check included (the faults end
    ``SETTLE_S`` before training does). Drawn from a generator of its own: the
    settling schedules of every seed stay the ones earlier commits explored."""
    rng = random.Random(f"churn|{seed}")
    n = rng.randint(6, 16)
    s = Schedule(seed, n, loss=rng.choice([0.0, 0.0, 0.005, 0.02]), jitter=rng.choice([0.0, 0.002, 0.02]),
                 duplicate=rng.choice([0.0, 0.0, 0.01, 0.05]), reorder=rng.choice([0.0, 0.0, 0.01, 0.05]),
                 reorder_by=rng.choice([0.01, 0.1, 0.5]), churn=True)
    if rng.random() < 0.5:
        s.clocks = [(rng.choice([0.0, 1e-4, -1e-4, 0.01, -0.01, 0.05, -0.05]), round(rng.uniform(0.0, 1000.0), 3))
                    for _ in range(n)]
    s.fanout = rng.choice([0, 0, 1, 2])
    end = lambda t: round(min(FAULTS_END, t), 2)  # noqa: E731
    free_at = [0.0] * n  # when each node's last fault is over (inf: crashed for good)
    gone, late = 0, 0
    t = 0.0
    while True:
        t = round(t + rng.uniform(0.3, 1.5), 2)
        if t >= FAULTS_END:
            break
        kind = rng.choice(["crash", "restart", "restart", "restart-ck", "restart-ck", "stall", "stall", "partition",
                           "late", "spike"])
        if kind == "spike":
            _draw_spike(rng, s, t, end)
            continue
        free = [i for i in range(n) if free_at[i] <= t]
        if kind == "partition":
            if any(t < f < math.inf for f in free_at):  # (every node alive unfaulted: it acts on them all)
                continue
            cut = rng.randint(1, n - 1)
            ids = list(range(n))
            rng.shuffle(ids)
            heal = end(t + rng.uniform(0.5, 4.0))
            if heal > t:
                s.faults.append((t, "partition", sorted(ids[:cut]), sorted(ids[cut:]), heal))
                free_at = [max(f, heal) for f in free_at]
            continue
        if not free:
            continue
        if kind == "late":  # it starts at t (its seeds: the nodes that start at 0): never faulted before
            fresh = [i for i in free if not any(f[2] == i for f in s.faults if f[1] != "partition" and f[1] != "spike")]
            if late >= 2 or len(fresh) < 2 or t > FAULTS_END / 2:
                continue
            i = rng.choice(fresh)
            late += 1
            s.faults.append((t, "late", i))
            free_at[i] = t + 1.0
            continue
        i = rng.choice(free)
        if kind == "crash":
            if gone >= n // 3 or any(f[1] == "late" and f[2] == i for f in s.faults):
                continue
            gone += 1
            s.faults.append((t, "crash", i))
            free_at[i] = math.inf
        elif kind in ("restart", "restart-ck"):
            back = end(t + rng.uniform(0.2, 2.5))
            if back > t:
                s.faults.append((t, kind, i, back))
                free_at[i] = back + rng.uniform(0.0, 1.0)  # (a new life: faulted again, maybe while it joins)
        else:
            until = end(t + rng.uniform(0.5, 3.5))
            if until > t:
                s.faults.append((t, "stall", i, until))
                free_at[i] = until
    s.faults.sort(key=lambda f: (f[0], f[1]))
    return s


def _draw_group(s: Schedule, busy: set[int], lo: float, hi: float, end: Any) -> None:
    """Half the schedules run groups of 2 or 3 ranks: the faults above then act on whole
    groups (a machine), and up to two more act on one rank: ``rank-crash`` (the group goes
    down, its launcher starts every rank again after a delay) and ``rank-stall`` (the
    group waits for the rank at its next step). Drawn from a generator of their own, so
    the schedules of single-process nodes are the ones every earlier commit explored."""
    rng = random.Random(s.seed * 7919 + 0x6A0)
    s.group = rng.choice([1, 1, 2, 3])
    if s.group == 1:
        return
    for _ in range(rng.randint(0, 2)):
        free = [i for i in range(s.n) if i not in busy]
        if len(free) < 2:
            return
        i, r = rng.choice(free), rng.randrange(s.group)
        t = round(rng.uniform(lo, hi), 2)
        if rng.random() < 0.5:
            back = round(rng.uniform(0.3, 2.0), 2)
            if end(t + back) == round(t + back, 2):  # (its restart is within the schedule's window)
                s.faults.append((t, "rank-crash", i, r, back))
                busy.add(i)
        else:
            until = end(t + rng.uniform(0.5, 3.5))
            if until > t:
                s.faults.append((t, "rank-stall", i, r, until))
                busy.add(i)


def run_schedule(s: Schedule, workdir: str, detector: str = DEFAULT_DETECTOR) -> SimCluster:
    """Run schedule ``s`` (checkpoints under ``workdir``) with failure detector ``detector``."""
    link = LinkModel(latency=1e-3, bandwidth=1e9, loss=s.loss, jitter=s.jitter)
    ck = {f[2] for f in s.faults if f[1] == "restart-ck"}  # only they read checkpoints: only they write them
    late = [f[2] for f in s.faults if f[1] == "late"]
    first = [i for i in range(s.n) if i not in late]

    def peers(i: int) -> list[int]:  # a ring among the first; a late node names them all (any may be down)
        if i in late:
            return first
        k = first.index(i)
        return [first[(k + 1) % len(first)]]

    c = SimCluster(s.n, steps=STEPS, seed=s.seed, link=link, step_time=STEP_S, task=TASK, join_margin=10,
                   timeout=2.0, checkpoint_every=10, peers=peers, late=late, duplicate=s.duplicate,
                   reorder=s.reorder, reorder_by=s.reorder_by,
                   checkpoint_dir=lambda i: f"{workdir}/ck{i}" if i in ck else None, detector=detector,
                   group=s.group, fanout=s.fanout)
    for i, (drift, offset) in enumerate(s.clocks):
        c.clock(i, drift=drift, offset=offset)
    for f in s.faults:
        t, kind = f[0], f[1]
        if kind == "late":
            c.start(f[2], at=t)
        elif kind == "spike":
            c.spike(f[2], f[3], at=t, until=f[4], delay=f[5])
        elif kind == "crash":
            c.crash(f[2], at=t)
        elif kind in ("restart", "restart-ck"):
            c.crash(f[2], at=t)
            c.start(f[2], at=f[3], resume=kind == "restart-ck")
        elif kind == "stall":
            c.stall(f[2], at=t, until=f[3])
        elif kind == "rank-crash":
            c.crash(f[2], rank=f[3], at=t, restart_after=f[4])
        elif kind == "rank-stall":
            c.stall(f[2], rank=f[3], at=t, until=f[4])
        elif kind == "partition":
            c.partition([f[2], f[3]], at=t, until=f[4])
    c.run(until=STEP_S * STEPS * 10 + 60.0)
    return c


def check(c: SimCluster, settles: bool = True) -> list[str]:
    """The invariants a finished run must hold; the violations, in words
    (``settles``: check that the survivors form one cluster)."""
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
        if p.after_finish and (r["exit"] or "").startswith(AFTER_FINISH):
            continue  # started after its cluster finished: it says so and exits (it must not hang)
        if r["exit"] != "done" or r["steps"] != STEPS:
            out.append(f"{r['node']}: did not finish (exit {r['exit']}, step {r['steps']} of {STEPS})")
    if c.group > 1:
        out.extend(check_ranks(c))
    if settles:
        # each set that can meet ends as one cluster, agreed by all in it; sets the model
        # keeps apart may still meet (a restarted life remembers whom it met since), but only
        # into a cluster every member of which lists the same members
        view = {r["node"]: tuple(sorted(r["member_ids"])) for r in survivors}
        for ids in _can_meet([p for p in c.procs if p.exit != "crashed"]):
            views = {view[i] for i in ids}
            one = next(iter(views))
            if len(views) != 1 or not set(ids) <= set(one) or any(view.get(m) != one for m in one):
                out.append(f"survivors {ids} end in clusters {sorted(views)}")
    return out


def _can_meet(survivors: list[Any]) -> list[list[str]]:
    """The survivors, in sets that can find each other (sorted ids): two can when one names
    the other as a seed in its present life, or when either remembers the cluster (its
    first life, or one that read its checkpoint's member list with ``--resume``), since
    a node probes the members it knew at their addresses until they answer. A life
    restarted without a checkpoint knows its seeds only: if those are dead for good, and
    no survivor remembers it or names it, nobody can find it (the explorer found such a
    schedule, seed 450001456: two restarted nodes whose only seeds had crashed). So is a
    life restarted with ``--resume`` that found no checkpoint (its last life trained too
    briefly to write one): it has no member list (seed 8002024047: three such lives, and
    a node whose only seed had crashed for good, which none of them had heard of).
    The sets say who must meet, not who may: a restarted life remembers whom it met since
    (seed 8302025296: two such lives, each seeded with a dead node, had met before the
    second one's restart; they ended as one cluster of two, which ``check`` accepts)."""
    def remembers(p: Any) -> bool:
        cfg = p.life.cfg if p.life is not None else p.cfg  # (the present life's: a restart may resume)
        if not p.lives:
            return True
        # (a member list is written with each checkpoint: none found, none read)
        return bool(cfg.resume and cfg.checkpoint_dir) and (p.life is None or p.life.resume_step > 0)

    ids = {p.id: p for p in survivors}
    parent = {i: i for i in ids}

    def root(i: str) -> str:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a in survivors:
        for b in survivors:
            if a.id < b.id and (b.id in a.cfg.peers or a.id in b.cfg.peers or remembers(a) or remembers(b)):
                parent[root(a.id)] = root(b.id)
    sets: dict[str, list[str]] = {}
    for i in sorted(ids):
        sets.setdefault(root(i), []).append(i)
    return list(sets.values())


def check_ranks(c: SimCluster) -> list[str]:
    """The invariants of groups: every rank of a group mixes with the same members in each
    round of a life; each rank's first shard of a joining life is exactly the one rank r
    of its donor handed it; every rank of a group alive at the end finishes with rank 0."""
    out: list[str] = []
    lives = [[[*q.lives, c._result(q)] for q in ranks] for ranks in c.ranks]
    handed = {(h["to"], h["round"], h["sha256"]) for member in lives for rank in member[1:] for life in rank
              for h in life["handed"]}
    for member in lives:
        lead = member[0]
        for rank in member[1:]:
            for k, life in enumerate(rank):
                node = life["node"]
                if k < len(lead):
                    for key, members in life["rounds_seen"].items():
                        want = lead[k]["rounds_seen"].get(key)
                        if want is not None and want != members:
                            out.append(f"{node}: start {key[0]} round {key[1]} mixed with {list(members)}, "
                                       f"rank 0 with {list(want)}")
                took = life["took"]
                if took is not None and (node, took["round"], took["sha256"]) not in handed:
                    out.append(f"{node}: took a shard of round {took['round']} from {took['from']} that it did "
                               f"not hand over")
                if k == len(rank) - 1 and lead[-1]["exit"] == "done" and life["exit"] != "done":
                    out.append(f"{node}: rank 0 finished, this rank did not (exit {life['exit']}, "
                               f"step {life['steps']})")
    return out


def trace(c: SimCluster) -> str:
    """What a run did, in one hash: every node's parameters, member list, steps and
    exit, every applied fault, and the frames sent and lost; equal on every replay."""
    what = ([(r["params_sha256"], r["member_ids"], r["steps"], r["exit"], r["state_from"]) for r in c.results()],
            [(p.exit, len(p.lives)) for p in c.procs], c.log and [(round(t, 9), w) for t, w in c.log],
            c.frames_sent, c.frames_lost)
    return hashlib.sha256(repr(what).encode()).hexdigest()[:16]


def code_fingerprint(root: str | None = None) -> dict[str, str]:
    """Where the running ``gossip`` package lives (or ``root``) and a hash of its ``.py``
    files (paths and contents, sorted): explorations of the same code report the same hash."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (gossip/sim/..)
    h = hashlib.sha256()
    for d, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as fh:
                    h.update(fh.read() + b"\0")
    return {"path": root, "sha256": h.hexdigest()[:16]}


def dense(seed: int, args: argparse.Namespace) -> bool:
    """Whether run seed ``seed`` draws a dense-fault schedule (``--churn``; ``--mixed``: one
    seed in four)."""
    return bool(args.churn or (args.mixed and seed % 4 == 3))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gossip.sim.explore", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="schedules to draw and run")
    ap.add_argument("--seed", type=int, default=0, help="run k uses seed SEED * 1000003 + k")
    ap.add_argument("--replay", type=int, default=None, help="run only the schedule of this run seed")
    ap.add_argument("--detector", choices=DETECTORS, default=DEFAULT_DETECTOR,
                    help="the nodes' failure detector (gossip-node --detector); a seed's schedule is the same "
                         "with either (default: %(default)s)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--groups", action="store_true", help="run only the schedules drawn with groups of ranks")
    which.add_argument("--single", action="store_true",
                       help="single-process nodes only: every seed's schedule as drawn before groups were (replay "
                            "the seeds found then with it)")
    which.add_argument("--churn", action="store_true",
                       help="dense-fault schedules (draw_churn): 6 to 16 nodes, a fault every 0.3-1.5 s")
    which.add_argument("--mixed", action="store_true",
                       help="both kinds: a dense-fault schedule for every run seed that is 3 modulo 4, the default "
                            "draw for the others")
    ap.add_argument("-v", "--verbose", action="store_true", help="log the protocol (INFO)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, format="%(message)s")
    torch.set_num_threads(1)
    seeds = [args.replay] if args.replay is not None else [args.seed * 1000003 + k for k in range(args.runs)]
    failed: list[int] = []
    code = code_fingerprint()  # (before the runs: the files a long exploration started with)
    cpu0 = time.process_time()
    # checkpoints on a memory file system where there is one: their fsyncs are not what is explored
    scratch = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    ran = 0
    for seed in seeds:
        s = draw_churn(seed) if dense(seed, args) else draw(seed, groups=not args.single)
        if args.groups and s.group == 1 and args.replay is None:
            continue
        ran += 1
        with tempfile.TemporaryDirectory(prefix="gossip-explore-", dir=scratch) as work:
            try:
                c = run_schedule(s, work, args.detector)
                bad = check(c, s.settles)
                s.trace = trace(c)
            except Exception:  # an exception out of the protocol (or the harness) is a finding too
                bad = ["raised: " + traceback.format_exc().rstrip().replace("\n", "\n  ")]
        if bad:
            failed.append(seed)
            print(f"VIOLATION {s.describe()}", file=sys.stderr)
            for b in bad:
                print(f"  {b}", file=sys.stderr)
            print(f"  replay: python -m gossip.sim.explore --replay {seed} --detector {args.detector}"
                  f"{' --single' if args.single else ' --churn' if dense(seed, args) else ''}", file=sys.stderr)
        elif args.replay is not None or args.verbose:
            print(f"ok {s.describe()}", file=sys.stderr)
    cpu = time.process_time() - cpu0
    print(json.dumps({"runs": ran, "violations": len(failed), "failing_seeds": failed, "detector": args.detector,
                      "schedules_per_cpu_minute": round(ran / (cpu / 60), 2) if cpu > 0 else None,
                      "code": code}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
