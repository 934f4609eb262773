"""The report of ``benchmarks/churn.py``: the shape of ``--mixed``'s faults (their kinds,
each node's datacenter), and which fault cost each timed-out round, read from the nodes'
logs (:func:`attribute_timeouts`); :func:`analyse` reads a kept run again (``churn.py
--analyse DIR``), running nothing.
"""

from __future__ import annotations

import bisect
import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

KINDS = ("kill", "stop-long", "stop-short", "partition")  # --mixed draws from these
# a synchronous round that waited --timeout in vain, as a node logs it (gossip/protocol/lifecycle.py;
# a group's rank: ranks.py); not the warning "N synchronous rounds in a row timed out waiting for"
# that follows several (counting those too made 198 of the 164 rounds of one --mixed run)
TIMED_OUT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ \[([^\]]+)\] .*?: round (\d+) timed out "
                       r"waiting for (?:neighbours \((.*)\)|(.*))$", re.MULTILINE)
LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"  # the nodes' log timestamps (local time, as ``started`` below)
RELATIONS = ("awaiting_victim", "victim_waiting", "other")  # a timed-out round to its fault (attribute_timeouts)


def datacenter(i: int, n: int) -> str:
    """Node ``i``'s datacenter under ``--mixed``: the first half ``a``, the rest ``b``."""
    return "a" if i < n // 2 else "b"


def draw_kinds(count: int, seed: int) -> list[str]:
    """The kinds of ``--mixed``'s ``count`` faults: each of :data:`KINDS` once in every
    four, in an order drawn from ``seed`` (the first k are the same whatever ``count``)."""
    draw = random.Random(f"kinds|{seed}")
    return [kind for _ in range(0, count, len(KINDS)) for kind in draw.sample(KINDS, len(KINDS))][:count]



@dataclass(frozen=True)
class TimedOutRound:
    """One synchronous round that timed out, as the waiting node logged it."""

    at_s: float  # when it was logged (the end of its wait), seconds on the faults' ``at_s`` clock
    node: int | None  # the waiting node (None: an address that is no node of the run)
    round: int
    awaited: tuple[int | None, ...]  # the nodes it waited for in vain


def timed_out_rounds(log: str, nodes: dict[str, int], started: datetime) -> list[TimedOutRound]:
    """The timed-out rounds that one node's log names.

    ``nodes`` maps an address (``127.0.0.1:PORT``) to its node's index; ``started`` is the
    local time that the faults' ``at_s`` count from (the log's timestamps are local too).
    """
    out = []
    for m in TIMED_OUT.finditer(log):
        at = (datetime.strptime(m[1], LOG_TIME) - started).total_seconds()
        awaited = m[4] if m[4] is not None else m[5]
        out.append(TimedOutRound(at, nodes.get(m[2]), int(m[3]),
                                 tuple(nodes.get(a) for a in awaited.split(", ") if a)))
    return out


def _relation(fault: dict, r: TimedOutRound, n: int) -> str:
    """How timed-out round ``r`` stands to ``fault`` (one of :data:`RELATIONS`): it waited
    for the victim (a partition's: a node across the cut), the victim itself waited (a
    stopped or restarted node), or it waited for others only."""
    if fault["kind"] == "partition":
        across = r.node is not None and any(a is not None and datacenter(a, n) != datacenter(r.node, n)
                                            for a in r.awaited)
        return "awaiting_victim" if across else "other"
    if r.node is not None and r.node == fault.get("node"):
        return "victim_waiting"
    return "awaiting_victim" if fault.get("node") in r.awaited else "other"


def attribute_timeouts(faults: list[dict], rounds: list[TimedOutRound], n: int, window: float,
                       gap: float = 10.0) -> dict:
    """Each timed-out round under the fault that began last before it, if that began
    less than ``window`` seconds before it (so at most until the next fault); counted per
    kind of fault, and per fault.

    ``faults`` are the run's (``kind``, ``at_s``, and a kill's or stop's ``node``), ``n``
    the nodes (a partition cuts the datacenters of :func:`_datacenter` apart). A round is
    also ``carried`` when it continues a burst begun under an earlier fault (timed-out
    rounds of any node, none more than ``gap`` s after the one before: a node stuck in
    its rounds logs one every ``--timeout``, 5 s): the earlier fault's doing, more likely.

    Returns ``kinds`` (per kind: ``faults``, ``faults_hit`` (those followed by a timed-out
    round), ``rounds``, ``per_fault``, the rounds per :data:`RELATIONS`, and ``carried``),
    ``outside`` (rounds under no fault: before the first, or ``window`` s or more after the
    last before them), ``window_s``, ``gap_s`` and ``rounds_per_fault`` (in the order of
    ``faults``).

    >>> f = [{"kind": "kill", "node": 1, "at_s": 10.0}]
    >>> attribute_timeouts(f, [TimedOutRound(12.0, 0, 7, (1,))], 2, 30.0)["kinds"]["kill"]["awaiting_victim"]
    1
    """
    if not window > 0:
        raise ValueError(f"window must be positive, got {window}")
    if not gap >= 0:
        raise ValueError(f"gap must be at least 0, got {gap}")
    order = sorted(range(len(faults)), key=lambda j: faults[j]["at_s"])
    starts = [faults[j]["at_s"] for j in order]
    per_fault = [0] * len(faults)
    kinds: dict[str, dict] = {}
    for f in faults:
        row = kinds.setdefault(f["kind"], {"faults": 0, "faults_hit": 0, "rounds": 0, "per_fault": 0.0,
                                           **{rel: 0 for rel in RELATIONS}, "carried": 0})
        row["faults"] += 1
    outside = 0
    last = burst = None  # the latest round's time, and the fault (its place in ``order``) its burst began under
    for r in sorted(rounds, key=lambda r: r.at_s):
        k = bisect.bisect_right(starts, r.at_s) - 1
        if k >= 0 and r.at_s - starts[k] >= window:
            k = -1
        if last is None or r.at_s - last > gap:
            burst = k
        last = r.at_s
        if k < 0:
            outside += 1
            continue
        fault = faults[order[k]]
        per_fault[order[k]] += 1
        row = kinds[fault["kind"]]
        row["rounds"] += 1
        row[_relation(fault, r, n)] += 1
        row["carried"] += 0 <= burst < k
    for f, count in zip(faults, per_fault):
        kinds[f["kind"]]["faults_hit"] += count > 0
    for row in kinds.values():
        row["per_fault"] = round(row["rounds"] / row["faults"], 2)
    return {"kinds": kinds, "outside": outside, "window_s": window, "gap_s": gap, "rounds_per_fault": per_fault}


def attribution_table(a: dict) -> str:
    """The lines that :func:`attribute_timeouts`'s result prints as."""
    cols = ("faults", "hit", "rounds", "per fault", "awaiting victim", "victim waiting", "other", "carried")
    lines = [f"timed-out rounds under the fault that began last before them (within {a['window_s']:.1f} s; "
             f"carried: in a burst begun under an earlier fault, gaps under {a['gap_s']:g} s)",
             f"{'fault':<11}" + "".join(f"  {c:>{max(len(c), 5)}}" for c in cols)]
    for kind, row in a["kinds"].items():
        values = [row["faults"], row["faults_hit"], row["rounds"], f"{row['per_fault']:.2f}",
                  *(row[rel] for rel in RELATIONS), row["carried"]]
        lines.append(f"{kind:<11}" + "".join(f"  {v:>{max(len(c), 5)}}" for c, v in zip(cols, values)))
    faults = sum(row["faults"] for row in a["kinds"].values())
    total = sum(row["rounds"] for row in a["kinds"].values()) + a["outside"]
    lines.append(f"{'outside':<11}  {'':>6}  {'':>5}  {a['outside']:>6}  (under no fault: before the first, or past "
                 "its window)")
    lines.append(f"{'total':<11}  {faults:>6}  {'':>5}  {total:>6}")
    return "\n".join(lines)



def analyse(directory: Path, schedule: Path | None = None, name: str = "churn", planned: int = 60) -> dict:
    """Attribute the timed-out rounds of a kept run (``--keep DIR``) to its faults again,
    from its logs, running nothing.

    The schedule is ``DIR/churn.faults.json``; a directory kept before the runs wrote it
    takes it from ``schedule``, the run's printed output (its last line, the JSON line:
    ``faults_applied`` or ``kills``; by default ``DIR.log`` beside the directory). Such a
    schedule lacks the local time its ``at_s`` count from: it is taken as the moment the
    last node of the first lives logged "training as" (``churn.run`` polls each node's log
    every 0.1 s before it starts the clock). Nor does it list the partitions that the
    emulators made after the last fault the run applied: with ``--mixed`` they are drawn
    again from its seed and ``planned`` (the run's ``--faults``), if the draw gives the
    kinds it recorded.
    """
    lives = []  # (node, life, its log)
    for path in sorted(directory.glob(f"{name}*.err")):
        m = re.fullmatch(rf"{re.escape(name)}(\d+)\.(\d+)\.err", path.name)
        if m:
            lives.append((int(m[1]), int(m[2]), path.read_text()))
    if not lives:
        raise ValueError(f"directory: no {name}<node>.<life>.err logs in {directory}")
    saved = directory / f"{name}.faults.json"
    if saved.exists():
        plan = json.loads(saved.read_text())
        source, n, every, faults = str(saved), plan["nodes"], plan["every_s"], plan["faults"]
        started = datetime.fromisoformat(plan["started"])
        index = {a: i for i, a in enumerate(plan["addresses"])}
    else:
        schedule = schedule or directory.with_name(directory.name + ".log")
        if not schedule.exists():
            raise ValueError(f"schedule: no {saved.name} in {directory} and no {schedule} (the run's output)")
        result = json.loads([ln for ln in schedule.read_text().splitlines() if ln.startswith("{")][-1])
        source, n, every = f"{schedule} (the run's JSON line)", result["nodes"], result["every_s"]
        faults = list(result.get("faults_applied") or result["kills"])
        cuts = [k for k, f in enumerate(faults) if f["kind"] == "partition"]
        if result.get("mixed") and cuts:
            kinds = draw_kinds(planned, result["seed"])
            if kinds[:len(faults)] != [f["kind"] for f in faults]:
                source += f"; seed {result['seed']} draws other kinds: the emulators' later partitions left out"
            else:  # the windows were fixed at the launch, ``every`` apart
                a, b = faults[cuts[-1]]["window_s"]
                recorded = len(faults)
                for k in range(recorded, planned):
                    shift = (k - cuts[-1]) * every
                    if kinds[k] == "partition" and a + shift < result["churn_s"]:
                        faults.append({"kind": "partition", "at_s": round(a + shift, 2),
                                       "window_s": [round(a + shift, 2), round(b + shift, 2)], "emulator_only": True})
                added = len(faults) - recorded
                source += f"; {added} later partitions of the emulators, drawn again (seed {result['seed']})"
        index = {}
        for node, _, text in lives:  # every line names its node, and a node keeps its port
            m = re.search(r"\[([^\]]+)\]", text)
            if m:
                index[m[1]] = node
        firsts = [re.search(r"^(\S+ \S+) .*training as", text, re.MULTILINE) for _, life, text in lives if life == 0]
        if not firsts or not all(firsts):
            raise ValueError(f"directory: a first life in {directory} never logged 'training as'")
        started = max(datetime.strptime(m[1], LOG_TIME) for m in firsts)
    rounds = [r for _, _, text in lives for r in timed_out_rounds(text, index, started)]
    return {"analysed": str(directory), "schedule": source, "started": started.isoformat(), "nodes": n,
            "faults": dict(Counter(f["kind"] for f in faults)),
            "timed_out_rounds": len(rounds), "timed_out_by_fault": attribute_timeouts(faults, rounds, n, every),
            "emulator_only": [f for f in faults if f.get("emulator_only")]}
