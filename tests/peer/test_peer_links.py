"""Compressed gossip and emulated links between real processes."""

from __future__ import annotations

import queue
import time

from gossip.transport.links import LinkModel, SimNetwork
from gossip.transport.zmq import ZmqTransport
from tests.cluster import Cluster, free_port

FAST = ["--heartbeat", "0.2", "--dead-after", "2", "--settle", "1", "--grace", "5"]


def test_a_dropped_compressed_message_is_resynced_and_copies_match(tmp_path):
    """Every link loses its 5th state message: CHOCO must notice, ask for a full
    snapshot, and end with public copies identical on both ends of every link."""
    ports = [free_port() for _ in range(3)]
    with Cluster(tmp_path) as c:
        nodes = [c.start(f"n{i}", ["--peers", f"127.0.0.1:{ports[(i + 1) % 3]}", "--topology", "ring", "--task",
                                   "synthetic", "--compression", "topk:0.1", "--steps", "40", "--json",
                                   "--emulate", "all:drop=5", *FAST], port=ports[i]) for i in range(3)]
        assert c.wait_all(120) == [0, 0, 0]
        summaries = {n.addr: n.summary() for n in nodes}
    for s in summaries.values():
        m = s["mixing"]
        assert m["rule"] == "choco" and s["emulated_losses"] >= 2, s  # one per out-link
        assert m["gaps"] >= 1 and m["resyncs"] >= 1, m  # the loss was seen and repaired
        for peer, digest in m["copies_sha"].items():  # my copy of x_hat_peer == peer's own x_hat
            assert digest == summaries[peer]["mixing"]["own_sha"], (s["node"], peer)
        assert s["final_accuracy"] > 0.5


def _pair(shaper=None):
    pa, pb = free_port(), free_port()
    got: queue.SimpleQueue = queue.SimpleQueue()
    a = ZmqTransport(f"127.0.0.1:{pa}", f"tcp://127.0.0.1:{pa}", on_frames=lambda i, f: None, shaper=shaper)
    b = ZmqTransport(f"127.0.0.1:{pb}", f"tcp://127.0.0.1:{pb}",
                     on_frames=lambda i, f: got.put((time.monotonic(), bytes(f[0]))))
    a.start()
    b.start()
    return a, b, got


def _deliver(a, dst, got, payload, droppable=True, retries=50, wait=0.1):
    """Send until the connection is up (the first sends may find it not yet connected),
    then drain duplicates."""
    for _ in range(retries):
        a.send(dst, [payload], droppable=droppable)
        try:
            first = got.get(timeout=wait)
        except queue.Empty:
            continue
        time.sleep(wait)
        while not got.empty():
            got.get()
        return first
    raise AssertionError("never delivered")


def test_emulated_latency_and_bandwidth_delay_every_message():
    net = SimNetwork({"intra": LinkModel(latency=0.3, bandwidth=8e6), "inter": LinkModel(latency=0.3, bandwidth=8e6)},
                     lambda u, v: "intra")
    a, b, got = _pair(net)
    try:
        _deliver(a, b.node_id, got, b"warm-up", droppable=False, wait=0.8)
        t0 = time.monotonic()
        a.send(b.node_id, [b"x" * 100_000])  # 0.1 s at 8 Mbit/s, plus 0.3 s latency
        arrived, data = got.get(timeout=5)
        assert data == b"x" * 100_000
        assert 0.38 <= arrived - t0 < 1.5
    finally:
        a.close()
        b.close()


def _arrivals(got, quiet=1.0, expect=0, timeout=60.0):
    """Payloads received, in arrival order: at least ``expect`` of them (waiting up to
    ``timeout`` seconds: a loaded machine may take a while to connect), then until none
    arrives for ``quiet`` seconds (so that a duplicate would be seen)."""
    seen = []
    deadline = time.monotonic() + timeout
    while True:
        wait = quiet if len(seen) >= expect else max(0.01, deadline - time.monotonic())
        try:
            seen.append(got.get(timeout=wait)[1])
        except queue.Empty:
            if len(seen) >= expect or time.monotonic() >= deadline:
                return seen


def test_emulated_drop_loses_exactly_the_nth_state_message():
    net = SimNetwork({"intra": LinkModel(latency=0.0, bandwidth=1e12, drop=2)}, lambda u, v: "intra")
    a, b, got = _pair(net)
    try:
        _deliver(a, b.node_id, got, b"hello", droppable=False)  # control: not counted
        for i in range(4):
            a.send(b.node_id, [b"m%d" % i])
        seen = _arrivals(got)
        assert seen == [b"m0", b"m2", b"m3"] and a.emulated_losses == 1
    finally:
        a.close()
        b.close()


def _two_dc_run(tmp_path, name, emulate):
    ports = [free_port() for _ in range(4)]
    dcs = ["east", "east", "west", "west"]
    with Cluster(tmp_path) as c:
        nodes = [c.start(f"{name}{i}", ["--peers", f"127.0.0.1:{ports[(i + 1) % 4]}", "--dc", dcs[i],
                                        "--topology", "hierarchical", "--async", "--task", "synthetic",
                                        "--steps", "400", "--json", *FAST, *emulate], port=ports[i])
                 for i in range(4)]
        assert c.wait_all(240) == [0, 0, 0, 0]
        return [n.summary() for n in nodes]


def test_async_across_emulated_datacenters_nobody_waits_on_the_slow_link(tmp_path):
    slow = ["--emulate", "inter:latency=300ms,bandwidth=20Mbit"]
    ratios = []
    # A node that waited on the 300 ms link would train at a few steps/s (synchronous
    # rounds on this setup: 3.9), 1-3% of the free cluster's 150-350 steps/s. The two
    # runs are sequential on a shared 2-core machine, where the same 4-node run has
    # gone from 155 to 300 steps/s between two tries, so the bound is half the free
    # rate, and a second pair of runs is made before failing.
    for attempt in range(2):
        workdir = tmp_path / f"try{attempt}"
        workdir.mkdir()
        shaped = _two_dc_run(workdir, "shaped", slow)
        free = _two_dc_run(workdir, "free", [])
        for s in shaped:
            assert s["members"] == 4 and s["final_accuracy"] > 0.8, s
            assert s["bytes_inter"] > 0 and s["bytes_intra"] > 0, s
            assert s["mixing"]["rule"] == "async"
        rate = sorted(s["steps_per_s"] for s in shaped)[1:3]  # the middle two: this 2-core box is noisy
        base = sorted(s["steps_per_s"] for s in free)[1:3]
        ratios.append(sum(rate) / sum(base))
        if ratios[-1] >= 0.5:
            break
    assert max(ratios) >= 0.5, ratios


def test_a_fresh_connection_holds_every_message_until_it_is_up_an_older_one_drops_state():
    """The first messages on a connection wait for it (a joiner's first round must not be
    lost to the handshake, nor to a peer still binding its socket), in order; on a
    connection older than ``hold_control`` that is not up, a state message is dropped at
    once (the next round's replaces it) while control still waits."""
    pa, pb, pc = free_port(), free_port(), free_port()
    got: queue.SimpleQueue = queue.SimpleQueue()
    skew = [0.0]  # the transport's clock runs ahead of the wall by this much
    a = ZmqTransport(f"127.0.0.1:{pa}", f"tcp://127.0.0.1:{pa}", on_frames=lambda i, f: None, hold_control=5.0,
                     clock=lambda: time.monotonic() + skew[0])
    b_id, gone = f"127.0.0.1:{pb}", f"127.0.0.1:{pc}"
    a.start()
    b = None
    try:
        # b is not listening yet: nothing may be dropped while it binds
        a.send(b_id, [b"state-0"])
        a.send(b_id, [b"ctl-0"], droppable=False)
        a.send(b_id, [b"state-1"])
        time.sleep(0.3)
        b = ZmqTransport(b_id, f"tcp://{b_id}", on_frames=lambda i, f: got.put((time.monotonic(), bytes(f[0]))))
        b.start()
        assert _arrivals(got, expect=3) == [b"state-0", b"ctl-0", b"state-1"]
        assert a.dropped[b_id] == 0
        # an address nobody listens on: its connection opened with a control message...
        a.send(gone, [b"ctl-1"], droppable=False)
        deadline = time.monotonic() + 30
        while gone not in a._held and time.monotonic() < deadline:
            time.sleep(0.01)
        skew[0] = 10.0  # ... is older than hold_control now: that message expires
        while a.dropped[gone] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        a.send(gone, [b"state-2"])  # dropped at once, never held
        a.send(gone, [b"ctl-2"], droppable=False)  # held
        while (a.dropped[gone] < 2 or not a._held.get(gone)) and time.monotonic() < deadline:
            time.sleep(0.01)  # (both sent in order: the state dropped, then the control held)
        assert a.dropped[gone] == 2 and len(a._held.get(gone, ())) == 1
    finally:
        a.close()
        if b is not None:
            b.close()


def test_held_control_messages_expire_towards_an_address_nobody_listens_on():
    dead = f"127.0.0.1:{free_port()}"
    a = ZmqTransport(f"127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", on_frames=lambda i, f: None,
                     hold_control=0.3)
    a.start()
    try:
        for i in range(3):
            a.send(dead, [b"hello"], droppable=False)
        time.sleep(1.0)
        assert a.dropped[dead] == 3 and not a._held
    finally:
        a.close()
