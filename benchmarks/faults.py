"""Faults, measured: real crashes on loopback, partitions and a misbehaving peer in the simulator.

1. crash (real processes). 8 ``gossip-node`` processes on a ring, synthetic
   task; a clean run and a run where two nodes are killed with SIGKILL once
   node 0 has logged half the steps (each victim's exit status must be
   SIGKILL's). Reported, for each victim on its own: how many survivors
   logged "member <victim> removed: silent" after its kill, and the seconds
   from its kill to the first and to the last of those lines; the longest
   pause between two local steps on any survivor, and the mean final
   accuracy of the survivors against the clean run's nodes.
2. partition (simulator). 8 nodes on a ring, digits, split in halves for one
   simulated second: the consensus distance before, at the end of, and after
   the partition.
   heal (real processes). 5 ``gossip-node`` processes on a ring, 3 labelled
   east and 2 west, with every message between the datacenters lost from 20
   to 30 s after each node starts (``--emulate inter:down=20s-30s``; ``--cut``
   moves the window: on a shared 2-core VM five nodes took 6-11 s from their
   start to training, so a cut from 10 s sometimes came before it). Every
   node must be training before its cut begins (a run where one is not is
   discarded and tried again with a cut that begins 10 s after the slowest
   start measured, up to ``--heal-attempts``, 3 by default; the JSON
   line counts the attempts, and if none measured a partition it holds no heal
   figures and the exit status is 1) and must drop every node of the other side
   during it. Each side trains on alone; when the link is
   back the two meet and west joins east. Reported:
   seconds from the end of the cut (each node's start, as it logs it, plus
   30 s) until each west node took an east node's state, new lives, members
   at the end, and (500 steps after the last west node joined) neighbour
   distances and the rounds that timed out since that join.
3. byzantine (simulator). 8 nodes on a ring, digits; node 3 sends its
   parameters x1000. Mean accuracy of the honest nodes without and with
   clipped gossip (``clip="auto"``), and the cost of clipping on a clean run.
4. churn (real processes, with ``--churn``; see ``benchmarks/churn.py``). 5
   nodes on a ring; one drawn at random gets SIGKILL every ``--churn-every``
   seconds (15) and starts again 2 s later with ``--resume``,
   ``--churn-restarts`` times (40: ten minutes). Reported: goodput (a clean
   run's time over the churn run's, same steps), the slowest stretch between
   two steps, how every last life started, and the accuracy change.

    python benchmarks/faults.py [--steps 1500] [--dead-after 2] [--seeds 3] [--cut 20-30] [--heal-attempts 3]
                                [--skip-real] [--churn [--churn-restarts 40] [--churn-every 15]]

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gossip  # noqa: E402
from tests.cluster import Cluster, free_port, records, wait_for_step  # noqa: E402

LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
JOINED_AT = re.compile(r"took the state of .* joining at round (\d+)")
REMOVED = re.compile(r"member (\S+) removed: silent")
# Peer sets its incarnation to the wall clock in microseconds on the line before it
# starts the clock that --emulate's down windows count from, and logs it at once
INCARNATION = re.compile(r"listening \(incarnation (\d+)")


def _log_time(line: str) -> float | None:
    """The wall-clock time a log line was written, or None for a line without one."""
    m = LOG_TIME.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def _log_times(text: str, needle: str = "removed: silent") -> list[float]:
    """The times of the log lines holding ``needle``."""
    return [t for line in text.splitlines() if needle in line and (t := _log_time(line)) is not None]


def removals(text: str, member: str, after: float) -> list[float]:
    """The times of the log lines in ``text`` that remove ``member`` as silent and
    were written at ``after`` (a wall-clock time) or later.

    Log times are truncated to the millisecond, so ``after`` is too.

    >>> log = ("2026-12-01 10:00:00,500 WARNING gossip: member 127.0.0.1:5002 removed: silent for more than 2 s\\n"
    ...        "2026-12-01 10:00:01,250 WARNING gossip: member 127.0.0.1:500 removed: silent for more than 2 s")
    >>> t0 = datetime(2026, 12, 1, 10, 0, 0).timestamp()
    >>> [round(t - t0, 3) for t in removals(log, "127.0.0.1:500", t0)]
    [1.25]
    >>> removals(log, "127.0.0.1:5002", t0 + 0.6)
    []
    """
    floor = int(after * 1000) / 1000
    out = []
    for line in text.splitlines():
        m = REMOVED.search(line)
        t = _log_time(line)
        if m and m.group(1) == member and t is not None and t >= floor - 1e-6:
            out.append(t)
    return out


def crash(steps: int, dead_after: float, n: int = 8) -> dict:
    timing = ["--heartbeat", str(dead_after / 8), "--dead-after", str(dead_after), "--settle", "1",
              "--grace", "5", "--timeout", "5"]
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for run in ("clean", "faulty"):
            ports = [free_port() for _ in range(n)]
            metrics = work / f"{run}.jsonl"
            with Cluster(work) as c:
                nodes = []
                for i in range(n):
                    extra = ["--log", str(metrics), "--eval-every", "50"] if i == 0 else []
                    nodes.append(c.start(f"{run}{i}", ["--peers", f"127.0.0.1:{ports[(i + 1) % n]}", "--topology",
                                                       "ring", "--task", "synthetic", "--steps", str(steps),
                                                       "--json", *timing, *extra], port=ports[i]))
                victims = [nodes[2], nodes[5]]
                killed_at: dict[str, float] = {}  # victim id -> wall-clock time of its SIGKILL
                if run == "faulty":
                    wait_for_step(metrics, steps // 2, 600)
                    for v in victims:
                        killed_at[v.addr] = time.time()
                        v.proc.send_signal(signal.SIGKILL)
                    for v in victims:  # the fault is a crash only if SIGKILL is what ended it
                        code = v.wait(30)
                        if code != -signal.SIGKILL:
                            raise RuntimeError(f"victim {v.name} ended with status {code}, not SIGKILL's "
                                               f"({-signal.SIGKILL}):\n{v.log()[-3000:]}")
                survivors = [x for x in nodes if run == "clean" or x not in victims]
                codes = [x.wait(600) for x in survivors]
                summaries = [x.summary() for x in survivors]
                row = {"exit_codes": sorted(set(codes)),
                       "mean_accuracy": sum(s["final_accuracy"] for s in summaries) / len(summaries),
                       "max_step_gap_s": max(s["max_step_gap_s"] for s in summaries),
                       "members_at_end": sorted({s["members"] for s in summaries}),
                       "train_time_s": max(s["train_time_s"] for s in summaries)}
                if killed_at:
                    logs = [x.log() for x in survivors]
                    per_victim = {}
                    for v in victims:  # each survivor's first removal of this victim after its kill
                        firsts = [min(t) - killed_at[v.addr] for t in
                                  (removals(log, v.addr, killed_at[v.addr]) for log in logs) if t]
                        if not firsts:
                            raise RuntimeError(f"no survivor removed {v.name} ({v.addr}) after its kill")
                        per_victim[v.name] = {"exit_status": v.proc.returncode, "detected_by": len(firsts),
                                              "detect_first_s": min(firsts), "detect_last_s": max(firsts)}
                    row.update(victims=per_victim, survivors=len(survivors),
                               detected_by=min(d["detected_by"] for d in per_victim.values()),
                               detect_first_s=min(d["detect_first_s"] for d in per_victim.values()),
                               detect_last_s=max(d["detect_last_s"] for d in per_victim.values()))
                out[run] = row
    out["accuracy_change_pts"] = 100 * (out["faulty"]["mean_accuracy"] - out["clean"]["mean_accuracy"])
    return out


def partition() -> dict:
    """The halves cut apart in the simulator, which runs every node's real control plane
    for a run with faults (gossip.sim.fault_runs): detection, the halves' own clusters and the
    merge after the heal are the protocol's."""
    r = gossip.simulate(nodes=8, topology="ring", task="digits", steps=300, eval_every=10, compute="fixed:0.01",
                        faults=["partition:0-3|4-7@1.0-2.0"], detect=0.2)

    def at(t: float) -> dict:
        return min(r.history, key=lambda h: abs(h["time"] - t))

    s = r.summary
    return {"consensus_before": at(1.0)["consensus_distance"], "consensus_end_of_split": at(2.0)["consensus_distance"],
            "consensus_final": r.history[-1]["consensus_distance"], "final_accuracy": s["final_accuracy"],
            "engine": s["engine"], "merges": s["merges"], "timed_out_rounds": s["timed_out_rounds"],
            "sim_time_s": s["sim_time_s"]}


class CutBeforeTraining(RuntimeError):
    """A node was not training yet when its cut began: that run measures no partition.
    ``began``: the latest node's seconds from its start to its first step."""

    def __init__(self, message: str, began: float) -> None:
        super().__init__(message)
        self.began = began


def _wait(done, timeout: float, what: str) -> None:
    """Poll ``done()`` every 0.1 s until it is true; AssertionError naming ``what`` after ``timeout`` s."""
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def _start_time(node, launched: float) -> float:
    """The wall-clock time ``node`` started its clock (the origin of its --emulate
    down windows), from the incarnation it logs; checked against its launch."""
    node.wait_for_log("listening (incarnation", 120)
    start = int(INCARNATION.search(node.log()).group(1)) / 1e6
    if not launched <= start <= time.time():
        raise RuntimeError(f"{node.name}: start {start:.3f} is not between its launch {launched:.3f} and now")
    return start


def heal(workdir: Path, cut: tuple[float, float] = (20.0, 30.0), after: int = 500) -> dict:
    """Cut 3 east nodes from 2 west nodes for ``cut`` seconds (each node's own clock,
    from its start) and let them meet again; stop ``after`` steps past the last
    west node's join. Returns the figures, every summary and every log."""
    n, dcs = 5, ["east", "east", "east", "west", "west"]
    ports = [free_port() for _ in range(n)]
    metrics = [workdir / f"heal{i}.jsonl" for i in range(n)]
    flags = ["--topology", "ring", "--task", "synthetic", "--steps", str(10**6), "--json", "--heartbeat", "0.25",
             "--dead-after", "2", "--settle", "1", "--grace", "5", "--timeout", "2", "--join-margin", "10",
             "--eval-every", "50", "--emulate", f"inter:down={cut[0]:g}s-{cut[1]:g}s"]
    with Cluster(workdir) as c:
        launched, nodes = [], []
        for i in range(n):
            launched.append(time.time())
            nodes.append(c.start(f"heal{i}", ["--peers", f"127.0.0.1:{ports[(i + 1) % n]}", "--dc", dcs[i], "--log",
                                              str(metrics[i]), *flags], port=ports[i]))
        west = nodes[3:]
        for x in nodes:
            x.wait_for_log("training as", 120)
        starts = [_start_time(x, launched[i]) for i, x in enumerate(nodes)]
        began = [_log_times(x.log(), "training as")[0] - starts[i] for i, x in enumerate(nodes)]
        for x, b in zip(nodes, began):  # the fault happens to a cluster that trains, or not at all
            if b >= cut[0]:
                raise CutBeforeTraining(f"{x.name} began training {b:.1f} s after its start, not before the cut "
                                        f"began at {cut[0]:g} s: this machine is too slow for that cut", max(began))
        # the cut: every node drops every node of the other side. A node drops what it
        # sends during its own cut, so node i stops hearing j when j's cut begins, which
        # is before i's own when j started first (by seconds on a loaded machine)
        for i, x in enumerate(nodes):
            others = {nodes[j].addr: starts[j] + cut[0] for j in range(n) if dcs[j] != dcs[i]}
            _wait(lambda: all(removals(x.log(), a, t) for a, t in others.items()), 120,
                  f"{x.name} removing each of {sorted(others)} after that member's cut began")
        for x in west:  # the link is back: west joins east
            x.wait_for_log("took the state of", 120)
        joined = max(int(r) for x in west for r in JOINED_AT.findall(x.log()))
        # a west node took east's step, which may be below the one it reached alone
        # (two nodes train faster than three): only records after its join count
        since = [len(records(m)) if i >= 3 else 0 for i, m in enumerate(metrics)]
        # the five train together: what each reports while it still trains (the stop
        # below reaches them one after another, and a node that hears another's goodbye
        # before its own signal ends with one member fewer)
        reports = [wait_for_step(m, joined + after, 300, k) for m, k in zip(metrics, since)]
        for x in nodes:
            x.proc.send_signal(signal.SIGTERM)
        codes = c.wait_all(120)
        summaries = [x.summary() for x in nodes]
        logs = [x.log() for x in nodes]
    merged_at = max(t for log in logs[3:] for t in _log_times(log, "took the state of"))
    merged_after = [_log_times(logs[i], "took the state of")[-1] - (starts[i] + cut[1]) for i in (3, 4)]
    return {"exit_codes": codes, "merged_after_cut_s": merged_after,
            "start_after_launch_s": [s - t for s, t in zip(starts, launched)], "began_training_s": began,
            "rejoins": [s["rejoins"] for s in summaries], "merges": [s["merges"] for s in summaries],
            "members_at_end": [s["members"] for s in summaries],
            "members_before_stop": [r["members"] for r in reports],
            "neighbor_distance": [s["neighbor_distance"] for s in summaries],
            # synchronous rounds that waited --timeout in vain once all five trained together
            "timeouts_after_join": [sum(t > merged_at for t in _log_times(log, "timed out waiting")) for log in logs],
            "summaries": summaries, "logs": logs}


def heal_measured(workdir: Path, cut: tuple[float, float] = (20.0, 30.0), attempts: int = 3) -> dict:
    """:func:`heal`, again with a later cut when a node was not training yet when its
    cut began (a loaded machine starts nodes slowly): the next cut begins 10 s after
    the slowest start measured, and lasts as long. Adds ``attempts`` and ``cut``."""
    for attempt in range(1, attempts + 1):
        run = workdir / f"attempt{attempt}"
        run.mkdir(parents=True, exist_ok=True)
        try:
            out = heal(run, cut)
        except CutBeforeTraining as e:
            print(f"heal: attempt {attempt} of {attempts} discarded: {e}", flush=True)
            if attempt == attempts:
                raise
            start = float(math.ceil(e.began + 10.0))
            cut = (start, start + cut[1] - cut[0])
            continue
        out.update(attempts=attempt, cut=list(cut))
        return out
    raise AssertionError("unreachable")


def byzantine(seeds: int) -> dict:
    rows = []
    for seed in range(seeds):
        common = dict(nodes=8, topology="ring", task="digits", steps=300, eval_every=300, seed=seed)
        acc = {name: gossip.simulate(**common, **kw).summary["mean_node_accuracy"] for name, kw in
               (("clean", {}), ("attack", {"byzantine": "3=1000"}), ("attack_clip", {"byzantine": "3=1000",
                                                                                    "clip": "auto"}),
                ("clean_clip", {"clip": "auto"}))}
        rows.append(acc)
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    return {"per_seed": rows, **{f"mean_{k}": v for k, v in mean.items()},
            "clip_vs_clean_pts": 100 * (mean["attack_clip"] - mean["clean"]),
            "clip_cost_pts": 100 * (mean["clean_clip"] - mean["clean"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--dead-after", type=float, default=2.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--cut", default="20-30", metavar="START-END",
                    help="heal: seconds after each node's start during which the datacenters are cut apart")
    ap.add_argument("--heal-attempts", type=int, default=3,
                    help="heal: runs to try before giving up when a node is not yet training at its cut; the "
                         "JSON line says how many it took")
    ap.add_argument("--skip-real", action="store_true", help="only the simulator measurements")
    ap.add_argument("--churn", action="store_true", help="also the churn scenario (about twice the churn window)")
    ap.add_argument("--churn-restarts", type=int, default=40)
    ap.add_argument("--churn-every", type=float, default=15.0, help="seconds between two kills")
    args = ap.parse_args()
    try:
        cut = tuple(float(x) for x in args.cut.split("-"))
        if len(cut) != 2 or not 0 < cut[0] < cut[1]:
            raise ValueError
    except ValueError:
        ap.error(f"--cut must be START-END seconds with 0 < START < END, got {args.cut!r}")
    if args.heal_attempts < 1:
        ap.error(f"--heal-attempts must be at least 1, got {args.heal_attempts}")
    result: dict = {}
    if not args.skip_real:
        result["crash"] = c = crash(args.steps, args.dead_after)
        per_victim = "; ".join(f"{name} (status {d['exit_status']}) removed by {d['detected_by']} of "
                               f"{c['faulty']['survivors']} survivors {d['detect_first_s']:.2f}-{d['detect_last_s']:.2f} s "
                               "after its kill" for name, d in c["faulty"]["victims"].items())
        print(f"crash: {per_victim} (dead-after {args.dead_after} s); longest step gap "
              f"{c['faulty']['max_step_gap_s']:.2f} s (clean {c['clean']['max_step_gap_s']:.2f} s); accuracy "
              f"{c['faulty']['mean_accuracy']:.4f} vs clean {c['clean']['mean_accuracy']:.4f}")
    result["partition"] = p = partition()
    print(f"partition: consensus {p['consensus_before']:.3g} before, {p['consensus_end_of_split']:.3g} at the end "
          f"of the split, {p['consensus_final']:.3g} at the end; accuracy {p['final_accuracy']:.4f}"
          + (f"; real protocol: {p['merges']} nodes merged, {p['timed_out_rounds']} rounds timed out, "
             f"{p['sim_time_s']:.2f} s simulated" if "merges" in p else ""))
    if not args.skip_real:
        h = None
        try:  # a run whose cut missed training is no measurement: it retries with a later cut
            with tempfile.TemporaryDirectory() as tmp:
                h = heal_measured(Path(tmp), cut, args.heal_attempts)
        except CutBeforeTraining as e:
            refused = str(e)
        if h is None:  # no figures, and a failing exit status: the scenario did not happen
            result["heal"] = {"attempts": args.heal_attempts, "refused": refused}
        else:
            result["heal"] = {k: v for k, v in h.items() if k not in ("summaries", "logs")}
            attempt = h["attempts"]
            print(f"heal: west joined east {', '.join(f'{t:.1f}' for t in h['merged_after_cut_s'])} s after the "
                  f"cut ended; new lives {h['rejoins']}, members before the stop {h['members_before_stop']}, neighbour "
                  f"distances {max(h['neighbor_distance']):.4f} at most (attempt {attempt})")
    if args.churn and not args.skip_real:
        from benchmarks.churn import churn

        with tempfile.TemporaryDirectory() as tmp:
            r = churn(Path(tmp), restarts=args.churn_restarts, every=args.churn_every)
        result["churn"] = {k: v for k, v in r.items() if k != "kills"}
        print(f"churn: {r['restarts']} restarts, one every {r['every_s']:g} s: goodput {r['goodput']:.3f}; slowest "
              f"stretch between two steps {r['max_step_gap_s']:.2f} s; steps at the end {r['steps_at_end']}; "
              f"accuracy change {r['accuracy_change_pts']:.2f} pts")
    result["byzantine"] = b = byzantine(args.seeds)
    print(f"byzantine x1000: honest accuracy clean {b['mean_clean']:.4f}, attacked {b['mean_attack']:.4f}, "
          f"attacked+clip {b['mean_attack_clip']:.4f}, clean+clip {b['mean_clean_clip']:.4f}")
    print(json.dumps(result, default=float))
    return 1 if "refused" in result.get("heal", {}) else 0


if __name__ == "__main__":
    # every node started from scratch, as on a real machine: a restart pays its imports again
    # (the tests start theirs from a fork server that imported torch once: tests/forkserver.py)
    os.environ.setdefault("GOSSIP_TEST_FORK", "0")
    sys.exit(main())
