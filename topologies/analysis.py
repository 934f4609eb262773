"""Analysis of gossip graphs: mixing matrices, spectral gap, sanity checks.

The mixing matrix of a weighted graph has ``W[v, u] = G[u][v]["weight"]``
(edge ``u -> v`` carries the coefficient receiver ``v`` applies to sender
``u``), so one synchronous gossip round is ``x <- W @ x``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import networkx as nx
import numpy as np

__all__ = [
    "check_graph",
    "is_column_stochastic",
    "is_doubly_stochastic",
    "is_row_stochastic",
    "is_strongly_connected",
    "mixing_matrix",
    "period_mixing_matrix",
    "spectral_gap",
]


def mixing_matrix(G: nx.DiGraph, nodelist: Iterable | None = None) -> np.ndarray:
    """Return the mixing matrix ``W`` of a weighted graph.

    Parameters
    ----------
    G : networkx.DiGraph
        Graph whose edges carry a ``weight`` attribute.
    nodelist : iterable, optional
        Node order of the rows and columns; default ``sorted(G)``. Edges to
        or from nodes outside ``nodelist`` are ignored.

    Returns
    -------
    numpy.ndarray
        ``W`` with ``W[v, u] = G[u][v]["weight"]`` and zeros elsewhere.

    Examples
    --------
    >>> from topologies import directed_ring
    >>> mixing_matrix(directed_ring(3))
    array([[0.5, 0. , 0.5],
           [0.5, 0.5, 0. ],
           [0. , 0.5, 0.5]])
    """
    nodes = sorted(G) if nodelist is None else list(nodelist)
    index = {node: i for i, node in enumerate(nodes)}
    if len(index) != len(nodes):
        raise ValueError("nodelist: contains duplicate nodes")
    missing = [node for node in nodes if node not in G]
    if missing:
        raise ValueError(f"nodelist: nodes {missing[:5]} are not in the graph")
    W = np.zeros((len(nodes), len(nodes)))
    for u, v, w in G.edges(data="weight"):
        if u in index and v in index:
            if w is None:
                raise ValueError(f"edge ({u}, {v}) has no 'weight' attribute")
            W[index[v], index[u]] = w
    return W


def spectral_gap(W: np.ndarray) -> float:
    """Return ``1 - |lambda_2|``, one minus the second largest eigenvalue modulus.

    For a stochastic mixing matrix the largest modulus is 1 and the gap
    governs how fast repeated gossip contracts towards consensus (larger is
    faster; 1 means exact averaging in one round, 0 means no convergence).
    Works for non-symmetric ``W``. A 1x1 matrix has gap 1 by convention.

    Examples
    --------
    >>> import numpy as np
    >>> round(spectral_gap(np.full((4, 4), 0.25)), 12)
    1.0
    >>> spectral_gap(np.eye(2))
    0.0
    """
    W = np.asarray(W, dtype=float)
    if W.ndim != 2 or W.shape[0] != W.shape[1]:
        raise ValueError(f"W: expected a square matrix, got shape {W.shape}")
    if W.shape[0] == 1:
        return 1.0
    if np.allclose(W, W.T, rtol=0, atol=1e-12):
        moduli = np.abs(np.linalg.eigvalsh(W))
    else:
        moduli = np.abs(np.linalg.eigvals(W))
    moduli = np.sort(moduli)[::-1]
    return float(1.0 - moduli[1])


def _as_matrix(W: np.ndarray) -> np.ndarray:
    W = np.asarray(W, dtype=float)
    if W.ndim != 2:
        raise ValueError(f"W: expected a 2-D matrix, got shape {W.shape}")
    return W


def is_row_stochastic(W: np.ndarray, tol: float = 1e-9) -> bool:
    """Return True if ``W`` is non-negative and every row sums to 1 (within ``tol``).

    Examples
    --------
    >>> is_row_stochastic([[0.5, 0.5], [1.0, 0.0]])
    True
    """
    W = _as_matrix(W)
    return bool(np.all(W >= -tol) and np.all(np.abs(W.sum(axis=1) - 1.0) <= tol))


def is_column_stochastic(W: np.ndarray, tol: float = 1e-9) -> bool:
    """Return True if ``W`` is non-negative and every column sums to 1 (within ``tol``).

    Examples
    --------
    >>> is_column_stochastic([[0.5, 0.5], [1.0, 0.0]])
    False
    """
    return is_row_stochastic(_as_matrix(W).T, tol)


def is_doubly_stochastic(W: np.ndarray, tol: float = 1e-9) -> bool:
    """Return True if ``W`` is both row- and column-stochastic (within ``tol``).

    Examples
    --------
    >>> is_doubly_stochastic([[0.5, 0.5], [0.5, 0.5]])
    True
    """
    return is_row_stochastic(W, tol) and is_column_stochastic(W, tol)


def is_strongly_connected(G: nx.Graph) -> bool:
    """Return True if every node of ``G`` can reach every other node.

    Undirected graphs are tested for connectivity; the empty graph is not
    connected.

    Examples
    --------
    >>> import networkx as nx
    >>> is_strongly_connected(nx.DiGraph([(0, 1), (1, 0)])), is_strongly_connected(nx.DiGraph([(0, 1)]))
    (True, False)
    """
    if len(G) == 0:
        return False
    if G.is_directed():
        return nx.is_strongly_connected(G)
    return nx.is_connected(G)


def _show(nodes: Iterable, limit: int = 5) -> str:
    nodes = sorted(nodes)
    text = ", ".join(str(node) for node in nodes[:limit])
    return f"[{text}, ...]" if len(nodes) > limit else f"[{text}]"


def check_graph(G: nx.DiGraph, *, tol: float = 1e-6, require_connected: bool = True) -> None:
    """Raise ValueError if ``G`` is not a valid gossip graph; return None if it is.

    Checks, in order: nodes are the integers ``0..n-1``; every node has a
    self-loop with a weight; every edge has a finite, non-negative
    ``weight``; the weights into each node sum to 1 (row-stochastic, within
    ``tol``); and, unless ``require_connected`` is False, the edges with
    positive weight form a strongly connected graph. Time-varying topologies
    check each round's graph with ``require_connected=False`` and the union
    of one period for connectivity.

    Examples
    --------
    >>> import networkx as nx
    >>> from topologies import ring
    >>> check_graph(ring(4)) is None
    True
    >>> G = nx.union(ring(2), ring(2), rename=("a", "b"))
    >>> check_graph(nx.convert_node_labels_to_integers(G, ordering="sorted"))
    Traceback (most recent call last):
    ...
    ValueError: graph is not strongly connected: 2 components, e.g. nodes [0, 1] and [2, 3]
    """
    n = len(G)
    if n == 0:
        raise ValueError("graph has no nodes")
    if not G.is_directed():
        raise ValueError("graph must be a networkx.DiGraph (store undirected edges both ways)")
    if set(G) != set(range(n)):
        odd = [node for node in G if not (isinstance(node, int) and 0 <= node < n)]
        raise ValueError(
            f"nodes must be the integers 0..{n - 1}; found {odd[:5]} "
            f"(use from_networkx to relabel)"
        )
    for i in range(n):
        if G.get_edge_data(i, i, default={}).get("weight") is None:
            raise ValueError(f"node {i} has no self-loop weight")
    for u, v, w in G.edges(data="weight"):
        if w is None:
            raise ValueError(f"edge ({u}, {v}) has no 'weight' attribute")
        if not isinstance(w, (int, float, np.floating, np.integer)) or not math.isfinite(w):
            raise ValueError(f"non-finite or non-numeric weight on edge ({u}, {v}): {w!r}")
        if w < -tol:
            raise ValueError(f"negative weight on edge ({u}, {v}): {w}")
    for v in range(n):
        total = sum(data["weight"] for data in G.pred[v].values())
        if abs(total - 1.0) > tol:
            raise ValueError(
                f"weights into node {v} sum to {total:.12g}, not 1 "
                f"(each node's in-weights, self included, must be row-stochastic)"
            )
    if require_connected:
        H = G
        if any(w <= 0 for _, _, w in G.edges(data="weight")):  # a zero weight carries nothing
            H = nx.DiGraph()
            H.add_nodes_from(range(n))
            H.add_edges_from((u, v) for u, v, w in G.edges(data="weight") if w > 0)
        if not nx.is_strongly_connected(H):
            comps = sorted((sorted(c) for c in nx.strongly_connected_components(H)), key=min)
            raise ValueError(
                f"graph is not strongly connected: {len(comps)} components, "
                f"e.g. nodes {_show(comps[0])} and {_show(comps[1])}"
            )


def period_mixing_matrix(topology: Any, rounds: int | None = None) -> np.ndarray:
    """Return ``W(rounds-1) @ ... @ W(1) @ W(0)``, the effect of several rounds.

    Parameters
    ----------
    topology : Topology
        Anything with ``n``, ``period`` and ``graph(round)`` (a
        :class:`topologies.Topology`).
    rounds : int, optional
        Number of rounds; default one period (``topology.period``).

    Examples
    --------
    >>> import numpy as np
    >>> from topologies import build
    >>> P = period_mixing_matrix(build("one-peer-exponential", 8))
    >>> bool(np.allclose(P, np.full((8, 8), 1 / 8)))
    True
    """
    if rounds is None:
        rounds = topology.period
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds: expected a non-negative int, got {rounds!r}")
    nodes = range(topology.n)
    cache: dict[int, np.ndarray] = {}
    P = np.eye(topology.n)
    for r in range(rounds):
        key = r % topology.period
        if key not in cache:
            cache[key] = mixing_matrix(topology.graph(r), nodes)
        P = cache[key] @ P
    return P
