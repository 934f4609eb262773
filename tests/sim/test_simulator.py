"""The simulator driving real Node programs: exactness against the mixing maths,
determinism, timing, and the statistical claims of the foundation issue."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gossip
from gossip.api import SimConfig, consensus_distance
from gossip.sim.engine import ComputeModel, Simulator, parse_compute, parse_slow
from gossip.sim.simulation import build_nodes
from gossip.training.data import BatchStream
from gossip.transport.links import LAN, WAN, LinkModel, SimNetwork, parse_link
from tests.helpers import FrozenTask
from topologies import build, mixing_matrix


def run_frozen(spec: str, n: int, rounds: int, algorithm: str = "gossip", dim: int = 5, seed: int = 0, **net):
    """Run ``rounds`` gossip rounds of frozen nodes started at random vectors."""
    task = FrozenTask(dim)
    topo = build(spec, n)
    cfg = SimConfig(nodes=n, topology=spec, algorithm=algorithm, steps=rounds, task=task)
    nodes = build_nodes(cfg, task, topo)
    x0 = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    for i, node in enumerate(nodes):
        node.state.load_(x0[i])
    network = SimNetwork({"intra": net.get("link", LAN), "inter": WAN}, topo.link, seed=seed)
    sim = Simulator(nodes, network, net.get("compute", ComputeModel()), seed=seed)
    sim.run()
    return topo, x0, nodes, sim


@pytest.mark.numeric
@pytest.mark.parametrize("spec,n", [("ring", 6), ("torus:3x3", 9), ("exponential", 8), ("star", 5),
                                    ("one-peer-exponential", 8), ("hierarchical:3,3", 6)])
def test_sync_gossip_equals_mixing_matrix_product(spec, n):
    rounds = 5
    topo, x0, nodes, _ = run_frozen(spec, n, rounds)
    expected = x0.double().numpy()
    for r in range(rounds):
        expected = mixing_matrix(topo.graph(r)) @ expected
    got = np.stack([nd.state.flat.double().numpy() for nd in nodes])
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    # the mean is preserved by doubly stochastic weights
    np.testing.assert_allclose(got.mean(0), x0.double().numpy().mean(0), atol=1e-5)


@pytest.mark.numeric
def test_complete_graph_is_exact_average_on_every_node():
    _, x0, nodes, _ = run_frozen("complete", 7, 1)
    for nd in nodes:
        torch.testing.assert_close(nd.state.flat, x0.mean(0), rtol=0, atol=1e-6)


@pytest.mark.numeric
@pytest.mark.parametrize("spec,n", [("directed-ring", 5), ("exponential", 6), ("one-peer-exponential", 6),
                                    ("star", 6)])
def test_push_sum_converges_to_average_and_conserves_mass(spec, n):
    topo, x0, nodes, _ = run_frozen(spec, n, 80, algorithm="push-sum")
    weights = [nd.rule.weight for nd in nodes]
    assert sum(weights) == pytest.approx(n, rel=1e-12)
    numer = sum(w * nd.state.flat.double() for w, nd in zip(weights, nodes))
    torch.testing.assert_close(numer, x0.double().sum(0), rtol=0, atol=1e-5)  # mass conserved
    for nd in nodes:
        torch.testing.assert_close(nd.state.flat, x0.mean(0), rtol=0, atol=1e-4)


@pytest.mark.numeric
def test_push_sum_on_regular_graph_equals_gossip_with_uniform_weights():
    _, _, ps_nodes, _ = run_frozen("exponential", 8, 6, algorithm="push-sum")
    _, _, g_nodes, _ = run_frozen("exponential", 8, 6, algorithm="gossip")
    for a, b in zip(ps_nodes, g_nodes):
        torch.testing.assert_close(a.state.flat, b.state.flat, rtol=0, atol=1e-6)


@pytest.mark.numeric
def test_push_sum_directed_non_regular_graph_is_debiased():
    # A star with push-sum shares: column- but not row-stochastic, so plain averaging would be biased.
    import networkx as nx

    G = nx.DiGraph([(0, 1), (1, 2), (2, 0), (0, 2)])
    topo = build(G, 3)
    task = FrozenTask(3)
    cfg = SimConfig(nodes=3, topology=G, algorithm="push-sum", steps=200, task=task)
    nodes = build_nodes(cfg, task, topo)
    x0 = torch.tensor([[3.0, 0, 0], [0, 3.0, 0], [0, 0, 3.0]])
    for i, nd in enumerate(nodes):
        nd.state.load_(x0[i])
    Simulator(nodes, SimNetwork({"intra": LAN}, topo.link), ComputeModel()).run()
    for nd in nodes:
        torch.testing.assert_close(nd.state.flat, torch.ones(3), rtol=0, atol=1e-5)
    assert sorted(round(nd.rule.weight, 3) for nd in nodes) != [1.0, 1.0, 1.0]  # weights really differ


@pytest.mark.numeric
def test_single_node_is_bit_identical_to_a_plain_torch_loop():
    from gossip.training.data import node_seed
    from gossip.training.tasks import get_task

    steps, seed = 40, 3
    # same thread count on both sides: reductions split across threads round differently; the
    # per-node engine runs this very loop (the batched one, auto's choice here, sums its matmuls
    # in another order: equal to rounding only, see test_batched.py)
    r = gossip.simulate(nodes=1, topology="ring", task="synthetic", steps=steps, seed=seed, eval_every=steps,
                        threads=torch.get_num_threads(), engine="per-node")
    # the ordinary loop: same init seed, same shard, same batch order
    task = get_task("synthetic")
    torch.manual_seed(seed)
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=task.momentum)
    g = torch.Generator().manual_seed(node_seed(seed, 0, 1))
    shard = torch.as_tensor(task.shard(0, 1, "iid", seed))
    order, pos = torch.empty(0, dtype=torch.long), 0
    for _ in range(steps):
        if pos + task.batch_size > len(order):
            order, pos = shard[torch.randperm(len(shard), generator=g)], 0
        idx = order[pos:pos + task.batch_size]
        pos += task.batch_size
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(task.X[idx]), task.y[idx]).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(r.params[0], flat)


def test_same_seed_same_results_different_seed_different():
    kw = dict(nodes=4, topology="ring", task="synthetic", steps=30, compute="lognormal:0.01,0.5", eval_every=10)
    a = gossip.simulate(seed=1, **kw)
    b = gossip.simulate(seed=1, **kw)
    c = gossip.simulate(seed=2, **kw)
    for x, y in zip(a.params, b.params):
        assert torch.equal(x, y)
    assert a.summary["sim_time_s"] == b.summary["sim_time_s"]
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]
    assert not torch.equal(a.params[0], c.params[0])
    assert a.summary["sim_time_s"] != c.summary["sim_time_s"]


def test_link_model_timing_latency_plus_size_over_bandwidth():
    net = SimNetwork({"intra": LinkModel(latency=0.05, bandwidth=8e6)}, lambda u, v: "intra")
    assert net.transmit(0, 1, 1_000_000, now=1.0) == pytest.approx(1.0 + 1.0 + 0.05)
    # a second message on the same link queues behind the first
    assert net.transmit(0, 1, 1_000_000, now=1.0) == pytest.approx(1.0 + 2.0 + 0.05)
    # another link is independent
    assert net.transmit(1, 0, 1_000_000, now=1.0) == pytest.approx(2.05)
    assert net.bytes_by_class["intra"] == 3_000_000


def test_sim_time_reflects_compute_and_slow_nodes():
    fast = gossip.simulate(nodes=4, topology="ring", task=FrozenTask(), steps=10, compute="fixed:0.1")
    slow = gossip.simulate(nodes=4, topology="ring", task=FrozenTask(), steps=10, compute="fixed:0.1", slow="2=3")
    assert fast.summary["sim_time_s"] == pytest.approx(10 * 0.1, rel=0.01)
    # synchronous gossip waits for the slowest node every round
    assert slow.summary["sim_time_s"] == pytest.approx(10 * 0.3, rel=0.01)


def test_wan_link_slows_synchronous_rounds():
    lan = gossip.simulate(nodes=4, topology="hierarchical:2,2", task=FrozenTask(), steps=10, compute="fixed:0.01")
    wan = gossip.simulate(nodes=4, topology="hierarchical:2,2", task=FrozenTask(), steps=10, compute="fixed:0.01",
                          inter_link="latency=100ms,bandwidth=1Gbit")
    assert lan.summary["bytes_inter"] > 0 and lan.summary["bytes_intra"] > 0
    assert wan.summary["sim_time_s"] == pytest.approx(lan.summary["sim_time_s"] + 10 * (0.1 - 0.05), rel=0.02)


def test_lost_messages_go_to_self_weight_and_never_crash():
    lossy = LinkModel(latency=1e-4, bandwidth=1e9, loss=0.3)
    topo, x0, nodes, sim = run_frozen("ring", 6, 20, link=lossy)
    assert sim.network.lost > 0
    # every lost message is a missing neighbour; a round that timed out also makes
    # the next round's messages of that node late, so misses can exceed losses
    assert sum(nd.mix_totals.missing for nd in nodes) >= sim.network.lost
    assert sum(nd.mix_totals.late for nd in nodes) > 0
    lo, hi = x0.min(0).values, x0.max(0).values
    for nd in nodes:  # row-stochastic mixing keeps every node in the convex hull
        assert bool(((nd.state.flat >= lo - 1e-6) & (nd.state.flat <= hi + 1e-6)).all())


def test_consensus_distance_definition():
    flats = [torch.tensor([0.0, 0.0]), torch.tensor([2.0, 0.0])]
    assert consensus_distance(flats) == pytest.approx(1.0)  # each is 1 away from the mean


def test_parse_specs_and_errors():
    assert parse_link("latency=50ms,bandwidth=100Mbit").latency == pytest.approx(0.05)
    assert parse_link("latency=50ms,bandwidth=100Mbit").bandwidth == pytest.approx(1e8)
    assert parse_link("wan") == WAN
    with pytest.raises(ValueError, match="latency"):
        parse_link("latency=-1ms")
    with pytest.raises(ValueError, match="valid keys"):
        parse_link("speed=1")
    assert parse_link("down=10-30s").down == (10.0, 30.0) == parse_link("down=10s-30s").down
    assert parse_link("down=500ms-2s").down == (0.5, 2.0)
    with pytest.raises(ValueError, match="START-END"):
        parse_link("down=10s")
    with pytest.raises(ValueError, match="START < END"):
        parse_link("down=30-10")
    assert parse_compute("lognormal:0.02,0.1").mean == pytest.approx(0.02)
    with pytest.raises(ValueError, match="compute"):
        parse_compute("gaussian:1")
    assert parse_slow("3=5,7=2.5") == {3: 5.0, 7: 2.5}
    with pytest.raises(ValueError, match="NODE=FACTOR"):
        parse_slow("three")


@pytest.mark.numeric
@pytest.mark.parametrize("self_w,ws", [(1 / 3, [1 / 3, 1 / 3]), (0.0, [0.25, 0.75]), (0.5, [0.0, 0.5]),
                                       (0.2, [0.3, 0.1, 0.4]), (0.3, [0.2, 0.1])])
def test_weighted_sum_matches_reference(self_w, ws):
    from gossip.mixing import weighted_sum_

    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, generator=g, dtype=torch.float64)
    ts = [torch.randn(50, generator=g, dtype=torch.float64) for _ in ws]
    expected = self_w * x + sum(w * t for w, t in zip(ws, ts))  # includes the non-convex (0.6 total) case
    torch.testing.assert_close(weighted_sum_(x.clone(), self_w, list(zip(ws, ts))), expected, rtol=0, atol=1e-12)


def test_synchronous_round_times_out_at_the_configured_deadline():
    # node 0 is cut off: every round it waits the full timeout, then mixes alone
    from gossip.api import Simulation

    sim = Simulation(nodes=3, topology="complete", task=FrozenTask(), steps=4, timeout=0.5, compute="fixed:0.01")
    sim.network.partition([[0], [1, 2]])
    r = sim.run().result()
    assert r.summary["sim_time_s"] == pytest.approx(4 * (0.01 + 0.5), rel=1e-6)
    assert r.summary["missing_neighbors"] == 4 * 2 + 4 * 2  # 0 misses both peers; 1 and 2 each miss 0


def test_a_link_class_that_is_down_loses_every_message_in_its_window():
    classes = {(0, 1): "inter", (0, 2): "intra"}
    net = SimNetwork({"intra": LinkModel(latency=0.0), "inter": LinkModel(latency=0.0, down=(1.0, 2.0))},
                     lambda u, v: classes[(u, v)], origin=100.0)  # windows count from the node's start
    sent = {t: net.transmit(0, 1, 10, 100.0 + t, droppable=False) for t in (0.5, 1.0, 1.5, 1.999, 2.0)}
    assert [t for t, arrival in sent.items() if arrival is None] == [1.0, 1.5, 1.999]  # control too
    assert net.transmit(0, 2, 10, 101.5) is not None  # the other class is up
    assert net.lost == 3


@pytest.mark.parametrize("size", [1, 2, 5])
def test_batch_stream_is_the_documented_randperm_replay(size):
    """A shard's batches are ``shard[randperm(len, generator)]`` per epoch, and the
    generator is left exactly where that replay leaves it (a one-sample shard takes
    the short path, which must draw nothing either)."""
    shard = torch.arange(10, 10 + size)
    stream = BatchStream((torch.arange(20),), shard.numpy(), 2, seed=7)
    g = torch.Generator().manual_seed(7)
    expected: list[int] = []
    for _ in range(6):
        order = shard[torch.randperm(size, generator=g)].tolist()
        step = min(2, size)
        expected += [x for i in range(0, size - step + 1, step) for x in order[i:i + step]]
    got = [int(v) for _ in range(len(expected) // min(2, size)) for v in stream.next_indices()]
    assert got == expected
    assert torch.equal(stream.generator.get_state(), g.get_state())
