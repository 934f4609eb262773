"""Tests of topology spec strings (build) and the Topology object."""

import time

import networkx as nx
import numpy as np
import pytest

from topologies import (
    SPEC_NAMES,
    Topology,
    build,
    complete,
    exponential,
    hierarchical,
    is_doubly_stochastic,
    mixing_matrix,
    one_peer_exponential,
    period_mixing_matrix,
    push_sum_weights,
    random_regular,
    ring,
    small_world,
    star,
    to_file,
    torus,
)


def edges(G):
    return {(u, v): w for u, v, w in G.edges(data="weight")}


# ---- every name ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,reference",
    [
        ("ring", lambda: ring(16)),
        ("directed-ring", lambda: nx.DiGraph(one_peer_exponential(16, 0))),
        ("torus", lambda: torus(4, 4)),
        ("torus:2x8", lambda: torus(2, 8)),
        ("complete", lambda: complete(16)),
        ("star", lambda: star(16)),
        ("exponential", lambda: exponential(16)),
        ("random-regular", lambda: random_regular(16, 3, seed=0)),
        ("random-regular:4", lambda: random_regular(16, 4, seed=0)),
        ("random-regular:4,seed=9", lambda: random_regular(16, 4, seed=9)),
        ("random-regular:degree=5,seed=2", lambda: random_regular(16, 5, seed=2)),
        ("small-world", lambda: small_world(16, 4, 0.1, seed=0)),
        ("small-world:6,0.3", lambda: small_world(16, 6, 0.3, seed=0)),
        ("small-world:k=6,p=0.3,seed=4", lambda: small_world(16, 6, 0.3, seed=4)),
        ("hierarchical:8,8", lambda: hierarchical([8, 8])),
        ("hierarchical:4,4,8,intra=ring,inter=matched", lambda: hierarchical([4, 4, 8], intra="ring", inter="matched")),
        ("hierarchical:10,6,intra=exponential,inter=complete",
         lambda: hierarchical([10, 6], intra="exponential", inter="complete")),
        ("  Directed_Ring  ", lambda: nx.DiGraph(one_peer_exponential(16, 0))),
    ],
)
def test_build_matches_builder(spec, reference):
    t = build(spec, 16)
    assert isinstance(t, Topology)
    assert t.n == 16 and t.period == 1 and not t.time_varying
    assert t.spec == spec.strip()
    assert edges(t.graph()) == edges(reference())


def test_every_name_builds():
    specs = {name: name for name in SPEC_NAMES}
    specs["hierarchical"] = "hierarchical:8,8"
    specs["file"] = None  # covered in test_topologies_files.py
    for name, spec in specs.items():
        if spec is not None:
            t = build(spec, 16)
            assert t.n == 16, name
    assert set(SPEC_NAMES) == {
        "ring", "directed-ring", "torus", "complete", "star", "exponential",
        "one-peer-exponential", "random-regular", "small-world", "hierarchical", "file",
    }


def test_build_seed_reaches_random_topologies():
    assert edges(build("random-regular", 16, seed=5).graph()) == edges(random_regular(16, 3, seed=5))
    assert edges(build("small-world", 16, seed=5).graph()) == edges(small_world(16, 4, 0.1, seed=5))
    assert edges(build("random-regular", 16, seed=5).graph()) != edges(build("random-regular", 16, seed=6).graph())


def test_torus_picks_most_square_shape():
    assert edges(build("torus", 12).graph()) == edges(torus(3, 4))
    assert edges(build("torus", 36).graph()) == edges(torus(6, 6))
    assert edges(build("torus", 4).graph()) == edges(torus(2, 2))
    assert edges(build("torus:1x7", 7).graph()) == edges(ring(7))


def test_one_peer_exponential_topology():
    t = build("one-peer-exponential", 16)
    assert t.time_varying and t.period == 4
    P = period_mixing_matrix(t)
    assert np.allclose(P, np.full((16, 16), 1 / 16), atol=1e-12)
    three = period_mixing_matrix(t, rounds=3)
    assert not np.allclose(three, 1 / 16, atol=1e-3)
    for r in range(8):
        assert edges(t.graph(r)) == edges(one_peer_exponential(16, r))
    assert build("one-peer-exponential", 1).period == 1
    assert build("one-peer-exponential", 2).period == 1
    assert build("one-peer-exponential", 5).period == 3


def test_weights_option_overrides():
    t = build("star:weights=uniform", 8)
    assert t.in_weights(0) == {i: 1 / 8 for i in range(8)}
    assert t.in_weights(3) == {3: 0.5, 0: 0.5}
    t = build("star,weights=max-degree".replace(",", ":"), 8)
    assert t.in_weights(3)[0] == 1 / 8
    assert t.in_weights(3)[3] == pytest.approx(7 / 8)
    t = build("hierarchical:4,4,inter=complete,weights=max-degree", 8)
    assert t.in_weights(0)[7] == 1 / 8  # max degree 3 + 4
    assert is_doubly_stochastic(t.mixing_matrix())
    t = build("exponential:weights=uniform", 8)
    assert edges(t.graph()) == edges(exponential(8))
    t = build("one-peer-exponential:weights=max-degree", 8)
    assert t.period == 3 and t.in_weights(0, 1) == {0: 0.5, 6: 0.5}


# ---- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,n,match",
    [
        ("foo", 8, r"unknown topology 'foo'; valid: ring, directed-ring, torus, complete, star, exponential, "
                   r"one-peer-exponential, random-regular, small-world, hierarchical, file"),
        ("torus:4x4", 8, r"^torus:4x4 needs 16 nodes, got 8$"),
        ("torus", 7, "n=7 has no such factorization"),
        ("torus:4by4", 16, "shape must be ROWSxCOLS"),
        ("random-regular:8", 8, "degree must be < n; got degree=8 with n=8"),
        ("random-regular:3", 7, "n \\* degree must be even"),
        ("random-regular:three", 8, "random-regular: degree must be an int, got 'three'"),
        ("random-regular:3,colour=red", 8, "unknown option 'colour'; valid: degree, seed, weights"),
        ("random-regular:3,4", 8, "at most 1"),
        ("random-regular:3,degree=4", 8, "degree given twice"),
        ("small-world:8", 8, "k must be < n"),
        ("small-world:4,2.5", 8, "p must be a probability"),
        ("hierarchical:8,8", 12, r"hierarchical:8,8 has 16 nodes \(sum of sizes\), but n=12"),
        ("hierarchical", 12, "needs the datacenter sizes"),
        ("hierarchical:6,6,intra=tree", 12, "intra: unknown choice 'tree'; valid: complete, ring, exponential"),
        ("hierarchical:6,x", 12, "each size must be an int"),
        ("hierarchical:6,0,6", 12, r"sizes\[1\] must be a positive int"),
        ("ring:3", 8, "ring takes no positional arguments"),
        ("ring:weights=bogus", 8, "weights: unknown choice 'bogus'; valid: metropolis, uniform, max-degree"),
        ("ring:weights=push-sum", 8, "weights: unknown choice 'push-sum'"),
        ("directed-ring:weights=metropolis", 8, "needs? a symmetric graph"),
        ("ring:,", 8, "empty argument"),
        ("random-regular:seed=1,3", 8, "positional argument '3' after a key=value"),
        ("file:/nonexistent/graph.txt", 8, "graph.txt"),
    ],
)
def test_spec_errors(spec, n, match):
    with pytest.raises((ValueError, OSError), match=match):
        build(spec, n)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_build_rejects_bad_n(bad):
    with pytest.raises(ValueError, match="n must be a positive int"):
        build("ring", bad)


def test_build_rejects_bad_spec_type():
    with pytest.raises(ValueError, match="spec must be a string"):
        build(42, 4)


# ---- networkx graphs and Topology passthrough ------------------------------------------


def test_build_from_networkx_graph():
    t = build(nx.petersen_graph(), 10)
    assert t.spec == "networkx:Graph"
    assert is_doubly_stochastic(t.mixing_matrix())
    assert t.in_weights(0) == pytest.approx({0: 1 / 4, 1: 1 / 4, 4: 1 / 4, 5: 1 / 4})
    with pytest.raises(ValueError, match="has 10 nodes, but n=8"):
        build(nx.petersen_graph(), 8)
    with pytest.raises(ValueError, match="not strongly connected: 2 components"):
        build(nx.disjoint_union(nx.cycle_graph(3), nx.cycle_graph(3)), 6)


def test_build_passes_topology_through():
    t = build("ring", 8)
    assert build(t, 8) is t
    with pytest.raises(ValueError, match="has 8 nodes, but n=4"):
        build(t, 4)


# ---- Topology ------------------------------------------------------------------------


def test_static_graph_is_cached_and_frozen():
    t = build("exponential", 16)
    G = t.graph(0)
    assert t.graph(1) is G and t.graph(12345) is G
    assert nx.is_frozen(G)
    with pytest.raises(nx.NetworkXError):
        G.add_edge(0, 5)


def test_time_varying_graph_cycles():
    t = build("one-peer-exponential", 8)
    graphs = [t.graph(r) for r in range(3)]
    assert len({id(G) for G in graphs}) == 3
    assert all(t.graph(r + 3 * k) is graphs[r] for r in range(3) for k in (1, 5))


@pytest.mark.parametrize(
    "spec,n", [("ring", 8), ("star", 6), ("hierarchical:3,5,inter=matched", 8), ("one-peer-exponential", 8),
               ("exponential", 13), ("random-regular:4", 10)],
)
def test_per_node_lookups_match_mixing_matrix(spec, n):
    t = build(spec, n)
    for r in range(t.period + 1):
        W = mixing_matrix(t.graph(r))
        P = mixing_matrix(push_sum_weights(t.graph(r)))
        for i in range(n):
            ins = t.in_weights(i, r)
            outs = t.out_weights(i, r)
            assert ins == {u: W[i, u] for u in range(n) if W[i, u] != 0}
            assert outs == {v: W[v, i] for v in range(n) if W[v, i] != 0}
            assert sum(ins.values()) == pytest.approx(1.0)
            assert sorted(t.in_neighbors(i, r)) == sorted(u for u in ins if u != i)
            assert sorted(t.out_neighbors(i, r)) == sorted(v for v in outs if v != i)
            shares = t.push_sum_out_weights(i, r)
            assert set(shares) == set(outs)
            assert all(s == 1 / len(outs) for s in shares.values())
            assert shares == {v: P[v, i] for v in range(n) if P[v, i] != 0}
        assert np.array_equal(t.mixing_matrix(r), W)


def test_lookups_return_copies():
    t = build("ring", 5)
    w = t.in_weights(0)
    w.pop(1)
    w[0] = 99.0
    assert t.in_weights(0) == pytest.approx({0: 1 / 3, 1: 1 / 3, 4: 1 / 3})
    t.out_weights(0).clear()
    assert len(t.out_weights(0)) == 3
    t.push_sum_out_weights(0).clear()
    assert len(t.push_sum_out_weights(0)) == 3


def test_lookups_are_cached():
    # complete graph on 256 nodes: rebuilding tables from networkx on each call would take minutes
    t = build("complete", 256)
    for r in range(5):  # the first call of a round may build that round's tables
        t.in_weights(0, r), t.out_weights(0, r), t.push_sum_out_weights(0, r)
    start = time.perf_counter()
    for r in range(5):
        for i in range(256):
            t.in_weights(i, r)
            t.out_weights(i, r)
            t.push_sum_out_weights(i, r)
    assert time.perf_counter() - start < 1.0  # about 0.04 s when cached


def test_dc_and_link():
    t = build("hierarchical:3,2,intra=ring,inter=gateway", 5)
    assert [t.dc(i) for i in range(5)] == [0, 0, 0, 1, 1]
    assert t.link(0, 3) == "inter" and t.link(3, 0) == "inter"
    assert t.link(0, 1) == "intra" and t.link(2, 2) == "intra"
    assert t.link(1, 4) == "inter"  # not an edge: classified by datacenter
    r = build("ring", 4)
    assert {r.dc(i) for i in range(4)} == {0}
    assert r.link(0, 2) == "intra"


def test_lookup_argument_errors():
    t = build("ring", 4)
    with pytest.raises(ValueError, match="node must be an int in 0..3"):
        t.in_weights(4)
    with pytest.raises(ValueError, match="node must be"):
        t.dc(-1)
    with pytest.raises(ValueError, match="round must be a non-negative int"):
        t.graph(-1)
    with pytest.raises(ValueError, match="round must be"):
        t.out_weights(0, 1.5)


def test_topology_constructor_validates():
    Topology([one_peer_exponential(16, r) for r in range(4)])  # each round disconnected, union connected
    with pytest.raises(ValueError, match="union of one period: graph is not strongly connected"):
        Topology([one_peer_exponential(16, r) for r in (1, 2)])  # even offsets only: two components
    bad = nx.DiGraph(ring(4))
    bad[0][1]["weight"] = 0.9
    with pytest.raises(ValueError, match="weights into node 1"):
        Topology(bad)
    with pytest.raises(ValueError, match="round 1: weights into node 1"):
        Topology([ring(4), bad])
    with pytest.raises(ValueError, match="different nodes"):
        Topology([ring(4), ring(5)])
    with pytest.raises(ValueError, match="at least one graph"):
        Topology([])


def test_file_spec_with_weights_option(tmp_path):
    path = tmp_path / "g.json"
    to_file(star(6), path)
    t = build(f"file:{path},weights=uniform", 6)
    assert t.in_weights(1) == {1: 0.5, 0: 0.5}
    t = build(f"file:{path}", 6)  # the file's own (Metropolis) weights
    assert t.in_weights(1) == pytest.approx({1: 5 / 6, 0: 1 / 6})
    with pytest.raises(ValueError, match="has 6 nodes, but n=7"):
        build(f"file:{path}", 7)
