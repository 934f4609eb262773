"""Codecs that compress a flat parameter tensor for gossip, registered by name.

A codec is a small class with ``encode`` / ``decode`` / ``validate`` / ``wire_size`` /
``ratio`` (see :class:`Codec`); an :class:`Encoded` value carries msgpack-able ``meta``
and raw byte buffers that the wire layer sends as zero-copy frames. Codecs are chosen
by a spec string, as on the command line:

=================  ===========================================  ==============
spec               what travels                                 vs float32
=================  ===========================================  ==============
``identity``       raw values (alias ``none``)                  1x
``fp16``           float16 values, saturating at +-65504        2x
``bf16``           bfloat16 values                              2x
``int8[:BLOCK]``   int8 codes + a float32 scale per BLOCK (256) 3.94x
``int4[:BLOCK]``   4-bit codes (15 levels) + a scale per BLOCK  7.76x
``int2[:BLOCK]``   2-bit codes (ternary) + a scale per BLOCK    15.1x
``topk:RATIO``     largest-magnitude values + int32 indices     1 / (2 RATIO)
``randk:RATIO``    values at seeded random positions + seed     1 / RATIO
``sign``           1 bit per value + float32 mean magnitude     ~32x
=================  ===========================================  ==============

Examples
--------
>>> import torch
>>> from gossip.compression import get_codec
>>> codec = get_codec("topk:0.25")
>>> enc = codec.encode(torch.tensor([0.5, -4.0, 1.0, 2.0]))
>>> enc.nbytes == codec.wire_size(4, "float32") == 8
True
>>> get_decoder(enc.codec).decode(enc).tolist()
[0.0, -4.0, 0.0, 0.0]
"""

from __future__ import annotations

from typing import Callable

from gossip.compression.base import MAX_NUMEL, Codec, CodecError, Encoded
from gossip.compression.cast import BFloat16Codec, Float16Codec, IdentityCodec
from gossip.compression.lowbit import Int2BlockCodec, Int4BlockCodec
from gossip.compression.quantize import Int8BlockCodec
from gossip.compression.sign import SignCodec
from gossip.compression.sparse import RandKCodec, TopKCodec

__all__ = [
    "MAX_NUMEL",
    "BFloat16Codec",
    "Codec",
    "CodecError",
    "Encoded",
    "Float16Codec",
    "IdentityCodec",
    "Int2BlockCodec",
    "Int4BlockCodec",
    "Int8BlockCodec",
    "RandKCodec",
    "SignCodec",
    "TopKCodec",
    "available_codecs",
    "get_codec",
    "get_decoder",
    "register_codec",
]

#: A factory gets the text after ``name:`` in a spec (``None`` when there is none)
#: and returns a codec, raising ValueError for an argument it cannot accept.
CodecFactory = Callable[["str | None"], Codec]

_FACTORIES: dict[str, CodecFactory] = {}
_USAGE: dict[str, str] = {}
_DECODER_SPECS: dict[str, str] = {}
_DECODERS: dict[str, Codec] = {}
_ALIASES = {"none": "identity"}


def register_codec(
    name: str,
    factory: CodecFactory,
    *,
    usage: str | None = None,
    decoder_spec: str | None = None,
    replace: bool = False,
) -> None:
    """Make ``factory`` available to :func:`get_codec` under ``name``.

    Parameters
    ----------
    name : str
        Lower-case registry name without ``:``; codecs built by ``factory`` must
        use it as their :attr:`Codec.name`.
    factory : callable
        ``factory(arg)`` with ``arg`` the text after ``name:`` or ``None``.
    usage : str, optional
        How the spec is written, for error messages, e.g. ``"topk:RATIO"``.
    decoder_spec : str, optional
        Spec of the instance :func:`get_decoder` uses (decoding reads everything
        from ``meta``); defaults to ``name``.
    replace : bool
        Allow replacing an existing registration.

    Examples
    --------
    >>> from gossip.compression import IdentityCodec, register_codec
    >>> class Raw(IdentityCodec):
    ...     name = "raw"
    >>> register_codec("raw", lambda arg: Raw(), replace=True)
    >>> get_codec("raw").name
    'raw'
    """
    if not isinstance(name, str) or not name or ":" in name or name != name.strip().lower():
        raise ValueError(f"name must be a non-empty lower-case string without ':', got {name!r}")
    if not callable(factory):
        raise ValueError(f"factory must be callable, got {factory!r}")
    if not replace and (name in _FACTORIES or name in _ALIASES):
        raise ValueError(f"name {name!r} is already registered; pass replace=True to override")
    _FACTORIES[name] = factory
    _USAGE[name] = usage or name
    _DECODER_SPECS[name] = decoder_spec or name
    _DECODERS.pop(name, None)


def available_codecs() -> list[str]:
    """Registered codec names, in registration order (aliases such as ``none`` excluded)."""
    return list(_FACTORIES)


def _valid_specs() -> str:
    return ", ".join(_USAGE[name] for name in _FACTORIES) + " (none = identity)"


def get_codec(spec: str) -> Codec:
    """Build a codec from a spec such as ``"fp16"``, ``"int8:128"`` or ``"topk:0.01"``.

    Raises
    ------
    ValueError
        Naming the spec and listing the valid ones, for an unknown name or a bad argument.

    Examples
    --------
    >>> get_codec("int8")
    Int8BlockCodec('int8:256')
    >>> get_codec("topk:0.01").ratio(1000, "float32")
    50.0
    """
    if not isinstance(spec, str):
        raise ValueError(f"spec must be a string, got {type(spec).__name__}")
    name, colon, arg = spec.strip().partition(":")
    name = _ALIASES.get(name.lower(), name.lower())
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown codec spec {spec!r}; valid specs: {_valid_specs()}")
    try:
        return factory(arg.strip() if colon else None)
    except ValueError as exc:
        raise ValueError(f"bad codec spec {spec!r}: {exc}; valid specs: {_valid_specs()}") from None


def get_decoder(name: str) -> Codec:
    """A codec able to validate and decode :class:`Encoded` data whose ``codec`` is ``name``.

    Meant for names that came off the network: an unknown name raises
    :class:`CodecError`, not a plain ValueError.
    """
    decoder = _DECODERS.get(name) if isinstance(name, str) else None
    if decoder is None:
        if not isinstance(name, str) or name not in _FACTORIES:
            raise CodecError(f"unknown codec {name!r}")
        decoder = _DECODERS[name] = get_codec(_DECODER_SPECS[name])
    return decoder


# ----------------------------------------------------------------- built-in codecs


def _no_argument(cls: type[Codec]) -> CodecFactory:
    def factory(arg: str | None) -> Codec:
        if arg is not None:
            raise ValueError(f"{cls.name} takes no argument, got {arg!r}")
        return cls()

    return factory


def _blockwise(cls: type[Codec]) -> CodecFactory:
    def factory(arg: str | None) -> Codec:
        if arg is None:
            return cls()
        if not arg.isdigit():
            raise ValueError(f"BLOCK must be a positive integer, got {arg!r}")
        return cls(int(arg))  # type: ignore[call-arg]

    return factory


_int8 = _blockwise(Int8BlockCodec)


def _ratio(cls: type[TopKCodec] | type[RandKCodec]) -> CodecFactory:
    def factory(arg: str | None) -> Codec:
        if not arg:
            raise ValueError(f"{cls.name} needs a RATIO in (0, 1], e.g. {cls.name}:0.01")
        try:
            fraction = float(arg)
        except ValueError:
            raise ValueError(f"RATIO must be a number in (0, 1], got {arg!r}") from None
        return cls(fraction)

    return factory


register_codec("identity", _no_argument(IdentityCodec))
register_codec("fp16", _no_argument(Float16Codec))
register_codec("bf16", _no_argument(BFloat16Codec))
register_codec("int8", _int8, usage="int8[:BLOCK]")
register_codec("topk", _ratio(TopKCodec), usage="topk:RATIO", decoder_spec="topk:1")
register_codec("randk", _ratio(RandKCodec), usage="randk:RATIO", decoder_spec="randk:1")
register_codec("sign", _no_argument(SignCodec))
register_codec("int4", _blockwise(Int4BlockCodec), usage="int4[:BLOCK]")
register_codec("int2", _blockwise(Int2BlockCodec), usage="int2[:BLOCK]")
