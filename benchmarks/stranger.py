"""A stranger without keys against two honest nodes, measured against an unattacked run.

Two real ``gossip-node`` processes (a ring of 2, synthetic task, the same seed) train
``--steps`` twice: once left alone, once while a stranger in this process sends each
of them, for the whole run:

- member lists that name 500 nodes that do not exist (loopback addresses where
  nothing listens, so that a connection to one is refused as to a host that does
  not exist), with the claim of a larger cluster that trains (a starting set, joins and leaves of the invented nodes, and
  leaves of the two honest ones), from the stranger's own id (an address where
  nothing listens) and in the invented nodes' names (ZeroMQ routing ids are free);
- hellos and pings in the invented nodes' names;
- state messages in their names (well-formed, the honest nodes' model size);
- malformed frames (random bytes, a truncated header).

Without CurveZMQ nothing stops these messages from arriving; the protocol must keep
them from mattering: a sender's word counts only once it is a member or has proved
that it receives at its address (see gossip.protocol.control and docs/PROTOCOL.md,
"Strangers"). Reported: each honest node's members at the end, rounds
timed out, steps per second and final accuracy in both runs, the accuracy change
(points), the speed ratio (attacked over clean), and how many stranger messages each
node refused, by reason (and the control messages that changed nothing because their
sender had not proved its address, ``unproven``).

    python benchmarks/stranger.py [--steps 3000] [--rate 200]

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zmq  # noqa: E402

from gossip.compression import get_codec  # noqa: E402
from gossip.core.message import Message  # noqa: E402
from gossip.core.state import FlatState  # noqa: E402
from gossip.training.node import init_model  # noqa: E402
from gossip.training.tasks import get_task  # noqa: E402
from gossip.transport import wire  # noqa: E402
from tests.cluster import Cluster, free_port  # noqa: E402

FLAGS = ["--topology", "ring", "--task", "synthetic", "--json", "--heartbeat", "0.25", "--dead-after", "2",
         "--settle", "1", "--grace", "5", "--timeout", "5"]
FAKES = 500
SPOOFED = 40  # invented ids the stranger also sends as (one ZeroMQ socket each, per target)


def _frames(msg: Message) -> list[bytes]:
    return [bytes(memoryview(f).cast("B")) for f in wire.encode(msg)]


class Stranger:
    """Sends the attack to ``targets`` at ``rate`` messages per second each, until stopped."""

    def __init__(self, targets: list[str], rate: float, seed: int = 0) -> None:
        self.targets, self.rate = targets, rate
        self.rng = random.Random(seed)
        self.me = f"127.0.0.1:{free_port()}"  # nobody listens here: the stranger never answers
        # loopback addresses where nothing listens: a made-up id costs what a host that does
        # not exist costs on a real network (the connection is refused), whatever the network
        # this runs on does with addresses it cannot route
        self.fakes = [f"127.{66 + i // 250}.{i % 250 // 16}.{i % 16 + 1}:7000" for i in range(FAKES)]
        task = get_task("synthetic")
        state = FlatState(init_model(task, 0, "cpu"))
        self.fingerprint, numel = state.fingerprint, state.flat.numel()
        self.values = state.flat.clone()
        self.numel = numel
        self.sent = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _lists(self, sender: str, kind: str) -> Message:
        f = self.fakes
        x = {"inc": 1, "status": "training", "dc": "", "seeding": False, "tok": "x" * 16, "echo": "y" * 16,
             "mids": [sender, *f], "mincs": [1] * (FAKES + 1), "mdcs": [""] * (FAKES + 1),
             "base": [sender, *f[:300]], "bincs": [1] * 301, "jids": f[300:450], "jrounds": [5] * 150,
             "jincs": [1] * 150, "lids": [*f[450:], *self.targets], "lrounds": [6] * (FAKES - 450 + len(self.targets)),
             "lincs": [0] * (FAKES - 450 + len(self.targets)), "digest": "z"}
        return Message(kind, sender, 9000, 9000, 0, None, None, x, self.fingerprint)

    def _batch(self) -> list[tuple[str, list[bytes]]]:
        """One round of every kind of message, as (routing id, frames)."""
        out = [(self.me, _frames(self._lists(self.me, "members"))), (self.me, _frames(self._lists(self.me, "hello")))]
        for sender in self.rng.choices(self.fakes[:SPOOFED], k=4):
            out.append((sender, _frames(self._lists(sender, "hello"))))
            out.append((sender, _frames(Message("ping", sender, 9000, 9000, 0, None, None,
                                                {"inc": 1, "status": "training", "dc": "", "digest": "z",
                                                 "tok": "x" * 16}, self.fingerprint))))
            out.append((sender, _frames(Message("state", sender, 1, 1, 1, get_codec("none").encode(self.values), 0.5, {},
                                                self.fingerprint))))
        out.append((self.me, [wire.TAG, bytes(self.rng.getrandbits(8) for _ in range(64))]))
        out.append((self.me, [bytes(self.rng.getrandbits(8) for _ in range(32))]))
        return out

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        ctx = zmq.Context()
        sockets: dict[tuple[str, str], zmq.Socket] = {}

        def socket(ident: str, target: str) -> zmq.Socket:
            s = sockets.get((ident, target))
            if s is None:
                s = sockets[(ident, target)] = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDHWM, 100)
                s.setsockopt(zmq.ROUTING_ID, ident.encode())
                s.connect(f"tcp://{target}")
            return s

        batches = [self._batch() for _ in range(8)]  # encoded once: the stranger costs little CPU
        per_batch = len(batches[0])
        try:
            i = 0
            while not self._stop.is_set():
                started = time.monotonic()
                for target in self.targets:
                    for ident, frames in batches[i % len(batches)]:
                        try:
                            socket(ident, target).send_multipart(frames, flags=zmq.NOBLOCK)
                            self.sent += 1
                        except zmq.Again:
                            pass
                i += 1
                self._stop.wait(max(0.0, per_batch / self.rate - (time.monotonic() - started)))
        finally:
            for s in sockets.values():
                s.close(0)
            ctx.term()


def run_pair(work: Path, name: str, steps: int, rate: float | None) -> dict:
    """Two honest nodes training ``steps``; with ``rate``, under the stranger's attack."""
    ports = [free_port(), free_port()]
    with Cluster(work) as c:
        nodes = [c.start(f"{name}{i}", ["--peers", f"127.0.0.1:{ports[1 - i]}", "--steps", str(steps), *FLAGS],
                         port=ports[i]) for i in range(2)]
        stranger = None
        if rate:
            stranger = Stranger([x.addr for x in nodes], rate)
            stranger.start()
        try:
            codes = [x.wait(600) for x in nodes]
        finally:
            if stranger is not None:
                stranger.stop()
        assert codes == [0, 0], nodes[0].log()[-3000:] + nodes[1].log()[-3000:]
        rs = [x.summary() for x in nodes]
        logs = [x.log() for x in nodes]
    return {"members": [r["members"] for r in rs], "timed_out_rounds": [r["timed_out_rounds"] for r in rs],
            "steps": [r["steps"] for r in rs], "steps_per_s": [r["steps_per_s"] for r in rs],
            "accuracy": [r["final_accuracy"] for r in rs], "rejected": [r["rejected"] for r in rs],
            "unproven": [r["unproven"] for r in rs],
            "start_wait_s": [r["start_wait_s"] for r in rs],
            # an invented id (127.66.* and 127.67.*) that became a member is logged as one that joined
            "fake_members": sum(log.count("member 127.66.") + log.count("member 127.67.") for log in logs),
            "stranger_sent": stranger.sent if stranger is not None else 0}


def measure(work: Path, steps: int, rate: float) -> dict:
    clean = run_pair(work, "clean", steps, None)
    attacked = run_pair(work, "attacked", steps, rate)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"steps": steps, "rate_per_node": rate, "clean": clean, "attacked": attacked,
            "accuracy_change_pts": round(100 * (mean(attacked["accuracy"]) - mean(clean["accuracy"])), 3),
            "speed_ratio": round(mean(attacked["steps_per_s"]) / mean(clean["steps_per_s"]), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3000, help="local steps each honest node trains (default: 3000)")
    ap.add_argument("--rate", type=float, default=200.0,
                    help="stranger messages per second to each honest node (default: 200)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = measure(Path(d), args.steps, args.rate)
    out["load"] = os.getloadavg()[0]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
