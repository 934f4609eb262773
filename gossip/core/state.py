"""A flat parameter buffer over any ``nn.Module``.

Every floating-point parameter (and, by default, floating-point buffer such as
BatchNorm running statistics) becomes a view into one contiguous 1-D tensor.
Mixing rules then work on one vector: a single ``add_`` averages a whole model,
a snapshot for sending is one ``clone``, and a hash of the model is one pass.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FlatState", "model_fingerprint", "fingerprint_of", "sha256_of", "model_spec", "first_difference"]


@dataclass(frozen=True)
class _Slot:
    name: str
    module: nn.Module
    attr: str
    is_param: bool
    offset: int
    shape: torch.Size

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _float_entries(model: nn.Module, include_buffers: bool):
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            yield (f"{mod_name}.{attr}" if mod_name else attr), module, attr, p, True
        if include_buffers:
            for attr, b in module.named_buffers(recurse=False):
                if b is None or id(b) in seen or not b.is_floating_point():
                    continue
                seen.add(id(b))
                yield (f"{mod_name}.{attr}" if mod_name else attr), module, attr, b, False


def sha256_of(t: torch.Tensor) -> str:
    """The hash of a tensor's bytes: equal hashes mean bit-identical values (any dtype)."""
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def model_fingerprint(names_shapes_dtypes: list[tuple[str, tuple[int, ...], str]]) -> str:
    """Hash of parameter names, shapes and dtypes: two nodes mix only when these agree."""
    h = hashlib.sha256()
    for name, shape, dtype in names_shapes_dtypes:
        h.update(f"{name}:{tuple(shape)}:{dtype};".encode())
    return h.hexdigest()[:16]


def fingerprint_of(model: nn.Module, include_buffers: bool = True) -> str:
    """The fingerprint :class:`FlatState` would give ``model``, without re-homing it."""
    entries = list(_float_entries(model, include_buffers))
    dtypes = {t.dtype for *_, t, _ in entries}
    dtype = str(dtypes.pop()) if len(dtypes) == 1 else "mixed"
    return model_fingerprint([(name, tuple(t.shape), dtype) for name, _, _, t, _ in entries])


def model_spec(model: nn.Module, include_buffers: bool = True) -> list[str]:
    """What the fingerprint hashes, readable: ``"name|shape|dtype"`` per floating tensor,
    in order (sent to a peer whose fingerprint differs, so both can name the difference)."""
    return [f"{name}|{'x'.join(map(str, t.shape))}|{str(t.dtype).split('.')[-1]}"
            for name, _, _, t, _ in _float_entries(model, include_buffers)]


def first_difference(mine: list[str], theirs: list[str]) -> str:
    """The first tensor where two :func:`model_spec` lists differ, in words.

    >>> first_difference(["fc.weight|4x8|float32", "fc.bias|4|float32"], ["fc.weight|4x16|float32"])
    "parameter 'fc.weight': shape (4, 8) float32 here, (4, 16) float32 there"
    >>> first_difference(["a|2|float32"], ["a|2|float32", "b|3|float32"])
    "parameter 'b' (shape (3,) float32) only there"
    """
    def words(entry: str) -> tuple[str, str]:
        name, _, rest = entry.partition("|")
        shape, _, dtype = rest.partition("|")
        dims = tuple(int(d) for d in shape.split("x") if d.isdigit())
        return name, f"{dims} {dtype}"

    for a, b in zip(mine, theirs):
        if a != b:
            (na, wa), (nb, wb) = words(a), words(b)
            if na == nb:
                return f"parameter {na!r}: shape {wa} here, {wb} there"
            return f"parameter {na!r} ({wa}) here where there is {nb!r} ({wb})"
    if len(mine) > len(theirs):
        name, w = words(mine[len(theirs)])
        return f"parameter {name!r} (shape {w}) only here"
    if len(theirs) > len(mine):
        name, w = words(theirs[len(mine)])
        return f"parameter {name!r} (shape {w}) only there"
    return "the same parameters (names, shapes, dtypes): another build of the model or of gossip"


class FlatState:
    """Re-home a model's floating tensors into one contiguous vector.

    After construction ``model``'s parameters are views of :attr:`flat`, so an
    optimizer step updates ``flat`` in place and an in-place change of ``flat``
    is the model's new weights. Build the optimizer before or after: parameter
    objects keep their identity, only their storage moves.

    Parameters
    ----------
    model : nn.Module
        All floating parameters must share one dtype and device.
    include_buffers : bool
        Also flatten floating buffers (BatchNorm statistics), so they are averaged too.

    Examples
    --------
    >>> m = nn.Linear(3, 2)
    >>> st = FlatState(m)
    >>> st.numel
    8
    >>> st.flat.zero_(); float(m.weight.abs().sum())
    0.0
    """

    def __init__(self, model: nn.Module, include_buffers: bool = True) -> None:
        entries = list(_float_entries(model, include_buffers))
        if not entries:
            raise ValueError("model has no floating-point parameters to gossip")
        dtypes = {t.dtype for *_, t, _ in entries}
        devices = {t.device for *_, t, _ in entries}
        if len(dtypes) != 1:
            raise ValueError(f"model mixes parameter dtypes {sorted(map(str, dtypes))}; cast it to one dtype")
        if len(devices) != 1:
            raise ValueError(f"model spans devices {sorted(map(str, devices))}; move it to one device")
        self.dtype = dtypes.pop()
        self.device = devices.pop()
        total = sum(t.numel() for *_, t, _ in entries)
        self.flat = torch.empty(total, dtype=self.dtype, device=self.device)
        self.slots: list[_Slot] = []
        offset = 0
        with torch.no_grad():
            for name, module, attr, t, is_param in entries:
                n = t.numel()
                view = self.flat[offset : offset + n].view_as(t)
                view.copy_(t)
                if is_param:
                    t.data = view
                else:
                    module._buffers[attr] = view
                self.slots.append(_Slot(name, module, attr, is_param, offset, t.shape))
                offset += n
        self.model = model
        self.fingerprint = model_fingerprint([(s.name, tuple(s.shape), str(self.dtype)) for s in self.slots])

    @property
    def numel(self) -> int:
        return self.flat.numel()

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def snapshot(self) -> torch.Tensor:
        """A copy of the current parameters (safe to send while training continues)."""
        return self.flat.detach().clone()

    def rehome(self, into: torch.Tensor | None = None) -> None:
        """Move the parameters to fresh memory (same values), leaving :attr:`flat`'s
        old memory to whoever still reads it (a send in flight).

        into : the memory to move to, a contiguous 1-D tensor of :attr:`numel`
            values of the same dtype (a row of the simulator's stacked replicas,
            :class:`gossip.sim.replicas.ReplicaRows`); default: a fresh tensor

        Parameters keep their identity (an optimizer built over them keeps
        working); only their storage moves, as at construction.
        """
        old = self.flat
        if into is None:
            new = torch.empty_like(old)
        elif into.shape != old.shape or into.dtype != old.dtype or not into.is_contiguous():
            raise ValueError(f"into must be a contiguous {old.dtype} tensor of shape {tuple(old.shape)}, "
                             f"got {into.dtype} {tuple(into.shape)}")
        else:
            new = into
        with torch.no_grad():
            new.copy_(old)
            for s in self.slots:
                view = new[s.offset : s.offset + s.numel].view(s.shape)
                if s.is_param:
                    getattr(s.module, s.attr).data = view
                else:
                    s.module._buffers[s.attr] = view
        self.flat = new

    def load_(self, values: torch.Tensor) -> None:
        """Overwrite the parameters in place from a flat tensor of the same size."""
        if values.numel() != self.numel:
            raise ValueError(f"flat state has {self.numel} values, got {values.numel()}")
        with torch.no_grad():
            self.flat.copy_(values.reshape(-1))

    def is_bound(self) -> bool:
        """True while every parameter is still a view of :attr:`flat` (an outside
        ``param.data = ...`` breaks the binding silently; this detects it)."""
        base = self.flat.untyped_storage().data_ptr()
        for s in self.slots:
            t = getattr(s.module, s.attr)
            if t.untyped_storage().data_ptr() != base:
                return False
        return True

    def rebind(self) -> None:
        """Make the module's tensors views of :attr:`flat` again, taking their current
        values: a framework that replaced them (``load_state_dict(assign=True)``, a
        ``param.data = ...``) breaks the binding (see :meth:`is_bound`)."""
        with torch.no_grad():
            for s in self.slots:
                t = getattr(s.module, s.attr)
                self.flat[s.offset : s.offset + s.numel].copy_(t.detach().reshape(-1))
                view = self.flat[s.offset : s.offset + s.numel].view(s.shape)
                if s.is_param:
                    getattr(s.module, s.attr).data = view
                else:
                    s.module._buffers[s.attr] = view

    def sha256(self) -> str:
        """Hash of the parameter bytes: equal hashes mean bit-identical models."""
        return sha256_of(self.flat)
