"""Sparsifying codecs: top-k and random-k.

Both keep ``k = max(1, round(fraction * numel))`` values (0 for an empty tensor), send
them in the tensor's own dtype, and decode to a dense tensor that is zero elsewhere.
Top-k keeps the largest magnitudes and sends their int32 indices (int64 beyond 2**31
values); random-k sends only the seed and ``k``, and both ends draw the same indices.

Decoding allocates ``numel`` values however small the payload: the wire layer must
check ``numel`` against the model before decoding (the codec itself caps it at 2**34).
"""

from __future__ import annotations

import math

import torch

from gossip.compression.base import (
    CHUNK,
    DTYPES,
    Codec,
    CodecError,
    Encoded,
    check_buffers,
    check_int,
    check_meta,
    check_size_args,
    dtype_name,
    finite_float,
    itemsize,
)
from gossip.core.buffers import from_buffer, tensor_to_buffer

__all__ = ["RandKCodec", "TopKCodec"]

#: Tensors with more values than this send int64 indices instead of int32.
_INT32_LIMIT = 2**31


class _SparseCodec(Codec):
    """Shared parts: the kept fraction, ``k``, and the dense scatter on decode."""

    def __init__(self, fraction: float) -> None:
        fraction = finite_float("fraction", fraction)
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
        #: Share of the values kept (RATIO in the spec ``topk:RATIO``).
        self.fraction = fraction

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.fraction!r}"

    def k(self, numel: int) -> int:
        """Number of values kept for a tensor of ``numel`` values."""
        if numel == 0:
            return 0
        return min(numel, max(1, round(self.fraction * numel)))


def _scatter(
    numel: int, dtype: torch.dtype, index: torch.Tensor, values: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """A zero tensor of ``numel`` values on ``device`` with ``values`` at ``index``."""
    out = torch.zeros(numel, dtype=dtype, device=device)
    if index.numel():
        out.index_copy_(0, index.to(device=device, dtype=torch.int64), values.to(device))
    return out


class TopKCodec(_SparseCodec):
    """Keep the ``k`` values of largest magnitude; send values and int32 indices.

    Wire bytes: ``k * (itemsize + 4)``, e.g. 8 bytes per kept float32 value, so
    ``topk:0.01`` is 50x smaller than float32. Indices are sent in increasing order,
    and :meth:`validate` requires them strictly increasing and in ``[0, numel)``, so
    every decodable message has exactly one meaning.

    Notes
    -----
    Selection is exact. For large tensors it first keeps the candidates above a
    threshold estimated from a strided sample of ``|x|`` (about 1.25 ``k`` of them)
    and runs ``torch.topk`` on those only: about 10x faster than a full ``torch.topk``
    on CPU at 2**24 values. When the sample misleads (fewer than ``k`` candidates, or
    more than a quarter of all values) it falls back to a full ``torch.topk``. Among
    equal magnitudes at the cut, which ones are kept is unspecified.

    The suggested CHOCO step size is ``min(1, 4 * fraction)`` (0.04 at 1%), in line with
    the step sizes tuned for top-1% in the CHOCO-Gossip paper (Koloskova et al., 2019).

    Examples
    --------
    >>> import torch
    >>> codec = TopKCodec(0.5)
    >>> codec.decode(codec.encode(torch.tensor([0.1, -3.0, 2.0, 0.5]))).tolist()
    [0.0, -3.0, 2.0, 0.0]
    """

    name = "topk"

    @property
    def default_gamma(self) -> float:  # type: ignore[override]
        return min(1.0, 4.0 * self.fraction)

    def wire_size(self, numel: int, dtype: str) -> int:
        check_size_args(numel, dtype)
        return self.k(numel) * (itemsize(dtype) + _index_size(numel))

    def _encode(self, x: torch.Tensor, seed: int) -> Encoded:
        n = x.numel()
        k = self.k(n)
        index = _topk_index(x, k)
        values = x[index]
        wire_index = index.to(torch.int32 if _index_size(n) == 4 else torch.int64)
        buffers = (tensor_to_buffer(values), tensor_to_buffer(wire_index))
        return Encoded(self.name, n, dtype_name(x.dtype), {"k": k}, buffers)

    def _check(self, enc: Encoded) -> None:
        check_meta(enc, ("k",))
        k = check_int("topk meta k", enc.meta["k"], 0, enc.numel)
        width = _index_size(enc.numel)
        check_buffers(enc, (k * itemsize(enc.dtype), k * width))
        if k:
            index = from_buffer(enc.buffers[1], torch.int32 if width == 4 else torch.int64)
            if int(index[0]) < 0 or int(index[-1]) >= enc.numel:
                raise CodecError(f"topk index outside [0, {enc.numel})")
            if k > 1 and not bool((index[1:] > index[:-1]).all()):
                raise CodecError("topk indices are not strictly increasing")

    def _decode(self, enc: Encoded, device: torch.device) -> torch.Tensor:
        dtype = DTYPES[enc.dtype]
        width = _index_size(enc.numel)
        values = from_buffer(enc.buffers[0], dtype)
        index = from_buffer(enc.buffers[1], torch.int32 if width == 4 else torch.int64)
        return _scatter(enc.numel, dtype, index, values, device)


def _index_size(numel: int) -> int:
    return 4 if numel <= _INT32_LIMIT else 8


#: Below this size (or when keeping more than 1/8 of the values) a plain topk is used.
_PREFILTER_MIN = 2**15
#: Size of the strided sample that estimates the threshold.
_SAMPLE = 2**16


def _topk_index(x: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted int64 indices of the ``k`` largest ``|x|`` (exact)."""
    n = x.numel()
    if k == n:
        return torch.arange(n, device=x.device)
    if n < _PREFILTER_MIN or 8 * k > n:
        return _full_topk(x, k)
    # Estimate a threshold t with count(|x| >= t) a little above k: take the j-th largest
    # of a strided sample, j = expected count * 1.25 plus a few standard deviations.
    sample = x[:: max(1, n // _SAMPLE)].abs().float()  # n may be below _SAMPLE (>= _PREFILTER_MIN)
    m = sample.numel()
    expected = m * k / n
    j = min(m, math.ceil(1.25 * expected + 4.0 * math.sqrt(expected) + 8))
    threshold = torch.kthvalue(sample, m - j + 1).values
    mask = _abs_at_least(x, threshold)
    candidates = mask.nonzero().squeeze(1)
    if candidates.numel() < k or candidates.numel() > n // 4:
        return _full_topk(x, k)  # the sample was unrepresentative
    # Every non-candidate is < t <= the k-th largest, so the top k are among the candidates.
    chosen = torch.topk(x[candidates].abs(), k, sorted=False).indices
    return candidates[chosen.sort().values]


def _full_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(x.abs(), k, sorted=False).indices.sort().values


def _abs_at_least(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Boolean mask ``|x| >= threshold``; on CPU ``|x|`` is formed piece by piece in cache."""
    threshold = threshold.to(x.dtype)
    if x.device.type != "cpu":
        return x.abs() >= threshold
    mask = torch.empty(x.numel(), dtype=torch.bool)
    scratch = torch.empty(min(x.numel(), CHUNK), dtype=x.dtype)
    for piece, out in zip(x.split(CHUNK), mask.split(CHUNK)):
        torch.ge(torch.abs(piece, out=scratch[: piece.numel()]), threshold, out=out)
    return mask


class RandKCodec(_SparseCodec):
    """Keep ``k`` values at random positions; only the values, ``k`` and the seed travel.

    Wire bytes: ``k * itemsize`` (100x smaller than float32 at ``randk:0.01``). The
    positions are a uniformly random ``k``-subset drawn from a CPU ``torch.Generator``
    seeded with the ``seed`` given to :meth:`encode`; the decoder draws them again from
    ``meta["seed"]``. They are drawn on the CPU even when ``x`` is on a GPU, so every
    peer gets the same positions; peers must run the same PyTorch release, whose CPU
    generator defines the stream. Vary the seed per message (e.g. round number), or the
    same positions are sent every time.

    Notes
    -----
    Values are not rescaled by ``numel / k``: the codec is biased but contractive,
    which is what CHOCO's error feedback expects. The suggested CHOCO step size is
    ``min(1, fraction)`` (0.01 at 1%), matching the step size tuned for random-1% in
    the CHOCO-Gossip paper (Koloskova et al., 2019).

    Examples
    --------
    >>> import torch
    >>> codec = RandKCodec(0.5)
    >>> enc = codec.encode(torch.arange(1.0, 7.0), seed=3)
    >>> enc.meta
    {'k': 3, 'seed': 3}
    >>> int((codec.decode(enc) != 0).sum())
    3
    """

    name = "randk"

    @property
    def default_gamma(self) -> float:  # type: ignore[override]
        return min(1.0, self.fraction)

    def wire_size(self, numel: int, dtype: str) -> int:
        check_size_args(numel, dtype)
        return self.k(numel) * itemsize(dtype)

    def _encode(self, x: torch.Tensor, seed: int) -> Encoded:
        n = x.numel()
        k = self.k(n)
        index = random_index(n, k, seed).to(x.device)
        buffers = (tensor_to_buffer(x[index]),)
        return Encoded(self.name, n, dtype_name(x.dtype), {"k": k, "seed": seed}, buffers)

    def _check(self, enc: Encoded) -> None:
        check_meta(enc, ("k", "seed"))
        k = check_int("randk meta k", enc.meta["k"], 0, enc.numel)
        check_int("randk meta seed", enc.meta["seed"], 0, 2**64 - 1)
        check_buffers(enc, (k * itemsize(enc.dtype),))

    def _decode(self, enc: Encoded, device: torch.device) -> torch.Tensor:
        dtype = DTYPES[enc.dtype]
        index = random_index(enc.numel, enc.meta["k"], enc.meta["seed"])
        values = from_buffer(enc.buffers[0], dtype)
        return _scatter(enc.numel, dtype, index, values, device)


def random_index(numel: int, k: int, seed: int) -> torch.Tensor:
    """Sorted int64 CPU tensor of ``k`` distinct positions in ``[0, numel)`` drawn from ``seed``.

    Uniform over ``k``-subsets. For ``k <= numel / 4`` it draws a few more than ``k``
    positions with replacement, removes repeats (which leaves a uniformly random set
    of its size) and, if more than ``k`` remain, keeps a random ``k`` of them; this
    costs O(k log k) instead of the O(numel) of a permutation.
    """
    if k == 0:
        return torch.zeros(0, dtype=torch.int64)
    if k == numel:
        return torch.arange(numel)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    if 4 * k > numel:
        return torch.randperm(numel, generator=gen)[:k].sort().values
    index = torch.unique(torch.randint(0, numel, (k + k // 8 + 16,), generator=gen))
    while index.numel() < k:
        more = torch.randint(0, numel, (k - index.numel() + k // 8 + 16,), generator=gen)
        index = torch.unique(torch.cat([index, more]))
    if index.numel() > k:
        keep = torch.randperm(index.numel(), generator=gen)[:k].sort().values
        index = index[keep]
    return index
