"""A group of devices as one gossip member: torch.distributed inside, sharded gossip between groups.

A group is K processes started by torchrun (``torchrun --nproc-per-node K ...``),
one per device. Inside it, torch.distributed does what it does best:

``intra="ddp"``
    every rank holds a replica; :class:`~torch.nn.parallel.DistributedDataParallel`
    all-reduces the gradients every step, so the replicas stay equal.
``intra="fsdp"``
    PyTorch's ``fully_shard``: parameters, gradients and optimizer state are
    sharded, so the model only has to fit across the group.

Between groups the cluster stays masterless gossip, and a group is one member:
rank r of a group exchanges only its part of the parameters with rank r of each
neighbour group, over a connection of its own, so K streams run in parallel.
Each rank's part is a :class:`ShardView`: one flat 1-D tensor that the mixing
rules and codecs act on exactly as on a whole model's
(:class:`gossip.core.state.FlatState`):

- FSDP: the rank's local shards of every parameter, padded as FSDP pads them,
  re-homed into one contiguous vector (:class:`FsdpShards`). FSDP's own
  all-gathers read that vector and the optimizer writes it, so there is no copy
  to keep in step.
- DDP: the rank's 1/K slice of the replica's flat vector (:class:`ReplicaSlice`);
  after mixing, each rank broadcasts its slice inside the group, so the
  replicas are equal again.

Rank r of every group holds the same layout (the same parameters, sharded the
same way), so the element-wise mixing of rank r's shards is exactly the mixing
of the whole models.

Addresses: a group's member id is ``HOST:PORT``, the gossip address of its rank
0; rank r listens on ``HOST:PORT+r`` (:func:`rank_address`). So a group that
knows a neighbour's member id knows the address of the neighbour's rank r, and
K consecutive ports must be free on each host.

One member, one view: rank 0 of a group decides (the neighbours, the round, the
verdict: :class:`Decision`), and :func:`agree` hands its decision to the other
ranks through the group's own process group. Groups must all have the same
size (:func:`check_group_sizes`).
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
from gossip.groups.shards import FsdpShards, ReplicaSlice, ShardView
from gossip.training.node import resolve_device

__all__ = ["INTRA", "VERDICTS", "GroupEnv", "GroupError", "GroupSizeError", "Group", "Decision", "ShardView",
           "FsdpShards", "ReplicaSlice", "group_env", "start_group", "agree", "check_group_sizes", "rank_address", "members_at"]

log = logging.getLogger("gossip.group")

INTRA = ("ddp", "fsdp")
# exchange this round / no exchange this round / end training / take shards from ``donor`` (rejoin)
VERDICTS = ("mix", "skip", "stop", "join")

_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class GroupError(ValueError):
    """A group that cannot be set up as asked (bad launch, bad option); the driver exits 2."""


class GroupSizeError(GroupError):
    """Groups of different sizes: rank r of one would have no partner in the other."""


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


def rank_address(group_id: str, rank: int) -> str:
    """The gossip address of rank ``rank`` of the group whose member id is ``HOST:PORT``:
    ``HOST:PORT+rank``.

    >>> rank_address("10.0.0.5:6000", 3)
    '10.0.0.5:6003'
    """
    host, sep, port = str(group_id).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"group id must be HOST:PORT, got {group_id!r}")
    p = int(port) + rank
    if not 0 < p < 65536:
        raise ValueError(f"group {group_id!r}: rank {rank} would listen on port {p}, outside 1-65535")
    return f"{host}:{p}"


def check_group_sizes(sizes: Mapping[str, int]) -> None:
    """Raise :class:`GroupSizeError` unless every group (member id -> ranks) has one size.

    >>> check_group_sizes({"a:1": 2, "b:1": 2})
    >>> check_group_sizes({"a:1": 2, "b:1": 4})
    Traceback (most recent call last):
    ...
    gossip.groups.group.GroupSizeError: group sizes differ: group a:1 has 2 ranks, group b:1 has 4 ranks; every group must have the same size (torchrun --nproc-per-node)
    """
    items = sorted(sizes.items())
    for gid, k in items:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise GroupError(f"group {gid} reports size {k!r}; a size is a positive integer")
    if items and any(k != items[0][1] for _, k in items):
        first = items[0]
        other = next((g, k) for g, k in items if k != first[1])
        raise GroupSizeError(f"group sizes differ: group {first[0]} has {_ranks(first[1])}, group {other[0]} has "
                             f"{_ranks(other[1])}; every group must have the same size (torchrun --nproc-per-node)")


def _ranks(k: int) -> str:
    return f"{k} rank" if k == 1 else f"{k} ranks"


@dataclass(frozen=True)
class Decision:
    """What rank 0 of a group decided for all of its ranks: the member list (group
    ids, in the order every member uses), the round and the verdict (:data:`VERDICTS`)."""

    round: int
    members: tuple[str, ...]
    verdict: str = "mix"
    # joiners (group ids, not in ``members``): after this round's mix, rank r sends its
    # shard to rank r of each; they are members from the next round on
    handover: tuple[str, ...] = ()
    donor: str | None = None  # verdict "join": the group whose shards every rank takes

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}, got {self.verdict!r}")
        if isinstance(self.round, bool) or not isinstance(self.round, int) or self.round < 0:
            raise ValueError(f"round must be a non-negative integer, got {self.round!r}")
        object.__setattr__(self, "members", tuple(self.members))
        object.__setattr__(self, "handover", tuple(self.handover))
        if (self.verdict == "join") != (self.donor is not None):
            raise ValueError("a donor goes with the verdict 'join', and only with it")
        if set(self.handover) & set(self.members):
            both = sorted(set(self.handover) & set(self.members))
            raise ValueError(f"a group handed its shards joins the round after: {both} cannot be a member of this one")


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

    def close(self) -> None:
        """Leave the process group (the group's end)."""
        if self.pg is not None and dist.is_initialized():
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


def agree(group: Group, decision: Decision | None) -> Decision:
    """Rank 0's ``decision``, on every rank of ``group`` (the others pass None or
    anything: rank 0's wins). A collective: every rank calls it for every decision."""
    if group.pg is None:
        if decision is None:
            raise ValueError("a group of one must make its own decision (got None)")
        return decision
    box = [decision if group.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, device=group.device if group.backend == "nccl" else None)
    out = box[0]
    if not isinstance(out, Decision):
        raise TypeError(f"rank 0 of the group broadcast {type(out).__name__}, not a Decision")
    return out


def members_at(groups: Sequence[str], rank: int) -> list[str]:
    """Rank ``rank``'s addresses of ``groups``, in the same order."""
    return [rank_address(g, rank) for g in groups]

