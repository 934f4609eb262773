"""Hybrid parallelism benchmark: groups of K ranks started with ``gossip-node --nproc-per-node K``.

Two figures, each a side-by-side comparison made in one invocation.

**The exchange's time, K = 1, 2, 4.** Two members on this machine train a
``--mib`` MiB float32 model (``--mib/64`` layers of 4096 x 4096 and a small
head; synthetic data, batch 4) and exchange every step. K = 1 is a plain
``gossip-node`` (a group of one, the whole model in one message); K > 1 is
``gossip-node --nproc-per-node K --intra fsdp`` (torchrun's launcher, FSDP inside,
gloo on CPU): rank r gossips its 1/K shard with rank r of the other group, K
streams at once. Every rank's connection is emulated at ``--gbit`` Gbit/s
(``--emulate all:bandwidth=...``), as on GPU servers with a network card per GPU
or WAN links where one TCP stream is window-bound. Each rank notes the end of
each local step (its optimizer step) and the start of the next (the task's
``loss``): in between, the rank exchanged (``GroupLeader.step`` /
``GroupFollower.step``, or the single node's lifecycle): sent its shard, waited
for the neighbour's, checked and mixed it. An exchange's time is from the last
end of a step among all ranks of both members to the last start of the next
step: a rank that ended its step first waits for its neighbour's shard, so the
exchange is over one transfer (and a mix) after the last rank ended its step,
however far apart the members' steps ended. The figure is the median over the
exchanges after ``--warmup``.
The final JSON line holds ``exchange_time_k1_over_k4`` (target >= 3).

**A neighbour group killed.** Two groups of 2 ranks (FSDP, a small model, a
round every step, ``--heartbeat`` / ``--dead-after``). ``control``: both train
``--kill-steps`` steps past step 30 and get SIGTERM. ``kill``: the same, but at
step 30 of group A, ``kill -9`` of group B's launcher and its ranks (the process
group of B's launcher); A trains on. The figure is A's longest gap between two
local steps (``max_step_gap_s``, from A's summary) in each run, against the
detection bound of the failure detector for two members
(``Timing.detection_bound``: SWIM by default): A may wait for B at most about
that long, never a round's ``--timeout``.

    nice -n 10 python benchmarks/hybrid.py [--mib 256] [--ks 1,2,4] [--gbit 1] [--steps 10] [--warmup 3]

Every process is started in a session of its own, reaped by its PID (its session
killed on the way out), on free loopback ports, under hard time limits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WIDTH = 4096  # a layer is WIDTH x WIDTH float32: 64 MiB
# the exchange runs: a failure detector slow enough that a state message holding a rank's
# emulated link for seconds (control messages queue behind it) is no false death
PATIENT = ["--heartbeat", "1", "--dead-after", "30", "--settle", "1", "--grace", "3"]


# -- the task the ranks run (``--task benchmarks.hybrid:timed_task``) ---------------------------------

def timed_task():
    """The synthetic task with a wide MLP, noting the time of each local step; its
    ``evaluate`` (run once, at the end) writes them to ``$HYBRID_TIMES/<name>-<rank>.json``."""
    from gossip.training.tasks import SyntheticTask

    class TimedTask(SyntheticTask):
        def __init__(self) -> None:
            layers = max(1, int(os.environ.get("HYBRID_MIB", "256")) // 64)
            super().__init__(dim=WIDTH, hidden=(WIDTH,) * layers, classes=8, samples=512, test_samples=16,
                             batch_size=4, lr=0.01)
            self.started: list[float] = []  # each local step's start (its loss)
            self.stepped: list[float] = []  # each local step's end (its optimizer step)

        def optimizer(self, params):
            opt = super().optimizer(params)
            opt.register_step_post_hook(lambda *_: self.stepped.append(time.monotonic()))
            return opt

        def loss(self, model, batch):
            self.started.append(time.monotonic())
            return super().loss(model, batch)

        def evaluate(self, model, device="cpu"):
            out = os.environ.get("HYBRID_TIMES")
            if out:
                name = f"{os.environ['HYBRID_NAME']}-{os.environ.get('RANK', '0')}.json"
                Path(out, name).write_text(json.dumps({"started": self.started, "stepped": self.stepped}))
            return super().evaluate(model, device)

    return TimedTask()


# -- processes -----------------------------------------------------------------------------------

class Member:
    """One ``gossip-node`` (K > 1: its launcher and K ranks) in a session of its own."""

    def __init__(self, name: str, port: int, k: int, args: list[str], tmp: Path, env: dict[str, str]) -> None:
        self.name, self.port, self.k = name, port, k
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        cmd = [sys.executable, "-c", "import sys; from gossip.cli import node_main; sys.exit(node_main())",
               "--listen", f"tcp://127.0.0.1:{port}", "--threads", "1", "--json", *args]
        if k > 1:
            cmd += ["--nproc-per-node", str(k)]
        self.proc = subprocess.Popen(cmd, stdout=open(self.out, "w"), stderr=open(self.err, "w"), cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                          "PYTHONUNBUFFERED": "1", "HYBRID_NAME": name, **env},
                                     start_new_session=True)

    def wait(self, limit: float) -> int:
        try:
            return self.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{self.name} still running after {limit:g} s:\n{self.log()[-3000:]}") from None

    def log(self) -> str:
        return self.err.read_text(errors="replace")

    def summary(self) -> dict:
        lines = [ln for ln in self.out.read_text().splitlines() if ln.startswith("{")]
        if not lines:
            raise RuntimeError(f"{self.name} printed no summary:\n{self.log()[-3000:]}")
        return json.loads(lines[-1])

    def kill(self) -> None:
        """SIGKILL to the member's session (its launcher and ranks), then reap the launcher."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)


class Members(list):
    """Members killed and reaped, whatever happens."""

    def __enter__(self) -> "Members":
        return self

    def __exit__(self, *exc: object) -> None:
        for m in self:
            m.kill()


def _ports(k: int, n: int) -> list[int]:
    """``n`` bases, each with ``k`` consecutive free ports, no port twice."""
    from gossip.transport.ports import free_ports

    taken: set[int] = set()
    out = []
    while len(out) < n:
        base = free_ports(k, consecutive=True)[0]
        block = set(range(base, base + k))
        if not block & taken:
            taken |= block
            out.append(base)
    return out


# -- the exchange's time -----------------------------------------------------------------------------

def _times(tmp: Path, name: str, k: int) -> list[dict]:
    return [json.loads((tmp / f"{name}-{r}.json").read_text()) for r in range(k)]


def _exchange_times(ranks: list[dict]) -> list[float]:
    """Per exchange, its time for the cluster: from the last end of a local step (an
    optimizer step) among all ranks to the last start of the next step. Each rank sends its
    shard at the end of its step and starts the next one once it has mixed its neighbour's:
    a rank that ended first waits for the last one's shard, so the exchange is over when the
    neighbour of the last rank to end has its shard, one transfer (and a mix) after that end."""
    n = min(min(len(t["stepped"]), len(t["started"]) - 1) for t in ranks)
    return [max(t["started"][i + 1] for t in ranks) - max(t["stepped"][i] for t in ranks) for i in range(n)]


def _step_times(ranks: list[dict]) -> list[float]:
    """Per local step, from one step's start to the next one's, the slowest rank's."""
    n = min(len(t["started"]) for t in ranks)
    return [max(t["started"][i + 1] - t["started"][i] for t in ranks) for i in range(n - 1)]


def run_k(k: int, args: argparse.Namespace, tmp: Path) -> dict:
    """Two members of ``k`` ranks exchanging every step; the time of their exchanges."""
    d = tmp / f"k{k}"
    d.mkdir()
    pa, pb = _ports(k, 2)
    common = ["--task", "benchmarks.hybrid:timed_task", "--steps", str(args.steps), "--period", "1",
              "--timeout", str(args.limit), "--emulate", f"all:bandwidth={args.gbit:g}Gbit,latency=0", *PATIENT]
    if k > 1:
        common += ["--intra", "fsdp"]
    env = {"HYBRID_TIMES": str(d), "HYBRID_MIB": str(args.mib)}
    with Members() as ms:
        for name, port, other in (("a", pa, pb), ("b", pb, pa)):
            ms.append(Member(name, port, k, [*common, "--peers", f"127.0.0.1:{other}"], d, env))
        codes = [m.wait(args.limit) for m in ms]
        if any(codes):
            raise RuntimeError(f"K={k}: exit {codes}:\n" + "\n".join(m.log()[-2000:] for m in ms))
        summaries = [m.summary() for m in ms]
    if any(s["members"] != 2 for s in summaries):
        raise RuntimeError(f"K={k}: the two members did not train together: {[s['members'] for s in summaries]}")
    ranks = {name: _times(d, name, k) for name in ("a", "b")}
    exchanges = _exchange_times(ranks["a"] + ranks["b"])[args.warmup:]
    steps = [max(x, y) for x, y in zip(*(_step_times(ranks[name]) for name in ("a", "b")))][args.warmup:]
    return {"k": k, "exchange_s": statistics.median(exchanges), "exchanges_s": [round(x, 3) for x in exchanges],
            "step_s": statistics.median(steps), "timed_out_rounds": sum(s["timed_out_rounds"] for s in summaries),
            "message_mib": summaries[0]["bytes_sent"] / args.steps / 2**20}


# -- a neighbour group killed ------------------------------------------------------------------------

def _steps_done(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(ln).get("step", 0) for ln in lines if ln.endswith("}")]
    return max(steps, default=0)


def _wait_steps(m: Member, metrics: Path, step: int, limit: float) -> None:
    end = time.monotonic() + limit
    while _steps_done(metrics) < step:
        if m.proc.poll() is not None:
            raise RuntimeError(f"{m.name} ended (exit {m.proc.returncode}) before step {step}:\n{m.log()[-3000:]}")
        if time.monotonic() > end:
            raise RuntimeError(f"{m.name} not at step {step} after {limit:g} s:\n{m.log()[-3000:]}")
        time.sleep(0.1)


def run_kill(kill: bool, args: argparse.Namespace, tmp: Path) -> dict:
    """Groups A and B (2 ranks each) train; with ``kill``, B's launcher and ranks get SIGKILL at
    A's step 30. A is stopped (SIGTERM) ``--kill-steps`` steps later; its summary's figures."""
    d = tmp / ("kill" if kill else "control")
    d.mkdir()
    pa, pb = _ports(2, 2)
    metrics = d / "a.jsonl"
    common = ["--task", "synthetic:hidden=63,classes=5", "--steps", "1000000", "--period", "1", "--intra", "fsdp",
              "--timeout", "30", "--heartbeat", str(args.heartbeat), "--dead-after", str(args.dead_after),
              "--settle", "1", "--grace", "3"]
    with Members() as ms:
        a = Member("a", pa, 2, [*common, "--peers", f"127.0.0.1:{pb}", "--log", str(metrics), "--eval-every", "1"],
                   d, {})
        b = Member("b", pb, 2, [*common, "--peers", f"127.0.0.1:{pa}"], d, {})
        ms += [a, b]
        _wait_steps(a, metrics, 30, args.limit)
        if kill:
            b.kill()
        _wait_steps(a, metrics, 30 + args.kill_steps, args.limit)
        for m in ([a] if kill else [a, b]):
            m.proc.send_signal(signal.SIGTERM)  # the launcher passes it on; rank 0 stops at the next exchange
        codes = [m.wait(args.limit) for m in ([a] if kill else [a, b])]
        if any(codes):
            raise RuntimeError(f"{'kill' if kill else 'control'}: exit {codes}:\n{a.log()[-3000:]}")
        s = a.summary()
    return {"max_step_gap_s": s["max_step_gap_s"], "timed_out_rounds": s["timed_out_rounds"],
            "members": s["members"], "steps": s["steps"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="model size in MiB (layers of 64 MiB)")
    p.add_argument("--ks", default="1,2,4", help="ranks per group to run (1 is a plain gossip-node)")
    p.add_argument("--gbit", type=float, default=1.0, help="emulated bandwidth of each rank's connection")
    p.add_argument("--steps", type=int, default=10, help="local steps per run (an exchange each)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    p.add_argument("--heartbeat", type=float, default=0.25, help="the kill runs' --heartbeat")
    p.add_argument("--dead-after", type=float, default=2.0, help="the kill runs' --dead-after")
    p.add_argument("--kill-steps", type=int, default=150, help="steps group A trains after the kill")
    p.add_argument("--skip", default="", help="comma list of parts to skip: exchange, kill")
    p.add_argument("--limit", type=float, default=600.0, help="seconds any one run may take")
    args = p.parse_args()
    if args.steps <= args.warmup + 1:
        p.error(f"--steps must exceed --warmup + 1, got {args.steps} and {args.warmup}")
    skip = set(filter(None, args.skip.split(",")))
    ks = [int(k) for k in args.ks.split(",")]
    summary: dict = {"mib": args.mib, "gbit": args.gbit, "ks": ks}
    with tempfile.TemporaryDirectory() as tmp:
        if "exchange" not in skip:
            rows = [run_k(k, args, Path(tmp)) for k in ks]
            ideal = args.mib * 2**20 * 8 / (args.gbit * 1e9)
            print(f"two members, a {args.mib} MiB model (K > 1: fsdp), each rank's link {args.gbit:g} Gbit/s "
                  f"(the whole model in one stream: {ideal:.2f} s); median step over steps {args.warmup + 1}.."
                  f"{args.steps - 1}, the slowest rank's")
            print(f"{'K':>3} {'rank 0 MiB/exchange':>20} {'step s':>7} {'exchange s':>11} {'transfer s':>11} "
                  f"{'exchanges s':>32} {'timed out':>10}")
            for r in rows:
                print(f"{r['k']:>3} {r['message_mib']:>20.1f} {r['step_s']:>7.3f} {r['exchange_s']:>11.3f} "
                      f"{ideal / r['k']:>11.3f} {' '.join(f'{x:.2f}' for x in r['exchanges_s']):>32} "
                      f"{r['timed_out_rounds']:>10}")
            by_k = {r["k"]: r for r in rows}
            summary.update(
                exchange_s={str(r["k"]): round(r["exchange_s"], 3) for r in rows},
                step_s={str(r["k"]): round(r["step_s"], 3) for r in rows},
                exchange_time_k1_over_k4=(round(by_k[1]["exchange_s"] / by_k[4]["exchange_s"], 3)
                                          if 1 in by_k and 4 in by_k else None),
                timed_out=sum(r["timed_out_rounds"] for r in rows))
        if "kill" not in skip:
            from gossip.protocol.timing import Timing

            bound = Timing(heartbeat=args.heartbeat, dead_after=args.dead_after).detection_bound("swim", 2)
            control, killed = run_kill(False, args, Path(tmp)), run_kill(True, args, Path(tmp))
            print(f"groups of 2 (fsdp), --heartbeat {args.heartbeat:g} --dead-after {args.dead_after:g}: "
                  f"detection bound (swim, 2 members) {bound:.2f} s")
            print(f"{'run':>8} {'A longest step gap s':>21} {'over bound':>11} {'A timed out':>12} {'A members':>10}")
            for name, r in (("control", control), ("kill", killed)):
                print(f"{name:>8} {r['max_step_gap_s']:>21.3f} {r['max_step_gap_s'] / bound:>11.3f} "
                      f"{r['timed_out_rounds']:>12} {r['members']:>10}")
            summary.update(max_step_gap_s=round(killed["max_step_gap_s"], 3),
                           control_max_step_gap_s=round(control["max_step_gap_s"], 3),
                           detect_bound_s=round(bound, 3),
                           max_step_gap_over_bound=round(killed["max_step_gap_s"] / bound, 3),
                           kill_timed_out_rounds=killed["timed_out_rounds"], kill_members_after=killed["members"])
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
