"""A fork server for the tests' node processes.

Every node a test starts is a real process of its own (its own PID, session, sockets
and signals; ``kill -9`` kills it), but starting one from scratch costs about 4 CPU
seconds before it trains: importing torch, and the first optimizer, which imports
torch._dynamo. Across the suite's few hundred nodes on a 2-core machine that was
minutes of the run. The server (:func:`serve`) pays those imports once, then forks
a child per node: the child takes a session of its own, its stdout and stderr files,
its environment, working directory and ``argv``, reseeds the random generators a
fresh process would seed from the OS (Python's and NumPy's), and runs ``gossip-node``
(or a script as ``__main__``), its exit status reported back as ``Popen`` reports one
(``-N`` for a signal). The server forks before any torch computation, thread or
ZeroMQ context exists in it, so the children start from a clean single-threaded state.

A group's launcher (``gossip-node --nproc-per-node K``, or ``torch.distributed.run`` over
a script) is forked too, and forks its ranks in turn: where torch's elastic launcher
would start a rank as the command ``python -u -m MODULE ...`` or ``python -u SCRIPT ...``
(``Popen``, a session of its own), it forks instead, and the child runs the module or
script as a fresh interpreter would (default signal handlers, no logging configured, no
exit handlers but its own). Everything else about the launcher is torch's: its
rendezvous, each rank's environment, its restarts, its signals and its waits; a rank is
still a process of its own, a child of its launcher.

``GOSSIP_TEST_FORK=0`` starts every node, launcher and rank from scratch instead
(``subprocess.Popen``).
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["enabled", "spawn", "ForkedProc", "serve"]


def enabled() -> bool:
    return os.environ.get("GOSSIP_TEST_FORK", "1") != "0" and sys.platform.startswith("linux")


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: SIGKILL this process when its parent dies."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


# -- the test process's side --------------------------------------------------------------

class _PopenLike:
    """``terminate`` and ``kill`` over a subclass's ``send_signal``, as ``subprocess.Popen`` has them."""

    def send_signal(self, sig: int) -> None:
        raise NotImplementedError

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedProc(_PopenLike):
    """A node forked by the server: the part of ``subprocess.Popen``'s interface the tests use."""

    def __init__(self, server: "_Server", pid: int, args: list[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_of(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._server.exit_of(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a PID the server has reaped (it may be another's by now)
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


class _Server:
    """The server process, and a thread reading what it reports (started PIDs, exits)."""

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-c", "from tests.forkserver import serve; serve()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=str(ROOT), env=env,
                                     preexec_fn=_die_with_parent)
        self._lock = threading.Lock()  # one start at a time: its reply is the next "started" line
        self._cond = threading.Condition()
        self._started: list[int] = []
        self._exits: dict[int, int] = {}
        self._dead = False
        threading.Thread(target=self._read, name="forkserver", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, *rest = line.decode().split()
            with self._cond:
                if kind == "started":
                    self._started.append(int(rest[0]))
                elif kind == "exit":
                    self._exits[int(rest[0])] = int(rest[1])
                self._cond.notify_all()
        with self._cond:
            self._dead = True
            self._cond.notify_all()

    def start(self, request: dict[str, Any]) -> int:
        assert self.proc.stdin is not None
        with self._lock:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            with self._cond:
                if not self._cond.wait_for(lambda: self._started or self._dead, timeout=60):
                    raise RuntimeError("the tests' fork server did not answer in 60 s")
                if not self._started:
                    raise RuntimeError("the tests' fork server died")
                return self._started.pop(0)

    def exit_of(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit status once the server reaped it; None while it runs after ``timeout``."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._dead, timeout=timeout)
            if pid not in self._exits and self._dead:  # its nodes died with it (their death signal)
                raise RuntimeError(f"the tests' fork server ended while node {pid} ran")
            return self._exits.get(pid)


_server: _Server | None = None
_server_lock = threading.Lock()


def spawn(args: list[str], *, script: str | None = None, module: str | None = None, env: dict[str, str], cwd: str,
          out: Path, err: Path) -> ForkedProc:
    """Start a node: ``gossip-node`` with ``args``, or ``script`` or ``module`` (run as
    ``__main__``) with ``args`` as its arguments; stdout and stderr to the files ``out``
    and ``err``."""
    global _server
    for path in (out, err):  # there before this returns, as Popen's files are
        open(path, "w").close()
    with _server_lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
        server = _server
    pid = server.start({"args": args, "script": script, "module": module, "env": env, "cwd": cwd, "out": str(out),
                        "err": str(err)})
    return ForkedProc(server, pid, [script or module or "gossip-node", *args])


# -- the server's side --------------------------------------------------------------------

def _warm() -> None:
    """What every node imports before it trains, imported once here."""
    import numpy  # noqa: F401
    import torch
    import zmq  # noqa: F401

    import gossip.cli  # noqa: F401
    import gossip.peer.driver  # noqa: F401
    import gossip.peer.user_loop  # noqa: F401
    import gossip.training.tasks  # noqa: F401

    # the first optimizer imports torch._dynamo (optimizer methods are wrapped to disable it)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    _fork_ranks()


def _fork_ranks() -> None:
    """Make torch's elastic launcher, in every child, fork its ranks (see the module's doc)."""
    import torch.distributed.fsdp  # noqa: F401 - what a group's ranks import
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler = subprocess_handler.SubprocessHandler
    popen = handler._popen

    def _popen(self: Any, args: tuple, env: dict[str, str]) -> Any:
        if tuple(args[:2]) != (sys.executable, "-u"):
            return popen(self, args, env)
        files = [(fd, f.fileno()) for fd, f in ((1, self._stdout), (2, self._stderr)) if f is not None]
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setsid()  # as Popen(start_new_session=True)
                for fd, f in files:
                    os.dup2(f, fd)
                os.environ.clear()
                os.environ.update(env)
                code = _rank(list(args[2:]))
            finally:
                os._exit(code & 0xFF if code >= 0 else 1)
        return _Child(pid, list(args))

    handler._popen = _popen


class _Child(_PopenLike):
    """A rank forked by its launcher: the part of ``subprocess.Popen`` the launcher uses."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def _fresh_interpreter() -> None:
    """In a forked process: the state a new interpreter starts in, as far as a node can tell."""
    import logging
    import random

    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.setLevel(logging.WARNING)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)  # as python -u
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    random.seed()  # a fresh process seeds these from the OS
    try:
        import numpy

        numpy.random.seed()
    except ImportError:
        pass


def _run_main(args: list[str], script: str | None, module: str | None) -> Any:
    """Run ``script`` or ``module`` (or ``gossip-node``) as ``__main__`` with ``args``, then the
    exit handlers it registered; returns its exit status as the interpreter would make it."""
    import atexit
    import runpy

    code: Any = 0
    try:
        if script:
            sys.argv = [script, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
        elif module:
            sys.argv = [module, *args]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            from gossip.cli import node_main

            sys.argv = ["gossip-node", *args]
            code = node_main()
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, status 1
        import traceback

        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def _rank(argv: list[str]) -> int:
    """A rank forked by torch's launcher for the command ``python -u ARGV``: ``-m MODULE
    ARGS`` or ``SCRIPT ARGS``. Returns the exit status the command would have."""
    import atexit

    atexit._clear()  # the launcher's exit handlers are its own
    _fresh_interpreter()
    if argv[:1] == ["-m"]:
        return _run_main(argv[2:], None, argv[1])
    return _run_main(argv[1:], argv[0], None)


def _child(request: dict[str, Any], keep: list[int]) -> int:
    """In the forked child: become the node and run it; returns its exit status."""
    signal.set_wakeup_fd(-1)  # (the server's wake-up pipe is closed below)
    os.setsid()
    _die_with_parent()
    for fd in keep:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, closefd=False)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _fresh_interpreter()
    return _run_main(request["args"], request["script"], request.get("module"))


def serve() -> None:
    """The server's loop: a JSON request per line on stdin starts a child ("started PID"
    on stdout); every child that ends is reaped and reported ("exit PID STATUS")."""
    _die_with_parent()
    _warm()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    out = sys.stdout.buffer
    pending = b""
    while True:
        try:
            ready, _, _ = select.select([0, wake_r], [], [], 1.0)
        except InterruptedError:
            ready = []
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:  # reap every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            out.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())
            out.flush()
        if 0 in ready:
            chunk = os.read(0, 65536)
            if not chunk:  # the test process is gone: so are its nodes (their death signal)
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        code = _child(request, [wake_r, wake_w])
                    finally:
                        os._exit(code & 0xFF if code >= 0 else 1)
                out.write(f"started {pid}\n".encode())
                out.flush()

