"""Structural and spectral tests of the topology builders, weight rules and analysis."""

import math

import networkx as nx
import numpy as np
import pytest

from topologies import (
    apply_weights,
    check_graph,
    complete,
    directed_ring,
    exponential,
    hierarchical,
    is_column_stochastic,
    is_doubly_stochastic,
    is_row_stochastic,
    is_strongly_connected,
    is_symmetric,
    max_degree_weights,
    metropolis_hastings_weights,
    mixing_matrix,
    one_peer_exponential,
    push_sum_weights,
    random_regular,
    ring,
    small_world,
    spectral_gap,
    star,
    torus,
    uniform_weights,
)

NS = [1, 2, 5, 8, 16, 33]


def log2_ceil(n):
    return math.ceil(math.log2(n)) if n > 1 else 0


def rr_degree(n):
    """A valid random-regular degree for n nodes."""
    if n <= 2:
        return n - 1
    return 3 if n % 2 == 0 and n > 3 else 2


TORUS_SHAPE = {1: (1, 1), 2: (1, 2), 5: (1, 5), 8: (2, 4), 16: (4, 4), 33: (3, 11)}
TORUS_DEGREE = {1: 0, 2: 1, 5: 2, 8: 3, 16: 4, 33: 4}

# name -> (builder(n), expected out-degree (self excluded) of node i, is_regular, is_symmetric, valid(n))
CASES = {
    "ring": (ring, lambda n, i: min(n - 1, 2), True, True, lambda n: True),
    "directed_ring": (directed_ring, lambda n, i: min(n - 1, 1), True, False, lambda n: True),
    "complete": (complete, lambda n, i: n - 1, True, True, lambda n: True),
    "star": (star, lambda n, i: n - 1 if i == 0 else 1, False, True, lambda n: True),
    "exponential": (exponential, lambda n, i: log2_ceil(n), True, False, lambda n: True),
    "one_peer_r0": (lambda n: one_peer_exponential(n, 0), lambda n, i: min(n - 1, 1), True, False, lambda n: True),
    "one_peer_r3": (lambda n: one_peer_exponential(n, 3), lambda n, i: min(n - 1, 1), True, False, lambda n: True),
    "random_regular": (
        lambda n: random_regular(n, rr_degree(n), seed=7),
        lambda n, i: rr_degree(n),
        True,
        True,
        lambda n: True,
    ),
    "small_world": (
        lambda n: small_world(n, 4 if n > 1 else 0, 0.3, seed=3),
        None,
        False,
        True,
        lambda n: n == 1 or n >= 5,
    ),
    "torus": (
        lambda n: torus(*TORUS_SHAPE[n]),
        lambda n, i: TORUS_DEGREE[n],  # from the shape: size-1 dims add 0, size-2 dims 1, larger 2
        True,
        True,
        lambda n: True,
    ),
    "hierarchical": (
        lambda n: hierarchical([n // 2, n - n // 2] if n > 1 else [1], intra="ring", inter="matched"),
        None,
        False,
        True,
        lambda n: True,
    ),
}

# a single round of one-peer exponential need not be connected (only a period's union is)
ONE_ROUND_OF_TIME_VARYING = {"one_peer_r3"}

PARAMS = [(name, n) for name, case in CASES.items() for n in NS if case[4](n)]
IDS = [f"{name}-{n}" for name, n in PARAMS]


def build_case(name, n):
    return CASES[name][0](n)


@pytest.mark.parametrize("name,n", PARAMS, ids=IDS)
def test_structure(name, n):
    G = build_case(name, n)
    _, degree, _, symmetric, _ = CASES[name]
    assert isinstance(G, nx.DiGraph)
    assert sorted(G) == list(range(n))
    assert all(G.has_edge(i, i) for i in range(n))
    if name in ONE_ROUND_OF_TIME_VARYING:
        check_graph(G, require_connected=False)
        assert is_strongly_connected(G) == (n != 16)  # offset 8 splits 16 nodes into pairs
    else:
        check_graph(G)
        assert is_strongly_connected(G)
        assert is_symmetric(G) == (symmetric or n <= 2 or (name == "exponential" and n <= 3))
    if degree is not None:
        for i in range(n):
            assert G.out_degree(i) - 1 == degree(n, i)
            assert G.in_degree(i) - 1 == degree(n, i)
        assert G.number_of_edges() == n + sum(degree(n, i) for i in range(n))
    if name == "small_world" and n > 1:
        assert G.number_of_edges() == n + n * 4  # rewiring keeps n*k/2 undirected edges


@pytest.mark.parametrize("name,n", PARAMS, ids=IDS)
def test_default_weights_doubly_stochastic(name, n):
    G = build_case(name, n)
    W = mixing_matrix(G)
    assert is_doubly_stochastic(W)
    assert np.all(W >= 0)
    assert np.all(np.diag(W) > 0)
    # a sender that is not an in-neighbour has weight exactly 0
    assert np.count_nonzero(W) == G.number_of_edges()
    if name != "hierarchical":
        assert {G.nodes[i]["dc"] for i in G} == {0}
        assert {link for _, _, link in G.edges(data="link")} == {"intra"}


@pytest.mark.parametrize("name,n", PARAMS, ids=IDS)
def test_weight_rules(name, n):
    G = build_case(name, n)
    _, _, regular, symmetric, _ = CASES[name]
    for rule in ("metropolis", "uniform", "max-degree"):
        if rule == "metropolis" and not is_symmetric(G):
            with pytest.raises(ValueError, match="symmetric"):
                apply_weights(G, rule)
            continue
        W = mixing_matrix(apply_weights(G, rule))
        assert is_row_stochastic(W), rule
        if rule != "uniform" and is_symmetric(G):
            assert is_doubly_stochastic(W), rule
            assert np.allclose(W, W.T)
    if regular:
        assert is_doubly_stochastic(mixing_matrix(uniform_weights(G)))
    P = mixing_matrix(push_sum_weights(G))
    assert is_column_stochastic(P)
    for u in G:  # sender u splits evenly over its out-neighbours and itself
        assert np.allclose(P[:, u][P[:, u] > 0], 1 / G.out_degree(u))


def test_weights_do_not_mutate_input():
    G = star(4)
    before = {(u, v): w for u, v, w in G.edges(data="weight")}
    H = uniform_weights(G)
    assert H is not G
    assert {(u, v): w for u, v, w in G.edges(data="weight")} == before
    assert H[1][0]["weight"] == 1 / 4 and G[1][0]["weight"] == 1 / 4  # MH: 1/(1+max(3,1))
    assert H[0][1]["weight"] == 1 / 2 and G[0][1]["weight"] == 1 / 4


def test_uniform_not_doubly_stochastic_on_star():
    W = mixing_matrix(uniform_weights(star(5)))
    assert is_row_stochastic(W)
    assert not is_column_stochastic(W)
    assert not is_doubly_stochastic(W)


def test_metropolis_reference_values_star():
    W = mixing_matrix(star(5))  # center degree 4, leaves degree 1
    assert W[0, 1] == W[1, 0] == 1 / 5
    assert W[1, 1] == pytest.approx(4 / 5)
    assert W[0, 0] == pytest.approx(1 / 5)
    assert W[1, 2] == 0


def test_metropolis_reference_values_path():
    # path 0-1-2-3: degrees 1,2,2,1
    W = mixing_matrix(metropolis_hastings_weights(nx.path_graph(4)))
    expected = np.array(
        [[2 / 3, 1 / 3, 0, 0], [1 / 3, 1 / 3, 1 / 3, 0], [0, 1 / 3, 1 / 3, 1 / 3], [0, 0, 1 / 3, 2 / 3]]
    )
    assert np.allclose(W, expected, atol=1e-15)


def test_max_degree_reference_values():
    W = mixing_matrix(max_degree_weights(star(4)))  # max degree 3
    assert W[0, 1] == 1 / 4 and W[1, 0] == 1 / 4
    assert W[1, 1] == pytest.approx(3 / 4)
    assert W[0, 0] == pytest.approx(1 / 4)


def test_push_sum_reference_values():
    G = nx.DiGraph([(0, 1), (0, 2), (1, 2), (2, 0)])
    P = mixing_matrix(push_sum_weights(G))
    assert P[1, 0] == P[2, 0] == P[0, 0] == 1 / 3
    assert P[2, 1] == P[1, 1] == 1 / 2
    assert P[0, 2] == P[2, 2] == 1 / 2
    assert is_column_stochastic(P) and not is_row_stochastic(P)


def test_apply_weights_unknown_rule_lists_valid():
    with pytest.raises(ValueError, match="rule.*'bogus'.*metropolis, uniform, max-degree, push-sum"):
        apply_weights(ring(4), "bogus")


def test_metropolis_rejects_directed():
    with pytest.raises(ValueError, match=r"edge \(0, 1\) has no reverse"):
        metropolis_hastings_weights(nx.DiGraph([(0, 1), (1, 2), (2, 0)]))


def test_weight_rules_accept_undirected_input_and_add_self_loops():
    H = uniform_weights(nx.cycle_graph(4))
    assert isinstance(H, nx.DiGraph)
    assert all(H.has_edge(i, i) for i in H)
    assert H.number_of_edges() == 12


# ---- orientation and spectral values -------------------------------------------------


def test_mixing_matrix_orientation():
    W = mixing_matrix(directed_ring(3))  # 0 -> 1 -> 2 -> 0
    assert W[1, 0] == 0.5  # node 1 receives from node 0
    assert W[0, 1] == 0.0
    x = np.array([0.0, 3.0, 6.0])
    assert np.allclose(W @ x, [3.0, 1.5, 4.5])


def test_mixing_matrix_nodelist_and_missing_weight():
    W = mixing_matrix(directed_ring(3), nodelist=[2, 1, 0])
    assert W[1, 2] == 0.5  # node 1 (row 1) receives from node 0 (column 2)
    with pytest.raises(ValueError, match=r"edge \(0, 1\) has no 'weight'"):
        mixing_matrix(nx.DiGraph([(0, 1)]))


def test_ring_spectral_gap():
    gap = spectral_gap(mixing_matrix(ring(16)))
    assert gap == pytest.approx(0.0507, abs=1e-3)
    assert gap == pytest.approx(1 - (1 / 3 + 2 / 3 * math.cos(2 * math.pi / 16)), abs=1e-12)


def test_exponential_spectral_gap():
    assert spectral_gap(mixing_matrix(exponential(16))) == pytest.approx(0.4, abs=1e-9)


@pytest.mark.parametrize("n", [2, 5, 16])
def test_complete_spectral_gap_is_one(n):
    W = mixing_matrix(complete(n))
    assert spectral_gap(W) == pytest.approx(1.0, abs=1e-12)
    assert np.allclose(W, 1 / n)


def test_spectral_gap_disconnected_and_single():
    assert spectral_gap(np.eye(3)) == pytest.approx(0.0)
    assert spectral_gap(np.array([[1.0]])) == 1.0
    with pytest.raises(ValueError, match="square"):
        spectral_gap(np.ones((2, 3)))


def test_spectral_gap_orders_topologies():
    gaps = [spectral_gap(mixing_matrix(G)) for G in (ring(16), torus(4, 4), exponential(16), complete(16))]
    assert gaps == sorted(gaps)
    assert gaps[0] < gaps[1] < gaps[3]


def test_stochastic_predicates_reject():
    assert not is_row_stochastic([[0.5, 0.6], [0.5, 0.5]])
    assert not is_row_stochastic([[1.5, -0.5], [0.5, 0.5]])  # rows sum to 1 but negative entry
    assert is_row_stochastic([[1.0 + 1e-12, 0.0], [0.0, 1.0]])
    assert not is_row_stochastic([[1.0 + 1e-6, 0.0], [0.0, 1.0]])


# ---- one-peer exponential -------------------------------------------------------------


def test_one_peer_exponential_exact_average_after_log2_n_rounds():
    n = 16
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3))
    mean = x.mean(axis=0)
    errors = []
    for r in range(4):
        x = mixing_matrix(one_peer_exponential(n, r)) @ x
        errors.append(np.linalg.norm(x - mean) / np.linalg.norm(mean))
    assert errors[2] > 1e-2  # not after 3 rounds
    assert errors[3] < 1e-6  # exactly after 4
    assert np.allclose(x.mean(axis=0), mean)


def test_one_peer_exponential_schedule():
    n = 16
    for r in range(10):
        G = one_peer_exponential(n, r)
        for i in range(n):
            assert set(G.successors(i)) == {i, (i + 2 ** (r % 4)) % n}
            assert G[i][i]["weight"] == 0.5
    assert one_peer_exponential(1, 5).number_of_edges() == 1
    assert one_peer_exponential(1, 0)[0][0]["weight"] == 1.0
    with pytest.raises(ValueError, match="round"):
        one_peer_exponential(4, -1)


@pytest.mark.parametrize("n", [3, 5, 6, 12])
def test_one_peer_exponential_non_power_of_two_doubly_stochastic(n):
    for r in range(log2_ceil(n)):
        assert is_doubly_stochastic(mixing_matrix(one_peer_exponential(n, r)))


# ---- individual builders --------------------------------------------------------------


def test_single_node_graphs():
    for G in (ring(1), directed_ring(1), complete(1), star(1), exponential(1), torus(1, 1),
              random_regular(1, 0, seed=0), small_world(1, 0, 0.5, seed=0), hierarchical([1])):
        assert list(G.edges(data="weight")) == [(0, 0, 1.0)]


@pytest.mark.parametrize(
    "rows,cols,degree",
    [(1, 1, 0), (1, 2, 1), (2, 2, 2), (1, 5, 2), (2, 3, 3), (2, 5, 3), (3, 3, 4), (3, 4, 4), (4, 4, 4)],
)
def test_torus_degrees(rows, cols, degree):
    G = torus(rows, cols)
    n = rows * cols
    assert len(G) == n
    assert {G.out_degree(i) - 1 for i in G} == {degree}
    assert G.number_of_edges() == n * (degree + 1)
    assert is_doubly_stochastic(mixing_matrix(G))


def test_torus_neighbours():
    G = torus(3, 4)  # node 5 is row 1, col 1
    assert set(G.successors(5)) == {5, 1, 9, 4, 6}
    assert set(G.successors(0)) == {0, 4, 8, 1, 3}
    assert nx.is_isomorphic(torus(1, 7), ring(7))


def test_exponential_neighbours():
    G = exponential(10)  # ceil(log2 10) = 4: offsets 1, 2, 4, 8
    assert set(G.successors(3)) == {3, 4, 5, 7, 1}
    assert set(G.predecessors(3)) == {3, 2, 1, 9, 5}
    assert G[3][4]["weight"] == 1 / 5


def test_random_regular_deterministic_and_connected():
    a = random_regular(20, 3, seed=1)
    b = random_regular(20, 3, seed=1)
    c = random_regular(20, 3, seed=2)
    assert set(a.edges()) == set(b.edges())
    assert set(a.edges()) != set(c.edges())
    for n in (10, 50, 101):
        G = random_regular(n, 2, seed=n)  # degree 2: a single Hamiltonian cycle
        assert is_strongly_connected(G)
        assert {G.out_degree(i) for i in G} == {3}


@pytest.mark.parametrize(
    "n,degree,match",
    [(8, 8, "degree must be < n"), (5, 3, "n \\* degree must be even"), (6, 1, "degree must be >= 2"),
     (0, 1, "n must be a positive int"), (4, -1, "degree must be")],
)
def test_random_regular_errors(n, degree, match):
    with pytest.raises(ValueError, match=match):
        random_regular(n, degree, seed=0)


def test_random_regular_requires_int_seed():
    with pytest.raises(ValueError, match="seed"):
        random_regular(8, 3, seed=None)


def test_small_world_lattice_and_errors():
    G = small_world(10, 4, 0.0, seed=0)  # no rewiring: ring lattice
    assert set(G.successors(0)) == {0, 1, 2, 8, 9}
    assert small_world(10, 4, 0.5, seed=1).number_of_edges() == 10 + 40
    assert set(small_world(30, 4, 0.5, seed=1).edges()) == set(small_world(30, 4, 0.5, seed=1).edges())
    with pytest.raises(ValueError, match="k must be < n"):
        small_world(4, 4, 0.1, seed=0)
    with pytest.raises(ValueError, match="k must be an even"):
        small_world(10, 3, 0.1, seed=0)
    with pytest.raises(ValueError, match="p must be"):
        small_world(10, 4, 1.5, seed=0)


@pytest.mark.parametrize("builder", [ring, directed_ring, complete, star, exponential])
@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "4", None])
def test_builders_reject_bad_n(builder, bad):
    with pytest.raises(ValueError, match="n must be a positive int"):
        builder(bad)


def test_torus_rejects_bad_dimensions():
    with pytest.raises(ValueError, match="rows"):
        torus(0, 3)
    with pytest.raises(ValueError, match="cols"):
        torus(3, 1.5)


# ---- hierarchical ---------------------------------------------------------------------


def dc_of(sizes):
    return [d for d, s in enumerate(sizes) for _ in range(s)]


def intra_directed_edges(size, intra):
    if intra == "complete":
        return size * (size - 1)
    if intra == "ring":
        return 2 * size if size >= 3 else (2 if size == 2 else 0)
    pairs = {frozenset((i, (i + 2**k) % size)) for i in range(size) for k in range(log2_ceil(size))}
    return 2 * len(pairs)


def inter_directed_edges(sizes, inter):
    if inter == "gateway":
        return len(sizes) * (len(sizes) - 1)
    if inter == "matched":
        return sum(m * (m - 1) for k in range(max(sizes)) for m in [sum(1 for s in sizes if s > k)])
    return sum(a * b for i, a in enumerate(sizes) for j, b in enumerate(sizes) if i != j)


@pytest.mark.parametrize("sizes", [[4, 4, 4], [5, 3, 2], [1, 6], [8, 8], [3]])
@pytest.mark.parametrize("intra", ["complete", "ring", "exponential"])
@pytest.mark.parametrize("inter", ["gateway", "matched", "complete"])
def test_hierarchical(sizes, intra, inter):
    G = hierarchical(sizes, intra=intra, inter=inter)
    n = sum(sizes)
    assert sorted(G) == list(range(n))
    assert [G.nodes[i]["dc"] for i in range(n)] == dc_of(sizes)
    for u, v, link in G.edges(data="link"):
        assert link == ("intra" if G.nodes[u]["dc"] == G.nodes[v]["dc"] else "inter")
    links = [link for u, v, link in G.edges(data="link") if u != v]
    assert links.count("intra") == sum(intra_directed_edges(s, intra) for s in sizes)
    assert links.count("inter") == inter_directed_edges(sizes, inter)
    assert is_symmetric(G)
    assert is_doubly_stochastic(mixing_matrix(G))
    check_graph(G)


def test_hierarchical_explicit_edges():
    G = hierarchical([3, 2, 2], intra="ring", inter="gateway")
    inter = {(u, v) for u, v, link in G.edges(data="link") if link == "inter"}
    assert inter == {(0, 3), (3, 0), (0, 5), (5, 0), (3, 5), (5, 3)}
    G = hierarchical([3, 2], inter="matched")
    inter = {(u, v) for u, v, link in G.edges(data="link") if link == "inter"}
    assert inter == {(0, 3), (3, 0), (1, 4), (4, 1)}


def test_hierarchical_errors():
    with pytest.raises(ValueError, match="sizes must name at least one"):
        hierarchical([])
    with pytest.raises(ValueError, match=r"sizes\[1\] must be a positive int"):
        hierarchical([2, 0])
    with pytest.raises(ValueError, match="intra.*'tree'.*complete, ring, exponential"):
        hierarchical([2, 2], intra="tree")
    with pytest.raises(ValueError, match="inter.*'mesh'.*gateway, matched, complete"):
        hierarchical([2, 2], inter="mesh")


# ---- check_graph ----------------------------------------------------------------------


def test_check_graph_accepts_valid():
    assert check_graph(ring(5)) is None


def test_check_graph_negative_weight():
    G = nx.DiGraph(ring(6))
    G[3][4]["weight"] = -0.1
    G[4][4]["weight"] += 0.1 + 1 / 3  # row 4 still sums to 1: only the sign is wrong
    with pytest.raises(ValueError, match=r"negative weight on edge \(3, 4\)"):
        check_graph(G)


def test_check_graph_missing_self_loop():
    G = nx.DiGraph(ring(4))
    G.remove_edge(2, 2)
    with pytest.raises(ValueError, match="node 2 has no self-loop weight"):
        check_graph(G)


def test_check_graph_row_sum():
    G = nx.DiGraph(ring(4))
    G[1][1]["weight"] = 0.5
    with pytest.raises(ValueError, match="weights into node 1 sum to 1.1666"):
        check_graph(G)


def test_check_graph_disconnected():
    G = nx.disjoint_union(ring(2), ring(3))
    with pytest.raises(ValueError, match=r"not strongly connected: 2 components, e.g. nodes \[0, 1\] and \[2, 3, 4\]"):
        check_graph(G)
    # a directed chain is weakly but not strongly connected
    G = uniform_weights(nx.DiGraph([(0, 1), (1, 2)]))
    with pytest.raises(ValueError, match="3 components"):
        check_graph(G)


def test_check_graph_zero_weight_edges_do_not_connect():
    G = nx.DiGraph(nx.disjoint_union(ring(2), ring(2)))
    G.add_edge(1, 2, weight=0.0)
    G.add_edge(2, 1, weight=0.0)
    assert is_strongly_connected(G)  # structurally
    with pytest.raises(ValueError, match="not strongly connected"):
        check_graph(G)


def test_check_graph_bad_labels():
    G = metropolis_hastings_weights(nx.path_graph(["a", "b"]))
    with pytest.raises(ValueError, match="nodes must be the integers 0..1"):
        check_graph(G)
