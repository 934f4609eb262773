"""Asynchronous staleness-aware mixing, overlap, link policies and the cross-DC claims."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

import gossip
from gossip.api import SimConfig, Simulation
from gossip.compression import get_codec
from gossip.core.message import Message
from gossip.mixing import AsyncGossipRule, Inbox, Staleness, make_rule, parse_staleness
from gossip.mixing.policy import parse_link_policies
from gossip.sim.engine import ComputeModel, Simulator
from gossip.sim.simulation import build_nodes
from gossip.transport.links import LAN, WAN, SimNetwork
from tests.helpers import FrozenTask
from topologies import build, mixing_matrix, restrict_links


def test_staleness_decays():
    assert parse_staleness("constant")(100) == 1.0
    assert parse_staleness("poly:1")(3) == pytest.approx(0.25)
    assert parse_staleness("exp:0.5")(2) == pytest.approx(math.exp(-1))
    h = parse_staleness("hinge:1,2")
    assert (h(0), h(2), h(3), h(12)) == (1.0, 1.0, 0.5, pytest.approx(1 / 11))
    assert parse_staleness(None) == Staleness("hinge", 1.0, 2.0)
    for bad in ("linear", "poly:x", "hinge:1", "exp:-1"):
        with pytest.raises(ValueError):
            parse_staleness(bad)


def test_async_rule_weights_by_staleness_uses_newest_and_each_message_once():
    topo = build("ring", 3)  # node 0's in-neighbours 1 and 2, weight 1/3 each
    rule = AsyncGossipRule(staleness="poly:1")
    codec = get_codec("none")
    inbox = Inbox()

    def msg(sender, progress, value, seq):
        return Message("state", sender, 0, progress, seq, codec.encode(torch.full((4,), float(value))))

    inbox.add(1, msg(1, 5, 100.0, 1))   # superseded by the next one
    inbox.add(1, msg(1, 9, 10.0, 2))    # staleness 10 - 9 = 1: weight 1/3 * 1/2
    inbox.add(2, msg(2, 7, 20.0, 1))    # staleness 3: weight 1/3 * 1/4
    x = torch.zeros(4)
    rep = rule.mix(x, inbox, topo, 0, 0, progress=10)
    w1, w2 = (1 / 3) / 2, (1 / 3) / 4
    torch.testing.assert_close(x, torch.full((4,), w1 * 10 + w2 * 20))
    assert rep.mixed == 2 and rule.superseded == 1 and rep.staleness == pytest.approx(2.0)
    y = x.clone()
    rule.mix(x, inbox, topo, 0, 1, progress=11)  # nothing new: nothing is mixed twice
    assert torch.equal(x, y)


def test_async_nodes_never_wait_for_a_cut_off_neighbour():
    sim = Simulation(nodes=4, topology="ring", task=FrozenTask(), steps=20, compute="fixed:0.01", asynchronous=True)
    sim.network.partition([[0], [1, 2, 3]])
    r = sim.run().result()
    assert r.summary["sim_time_s"] == pytest.approx(20 * 0.01)  # no timeouts, nobody waited
    sync = Simulation(nodes=4, topology="ring", task=FrozenTask(), steps=20, compute="fixed:0.01", timeout=1.0)
    sync.network.partition([[0], [1, 2, 3]])
    assert sync.run().result().summary["sim_time_s"] > 20 * 1.0  # synchronous rounds time out


def run_frozen(n, rounds, topology, **cfg):
    task = FrozenTask(5)
    topo = build(topology, n)
    config = SimConfig(nodes=n, topology=topology, steps=rounds, task=task, **cfg)
    nodes = build_nodes(config, task, topo)
    x0 = torch.randn(n, 5, generator=torch.Generator().manual_seed(1))
    for i, nd in enumerate(nodes):
        nd.state.load_(x0[i])
    Simulator(nodes, SimNetwork({"intra": LAN, "inter": WAN}, topo.link), ComputeModel()).run()
    return topo, x0.double().numpy(), np.stack([nd.state.flat.double().numpy() for nd in nodes])


@pytest.mark.numeric
def test_overlap_mixes_the_same_rounds_one_exchange_later():
    # with no local progress in between, overlapped mixing is exactly synchronous mixing
    topo, x0, got = run_frozen(6, 5, "ring", overlap=True)
    W = mixing_matrix(topo.graph(0))
    np.testing.assert_allclose(got, np.linalg.matrix_power(W, 5) @ x0, atol=1e-5)


def test_overlap_keeps_local_progress_made_while_the_round_travels():
    # x_cur = ref + delta: the correction sum_j w (x_j - ref) must leave delta in place
    rule = make_rule("gossip")
    rule.overlap = True
    topo = build("ring", 3)
    x = torch.tensor([1.0, 1.0])
    out = rule.outgoing(x, topo, 0, 0)
    assert out
    inbox = Inbox()
    codec = get_codec("none")
    for j, v in ((1, 4.0), (2, 7.0)):
        inbox.add(j, Message("state", j, 0, 0, 1, codec.encode(torch.full((2,), v))))
    x += 0.5  # a local step while the round was in flight
    rule.mix(x, inbox, topo, 0, 0, 1)
    torch.testing.assert_close(x, torch.full((2,), (1 + 4 + 7) / 3 + 0.5))


def test_overlap_speedup_and_loss_when_messages_take_a_compute_step():
    common = dict(nodes=8, topology="ring", task="digits", steps=200, link="latency=10ms,bandwidth=10Gbit",
                  compute="fixed:0.01", eval_every=200, seed=0)
    block = gossip.simulate(**common).summary
    over = gossip.simulate(overlap=True, **common).summary
    assert block["sim_time_s"] / over["sim_time_s"] >= 1.6
    assert abs(over["final_loss"] / block["final_loss"] - 1) <= 0.05


@pytest.mark.numeric
def test_link_policies_mix_each_class_on_its_own_schedule():
    # intra every step, inter every 2nd: after 4 steps x = Wx Wi Wi Wx Wi Wi ... applied in order
    n, steps = 6, 4
    topo, x0, got = run_frozen(n, steps, "hierarchical:3,3", link_policy={"inter": "period=2"})
    Wi = mixing_matrix(restrict_links(topo, "intra").graph(0))
    Wx = mixing_matrix(restrict_links(topo, "inter").graph(0))
    x = x0
    for step in range(1, steps + 1):
        x = Wi @ x
        if step % 2 == 0:
            x = Wx @ x
    np.testing.assert_allclose(got, x, atol=1e-5)


def test_inter_policy_async_topk_cuts_inter_bytes_and_still_trains():
    common = dict(nodes=8, topology="hierarchical:4,4,inter=matched", task="digits", steps=150, eval_every=150,
                  inter_link="latency=50ms,bandwidth=100Mbit")
    plain = gossip.simulate(**common).summary
    policy = gossip.simulate(link_policy=["inter:period=10,codec=topk:0.05,async"], **common).summary
    assert policy["intra_rule"] == "gossip" and policy["inter_rule"] == "choco"
    assert policy["bytes_inter"] * 50 < plain["bytes_inter"]
    assert policy["bytes_intra"] == pytest.approx(plain["bytes_intra"], rel=0.01)
    assert policy["sim_time_s"] < plain["sim_time_s"] / 2  # no waiting on the slow link
    assert policy["final_accuracy"] > 0.85


def test_policy_parsing_errors():
    assert parse_link_policies(["inter:period=20,codec=topk:0.01,async"])["inter"].period == 20
    for bad in ("wan:period=2", "inter:period=0", "inter:speed=1", "inter"):
        with pytest.raises(ValueError):
            parse_link_policies([bad])
    with pytest.raises(ValueError, match="two link policies"):
        parse_link_policies(["inter:period=2", "inter:period=3"])
    with pytest.raises(ValueError, match="asynchronous"):
        SimConfig(staleness="poly:1")  # a decay without --async


@pytest.mark.parametrize("args,needle", [
    (["--staleness", "wobbly", "--async"], "unknown staleness"),
    (["--link-policy", "mars:period=3"], "intra or inter"),
    (["--link-policy", "inter:codec=zip"], "zip"),
])
def test_cli_rejects_bad_async_options(args, needle, capsys):
    from gossip.cli import sim_main

    assert sim_main(["--steps", "2", *args]) == 2
    assert needle in capsys.readouterr().err


# -- the cross-datacenter claims, in their benchmark configuration (one or two seeds) -------

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks"))


def test_async_reaches_sync_accuracy_in_a_third_of_the_time():
    import cross_dc

    r = cross_dc.async_vs_sync(seed=1, steps=300)
    assert r["ratio"] <= 1 / 3, r


def test_staleness_weighting_beats_constant_with_a_16_step_inter_dc_delay():
    import cross_dc

    rs = [cross_dc.staleness_vs_constant(seed, steps=300) for seed in (0, 1)]
    assert all(r["staleness"] > r["constant"] for r in rs), rs
    assert all(r["staleness_nodes"] > r["constant_nodes"] for r in rs), rs
