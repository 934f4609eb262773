"""Lossless and cast codecs: identity, float16, bfloat16.

Each sends every value; they differ only in the dtype on the wire. Because they
introduce no (identity) or tiny (a half-precision rounding) error, their suggested
CHOCO step size is 1.0: compressed gossip then behaves like exact gossip.
"""

from __future__ import annotations

import torch

from gossip.compression.base import (
    DTYPES,
    Codec,
    Encoded,
    check_buffers,
    check_meta,
    check_size_args,
    dtype_name,
    itemsize,
)
from gossip.core.buffers import from_buffer, tensor_to_buffer

__all__ = ["BFloat16Codec", "Float16Codec", "IdentityCodec"]

_FP16_MAX = 65504.0
_FAST = {torch.float32: "float32", torch.float16: "float16"}  # dtypes numpy can view directly


class IdentityCodec(Codec):
    """Send the raw bytes of the tensor in its own dtype.

    On CPU, :meth:`encode` is zero-copy: the buffer is a ``memoryview`` of ``x``'s
    own memory, so ``x`` must not change until the bytes are sent (callers encode a
    snapshot). A CUDA tensor is copied to the host once.

    Examples
    --------
    >>> import torch
    >>> codec = IdentityCodec()
    >>> x = torch.arange(4.0)
    >>> torch.equal(codec.decode(codec.encode(x)), x)
    True
    """

    name = "identity"
    default_gamma = 1.0
    aliases_input = True

    def encode(self, x: torch.Tensor, *, seed: int = 0) -> Encoded:
        if type(self) is IdentityCodec and type(x) is torch.Tensor and x.device.type == "cpu" and x.dim() == 1 \
                and x.is_contiguous() and x.dtype in _FAST and not x.requires_grad and type(seed) is int \
                and 0 <= seed < 2**64:
            # the hot path of uncompressed gossip: a view of x's memory, nothing to check or copy
            return Encoded(self.name, x.numel(), _FAST[x.dtype], {}, (memoryview(x.numpy()).cast("B"),), x)
        return super().encode(x, seed=seed)

    def _encode(self, x: torch.Tensor, seed: int) -> Encoded:
        source = x if x.device.type == "cpu" else None  # only when the buffer really views x
        return Encoded(self.name, x.numel(), dtype_name(x.dtype), {}, (tensor_to_buffer(x),), source)

    def _decode(self, enc: Encoded, device: torch.device) -> torch.Tensor:
        values = from_buffer(enc.buffers[0], DTYPES[enc.dtype])
        # copy=True: the result must own its memory, never alias the (maybe read-only) frame.
        return values.to(device=device, copy=True)

    def _decode_view(self, enc: Encoded, device: torch.device) -> torch.Tensor:
        if enc.source is not None:
            return enc.source.to(device=device)
        return from_buffer(enc.buffers[0], DTYPES[enc.dtype]).to(device=device)

    def _check(self, enc: Encoded) -> None:
        check_meta(enc, ())
        check_buffers(enc, (self.wire_size(enc.numel, enc.dtype),))

    def wire_size(self, numel: int, dtype: str) -> int:
        check_size_args(numel, dtype)
        return numel * itemsize(dtype)


class _CastCodec(Codec):
    """Send every value cast to :attr:`wire_dtype`; decoding casts back."""

    wire_dtype: torch.dtype

    def _encode(self, x: torch.Tensor, seed: int) -> Encoded:
        if x.dtype == self.wire_dtype:
            wire = x.clone()  # a cast to the same dtype would alias x
        else:
            wire = self._cast(x)
        return Encoded(self.name, x.numel(), dtype_name(x.dtype), {}, (tensor_to_buffer(wire),))

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.wire_dtype)

    def _decode(self, enc: Encoded, device: torch.device) -> torch.Tensor:
        wire = from_buffer(enc.buffers[0], self.wire_dtype)
        if device.type != "cpu":
            wire = wire.to(device)  # move the compact form, widen on the device
        return wire.to(dtype=DTYPES[enc.dtype], copy=True)

    def _check(self, enc: Encoded) -> None:
        check_meta(enc, ())
        check_buffers(enc, (self.wire_size(enc.numel, enc.dtype),))

    def wire_size(self, numel: int, dtype: str) -> int:
        check_size_args(numel, dtype)
        return numel * self.wire_dtype.itemsize


class Float16Codec(_CastCodec):
    """Send values as IEEE float16 (2 bytes); decode casts back to the original dtype.

    Values beyond float16's range saturate at +-65504 instead of becoming inf (as
    hivemind does), so a large but finite parameter still yields a valid message;
    NaN stays NaN. Relative error is at most 2**-11 for values in float16's normal
    range (above 6.1e-5 in magnitude); smaller values lose relative precision.
    """

    name = "fp16"
    default_gamma = 1.0
    wire_dtype = torch.float16

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        wire = x.to(torch.float16)
        return wire.clamp_(-_FP16_MAX, _FP16_MAX)  # in place on the small copy: inf -> max


class BFloat16Codec(_CastCodec):
    """Send values as bfloat16 (2 bytes): float32's range, 8 bits of precision.

    Relative error is at most 2**-8 per value; no overflow is possible from float32.
    """

    name = "bf16"
    default_gamma = 1.0
    wire_dtype = torch.bfloat16
