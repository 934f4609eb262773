"""Local cluster: N real ``gossip-node`` processes on this machine, over loopback.

The first step from the simulator to real nodes. Each node listens on a free
loopback port and is seeded with the next node of a ring (any seed will do: the
member list spreads by gossip). Options after ``--`` go to every node.

    python examples/local_cluster.py --nodes 4 -- --steps 500 --topology exponential
    python examples/local_cluster.py --nodes 3 --follow -- -v --task digits
    python examples/local_cluster.py --short        # CI: 3 nodes, synthetic, 50 steps, checked

Each node's log goes to ``OUT_DIR/nodeI.log`` (``--follow`` also shows it here,
prefixed), its metrics to ``OUT_DIR/nodeI.jsonl`` and its JSON summary to
``OUT_DIR/nodeI.out``; ``OUT_DIR/nodes.json`` lists the processes. At the end
a table of the summaries and one JSON line are printed.

Ctrl-C or SIGTERM stops every node cleanly (SIGTERM to each, which finishes the
current step and says goodbye; SIGKILL after ``--kill-after`` seconds). Should
this script itself be killed outright, Linux sends each node SIGTERM, so no
node is left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Sequence

from gossip.transport.ports import free_ports

NODE_MAIN = "import sys; from gossip.cli import node_main; sys.exit(node_main())"
SHORT_NODES, SHORT_STEPS = 3, 50
SHORT_MIN_ACCURACY = 0.7  # the short form's pass mark on the synthetic task (it reaches ~0.80; untrained ~0.1)
# a quick start on one machine: short heartbeats, a one-second settle
SHORT_OPTIONS = ["--task", "synthetic", "--topology", "ring", "--heartbeat", "0.2", "--dead-after", "2",
                 "--settle", "1", "--grace", "5"]


@dataclass
class NodeProcess:
    """One node: its process, its address and where its output goes."""

    index: int
    port: int
    proc: subprocess.Popen
    log_path: Path
    out_path: Path
    reader: threading.Thread | None = None
    summary: dict[str, Any] | None = field(default=None)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the node gets SIGTERM if this launcher dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _pump(stream: IO[bytes], log: IO[bytes], prefix: bytes | None) -> None:
    """Copy a node's stderr to its log file (and, with --follow, to ours with a prefix)."""
    for line in iter(stream.readline, b""):
        log.write(line)
        log.flush()
        if prefix is not None:
            sys.stderr.buffer.write(prefix + line)
            sys.stderr.buffer.flush()
    stream.close()
    log.close()


def start_nodes(n: int, out_dir: Path, node_args: Sequence[str], threads: int, follow: bool) -> list[NodeProcess]:
    """Start ``n`` nodes on free loopback ports, node i seeded with node i+1."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ports = free_ports(n)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "") if env.get("PYTHONPATH") else root
    nodes: list[NodeProcess] = []
    try:
        for i, port in enumerate(ports):
            cmd = [sys.executable, "-c", NODE_MAIN, "--listen", f"tcp://127.0.0.1:{port}", "--threads", str(threads),
                   "--json", "--log", str(out_dir / f"node{i}.jsonl")]
            if n > 1:
                cmd += ["--peers", f"127.0.0.1:{ports[(i + 1) % n]}"]
            cmd += list(node_args)  # last, so they win over the defaults above
            out = open(out_dir / f"node{i}.out", "wb")
            # a session of its own: Ctrl-C in the terminal reaches only this launcher, which
            # then stops each node once (a second signal would make a node leave at once)
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True,
                                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
            out.close()
            nodes.append(NodeProcess(i, port, proc, out_dir / f"node{i}.log", out_dir / f"node{i}.out"))
    except BaseException:
        stop_nodes(nodes, kill_after=5.0)
        raise
    # the readers start after the last fork (preexec_fn and threads do not mix)
    for node in nodes:
        prefix = f"node{node.index} | ".encode() if follow else None
        node.reader = threading.Thread(target=_pump, args=(node.proc.stderr, open(node.log_path, "wb"), prefix),
                                       daemon=True)
        node.reader.start()
    # written whole, then renamed: whoever waits for the file never reads half of it
    tmp = out_dir / "nodes.json.tmp"
    tmp.write_text(json.dumps(
        {"launcher_pid": os.getpid(),
         "nodes": [{"index": x.index, "pid": x.proc.pid, "address": x.address, "log": str(x.log_path),
                    "summary": str(x.out_path)} for x in nodes]}, indent=1) + "\n")
    os.replace(tmp, out_dir / "nodes.json")
    return nodes


def stop_nodes(nodes: Sequence[NodeProcess], kill_after: float) -> None:
    """SIGTERM each running node (by PID), SIGKILL whoever is left after ``kill_after`` s; reap all."""
    for node in nodes:
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + kill_after
    for node in nodes:
        try:
            node.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait()


def read_summary(path: Path) -> dict[str, Any] | None:
    """The last JSON line a node printed (its ``--json`` summary), if any."""
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def wait_nodes(nodes: Sequence[NodeProcess], timeout: float | None, stop: list[int]) -> str | None:
    """Wait until every node exits; returns why it stopped early (signal, timeout, a failed node) or None."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while any(x.proc.poll() is None for x in nodes):
        if stop:
            return f"signal {stop[0]}"
        if deadline is not None and time.monotonic() > deadline:
            return f"timeout after {timeout:g} s"
        failed = [x for x in nodes if x.proc.returncode not in (None, 0)]
        if failed:  # the others would only wait for it
            return f"node{failed[0].index} exited with status {failed[0].proc.returncode}"
        time.sleep(0.1)
    return None


def table(nodes: Sequence[NodeProcess]) -> str:
    """One row per node: exit status and the figures of its summary."""
    rows = [("node", "pid", "address", "exit", "steps", "accuracy", "members", "nbr dist", "MB sent")]
    for x in nodes:
        s = x.summary or {}

        def fmt(key: str, spec: str) -> str:
            v = s.get(key)
            return "-" if v is None else format(v, spec)

        rows.append((f"node{x.index}", str(x.proc.pid), x.address, str(x.proc.returncode), fmt("steps", "d"),
                     fmt("final_accuracy", ".4f"), fmt("members", "d"), fmt("neighbor_distance", ".2e"),
                     "-" if "bytes_sent" not in s else f"{s['bytes_sent'] / 1e6:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s [options] [-- gossip-node options]")
    p.add_argument("--nodes", type=int, default=4, metavar="N", help="number of nodes (default: 4)")
    p.add_argument("--out-dir", default="runs/local_cluster", metavar="DIR",
                   help="logs, metrics and summaries (default: runs/local_cluster)")
    p.add_argument("--threads", type=int, default=1, metavar="N", help="torch threads per node (default: 1)")
    p.add_argument("--timeout", type=float, default=None, metavar="SEC",
                   help="stop the nodes after this long (default: wait for them)")
    p.add_argument("--kill-after", type=float, default=15.0, metavar="SEC",
                   help="after SIGTERM, SIGKILL a node still running this long (default: 15)")
    p.add_argument("--follow", action="store_true", help="also show the nodes' logs here, prefixed by node")
    p.add_argument("--short", action="store_true",
                   help=f"CI: {SHORT_NODES} nodes, synthetic task, {SHORT_STEPS} steps; checks exit codes and "
                        f"accuracy >= {SHORT_MIN_ACCURACY}")
    p.add_argument("node_args", nargs="*", metavar="-- OPTIONS", help="passed to every gossip-node")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the cluster; returns the JSON line's figures (and exits non-zero if the short form fails)."""
    args = build_parser().parse_args(argv)
    if args.nodes < 1:
        raise SystemExit("--nodes must be >= 1")
    node_args = list(args.node_args)
    if args.short:
        args.nodes = SHORT_NODES
        node_args = [*SHORT_OPTIONS, "--steps", str(SHORT_STEPS), *node_args]
        if args.timeout is None:
            args.timeout = 300.0
    out_dir = Path(args.out_dir)

    stop: list[int] = []
    handlers: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            handlers[sig] = signal.signal(sig, lambda signum, frame: stop.append(signum))
    t0 = time.perf_counter()
    nodes: list[NodeProcess] = []
    why: str | None = None
    try:
        nodes = start_nodes(args.nodes, out_dir, node_args, args.threads, args.follow)
        print(f"started {args.nodes} nodes ({', '.join(x.address for x in nodes)}); logs in {out_dir}/",
              file=sys.stderr, flush=True)
        why = wait_nodes(nodes, args.timeout, stop)
        if why is not None:
            print(f"stopping all nodes: {why}", file=sys.stderr, flush=True)
    finally:
        stop_nodes(nodes, args.kill_after)  # idempotent; also on an exception of our own
        for x in nodes:
            if x.reader is not None:
                x.reader.join(timeout=5)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    for x in nodes:
        x.summary = read_summary(x.out_path)
    print(table(nodes))
    accuracies = [(x.summary or {}).get("final_accuracy") for x in nodes]
    result = {
        "nodes": len(nodes),
        "exit_codes": [x.proc.returncode for x in nodes],
        "steps": [(x.summary or {}).get("steps") for x in nodes],
        "accuracy": accuracies,
        "min_accuracy": min((a for a in accuracies if a is not None), default=None),
        "members": [(x.summary or {}).get("members") for x in nodes],
        "stopped": why,
        "signal": stop[0] if stop else None,
        "wall_time_s": round(time.perf_counter() - t0, 3),
        "out_dir": str(out_dir),
    }
    print(json.dumps(result), flush=True)
    if args.short:
        problems = []
        if result["exit_codes"] != [0] * SHORT_NODES:
            problems.append(f"exit codes {result['exit_codes']}")
        if result["steps"] != [SHORT_STEPS] * SHORT_NODES or result["members"] != [SHORT_NODES] * SHORT_NODES:
            problems.append(f"steps {result['steps']}, members {result['members']}")
        if result["min_accuracy"] is None or result["min_accuracy"] < SHORT_MIN_ACCURACY:
            problems.append(f"accuracy {accuracies} below {SHORT_MIN_ACCURACY}")
        if problems:
            raise SystemExit("short form failed: " + "; ".join(problems) + f" (logs in {out_dir}/)")
    return result


def exit_status(result: dict[str, Any]) -> int:
    """128 + the signal that stopped the run, 1 if a node failed or timed out, else 0."""
    if result["signal"]:
        return 128 + int(result["signal"])
    return 0 if result["stopped"] is None and all(c == 0 for c in result["exit_codes"]) else 1


if __name__ == "__main__":
    sys.exit(exit_status(main()))
