"""benchmarks/churn.py's attribution of timed-out rounds to faults, on logs written here
(no processes): each round under the fault that began last before it, by kind and by how
it stands to the fault's victim; the rounds under no fault counted apart."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from benchmarks.churn_report import TimedOutRound, analyse, attribute_timeouts, draw_kinds

N = 4  # datacenter a: nodes 0 and 1; b: nodes 2 and 3
ADDR = [f"127.0.0.1:{20000 + i}" for i in range(N)]
STARTED = datetime(2026, 1, 2, 3, 4, 5, 250000)  # the local time the faults' at_s count from


def line(at: float, node: int, text: str, level: str = "INFO") -> str:
    """One log line of ``node``, ``at`` seconds after STARTED, in the nodes' format."""
    t = STARTED + timedelta(seconds=at)
    stamp = t.strftime("%Y-%m-%d %H:%M:%S,") + f"{t.microsecond // 1000:03d}"
    return f"{stamp} {level} [{ADDR[node]}] gossip.peer: {ADDR[node]}: {text}\n"


def timed_out(at: float, node: int, rnd: int, *awaited: int) -> str:
    return line(at, node, f"round {rnd} timed out waiting for neighbours ({', '.join(ADDR[a] for a in awaited)})")


def write_lives(d: Path, lives: dict[str, list[str]]) -> None:
    for name, lines in lives.items():
        (d / f"{name}.err").write_text("".join(lines))


# fault 0: node 1 killed at 10 s; fault 1: node 2 stopped briefly at 40 s; fault 2: the
# datacenters cut apart at 70 s; 30 s apart, so each fault's window ends at the next
FAULTS = [{"kind": "kill", "node": 1, "at_s": 10.0}, {"kind": "stop-short", "node": 2, "at_s": 40.0},
          {"kind": "partition", "at_s": 70.0, "window_s": [70.0, 74.0]}]
LIVES = {
    "churn0.0": [line(-0.2, 0, "training as 0 of 4 (fresh start, round 0, step 0)"),
                 timed_out(5.0, 0, 11, 1),  # before the first fault: outside
                 timed_out(14.0, 0, 40, 1),  # kill: waited for the killed node
                 # the warning after several: no round of its own
                 line(14.0, 0, f"3 synchronous rounds in a row timed out waiting for {ADDR[1]} (alive: ...)",
                      "WARNING"),
                 timed_out(75.0, 0, 300, 2, 1)],  # partition: waited across the cut
    "churn1.0": [line(-0.1, 1, "training as 1 of 4 (member start, round 0, step 0)")],
    "churn1.1": [timed_out(16.5, 1, 60, 2)],  # kill: the restarted victim waited
    "churn2.0": [line(0.0, 2, "training as 2 of 4 (member start, round 0, step 0)"),
                 timed_out(76.0, 2, 301, 3)],  # partition: waited for its own side only
    "churn3.0": [line(-0.3, 3, "training as 3 of 4 (member start, round 0, step 0)"),
                 timed_out(45.0, 3, 150, 0),  # stop-short: waited for another than the victim
                 timed_out(77.0, 3, 302, 1),  # partition: waited across the cut
                 line(105.0, 3, f"round 400 timed out waiting for {ADDR[0]}")],  # a rank's form; past every window
}


def test_a_kept_run_puts_each_timed_out_round_under_its_fault(tmp_path):
    write_lives(tmp_path, LIVES)
    (tmp_path / "churn.faults.json").write_text(json.dumps(
        {"nodes": N, "every_s": 30.0, "started": STARTED.isoformat(), "addresses": ADDR, "faults": FAULTS}))
    r = analyse(tmp_path)
    assert r["timed_out_rounds"] == 8  # not the warning
    a = r["timed_out_by_fault"]
    assert a["outside"] == 2
    assert a["rounds_per_fault"] == [2, 1, 3]
    kinds = a["kinds"]
    assert kinds["kill"] == {"faults": 1, "faults_hit": 1, "rounds": 2, "per_fault": 2.0, "awaiting_victim": 1,
                             "victim_waiting": 1, "other": 0, "carried": 0}
    assert (kinds["stop-short"]["rounds"], kinds["stop-short"]["other"]) == (1, 1)
    assert (kinds["partition"]["awaiting_victim"], kinds["partition"]["other"]) == (2, 1)


def test_a_round_continuing_an_earlier_faults_burst_is_carried():
    faults = [{"kind": "partition", "at_s": 0.0}, {"kind": "stop-short", "node": 3, "at_s": 20.0}]
    rounds = [TimedOutRound(t, 0, i, (2,)) for i, t in enumerate([5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 45.0])]
    a = attribute_timeouts(faults, rounds, N, window=100.0, gap=10.0)
    assert a["rounds_per_fault"] == [3, 4]
    assert a["kinds"]["partition"]["carried"] == 0
    assert a["kinds"]["stop-short"]["carried"] == 3  # 20, 25, 30 s; 45 s begins a burst of its own
    assert a["outside"] == 0
    with pytest.raises(ValueError, match="window"):
        attribute_timeouts(faults, rounds, N, window=0.0)


def test_an_older_kept_run_reads_its_schedule_from_the_runs_output(tmp_path):
    # no churn.faults.json: the schedule is the printed JSON line, the clock starts when the last
    # first life logged "training as", and the partition the emulators made after the last fault
    # recorded is drawn again from the seed
    kinds = draw_kinds(60, 0)
    first, second = [k for k, kind in enumerate(kinds) if kind == "partition"][:2]
    every = 30.0
    recorded = [{"kind": kind, "node": 1, "at_s": 10.0 + k * every} for k, kind in enumerate(kinds[:first])]
    cut = 10.0 + first * every
    recorded.append({"kind": "partition", "at_s": cut, "window_s": [cut, cut + 4.0]})
    late = 10.0 + second * every
    result = {"nodes": N, "every_s": every, "mixed": True, "seed": 0, "churn_s": late + 20.0,
              "faults_applied": recorded}
    (tmp_path / "run").mkdir()
    (tmp_path / "run.log").write_text("churn: ...\n" + json.dumps(result) + "\n")
    write_lives(tmp_path / "run", {
        "churn0.0": [line(-1.0, 0, "training as 0 of 4 (fresh start, round 0, step 0)"),
                     timed_out(late + 3.0 - 1.0, 0, 900, 3)],  # 1 s later on the logs' clock than STARTED
        "churn3.0": [line(1.0, 3, "training as 3 of 4 (member start, round 0, step 0)")]})
    r = analyse(tmp_path / "run")
    assert r["started"] == (STARTED + timedelta(seconds=1.0)).isoformat()
    assert [f["at_s"] for f in r["emulator_only"]] == [late]
    a = r["timed_out_by_fault"]
    assert a["rounds_per_fault"][-1] == 1 and a["kinds"]["partition"]["awaiting_victim"] == 1
