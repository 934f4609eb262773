"""The wire format: how a :class:`~gossip.core.message.Message` becomes ZeroMQ frames.

A message is a multipart::

    frame 0   b"GSP/2"                 protocol tag and version
    frame 1   msgpack map (the header)
    frame 2.. raw buffers (tensor bytes, exactly as the codec produced them)

Header keys: ``kind``, ``from`` (sender id), ``seq``, ``round``, ``prog``
(progress: the sender's local step count), ``fp`` (model fingerprint), and for
messages carrying a tensor ``codec``, ``dtype``, ``numel``, ``meta`` (codec
metadata) and ``lens`` (byte length of each codec buffer); optional ``w``
(push-sum mass) and ``x`` (small extra fields: members list, rule flags).

Buffers larger than ``chunk`` bytes (1 MiB) travel as several frames of at
most that size (header key ``chunk``). The receiver keeps uncompressed
payloads as those frames (:class:`gossip.core.buffers.Chunked`): the finite check
and the mixing step read them in place, part by part. Other codecs' buffers
are joined into a pooled block (:mod:`gossip.core.buffers`) for their decoders.
Small frames let libzmq's allocator reuse receive memory instead of mapping
(and page-faulting) a fresh region for every large message, which more than
halves transfer time for a 64 MiB model on loopback; 1 MiB was the fastest
and steadiest of 256 KiB - 16 MiB there.

Tensors are never pickled. :func:`decode` checks every field before anything
is built from it and raises :class:`WireError` with a short ``reason`` that
nodes count; it never raises anything else on hostile bytes.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Sequence

import msgpack

from gossip.compression import CodecError, Encoded, available_codecs, get_decoder
from gossip.core.buffers import Chunked
from gossip.core.message import Message

__all__ = ["TAG", "VERSION", "KINDS", "WireError", "encode", "decode", "message_size", "same_header_size", "header_of"]

VERSION = 3
PREFIX = b"GSP/"
TAG = PREFIX + str(VERSION).encode()
KINDS = frozenset({"state", "hello", "members", "ping", "pong", "bye", "state-request", "state-reply",
                   "average", "swim"})
SWIM_OPS = frozenset({"ping", "ping-req", "ack", "gossip"})  # gossip.protocol.swim.OPS: a swim message's x["op"]
DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})
MAX_HEADER = 1024 * 1024  # a whole member table of about 24,000 members (a start's, an anti-entropy exchange's)
MAX_LIST = 65536  # entries in one list of a header's map: a member table's ids (MAX_HEADER bounds the bytes)
MAX_FRAMES = 2 + 65536  # with 1 MiB chunks: 64 GiB; ZeroMQ's MAXMSGSIZE bounds the real total
CHUNK = 2**20
MAX_INT = 2**63 - 1
MAX_NUMEL = 2**34


class WireError(Exception):
    """A message that cannot be accepted; ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def _buffer_len(b: Any) -> int:
    return b.nbytes if type(b) is Chunked else memoryview(b).nbytes


def header_of(msg: Message) -> dict[str, Any]:
    """The header map of ``msg`` (without the buffers)."""
    h: dict[str, Any] = {"kind": msg.kind, "from": msg.sender, "seq": msg.seq, "round": msg.round,
                         "prog": msg.progress, "fp": msg.fingerprint}
    enc = msg.data
    if enc is not None:
        h["codec"] = enc.codec
        h["dtype"] = enc.dtype
        h["numel"] = enc.numel
        h["meta"] = enc.meta
        h["lens"] = lens = [_buffer_len(b) for b in enc.buffers]
        if any(n > CHUNK for n in lens):
            h["chunk"] = CHUNK
    if msg.weight is not None:
        h["w"] = float(msg.weight)
    if msg.extra:
        h["x"] = msg.extra
    return h


_packer = threading.local()


def _pack(obj: Any) -> bytes:
    p = getattr(_packer, "p", None)
    if p is None:  # a Packer per thread: reusing one is several times faster than packb
        p = _packer.p = msgpack.Packer(use_bin_type=True)
    return p.pack(obj)


def encode(msg: Message) -> list[Any]:
    """Frames for ``msg``; tensor buffers are passed through without copying."""
    frames: list[Any] = [TAG, _pack(header_of(msg))]
    if msg.data is not None:
        for b in msg.data.buffers:
            if type(b) is Chunked:  # a received payload sent on: cut again at this side's chunk size
                b = b.join()
            view = memoryview(b).cast("B")
            if view.nbytes > CHUNK:
                frames.extend(view[i:i + CHUNK] for i in range(0, view.nbytes, CHUNK))
            else:
                frames.append(b)
    return frames


def message_size(msg: Message) -> int:
    """Exact bytes of ``msg`` on the wire (all frames, before ZeroMQ framing)."""
    n = len(TAG) + len(_pack(header_of(msg)))
    if msg.data is not None:
        n += msg.data.nbytes
    return n


def same_header_size(a: Message, b: Message) -> bool:
    """True when ``a`` and ``b`` encode to the same number of bytes for certain: the
    same payload object and header fields that differ at most in a push-sum
    weight (always a 9-byte msgpack float64)."""
    return (a.data is b.data and a.sender == b.sender and a.round == b.round and a.progress == b.progress
            and a.seq == b.seq and a.kind == b.kind and a.fingerprint == b.fingerprint
            and (a.weight is None) == (b.weight is None) and a.extra == b.extra)


def _int(h: dict, key: str, default: int | None = None) -> int:
    v = h.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_INT:
        raise WireError("header", f"{key} must be a non-negative integer")
    return v


MAX_SHARED = 1 << 17  # distinct ids _shared keeps one copy of (twice a member table's most)


_SHARED: dict[str, str] = {}


def _shared(s: str) -> str:
    """One copy of a node id that a process decodes again and again (a sender, an entry of a
    member list): ids key every member table, and a simulated cluster of n holds n tables
    of n, each key otherwise its own copy from some message. Bounded (MAX_SHARED strings of
    at most 256 characters): a flood of new ids only ends the sharing. Scalars (a digest
    changes with every change to the table) are not kept."""
    if len(s) > 256:
        return s
    t = _SHARED.get(s)
    if t is None:
        if len(_SHARED) >= MAX_SHARED:
            return s
        t = _SHARED[s] = s
    return t


def _scalars(d: Any, what: str) -> dict[str, Any]:
    if not isinstance(d, dict) or len(d) > 64:
        raise WireError("header", f"{what} must be a small map")
    for k, v in d.items():
        if not isinstance(k, str):
            raise WireError("header", f"{what} keys must be strings")
        if isinstance(v, (list, tuple)):
            if len(v) > MAX_LIST or not all(isinstance(e, (str, int, float, bool)) or e is None for e in v):
                raise WireError("header", f"{what}.{k} must be a short list of scalars")
            if v and isinstance(v[0], str):
                d[k] = [_shared(e) if isinstance(e, str) else e for e in v]
        elif isinstance(v, str):
            if len(v) > 4096:
                raise WireError("header", f"{what}.{k} is too long")
        elif not (isinstance(v, (int, float, bool)) or v is None):
            raise WireError("header", f"{what}.{k} must be a scalar")
    return d


def _is_node_id(x: Any) -> bool:
    """A node id as headers carry it: a non-empty string of at most 256 characters."""
    return isinstance(x, str) and 0 < len(x) <= 256


def _header(frames: Sequence[Any]) -> dict:
    """The checked frame count and tag, and the header map; raise :class:`WireError`."""
    try:
        nframes = len(frames)
    except TypeError:
        raise WireError("frames", "not a frame list") from None
    if nframes < 2:
        raise WireError("frames", f"{nframes} frame(s), need at least 2")
    if nframes > MAX_FRAMES:
        raise WireError("frames", f"{nframes} frames")
    tag = bytes(frames[0])
    if tag != TAG:
        if tag.startswith(PREFIX):
            raise WireError("version", f"peer speaks {tag.decode(errors='replace')}, this node {TAG.decode()}")
        raise WireError("protocol", "not a gossip message")
    raw = frames[1]
    if _buffer_len(raw) > MAX_HEADER:
        raise WireError("header", "header too large")
    try:
        h = msgpack.unpackb(raw, raw=False, strict_map_key=True)  # size capped just above
    except Exception:  # msgpack raises several unrelated types on garbage
        raise WireError("header", "undecodable header") from None
    if not isinstance(h, dict):
        raise WireError("header", "header is not a map")
    return h


def claimed_sender(frames: Sequence[Any]) -> str | None:
    """The sender id a gossip message's header claims, or None when the frames are
    not a gossip message of this version with a string sender. Nothing else is
    validated: :func:`decode` does that."""
    try:
        sender = _header(frames).get("from")
    except WireError:
        return None
    return sender if _is_node_id(sender) else None


def decode(frames: Sequence[Any]) -> Message:
    """Parse and validate frames into a :class:`Message`; raise :class:`WireError`."""
    h = _header(frames)
    nframes = len(frames)
    kind = h.get("kind")
    if kind not in KINDS:
        raise WireError("kind", f"unknown kind {str(kind)[:32]!r}")
    sender = h.get("from")
    if not _is_node_id(sender) and not (
            isinstance(sender, int) and not isinstance(sender, bool) and 0 <= sender <= MAX_INT):
        raise WireError("header", "bad sender id")
    if isinstance(sender, str):
        sender = _shared(sender)
    seq, rnd, prog = _int(h, "seq", 0), _int(h, "round", 0), _int(h, "prog", 0)
    fp = h.get("fp", "")
    if not isinstance(fp, str) or len(fp) > 128:
        raise WireError("header", "bad fingerprint field")
    weight = h.get("w")
    if weight is not None:
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (math.isfinite(weight) and weight > 0):
            raise WireError("weight", "push-sum weight must be finite and positive")
        weight = float(weight)
    extra = _scalars(h.get("x", {}), "x")
    if kind == "swim":
        # the failure detector's messages (gossip/protocol/swim.py): fields only, each checked by
        # the control plane (gossip.protocol.swim.check, gossip.protocol.control.parse_control)
        if "codec" in h or weight is not None or nframes != 2:
            raise WireError("swim", "a swim message carries no tensor and no push-sum weight")
        if extra.get("op") not in SWIM_OPS:
            raise WireError("swim", f"unknown swim op {str(extra.get('op'))[:32]!r}")
    data = None
    if "codec" in h:
        codec = h["codec"]
        if not isinstance(codec, str) or codec not in available_codecs():
            raise WireError("codec", f"unknown codec {str(codec)[:32]!r}")
        dtype = h.get("dtype")
        if dtype not in DTYPES:
            raise WireError("dtype", f"unknown dtype {str(dtype)[:32]!r}")
        numel = _int(h, "numel")
        if numel > MAX_NUMEL:
            raise WireError("size", "numel too large")
        meta = _scalars(h.get("meta", {}), "meta")
        lens = h.get("lens")
        if not isinstance(lens, list) or len(lens) > MAX_FRAMES or not all(
                isinstance(n, int) and not isinstance(n, bool) and 0 <= n for n in lens):
            raise WireError("header", "lens must be a list of byte counts")
        chunk = h.get("chunk")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                                  or not 2**16 <= chunk <= 2**30):
            raise WireError("header", "bad chunk size")
        per_buffer = [1 if chunk is None or n <= chunk else -(-n // chunk) for n in lens]
        if sum(per_buffer) != nframes - 2:
            raise WireError("frames", "frame count does not match declared buffers")
        buffers_list = []
        pos = 2
        for i, (n, k) in enumerate(zip(lens, per_buffer)):
            parts = frames[pos:pos + k]
            pos += k
            sizes = [_buffer_len(f) for f in parts]
            want = [n] if k == 1 else [chunk] * (k - 1) + [n - chunk * (k - 1)]
            if sizes != want:
                raise WireError("lengths", f"buffer {i} length differs from the declared one")
            if k == 1:
                buffers_list.append(parts[0])
            else:
                chunked = Chunked(list(parts), n)
                # uncompressed payloads stay as frames (mixed in place); decoders of the others want one buffer
                buffers_list.append(chunked if codec == "identity" else chunked.join())
        buffers = tuple(buffers_list)
        data = Encoded(codec, numel, dtype, meta, buffers)
        try:
            get_decoder(codec).validate(data)
        except CodecError as e:
            raise WireError("codec-data", str(e)[:200]) from None
    elif nframes != 2:
        raise WireError("frames", "buffers without a codec")
    return Message(kind, sender, rnd, prog, seq, data, weight, extra, fp)
