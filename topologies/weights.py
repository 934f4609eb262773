"""Mixing-weight rules: turn a gossip graph into a weighted one.

Conventions shared by the whole package: edge ``(u, v)`` means "u sends to v"
and its ``weight`` attribute is ``W[v, u]``, the coefficient node ``v`` applies
to ``u``'s value in ``x_v <- sum_u W[v, u] x_u``. Every node carries a
self-loop ``(i, i)`` whose weight is ``W[i, i]``.

Each rule returns a new :class:`networkx.DiGraph` (an undirected input is
first turned into a symmetric directed graph); the input is never mutated.
Missing self-loops are added (with ``link="intra"``). Degrees never count
self-loops.

==============  ======================================  =========================
rule            weights                                 stochastic
==============  ======================================  =========================
``metropolis``  ``1/(1+max(d_u, d_v))``, rest to self   doubly (symmetric graphs)
``uniform``     ``1/(in_deg(v)+1)`` from each sender    rows; doubly if regular
``max-degree``  ``1/(max_deg+1)``, rest to self         rows; doubly if symmetric
``push-sum``    ``1/(out_deg(u)+1)`` from each sender   columns
==============  ======================================  =========================
"""

from __future__ import annotations

from collections.abc import Callable

import networkx as nx

__all__ = [
    "WEIGHT_RULES",
    "apply_weights",
    "is_symmetric",
    "max_degree_weights",
    "metropolis_hastings_weights",
    "push_sum_weights",
    "uniform_weights",
]


def _directed_copy(G: nx.Graph) -> nx.DiGraph:
    """Return a directed copy of ``G`` with a self-loop on every node."""
    if G.is_multigraph():
        raise ValueError("G: multigraphs are not supported; convert with nx.DiGraph(G) first")
    H = G.to_directed() if not G.is_directed() else nx.DiGraph(G)
    for i in H:
        if not H.has_edge(i, i):
            H.add_edge(i, i, link="intra")
    return H


def is_symmetric(G: nx.Graph) -> bool:
    """Return True if every edge of ``G`` also exists in the reverse direction.

    Undirected graphs are always symmetric.

    Examples
    --------
    >>> import networkx as nx
    >>> is_symmetric(nx.DiGraph([(0, 1), (1, 0)])), is_symmetric(nx.DiGraph([(0, 1)]))
    (True, False)
    """
    if not G.is_directed():
        return True
    return _first_asymmetric_edge(G) is None


def _first_asymmetric_edge(G: nx.DiGraph) -> tuple | None:
    for u, v in G.edges():
        if not G.has_edge(v, u):
            return (u, v)
    return None


def _in_degrees(H: nx.DiGraph) -> dict:
    # Every node of H has a self-loop (see _directed_copy), so subtract it.
    return {v: len(H.pred[v]) - 1 for v in H}


def metropolis_hastings_weights(G: nx.Graph) -> nx.DiGraph:
    """Return a copy of ``G`` with Metropolis-Hastings mixing weights.

    ``w_uv = 1 / (1 + max(d_u, d_v))`` for neighbours ``u != v`` (degrees
    exclude self-loops) and the self weight is ``1 - sum`` of the others. The
    matrix is symmetric and doubly stochastic on any graph.

    Parameters
    ----------
    G : networkx.Graph or networkx.DiGraph
        Undirected graph, or directed graph with every edge in both directions.

    Returns
    -------
    networkx.DiGraph
        A new graph; ``G`` is not modified.

    Raises
    ------
    ValueError
        If ``G`` is directed and some edge has no reverse.

    Examples
    --------
    >>> import networkx as nx
    >>> H = metropolis_hastings_weights(nx.path_graph(3))
    >>> H[0][1]["weight"], H[0][0]["weight"], H[1][1]["weight"]
    (0.3333333333333333, 0.6666666666666667, 0.33333333333333337)
    """
    return _set_metropolis(_directed_copy(G))


def _set_metropolis(H: nx.DiGraph) -> nx.DiGraph:
    """Metropolis-Hastings weights in place on a DiGraph whose nodes all have self-loops."""
    bad = _first_asymmetric_edge(H)
    if bad is not None:
        u, v = bad
        raise ValueError(
            f"G: metropolis weights need a symmetric graph (every edge in both "
            f"directions); edge ({u}, {v}) has no reverse ({v}, {u}). "
            f"Use 'uniform' or 'push-sum' weights for directed graphs"
        )
    deg = _in_degrees(H)
    for v in H:
        total = 0.0
        for u, data in H.pred[v].items():
            if u != v:
                w = 1.0 / (1 + max(deg[u], deg[v]))
                data["weight"] = w
                total += w
        H[v][v]["weight"] = 1.0 - total
    return H


def uniform_weights(G: nx.Graph) -> nx.DiGraph:
    """Return a copy of ``G`` where each receiver averages its inputs equally.

    Receiver ``v`` gives ``1 / (in_deg(v) + 1)`` to each in-neighbour and to
    itself. The result is row-stochastic; it is doubly stochastic when every
    node has the same in-degree and out-degree ``d`` (regular graphs such as
    rings, tori and exponential graphs), but not in general (e.g. a star).

    Examples
    --------
    >>> import networkx as nx
    >>> H = uniform_weights(nx.DiGraph([(0, 1), (1, 2), (2, 0)]))
    >>> H[0][1]["weight"], H[1][1]["weight"]
    (0.5, 0.5)
    """
    return _set_uniform(_directed_copy(G))


def _set_uniform(H: nx.DiGraph) -> nx.DiGraph:
    """Uniform weights in place on a DiGraph whose nodes all have self-loops."""
    for v in H:
        share = 1.0 / len(H.pred[v])  # in-neighbours plus the self-loop
        for data in H.pred[v].values():
            data["weight"] = share
    return H


def max_degree_weights(G: nx.Graph) -> nx.DiGraph:
    """Return a copy of ``G`` with maximum-degree weights.

    Every edge ``u -> v`` (``u != v``) gets ``1 / (D + 1)`` where ``D`` is the
    largest in-degree in the graph; the remainder goes to the self-loop. The
    result is row-stochastic, symmetric and doubly stochastic on any undirected
    (symmetric) graph, and needs only the global maximum degree.

    Examples
    --------
    >>> import networkx as nx
    >>> H = max_degree_weights(nx.star_graph(3))
    >>> H[0][1]["weight"], H[0][0]["weight"], H[1][1]["weight"]
    (0.25, 0.25, 0.75)
    """
    H = _directed_copy(G)
    deg = _in_degrees(H)
    share = 1.0 / (max(deg.values(), default=0) + 1)
    for v in H:
        for u, data in H.pred[v].items():
            if u != v:
                data["weight"] = share
        H[v][v]["weight"] = 1.0 - deg[v] * share
    return H


def push_sum_weights(G: nx.Graph) -> nx.DiGraph:
    """Return a copy of ``G`` with column-stochastic push-sum shares.

    Sender ``u`` keeps ``1 / (out_deg(u) + 1)`` of its value and mass and sends
    the same share to each out-neighbour, so the weights on ``u``'s out-edges
    (column ``u`` of ``W``) sum to one. Works on any directed graph.

    Examples
    --------
    >>> import networkx as nx
    >>> H = push_sum_weights(nx.DiGraph([(0, 1), (0, 2), (1, 0), (2, 0)]))
    >>> H[0][1]["weight"], H[0][0]["weight"], H[1][0]["weight"]
    (0.3333333333333333, 0.3333333333333333, 0.5)
    """
    H = _directed_copy(G)
    for u in H:
        share = 1.0 / len(H.succ[u])  # out-neighbours plus the self-loop
        for data in H.succ[u].values():
            data["weight"] = share
    return H


WEIGHT_RULES: dict[str, Callable[[nx.Graph], nx.DiGraph]] = {
    "metropolis": metropolis_hastings_weights,
    "uniform": uniform_weights,
    "max-degree": max_degree_weights,
    "push-sum": push_sum_weights,
}
"""Weight rules by name, as accepted by :func:`apply_weights`."""


def apply_weights(G: nx.Graph, rule: str) -> nx.DiGraph:
    """Return a copy of ``G`` weighted by the rule named ``rule``.

    Parameters
    ----------
    G : networkx.Graph or networkx.DiGraph
    rule : {"metropolis", "uniform", "max-degree", "push-sum"}

    Examples
    --------
    >>> import networkx as nx
    >>> apply_weights(nx.path_graph(2), "uniform")[0][1]["weight"]
    0.5
    """
    try:
        fn = WEIGHT_RULES[rule]
    except (KeyError, TypeError):
        raise ValueError(
            f"rule: unknown weight rule {rule!r}; valid: {', '.join(WEIGHT_RULES)}"
        ) from None
    return fn(G)
