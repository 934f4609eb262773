"""Checkpoints of a group: sharded state with ``torch.distributed.checkpoint``, atomic.

A checkpoint is a directory ``step-NNNNNNNN`` under the checkpoint directory:

- the model and optimizer state, written by every rank for its own shards with
  ``torch.distributed.checkpoint`` (FSDP: only the local shards; DDP: rank 0's
  replica, as DCP deduplicates);
- ``rank-R.pt`` per rank: what gossip keeps per shard (the mixing rules' state:
  CHOCO's public copies, an outer optimizer's anchor and momentum; the round and
  sequence number) and the rank's data stream position;
- ``group.pt``: the step and the group size.

All of it is written into ``step-NNNNNNNN.tmp`` first; after every rank has
finished, rank 0 renames the directory, so a checkpoint is either complete or
absent. Resuming needs the same group size (the shards are per rank).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from gossip.groups.group import Group, GroupError
from gossip.training.node import Node
from gossip.training.shards import ShardView

__all__ = ["save_group_checkpoint", "load_group_checkpoint", "latest_group_checkpoint", "restore_node"]

_NAME = re.compile(r"^step-(\d{8})$")


def latest_group_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``directory`` (unfinished ``.tmp`` ones never count)."""
    d = Path(directory)
    if not d.is_dir():
        return None
    found = sorted((int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name)) and p.is_dir())
    return found[-1][1] if found else None


def save_group_checkpoint(directory: str | os.PathLike, step: int, group: Group, model: torch.nn.Module,
                          optimizer: torch.optim.Optimizer, node: Node, view: ShardView, stream: Any = None,
                          members: list[str] | None = None) -> Path:
    """Write this group's state at local ``step`` (a collective: every rank calls it);
    ``node`` mixes this rank's shard ``view``; rank 0 also keeps the ``members`` it trains with."""
    final = Path(directory) / f"step-{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if group.rank == 0:
        tmp.mkdir(parents=True, exist_ok=True)
    group.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), no_dist=group.pg is None)
    torch.save({"rules": [ch.rule.state_dict() for ch in node.channels], "rounds": [ch.round for ch in node.channels],
                "seq": node.seq, "stream": stream.state_dict() if hasattr(stream, "state_dict") else None,
                "shard_numel": view.flat.numel()}, tmp / f"rank-{group.rank}.pt")
    group.barrier()
    if group.rank == 0:
        torch.save({"step": step, "group_size": group.size, "intra": group.intra, "members": list(members or [])},
                   tmp / "group.pt")
        if final.exists():  # this step again (the last step is also a --checkpoint-every step): the newer wins
            old = final.with_name(final.name + ".old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)  # (the name no longer counts: an older complete checkpoint is the latest now)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
    group.barrier()
    return final


def load_group_checkpoint(path: str | os.PathLike, group: Group, model: torch.nn.Module,
                          optimizer: torch.optim.Optimizer, view: ShardView, stream: Any = None) -> dict[str, Any]:
    """Resume the model, optimizer and data stream from the checkpoint ``path`` (a
    collective); returns what the node takes back (:func:`restore_node`): the step,
    this rank's mixing state, and the members rank 0 trained with.

    Raises :class:`~gossip.groups.group.GroupError` when it was written by a group of
    another size or with the other ``intra``.
    """
    path = Path(path)
    meta = torch.load(path / "group.pt", map_location="cpu", weights_only=True)
    if meta["group_size"] != group.size:
        raise GroupError(f"checkpoint {path} was written by a group of {meta['group_size']} ranks; this group has "
                         f"{group.size}: resume with torchrun --nproc-per-node {meta['group_size']}")
    if meta["intra"] != group.intra:
        raise GroupError(f"checkpoint {path} was written with intra {meta['intra']!r}, this group runs "
                         f"{group.intra!r}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path), no_dist=group.pg is None)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if not view.is_bound():
        raise RuntimeError("loading the checkpoint moved the parameters out of the gossip shard")
    mine = torch.load(path / f"rank-{group.rank}.pt", map_location="cpu", weights_only=True)
    if mine["shard_numel"] != view.flat.numel():
        raise GroupError(f"checkpoint {path}: rank {group.rank}'s shard has {mine['shard_numel']} values, this "
                         f"rank's {view.flat.numel()} (another model?)")
    if stream is not None and mine["stream"] is not None and hasattr(stream, "load_state_dict"):
        stream.load_state_dict(mine["stream"])
    return {"step": int(meta["step"]), "rules": mine["rules"], "rounds": mine["rounds"], "seq": int(mine["seq"]),
            "members": list(meta.get("members") or []), "stream": mine["stream"]}


def restore_node(node: Node, state: dict[str, Any], stream: Any = None) -> None:
    """Give ``node`` back the mixing state of :func:`load_group_checkpoint` (its rules' state,
    rounds, sequence number and step), and ``stream`` its data position when the stream
    was made after the load (a group's stream depends on where the cluster placed it)."""
    for ch, rs, rnd in zip(node.channels, state["rules"], state["rounds"]):
        ch.rule.load_state_dict(rs)
        ch.round = int(rnd)
    node.seq = int(state["seq"])
    node.step = int(state["step"])
    if stream is not None and state.get("stream") is not None and hasattr(stream, "load_state_dict"):
        stream.load_state_dict(state["stream"])
