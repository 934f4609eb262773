"""Blockwise absmax quantization to 4 or 2 bits, packed (``int4[:BLOCK]``, ``int2[:BLOCK]``).

Per block of ``B`` values: one float32 scale ``s = absmax / Q`` and one code per value,
``q = round(x / s)`` in ``[-Q, Q]``, stored as the unsigned ``q + Q`` in ``bits`` bits,
``8 / bits`` codes per byte (most significant first); decoding gives ``q * s``.
``Q = 2**(bits - 1) - 1``: 7 for int4 (15 levels), 1 for int2 (ternary: ``-s, 0, s``).
The error of each value is at most ``s / 2``. Wire bytes:
``ceil(numel * bits / 8) + 4 * ceil(numel / B)``: at ``B = 256`` about 7.5x (int4) and
14.2x (int2) smaller than float32.

Meant for what error feedback protects (CHOCO's differences, an outer optimizer's
pseudo-gradients): what one round rounds away is sent in a later one.
"""

from __future__ import annotations

import torch

from gossip.compression.base import (
    DTYPES,
    Codec,
    Encoded,
    ceil_div,
    check_buffers,
    check_int,
    check_meta,
    check_size_args,
    dtype_name,
)
from gossip.compression.quantize import _TINY, MAX_BLOCK
from gossip.core.buffers import from_buffer, tensor_to_buffer

__all__ = ["Int4BlockCodec", "Int2BlockCodec", "LowBitBlockCodec"]


class LowBitBlockCodec(Codec):
    """Blockwise absmax quantization to ``bits`` (4 or 2) bits per value (see the module docstring)."""

    bits = 4
    name = "int4"
    default_gamma = 0.7

    def __init__(self, block: int = 256) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_BLOCK:
            raise ValueError(f"block must be an int in [1, 2**24], got {block!r}")
        self.block = block

    @property
    def levels(self) -> int:
        """Q: codes run over [-Q, Q]."""
        return 2 ** (self.bits - 1) - 1

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.block}"

    def wire_size(self, numel: int, dtype: str) -> int:
        check_size_args(numel, dtype)
        return ceil_div(numel * self.bits, 8) + 4 * ceil_div(numel, self.block)

    def _encode(self, x: torch.Tensor, seed: int) -> Encoded:
        n, block, q_max = x.numel(), self.block, self.levels
        rows = ceil_div(n, block)
        flat = torch.zeros(rows * block, dtype=torch.float32, device=x.device)
        flat[:n] = x.reshape(-1)
        grid = flat.view(rows, block)
        absmax = grid.abs().amax(dim=1) if n else torch.zeros(0, device=x.device)
        keep = absmax >= _TINY
        scales = torch.where(keep, absmax / q_max, torch.zeros_like(absmax))
        inverse = torch.where(keep, q_max / absmax.clamp(min=_TINY), torch.zeros_like(absmax))
        codes = grid.mul_(inverse.unsqueeze(1)).round_().clamp_(-q_max, q_max).add_(q_max)
        packed = _pack(codes.view(-1)[:n].to(torch.uint8), self.bits)
        meta = {"block": block}
        return Encoded(self.name, n, dtype_name(x.dtype), meta, (tensor_to_buffer(packed),
                                                               tensor_to_buffer(scales.contiguous())))

    def _check(self, enc: Encoded) -> None:
        check_meta(enc, ("block",))
        block = check_int(f"{self.name} meta block", enc.meta["block"], 1, MAX_BLOCK)
        check_buffers(enc, (ceil_div(enc.numel * self.bits, 8), 4 * ceil_div(enc.numel, block)))

    def _decode(self, enc: Encoded, device: torch.device) -> torch.Tensor:
        n, block = enc.numel, enc.meta["block"]
        packed = from_buffer(enc.buffers[0], torch.uint8).to(device)
        scales = from_buffer(enc.buffers[1], torch.float32).to(device)
        codes = _unpack(packed, self.bits, n).to(torch.float32).sub_(self.levels)
        rows = ceil_div(n, block)
        full = torch.zeros(rows * block, dtype=torch.float32, device=device)
        full[:n] = codes
        out = full.view(rows, block).mul_(scales.unsqueeze(1)).view(-1)[:n]
        dtype = DTYPES[enc.dtype]
        return out if dtype == torch.float32 else out.to(dtype)


class Int4BlockCodec(LowBitBlockCodec):
    """int4: 15 levels per block, 4 bits per value.

    Examples
    --------
    >>> import torch
    >>> codec = Int4BlockCodec(block=4)
    >>> codec.decode(codec.encode(torch.tensor([7.0, -3.5, 1.0, 0.0, 2.0]))).tolist()
    [7.0, -4.0, 1.0, 0.0, 2.0]
    """

    bits = 4
    name = "int4"
    default_gamma = 0.7


class Int2BlockCodec(LowBitBlockCodec):
    """int2: ternary per block (``-s, 0, s`` with ``s`` the block's absmax), 2 bits per value.

    Examples
    --------
    >>> import torch
    >>> codec = Int2BlockCodec(block=4)
    >>> codec.decode(codec.encode(torch.tensor([4.0, -3.0, 1.0, 0.0, -2.0]))).tolist()
    [4.0, -4.0, 0.0, 0.0, -2.0]
    """

    bits = 2
    name = "int2"
    default_gamma = 0.3


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes below ``2**bits`` into bytes, ``8 // bits`` per byte, first code highest."""
    per = 8 // bits
    n = codes.numel()
    padded = torch.zeros(ceil_div(n, per) * per, dtype=torch.uint8, device=codes.device)
    padded[:n] = codes
    grid = padded.view(-1, per)
    out = torch.zeros(grid.shape[0], dtype=torch.uint8, device=codes.device)
    for k in range(per):
        out |= grid[:, k] << (bits * (per - 1 - k))
    return out


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per = 8 // bits
    mask = (1 << bits) - 1
    grid = torch.empty(packed.numel(), per, dtype=torch.uint8, device=packed.device)
    for k in range(per):
        grid[:, k] = (packed >> (bits * (per - 1 - k))) & mask
    return grid.view(-1)[:n]
