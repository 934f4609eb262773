"""A group's run, on every rank: torchrun's launcher for ``gossip-node --nproc-per-node K``
(:func:`launch`), the group's training loop (:func:`run_group`), and a single process
gossiping as a group of K slices (:func:`run_slices`, ``gossip-node --as-group K``).

Rank 0 runs the member's protocol (:class:`~gossip.peer.group.GroupLeader`), the other
ranks follow it (:class:`~gossip.peer.group.GroupFollower`); the local steps are the
group's own collectives (DDP or FSDP). The entry point is :mod:`gossip.node`.
"""

from __future__ import annotations

import logging
import signal
import math
import sys
import time
from typing import Any, Sequence

import torch

from gossip.groups.checkpoint import latest_group_checkpoint, load_group_checkpoint, restore_node, save_group_checkpoint
from gossip.groups.group import Group, start_group
from gossip.peer.group import GroupFollower, GroupLeader, rank_counts
from gossip.protocol.config import PeerConfig
from gossip.training.node import init_model
from gossip.training.tasks import get_task

__all__ = ["launch", "run_group", "run_slices"]

log = logging.getLogger("gossip.group")


def launch(argv: Sequence[str], nproc: int, max_restarts: int) -> int:
    """Start torchrun's elastic launcher with ``nproc`` workers running :mod:`gossip.node` on ``argv``;
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
        member.listen()
        group.barrier()  # every rank listens before rank 0 says hello: a joiner's ranks are all there
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
        counts = group.gather_ints(member.round_counts)  # (a barrier: every rank's last round is mixed
        member.finish()                                  # before the group says goodbye)
        summary = member.summary(evaluation)
    summary.update(loss=loss, intra=group.intra, group_size=k, rank=r, device=str(group.device),
                   max_step_gap_s=max(gaps, default=0.0), **rank_counts(counts))
    return summary


def run_slices(cfg: PeerConfig, k: int, *, on_leader: Any = None) -> dict[str, Any]:
    """One process gossiping as a group of ``k`` DDP ranks (``gossip-node --as-group K``), so
    that it mixes with such groups: its model's flat vector in K slices, slice r exchanged
    by a thread at ``HOST:PORT+r`` with rank r of the other members, exactly as rank r of a
    DDP group of K (the same layout and fingerprints). The process trains its one model;
    the slice threads mix between its steps. Returns rank 0's summary."""
    import threading

    from gossip.core.state import FlatState
    from gossip.groups.link import LocalLink
    from gossip.training.node import resolve_device
    from gossip.training.shards import ReplicaSlice, SlicePlace, take_slices

    if cfg.checkpoint_dir or cfg.resume:
        raise ValueError("--as-group does not write or read checkpoints yet: leave out --checkpoint-dir "
                         "and --resume (a restarted node takes the cluster's state when it joins)")
    task = get_task(cfg.task)
    device = resolve_device(cfg.device)
    model = init_model(task, cfg.seed, device)
    state = FlatState(model)
    views = [ReplicaSlice(state, SlicePlace(r, k, device)) for r in range(k)]
    optimizer = task.optimizer(model.parameters())
    link = LocalLink(k)
    leader = GroupLeader(cfg, views[0].flat, views[0].fingerprint, link.rank(0), k)
    if on_leader is not None:
        on_leader(leader)
    followers = [GroupFollower(cfg, r, views[r].flat, views[r].fingerprint, link.rank(r)) for r in range(1, k)]
    ranks: list[GroupLeader | GroupFollower] = [leader, *followers]
    listening = threading.Barrier(k)  # every slice listens before slice 0 says hello
    # every slice's node is built over its slice before the first step: a node takes its slice's
    # values when it is built and writes them back when it binds to the slice, so a step between
    # the two was lost on that slice (CI: one step's update of slice 1, 0.003 off the reference)
    started = threading.Barrier(k)
    step_ready = threading.Barrier(k)  # the process's step is done: every slice's exchange may run
    step_mixed = threading.Barrier(k)  # every slice mixed: the next step may run
    done = threading.Event()  # set by the main thread, between two steps, when training ends
    errors: list[BaseException] = []

    def follow(member: GroupFollower) -> None:
        try:
            with member:
                member.listen()
                listening.wait()
                member.start()
                started.wait()
                step = member.node.step
                while True:
                    step_ready.wait()
                    if done.is_set():  # (read after the barrier: the main thread set it before)
                        break
                    step += 1
                    member.step(step)
                    step_mixed.wait()
                    step = member.node.step
                member.complete_pending()
                member.finish()
        except threading.BrokenBarrierError:
            pass
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            for barrier in (listening, started, step_ready, step_mixed):
                barrier.abort()

    threads = [threading.Thread(target=follow, args=(f,), name=f"slice-{f.rank}", daemon=True) for f in followers]
    for t in threads:
        t.start()
    loss = math.nan
    try:
        with leader:
            leader.listen()
            listening.wait()
            start = leader.start()
            started.wait()
            streams = [task.stream(start.rank * k + r, start.world * k, cfg.split, cfg.seed, device)
                       for r in range(k)]  # this member's share of the data: K ranks' streams
            step = leader.node.step
            every = cfg.eval_every or max(1, cfg.steps // 10)
            logging_metrics = bool(cfg.log or cfg.tensorboard)
            while step < cfg.steps and not errors:
                optimizer.zero_grad(set_to_none=True)
                batch = tuple(torch.cat(parts) for parts in zip(*(s.next() for s in streams)))
                out = task.loss(model, batch)  # the K ranks' batches at once: DDP's gradient
                out.backward()
                optimizer.step()
                loss = float(out.detach())
                leader.loss = loss
                step += 1
                step_ready.wait()
                leader.step(step)
                step_mixed.wait()
                take_slices(views, [m.node.state for m in ranks])  # (a send held in place moved a slice)
                if leader.stopped:
                    break
                step = leader.node.step
                if logging_metrics and step % every == 0:
                    leader.record(task.evaluate(model, device))
            done.set()
            step_ready.wait()  # the slice threads see the end
            leader.complete_pending()
            evaluation = task.evaluate(model, device)
            leader.finish()  # serves joiners, then tells the slices to exit
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            summary = leader.summary(evaluation)
            summary.update(rank_counts([m.round_counts for m in ranks]))
    except threading.BrokenBarrierError:
        raise errors[0] if errors else RuntimeError("a slice thread stopped") from None
    except BaseException:
        for barrier in (listening, started, step_ready, step_mixed):
            barrier.abort()
        raise
    summary.update(loss=loss, intra="slices", group_size=k, rank=0, device=str(device))
    return summary
