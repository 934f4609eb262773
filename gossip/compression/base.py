"""The codec contract: :class:`Encoded`, :class:`Codec`, :class:`CodecError`.

A codec turns a flat 1-D tensor into an :class:`Encoded` value (a few msgpack-able
scalars in ``meta`` plus raw byte buffers that travel as zero-copy frames) and back.
The helpers here are shared by every codec: dtype tables, strict checks for data
that came off the network, and conversion between byte buffers and tensors.

Byte order is the machine's native one; every supported platform (x86-64,
aarch64) is little-endian.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from gossip.core.buffers import Chunked

__all__ = [
    "CHUNK",
    "DTYPES",
    "MAX_NUMEL",
    "Codec",
    "CodecError",
    "Encoded",
]

#: Largest ``numel`` accepted from the network (2**34 values, 64 GiB of float32).
MAX_NUMEL = 2**34

#: Elements per piece in CPU kernels that make several passes (scale, round, cast):
#: 4 MiB of float32, so a piece is still in cache for the next pass and one scratch
#: buffer replaces fresh full-size temporaries (whose page faults cost as much as the
#: arithmetic). Pieces are large enough that each op's parallel region amortises its
#: start-up even when another process holds a core; much smaller pieces stall.
CHUNK = 2**20

#: Wire name -> torch dtype of the tensors a codec accepts and returns.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

#: Integer dtype of the same width, used to move a float tensor's bits through numpy
#: (numpy has no bfloat16).
_BITS_DTYPE = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


class CodecError(ValueError):
    """Encoded data is malformed: wrong codec, bad ``meta``, or wrong buffer sizes.

    Raised by :meth:`Codec.validate` (and therefore :meth:`Codec.decode`) so that
    the wire layer can drop a hostile or corrupted message and count the reason.
    """


@dataclass(frozen=True)
class Encoded:
    """One compressed 1-D tensor.

    Attributes
    ----------
    codec : str
        Registry name of the codec that produced it, e.g. ``"topk"``.
    numel : int
        Number of values in the original tensor.
    dtype : str
        ``"float32"``, ``"float16"`` or ``"bfloat16"``: the dtype decoding returns.
    meta : dict
        Small msgpack-able scalars (int, float, str, bool), e.g. ``{"k": 123}``.
    buffers : tuple
        Raw byte buffers (anything with the buffer protocol). Codecs in this package
        produce flat, C-contiguous ``memoryview`` objects of format ``"B"``, so
        ``len(b) == memoryview(b).nbytes``.
    source : torch.Tensor or None
        For zero-copy codecs, the tensor whose memory the buffers view; for others,
        optionally the decoded values, when the sender decoded its own message (CHOCO
        does). It never travels: in-process delivery (the simulator) reads it instead
        of rebuilding a tensor from the bytes; data decoded off the wire has none.
    """

    codec: str
    numel: int
    dtype: str
    meta: dict = field(default_factory=dict)
    buffers: tuple = ()
    source: Any = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        """Exact payload size: the sum of the buffers' byte lengths."""
        return sum(b.nbytes if type(b) is Chunked else memoryview(b).nbytes for b in self.buffers)


class Codec:
    """Base class of all codecs.

    Subclasses set :attr:`name` and :attr:`default_gamma` and implement
    :meth:`_encode`, :meth:`_decode`, :meth:`_check` and :meth:`wire_size`.
    The public :meth:`encode`, :meth:`decode` and :meth:`validate` wrap those with
    argument and network-data checks, so no subclass can forget them.

    Attributes
    ----------
    name : str
        Registry name, also written into :attr:`Encoded.codec`.
    spec : str
        Full specification that :func:`gossip.compression.get_codec` parses back
        into an equal codec, e.g. ``"topk:0.01"``.
    default_gamma : float
        Suggested CHOCO consensus step size for this codec.
    aliases_input : bool
        Whether :meth:`encode`'s buffers may view the input's memory (then a
        sender must encode a snapshot, not parameters it keeps training).
    """

    name: str = ""
    default_gamma: float = 1.0
    aliases_input: bool = False

    @property
    def spec(self) -> str:
        """The spec string that builds an equal codec, e.g. ``"int8:256"``."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.spec))

    # ------------------------------------------------------------------ public API

    def encode(self, x: torch.Tensor, *, seed: int = 0) -> Encoded:
        """Compress a 1-D contiguous CPU or CUDA tensor.

        Parameters
        ----------
        x : torch.Tensor
            1-D, contiguous, float32 / float16 / bfloat16, on any device.
        seed : int
            Randomness for codecs that use it (random-k); it travels in ``meta``.

        Returns
        -------
        Encoded
            Its buffers never alias ``x`` unless :attr:`aliases_input` says so
            (only :class:`~gossip.compression.cast.IdentityCodec` on CPU does).
        """
        check_input(x)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        if x.requires_grad:
            x = x.detach()
        return self._encode(x, seed)

    def decode(self, enc: Encoded, *, device: torch.device | str | None = None, copy: bool = True) -> torch.Tensor:
        """Validate ``enc`` and rebuild a fresh 1-D tensor of ``enc.numel`` values.

        The result has dtype ``enc.dtype``, lives on ``device`` (CPU when ``None``),
        and owns its memory: it never aliases ``enc.buffers``. Compact forms move to
        ``device`` before they are expanded. With ``copy=False`` a codec may return a
        read-only view of the buffers instead (identity on CPU does): for callers that
        only read the values, such as a mixing step.

        Validation bounds every allocation by the payload size, except the output of
        codecs whose payload does not grow with ``numel`` (top-k, random-k): callers
        decoding network data must check ``enc.numel`` against the model first.

        Raises
        ------
        CodecError
            If ``enc`` fails :meth:`validate`.
        """
        self.validate(enc)
        dev = torch.device("cpu") if device is None else torch.device(device)
        with torch.no_grad():
            if not copy:
                return self._decode_view(enc, dev)
            return self._decode(enc, dev)

    def validate(self, enc: Encoded) -> None:
        """Check data that came off the network before anything is allocated from it.

        Verifies the codec name, ``numel`` (an int in ``[0, 2**34]``), ``dtype``, the
        exact ``meta`` keys and their types and ranges, the number of buffers and each
        buffer's byte length, and codec-specific content (e.g. top-k indices in range).

        Raises
        ------
        CodecError
            With a short reason; never any other exception type.
        """
        try:
            if not isinstance(enc, Encoded):
                raise CodecError(f"expected Encoded, got {type(enc).__name__}")
            if enc.codec != self.name:
                raise CodecError(f"codec is {enc.codec!r}, expected {self.name!r}")
            check_int("numel", enc.numel, 0, MAX_NUMEL)
            if not isinstance(enc.dtype, str) or enc.dtype not in DTYPES:
                raise CodecError(f"dtype {enc.dtype!r} is not one of {sorted(DTYPES)}")
            if not isinstance(enc.meta, Mapping):
                raise CodecError(f"meta must be a dict, got {type(enc.meta).__name__}")
            if not isinstance(enc.buffers, tuple):
                raise CodecError(f"buffers must be a tuple, got {type(enc.buffers).__name__}")
            self._check(enc)
        except CodecError:
            raise
        except Exception as exc:  # noqa: BLE001 - hostile data must only ever raise CodecError
            raise CodecError(f"malformed {self.name} data: {type(exc).__name__}: {exc}") from None

    def wire_size(self, numel: int, dtype: str) -> int:
        """Exact payload bytes of a tensor of ``numel`` values of ``dtype``."""
        raise NotImplementedError

    def ratio(self, numel: int, dtype: str) -> float:
        """Uncompressed bytes / wire bytes (1.0 for an empty tensor)."""
        wire = self.wire_size(numel, dtype)
        if numel == 0:
            return 1.0
        return numel * itemsize(dtype) / wire

    # ------------------------------------------------------------ subclass hooks

    def _encode(self, x: torch.Tensor, seed: int) -> Encoded:
        raise NotImplementedError

    def _decode(self, enc: Encoded, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def _decode_view(self, enc: Encoded, device: torch.device) -> torch.Tensor:
        """Like :meth:`_decode` but may alias the buffers; by default it does not."""
        return self._decode(enc, device)

    def _check(self, enc: Encoded) -> None:
        """Codec-specific validation; ``numel``, ``dtype`` and types are already checked."""
        raise NotImplementedError


# ---------------------------------------------------------------------- input checks


def check_input(x: Any) -> None:
    """Raise ``ValueError`` naming ``x`` unless it is a 1-D contiguous float tensor."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"x must be 1-D, got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPE_NAMES:
        raise ValueError(f"x has dtype {x.dtype}; supported: {sorted(DTYPES)}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if x.numel() > MAX_NUMEL:
        raise ValueError(f"x has {x.numel()} values, more than 2**34")


def check_size_args(numel: Any, dtype: Any) -> None:
    """Argument checks for ``wire_size``/``ratio``: ValueError naming the argument."""
    if isinstance(numel, bool) or not isinstance(numel, int) or not 0 <= numel <= MAX_NUMEL:
        raise ValueError(f"numel must be an int in [0, 2**34], got {numel!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def itemsize(dtype: str) -> int:
    return DTYPES[dtype].itemsize


# ----------------------------------------------------------- network data checks


def check_int(what: str, value: Any, lo: int, hi: int) -> int:
    """Return ``value`` if it is an int (not bool) in ``[lo, hi]``, else CodecError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise CodecError(f"{what} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise CodecError(f"{what}={value} is outside [{lo}, {hi}]")
    return value


def check_meta(enc: Encoded, keys: tuple[str, ...]) -> None:
    """``enc.meta`` must have exactly ``keys`` (types are checked by the caller)."""
    got = set(enc.meta)
    if got != set(keys):
        missing = sorted(set(keys) - got)
        extra = sorted(map(repr, got - set(keys)))
        raise CodecError(f"{enc.codec} meta keys: missing {missing}, unexpected {extra}")


def check_buffers(enc: Encoded, sizes: tuple[int, ...]) -> None:
    """``enc.buffers`` must be ``len(sizes)`` contiguous buffers of exactly ``sizes`` bytes."""
    if len(enc.buffers) != len(sizes):
        raise CodecError(f"{enc.codec} expects {len(sizes)} buffers, got {len(enc.buffers)}")
    for i, (buf, size) in enumerate(zip(enc.buffers, sizes)):
        if type(buf) is Chunked:  # received as frames; the wire checked each frame's length
            if buf.nbytes != size:
                raise CodecError(f"buffer {i} has {buf.nbytes} bytes, expected {size}")
            continue
        try:
            view = memoryview(buf)
        except TypeError:
            raise CodecError(f"buffer {i} does not support the buffer protocol") from None
        if not view.c_contiguous:
            raise CodecError(f"buffer {i} is not contiguous")
        if view.nbytes != size:
            raise CodecError(f"buffer {i} has {view.nbytes} bytes, expected {size}")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def finite_float(what: str, value: float) -> float:
    """Validate a user-supplied float parameter (ValueError, not CodecError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)
