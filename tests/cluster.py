"""Start real gossip-node processes on loopback for tests: free ports, hard time
limits, and every process reaped (by PID) whatever happens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gossip.transport.ports import free_port, free_ports
from tests import forkserver


ROOT = str(Path(__file__).resolve().parents[1])

# the timing of real runs compared number for number with the simulator or with single
# nodes: every round mixes every member, so a hiccup of a loaded machine must neither leave a
# slow neighbour out of a round (a suspect silent for a second) nor have it declared dead;
# such a test also asserts that no round timed out or went on without a neighbour
EXACT = ["--heartbeat", "0.25", "--dead-after", "10", "--settle", "1", "--grace", "5", "--timeout", "60",
         "--wait-for-suspects"]


def _node_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A node process's environment: unbuffered output, one OpenMP thread, ``extra``, and
    this checkout's gossip first on the path, wherever (or whether) the package is
    installed (a script runs with its own folder first on its path, not the repository's)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def _die_with_parent() -> None:
    """In the child, before it runs: on Linux, SIGKILL it when the test process dies, so that
    a test run that is itself killed (a CI timeout, ^C twice) leaves no node behind; the
    reaping in :meth:`Cluster.__exit__` covers every other end."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class NodeProc:
    """One ``gossip-node`` (or, with ``script``, a Python script of the user's own, given
    ``HOST:PORT`` as its first argument); stdout/stderr go to files in ``workdir``.
    With ``group=K`` the node is a group of K processes under torchrun's launcher
    (``--nproc-per-node K``): rank r listens on the port + r. With ``script`` and
    ``torchrun=K``, the script runs under ``torch.distributed.run --nproc-per-node K``
    instead, its address in ``GOSSIP_LISTEN`` (every rank's); ``env`` adds to its
    environment. Every process imports this checkout's gossip. Each node runs in a
    session of its own, so that a kill reaches the launcher's workers too."""

    def __init__(self, workdir: Path, name: str, args: list[str], port: int | None = None,
                 script: Path | None = None, group: int = 1, torchrun: int = 0,
                 env: dict[str, str] | None = None) -> None:
        self.group = group = max(group, torchrun)
        self.port = port or (free_ports(group, consecutive=True)[0] if group > 1 else free_port())
        self.addr = f"127.0.0.1:{self.port}"
        self.name = name
        self.out = workdir / f"{name}.out"
        self.err = workdir / f"{name}.err"
        env = _node_env(env)
        if script is not None and torchrun:
            env["GOSSIP_LISTEN"] = self.addr
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(torchrun),
                   str(script), *args]
        elif script is not None:
            cmd = [sys.executable, str(script), self.addr, *args]
        else:
            cmd = [sys.executable, "-c", "import sys; from gossip.cli import node_main; sys.exit(node_main())",
                   "--listen", f"tcp://{self.addr}", "--threads", "1", "-v", *args]
            if group > 1:
                cmd += ["--nproc-per-node", str(group)]
        self.proc: subprocess.Popen | forkserver.ForkedProc
        if forkserver.enabled():  # a process of its own, without paying torch's imports again
            if torchrun:
                self.proc = forkserver.spawn(cmd[3:], module="torch.distributed.run", env=env, cwd=ROOT,
                                             out=self.out, err=self.err)
            else:
                self.proc = forkserver.spawn(cmd[2 if script is not None else 3:],
                                             script=str(script) if script else None, env=env, cwd=ROOT,
                                             out=self.out, err=self.err)
        else:
            self.proc = subprocess.Popen(cmd, stdout=open(self.out, "w"), stderr=open(self.err, "w"), env=env,
                                         cwd=ROOT, start_new_session=True, preexec_fn=_die_with_parent)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def summary(self) -> dict:
        lines = [ln for ln in self.out.read_text().splitlines() if ln.startswith("{")]
        assert lines, f"{self.name} printed no JSON; stderr:\n{self.log()[-3000:]}"
        return json.loads(lines[-1])

    def log(self) -> str:
        return self.err.read_text()

    def wait_for_log(self, needle: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if needle in self.log():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{self.name}: {needle!r} not logged in {timeout} s:\n{self.log()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL to the node's whole session (a group's workers too), then reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the session this node leads: its own processes only
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)

    def ranks(self) -> list[int]:
        """The PIDs of a group's worker processes (children of its launcher), in start order."""
        try:
            out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        except OSError:
            return []
        return sorted(int(x) for x in out.split())


def records(metrics: Path) -> list[dict]:
    """The complete records of the ``--log`` JSON-lines file ``metrics`` so far."""
    text = metrics.read_text() if metrics.exists() else ""
    return [json.loads(ln) for ln in text.splitlines() if ln.endswith("}")]


def wait_for_step(metrics: Path, step: int, timeout: float, since: int = 0, *, members: int | None = None) -> dict:
    """Wait until the ``--log`` JSON-lines file ``metrics`` holds a record at ``step``
    or later among its records after the first ``since`` (and, with ``members``, that
    counts that many members); returns the first such record (what the node reported
    while it still trained, before any stop the caller sends next). ``since`` skips
    what an earlier life wrote: a node that joined another cluster takes that
    cluster's step, which may be below its own."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for rec in records(metrics)[since:]:
            if rec.get("step", 0) >= step and members in (None, rec.get("members")):
                return rec
        time.sleep(0.1)
    counting = "" if members is None else f" with {members} members"
    raise AssertionError(f"{metrics} did not reach step {step}{counting} (after record {since}) in {timeout} s")


def run_node(args: list[str], workdir: Path, name: str = "run", timeout: float = 120.0) -> subprocess.CompletedProcess:
    """``gossip-node ARGS`` run to its end as a process of its own (from the tests' fork
    server when it runs); its exit status and output."""
    env = _node_env()
    if not forkserver.enabled():
        return subprocess.run([sys.executable, "-c", "import sys; from gossip.cli import node_main; "
                               "sys.exit(node_main())", *args], capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=ROOT)
    out, err = workdir / f"{name}.out", workdir / f"{name}.err"
    proc = forkserver.spawn(list(args), env=env, cwd=ROOT, out=out, err=err)
    try:
        code = proc.wait(timeout)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, code, out.read_text(), err.read_text())


class Cluster:
    """Context manager owning a set of node processes."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.nodes: list[NodeProc] = []

    def start(self, name: str, args: list[str], port: int | None = None, script: Path | None = None,
              group: int = 1, torchrun: int = 0, env: dict[str, str] | None = None) -> NodeProc:
        node = NodeProc(self.workdir, name, args, port, script, group, torchrun, env)
        self.nodes.append(node)
        return node

    def wait_all(self, timeout: float) -> list[int]:
        end = time.monotonic() + timeout
        codes = []
        for n in self.nodes:
            try:
                codes.append(n.wait(max(0.1, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{n.name} did not finish in {timeout} s:\n{n.log()[-3000:]}") from None
        return codes

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        for n in self.nodes:  # only the processes we started, by PID
            n.kill()
