"""Ordinary PyTorch training scripts converted to GossipNode in a handful of lines,
each run as 3 real processes on loopback (tests/user_scripts/*_before.py and
*_after.py): every node takes the same number of steps, ends with the same test
figures, logs no round timeout and exits cleanly; shards of unequal length stall
nobody; a node killed and restarted resumes at the cluster's step and epoch."""

from __future__ import annotations

import difflib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forkserver
from tests.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "user_scripts"
FINISHED = re.compile(r"finished at step (\d+) \((\d+) trained here\), round (\d+); (\d+) round\(s\) timed out")


class ScriptProc:
    """A user's script as one gossip node: its addresses in GOSSIP_LISTEN / GOSSIP_PEERS,
    output in files, reaped by PID."""

    def __init__(self, workdir: Path, name: str, script: Path, port: int, peer: int, args: list[str]) -> None:
        self.name, self.port = name, port
        self.out, self.err = workdir / f"{name}.out", workdir / f"{name}.err"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", GOSSIP_LISTEN=f"127.0.0.1:{port}",
                   GOSSIP_PEERS=f"127.0.0.1:{peer}")
        self.proc: subprocess.Popen | forkserver.ForkedProc
        if forkserver.enabled():  # a process of its own, without paying torch's imports again
            self.proc = forkserver.spawn(list(args), script=str(script), env=env, cwd=str(ROOT), out=self.out,
                                         err=self.err)
        else:
            self.proc = subprocess.Popen([sys.executable, str(script), *args], stdout=open(self.out, "w"),
                                         stderr=open(self.err, "w"), env=env, cwd=str(ROOT))

    def log(self) -> str:
        return self.err.read_text()

    def stdout(self) -> str:
        return self.out.read_text()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        return self._wait(self.log, pattern, timeout, "logged")

    def wait_for_stdout(self, pattern: str, timeout: float) -> re.Match:
        return self._wait(self.stdout, pattern, timeout, "printed")

    def _wait(self, read, pattern: str, timeout: float, what: str) -> re.Match:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = re.search(pattern, read())
            if m:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: {pattern!r} not {what}:\n{self.log()[-3000:]}")

    def reap(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


def run_cluster(tmp_path: Path, script: Path, args: list[str], n: int = 3, timeout: float = 240,
                per_node: list[list[str]] | None = None) -> list[ScriptProc]:
    ports = [free_port() for _ in range(n)]
    procs: list[ScriptProc] = []
    try:
        for i in range(n):
            procs.append(ScriptProc(tmp_path, f"n{i}", script, ports[i], ports[(i + 1) % n],
                                    args + (per_node[i] if per_node else [])))
        end = time.monotonic() + timeout
        for p in procs:
            try:
                p.proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{p.name} did not finish in {timeout} s:\n{p.log()[-3000:]}") from None
    finally:
        for p in procs:
            p.reap()
    return procs


def changed_lines(before: Path, after: Path) -> tuple[int, int]:
    diff = list(difflib.unified_diff(before.read_text().splitlines(), after.read_text().splitlines(), n=0,
                                     lineterm=""))
    added = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++") and d[1:].strip())
    removed = sum(1 for d in diff if d.startswith("-") and not d.startswith("---") and d[1:].strip())
    return added, removed


def finished(p: ScriptProc) -> tuple[int, int, int]:
    """(steps, trained here, timed-out rounds) from the node's last log line."""
    m = FINISHED.search(p.log())
    assert m, f"{p.name} logged no finish:\n{p.log()[-3000:]}"
    return int(m.group(1)), int(m.group(2)), int(m.group(4))


def check_clean(procs: list[ScriptProc]) -> None:
    for p in procs:
        assert p.proc.returncode == 0, f"{p.name} exit {p.proc.returncode}:\n{p.log()[-3000:]}"
        assert "timed out waiting" not in p.log(), p.log()[-3000:]
        assert "training as" in p.log() and "Traceback" not in p.log(), p.log()[-3000:]


def figures(p: ScriptProc, pattern: str) -> list[float]:
    found = [float(x) for x in re.findall(pattern, p.stdout())]
    assert found, f"{p.name} printed no {pattern!r}:\n{p.stdout()[-2000:]}"
    return found


CASES = {
    # script, arguments, the last test figure printed, how close the nodes must be
    "mnist": ("mnist", [], r"Accuracy: \d+/\d+ \(([\d.]+)%\)", 0.5),
    "lm": ("lm", [], r"test loss ([\d.]+)", 1e-4),
    "recommender": ("recommender", [], r"test rmse ([\d.]+)", 1e-4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_converted_script_runs_as_three_agreeing_nodes(tmp_path, case):
    name, args, pattern, tolerance = CASES[case]
    before, after = SCRIPTS / f"{name}_before.py", SCRIPTS / f"{name}_after.py"
    added, removed = changed_lines(before, after)
    assert added <= 6 and removed <= 6, (added, removed)
    # different seeds: the nodes agree on a common start only because GossipNode makes them
    per_node = [["--seed", str(10 + i)] for i in range(3)] if case == "mnist" else None
    procs = run_cluster(tmp_path, after, args, per_node=per_node)
    check_clean(procs)
    ends = [finished(p) for p in procs]
    steps = {s for s, _, _ in ends}
    assert len(steps) == 1 and steps.pop() > 0, ends
    assert all(t == 0 for _, _, t in ends), ends
    finals = [figures(p, pattern)[-1] for p in procs]
    assert max(finals) - min(finals) <= tolerance, finals
    assert any("took the starting parameters of" in p.log() for p in procs), [p.log()[-2000:] for p in procs]


def test_unequal_shards_stall_nobody(tmp_path):
    """Shards of 300, 400 and 500 samples (6, 8, 10 batches an epoch): the nodes whose
    data ends first keep taking part in rounds until the last one ends (DDP's Join)
    instead of leaving it to wait out a round timeout per round."""
    procs = run_cluster(tmp_path, SCRIPTS / "uneven_shards.py", [])
    check_clean(procs)
    trained = [finished(p)[1] for p in procs]
    by_rank = {int(re.search(r"training as (\d) of 3", p.log()).group(1)): t for p, t in zip(procs, trained)}
    assert by_rank == {0: 18, 1: 24, 2: 30}, by_rank
    served = [p for p in procs if "more round(s) while others trained" in p.log()]
    assert len(served) == 2, [p.log()[-1500:] for p in procs]


def wait_removed(survivors: list[ScriptProc], port: int, timeout: float = 120) -> None:
    """Until every survivor has removed the killed node at ``port`` (its detector's verdict).

    A process started again sooner, before the failure detector could find its old life
    dead (forked from the tests' server, it listens within milliseconds), meets the race
    of a restart faster than detection: each member then drops the old life at the round
    it hears of the new one, not at one announced round, and members can plan an epoch's
    data differently. A real restart (a fresh interpreter, torch's imports) takes
    seconds; these tests restart as one does."""
    needle = f"member 127.0.0.1:{port} removed"
    end = time.monotonic() + timeout
    while time.monotonic() < end and not all(needle in p.log() for p in survivors):
        time.sleep(0.05)
    assert all(needle in p.log() for p in survivors), [p.log()[-2000:] for p in survivors]


def test_killed_node_restarts_at_the_clusters_step_and_epoch(tmp_path):
    """kill -9 one node after it wrote a checkpoint, start it again with the same
    checkpoint directory: it continues in the epoch and at the step the cluster is
    at (not from its first epoch), and everyone ends at the same step
    (tests/peer/test_join_state.py checks the state it takes)."""
    n = 3
    ports = [free_port() for _ in range(n)]
    last = tmp_path / "last"
    script = SCRIPTS / "restartable.py"

    def start(i: int, name: str) -> ScriptProc:
        return ScriptProc(tmp_path, name, script, ports[i], ports[(i + 1) % n],
                          ["--checkpoints", str(tmp_path / f"ck{i}"), "--last", str(last)])

    procs = [start(i, f"n{i}") for i in range(n)]
    try:
        spe = int(re.search(r"steps per epoch (\d+)", procs[1].wait_for_stdout(r"steps per epoch \d+", 120)
                            .group(0)).group(1))
        ck = tmp_path / "ck1"
        end = time.monotonic() + 120
        while not list(ck.glob("ckpt-*.pt")) and time.monotonic() < end:
            time.sleep(0.05)
        assert list(ck.glob("ckpt-*.pt")), procs[1].log()[-3000:]
        procs[1].proc.send_signal(signal.SIGKILL)
        procs[1].proc.wait(timeout=10)
        wait_removed([procs[0], procs[2]], ports[1])
        done = re.findall(r"steps (\d+)", procs[1].stdout())
        killed_at = int(done[-1]) if done else 0  # the last epoch it finished
        back = start(1, "n1b")
        procs.append(back)
        m = back.wait_for(r"continuing at step (\d+)", 120)
        resumed = int(m.group(1))
        epochs_now = [int(e) for p in (procs[0], procs[2]) for e in re.findall(r"epoch (\d+) ", p.stdout())]
        target = max(epochs_now + [resumed // spe]) + 3
        last.write_text(str(target))
        for p in (procs[0], procs[2], back):
            p.proc.wait(timeout=240)
    finally:
        for p in procs:
            p.reap()
    for p in (procs[0], procs[2], back):
        assert p.proc.returncode == 0, p.log()[-3000:]
    assert resumed > 0 and resumed >= killed_at, (resumed, killed_at)
    first = re.search(r"epoch (\d+) batches (\d+)", back.stdout())
    assert first, back.stdout()
    # the epoch it was in, the batches of its shard still to do: not its first epoch again. Or, when
    # that epoch began while it was away (its data shared by the two others), none of it: it takes
    # part in the rounds without training until the epoch ends, and has its shard from the next one
    cont = re.search(r"continuing in epoch (\d+), after batch (\d+) of (\d+)", back.log())
    serve = re.search(r"joined in epoch (\d+), .* until it ends at step (\d+)", back.log())
    assert (cont is None) != (serve is None), back.log()[-3000:]
    ends = [finished(p) for p in (procs[0], procs[2], back)]
    assert len({s for s, _, _ in ends}) == 1, ends
    if cont:
        epoch, done, total = map(int, cont.groups())
        assert (int(first.group(1)), int(first.group(2))) == (epoch, total - done), (first.group(0), cont.group(0))
        assert ends[2][1] == ends[2][0] - resumed, ends  # trained only the steps after its restart
    else:
        # (that epoch's body runs over no batches, its own code as on the others; then a whole epoch)
        assert (int(first.group(1)), int(first.group(2))) == (int(serve.group(1)), 0), first.group(0)
        second = re.findall(r"epoch (\d+) batches (\d+)", back.stdout())[1]
        assert (int(second[0]), int(second[1])) == (int(serve.group(1)) + 1, spe), second
        assert ends[2][1] == ends[2][0] - int(serve.group(2)), ends  # none of the epoch it had no shard of
    assert list((tmp_path / "ck1").glob("ckpt-*.pt")) and list((tmp_path / "ck0").glob("ckpt-*.pt"))
