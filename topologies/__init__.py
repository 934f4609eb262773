"""Gossip topologies: graphs and mixing weights (depends only on networkx and numpy).

A topology is a weighted :class:`networkx.DiGraph` on nodes ``0..n-1``. Edge
``(u, v)`` means "u sends to v" and its ``weight`` attribute is ``W[v, u]``, the
coefficient receiver ``v`` applies to ``u``'s value (``x_v <- sum_u W[v, u] x_u``);
every node has a self-loop carrying ``W[i, i]``. Nodes carry ``dc`` (datacenter
index) and edges ``link`` (``"intra"`` or ``"inter"``).

Specs accepted by :func:`build` (and the command line)::

    ring                                   undirected cycle (Metropolis weights, 1/3 each)
    directed-ring                          i -> i+1
    torus | torus:RxC                      2-D periodic grid (alone: most square R x C, both >= 2)
    complete                               all-reduce baseline: exact average every round
    star                                   hub node 0, parameter-server-like baseline
    exponential                            i -> i + 2^k, k < ceil(log2 n)
    one-peer-exponential                   i -> i + 2^(r mod ceil(log2 n)) at round r (time-varying)
    random-regular[:D][,seed=S]            connected random D-regular graph, D=3 by default
    small-world[:K,P][,seed=S]             connected Watts-Strogatz, K=4, P=0.1 by default
    hierarchical:8,8[,intra=complete|ring|exponential][,inter=gateway|matched|complete]
                                           datacenters of the given sizes (sum = n)
    file:PATH                              edge list ("u v [w]" lines, "# directed") or JSON

    Every spec also takes weights=metropolis|uniform|max-degree.

Example
-------
>>> import topologies
>>> t = topologies.build("torus:4x4", 16)
>>> round(topologies.spectral_gap(t.mixing_matrix()), 4)
0.4
"""

from .analysis import (
    check_graph,
    is_column_stochastic,
    is_doubly_stochastic,
    is_row_stochastic,
    is_strongly_connected,
    mixing_matrix,
    period_mixing_matrix,
    spectral_gap,
)
from .builders import (
    HIERARCHICAL_INTER,
    HIERARCHICAL_INTRA,
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
from .convert import from_file, from_networkx, to_file
from .spec import SPEC_NAMES, SPEC_WEIGHTS, build
from .topology import Topology, restrict_links
from .weights import (
    WEIGHT_RULES,
    apply_weights,
    is_symmetric,
    max_degree_weights,
    metropolis_hastings_weights,
    push_sum_weights,
    uniform_weights,
)

__all__ = [
    "restrict_links",
    "HIERARCHICAL_INTER",
    "HIERARCHICAL_INTRA",
    "SPEC_NAMES",
    "SPEC_WEIGHTS",
    "Topology",
    "WEIGHT_RULES",
    "apply_weights",
    "build",
    "check_graph",
    "complete",
    "directed_ring",
    "exponential",
    "from_file",
    "from_networkx",
    "hierarchical",
    "is_column_stochastic",
    "is_doubly_stochastic",
    "is_row_stochastic",
    "is_strongly_connected",
    "is_symmetric",
    "max_degree_weights",
    "metropolis_hastings_weights",
    "mixing_matrix",
    "one_peer_exponential",
    "period_mixing_matrix",
    "push_sum_weights",
    "random_regular",
    "ring",
    "small_world",
    "spectral_gap",
    "star",
    "to_file",
    "torus",
    "uniform_weights",
]
