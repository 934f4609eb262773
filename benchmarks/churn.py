"""Churn, measured: real ``gossip-node`` processes killed with SIGKILL and started
again with ``--resume``, one every ``--every`` seconds, while the cluster trains.

5 nodes on a ring, synthetic task, ``--dead-after 2``, a checkpoint every 200
steps. Three runs of the same cluster:

1. calibration: the fault-free cluster trains for a few seconds; its rate
   (steps per second, read from the checkpoints) sets the run length, so that
   training lasts the churn window whatever the machine's speed, and the time
   its processes took to start training spaces the kills at least 2.5 times
   that apart (on a slow machine every node could otherwise be down at once);
2. clean: the fault-free cluster trains that many steps;
3. churn: the same, and every ``every`` seconds one node drawn at random (seeded)
   gets SIGKILL and starts again ``down`` seconds later with the same flags and
   ``--resume``, ``restarts`` times.

Reported: goodput (clean time over churn time for the same steps), the slowest
stretch between two local steps in any node's last life, every node's exit code
and steps, how each last life started (joined with a neighbour's state or not),
the members at the end, the rounds that timed out (each under the fault that began
last before it: ``churn_report.attribute_timeouts``), and the final accuracy against the clean
run's. The run's fault schedule goes to ``churn.faults.json`` beside the logs, and
``--analyse DIR`` reads a kept run again (``--keep DIR``) and prints the attribution
without running anything.

    python benchmarks/churn.py [--faults 40] [--every 15] [--down 2] [--seed 0] [--matched]

``--matched`` adds a third run that tells the protocol's cost from this machine's: the
clean cluster again, and at each kill's restart time a process that does a restarted
node's start-up work and no more (a fresh interpreter imports ``gossip.cli`` and
torch, builds the task's model and optimizer, takes one step, exits: about 4 CPU
seconds, nearly half of them ``torch._dynamo``, which ``torch.optim`` imports). When
every node shares one machine, those seconds come out of the others' training; on a
cluster of machines, a restarted node's start-up costs the others nothing. Reported
as ``goodput_matched`` (that run's time over the churn run's) beside ``goodput``, with
the twins' CPU seconds (``startup_cpu_s``, median and total).

``--mixed`` (8 nodes, a fault every 10 s, 60 faults: 10 minutes) draws the faults
from four kinds (each once in every four, in a seeded order), each proven as it is
applied or from the node's own log:

- ``kill``: SIGKILL (its exit status) and a start again ``--down`` s later with
  ``--resume``;
- ``stop-long``: SIGSTOP for ``--dead-after`` + 1.5 s, then SIGCONT (the kernel's
  process state ``T`` read while stopped, and the node's own log of its stall);
- ``stop-short``: SIGSTOP for half of ``--dead-after`` (the state ``T``);
- ``partition``: the two datacenters (``--dc a`` and ``--dc b``, half the nodes
  each) cut apart for ``--partition-s`` s by ``--emulate inter:down=...``, every
  node counting the windows from one ``--emulate-origin`` (the messages each
  node's emulator dropped, in its summary). The clean run has the same labels and
  an emulator without outages.

    python benchmarks/churn.py --mixed [--faults 60] [--every 10] [--seed 0]
    python benchmarks/churn.py --analyse DIR [--schedule DIR.log]

Ends with one JSON line. ``benchmarks/faults.py`` runs it too (``--churn``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gossip.core.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from benchmarks.churn_report import (KINDS, analyse, attribute_timeouts, attribution_table,  # noqa: E402,F401
                                     datacenter, draw_kinds, timed_out_rounds)
from tests.cluster import Cluster, NodeProc, free_port  # noqa: E402

DEAD_AFTER = 2.0  # the nodes' --dead-after (the stops of --mixed are measured against it)
FLAGS = ["--topology", "ring", "--task", "synthetic", "--json", "--dead-after", f"{DEAD_AFTER:g}",
         "--checkpoint-every", "200"]
# a restarted node's start-up work and no more (--matched): the node's imports, the task's
# model and optimizer (which imports torch._dynamo), one step; its CPU seconds on the last line
STARTUP_TWIN = (
    "import resource, torch\n"
    "import gossip.cli\n"
    "from gossip.training.tasks import get_task\n"
    "torch.set_num_threads(1)\n"
    "task = get_task('synthetic')\n"
    "model = task.model()\n"
    "opt = task.optimizer(model.parameters())\n"
    "batch = task.stream(0, 1, 'iid', 0).next()\n"
    "task.loss(model, batch).backward()\n"
    "opt.step()\n"
    "u = resource.getrusage(resource.RUSAGE_SELF)\n"
    "print(f'cpu {u.ru_utime + u.ru_stime:.3f}')\n"
)


def _checkpoint_step(directory: Path) -> int:
    path = latest_checkpoint(directory)
    if path is None:
        return 0
    try:
        return int(load_checkpoint(path)["step"])
    except Exception:  # being replaced right now: the next look finds it
        return 0


def _args(ports: list[int], i: int, steps: int, ck: Path, extra: list[str]) -> list[str]:
    return ["--peers", f"127.0.0.1:{ports[(i + 1) % len(ports)]}", "--steps", str(steps), "--checkpoint-dir",
            str(ck / f"n{i}"), *FLAGS, *extra]


def _process_state(pid: int) -> str:
    """The kernel's state letter of process ``pid`` (``T``: stopped), or "" where unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def _mixed_flags(i: int, n: int, windows: list[tuple[float, float]], origin: float) -> list[str]:
    """A node's datacenter label and its link emulator: the partition windows, counted
    from ``origin`` (UNIX seconds)."""
    spec = ",".join(["latency=0s", *(f"down={a:.3f}s-{b:.3f}s" for a, b in windows)])
    return ["--dc", datacenter(i, n), "--emulate", f"inter:{spec}", "--emulate-origin", f"{origin:.3f}"]


def _cluster_step(ck: Path, n: int) -> int:
    return max(_checkpoint_step(ck / f"n{i}") for i in range(n))


def calibrate(work: Path, n: int, extra: list[str], window: float = 8.0) -> tuple[float, float]:
    """Steps per second of the fault-free cluster, measured over ``window`` seconds of
    training, and the seconds from starting the processes until all of them train."""
    ports = [free_port() for _ in range(n)]
    ck = work / "calibrate"
    with Cluster(work) as c:
        spawned = time.monotonic()
        nodes = [c.start(f"cal{i}", _args(ports, i, 10**9, ck, extra), port=ports[i]) for i in range(n)]
        for x in nodes:
            x.wait_for_log("training as", 180)
        startup = time.monotonic() - spawned
        deadline = time.monotonic() + 120
        while _cluster_step(ck, n) == 0 and time.monotonic() < deadline:  # the first checkpoint
            time.sleep(0.1)
        s0, t0 = _cluster_step(ck, n), time.monotonic()
        time.sleep(window)
        s1, t1 = _cluster_step(ck, n), time.monotonic()
        for x in nodes:
            x.proc.send_signal(signal.SIGTERM)
        c.wait_all(120)
    if s1 <= s0:
        raise RuntimeError(f"the fault-free cluster did not advance in {window} s (step {s0})")
    return (s1 - s0) / (t1 - t0), startup


def run(work: Path, name: str, n: int, steps: int, extra: list[str], *, restarts: int = 0, every: float = 15.0,
        down: float = 2.0, seed: int = 0, timeout: float = 1800.0, kinds: list[str] | None = None,
        mixed: tuple[float, float] | None = None, twins: bool = False) -> dict:
    """One run of ``steps`` steps; with ``restarts``, kill and restart nodes as described
    above; with ``kinds``, one fault of each kind in turn (``--mixed``). ``mixed`` =
    (lead, partition seconds) labels the nodes' datacenters and emulates their links
    (without ``kinds``: the clean run's emulator, no outage): fault k comes ``lead + k *
    every`` seconds after the processes are started, and the partitions' windows are
    fixed before they start (every node counts them from the same moment). With
    ``twins``, a kill kills nothing: ``down`` s after its time a start-up twin
    (:data:`STARTUP_TWIN`) runs beside the untouched cluster (``--matched``)."""
    ports = [free_port() for _ in range(n)]
    ck = work / name
    rng = random.Random(seed)
    kinds = list(kinds) if kinds is not None else ["kill"] * restarts
    faults: list[dict] = []  # every fault applied (the kills, and with --mixed the others)
    origin = time.time()
    spawned = time.monotonic()
    windows: list[tuple[float, float]] = []
    if mixed is not None:
        lead, cut = mixed
        windows = [(lead + k * every, lead + k * every + cut) for k, kind in enumerate(kinds) if kind == "partition"]

    def node_args(i: int, more: list[str]) -> list[str]:
        flags = _mixed_flags(i, n, windows, origin) if mixed is not None else []
        return _args(ports, i, steps, ck, [*extra, *flags, *more])

    twin_script = work / "startup_twin.py"
    schedule = work / f"{name}.faults.json"  # (rewritten after each fault: a run that dies keeps it)
    started_twins: list[NodeProc] = []
    if twins:
        twin_script.write_text(STARTUP_TWIN)
    with Cluster(work) as c:
        current: list[NodeProc] = [c.start(f"{name}{i}.0", node_args(i, []), port=ports[i]) for i in range(n)]
        for x in current:
            x.wait_for_log("training as", 180)
        started = time.monotonic()
        started_local = datetime.now()  # (the clock of the nodes' log lines; ``at_s`` counts from here)

        def save_schedule() -> None:
            if kinds:
                schedule.write_text(json.dumps({
                    "run": name, "nodes": n, "every_s": every, "seed": seed, "started": started_local.isoformat(),
                    "addresses": [f"127.0.0.1:{port}" for port in ports], "faults": faults}, indent=1) + "\n")

        next_kill = spawned + mixed[0] if mixed is not None else started + every
        lives = 0
        for kind in kinds:
            while time.monotonic() < next_kill and any(x.proc.poll() is None for x in current):
                time.sleep(max(0.0, min(next_kill - time.monotonic(), 0.5)))
            if not any(x.proc.poll() is None for x in current):
                break
            i = rng.randrange(n)
            victim = current[i]
            if victim.proc.poll() is not None:  # it finished: the run is ending
                break
            done = _cluster_step(ck, n)
            if done >= 0.9 * steps:  # too late to come back: the others finish first
                break
            # (the same for a kill when, at the pace of this run so far, the others finish before
            # a restarted node could be back: twice this run's start-up after ``down``; the pace of
            # the calibration, under another load, said nothing of it: a life restarted that late
            # found its cluster finished, in the suite on a loaded machine. A twin joins nothing)
            pace = done / max(time.monotonic() - started, 1e-9)
            if kind == "kill" and not twins and pace > 0 and (steps - done) / pace < down + 2 * (started - spawned):
                break
            at = round(time.monotonic() - started, 2)
            at_step = _checkpoint_step(ck / f"n{i}")
            if kind == "kill" and twins:  # the restart's start-up, and no kill
                time.sleep(down)
                lives += 1
                started_twins.append(c.start(f"{name}{i}.twin{lives}", [], script=twin_script))
                faults.append({"kind": "twin", "node": i, "at_s": at})
            elif kind == "kill":
                victim.proc.send_signal(signal.SIGKILL)
                code = victim.proc.wait(30)
                time.sleep(down)
                lives += 1
                current[i] = c.start(f"{name}{i}.{lives}", node_args(i, ["--resume"]), port=ports[i])
                faults.append({"kind": kind, "node": i, "at_s": at, "checkpoint_step": at_step, "exit": code})
            elif kind in ("stop-long", "stop-short"):
                hold = DEAD_AFTER + 1.5 if kind == "stop-long" else DEAD_AFTER / 2
                victim.proc.send_signal(signal.SIGSTOP)
                t = time.monotonic()
                state = ""
                while state != "T" and time.monotonic() - t < 1.0:  # (the signal is delivered at once, or nearly)
                    state = _process_state(victim.proc.pid)
                time.sleep(max(0.0, hold - (time.monotonic() - t)))
                victim.proc.send_signal(signal.SIGCONT)
                faults.append({"kind": kind, "node": i, "at_s": at, "stopped_s": round(time.monotonic() - t, 2),
                              "state": state, "life": victim.name})
            else:  # partition: the emulators cut it at its time; nothing to do here
                a, b = windows[sum(1 for f in faults if f["kind"] == "partition")]
                lag = started - spawned  # (the windows count from the launch, ``at_s`` from the start)
                faults.append({"kind": kind, "at_s": at, "window_s": [round(a - lag, 2), round(b - lag, 2)]})
            save_schedule()
            next_kill += every
        codes = []
        for x in current:
            try:
                codes.append(x.wait(max(1.0, started + timeout - time.monotonic())))
            except Exception:
                codes.append(None)
        elapsed = time.monotonic() - started
        # the emulators cut the links at every partition planned at the launch, also those after the
        # last fault this loop applied (it stops at 90 % of the steps): faults too, though none drew them
        lag = started - spawned
        for a, b in windows[sum(1 for f in faults if f["kind"] == "partition"):]:
            if a - lag < elapsed:
                faults.append({"kind": "partition", "at_s": round(a - lag, 2),
                               "window_s": [round(a - lag, 2), round(b - lag, 2)], "emulator_only": True})
        twin_cpu = []
        for x in started_twins:
            x.wait(120)
            line = x.out.read_text().strip().splitlines()[-1:] or [""]
            if x.proc.returncode != 0 or not line[0].startswith("cpu "):
                raise RuntimeError(f"a start-up twin failed (exit {x.proc.returncode}):\n{x.log()[-2000:]}")
            twin_cpu.append(float(line[0].split()[1]))
        summaries = []
        for x in current:
            try:
                summaries.append(x.summary())
            except AssertionError:
                summaries.append({"node": x.addr, "steps": None, "error": x.log()[-2000:]})
        logs = {x.name: x.log() for x in c.nodes}
        index = {f"127.0.0.1:{port}": i for i, port in enumerate(ports)}
        rounds = [r for log in logs.values() for r in timed_out_rounds(log, index, started_local)]
        for f in faults:  # a long stop proven by the node's own log (its control plane saw the gap)
            if f["kind"] == "stop-long":
                f["logged_stall"] = "this node stalled for" in logs[f["life"]]
        save_schedule()
    return {"elapsed_s": elapsed, "exit_codes": codes, "faults": faults, "summaries": summaries,
            "timed_out_rounds": len(rounds), "timed_out_by_fault": attribute_timeouts(faults, rounds, n, every),
            "twin_cpu_s": twin_cpu}


def churn(work: Path, *, n: int = 5, restarts: int = 40, every: float = 15.0, down: float = 2.0, seed: int = 0,
          tail: float = 20.0, extra: list[str] | None = None, steps: int | None = None,
          clean_run: bool = True, calibration: tuple[float, float] | None = None, mixed: bool = False,
          partition_s: float = 4.0, matched: bool = False) -> dict:
    """Calibrate, then a clean and a churn run of the same steps; returns the figures.
    ``steps`` skips the calibration; so does ``calibration``, the (rate, start-up) that
    :func:`calibrate` measured before for the same ``n`` and ``extra`` (the tests measure
    it once for several runs); without ``clean_run`` only the churn run is made
    (a diagnosis: goodput and the accuracy change are then None). With ``mixed``,
    ``restarts`` faults drawn from :data:`KINDS` (seeded) instead of kills only. With
    ``matched``, a third run: the clean cluster beside a start-up twin at each kill's
    restart time (``goodput_matched``; see the module's docstring)."""
    extra = list(extra or [])
    rate = startup = None
    lead = 0.0  # (--mixed: when the first fault comes, counted from the processes' launch)
    if steps is None:
        rate, startup = calibration if calibration is not None else calibrate(work, n, extra)
        # the churn is measured against the time a node needs to come back: on a slow
        # machine kills are spaced so that a restarted node can train before the next
        # (otherwise every node could be down at once, whatever the protocol does)
        every = max(every, 2.5 * startup)
        lead = max(every, 3.0 * startup) if mixed else 0.0
        steps = int(rate * (restarts * every + tail + lead)) // 200 * 200 + 200
    lead = lead or max(every, 20.0)
    kinds = draw_kinds(restarts, seed) if mixed else None
    plan = (lead, partition_s) if mixed else None
    # how long a run may take: three times its measured length (the full --mixed form, 8
    # nodes on two cores, is longer than the 30 minutes that bound a run of given steps)
    limit = max(1800.0, 3.0 * steps / rate) if rate else 1800.0
    clean = run(work, "clean", n, steps, extra, mixed=plan, timeout=limit) if clean_run else None
    faulty = run(work, "churn", n, steps, extra, restarts=restarts, every=every, down=down, seed=seed, kinds=kinds,
                 mixed=plan, timeout=limit)
    # (the same seed: the twins come at the kills' times, as far as the run lasts)
    twin = run(work, "twins", n, steps, extra, restarts=restarts, every=every, down=down, seed=seed, kinds=kinds,
               mixed=plan, twins=True, timeout=limit) if matched else None
    if clean is None:
        clean = {"elapsed_s": math.nan, "summaries": [{}], "timed_out_rounds": None}
    acc_clean = [s.get("final_accuracy") for s in clean["summaries"]]
    acc = [s.get("final_accuracy") for s in faulty["summaries"]]
    last = faulty["summaries"]
    applied = faulty["faults"]
    return {
        "nodes": n, "steps": steps, "calibrated_steps_per_s": rate, "startup_s": startup, "mixed": mixed,
        "restarts": sum(1 for k in applied if k.get("kind", "kill") == "kill"),
        "faults": {kind: sum(1 for k in applied if k.get("kind") == kind) for kind in KINDS} if mixed else None,
        # each fault proven: a kill's exit status, a stop's process state T (and a long one's own log of
        # its stall), a partition's messages dropped by the emulators (of the last lives: a killed life
        # prints no summary)
        "proven": {
            "stopped": sum(1 for k in applied if k["kind"].startswith("stop") and k["state"] == "T"),
            "long_stops_logged": sum(1 for k in applied if k["kind"] == "stop-long" and k["logged_stall"]),
            "partition_losses": sum(s.get("emulated_losses") or 0 for s in last),
        } if mixed else None,
        "every_s": every, "down_s": down, "seed": seed,
        "goodput": clean["elapsed_s"] / faulty["elapsed_s"],
        "clean_s": clean["elapsed_s"], "churn_s": faulty["elapsed_s"],
        "goodput_matched": twin["elapsed_s"] / faulty["elapsed_s"] if twin is not None else None,
        "matched_s": twin["elapsed_s"] if twin is not None else None,
        "twins": len(twin["twin_cpu_s"]) if twin is not None else None,
        "startup_cpu_s": {"median": statistics.median(twin["twin_cpu_s"]), "total": sum(twin["twin_cpu_s"])}
        if twin is not None and twin["twin_cpu_s"] else None,
        "timed_out_rounds_matched": twin["timed_out_rounds"] if twin is not None else None,
        "exit_codes": faulty["exit_codes"],
        "kill_exit_codes": sorted({k["exit"] for k in applied if k.get("kind", "kill") == "kill"}),
        "steps_at_end": [s.get("steps") for s in last],
        "members_at_end": [s.get("members") for s in last],
        "joined": [s.get("joined") for s in last], "state_from": [s.get("state_from") for s in last],
        "rejoins": [s.get("rejoins") for s in last],
        "max_step_gap_s": max((s.get("max_step_gap_s") or 0.0) for s in last),
        "timed_out_rounds": faulty["timed_out_rounds"], "timed_out_rounds_clean": clean["timed_out_rounds"],
        "timed_out_by_fault": faulty["timed_out_by_fault"],
        "timed_out_rounds_at_end": [s.get("timed_out_rounds") for s in last],
        "accuracy_clean": sum(acc_clean) / len(acc_clean) if None not in acc_clean else None,
        "accuracy": acc,
        "accuracy_change_pts": (100 * (min(acc) - sum(acc_clean) / len(acc_clean))
                                if None not in acc and None not in acc_clean else None),
        "kills": [k for k in applied if k["kind"] == "kill"],
        "faults_applied": applied if mixed else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixed", action="store_true",
                    help="draw each fault from kill, a long and a short SIGSTOP, and a partition (default: kills)")
    ap.add_argument("--nodes", type=int, help="nodes (default: 5; 8 with --mixed)")
    ap.add_argument("--faults", "--restarts", dest="faults", type=int,
                    help="faults (kills) in the run (default: 40; 60 with --mixed; with --analyse, the run's)")
    ap.add_argument("--every", type=float, help="seconds between two faults (default: 15; 10 with --mixed)")
    ap.add_argument("--down", type=float, default=2.0, help="seconds a killed node stays down")
    ap.add_argument("--partition-s", type=float, default=4.0, help="seconds a partition lasts (--mixed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", metavar="DIR", help="keep the logs and checkpoints in DIR")
    ap.add_argument("--steps", type=int, help="steps per node (default: measured, to last the churn)")
    ap.add_argument("--churn-only", action="store_true", help="no clean run (a diagnosis: no goodput)")
    ap.add_argument("--matched", action="store_true",
                    help="a third run: the clean cluster beside a restart's start-up work at each kill's time "
                         "(goodput_matched: what the restarts cost beyond this machine's shared CPU)")
    ap.add_argument("--analyse", metavar="DIR",
                    help="run nothing: attribute the timed-out rounds of a run kept in DIR to its faults")
    ap.add_argument("--schedule", metavar="FILE",
                    help="with --analyse, for a DIR without churn.faults.json: the run's output (default: DIR.log)")
    args = ap.parse_args()
    if args.schedule and not args.analyse:
        ap.error("--schedule goes with --analyse")
    if args.analyse:
        try:
            r = analyse(Path(args.analyse), Path(args.schedule) if args.schedule else None,
                        planned=args.faults if args.faults is not None else 60)
        except ValueError as e:
            ap.error(str(e))
        print(f"{args.analyse}: {r['timed_out_rounds']} rounds timed out; faults {r['faults']}; schedule from "
              f"{r['schedule']}")
        print(attribution_table(r["timed_out_by_fault"]))
        print(json.dumps(r))
        return
    n = args.nodes or (8 if args.mixed else 5)
    faults = args.faults if args.faults is not None else (60 if args.mixed else 40)
    every = args.every or (10.0 if args.mixed else 15.0)
    for name, value in (("--nodes", n), ("--faults", faults)):
        if value < (2 if name == "--nodes" else 0):
            ap.error(f"{name} must be at least {2 if name == '--nodes' else 0}, got {value}")
    if args.matched and args.mixed:
        ap.error("--matched compares kills only (not with --mixed)")
    if args.matched and args.churn_only:
        ap.error("--matched needs the clean run (not with --churn-only)")
    if not (every > 0 and args.down >= 0 and args.partition_s > 0):
        ap.error("--every and --partition-s must be positive, --down at least 0")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        r = churn(work, n=n, restarts=faults, every=every, down=args.down, seed=args.seed, steps=args.steps,
                  clean_run=not args.churn_only, mixed=args.mixed, partition_s=args.partition_s,
                  matched=args.matched)
    what = f"{sum(r['faults'].values())} faults ({r['faults']})" if r["mixed"] else f"{r['restarts']} restarts"
    print(f"churn: {what}, one every {r['every_s']:g} s, {r['steps']} steps: goodput "
          f"{r['goodput']:.3f} (clean {r['clean_s']:.1f} s, churn {r['churn_s']:.1f} s); slowest stretch between "
          f"two steps {r['max_step_gap_s']:.2f} s; steps at the end {r['steps_at_end']}; members {r['members_at_end']}"
          f"; rounds timed out {r['timed_out_rounds']}; accuracy change {r['accuracy_change_pts']} pts")
    print(attribution_table(r["timed_out_by_fault"]))
    if r["goodput_matched"] is not None:
        print(f"matched: the clean cluster beside {r['twins']} restarts' start-up work ({r['startup_cpu_s']} CPU s) "
              f"took {r['matched_s']:.1f} s: goodput against it {r['goodput_matched']:.3f}")
    print(json.dumps(r, default=str))


if __name__ == "__main__":
    # every node started from scratch, as on a real machine: a restart pays its imports again
    # (the tests start theirs from a fork server that imported torch once: tests/forkserver.py)
    os.environ.setdefault("GOSSIP_TEST_FORK", "0")
    main()
