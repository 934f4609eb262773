"""The Topology object: a gossip graph (or a cycle of them) with fast per-node lookups."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import networkx as nx
import numpy as np

from .analysis import check_graph, mixing_matrix

__all__ = ["Topology"]


def _check_round(round: Any) -> int:
    if type(round) is int and round >= 0:  # the simulator's hot path: skip the ABC check
        return round
    if isinstance(round, bool) or not isinstance(round, numbers.Integral) or round < 0:
        raise ValueError(f"round must be a non-negative int, got {round!r}")
    return int(round)


class Topology:
    """A gossip topology: one weighted graph, or a cycle of them (time-varying).

    Round ``r`` uses ``graph(r)``, the ``r mod period``-th graph. The per-node
    lookups (:meth:`in_weights`, :meth:`out_weights`, ...) are built once per
    graph of the cycle and are then plain dict copies, cheap enough to call
    for every node on every round.

    Parameters
    ----------
    graphs : networkx.DiGraph or sequence of networkx.DiGraph
        The graph, or the graphs of one period in round order, all on nodes
        ``0..n-1`` and weighted as described in :mod:`topologies.weights`.
        The Topology takes ownership: the graphs are frozen
        (:func:`networkx.freeze`), so pass copies if you want to keep editing.
    spec : str
        Description kept in :attr:`spec`.
    validate : bool
        Run :func:`topologies.analysis.check_graph` on every graph (for a
        time-varying topology, connectivity is required of one period's union).

    Attributes
    ----------
    n : int
        Number of nodes.
    spec : str
        The spec it was built from.
    period : int
        Number of distinct graphs in the cycle, 1 if static.
    time_varying : bool
        ``period > 1``.

    Examples
    --------
    >>> from topologies import ring
    >>> t = Topology(ring(4), spec="ring")
    >>> t.in_weights(0)
    {0: 0.33333333333333337, 1: 0.3333333333333333, 3: 0.3333333333333333}
    """

    def __init__(self, graphs: nx.DiGraph | Sequence[nx.DiGraph], *, spec: str = "custom", validate: bool = True):
        graphs = [graphs] if isinstance(graphs, nx.Graph) else list(graphs)
        if not graphs:
            raise ValueError("graphs: need at least one graph")
        for r, G in enumerate(graphs):
            if not isinstance(G, nx.DiGraph) or G.is_multigraph():
                raise ValueError(f"graphs[{r}]: expected a networkx.DiGraph, got {type(G).__name__}")
            if set(G) != set(graphs[0]):
                raise ValueError(f"graphs[{r}] has different nodes from graphs[0]")
        if validate:
            static = len(graphs) == 1
            for r, G in enumerate(graphs):
                try:
                    check_graph(G, require_connected=static)
                except ValueError as e:
                    raise ValueError(str(e) if static else f"round {r}: {e}") from None
            if not static:
                union = nx.DiGraph()
                for G in graphs:
                    union.add_edges_from(G.edges(data=True))
                try:
                    check_graph(union, tol=float("inf"))  # only connectivity is meaningful here
                except ValueError as e:
                    raise ValueError(f"union of one period: {e}") from None

        self.n: int = len(graphs[0])
        self.spec: str = spec
        self.period: int = len(graphs)
        self.time_varying: bool = self.period > 1
        self._graphs = [nx.freeze(G) for G in graphs]
        self._dc = tuple(int(graphs[0].nodes[i].get("dc", 0)) for i in range(self.n))
        self._links: dict[tuple[int, int], str] = {}
        for G in graphs:
            for u, v, link in G.edges(data="link"):
                if link is not None:
                    self._links.setdefault((u, v), link)
        # Per graph of the cycle, filled on first use: [in, out] lists of per-node dicts.
        self._tables: list[tuple[list[dict[int, float]], list[dict[int, float]]] | None] = [None] * self.period
        self._push_sum: list[list[dict[int, float]] | None] = [None] * self.period

    def __repr__(self) -> str:
        return f"Topology({self.spec!r}, n={self.n}, period={self.period})"

    def _index(self, round: int) -> int:
        return _check_round(round) % self.period

    def _check_node(self, node: int) -> None:
        if type(node) is int and 0 <= node < self.n:  # the simulator's hot path: skip the ABC check
            return
        if isinstance(node, bool) or not isinstance(node, numbers.Integral) or not 0 <= node < self.n:
            raise ValueError(f"node must be an int in 0..{self.n - 1}, got {node!r}")

    def _table(self, round: int) -> tuple[list[dict[int, float]], list[dict[int, float]]]:
        idx = self._index(round)
        table = self._tables[idx]
        if table is None:
            ins: list[dict[int, float]] = [{} for _ in range(self.n)]
            outs: list[dict[int, float]] = [{} for _ in range(self.n)]
            for u, v, w in self._graphs[idx].edges(data="weight"):
                ins[v][u] = w
                outs[u][v] = w
            table = self._tables[idx] = (ins, outs)
        return table

    def graph(self, round: int = 0) -> nx.DiGraph:
        """Return the weighted graph used at ``round``.

        Static topologies return the same object for every round. The graph
        is shared and frozen: do not mutate it (copy it with ``nx.DiGraph(G)``).
        """
        return self._graphs[self._index(round)]

    def mixing_matrix(self, round: int = 0) -> np.ndarray:
        """Return a fresh copy of ``W`` at ``round`` (rows and columns in node order)."""
        return mixing_matrix(self.graph(round), range(self.n))

    def in_weights(self, node: int, round: int = 0) -> dict[int, float]:
        """Return ``{sender: W[node, sender]}`` at ``round``, self included (a fresh dict)."""
        self._check_node(node)
        return dict(self._table(round)[0][node])

    def out_weights(self, node: int, round: int = 0) -> dict[int, float]:
        """Return ``{receiver: W[receiver, node]}`` at ``round``, self included (a fresh dict)."""
        self._check_node(node)
        return dict(self._table(round)[1][node])

    def in_neighbors(self, node: int, round: int = 0) -> list[int]:
        """Return the nodes that send to ``node`` at ``round``, self excluded."""
        self._check_node(node)
        return [u for u in self._table(round)[0][node] if u != node]

    def out_neighbors(self, node: int, round: int = 0) -> list[int]:
        """Return the nodes ``node`` sends to at ``round``, self excluded."""
        self._check_node(node)
        return [v for v in self._table(round)[1][node] if v != node]

    def push_sum_out_weights(self, node: int, round: int = 0) -> dict[int, float]:
        """Return ``{receiver: share}`` for push-sum at ``round``, self included.

        Column-stochastic shares from :func:`topologies.weights.push_sum_weights`:
        ``1 / (out_degree + 1)`` to each out-neighbour and to self, summing to 1.
        """
        self._check_node(node)
        idx = self._index(round)
        table = self._push_sum[idx]
        if table is None:
            # Same shares as push_sum_weights(graph), without copying the graph.
            table = [dict.fromkeys(outs, 1.0 / len(outs)) for outs in self._table(round)[1]]
            self._push_sum[idx] = table
        return dict(table[node])

    def dc(self, node: int) -> int:
        """Return the datacenter index of ``node`` (0 unless hierarchical)."""
        self._check_node(node)
        return self._dc[node]

    def link(self, u: int, v: int) -> str:
        """Return the link class of ``u -> v``: ``"intra"`` or ``"inter"``.

        The edge's ``link`` attribute in any round's graph; for a pair that is
        never an edge, ``"intra"`` when both nodes share a datacenter.
        """
        self._check_node(u)
        self._check_node(v)
        link = self._links.get((u, v))
        if link is None:
            link = "intra" if self._dc[u] == self._dc[v] else "inter"
        return link


def restrict_links(topology: Topology, link: str) -> Topology:
    """The topology's graphs keeping only edges of link class ``link`` ("intra"
    or "inter"); each node's self weight takes the weight of the edges removed.

    Used for link policies: mixing over intra-datacenter links on one schedule
    and over inter-datacenter links on another. Each restricted matrix stays
    row-stochastic (and doubly stochastic when the original was symmetric).
    The result is generally not connected, so it is not checked for that.

    Examples
    --------
    >>> from topologies import build
    >>> t = build("hierarchical:2,2", 4)
    >>> sorted(restrict_links(t, "inter").in_weights(0))
    [0, 2]
    """
    if link not in ("intra", "inter"):
        raise ValueError(f"link must be 'intra' or 'inter', got {link!r}")
    graphs = []
    for r in range(topology.period):
        G = topology.graph(r)
        H = nx.DiGraph()
        H.add_nodes_from(G.nodes(data=True))
        incoming = dict.fromkeys(G.nodes, 0.0)
        for u, v, data in G.edges(data=True):
            if u != v and data.get("link", "intra") == link:
                H.add_edge(u, v, **data)
                incoming[v] += data["weight"]
        for v in G.nodes:
            H.add_edge(v, v, weight=1.0 - incoming[v], link="intra")
        graphs.append(H)
    return Topology(graphs, spec=f"{topology.spec}[{link}]", validate=False)
