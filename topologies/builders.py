"""Graph builders for gossip topologies.

Every builder is a plain function returning a weighted :class:`networkx.DiGraph`
on nodes ``0..n-1``: edge ``(u, v)`` means "u sends to v", its ``weight`` is
``W[v, u]``, and every node has a self-loop carrying its self weight. An
undirected topology is stored with both directions and gets
Metropolis-Hastings weights (doubly stochastic); the directed ones (directed
ring, exponential, one-peer exponential) are regular and get uniform weights
``1/(in_degree+1)``, which is then doubly stochastic too. Nodes carry ``dc``
(datacenter index, 0 except in :func:`hierarchical`) and edges ``link``
(``"intra"`` or ``"inter"``; self-loops are ``"intra"``).

Use :func:`topologies.weights.apply_weights` to re-weight a graph, and
:func:`from_networkx` / :func:`from_file` for graphs made elsewhere.
"""

from __future__ import annotations

import numbers
import random
from collections.abc import Callable, Iterable, Sequence

import networkx as nx

from .convert import from_file, from_networkx, to_file
from .weights import _set_metropolis, _set_uniform

__all__ = [
    "HIERARCHICAL_INTER",
    "HIERARCHICAL_INTRA",
    "complete",
    "directed_ring",
    "exponential",
    "from_file",
    "from_networkx",
    "hierarchical",
    "one_peer_exponential",
    "random_regular",
    "ring",
    "small_world",
    "star",
    "to_file",
    "torus",
]

Pairs = Iterable[tuple[int, int]]


def _check_int(name: str, value: object, minimum: int) -> int:
    """Return ``value`` if it is an int >= ``minimum``, else raise ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return int(value)


def _log2_ceil(n: int) -> int:
    """Return ceil(log2(n)) for n >= 1, exactly (no floating point)."""
    return (n - 1).bit_length()


def _graph(n: int, pairs: Pairs, *, directed: bool) -> nx.DiGraph:
    """Return the weighted DiGraph on ``0..n-1`` with the given edges.

    ``pairs`` are sender/receiver pairs; with ``directed=False`` each is added
    in both directions and the graph gets Metropolis-Hastings weights,
    otherwise uniform weights.
    """
    G = nx.DiGraph()
    G.add_nodes_from(range(n), dc=0)
    G.add_edges_from(((i, i) for i in range(n)), link="intra")
    edges = [(u, v) for u, v in pairs if u != v]
    if not directed:
        edges += [(v, u) for u, v in edges]
    G.add_edges_from(edges, link="intra")
    # G is fresh and private: weight it in place rather than through a copying public rule.
    return _set_uniform(G) if directed else _set_metropolis(G)


# Undirected edge sets, shared by the builders and by hierarchical().


def _ring_pairs(n: int) -> Pairs:
    return [(i, (i + 1) % n) for i in range(n)] if n > 1 else []


def _complete_pairs(n: int) -> Pairs:
    return [(u, v) for u in range(n) for v in range(u + 1, n)]


def _exponential_pairs(n: int) -> Pairs:
    return [(i, (i + 2**k) % n) for i in range(n) for k in range(_log2_ceil(n))]


def ring(n: int) -> nx.DiGraph:
    """Return the undirected ring (cycle) on ``n`` nodes.

    Each node exchanges with ``i - 1`` and ``i + 1`` (mod ``n``); weights are
    Metropolis-Hastings, i.e. 1/3 each for ``n >= 3``. ``n = 2`` is a single
    edge and ``n = 1`` a lone node.

    Parameters
    ----------
    n : int
        Number of nodes, at least 1.

    Examples
    --------
    >>> G = ring(5)
    >>> sorted(G.successors(0)), G[0][1]["weight"]
    ([0, 1, 4], 0.3333333333333333)
    """
    n = _check_int("n", n, 1)
    return _graph(n, _ring_pairs(n), directed=False)


def directed_ring(n: int) -> nx.DiGraph:
    """Return the directed ring on ``n`` nodes: ``i`` sends to ``i + 1`` (mod ``n``).

    Weights are 1/2 self and 1/2 from the predecessor (uniform), doubly
    stochastic. The ring where every node has one in- and one out-neighbour
    is the cheapest strongly connected topology (one message per round).

    Examples
    --------
    >>> G = directed_ring(4)
    >>> list(G.successors(3)), G[3][0]["weight"]
    ([3, 0], 0.5)
    """
    n = _check_int("n", n, 1)
    return _graph(n, _ring_pairs(n), directed=True)


def torus(rows: int, cols: int) -> nx.DiGraph:
    """Return the 2-D periodic grid (torus) with ``rows * cols`` nodes.

    Node ``r * cols + c`` exchanges with its neighbours up, down, left and
    right, wrapping around. Along a dimension of size 2 the two wrap-around
    neighbours coincide and are kept once; a dimension of size 1 adds none,
    so ``torus(1, n)`` is ``ring(n)``.

    Parameters
    ----------
    rows, cols : int
        Grid dimensions, each at least 1.

    Examples
    --------
    >>> G = torus(3, 4)
    >>> len(G), sorted(G.successors(0))
    (12, [0, 1, 3, 4, 8])
    """
    rows = _check_int("rows", rows, 1)
    cols = _check_int("cols", cols, 1)
    pairs = []
    for r in range(rows):
        for c in range(cols):
            pairs.append((r * cols + c, ((r + 1) % rows) * cols + c))
            pairs.append((r * cols + c, r * cols + (c + 1) % cols))
    return _graph(rows * cols, pairs, directed=False)


def complete(n: int) -> nx.DiGraph:
    """Return the complete graph on ``n`` nodes: the all-reduce baseline.

    Metropolis-Hastings weights are ``1/n`` everywhere, so one round of
    gossip computes the exact average (spectral gap 1).

    Examples
    --------
    >>> G = complete(4)
    >>> G.number_of_edges(), G[2][3]["weight"]
    (16, 0.25)
    """
    n = _check_int("n", n, 1)
    return _graph(n, _complete_pairs(n), directed=False)


def star(n: int) -> nx.DiGraph:
    """Return the star with center 0 and ``n - 1`` leaves.

    The parameter-server-like baseline: every leaf exchanges only with node 0.

    Examples
    --------
    >>> G = star(4)
    >>> sorted(G.successors(0)), sorted(G.successors(2))
    ([0, 1, 2, 3], [0, 2])
    """
    n = _check_int("n", n, 1)
    return _graph(n, [(0, i) for i in range(1, n)], directed=False)


def exponential(n: int) -> nx.DiGraph:
    """Return the static exponential graph on ``n`` nodes.

    Node ``i`` sends to ``(i + 2**k) mod n`` for ``k = 0 .. ceil(log2 n) - 1``,
    so every node has ``ceil(log2 n)`` out- and in-neighbours. Weights are
    uniform, ``1 / (ceil(log2 n) + 1)``, doubly stochastic because the graph is
    regular.

    Examples
    --------
    >>> G = exponential(8)
    >>> sorted(G.successors(0)), G[0][1]["weight"]
    ([0, 1, 2, 4], 0.25)
    """
    n = _check_int("n", n, 1)
    return _graph(n, _exponential_pairs(n), directed=True)


def one_peer_exponential(n: int, round: int) -> nx.DiGraph:
    """Return round ``round``'s graph of the time-varying one-peer exponential graph.

    With ``tau = ceil(log2 n)``, at round ``r`` node ``i`` sends only to
    ``(i + 2**(r mod tau)) mod n``; the receiver keeps 1/2 of its own value and
    takes 1/2 of its single in-neighbour's. The graphs repeat with period
    ``tau``; when ``n`` is a power of two, ``tau`` consecutive rounds compute
    the exact average. ``n = 1`` gives a lone node.

    Parameters
    ----------
    n : int
        Number of nodes, at least 1.
    round : int
        Gossip round, at least 0.

    Examples
    --------
    >>> [list(one_peer_exponential(8, r).successors(0)) for r in range(4)]
    [[0, 1], [0, 2], [0, 4], [0, 1]]
    """
    n = _check_int("n", n, 1)
    round = _check_int("round", round, 0)
    tau = _log2_ceil(n)
    offset = 2 ** (round % tau) if tau else 0
    return _graph(n, [(i, (i + offset) % n) for i in range(n)], directed=True)


def random_regular(n: int, degree: int, *, seed: int) -> nx.DiGraph:
    """Return a connected random ``degree``-regular graph on ``n`` nodes.

    Drawn with :func:`networkx.random_regular_graph`, redrawn until connected;
    for ``degree = 2`` a uniformly random Hamiltonian cycle is returned
    directly (a random 2-regular graph is rarely connected). The seed is
    required: every node of a cluster must build the same graph.

    Parameters
    ----------
    n : int
        Number of nodes, at least 1.
    degree : int
        Neighbours per node: ``degree < n`` and ``n * degree`` even; at least 2
        when ``n > 2`` (1 when ``n = 2``) so that the graph can be connected.
    seed : int
        Random seed.

    Examples
    --------
    >>> G = random_regular(10, 3, seed=1)
    >>> {G.out_degree(i) - 1 for i in G}
    {3}
    """
    n = _check_int("n", n, 1)
    degree = _check_int("degree", degree, 0)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if degree >= n:
        raise ValueError(f"degree must be < n; got degree={degree} with n={n}")
    if (n * degree) % 2:
        raise ValueError(f"n * degree must be even; got n={n}, degree={degree}")
    if n > 1 and degree < min(2, n - 1):
        need = min(2, n - 1)
        raise ValueError(f"degree must be >= {need} for a connected graph on n={n} nodes, got {degree}")
    rng = random.Random(seed)
    if degree == 2:
        order = list(range(n))
        rng.shuffle(order)
        return _graph(n, zip(order, order[1:] + order[:1]), directed=False)
    for _ in range(100):
        H = nx.random_regular_graph(degree, n, seed=rng)
        if n == 1 or nx.is_connected(H):
            return _graph(n, H.edges(), directed=False)
    raise ValueError(f"could not draw a connected {degree}-regular graph on {n} nodes in 100 tries")


def small_world(n: int, k: int, p: float, *, seed: int) -> nx.DiGraph:
    """Return a connected Watts-Strogatz small-world graph.

    Starts from a ring where each node is joined to its ``k`` nearest
    neighbours (``k/2`` on each side) and rewires each edge with probability
    ``p``; redrawn until connected (:func:`networkx.connected_watts_strogatz_graph`).

    Parameters
    ----------
    n : int
        Number of nodes, at least 1.
    k : int
        Even number of ring neighbours, ``2 <= k < n`` (``k = 0`` only for ``n = 1``).
    p : float
        Rewiring probability in ``[0, 1]``.
    seed : int
        Random seed (required, so that every node builds the same graph).

    Examples
    --------
    >>> G = small_world(10, 4, 0.0, seed=0)
    >>> sorted(G.successors(0))
    [0, 1, 2, 8, 9]
    """
    n = _check_int("n", n, 1)
    k = _check_int("k", k, 0)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be a probability in [0, 1], got {p!r}")
    if k >= n:
        raise ValueError(f"k must be < n; got k={k} with n={n}")
    if n > 1 and (k < 2 or k % 2):
        raise ValueError(f"k must be an even int >= 2 (k/2 neighbours on each side), got {k}")
    if n == 1:
        return _graph(1, [], directed=False)
    try:
        H = nx.connected_watts_strogatz_graph(n, k, float(p), tries=100, seed=seed)
    except nx.NetworkXError as e:
        raise ValueError(f"could not draw a connected small-world graph (n={n}, k={k}, p={p}): {e}") from None
    return _graph(n, H.edges(), directed=False)


_INTRA_PAIRS: dict[str, Callable[[int], Pairs]] = {
    "complete": _complete_pairs,
    "ring": _ring_pairs,
    "exponential": _exponential_pairs,
}
HIERARCHICAL_INTRA = tuple(_INTRA_PAIRS)
"""Valid ``intra`` choices of :func:`hierarchical`."""
HIERARCHICAL_INTER = ("gateway", "matched", "complete")
"""Valid ``inter`` choices of :func:`hierarchical`."""


def hierarchical(sizes: Sequence[int], *, intra: str = "complete", inter: str = "gateway") -> nx.DiGraph:
    """Return a multi-datacenter topology: dense inside each DC, sparse across.

    Nodes are numbered DC by DC: DC 0 holds ``0 .. sizes[0]-1``, DC 1 the next
    ``sizes[1]`` and so on. Every node carries ``dc``; every edge carries
    ``link="intra"`` (same DC, and self-loops) or ``link="inter"``. The graph
    is undirected with Metropolis-Hastings weights.

    Parameters
    ----------
    sizes : sequence of int
        Number of nodes in each datacenter, each at least 1.
    intra : {"complete", "ring", "exponential"}
        Graph inside each DC. ``"exponential"`` uses the exponential graph's
        edges in both directions so the whole graph stays symmetric.
    inter : {"gateway", "matched", "complete"}
        Cross-DC links: ``"gateway"`` joins the first node of every DC into a
        complete graph; ``"matched"`` links node ``k`` of each DC to node ``k``
        of every other DC that has one; ``"complete"`` links every cross pair.

    Examples
    --------
    >>> G = hierarchical([3, 2], intra="ring", inter="gateway")
    >>> [G.nodes[i]["dc"] for i in G], G[0][3]["link"], G[0][1]["link"]
    ([0, 0, 0, 1, 1], 'inter', 'intra')
    """
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise ValueError(f"sizes must be a sequence of positive ints, got {sizes!r}")
    sizes = [_check_int(f"sizes[{i}]", s, 1) for i, s in enumerate(sizes)]
    if not sizes:
        raise ValueError("sizes must name at least one datacenter, got []")
    if intra not in _INTRA_PAIRS:
        raise ValueError(f"intra: unknown choice {intra!r}; valid: {', '.join(HIERARCHICAL_INTRA)}")
    if inter not in HIERARCHICAL_INTER:
        raise ValueError(f"inter: unknown choice {inter!r}; valid: {', '.join(HIERARCHICAL_INTER)}")
    starts = [sum(sizes[:d]) for d in range(len(sizes))]
    G = nx.DiGraph()
    for d, (start, size) in enumerate(zip(starts, sizes)):
        G.add_nodes_from(range(start, start + size), dc=d)
        G.add_edges_from(((i, i) for i in range(start, start + size)), link="intra")
        for u, v in _INTRA_PAIRS[intra](size):
            if u != v:
                G.add_edge(start + u, start + v, link="intra")
                G.add_edge(start + v, start + u, link="intra")

    groups: list[list[int]]
    if inter == "gateway":
        groups = [starts]
    elif inter == "matched":
        groups = [[s + k for s, size in zip(starts, sizes) if k < size] for k in range(max(sizes))]
    else:
        groups = [list(G)]
    for group in groups:
        for u in group:
            for v in group:
                if G.nodes[u]["dc"] != G.nodes[v]["dc"]:
                    G.add_edge(u, v, link="inter")
    return _set_metropolis(G)
