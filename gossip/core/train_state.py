"""The training state a member hands a joiner besides its parameters: the inner
optimizer's state and param groups, and small JSON-able extras (learning-rate
schedulers, the data position), in a form that travels without pickling.

An optimizer's ``state_dict()`` splits into tensors, which travel as raw values
appended to the parameters of the state reply, and a description (the param
groups' hyper-parameters, every state entry's key, shape and dtype, small values
inline), which travels zlib-compressed in the message header as a few short
strings. The receiver checks the description against its own optimizer before
anything is loaded, and decompresses no more than :data:`MAX_META` bytes.

Tensors travel in the parameters' dtype: exact for the usual optimizers (SGD,
Adam, AdamW keep their state in the parameters' dtype); a state tensor of
another floating dtype is converted on the way.
"""

from __future__ import annotations

import base64
import json
import math
import zlib
from typing import Any

import torch

__all__ = ["pack_optimizer", "unpack_optimizer", "optimizer_numel", "encode_meta", "decode_meta", "plain",
           "restore_plain", "TrainStateError", "MAX_META"]

MAX_META = 4 * 2**20  # decompressed description bytes accepted from a peer
CHUNK = 4000  # characters per header string (the wire allows 4096)
MAX_HEADER_CHARS = 48 * 1024  # what the description may take of a header
SMALL = 16  # tensors of at most this many elements travel inline (step counts, scalars)


class TrainStateError(ValueError):
    """A training-state description that does not fit this node's optimizer (or is malformed)."""


def plain(value: Any) -> Any:
    """``value`` as JSON can carry it (tuples become lists; non-finite floats are kept
    by Python's json); raises TypeError for what it cannot."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() <= SMALL:
        return {"__tensor__": value.detach().cpu().reshape(-1).tolist(), "dtype": str(value.dtype).split(".")[-1],
                "shape": list(value.shape)}
    raise TypeError(f"cannot hand over a {type(value).__name__}")


def restore_plain(value: Any, like: Any = None) -> Any:
    """Undo :func:`plain`; ``like`` (this node's own value, if any) gives back tuples."""
    if isinstance(value, dict) and "__tensor__" in value:
        dtype = getattr(torch, str(value.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise TrainStateError(f"unknown dtype {value.get('dtype')!r}")
        return torch.tensor(value["__tensor__"], dtype=dtype).reshape(value.get("shape", []))
    if isinstance(value, list):
        items = [restore_plain(v, like[i] if isinstance(like, (list, tuple)) and i < len(like) else None)
                 for i, v in enumerate(value)]
        return tuple(items) if isinstance(like, tuple) else items
    if isinstance(value, dict):
        return {k: restore_plain(v, like.get(k) if isinstance(like, dict) else None) for k, v in value.items()}
    return value


def pack_optimizer(optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> tuple[list[torch.Tensor], dict]:
    """``optimizer``'s state as (tensors to send, in ``dtype``; a JSON-able description).

    Tensors larger than :data:`SMALL` elements travel in the list, in order; the
    description names each entry's parameter index, key, shape and dtype."""
    sd = optimizer.state_dict()
    groups = [{k: plain(v) for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    entries: list[list[Any]] = []
    tensors: list[torch.Tensor] = []
    for idx in sorted(sd["state"], key=int):
        for key, value in sd["state"][idx].items():
            if isinstance(value, torch.Tensor) and value.numel() > SMALL:
                if not value.is_floating_point():
                    raise TypeError(f"optimizer state {key!r} is a {value.dtype} tensor of {value.numel()} elements")
                entries.append([int(idx), str(key), list(value.shape), str(value.dtype).split(".")[-1]])
                tensors.append(value.detach().reshape(-1).to(dtype))
            else:
                entries.append([int(idx), str(key), None, plain(value)])
    return tensors, {"type": type(optimizer).__name__, "groups": groups, "state": entries}


def optimizer_numel(desc: Any) -> int:
    """Elements the tensors described by ``desc`` (from :func:`pack_optimizer`) take;
    raises :class:`TrainStateError` on a malformed description."""
    if not isinstance(desc, dict) or not isinstance(desc.get("state"), list) or not isinstance(desc.get("groups"), list):
        raise TrainStateError("an optimizer description needs 'groups' and 'state' lists")
    total = 0
    for e in desc["state"]:
        if not (isinstance(e, list) and len(e) == 4 and type(e[0]) is int and e[0] >= 0 and isinstance(e[1], str)):
            raise TrainStateError("a bad optimizer state entry")
        if e[2] is not None:
            if not (isinstance(e[2], list) and all(type(d) is int and d >= 0 for d in e[2]) and isinstance(e[3], str)):
                raise TrainStateError("a bad optimizer state shape")
            total += math.prod(e[2])
    return total


def unpack_optimizer(desc: dict, values: torch.Tensor, optimizer: torch.optim.Optimizer) -> dict:
    """The ``state_dict`` for ``optimizer`` described by ``desc`` with its tensors in
    ``values`` (concatenated, as :func:`pack_optimizer` sent them): this node's own
    param-group layout, the sender's hyper-parameters and state. Raises
    :class:`TrainStateError` when it does not fit ``optimizer`` (other groups, other
    shapes)."""
    own = optimizer.state_dict()
    if desc.get("type") != type(optimizer).__name__:
        raise TrainStateError(f"the member's optimizer is a {desc.get('type')!r}, this node's a "
                              f"{type(optimizer).__name__!r}")
    if optimizer_numel(desc) != values.numel():
        raise TrainStateError("the optimizer state's size differs from its description")
    if len(desc["groups"]) != len(own["param_groups"]):
        raise TrainStateError(f"the optimizer has {len(own['param_groups'])} param group(s), the member's "
                              f"{len(desc['groups'])}")
    groups = []
    for mine, theirs in zip(own["param_groups"], desc["groups"]):
        if not isinstance(theirs, dict):
            raise TrainStateError("a bad param group")
        g = dict(mine)
        for k, v in theirs.items():
            if k != "params":
                g[k] = restore_plain(v, mine.get(k))
        groups.append(g)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    at = 0
    for idx, key, shape, extra in desc["state"]:
        if idx >= len(params):
            raise TrainStateError(f"optimizer state for parameter {idx}; the optimizer has {len(params)}")
        if shape is None:
            value = restore_plain(extra)
        else:
            dtype = getattr(torch, extra, None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise TrainStateError(f"a bad dtype {extra!r}")
            if key in ("exp_avg", "exp_avg_sq", "momentum_buffer") and shape != list(params[idx].shape):
                raise TrainStateError(f"optimizer state {key!r} of parameter {idx} has shape {tuple(shape)}, the "
                                      f"parameter {tuple(params[idx].shape)}")
            n = math.prod(shape)
            # (load_state_dict moves it to the parameter's device and dtype)
            value = values[at:at + n].reshape(shape).to(dtype).clone()
            at += n
        state.setdefault(idx, {})[key] = value
    return {"state": state, "param_groups": groups}


def encode_meta(obj: Any) -> list[str]:
    """``obj`` (JSON-able) as short header strings: JSON, zlib, base64, cut in pieces.
    Raises ValueError when it would not fit a message header."""
    raw = zlib.compress(json.dumps(obj, separators=(",", ":")).encode(), 6)
    text = base64.b64encode(raw).decode("ascii")
    if len(text) > MAX_HEADER_CHARS:
        raise ValueError(f"the training state's description takes {len(text)} header bytes "
                         f"(at most {MAX_HEADER_CHARS})")
    return [text[i:i + CHUNK] for i in range(0, len(text), CHUNK)] or [""]


def decode_meta(chunks: Any) -> Any:
    """Undo :func:`encode_meta` on what a peer sent; raises :class:`TrainStateError`."""
    if not isinstance(chunks, list) or not all(isinstance(c, str) for c in chunks):
        raise TrainStateError("the training state's description must be a list of strings")
    try:
        raw = base64.b64decode("".join(chunks).encode("ascii"), validate=True)
        d = zlib.decompressobj()
        text = d.decompress(raw, MAX_META)
        if d.unconsumed_tail:
            raise TrainStateError(f"the training state's description is over {MAX_META} bytes")
        return json.loads(text)
    except TrainStateError:
        raise
    except Exception as e:  # base64, zlib and json each raise their own kinds on garbage
        raise TrainStateError(f"an undecodable training state description ({type(e).__name__})") from None
