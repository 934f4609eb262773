"""Transport benchmark: a gossip exchange of a 64 MiB parameter vector, side by side.

Two processes on loopback, in one run, repeated and interleaved:

  raw     pyzmq PUSH/PULL, each process pushes the vector to the other (both
          directions at once, as in a gossip round) and receives the other's,
          with the same libzmq settings (2 I/O threads) as the gossip transport;
  gossip  the real exchange path: snapshot (clone), encode (wire format), the
          ZmqTransport I/O thread, decode, validation (finite values), and the
          mixing step (x <- (x + x_peer) / 2) -- everything but the local step;
  gloo    torch.distributed all_reduce of the same vector with the gloo backend.

Bandwidth is payload bytes per direction / round time. Also reported: encode +
decode of the 64 MiB message against one memcpy of it.

Ends with one JSON line holding ``exchange_over_raw_zmq`` (gossip bandwidth /
raw bandwidth; target >= 0.7) and ``exchange_over_gloo`` (gossip round time /
all_reduce time; target <= 1).

    python benchmarks/transport.py [--mib 64] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


WARMUP = 3  # rounds discarded: connection set-up and the receive-buffer pool filling up


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raw(rank: int, ports: list[int], numel: int, rounds: int, barrier, out) -> None:
    import numpy as np
    import zmq

    ctx = zmq.Context(io_threads=2)  # as the gossip transport uses
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"tcp://127.0.0.1:{ports[rank]}")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{ports[1 - rank]}")
    x = np.ones(numel, dtype=np.float32)
    barrier.wait()
    times = []
    for _ in range(rounds + WARMUP):
        barrier.wait()
        t0 = time.perf_counter()
        push.send(x, copy=False)
        frame = pull.recv(copy=False)
        np.frombuffer(frame.buffer, dtype=np.float32)
        times.append(time.perf_counter() - t0)
        barrier.wait()
    out.put((rank, times[WARMUP:]))
    push.close(0)
    pull.close(0)
    ctx.term()


def _gossip(rank: int, ports: list[int], numel: int, rounds: int, barrier, out) -> None:
    import queue

    import torch

    from gossip import wire
    from gossip.compression import get_codec
    from gossip.message import Message
    from gossip.mixing.base import all_finite, decode_payload
    from gossip.transport.zmq import ZmqTransport

    torch.set_num_threads(1)
    me, peer = f"127.0.0.1:{ports[rank]}", f"127.0.0.1:{ports[1 - rank]}"
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def on_frames(ident: bytes, frames: list) -> None:
        inbox.put(wire.decode(frames))  # header validation happens on the I/O thread

    t = ZmqTransport(me, f"tcp://{me}", on_frames=on_frames, max_message_size=2 * numel * 4 + 2**20, hwm=4)
    t.start()
    x = torch.full((numel,), float(rank))
    codec = get_codec("none")

    def receive(rnd: int, resend) -> Message:
        while True:
            try:
                msg = inbox.get(timeout=0.5)
            except queue.Empty:
                resend()  # the connection was not up yet: say it again
                continue
            if msg.round == rnd:
                return msg  # an older round's duplicate is dropped

    # handshake so the timed rounds start on an established connection
    hello = lambda: t.send(peer, wire.encode(Message("ping", me, 0, 0, 0, None, None, {}, "fp")))  # noqa: E731
    hello()
    receive(0, hello)
    hello()
    barrier.wait()
    times = []
    for r in range(1, rounds + WARMUP + 1):
        barrier.wait()
        t0 = time.perf_counter()
        snap = x.clone()  # what the node sends while it keeps training
        frames = wire.encode(Message("state", me, r, r, r, codec.encode(snap), None, {}, "fp"))
        t.send(peer, frames)
        msg = receive(r, lambda: t.send(peer, frames))
        other = decode_payload(msg, x)
        assert all_finite(other)
        x.lerp_(other, 0.5)  # the mixing step
        del msg, other  # as a node does after mixing: the receive buffer can be reused
        times.append(time.perf_counter() - t0)
        barrier.wait()
    out.put((rank, times[WARMUP:]))
    t.close()


def _gloo(rank: int, ports: list[int], numel: int, rounds: int, barrier, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=2)
    x = torch.full((numel,), float(rank))
    barrier.wait()
    times = []
    for _ in range(rounds + WARMUP):
        barrier.wait()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
        barrier.wait()
    out.put((rank, times[WARMUP:]))
    dist.destroy_process_group()


def run_pair(fn, numel: int, rounds: int) -> float:
    """Median round time (the slower rank per round) of ``fn`` over two processes."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    ports = [free_port(), free_port()]
    procs = [ctx.Process(target=fn, args=(r, ports, numel, rounds, barrier, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return statistics.median(max(a, b) for a, b in zip(results[0], results[1]))


def codec_overhead(numel: int, repeat: int) -> tuple[float, float]:
    """(encode + decode seconds, memcpy seconds) for one 64 MiB state message."""
    import torch

    from gossip import wire
    from gossip.compression import get_codec
    from gossip.message import Message
    from gossip.mixing.base import decode_payload

    x = torch.randn(numel)
    codec = get_codec("none")
    enc_dec, copy = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        x.clone()
        copy.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        frames = wire.encode(Message("state", "a:1", 0, 0, 0, codec.encode(x), None, {}, "fp"))
        msg = wire.decode([memoryview(f) for f in frames])
        msg.data = type(msg.data)(msg.data.codec, msg.data.numel, msg.data.dtype, msg.data.meta, msg.data.buffers)
        decode_payload(msg, x)
        enc_dec.append(time.perf_counter() - t0)
    return statistics.median(enc_dec), statistics.median(copy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=64.0)
    ap.add_argument("--repeat", type=int, default=5, help="interleaved repetitions of all three")
    ap.add_argument("--rounds", type=int, default=5, help="exchanges per measurement")
    args = ap.parse_args()
    numel = int(args.mib * 2**20 / 4)
    payload = numel * 4
    raw, goss, gloo = [], [], []
    for _ in range(args.repeat):
        raw.append(run_pair(_raw, numel, args.rounds))
        goss.append(run_pair(_gossip, numel, args.rounds))
        gloo.append(run_pair(_gloo, numel, args.rounds))
    r, g, a = statistics.median(raw), statistics.median(goss), statistics.median(gloo)
    ed, mc = codec_overhead(numel, 7)
    print(f"payload {payload / 2**20:.0f} MiB float32, loopback, 2 processes, median of {args.repeat} x {args.rounds}")
    print(f"{'path':<34} {'round ms':>9} {'GB/s per direction':>19}")
    print(f"{'raw pyzmq PUSH/PULL (both ways)':<34} {r * 1e3:>9.1f} {payload / r / 1e9:>19.2f}")
    print(f"{'gossip exchange (snapshot..mix)':<34} {g * 1e3:>9.1f} {payload / g / 1e9:>19.2f}")
    print(f"{'gloo all_reduce':<34} {a * 1e3:>9.1f} {payload / a / 1e9:>19.2f}")
    print(f"encode + decode {ed * 1e3:.2f} ms vs one memcpy {mc * 1e3:.2f} ms ({ed / mc:.3f}x)")
    print(json.dumps({"exchange_over_raw_zmq": round(r / g, 3), "exchange_over_gloo": round(g / a, 3),
                      "encode_decode_over_memcpy": round(ed / mc, 3), "raw_gbps": round(payload / r / 1e9, 3),
                      "exchange_gbps": round(payload / g / 1e9, 3), "gloo_ms": round(a * 1e3, 2),
                      "mib": args.mib}))


if __name__ == "__main__":
    main()
