"""Splitting a dataset across nodes and drawing each node's minibatches.

Splits are a pure function of (labels, number of nodes, split spec, seed), so
every real node computes the same partition on its own and picks its shard by
rank, with no master handing out data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

__all__ = ["Split", "parse_split", "split_indices", "BatchStream", "StackedDraws", "node_seed"]


@dataclass(frozen=True)
class Split:
    """How samples are spread across nodes: ``iid`` or non-IID ``dirichlet`` with ``alpha``."""

    kind: str = "iid"
    alpha: float = 0.0

    def __str__(self) -> str:
        return "iid" if self.kind == "iid" else f"dirichlet:{self.alpha:g}"


def parse_split(spec: str | Split) -> Split:
    """Parse ``iid`` or ``dirichlet:ALPHA`` (ALPHA > 0; smaller is more skewed)."""
    if isinstance(spec, Split):
        return spec
    s = str(spec).strip()
    if s == "iid":
        return Split("iid")
    if s.startswith("dirichlet"):
        _, _, arg = s.partition(":")
        try:
            alpha = float(arg)
        except ValueError:
            raise ValueError(f"split {spec!r}: expected dirichlet:ALPHA with a number, e.g. dirichlet:0.1") from None
        if not np.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"split {spec!r}: ALPHA must be a positive number")
        return Split("dirichlet", alpha)
    raise ValueError(f"unknown split {spec!r}; valid: iid, dirichlet:ALPHA")


def node_seed(seed: int, rank: int, purpose: int = 0) -> int:
    """Independent 63-bit seed for one node and purpose, derived from the run seed."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(rank), int(purpose)])
    return int(ss.generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def split_indices(
    num_samples: int,
    world_size: int,
    split: Split | str = "iid",
    *,
    labels: np.ndarray | None = None,
    seed: int = 0,
    min_size: int = 1,
) -> list[np.ndarray]:
    """Partition ``range(num_samples)`` into ``world_size`` shards.

    ``iid`` shuffles and deals equal shares. ``dirichlet:ALPHA`` draws, for each
    class, the fraction of its samples each node receives from Dirichlet(ALPHA)
    (Hsu et al., 2019); draws are repeated (up to 100 times) until every node
    holds at least ``min_size`` samples.

    Examples
    --------
    >>> [len(s) for s in split_indices(10, 3)]
    [4, 3, 3]
    """
    split = parse_split(split)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if num_samples < world_size:
        raise ValueError(f"cannot split {num_samples} samples across {world_size} nodes")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, 0x5EED]))
    if split.kind == "iid":
        perm = rng.permutation(num_samples)
        return [np.sort(p) for p in np.array_split(perm, world_size)]
    if labels is None:
        raise ValueError("a dirichlet split needs class labels; this task provides none (use --split iid)")
    labels = np.asarray(labels)
    classes = np.unique(labels)
    best: list[np.ndarray] | None = None
    for _ in range(100):
        shards: list[list[np.ndarray]] = [[] for _ in range(world_size)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(world_size, split.alpha))
            cuts = (np.cumsum(props)[:-1] * len(idx)).astype(int)
            for node, part in enumerate(np.split(idx, cuts)):
                shards[node].append(part)
        out = [np.sort(np.concatenate(s)) for s in shards]
        if best is None or min(map(len, out)) > min(map(len, best)):
            best = out
        if min(map(len, out)) >= min_size:
            return out
    assert best is not None
    return best


class BatchStream:
    """Endless minibatches from one node's shard: a fresh shuffle every epoch.

    The order is a pure function of ``seed``, so a node's batches are
    reproducible and a plain training loop can replay them exactly:
    ``perm = torch.randperm(len(shard), generator=g)`` per epoch, batches taken
    in order, the last short batch dropped when the shard is larger than a batch.
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...], shard: np.ndarray | torch.Tensor, batch_size: int, seed: int,
                 device: torch.device | str = "cpu") -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(shard) == 0:
            raise ValueError("this node's data shard is empty")
        self.tensors = tensors
        self.shard = torch.as_tensor(np.asarray(shard), dtype=torch.long)
        self.batch_size = min(batch_size, len(self.shard))
        self.generator = torch.Generator().manual_seed(seed)
        self.device = torch.device(device)
        self._order = torch.empty(0, dtype=torch.long)
        self._order_len = 0  # len(self._order), len(self.shard): kept as ints (a tensor's len() is slow)
        self._len = len(self.shard)
        self._pos = 0
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.shard)

    def next(self) -> tuple[torch.Tensor, ...]:
        idx = self.next_indices()
        return tuple(t[idx].to(self.device, non_blocking=True) for t in self.tensors)

    def next_indices(self) -> torch.Tensor:
        """The rows of :attr:`tensors` that :meth:`next` would return, advancing the
        stream just as it does (a driver that gathers many nodes' batches at once
        indexes the shared tensors itself)."""
        pos, size = self._pos, self.batch_size
        if pos + size > self._order_len:
            if self._len == 1:  # randperm(1) is [0] and draws nothing: the same stream, without the call
                self._order = self.shard
            else:
                self._order = self.shard[torch.randperm(self._len, generator=self.generator)]
            self._order_len = self._len
            pos = 0
            self.epoch += 1
        self._pos = pos + size
        return self._order[pos : pos + size]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "order": self._order.clone(), "pos": self._pos, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self._order = state["order"].clone()
        self._order_len = len(self._order)
        self._pos = int(state["pos"])
        self.epoch = int(state["epoch"])


class StackedDraws:
    """The next batch of many :class:`BatchStream` of one batch size at once.

    ``draw()`` is ``torch.stack([s.next_indices() for s in streams])``, and leaves
    every stream exactly where that call would leave it (its generator included),
    with less work per stream. A stream whose batch is its whole shard starts an
    epoch at every call, so its batch is its shard in a fresh order: the shards are
    stacked once, a one-sample shard draws nothing (as ``next_indices`` has it) and
    a larger one draws only its ``randperm``; the orders are gathered in one call.
    Other streams take their own ``next_indices()``.
    """

    def __init__(self, streams: Sequence[BatchStream]) -> None:
        self.streams = list(streams)
        if not self.streams:
            raise ValueError("no streams to draw from")
        self.size = size = self.streams[0].batch_size
        if any(s.batch_size != size for s in self.streams):
            raise ValueError("the streams have different batch sizes")
        whole = [j for j, s in enumerate(self.streams) if s._len == size]
        self._whole = [self.streams[j] for j in whole]
        self._whole_at = torch.tensor(whole, dtype=torch.long)
        self._rest = [(j, s) for j, s in enumerate(self.streams) if s._len != size]
        self._shards = torch.stack([s.shard for s in self._whole]) if whole else None
        self._all_whole = not self._rest

    def draw(self) -> torch.Tensor:
        """Row j: the rows of the shared tensors that ``streams[j].next()`` would return."""
        size, whole = self.size, self._whole
        if any(s._pos + size <= s._order_len for s in whole):  # a restored stream mid-epoch: one at a time
            return torch.stack([s.next_indices() for s in self.streams])
        if whole:
            if size == 1:  # randperm(1) draws nothing: each order is the shard itself
                orders = self._shards
                for s in whole:
                    s._order = s.shard
                    s._order_len = 1
                    s._pos = 1
                    s.epoch += 1
            else:
                perms = torch.stack([torch.randperm(size, generator=s.generator) for s in whole])
                orders = torch.gather(self._shards, 1, perms)
                for s, order in zip(whole, orders.unbind(0)):
                    s._order = order
                    s._order_len = size
                    s._pos = size
                    s.epoch += 1
            if self._all_whole:
                return orders
        out = torch.empty(len(self.streams), size, dtype=torch.long)
        if whole:
            out[self._whole_at] = orders
        for j, s in self._rest:
            out[j] = s.next_indices()
        return out
