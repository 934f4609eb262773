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
import time
import warnings
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

__all__ = ["BufferPool", "Chunked", "POOL_MIN", "Pieces", "SendLease", "pooled_copy", "pool", "to_buffer",
           "tensor_to_buffer", "from_buffer"]

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


class Chunked:
    """One byte buffer that arrived as consecutive frames, kept as they are.

    The wire cuts large buffers into 1 MiB frames; joining them again costs a
    copy of the whole payload. A mixing step can instead read each frame where
    it lies (:meth:`pieces`), so the join happens only when something needs one
    contiguous buffer (:meth:`join`, cached).
    """

    __slots__ = ("frames", "nbytes", "_joined")

    def __init__(self, frames: list, nbytes: int) -> None:
        self.frames = frames
        self.nbytes = nbytes
        self._joined: memoryview | None = None

    def join(self) -> memoryview:
        """The bytes as one contiguous buffer (a pooled block, made once)."""
        if self._joined is None:
            out = pool.get(self.nbytes)
            pos = 0
            for f in self.frames:
                view = memoryview(f).cast("B")
                out[pos:pos + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
                pos += view.nbytes
            self._joined = memoryview(out)
        return self._joined

    def pieces(self, dtype: torch.dtype) -> Pieces | None:
        """The frames viewed as consecutive tensors of ``dtype``; None when a frame
        boundary would split a value (a sender with an odd chunk size)."""
        size = dtype.itemsize
        views = [memoryview(f).cast("B") for f in self.frames]
        if any(v.nbytes % size for v in views):
            return None
        return Pieces([from_buffer(v, dtype) for v in views])


class Pieces:
    """A 1-D tensor held as consecutive parts (the received frames), not joined.

    Kernels that work element-wise (the finite check, ``lerp_``) run part by
    part against the matching slice of the other operand: the same arithmetic
    as on the joined tensor, without the copy. Read-only: the parts may view
    ZeroMQ frames.
    """

    __slots__ = ("parts", "numel", "dtype")

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts
        self.numel = sum(p.numel() for p in parts)
        self.dtype = parts[0].dtype if parts else torch.float32

    def __iter__(self):
        """``(offset, part)`` pairs, ``offset`` in elements."""
        pos = 0
        for p in self.parts:
            yield pos, p
            pos += p.numel()

    def join(self) -> torch.Tensor:
        """One contiguous tensor (a pooled block)."""
        nbytes = self.numel * self.dtype.itemsize
        if nbytes < POOL_MIN:
            return torch.cat(self.parts) if self.parts else torch.empty(0, dtype=self.dtype)
        out = torch.from_numpy(pool.get(nbytes)).view(self.dtype)
        for off, p in self:
            out[off:off + p.numel()].copy_(p)
        return out


class SendLease:
    """Send a CPU tensor without copying it, and know when the sends are done.

    :meth:`tensor` gives a tensor over the same memory whose every view (the
    encoded buffers, the frames cut from them, ZeroMQ's references to those
    frames) keeps one numpy exporter alive; :meth:`released` is true once none
    is left, that is, once the transport has finished with every message built
    from it. Until then the memory must not change.
    """

    def __init__(self, x: torch.Tensor) -> None:
        if x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError("only a contiguous CPU tensor can be sent in place")
        self._dtype = x.dtype
        # numpy has no bfloat16: its bits go through an integer of the same width
        self._array = (x.detach().view(torch.int16) if x.dtype == torch.bfloat16 else x.detach()).numpy()

    def tensor(self) -> torch.Tensor:
        """The tensor to encode and send (same memory as ``x``)."""
        return torch.from_numpy(self._array).view(self._dtype)

    def released(self) -> bool:
        return sys.getrefcount(self._array) <= 2  # this object's reference and getrefcount's argument

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for :meth:`released`; return it.

        libzmq hands finished frames back through pyzmq's garbage-collection
        thread, so a send that has completed is seen here a moment later."""
        if self.released():
            return True
        deadline = time.monotonic() + timeout
        pause = 1e-4
        while time.monotonic() < deadline:
            time.sleep(pause)
            if self.released():
                return True
            pause = min(pause * 2, 5e-3)
        return False


# ------------------------------------------------------ buffers <-> tensors


def to_buffer(t: torch.Tensor) -> memoryview:
    """A flat byte ``memoryview`` of ``t``'s memory (CPU, contiguous): zero-copy."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def tensor_to_buffer(t: torch.Tensor) -> memoryview:
    """Like :func:`to_buffer` but moves a device tensor to the CPU first."""
    return to_buffer(t.cpu() if t.device.type != "cpu" else t)


def from_buffer(buf: Any, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor viewing ``buf``'s bytes as ``dtype`` (no copy when aligned).

    The result may alias a read-only buffer: callers must only read it. A buffer
    whose address is not a multiple of the item size is copied once, so kernels
    never see misaligned data. Sizes must already be validated. A buffer that
    arrived as several frames (:class:`gossip.core.buffers.Chunked`) is joined.
    """
    if type(buf) is Chunked:
        buf = buf.join()
    view = memoryview(buf).cast("B")
    if view.nbytes == 0:
        return torch.empty(0, dtype=dtype)
    if view.readonly:
        with warnings.catch_warnings():
            # Read-only network frames: torch warns that writing would be undefined; we never write.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(view, dtype=torch.uint8)
    else:
        raw = torch.frombuffer(view, dtype=torch.uint8)
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype)
