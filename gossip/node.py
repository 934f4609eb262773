"""``gossip-node`` for a node of any size: one process, or a group of K under torchrun.

Three ways to start the same member:

- ``gossip-node --listen tcp://H:P ...``: one process, a group of one.
- ``gossip-node --nproc-per-node K --intra ddp|fsdp --listen tcp://H:P ...``: starts
  torchrun's elastic launcher for you, with K workers each running this module
  (``--max-restarts N``: a group whose rank died starts again, as a new life).
- ``torchrun --nproc-per-node K -m gossip.node --intra ddp|fsdp --listen tcp://H:P ...``:
  the same under a launcher of your own.

Every flag, TOML key, discovery option, checkpoint, output and signal behaves as
for a single node. The group's member id is ``H:P`` (rank 0's address); rank r
listens on ``H:P+r``. Rank 0 runs the member's protocol (:class:`~gossip.peer.group.GroupLeader`),
the other ranks follow it (:class:`~gossip.peer.group.GroupFollower`); the local
steps are the group's own collectives (DDP or FSDP).
"""

from __future__ import annotations

import logging
import signal
import math
import sys
import time
from typing import Any, Sequence


from gossip.groups.checkpoint import latest_group_checkpoint, load_group_checkpoint, restore_node, save_group_checkpoint
from gossip.groups.group import Group, start_group
from gossip.peer.group import GroupFollower, GroupLeader
from gossip.protocol.config import PeerConfig
from gossip.training.node import init_model
from gossip.training.tasks import get_task

__all__ = ["main", "run_group", "launch"]

log = logging.getLogger("gossip.group")


def launch(argv: Sequence[str], nproc: int, max_restarts: int) -> int:
    """Start torchrun's elastic launcher with ``nproc`` workers running this module on ``argv``;
    returns the launcher's exit status (0: every worker finished)."""
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
                          monitor_interval=0.5, start_method="spawn")
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        elastic_launch(config, sys.executable)("-u", "-m", "gossip.node", *argv)
    except SignalException as e:
        if e.sigval in (signal.SIGTERM, signal.SIGINT):
            # the launcher passed the signal on to its workers, and waited for them: rank 0
            # stopped the group at its next exchange, with a final checkpoint and a goodbye
            return 0
        print(f"gossip-node: the group's launcher got signal {int(e.sigval)}", file=sys.stderr)
        return 1
    except Exception as e:  # ChildFailedError: a worker failed for good (after its restarts)
        failures = getattr(e, "failures", None) or {}
        why = ", ".join(f"rank {r} exited with {f.exitcode}" for r, f in sorted(failures.items())) or \
            type(e).__name__
        print(f"gossip-node: the group failed ({why}; their errors are above)", file=sys.stderr)
        return 1
    return 0


def run_group(cfg: PeerConfig, intra: str, *, on_leader: Any = None) -> dict[str, Any]:
    """Train as this process's rank of a group started by torchrun; returns its summary.
    ``on_leader(leader)`` is called on rank 0 before it starts (a progress bar, signals)."""
    group = start_group(intra, cfg.device)
    try:
        return _run(cfg, group, on_leader)
    finally:
        group.close()


def _run(cfg: PeerConfig, group: Group, on_leader: Any) -> dict[str, Any]:
    task = get_task(cfg.task)
    model, view = group.wrap(init_model(task, cfg.seed, "cpu"))
    optimizer = task.optimizer(model.parameters())
    link = group.link()
    k, r = group.size, group.rank
    member: GroupLeader | GroupFollower
    if r == 0:
        member = GroupLeader(cfg, view.flat, view.fingerprint, link, k)
        if on_leader is not None:
            on_leader(member)
    else:
        member = GroupFollower(cfg, r, view.flat, view.fingerprint, link)
    resumed = None
    if cfg.resume:
        path = latest_group_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
        if path is not None:  # (every rank reads the same directory's newest)
            resumed = load_group_checkpoint(path, group, model, optimizer, view)
            if r == 0:
                member.life.resume_step = resumed["step"]
                member.resumed = (str(path), resumed)
    loss = math.nan
    with member:
        start = member.start()
        stream = task.stream(start.rank * k + r, start.world * k, cfg.split, cfg.seed, group.device)
        if resumed is not None and member.node.step <= resumed["step"] and not member.joined:
            restore_node(member.node, resumed, stream)  # a cluster restarted as a whole: this group's own state
        step = member.node.step
        view.after_mix()  # DDP: a joiner's slices taken, the replicas whole again
        every = cfg.eval_every or max(1, cfg.steps // 10)
        logging_metrics = bool(cfg.log or cfg.tensorboard)
        gaps: list[float] = []
        last = time.monotonic()
        while step < cfg.steps:
            step += 1
            optimizer.zero_grad(set_to_none=True)
            out = task.loss(model, stream.next())
            out.backward()
            optimizer.step()
            loss = float(out.detach())
            member.loss = loss
            if member.step(step):  # an exchange: DDP's replicas whole again, FSDP's shards in place
                node = member.node
                if node.state.flat is not view.flat:  # a held send moved the shard to fresh memory
                    home = view.moved(node.state.flat)
                    if home is not node.state.flat:
                        node.state.rehome(into=home)
                view.after_mix()
                if not view.is_bound():
                    raise RuntimeError("the model's parameters no longer live in the gossip shard")
            if member.stopped:
                break
            step = member.node.step  # a new life continues at its donor's step
            if logging_metrics and step % every == 0:
                member.record(task.evaluate(model, group.device))  # every rank: FSDP's forward is a collective
            if cfg.checkpoint_dir and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                save_group_checkpoint(cfg.checkpoint_dir, step, group, model, optimizer, member.node, view, stream,
                                      members=list(member.node.members))
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        member.complete_pending()
        view.after_mix()
        if cfg.checkpoint_dir:
            save_group_checkpoint(cfg.checkpoint_dir, member.node.step, group, model, optimizer, member.node, view,
                                  stream, members=list(member.node.members))
        evaluation = task.evaluate(model, group.device)  # the whole model, every rank taking part
        group.barrier()  # every rank's last round is mixed before the group says goodbye
        member.finish()
        summary = member.summary(evaluation)
    summary.update(loss=loss, intra=group.intra, group_size=k, rank=r, device=str(group.device),
                   max_step_gap_s=max(gaps, default=0.0))
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gossip.node`` (torchrun's workers run this): ``gossip-node``'s own main."""
    from gossip.cli import node_main

    return node_main(argv)


if __name__ == "__main__":
    sys.exit(main())
