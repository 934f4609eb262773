"""Fault schedules for the simulator: crashes, (re)joins and partitions at given times.

Grammar (one event per string; ``gossip-sim --fault EVENT``, repeatable)::

    crash:N@T              node N stops at simulated time T (its state is lost)
    join:N@T               node N (re)joins at T with a neighbour's parameters;
                           a node whose first event is a join starts absent
    partition:A|B@T1-T2    groups A and B cannot reach each other from T1 to T2
                           (a group: node ranges and lists, e.g. 0-3,7)

Example: ``crash:3@1.0`` ``join:3@2.5`` ``partition:0-7|8-15@1.0-2.0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["FaultEvent", "parse_faults", "parse_group"]


@dataclass(frozen=True)
class FaultEvent:
    """One scheduled fault: ``kind`` is crash, join, partition or heal."""

    time: float
    kind: str
    node: int = -1
    groups: tuple[tuple[int, ...], ...] = ()


def parse_group(text: str, n: int, what: str) -> tuple[int, ...]:
    """``0-3,7`` -> (0, 1, 2, 3, 7), every id checked against ``n`` nodes."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{what}: {part!r} is not a node id or range") from None
        if not (0 <= a <= b < n):
            raise ValueError(f"{what}: nodes {part} not in 0..{n - 1}")
        out.extend(range(a, b + 1))
    if not out:
        raise ValueError(f"{what}: empty node group")
    return tuple(out)


def _time(text: str, what: str) -> float:
    try:
        t = float(text)
    except ValueError:
        raise ValueError(f"{what}: time {text!r} is not a number of seconds") from None
    if not (math.isfinite(t) and t >= 0):
        raise ValueError(f"{what}: time must be >= 0")
    return t


def parse_faults(specs: list[str] | tuple[str, ...] | str | None, n: int) -> list[FaultEvent]:
    """Parse fault specs for ``n`` nodes into events sorted by time."""
    if not specs:
        return []
    if isinstance(specs, str):
        specs = [specs]
    events: list[FaultEvent] = []
    for spec in specs:
        if isinstance(spec, FaultEvent):
            events.append(spec)
            continue
        kind, sep, rest = str(spec).strip().partition(":")
        what, at, when = rest.rpartition("@")
        if not sep or not at or kind not in ("crash", "join", "partition"):
            raise ValueError(f"fault {spec!r}: expected crash:N@T, join:N@T or partition:A|B@T1-T2")
        if kind == "partition":
            start, dash, end = when.partition("-")
            t0, t1 = _time(start, f"fault {spec!r}"), _time(end, f"fault {spec!r}") if dash else math.inf
            if t1 <= t0:
                raise ValueError(f"fault {spec!r}: the partition must end after it starts")
            groups = tuple(parse_group(g, n, f"fault {spec!r}") for g in what.split("|"))
            if len(groups) < 2:
                raise ValueError(f"fault {spec!r}: a partition needs at least two groups (A|B)")
            seen = [i for g in groups for i in g]
            if len(seen) != len(set(seen)):
                raise ValueError(f"fault {spec!r}: a node is in two groups")
            events.append(FaultEvent(t0, "partition", groups=groups))
            if math.isfinite(t1):
                events.append(FaultEvent(t1, "heal"))
        else:
            node = parse_group(what, n, f"fault {spec!r}")
            if len(node) != 1:
                raise ValueError(f"fault {spec!r}: one node per {kind}")
            events.append(FaultEvent(_time(when, f"fault {spec!r}"), kind, node[0]))
    return sorted(events, key=lambda e: e.time)
