"""Choosing CHOCO's consensus step size gamma by simulating consensus.

CHOCO's gamma trades speed for stability: too large and the compression error
is amplified every round (the copies never settle, or blow up), too small and
the nodes barely move towards each other. The right value depends on the codec
and on the graph, so :func:`tune_gamma` measures it: it runs CHOCO consensus
(no gradients) on the actual mixing matrix with the actual codec, from random
vectors, for each gamma of a grid, and keeps the gamma with the lowest final
consensus distance (1/n) sum_i ||x_i - x_bar||^2.
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

import numpy as np
import torch

from gossip.compression import Codec, get_codec, get_decoder

__all__ = ["GAMMA_GRID", "choco_consensus", "tune_gamma", "cached_tune_gamma"]

#: Candidate step sizes: 1 down to 1/512 in steps of sqrt(2).
GAMMA_GRID: tuple[float, ...] = tuple(round(2.0 ** (-k / 2), 6) for k in range(19))


def choco_consensus(W: np.ndarray, codec: Codec | str, gamma: float, x0: torch.Tensor, rounds: int,
                    *, seed: int = 0) -> list[float]:
    """Run ``rounds`` of CHOCO consensus from ``x0`` (one row per node); return the
    consensus distance before the first round and after each round.

    Public copies start at zero, as in :class:`gossip.mixing.ChocoRule`; node i's
    update is x_i += gamma * sum_j W_ij (x_hat_j - x_hat_i). ``seed`` varies the
    positions random-k draws.
    """
    codec = get_codec(codec) if isinstance(codec, str) else codec
    W = np.asarray(W, dtype=np.float64)
    n = x0.shape[0]
    if W.shape != (n, n):
        raise ValueError(f"W must be {n}x{n} to match x0, got shape {W.shape}")
    Wt = torch.as_tensor(W, dtype=x0.dtype)
    # sum_j W_ij (xh_j - xh_i) = (W xh)_i - rowsum_i xh_i
    lap = Wt - torch.diag(Wt.sum(1))
    x = x0.clone()
    xh = torch.zeros_like(x)
    decoder = get_decoder(codec.name)
    out = [_distance(x)]
    for r in range(rounds):
        for i in range(n):
            enc = codec.encode(x[i] - xh[i], seed=((seed * 1_000_003 + r) * 0x9E3779B1 + i) & 0x7FFFFFFFFFFFFFFF)
            xh[i] += decoder.decode(enc)
        x += gamma * (lap @ xh)
        d = _distance(x)
        out.append(d)
        if not math.isfinite(d) or d > 1e3 * out[0]:
            out.extend([math.inf] * (rounds - r - 1))  # diverged: no need to go on
            break
        if d <= _FLOOR * out[0]:
            out.extend([0.0] * (rounds - r - 1))  # at float round-off: converged, and ties with any faster gamma
            break
    return out


def _distance(x: torch.Tensor) -> float:
    x = x.double()
    return float(((x - x.mean(0)) ** 2).sum(1).mean())


def tune_gamma(W: np.ndarray, codec: Codec | str, *, dim: int = 1000, rounds: int = 100, seed: int = 0,
               grid: Sequence[float] = GAMMA_GRID) -> float:
    """The gamma of ``grid`` with the lowest consensus distance after ``rounds`` rounds
    of CHOCO consensus on ``W`` with ``codec``, from standard normal vectors of ``dim``
    values per node (drawn from ``seed``). Ties go to the larger gamma; distances at
    float round-off count as exact consensus.

    The grid is searched from the largest gamma down. A run that blows up (distance
    1000x its start) stops early, and the search stops two grid points past the best
    one: below the optimum smaller steps only converge more slowly.

    Deterministic for given arguments, so every node of a real deployment that tunes
    on the same matrix gets the same gamma. Cost: at most ``len(grid) * rounds * n``
    encodes (1-4 s for 8 nodes at the defaults).

    Examples
    --------
    >>> import topologies as T
    >>> g = tune_gamma(T.mixing_matrix(T.ring(8)), "topk:0.1", dim=200, rounds=100)  # doctest: +SKIP
    """
    codec = get_codec(codec) if isinstance(codec, str) else codec
    W = np.asarray(W, dtype=np.float64)
    if W.ndim != 2 or W.shape[0] != W.shape[1] or W.shape[0] < 1:
        raise ValueError(f"W must be a square matrix, got shape {W.shape}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    grid = sorted({float(g) for g in grid}, reverse=True)
    if not grid or not all(0 < g <= 1 for g in grid):
        raise ValueError(f"grid must hold numbers in (0, 1], got {grid!r}")
    x0 = torch.randn(W.shape[0], dim, generator=torch.Generator().manual_seed(seed))
    best, best_d = grid[0], math.inf
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: extra threads only add synchronisation
    try:
        with torch.no_grad():
            worse = 0
            for g in grid:  # largest first: ties keep the faster one
                d = choco_consensus(W, codec, g, x0, rounds, seed=seed)[-1]
                if d < best_d:
                    best, best_d, worse = g, d, 0
                elif math.isfinite(best_d):
                    worse += 1
                    if worse == 2:  # past the optimum: smaller steps only converge slower
                        break
    finally:
        torch.set_num_threads(threads)
    return best


_CACHE: dict[tuple, float] = {}

#: A consensus distance this far below the start is float32 round-off: counted as exact consensus.
_FLOOR = 1e-10



def cached_tune_gamma(W: np.ndarray, codec: Codec, *, dim: int = 1000, rounds: int = 100, seed: int = 0) -> float:
    """:func:`tune_gamma`, computed once per (matrix, codec, dim, rounds, seed) in this process
    (a simulation's nodes all ask for the same one)."""
    W = np.ascontiguousarray(W, dtype=np.float64)
    key = (hashlib.sha1(W.tobytes()).hexdigest(), W.shape, codec.spec, dim, rounds, seed)
    if key not in _CACHE:
        _CACHE[key] = tune_gamma(W, codec, dim=dim, rounds=rounds, seed=seed)
    return _CACHE[key]
