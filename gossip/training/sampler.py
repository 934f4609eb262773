"""Equal-length data shards for gossip nodes: a drop-in ``DistributedSampler``
and a shard helper for any ``torch.utils.data.Dataset``.

Every node of a synchronous cluster must take the same number of optimizer steps
per epoch, or the one with more batches waits for rounds nobody else will send.
Both helpers pad the shards by repeating samples from the start, as
:class:`torch.utils.data.DistributedSampler` does, so every shard has
``ceil(len(dataset) / world_size)`` samples.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

from torch.utils.data import Dataset, DistributedSampler, Subset

__all__ = ["ShardSampler", "shard"]


def _check_rank(rank: int, world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")


def shard(dataset: Dataset, rank: int, world_size: int) -> Subset:
    """This node's part of ``dataset``: samples ``rank, rank + world_size, ...``, padded
    (with samples from the start) so that every rank's shard has the same length.

    The torch-``Dataset`` form of ``dataset[rank::world_size]``, which a
    ``Dataset`` does not support.

    >>> import torch
    >>> from torch.utils.data import TensorDataset
    >>> ds = TensorDataset(torch.arange(10))
    >>> [len(shard(ds, r, 3)) for r in range(3)]
    [4, 4, 4]
    >>> [int(x) for (x,) in shard(ds, 2, 3)]
    [2, 5, 8, 1]
    """
    _check_rank(rank, world_size)
    n = len(dataset)  # type: ignore[arg-type]
    if n == 0:
        raise ValueError("dataset is empty")
    per = math.ceil(n / world_size)
    total = per * world_size
    order = list(range(n)) + [i % n for i in range(total - n)]  # pad from the start, like DistributedSampler
    return Subset(dataset, order[rank:total:world_size])


class ShardSampler(DistributedSampler):
    """``DistributedSampler`` for a gossip node: equal-length shards (padded),
    reshuffled by :meth:`set_epoch`, and able to start an epoch part-way
    through (:meth:`skip`), so that a restarted node continues the epoch it was
    in instead of running it again.

    Usually made by :meth:`gossip.GossipNode.sampler`; with it,
    :meth:`gossip.GossipNode.epochs` calls ``set_epoch`` and ``skip`` for you.
    ``len(sampler)`` is always the whole epoch's share (``len(loader)`` the
    number of optimizer steps in an epoch).
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        _check_rank(rank, num_replicas)
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self._skip = 0
        self._resume: tuple[int, int] | None = None

    def reshard(self, num_replicas: int, rank: int) -> None:
        """Share the data among ``num_replicas`` from the next iteration on, this node
        taking part ``rank`` (a cluster whose members changed, at an epoch's start)."""
        _check_rank(rank, num_replicas)
        if (num_replicas, rank) == (self.num_replicas, self.rank):
            return
        self.num_replicas, self.rank = num_replicas, rank
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.drop_last and n % num_replicas:
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def resume_at(self, epoch: int, samples: int) -> None:
        """Leave out the first ``samples`` indices of every iteration of epoch ``epoch`` (a
        framework that may start an epoch's iteration more than once: each is the rest of it)."""
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"samples must be a non-negative integer, got {samples!r}")
        self._resume = (int(epoch), samples)

    def skip(self, samples: int) -> None:
        """Leave out the first ``samples`` indices of the next iteration only."""
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"samples must be a non-negative integer, got {samples!r}")
        self._skip = samples

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())
        skip, self._skip = self._skip, 0
        if self._resume is not None and self._resume[0] == self.epoch:
            skip = max(skip, self._resume[1])
        return iter(indices[skip:])


def steps_per_epoch(loader: Any) -> int:
    """Optimizer steps in one epoch of ``loader`` (one step per batch)."""
    try:
        n = len(loader)
    except TypeError:
        raise ValueError("loader has no len(); pass steps_per_epoch") from None
    if n < 1:
        raise ValueError("loader is empty")
    return int(n)


def sampler_of(loader: Any) -> ShardSampler | None:
    """The :class:`ShardSampler` behind a DataLoader (as ``sampler`` or inside its ``batch_sampler``)."""
    for s in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(s, ShardSampler):
            return s
    return None
