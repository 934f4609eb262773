"""Reused host buffers for large messages: snapshots to send, frames to join.

A fresh allocation of a large block is mapped by the C library and
page-faulted on first touch, which costs several times the copy that fills it
(a ``clone`` of 64 MiB of float32: ~40-60 ms here, a copy into warm memory:
~10 ms). A node makes one such copy per gossip round on each side of the wire,
so both are taken from a :class:`BufferPool` instead.

A pooled block is a numpy array, the exporter of every view made from it
(memoryviews, ``torch.from_numpy`` tensors and their views, frames handed to
ZeroMQ), so its reference count tells exactly when nothing uses it any more;
only then is it handed out again. Blocks still in use are never touched: the
pool allocates a new one and keeps it too, up to ``keep`` per size. So the pool
holds at most what was in use at once at the busiest moment (a node keeps the
last message from each neighbour, so that is about twice its degree).
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict

import numpy as np
import torch

__all__ = ["BufferPool", "POOL_MIN", "pooled_copy", "pool"]

#: Smaller tensors are cloned as usual: malloc reuses small blocks by itself.
POOL_MIN = 1 << 20


class BufferPool:
    """Byte arrays by size, handed out again once nothing views them.

    Only the ``sizes`` most recently asked for are kept: a node uses a few sizes
    (its model, a codec's buffers), while a peer sending messages of ever new
    sizes must not make it keep a block of each.
    """

    def __init__(self, keep: int = 16, sizes: int = 8) -> None:
        self.keep = keep
        self.sizes = sizes
        self.free: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self.lock = threading.Lock()
        self.reused = 0  # blocks handed out again (a figure for tests and benchmarks)

    def get(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` that nothing else references (contents undefined)."""
        with self.lock:
            arrays = self.free.get(nbytes)
            if arrays is None:
                arrays = self.free[nbytes] = []
                while len(self.free) > self.sizes:
                    self.free.popitem(last=False)  # the least recently used size: its blocks go when unused
            else:
                self.free.move_to_end(nbytes)
            for a in arrays:
                if sys.getrefcount(a) == 3:  # the list, the loop variable, getrefcount's argument
                    self.reused += 1
                    return a
            a = np.empty(nbytes, dtype=np.uint8)
            if len(arrays) < self.keep:
                arrays.append(a)
            return a

    def clear(self) -> None:
        with self.lock:
            self.free.clear()


pool = BufferPool()


def pooled_copy(x: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``x`` (contiguous, same dtype and device), safe to send
    while ``x`` keeps changing. Large CPU tensors are copied into a pooled block,
    small ones (where malloc reuses memory by itself) are cloned."""
    nbytes = x.numel() * x.element_size()
    if nbytes < POOL_MIN or x.device.type != "cpu":
        return x.clone(memory_format=torch.contiguous_format) if not x.requires_grad else x.detach().contiguous().clone()
    out = torch.from_numpy(pool.get(nbytes)).view(x.dtype).view(x.shape)
    return out.copy_(x.detach())
