"""The part of the parameters a rank of a group gossips: one flat vector over its shard.

See :mod:`gossip.groups.group`. :class:`FsdpShards` re-homes a ``fully_shard``-ed
model's local shards into one vector; :class:`ReplicaSlice` is rank r's 1/K
slice of a replica's flat vector (DDP, or a group of one). Either way rank r of
every group holds the same layout, so mixing rank r's shards element by element
is mixing the whole models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from gossip.core.state import FlatState, model_fingerprint

__all__ = ["ShardView", "FsdpShards", "ReplicaSlice", "RankPlace", "SlicePlace", "take_slices"]


class RankPlace(Protocol):
    """Where a rank sits in its group (what :class:`~gossip.groups.group.Group` gives a shard view)."""

    rank: int
    size: int
    device: torch.device
    pg: Any  # the group's process group (None for a group of one)


@dataclass(frozen=True)
class SlicePlace:
    """A :class:`RankPlace` with no process group: slice ``rank`` of ``size`` of a model that
    one process holds whole (``gossip-node --as-group K``, the simulator's groups)."""

    rank: int
    size: int
    device: torch.device = torch.device("cpu")
    pg: Any = None


class ShardView:
    """The part of the parameters this rank gossips: :attr:`flat`, one contiguous 1-D tensor.

    Attributes: ``flat`` (the shard itself; changing it changes the model),
    ``total`` (numel of the whole model), ``fingerprint`` (equal for rank r of
    every group running the same model with the same group size),
    ``resident`` (parameter values this process holds).
    """

    flat: torch.Tensor
    total: int
    fingerprint: str
    resident: int

    def after_mix(self) -> None:
        """The shard was mixed: make the group consistent again (a collective)."""

    def is_bound(self) -> bool:
        """True while the model's parameters are still views of :attr:`flat`."""
        raise NotImplementedError

    def moved(self, values: torch.Tensor) -> torch.Tensor:
        """The gossip shard moved to ``values`` (fresh memory: a send still held the old);
        make the model use them and return the tensor that is the shard from now on."""
        raise NotImplementedError

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters by name, on CPU, on every rank (a collective;
        for tests and final results, never during an exchange)."""
        raise NotImplementedError


def _fsdp_params(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    out = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for pg in module._get_fsdp_state()._fsdp_param_groups:
                out.extend(pg.fsdp_params)
    return out


class FsdpShards(ShardView):
    """A ``fully_shard``-ed model's local shards, re-homed into one flat vector.

    FSDP keeps each parameter's local shard padded (``_sharded_param_data``,
    what its all-gather reads) with the DTensor's local tensor a view of it.
    Both are pointed into :attr:`flat`, padding included, so the layout is the
    same on rank r of every group. This reaches into FSDP's parameter objects
    (torch 2.13 ``_fully_shard``); :meth:`is_bound` checks the binding held.
    """

    def __init__(self, model: nn.Module, group: RankPlace) -> None:
        self.model = model
        self.group = group
        self.params = _fsdp_params(model)
        if not self.params:
            raise ValueError("the model has no fully_shard-ed parameters")
        dtypes = {fp._sharded_param_data.dtype for fp in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"model mixes parameter dtypes {sorted(map(str, dtypes))}; cast it to one dtype")
        self.dtype = dtypes.pop()
        n = sum(fp._sharded_param_data.numel() for fp in self.params)
        self.flat = torch.empty(n, dtype=self.dtype, device=group.device)
        self._bind(self.flat, copy=True)
        self.total = sum(fp._orig_size.numel() for fp in self.params)
        self.resident = n
        self.fingerprint = model_fingerprint(
            [(fp._param_fqn if hasattr(fp, "_param_fqn") else str(i), tuple(fp.padded_sharded_param_size),
              str(self.dtype)) for i, fp in enumerate(self.params)] + [("fsdp", (group.size,), "")])

    def _bind(self, flat: torch.Tensor, copy: bool) -> None:
        offset = 0
        with torch.no_grad():
            for fp in self.params:
                old = fp._sharded_param_data
                n = old.numel()
                view = flat[offset:offset + n]
                if copy:
                    view.copy_(old)
                dim = fp.fsdp_placement.dim
                local = fp.sharded_param._local_tensor
                length = local.size(dim) if local.numel() > 0 else 0
                fp._sharded_param_data = view
                fp.sharded_param._local_tensor = view.view(fp.padded_sharded_param_size).narrow(dim, 0, length)
                offset += n
        self.flat = flat

    def is_bound(self) -> bool:
        lo = self.flat.data_ptr()
        hi = lo + self.flat.numel() * self.flat.element_size()
        for fp in self.params:
            for t in (fp._sharded_param_data, fp.sharded_param._local_tensor):
                if t.numel() and not lo <= t.data_ptr() < hi:
                    return False
        return True

    def moved(self, values: torch.Tensor) -> torch.Tensor:
        self._bind(values, copy=False)
        return values

    def full_state(self) -> dict[str, torch.Tensor]:
        return {name: p.full_tensor().detach().cpu() for name, p in self.model.named_parameters()}


class ReplicaSlice(ShardView):
    """Rank r's 1/K slice of a replicated model's flat vector (DDP, or a group of one).

    Slice r is ``flat[r*n//K : (r+1)*n//K]``, so slices differ by one element at
    most and rank r's is the same on every group. :meth:`after_mix` broadcasts
    each rank's slice to the others: the replicas are equal again.
    """

    def __init__(self, state: FlatState, group: RankPlace) -> None:
        self.state = state
        self.group = group
        n, k, r = state.numel, group.size, group.rank
        self.bounds = [(i * n // k, (i + 1) * n // k) for i in range(k)]
        lo, hi = self.bounds[r]
        self.flat = state.flat[lo:hi]
        self.total = n
        self.resident = n
        self.fingerprint = model_fingerprint([("replica", (state.fingerprint,), ""), ("slice", (r, k), "")])

    def after_mix(self) -> None:
        if self.group.pg is None or self.group.size == 1:
            return
        flat = self.state.flat
        for src, (lo, hi) in enumerate(self.bounds):
            dist.broadcast(flat[lo:hi], src=src)

    def is_bound(self) -> bool:
        lo, _ = self.bounds[self.group.rank]
        return self.state.is_bound() and self.flat.data_ptr() == self.state.flat[lo:].data_ptr()

    def moved(self, values: torch.Tensor) -> torch.Tensor:
        self.state.rehome()  # the whole replica to fresh memory: the old is still being sent
        lo, hi = self.bounds[self.group.rank]
        self.flat = self.state.flat[lo:hi]
        with torch.no_grad():
            self.flat.copy_(values)
        return self.flat

    def full_state(self) -> dict[str, torch.Tensor]:
        model = self.state.model
        return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


def take_slices(views: list[ReplicaSlice], states: list[FlatState]) -> bool:
    """After an exchange of one model's slices, each mixed by a node of its own
    (``gossip-node --as-group K``; ``states[r]`` is slice r's node's state), put every
    slice back where the model reads it; returns whether the model moved.

    A node whose send was still in flight when it mixed moved its slice to fresh memory,
    and the transport still reads the old: the whole model then moves to fresh memory too
    (the old is left to the sends in flight) and each slice takes its node's values there.
    Writing them into the old memory would change a message while it is being sent."""
    if all(st.flat.data_ptr() == v.flat.data_ptr() for v, st in zip(views, states)):
        return False
    model = views[0].state
    model.rehome()
    for v, st in zip(views, states):
        lo, hi = v.bounds[v.group.rank]
        v.flat = model.flat[lo:hi]
        st.rehome(into=v.flat)  # its mixed values, and it mixes the model's own memory again
    return True
