"""Transport benchmark: a gossip exchange of a 64 MiB parameter vector, side by side.

Two processes on loopback, in one run, repeated and interleaved, each on one
torch thread (``--threads N`` for more, where each process has cores of its own):

  raw       pyzmq PUSH/PULL, each process pushes the vector to the other (both
            directions at once, as in a gossip round) and receives the other's,
            with the same libzmq settings (2 I/O threads) as the gossip
            transport: once as one 64 MiB frame, once as 1 MiB frames (the
            wire's chunking);
  raw_mix   raw 1 MiB frames plus the work any gossip exchange must do on what
            it receives: the finite check and the mix (``lerp_``), once after
            the whole vector is in, once part by part as ``--parts`` messages
            arrive (a pipelined receive). No wire format: a floor;
  gossip    the real exchange path of a synchronous round: the rule's packet
            (the parameters themselves, through a SendLease), wire encode, the
            ZmqTransport I/O thread, decode (the frames where they arrived), the
            node's finite check, the wait for ZeroMQ to let go of the parameters,
            and GossipRule.mix -- everything but the local step;
  gloo      torch.distributed all_reduce of the same vector with the gloo
            backend, and PyTorch's model averager (average_parameters) over it.

Bandwidth is payload bytes per direction / round time. CPU time per round and
process (user and system, all threads) says how much of the machine a path
needs. Also reported: encode + decode of the 64 MiB message against one memcpy
of it (into warm memory) and one clone (into fresh memory).

Ends with one JSON line holding ``exchange_over_raw_zmq`` (gossip bandwidth /
the faster raw bandwidth; target >= 0.7), ``exchange_over_gloo`` (gossip
round time / all_reduce time; target <= 1) and ``exchange_over_raw_mix``
(gossip round time / its floor).

    python benchmarks/transport.py [--mib 64] [--repeat 5] [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing as mp
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gossip.transport.ports import free_port  # noqa: E402

WARMUP = 3  # rounds discarded: connection set-up and the receive-buffer pool filling up


class Rounds:
    """Wall time and CPU time of each round. CPU time is the whole process's, user
    and system: ZeroMQ's and gloo's I/O threads and the kernel's loopback copies
    made on their behalf count, so it says how much of two cores a path needs."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    @staticmethod
    def _cpu() -> float:
        use = resource.getrusage(resource.RUSAGE_SELF)
        return use.ru_utime + use.ru_stime

    def __enter__(self) -> None:
        self._t, self._c = time.perf_counter(), self._cpu()

    def __exit__(self, *exc) -> None:
        self.wall.append(time.perf_counter() - self._t)
        self.cpu.append(self._cpu() - self._c)

    def report(self, rank: int, *counts: int) -> tuple:
        return (rank, self.wall[WARMUP:], self.cpu[WARMUP:], *counts)


@contextlib.contextmanager
def _push_pull(rank: int, ports: list[int]):
    """This process's PUSH towards the other and its PULL, with libzmq at 2 I/O
    threads as the gossip transport uses; closed on exit."""
    import zmq

    ctx = zmq.Context(io_threads=2)
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"tcp://127.0.0.1:{ports[rank]}")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{ports[1 - rank]}")
    try:
        yield push, pull
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


def _raw(rank: int, ports: list[int], numel: int, rounds: int, barrier, out, chunk: int = 0) -> None:
    import numpy as np

    x = np.ones(numel, dtype=np.float32)
    view = memoryview(x).cast("B")
    frames = [view[i:i + chunk] for i in range(0, view.nbytes, chunk)] if chunk else [view]
    with _push_pull(rank, ports) as (push, pull):
        barrier.wait()
        clock = Rounds()
        for _ in range(rounds + WARMUP):
            barrier.wait()
            with clock:
                push.send_multipart(frames, copy=False)
                got = pull.recv_multipart(copy=False)
                [np.frombuffer(f.buffer, dtype=np.float32) for f in got]
                del got
            barrier.wait()
        out.put(clock.report(rank))


def message_starts(nbytes: int, parts: int, frame: int) -> range:
    """Where each of (at most) ``parts`` messages of whole ``frame``-byte frames starts."""
    return range(0, nbytes, -(-nbytes // parts // frame) * frame)


def _raw_mixing(rank: int, ports: list[int], numel: int, rounds: int, barrier, out, parts: int = 1) -> None:
    """Raw pyzmq plus the work every gossip exchange does on what it receives:
    check that it is finite (``all_finite``) and mix it into x (``lerp_``). The
    vector travels as ``parts`` messages of 1 MiB frames, and each is checked
    and mixed as soon as it is in: with ``parts`` > 1 that work overlaps with the
    rest of the transfer. No wire format, and the send is from a second buffer,
    so the mix never waits for ZeroMQ to let go of x: a floor for the gossip
    exchange, with and without a pipelined receive."""
    import torch

    from gossip.mixing.base import all_finite
    from gossip.transport.wire import CHUNK

    x = torch.full((numel,), float(rank))
    view = memoryview(torch.full((numel,), float(rank)).numpy()).cast("B")
    starts = message_starts(view.nbytes, parts, CHUNK)
    messages = [[view[i:i + CHUNK] for i in range(lo, min(lo + starts.step, view.nbytes), CHUNK)] for lo in starts]
    with _push_pull(rank, ports) as (push, pull):
        barrier.wait()
        clock = Rounds()
        for _ in range(rounds + WARMUP):
            barrier.wait()
            with clock:
                for frames in messages:
                    push.send_multipart(frames, copy=False)
                at = 0
                for _ in messages:
                    got = [torch.frombuffer(f.buffer, dtype=torch.float32) for f in pull.recv_multipart(copy=False)]
                    assert all(all_finite(t) for t in got)
                    for t in got:
                        x[at:at + t.numel()].lerp_(t, 0.5)
                        at += t.numel()
                    del got
            barrier.wait()
        out.put(clock.report(rank))


def _gossip(rank: int, ports: list[int], numel: int, rounds: int, barrier, out) -> None:
    import queue

    import torch

    from gossip.core.buffers import SendLease
    from gossip.core.message import Message
    from gossip.mixing.base import Inbox, all_finite, decode_payload
    from gossip.mixing.gossip import GossipRule
    from gossip.transport import wire
    from gossip.transport.zmq import ZmqTransport
    from topologies import Topology, complete

    me, peer = f"127.0.0.1:{ports[rank]}", f"127.0.0.1:{ports[1 - rank]}"
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def on_frames(ident: bytes, frames: list) -> None:
        inbox.put(wire.decode(frames))  # header validation happens on the I/O thread

    t = ZmqTransport(me, f"tcp://{me}", on_frames=on_frames, max_message_size=2 * numel * 4 + 2**20, hwm=4)
    t.start()
    x = torch.full((numel,), float(rank))
    rule, topology, mixing_inbox = GossipRule("none"), Topology(complete(2)), Inbox()

    def receive(rnd: int, resend) -> Message:
        while True:
            try:
                msg = inbox.get(timeout=0.5)
            except queue.Empty:
                resend()  # the connection was not up yet: say it again
                continue
            if msg.round == rnd:
                return msg  # an older round's duplicate is dropped

    # Handshake, so the timed rounds start on connections that are up both ways. A
    # message sent before its connection is up is dropped (IMMEDIATE), so each side
    # says whether it has heard the other, and stops once the other has heard it.
    heard = False

    def hello() -> None:
        t.send(peer, wire.encode(Message("ping", me, 0, 0, 0, None, None, {"heard": heard}, "fp")))

    while True:
        hello()
        try:
            msg = inbox.get(timeout=0.2)
        except queue.Empty:
            continue
        heard = True
        if msg.extra.get("heard"):
            break
    hello()  # the peer heard us, so this one arrives: it may still be waiting for it
    barrier.wait()
    clock, moved = Rounds(), 0
    for r in range(1, rounds + WARMUP + 1):
        barrier.wait()
        with clock:
            # what Node.outgoing does with live sends: the rule encodes x itself
            lease = SendLease(x)
            rule.sends_live = True
            [(_, packet)] = rule.outgoing(lease.tensor(), topology, rank, r)
            frames = wire.encode(Message("state", me, r, r, r, packet.data, None, {}, "fp"))
            del packet
            t.send(peer, frames)
            msg = receive(r, lambda f=frames: t.send(peer, f))
            del frames
            msg.tensor = decode_payload(msg, x, pieces=True)  # Node._check: decoded where it lies, validated
            assert all_finite(msg.tensor)
            mixing_inbox.add(1 - rank, msg)
            del msg
            if not lease.wait(0.2):  # Node.settle: still sending, so the parameters move to fresh memory
                x = x.clone()
                moved += 1
            rule.mix(x, mixing_inbox, topology, rank, r, r)
        barrier.wait()
    assert float(x[0]) == 0.5 and float(x[-1]) == 0.5  # both sides mixed the other's values
    out.put(clock.report(rank, moved))
    t.close()


def _gloo(rank: int, ports: list[int], numel: int, rounds: int, barrier, out, averager: bool = False) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.utils import average_parameters

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=2)
    x = torch.full((numel,), float(rank))
    param = torch.nn.Parameter(x, requires_grad=False)
    barrier.wait()
    clock = Rounds()
    for _ in range(rounds + WARMUP):
        barrier.wait()
        with clock:
            if averager:  # PyTorch's model averager: flatten (a copy), divide, all_reduce, copy back
                average_parameters(iter([param]), None)
            else:
                dist.all_reduce(x)
        barrier.wait()
    out.put(clock.report(rank))
    dist.destroy_process_group()


def _worker(fn, threads: int, *args) -> None:
    """One process of a pair: ``fn`` on ``threads`` torch threads."""
    import torch

    torch.set_num_threads(threads)
    fn(*args)


def run_pair(fn, numel: int, rounds: int, threads: int = 1) -> tuple[float, float, int]:
    """Median round time (the slower rank per round) of ``fn`` over two processes,
    each on ``threads`` torch threads, median CPU time per round and process, and
    the sum of any counts the processes reported after their times."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    ports = [free_port(), free_port()]
    procs = [ctx.Process(target=_worker, args=(fn, threads, r, ports, numel, rounds, barrier, out)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        reports = [out.get(timeout=300) for _ in procs]
        results = {rep[0]: rep[1] for rep in reports}
        cpu = statistics.median(c for rep in reports for c in rep[2])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    counts = sum(sum(rep[3:]) for rep in reports)
    return statistics.median(max(a, b) for a, b in zip(results[0], results[1])), cpu, counts


def codec_overhead(numel: int, repeat: int) -> tuple[float, float, float, float]:
    """(encode + decode, encode + decode into one tensor, memcpy, clone) seconds
    for one 64 MiB state message.

    The first decodes as a node does (the chunk frames viewed where they lie,
    :class:`~gossip.core.buffers.Pieces`); the second also joins them into one
    tensor, as a consumer that needs one contiguous tensor gets it. The memcpy is into a buffer already in use, the baseline of the target; a
    clone (a copy into fresh memory) also pays for mapping and page-faulting it.
    One torch thread, as in the exchange processes (the join copies with numpy)."""
    import torch

    from gossip.compression import get_codec
    from gossip.core.message import Message
    from gossip.mixing.base import decode_payload
    from gossip.transport import wire

    torch.set_num_threads(1)
    x = torch.randn(numel)
    dst = torch.empty_like(x).copy_(x)
    codec = get_codec("none")
    enc_dec, enc_dec_joined, copy, clone = [], [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(x)
        copy.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        x.clone()
        clone.append(time.perf_counter() - t0)
        for pieces, times in ((True, enc_dec), (False, enc_dec_joined)):
            t0 = time.perf_counter()
            frames = wire.encode(Message("state", "a:1", 0, 0, 0, codec.encode(x), None, {}, "fp"))
            msg = wire.decode([memoryview(f) for f in frames])
            # as off the wire: no in-process source tensor to short-cut the decode
            msg.data = type(msg.data)(msg.data.codec, msg.data.numel, msg.data.dtype, msg.data.meta, msg.data.buffers)
            decoded = decode_payload(msg, x, pieces=pieces)
            times.append(time.perf_counter() - t0)
            del decoded, msg, frames
    return (statistics.median(enc_dec), statistics.median(enc_dec_joined), statistics.median(copy),
            statistics.median(clone))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=64.0)
    ap.add_argument("--repeat", type=int, default=5, help="interleaved repetitions of all the paths")
    ap.add_argument("--rounds", type=int, default=5, help="exchanges per measurement")
    ap.add_argument("--parts", type=int, default=8, help="messages per vector on the pipelined raw path")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per process on every path (the finite check, the mix, gloo's reduction); "
                         "more than 1 only where each process has cores of its own")
    args = ap.parse_args()
    if args.parts < 1:
        ap.error(f"--parts must be at least 1, got {args.parts}")
    if args.threads < 1:
        ap.error(f"--threads must be at least 1, got {args.threads}")
    numel = int(args.mib * 2**20 / 4)
    payload = numel * 4
    from gossip.transport.wire import CHUNK

    parts = len(message_starts(payload, args.parts, CHUNK))
    paths = {  # name: (worker, label)
        "raw": (_raw, "raw pyzmq, one frame (both ways)"),
        "raw_chunked": (functools.partial(_raw, chunk=CHUNK), f"raw pyzmq, {CHUNK >> 20} MiB frames"),
        "raw_mix": (_raw_mixing, "raw + check + mix after"),
        "raw_pipelined": (functools.partial(_raw_mixing, parts=args.parts),
                          f"raw in {parts} parts, each mixed"),
        "gossip": (_gossip, "gossip exchange (send..mix)"),
        "gloo": (_gloo, "gloo all_reduce"),
        "averager": (functools.partial(_gloo, averager=True), "torch average_parameters (gloo)"),
    }
    wall: dict[str, list[float]] = {name: [] for name in paths}
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    moved = 0  # exchanges whose send was still in flight when the round mixed
    for _ in range(args.repeat):
        for name, (fn, _) in paths.items():
            w, c, n = run_pair(fn, numel, args.rounds, args.threads)
            wall[name].append(w)
            cpu[name].append(c)
            moved += n
    t = {name: statistics.median(v) for name, v in wall.items()}
    c = {name: statistics.median(v) for name, v in cpu.items()}
    r1, rc, g, a = t["raw"], t["raw_chunked"], t["gossip"], t["gloo"]
    r = min(r1, rc)
    ed, edj, mc, cl = codec_overhead(numel, 15)
    print(f"payload {payload / 2**20:.0f} MiB float32, loopback, 2 processes on {args.threads} torch thread(s) each,"
          f" median of {args.repeat} x {args.rounds}")
    print(f"{'path':<34} {'round ms':>9} {'GB/s per direction':>19} {'CPU ms per process':>19}")
    for name, (_, label) in paths.items():
        print(f"{label:<34} {t[name] * 1e3:>9.1f} {payload / t[name] / 1e9:>19.2f} {c[name] * 1e3:>19.1f}")
    print(f"encode + decode {ed * 1e3:.2f} ms vs one memcpy {mc * 1e3:.2f} ms ({ed / mc:.3f}x)"
          f" and one clone {cl * 1e3:.2f} ms ({ed / cl:.3f}x)")
    print(f"encode + decode into one tensor {edj * 1e3:.2f} ms ({edj / mc:.3f}x memcpy)")
    print(f"sends still in flight at mixing time (parameters moved): {moved} of"
          f" {2 * args.repeat * (args.rounds + WARMUP)} exchanges")
    print(json.dumps({"exchange_over_raw_zmq": round(r / g, 3), "exchange_over_raw_zmq_one_frame": round(r1 / g, 3),
                      "exchange_over_gloo": round(g / a, 3), "encode_decode_over_memcpy": round(ed / mc, 3),
                      "encode_decode_over_clone": round(ed / cl, 3),
                      "encode_decode_joined_over_memcpy": round(edj / mc, 3), "sends_moved": moved,
                      "raw_gbps": round(payload / r / 1e9, 3),
                      "exchange_gbps": round(payload / g / 1e9, 3), "gloo_ms": round(a * 1e3, 2),
                      "exchange_over_torch_averager": round(g / t["averager"], 3),
                      "raw_mix_over_gloo": round(t["raw_mix"] / a, 3),
                      "exchange_over_raw_mix": round(g / t["raw_mix"], 3),
                      "pipelined_over_mix_after": round(t["raw_pipelined"] / t["raw_mix"], 3),
                      "cpu_ms": {name: round(v * 1e3, 1) for name, v in c.items()},
                      "mib": args.mib, "threads": args.threads}))


if __name__ == "__main__":
    main()
