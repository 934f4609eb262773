"""torch.distributed inside a node: a group of K processes that is one gossip member.

A group is K processes started by torchrun (``gossip-node --nproc-per-node K``
starts torchrun's launcher for you), one per device. Inside it, torch.distributed
does what it does best:

``intra="ddp"``
    every rank holds a replica; :class:`~torch.nn.parallel.DistributedDataParallel`
    all-reduces the gradients every step, so the replicas stay equal.
``intra="fsdp"``
    PyTorch's ``fully_shard``: parameters, gradients and optimizer state are
    sharded, so the model only has to fit across the group.

Between groups the cluster stays masterless gossip, and a group is one member:
rank 0 runs the member's protocol (:mod:`gossip.peer.group`), and rank r
exchanges only its part of the parameters (its
:class:`~gossip.training.shards.ShardView`) with rank r of each neighbour group.
This module starts the process group (:func:`start_group`) or takes the user's
(:func:`current_group`), wraps the model (:meth:`Group.wrap`) or takes one the user
wrapped (:func:`wrapped`, :func:`shard_view`: ``GossipNode`` under torchrun), and gives
the ranks their channel (:meth:`Group.link`, over torchrun's store).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from gossip.core.state import FlatState
from gossip.training.shards import FsdpShards, ReplicaSlice, ShardView
from gossip.groups.link import StoreLink
from gossip.training.node import resolve_device

__all__ = ["INTRA", "GroupEnv", "GroupError", "Group", "ShardView", "FsdpShards", "ReplicaSlice", "group_env",
           "start_group", "current_group", "wrapped", "shard_view"]

log = logging.getLogger("gossip.group")

INTRA = ("ddp", "fsdp")

_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class GroupError(ValueError):
    """A group that cannot be set up as asked (bad launch, bad option); the driver exits 2."""


@dataclass(frozen=True)
class GroupEnv:
    """Where torchrun put this process; a group of one when not launched by it."""

    rank: int = 0
    local_rank: int = 0
    size: int = 1
    local_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    launched: bool = False  # torchrun's variables are set


def _int_var(env: Mapping[str, str], name: str, lo: int) -> int:
    text = env.get(name)
    if text is None:
        raise GroupError(f"{name} is not set, but torchrun's other variables are: launch with torchrun "
                         f"(it sets {', '.join(_TORCHRUN_VARS)})")
    try:
        value = int(text)
    except ValueError:
        raise GroupError(f"{name} must be an integer, got {text!r}") from None
    if value < lo:
        raise GroupError(f"{name} must be >= {lo}, got {value}")
    return value


def group_env(environ: Mapping[str, str] | None = None) -> GroupEnv:
    """Read torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT``; none of them set means a group of one.

    >>> group_env({}).size
    1
    >>> group_env({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
    ...            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}).rank
    1
    """
    env = os.environ if environ is None else environ
    if not any(v in env for v in ("RANK", "WORLD_SIZE")):
        return GroupEnv()
    size = _int_var(env, "WORLD_SIZE", 1)
    rank = _int_var(env, "RANK", 0)
    local_rank = _int_var(env, "LOCAL_RANK", 0)
    local_size = _int_var(env, "LOCAL_WORLD_SIZE", 1)
    if rank >= size:
        raise GroupError(f"RANK {rank} is not below WORLD_SIZE {size}")
    if local_rank >= local_size:
        raise GroupError(f"LOCAL_RANK {local_rank} is not below LOCAL_WORLD_SIZE {local_size}")
    addr = env.get("MASTER_ADDR")
    if not addr:
        raise GroupError("MASTER_ADDR is not set: launch with torchrun")
    port = _int_var(env, "MASTER_PORT", 1)
    return GroupEnv(rank, local_rank, size, local_size, addr, port, True)


@dataclass
class Group:
    """This process's place in its group and the group's process group.

    Build it with :func:`start_group`. ``pg`` is None for a group of one
    (no torchrun): everything then works as for a single node.
    """

    env: GroupEnv
    intra: str
    device: torch.device
    backend: str | None
    pg: Any = None
    owns_pg: bool = True  # False for the process group of the user's own (current_group): never destroyed here

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def size(self) -> int:
        return self.env.size

    def wrap(self, model: nn.Module) -> tuple[nn.Module, ShardView]:
        """Put ``model`` on this rank's device and wrap it for ``intra``; returns the
        module to train (build the optimizer over its parameters) and this rank's
        :class:`ShardView`.

        Every rank must pass the same model (same initial values): DDP broadcasts
        rank 0's anyway, FSDP shards what each rank holds. FSDP shards each direct
        child that has parameters, then the root (a parameter of the root itself
        is sharded with the root's group). A model ``fully_shard``-ed already (say,
        built on the meta device, sharded, then ``to_empty``) is taken as it is:
        no rank then ever holds the whole model.
        """
        if self.intra == "fsdp":
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if not isinstance(model, FSDPModule):
                model = model.to(self.device)
                for child in model.children():
                    if any(True for _ in child.parameters()):
                        fully_shard(child)
                fully_shard(model)
            return model, FsdpShards(model, self)
        model = model.to(self.device)
        state = FlatState(model)  # before DDP: it must see the parameters where they stay
        if self.pg is None:
            return model, ReplicaSlice(state, self)
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids), ReplicaSlice(state, self)

    def barrier(self) -> None:
        if self.pg is not None:
            dist.barrier()

    def gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (as many on each), rank by rank: a collective, so also a
        barrier; every rank calls it."""
        if self.pg is None:
            return [list(values)]
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine)
        return [t.tolist() for t in every]

    def link(self) -> StoreLink | None:
        """The ranks' channel (rank 0's decisions), over the process group's store; None
        for a group of one."""
        if self.pg is None:
            return None
        # a prefix per life: under torchrun --max-restarts, a store that outlives a life (the agent's)
        # must not show the next life the dead one's decisions
        life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"gossip-link/life-{life}/", dist.distributed_c10d._get_default_store())
        return StoreLink(store, self.rank, self.size)

    def close(self) -> None:
        """Leave the process group (the group's end), unless it is the user's (:func:`current_group`)."""
        if self.pg is not None and self.owns_pg and dist.is_initialized():
            dist.destroy_process_group()
        self.pg = None


def start_group(intra: str = "ddp", device: str = "auto", environ: Mapping[str, str] | None = None, *,
                timeout: float = 300.0) -> Group:
    """Join this process's group: read torchrun's environment, pick the device
    (``auto``: ``cuda:LOCAL_RANK`` when CUDA is present, else CPU) and start the
    process group (NCCL on CUDA, gloo on CPU).

    ``timeout``: seconds a collective waits for the group's other ranks before it
    fails (a rank that died takes its group down instead of hanging it).

    Without torchrun this is a group of one; ``intra="fsdp"`` then raises
    :class:`GroupError` (sharding needs the ranks torchrun starts).
    """
    if intra not in INTRA:
        raise GroupError(f"intra must be one of {', '.join(INTRA)}, got {intra!r}")
    env = group_env(environ)
    if intra == "fsdp" and not env.launched:
        raise GroupError("intra 'fsdp' shards the model over the ranks of a group: start the node with "
                         "torchrun --nproc-per-node K (RANK and WORLD_SIZE are not set)")
    if env.launched and device == "auto" and torch.cuda.is_available():
        dev = torch.device("cuda", env.local_rank % torch.cuda.device_count())
    else:
        dev = resolve_device(device)
    if not env.launched:
        return Group(env, intra, dev, None)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"device_id": dev} if dev.type == "cuda" else {}
        life = os.environ.get("TORCHELASTIC_RESTART_COUNT") if environ is None else None
        if life is not None:
            kwargs["store"] = _life_store(env, life, timeout)
        else:
            # torchrun's own environment: env:// (it may hand over the agent's store); one passed in: tcp://
            kwargs["init_method"] = "env://" if environ is None else f"tcp://{env.master_addr}:{env.master_port}"
        dist.init_process_group(backend, rank=env.rank, world_size=env.size,
                                timeout=datetime.timedelta(seconds=timeout), **kwargs)
    return Group(env, intra, dev, backend, dist.group.WORLD)


def current_group(intra: str, device: torch.device) -> Group:
    """This process's group over the process group the user initialised already (DDP and
    ``fully_shard`` need one): the whole default group is the gossip member's group, and
    nothing is initialised again, nor destroyed by :meth:`Group.close`.

    ``intra``: how the user wrapped the model; ``device``: where this rank's model lives.
    """
    if intra not in INTRA:
        raise GroupError(f"intra must be one of {', '.join(INTRA)}, got {intra!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise GroupError("torch.distributed's process group is not initialised: call "
                         "torch.distributed.init_process_group() before wrapping the model")
    rank, size = dist.get_rank(), dist.get_world_size()
    try:
        local, local_size = int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", size))
        port = int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else None
    except ValueError as e:
        raise GroupError(f"torchrun's environment: {e}") from None
    env = GroupEnv(rank, local, size, local_size, os.environ.get("MASTER_ADDR"), port, True)
    return Group(env, intra, device, str(dist.get_backend()), dist.group.WORLD, owns_pg=False)


def wrapped(model: nn.Module) -> tuple[str, nn.Module]:
    """How ``model`` is spread over its group: ``("ddp", the module DDP wraps)`` or
    ``("fsdp", model)``; anything else is a :class:`~gossip.groups.group.GroupError` saying
    what to do."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "ddp", model.module
    if isinstance(model, FSDPModule):
        return "fsdp", model
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    where = f"a torch.distributed world of {world} processes" if world else "torchrun (WORLD_SIZE > 1)"
    if type(model).__name__ == "FullyShardedDataParallel":
        raise GroupError(f"GossipNode in {where} takes a model sharded with fully_shard (FSDP2), not "
                         "FullyShardedDataParallel (FSDP1): fully_shard each block, then the root")
    raise GroupError(f"GossipNode in {where} makes each process one rank of a group: give it the model wrapped "
                     f"for the group, torch.nn.parallel.DistributedDataParallel(model) or fully_shard(model) "
                     f"(after torch.distributed.init_process_group), not a plain {type(model).__name__}; "
                     "or run one process per gossip node, without torchrun")


def _check_spans_world(intra: str, model: nn.Module, view: ShardView | None = None) -> None:
    """The group is the whole default process group: DDP's or FSDP's group must be it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if intra == "ddp":
        pg = getattr(model, "process_group", None)
        size = dist.get_world_size(pg) if pg is not None else world
        if size != world:
            raise GroupError(f"DistributedDataParallel runs over a process group of {size} of the world's {world} "
                             "processes; GossipNode's group is the whole world (one gossip member per torchrun)")
        return
    assert isinstance(view, FsdpShards)
    for fp in view.params:
        info = fp.mesh_info
        if type(info).__name__ != "FSDPMeshInfo" or info.shard_mesh_size != world or info.shard_mesh_rank != rank:
            raise GroupError(f"fully_shard over a mesh of {tuple(info.mesh.shape)} (rank {info.shard_mesh_rank}); "
                             f"GossipNode needs a 1-D mesh over the whole world of {world} (HSDP is not supported)")


def shard_view(intra: str, model: nn.Module, group: Group) -> ShardView:
    """This rank's :class:`~gossip.training.shards.ShardView` of a model the user wrapped already.

    DDP: :class:`~gossip.core.state.FlatState` over the wrapped module, after DDP was built.
    That re-homes the parameters into one vector by ``param.data = view``, which keeps each
    parameter object and (same dtype and device) its gradient accumulator, where DDP's
    reducer hooks sit; the reducer copies gradients into its own buckets and never keeps
    a parameter's storage, and DDP reads the module's buffers again before each buffer
    broadcast (``_sync_buffers``). So DDP trains bit for bit as without it, parameters and
    buffers, also with ``gradient_as_bucket_view=True``; after a later
    :meth:`~gossip.core.state.FlatState.rehome` too (the parameters: ``after_mix`` then
    broadcasts each rank's slice, BatchNorm's statistics included).
    tests/groups/test_user_loop_real.py checks these against plain DDP. An optimizer
    built before keeps working (the same parameter objects).
    """
    if intra == "fsdp":
        view: ShardView = FsdpShards(model, group)
        _check_spans_world(intra, model, view)
        return view
    _check_spans_world(intra, model)
    return ReplicaSlice(FlatState(model.module), group)


def _life_store(env: GroupEnv, life: str, timeout: float) -> Any:
    """torchrun's store, under a prefix of this life's own (``TORCHELASTIC_RESTART_COUNT``).

    After ``--max-restarts`` brings a group back, the agent's store (same address,
    same port) still holds the keys the dead life's process group wrote there (each
    rank's gloo address among them): a new life reading those would connect to
    ranks that are gone. A prefix per life keeps the lives apart."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(env.master_addr, env.master_port, env.size, is_master=not agent and env.rank == 0,
                          timeout=datetime.timedelta(seconds=timeout), multi_tenant=True)
    return dist.PrefixStore(f"gossip-group/life-{life}/", store)
