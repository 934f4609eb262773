"""Gossip graphs from other sources: any networkx graph, edge-list and JSON files.

File formats read by :func:`from_file`:

* Edge list (any suffix but ``.json``): one edge per line, ``u v`` or
  ``u v w`` with integer nodes and ``w`` the mixing weight ``W[v, u]``; a line
  with a single ``u`` declares a node; ``#`` starts a comment. The graph is
  undirected unless a comment line ``# directed`` comes before the first edge.
* JSON (suffix ``.json``): networkx node-link data
  (:func:`networkx.readwrite.json_graph.node_link_data`, ``"edges"`` or
  ``"links"`` key), or the short form
  ``{"directed": false, "edges": [[u, v], [u, v, w], ...]}``.

:func:`to_file` writes node-link JSON (or an edge list when the suffix is not
``.json``) that :func:`from_file` reads back unchanged.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import networkx as nx

from .weights import apply_weights, is_symmetric

__all__ = ["FROM_NETWORKX_WEIGHTS", "from_file", "from_networkx", "to_file"]

FROM_NETWORKX_WEIGHTS = ("auto", "given", "metropolis", "uniform", "max-degree")
"""Valid ``weights`` choices of :func:`from_networkx` and :func:`from_file`."""

_ROW_TOL = 1e-6  # hand-written weights such as 0.333333 are accepted


def _sorted_nodes(G: nx.Graph) -> list:
    try:
        return sorted(G)
    except TypeError:  # mixed label types: any fixed order shared by all nodes will do
        return sorted(G, key=lambda node: (type(node).__name__, repr(node)))


def from_networkx(G: nx.Graph, *, weights: str = "auto") -> nx.DiGraph:
    """Return a gossip graph made from any networkx graph.

    Nodes are relabelled ``0..n-1`` in sorted order, each keeping its
    original label in the node attribute ``label`` (other attributes are kept).
    An undirected graph becomes a symmetric DiGraph. A node attribute ``dc``
    is kept (default 0); an edge's ``link`` is kept if present, otherwise
    ``"intra"`` when both ends share a ``dc`` and ``"inter"`` when not.
    Missing self-loops are added.

    Parameters
    ----------
    G : networkx.Graph or networkx.DiGraph
        Not a multigraph; at least one node.
    weights : {"auto", "given", "metropolis", "uniform", "max-degree"}
        ``"auto"``: Metropolis-Hastings if the graph is symmetric, else uniform
        (a ``weight`` attribute on ``G`` is ignored, since networkx graphs often
        use it for distances). ``"given"``: use ``G``'s ``weight`` attributes as
        mixing weights ``W[v, u]`` on edge ``u -> v``; a missing self-loop takes
        the rest of its row; the weights into every node must then sum to 1.

    Examples
    --------
    >>> import networkx as nx
    >>> H = from_networkx(nx.path_graph(["a", "b", "c"]))
    >>> H.nodes[2]["label"], H[0][1]["weight"]
    ('c', 0.3333333333333333)
    """
    if not isinstance(G, nx.Graph):
        raise ValueError(f"G must be a networkx graph, got {type(G).__name__}")
    if G.is_multigraph():
        raise ValueError("G: multigraphs are not supported; convert with nx.DiGraph(G) first")
    if len(G) == 0:
        raise ValueError("G has no nodes")
    if weights not in FROM_NETWORKX_WEIGHTS:
        raise ValueError(f"weights: unknown choice {weights!r}; valid: {', '.join(FROM_NETWORKX_WEIGHTS)}")

    order = _sorted_nodes(G)
    index = {node: i for i, node in enumerate(order)}
    H = nx.DiGraph()
    for node in order:
        attrs = dict(G.nodes[node])
        attrs["label"] = node
        try:
            attrs["dc"] = int(attrs.get("dc", 0))
        except (TypeError, ValueError):
            raise ValueError(f"node {node!r}: attribute dc must be an int, got {attrs['dc']!r}") from None
        H.add_node(index[node], **attrs)
    edges = G.edges(data=True)
    if not G.is_directed():
        edges = [e for u, v, d in edges for e in ((u, v, d), (v, u, d))]
    for u, v, data in edges:
        a, b = index[u], index[v]
        attrs = dict(data)
        link = attrs.get("link")
        if link is None:
            attrs["link"] = "intra" if H.nodes[a]["dc"] == H.nodes[b]["dc"] else "inter"
        elif link not in ("intra", "inter"):
            raise ValueError(f"edge ({u!r}, {v!r}): link must be 'intra' or 'inter', got {link!r}")
        H.add_edge(a, b, **attrs)

    if weights == "given":
        return _given_weights(H)
    for i in H:
        if not H.has_edge(i, i):
            H.add_edge(i, i, link="intra")
    if weights == "auto":
        weights = "metropolis" if is_symmetric(H) else "uniform"
    return apply_weights(H, weights)


def _given_weights(H: nx.DiGraph) -> nx.DiGraph:
    """Validate the weights already on ``H`` (relabelled), completing self-loops."""
    label = H.nodes
    for u, v, w in H.edges(data="weight"):
        if w is None and u != v:
            raise ValueError(
                f"weights='given' but edge ({label[u]['label']!r}, {label[v]['label']!r}) has no weight"
            )
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)):
            raise ValueError(
                f"edge ({label[u]['label']!r}, {label[v]['label']!r}): weight must be a finite number, got {w!r}"
            )
        if w is not None and w < 0:
            raise ValueError(f"negative weight on edge ({label[u]['label']!r}, {label[v]['label']!r}): {w}")
    for v in H:
        if H.get_edge_data(v, v, default={}).get("weight") is None:
            rest = 1.0 - sum(d["weight"] for u, d in H.pred[v].items() if u != v)
            H.add_edge(v, v, link="intra", weight=rest if abs(rest) > 1e-15 else 0.0)
    for v in H:
        total = sum(d["weight"] for d in H.pred[v].values())
        if abs(total - 1.0) > _ROW_TOL or H[v][v]["weight"] < -_ROW_TOL:
            raise ValueError(
                f"weights='given' but the weights into node {label[v]['label']!r} sum to "
                f"{total:.12g} (self {H[v][v]['weight']:.12g}); they must sum to 1"
            )
    return H


def _parse_weight(text: str, where: str) -> float:
    try:
        w = float(text)
    except ValueError:
        raise ValueError(f"{where}: weight {text!r} is not a number") from None
    if not math.isfinite(w):
        raise ValueError(f"{where}: weight {text!r} is not finite")
    return w


def _read_edge_list(path: str) -> tuple[nx.Graph, bool]:
    """Return the graph in an edge-list file and whether it carried weights."""
    directed = False
    nodes: list[tuple[int, str]] = []
    edges: list[tuple[int, int, float | None, int]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            text, _, comment = raw.partition("#")
            if not text.strip():
                if not edges and comment.strip().lower() in ("directed", "undirected"):
                    directed = comment.strip().lower() == "directed"
                continue
            fields = text.split()
            if len(fields) > 3:
                raise ValueError(f"{where}: expected 'u v' or 'u v w', got {raw.strip()!r}")
            try:
                ends = [int(tok) for tok in fields[:2]]
            except ValueError:
                raise ValueError(f"{where}: nodes must be integers, got {raw.strip()!r}") from None
            if len(ends) == 1:
                nodes.append((ends[0], where))
                continue
            w = _parse_weight(fields[2], where) if len(fields) == 3 else None
            edges.append((ends[0], ends[1], w, lineno))

    G = nx.DiGraph() if directed else nx.Graph()
    G.add_nodes_from(node for node, _ in nodes)
    weighted = [lineno for *_, w, lineno in edges if w is not None]
    seen: dict[tuple[int, int], int] = {}
    for u, v, w, lineno in edges:
        where = f"{path}:{lineno}"
        if weighted and w is None:
            raise ValueError(f"{where}: edge {u} {v} has no weight but line {weighted[0]} has one; give all or none")
        key = (u, v) if directed else (min(u, v), max(u, v))
        if key in seen:
            raise ValueError(f"{where}: duplicate edge {u} {v} (first on line {seen[key]})")
        seen[key] = lineno
        if w is None:
            G.add_edge(u, v)
        else:
            G.add_edge(u, v, weight=w)
    if len(G) == 0:
        raise ValueError(f"{path}: no edges or nodes found")
    return G, bool(weighted)


def _read_json(path: str) -> tuple[nx.Graph, bool]:
    """Return the graph in a JSON file and whether it carried weights."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object with 'edges', got {type(data).__name__}")
    key = "edges" if "edges" in data else "links" if "links" in data else None
    if key is None:
        raise ValueError(f"{path}: JSON object has no 'edges' (or node-link 'links') list")
    edges, node_list = data[key], data.get("nodes", [])
    if not isinstance(edges, list) or not isinstance(node_list, list):
        raise ValueError(f"{path}: 'nodes' and '{key}' must be lists")
    directed = data.get("directed", False)
    if not isinstance(directed, bool):
        raise ValueError(f"{path}: 'directed' must be true or false, got {directed!r}")
    if data.get("multigraph"):
        raise ValueError(f"{path}: multigraphs are not supported")
    G = nx.DiGraph() if directed else nx.Graph()

    def node_id(value: Any, where: str) -> Any:
        if isinstance(value, list):  # JSON turned a tuple label into a list
            value = tuple(value)
        if isinstance(value, (dict, float)) or value is None:
            raise ValueError(f"{path}: {where}: node id must be an int or string, got {value!r}")
        return value

    for i, item in enumerate(node_list):
        if isinstance(item, dict):
            if "id" not in item:
                raise ValueError(f"{path}: nodes[{i}] has no 'id'")
            attrs = {k: v for k, v in item.items() if k != "id"}
            G.add_node(node_id(item["id"], f"nodes[{i}]"), **attrs)
        else:
            G.add_node(node_id(item, f"nodes[{i}]"))
    weighted = False
    for i, item in enumerate(edges):
        where = f"{key}[{i}]"
        if isinstance(item, dict):
            if "source" not in item or "target" not in item:
                raise ValueError(f"{path}: {where} needs 'source' and 'target'")
            u, v = node_id(item["source"], where), node_id(item["target"], where)
            attrs = {k: val for k, val in item.items() if k not in ("source", "target", "key")}
        elif isinstance(item, list) and len(item) in (2, 3):
            u, v = node_id(item[0], where), node_id(item[1], where)
            attrs = {} if len(item) == 2 else {"weight": item[2]}
        else:
            raise ValueError(f"{path}: {where} must be [u, v], [u, v, w] or a node-link object, got {item!r}")
        if "weight" in attrs:
            w = attrs["weight"]
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
                raise ValueError(f"{path}: {where}: weight must be a finite number, got {w!r}")
            weighted = True
        if G.has_edge(u, v):
            raise ValueError(f"{path}: {where}: duplicate edge ({u!r}, {v!r})")
        G.add_edge(u, v, **attrs)
    if len(G) == 0:
        raise ValueError(f"{path}: no edges or nodes found")
    return G, weighted


def from_file(path: str | os.PathLike, *, weights: str = "auto") -> nx.DiGraph:
    """Return the gossip graph stored in an edge-list or JSON file.

    See the module docstring for the formats. The result goes through
    :func:`from_networkx`, so nodes are relabelled ``0..n-1`` in sorted order.

    Parameters
    ----------
    path : str or path-like
        ``*.json`` is read as JSON, anything else as an edge list.
    weights : {"auto", "given", "metropolis", "uniform", "max-degree"}
        ``"auto"`` uses the file's weights when it has any (all edges must
        then have one) and otherwise Metropolis-Hastings (symmetric graphs) or
        uniform weights (directed graphs).

    Raises
    ------
    ValueError
        On a malformed file; the message names the file and, for edge lists,
        the line.

    Examples
    --------
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "g.txt")
    >>> _ = open(path, "w").write("# directed\\n0 1\\n1 2\\n2 0\\n")
    >>> from_file(path)[0][1]["weight"]
    0.5
    """
    path = os.fspath(path)
    if weights not in FROM_NETWORKX_WEIGHTS:
        raise ValueError(f"weights: unknown choice {weights!r}; valid: {', '.join(FROM_NETWORKX_WEIGHTS)}")
    if Path(path).suffix.lower() == ".json":
        G, weighted = _read_json(path)
    else:
        G, weighted = _read_edge_list(path)
    if weights == "auto" and weighted:
        weights = "given"
    try:
        return from_networkx(G, weights=weights)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def to_file(G: nx.DiGraph, path: str | os.PathLike) -> None:
    """Write a gossip graph to ``path`` so that :func:`from_file` reads it back.

    A ``.json`` suffix (or any suffix but ``.txt``, ``.edges``, ``.edgelist``)
    writes node-link JSON keeping every node and edge attribute (``dc``,
    ``link``, ``weight``); those three suffixes write a ``# directed`` edge
    list ``u v w`` (weights only).

    Examples
    --------
    >>> import tempfile, os
    >>> from topologies import ring
    >>> path = os.path.join(tempfile.mkdtemp(), "ring.json")
    >>> to_file(ring(4), path)
    >>> from_file(path)[0][1]["weight"]
    0.3333333333333333
    """
    path = os.fspath(path)
    if Path(path).suffix.lower() in (".txt", ".edges", ".edgelist"):
        with open(path, "w", encoding="utf-8") as f:
            f.write("# directed\n# u v w: u sends to v, W[v, u] = w\n")
            for u in G:
                f.write(f"{u}\n")
            for u, v, w in G.edges(data="weight"):
                f.write(f"{u} {v}\n" if w is None else f"{u} {v} {float(w)!r}\n")
        return
    data = {
        "directed": G.is_directed(),
        "multigraph": False,
        "graph": {},
        "nodes": [{"id": node, **attrs} for node, attrs in G.nodes(data=True)],
        "edges": [{"source": u, "target": v, **attrs} for u, v, attrs in G.edges(data=True)],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")

