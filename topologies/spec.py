"""Topologies by name: the spec strings of the command line.

A spec is ``name[:args]`` where ``args`` are comma-separated, each positional
or ``key=value``; see :func:`build` for the names. Every spec accepts
``weights=metropolis|uniform|max-degree`` to override the default weights.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import networkx as nx

from .builders import (
    complete,
    directed_ring,
    exponential,
    hierarchical,
    one_peer_exponential,
    random_regular,
    ring,
    small_world,
    star,
    torus,
)
from .convert import from_file, from_networkx
from .topology import Topology
from .weights import apply_weights

__all__ = ["SPEC_NAMES", "SPEC_WEIGHTS", "Topology", "build"]

SPEC_WEIGHTS = ("metropolis", "uniform", "max-degree")
"""Valid values of the ``weights=`` option (``file:`` also takes ``given``)."""

_Args = tuple[list[str], dict[str, str]]


def _convert(name: str, key: str, text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{name}: {key} must be {'an int' if kind is int else 'a number'}, got {text!r}") from None


def _bind(name: str, args: _Args, params: dict[str, tuple[type, Any]]) -> dict[str, Any]:
    """Bind positional and ``key=value`` args to ``params`` (name -> (type, default)).

    ``seed`` is keyword-only; the other parameters may be given in order.
    """
    positional, options = args
    in_order = [key for key in params if key != "seed"]
    if len(positional) > len(in_order):
        allowed = f"at most {len(in_order)} ({', '.join(in_order)})" if in_order else "no"
        raise ValueError(f"{name} takes {allowed} positional arguments, got {','.join(positional)!r}")
    texts = dict(zip(in_order, positional))
    for key, text in options.items():
        if key not in params:
            raise ValueError(f"{name}: unknown option {key!r}; valid: {', '.join([*params, 'weights'])}")
        if key in texts:
            raise ValueError(f"{name}: {key} given twice")
        texts[key] = text
    return {
        key: _convert(name, key, texts[key], kind) if key in texts else default
        for key, (kind, default) in params.items()
    }


def _torus(args: _Args, n: int, seed: int) -> list[nx.DiGraph]:
    shape = _bind("torus", args, {"shape": (str, None)})["shape"]
    if shape is None:
        rows = max((r for r in range(2, int(n**0.5) + 1) if n % r == 0), default=None)
        if rows is None:
            raise ValueError(
                f"torus needs n = rows x cols with both >= 2, and n={n} has no such factorization; "
                f"give the shape (torus:1x{n}) or use ring"
            )
        return [torus(rows, n // rows)]
    parts = shape.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"torus: shape must be ROWSxCOLS like 4x4, got {shape!r}")
    rows, cols = (int(p) for p in parts)
    if rows * cols != n:
        raise ValueError(f"torus:{shape} needs {rows * cols} nodes, got {n}")
    return [torus(rows, cols)]


def _random_regular(args: _Args, n: int, seed: int) -> list[nx.DiGraph]:
    kw = _bind("random-regular", args, {"degree": (int, 3), "seed": (int, seed)})
    return [random_regular(n, kw["degree"], seed=kw["seed"])]


def _small_world(args: _Args, n: int, seed: int) -> list[nx.DiGraph]:
    kw = _bind("small-world", args, {"k": (int, 4), "p": (float, 0.1), "seed": (int, seed)})
    return [small_world(n, kw["k"], kw["p"], seed=kw["seed"])]


def _hierarchical(args: _Args, n: int, seed: int) -> list[nx.DiGraph]:
    positional, options = args
    kw = _bind("hierarchical", ([], options), {"intra": (str, "complete"), "inter": (str, "gateway")})
    if not positional:
        raise ValueError("hierarchical needs the datacenter sizes, e.g. hierarchical:8,8")
    sizes = [_convert("hierarchical", "each size", text, int) for text in positional]
    if sum(sizes) != n:
        raise ValueError(f"hierarchical:{','.join(positional)} has {sum(sizes)} nodes (sum of sizes), but n={n}")
    return [hierarchical(sizes, intra=kw["intra"], inter=kw["inter"])]


def _one_peer(args: _Args, n: int, seed: int) -> list[nx.DiGraph]:
    _bind("one-peer-exponential", args, {})
    period = max(1, (n - 1).bit_length())
    return [one_peer_exponential(n, r) for r in range(period)]


def _plain(name: str, builder: Callable[[int], nx.DiGraph]) -> Callable[[_Args, int, int], list[nx.DiGraph]]:
    def make(args: _Args, n: int, seed: int) -> list[nx.DiGraph]:
        _bind(name, args, {})
        return [builder(n)]

    return make


_BUILDERS: dict[str, Callable[[_Args, int, int], list[nx.DiGraph]]] = {
    "ring": _plain("ring", ring),
    "directed-ring": _plain("directed-ring", directed_ring),
    "torus": _torus,
    "complete": _plain("complete", complete),
    "star": _plain("star", star),
    "exponential": _plain("exponential", exponential),
    "one-peer-exponential": _one_peer,
    "random-regular": _random_regular,
    "small-world": _small_world,
    "hierarchical": _hierarchical,
}
SPEC_NAMES = (*_BUILDERS, "file")  # file: is parsed apart, since a path may contain commas
"""Topology names accepted by :func:`build`."""


def _split_args(name: str, rest: str) -> _Args:
    positional: list[str] = []
    options: dict[str, str] = {}
    if not rest.strip():
        return positional, options
    for item in rest.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"{name}: empty argument in {rest!r}")
        key, eq, value = item.partition("=")
        if eq:
            key = key.strip().lower()
            if key in options:
                raise ValueError(f"{name}: option {key!r} given twice")
            options[key] = value.strip()
        elif options:
            raise ValueError(f"{name}: positional argument {item!r} after a key=value option")
        else:
            positional.append(item)
    return positional, options


def _split_file_args(rest: str) -> tuple[str, dict[str, str]]:
    # Only a trailing ",weights=..." is an option; everything before it is the path.
    path, options = rest, {}
    head, comma, tail = rest.rpartition(",")
    key, eq, value = tail.partition("=")
    if comma and eq and key.strip().lower() == "weights":
        path, options = head, {"weights": value.strip()}
    if not path.strip():
        raise ValueError("file needs a path, e.g. file:cluster.txt")
    return path.strip(), options


def build(spec: str | nx.Graph | Topology, n: int, *, seed: int = 0) -> Topology:
    """Return the topology described by ``spec`` on ``n`` nodes.

    Specs (``name[:args]``, args comma-separated, positional or ``key=value``):

    ==========================================  ==============================================
    ``ring``, ``directed-ring``                 cycle, both directions / one direction
    ``torus``, ``torus:4x4``                    2-D periodic grid; alone: most square RxC, R, C >= 2
    ``complete``                                all-reduce baseline (exact average)
    ``star``                                    node 0 is the hub (parameter-server-like)
    ``exponential``                             i -> i + 2^k, static
    ``one-peer-exponential``                    i -> i + 2^(r mod log2 n), time-varying
    ``random-regular[:D][,seed=S]``             connected random D-regular (default D=3)
    ``small-world[:K,P][,seed=S]``              connected Watts-Strogatz (default K=4, P=0.1)
    ``hierarchical:8,8[,intra=..][,inter=..]``  datacenters of the given sizes
    ``file:PATH``                               edge list or JSON, see :func:`from_file`
    ==========================================  ==============================================

    Every spec takes ``weights=metropolis|uniform|max-degree`` (``file:`` also
    ``given``, its default when the file has weights). ``seed=`` defaults to
    ``seed``. A networkx graph goes through :func:`from_networkx`; a Topology
    is returned as is. The result is checked with
    :func:`topologies.analysis.check_graph`.

    Parameters
    ----------
    spec : str, networkx.Graph or Topology
    n : int
        Number of nodes; must match the spec (torus shape, hierarchical sizes,
        file or graph node count).
    seed : int
        Default seed of the random topologies.

    Raises
    ------
    ValueError
        On an unknown name, bad argument, node-count mismatch or invalid graph,
        with a message naming the problem.

    Examples
    --------
    >>> t = build("hierarchical:4,4,intra=ring", 8)
    >>> t.dc(5), t.link(0, 4), t.period
    (1, 'inter', 1)
    >>> build("one-peer-exponential", 16).period
    4
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be an int, got {seed!r}")
    n, seed = int(n), int(seed)
    if isinstance(spec, Topology):
        if spec.n != n:
            raise ValueError(f"topology {spec.spec!r} has {spec.n} nodes, but n={n}")
        return spec
    if isinstance(spec, nx.Graph):
        if len(spec) != n:
            raise ValueError(f"the networkx graph has {len(spec)} nodes, but n={n}")
        return Topology(from_networkx(spec), spec=f"networkx:{type(spec).__name__}")
    if not isinstance(spec, str):
        raise ValueError(f"spec must be a string, networkx graph or Topology, got {type(spec).__name__}")

    text = spec.strip()
    head, _, rest = text.partition(":")
    name = head.strip().lower().replace("_", "-")
    if name not in SPEC_NAMES:
        raise ValueError(f"unknown topology {head.strip()!r}; valid: {', '.join(SPEC_NAMES)}")

    if name == "file":
        path, options = _split_file_args(rest)
        weights = options.get("weights", "auto")
        if weights not in (*SPEC_WEIGHTS, "given", "auto"):
            raise ValueError(f"weights: unknown choice {weights!r}; valid: {', '.join([*SPEC_WEIGHTS, 'given'])}")
        G = from_file(path, weights=weights)
        if len(G) != n:
            raise ValueError(f"file:{path} has {len(G)} nodes, but n={n}")
        graphs = [G]
    else:
        positional, options = _split_args(name, rest)
        weights = options.pop("weights", None)
        if weights is not None and weights not in SPEC_WEIGHTS:
            raise ValueError(f"weights: unknown choice {weights!r}; valid: {', '.join(SPEC_WEIGHTS)}")
        try:
            graphs = _BUILDERS[name]((positional, options), n, seed)
            if weights is not None:
                graphs = [apply_weights(G, weights) for G in graphs]
        except ValueError as e:
            message = str(e)
            raise ValueError(message if message.startswith(name) else f"{text}: {message}") from None
    try:
        return Topology(graphs, spec=text)
    except ValueError as e:
        raise ValueError(f"{text}: {e}") from None
