"""Outer optimizers on real gossip-node processes: the same numbers as the simulator,
and the outer momentum handed to a joiner with the parameters."""

from __future__ import annotations

import signal

import torch

import gossip
from gossip.api import Simulation
from gossip.core.checkpoint import latest_checkpoint, load_checkpoint
from gossip.core.message import Message
from gossip.transport import wire
from tests.cluster import EXACT, Cluster, free_port

FAST = ["--heartbeat", "0.2", "--dead-after", "2", "--settle", "1", "--grace", "5"]
OUTER = "nesterov:lr=0.7,momentum=0.9"


def _every_round_mixed(nodes) -> None:
    """No round of a run compared number for number timed out or went on without a neighbour."""
    for node in nodes:
        s = node.summary()
        assert (s["timed_out_rounds"], s["skipped_rounds"]) == (0, 0), s


def test_three_real_nodes_with_nesterov_match_the_simulator(tmp_path):
    """Same seed and schedule (4 synchronous outer rounds of 2 inner steps): real nodes end
    where simulated ones do, parameters and outer momentum alike."""
    steps, period, n = 8, 2, 3
    ports = sorted(free_port() for _ in range(n))  # sorted ids = simulator ranks
    with Cluster(tmp_path) as c:
        nodes = [c.start(f"n{i}", ["--peers", f"127.0.0.1:{ports[(i + 1) % n]}", "--topology", "ring",
                                   "--task", "synthetic", "--steps", str(steps), "--period", str(period),
                                   "--outer", OUTER, "--seed", "0", "--json", *EXACT,
                                   "--checkpoint-dir", str(tmp_path / f"ck{i}")], port=ports[i]) for i in range(n)]
        assert c.wait_all(120) == [0] * n
    _every_round_mixed(nodes)
    sim = Simulation(nodes=n, topology="ring", task="synthetic", steps=steps, period=period, outer=OUTER, seed=0,
                     eval_every=steps)
    result = sim.run().result()
    ids = sorted(f"127.0.0.1:{p}" for p in ports)
    for i, node in enumerate(nodes):
        rank = ids.index(node.summary()["node"])
        state = load_checkpoint(latest_checkpoint(tmp_path / f"ck{i}"))
        torch.testing.assert_close(state["flat"], result.params[rank], rtol=1e-5, atol=1e-6)
        outer = state["rules"][0]
        assert outer["outer"] == OUTER and outer["outer_steps"] == steps // period
        torch.testing.assert_close(outer["momentum"], sim.nodes[rank].rule.momentum, rtol=1e-5, atol=1e-6)
    # the outer step changed the numbers: plain gossip ends elsewhere
    plain = gossip.simulate(nodes=n, topology="ring", task="synthetic", steps=steps, period=period, seed=0)
    assert (plain.params[0] - result.params[0]).abs().max() > 1e-3


def test_handover_carries_the_momentum_through_the_wire():
    donor = Simulation(nodes=2, topology="ring", task="synthetic", steps=10, period=5, outer=OUTER, seed=0)
    donor.run()
    giver = donor.nodes[0]
    payload, extra = giver.handover()
    # the parameters, then the momentum of channel 0's outer optimizer, then the inner optimizer's
    # state tensors (described in extra["train"]: this engine steps its own rows, so there are none)
    assert extra["outer"] == [0] and set(extra) == {"outer", "train"}, extra
    assert payload.numel() == giver.handover_numel(extra) == 2 * giver.numel
    from gossip.compression import get_codec

    msg = Message("state-reply", "127.0.0.1:1", giver.round, giver.step, 0, get_codec("none").encode(payload),
                  None, {"inc": 1, **extra}, giver.fingerprint)
    back = wire.decode(wire.encode(msg))
    taker = Simulation(nodes=2, topology="ring", task="synthetic", steps=10, period=5, outer=OUTER, seed=7).nodes[1]
    assert back.data.numel == taker.handover_numel(back.extra)
    from gossip.mixing.base import decode_payload

    taker.adopt_handover(decode_payload(back, taker.state.flat), back.extra)
    assert torch.equal(taker.state.flat, giver.state.flat)
    assert torch.equal(taker.rule.anchor, giver.state.flat)
    assert torch.equal(taker.rule.momentum, giver.rule.momentum)
    # a payload description that does not fit this node is refused, not trusted
    for bad in ({"outer": [0, 0]}, {"outer": [5]}, {"outer": "0"}, {"outer": [True]}):
        assert taker.handover_numel(bad) is None
    plain = Simulation(nodes=2, topology="ring", task="synthetic", steps=10, period=5, seed=0).nodes[0]
    payload, extra = plain.handover()
    assert "outer" not in extra and plain.handover_numel(extra) == payload.numel() == plain.numel
    assert plain.handover_numel({}) == plain.numel  # (a donor with no optimizer state to give)


def test_a_late_real_joiner_takes_the_outer_momentum(tmp_path):
    """The cluster trains until the late node has joined (a fixed step count would end
    before a slow machine has started it), then everyone is stopped."""
    ports = [free_port() for _ in range(3)]
    common = ["--topology", "ring", "--task", "synthetic", "--steps", str(10**7), "--period", "4", "--outer", OUTER,
              "--seed", "0", "--json", "--join-margin", "10", *FAST]
    with Cluster(tmp_path) as c:
        first = [c.start(f"n{i}", ["--peers", f"127.0.0.1:{ports[(i + 1) % 3]}", *common], port=ports[i])
                 for i in range(3)]
        first[0].wait_for_log("training as", 60)
        late = c.start("late", ["--peers", first[1].addr, *common])
        late.wait_for_log("took the outer momentum of channel(s) all with the parameters", 180)
        for x in (*first, late):
            x.proc.send_signal(signal.SIGTERM)
        assert [x.wait(60) for x in (*first, late)] == [0, 0, 0, 0], late.log()[-3000:]
        log = late.log()
        s = late.summary()
    assert s["joined"] is True and s["state_from"] in {x.addr for x in first}, s
    assert "took the state of" in log


def test_three_real_nodes_with_pseudograd_top_k_and_fragments_match_the_simulator(tmp_path):
    """exchange=pseudograd (top-k, error feedback) over 2 fragments on real nodes: the wire carries
    one fragment's compressed pseudo-gradient per round, and the numbers are the simulator's."""
    steps, period, n = 8, 2, 3
    spec = OUTER + ",exchange=pseudograd,fragments=2"
    ports = sorted(free_port() for _ in range(n))
    with Cluster(tmp_path) as c:
        nodes = [c.start(f"n{i}", ["--peers", f"127.0.0.1:{ports[(i + 1) % n]}", "--topology", "complete",
                                   "--task", "synthetic", "--steps", str(steps), "--period", str(period),
                                   "--outer", spec, "--compression", "topk:0.2", "--seed", "0", "--json", *EXACT,
                                   "--checkpoint-dir", str(tmp_path / f"ck{i}")], port=ports[i]) for i in range(n)]
        assert c.wait_all(120) == [0] * n
    _every_round_mixed(nodes)
    # the per-node engine steps as a real node does (the batched one's matmuls round differently,
    # and top-k would turn that rounding into other entries sent)
    sim = Simulation(nodes=n, topology="complete", task="synthetic", steps=steps, period=period, outer=spec,
                     compression="topk:0.2", seed=0, eval_every=steps, engine="per-node")
    result = sim.run().result()
    ids = sorted(f"127.0.0.1:{p}" for p in ports)
    for i, node in enumerate(nodes):
        rank = ids.index(node.summary()["node"])
        state = load_checkpoint(latest_checkpoint(tmp_path / f"ck{i}"))
        torch.testing.assert_close(state["flat"], result.params[rank], rtol=1e-5, atol=1e-6)
        parts = state["rules"][0]["fragments"]
        assert [p["outer_steps"] for p in parts] == [2, 2]
        for got, want in zip(parts, sim.nodes[rank].rule.rules):
            torch.testing.assert_close(got["residual"], want.residual, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["momentum"], want.momentum, rtol=1e-5, atol=1e-6)
        assert not node.summary()["rejected"]  # no fragment refused for its size
