"""Train groups that gossip shard by shard: the driver of :class:`gossip.groups.member.GroupMember`.

Start each group with torchrun; every rank runs the same command::

    torchrun --nproc-per-node 2 --master-port 29501 -m gossip.groups.run \\
        --group 127.0.0.1:7000 --groups 127.0.0.1:7000,127.0.0.1:7100 --intra fsdp --steps 20 --period 2
    torchrun --nproc-per-node 2 --master-port 29502 -m gossip.groups.run \\
        --group 127.0.0.1:7100 --groups 127.0.0.1:7000,127.0.0.1:7100 --intra fsdp --steps 20 --period 2

Rank r of group ``HOST:PORT`` gossips on ``HOST:PORT+r``. Each rank trains on its own
data shard (group g's rank r: shard ``g*K + r`` of ``G*K``), the group's optimizer
steps every local step (DDP or FSDP), and every ``--period`` steps rank 0 decides
a synchronous round for the whole group and each rank mixes its shard with rank r
of the neighbour groups. ``--out DIR`` writes each rank's figures
(``rank-PORT-R.json``) and the group's final parameters (``params-PORT.pt``, from rank 0).
``--checkpoint-dir DIR --checkpoint-every N`` writes sharded checkpoints
(:mod:`gossip.groups.checkpoint`); ``--resume`` starts from the newest one, with
the same group size.

Bad input (``--intra fsdp`` without torchrun, groups of different sizes) exits 2.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from typing import Sequence

import torch

from gossip.groups.checkpoint import (
    latest_group_checkpoint,
    load_group_checkpoint,
    save_group_checkpoint,
)
from gossip.groups.control import GroupControl
from gossip.groups.group import INTRA, GroupError, start_group
from gossip.groups.member import GroupMember
from gossip.mixing.settings import MixingSettings
from gossip.protocol.timing import Timing
from gossip.training.node import init_model
from gossip.training.tasks import get_task

__all__ = ["main", "run"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gossip.groups.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--group", required=True, help="this group's member id HOST:PORT (rank r listens on PORT+r)")
    p.add_argument("--groups", required=True, help="every group's member id, comma-separated (this one too)")
    p.add_argument("--intra", choices=INTRA, default="ddp", help="inside the group: replicas or shards")
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK when CUDA is present), cpu, cuda:N")
    p.add_argument("--task", default="synthetic")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--period", type=int, default=1)
    p.add_argument("--compression", default="none")
    p.add_argument("--overlap", action="store_true", help="a round's messages travel during the next local steps")
    p.add_argument("--topology", default="ring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="synchronous round timeout, seconds")
    p.add_argument("--connect-timeout", type=float, default=60.0, help="how long to wait for the other groups")
    p.add_argument("--heartbeat", type=float, default=Timing.heartbeat,
                   help="seconds between rank 0's pings to other groups")
    p.add_argument("--dead-after", type=float, default=Timing.dead_after,
                   help="a group whose rank 0 is silent this long is dropped (detection: dead-after + heartbeat)")
    p.add_argument("--join-timeout", type=float, default=Timing.join_timeout,
                   help="how long a joining group waits for its donor's shards")
    p.add_argument("--stop-file", default=None, help="once this file exists, rank 0 ends the run at the next round")
    p.add_argument("--trace", action="store_true", help="one JSON line per event on stderr ('trace {...}')")
    p.add_argument("--emulate", default=None, help="this rank's link, e.g. bandwidth=1Gbit,latency=1ms")
    p.add_argument("--out", default=None, help="directory for each rank's figures and the final parameters")
    p.add_argument("--checkpoint-dir", default=None, help="where the group writes its sharded checkpoints")
    p.add_argument("--checkpoint-every", type=int, default=0, help="local steps between checkpoints (0: none)")
    p.add_argument("--resume", action="store_true", help="start from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--json", action="store_true", help="rank 0 prints a one-line JSON summary")
    return p


def run(args: argparse.Namespace) -> dict:
    """Train as this process's rank; returns its summary."""
    groups = tuple(g.strip() for g in args.groups.split(",") if g.strip())
    if args.group not in groups:
        raise GroupError(f"--group {args.group} is not in --groups {args.groups}")
    try:
        timing = Timing(heartbeat=args.heartbeat, dead_after=args.dead_after, join_timeout=args.join_timeout)
    except ValueError as e:
        raise GroupError(str(e)) from None
    mixing = MixingSettings(compression=args.compression, period=args.period, overlap=args.overlap)
    group = start_group(args.intra, args.device)
    try:
        task = get_task(args.task)
        model, view = group.wrap(init_model(task, args.seed, "cpu"))
        optimizer = task.optimizer(model.parameters())
        k = group.size
        index = sorted(groups).index(args.group)
        stream = task.stream(index * k + group.rank, len(groups) * k, "iid", args.seed, group.device)
        member = GroupMember(group, view, args.group, sorted(groups), mixing=mixing, topology=args.topology,
                             timeout=args.timeout, emulate=args.emulate, seed=args.seed)
        life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

        def trace(event: str, fields: dict | None = None) -> None:
            if args.trace:
                line = {"event": event, "group": args.group, "rank": group.rank, "pid": os.getpid(), "life": life,
                        "time": time.time(), **(fields or {})}
                sys.stderr.write("trace " + json.dumps(line) + "\n")  # one write: the ranks share the stream
                sys.stderr.flush()

        plane = None
        if group.rank == 0:
            plane = member.plane = GroupControl(member, timing=timing,
                                                on_event=lambda kind, e: trace(kind, {k: v for k, v in e.items()
                                                                                      if k != "event"}))
        with member:
            if plane is not None:
                plane.start()
            first = 1
            if args.resume:
                path = latest_group_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
                if path is None:
                    raise GroupError(f"--resume: no checkpoint in --checkpoint-dir {args.checkpoint_dir}")
                first = load_group_checkpoint(path, group, model, optimizer, member, stream) + 1
            member.connect(args.connect_timeout)
            if member.donor is not None:  # the others train already: a new life, pulling each shard
                trace("joining", {"donor": member.donor})
                first = member.join(args.join_timeout) + 1
                trace("joined", {"donor": member.donor, "step": first - 1, "round": member.node.round})
            trace("training", {"step": first})
            loss = float("nan")
            gaps: list[float] = []  # seconds between the ends of consecutive local steps (waits included)
            last = time.monotonic()
            step = first - 1
            while step < args.steps:
                step += 1
                optimizer.zero_grad(set_to_none=True)
                out = task.loss(model, stream.next())
                out.backward()
                optimizer.step()
                loss = float(out.detach())
                if step % args.period == 0:
                    if plane is not None and args.stop_file and os.path.exists(args.stop_file):
                        plane.request_stop()
                    member.exchange(step)
                    if member.stopped:
                        break
                    if member.rejoining:  # dropped by a stronger cluster: its shards, and its step
                        trace("joining", {"donor": member.donor})
                        step = member.join(args.join_timeout)
                        trace("joined", {"donor": member.donor, "step": step, "round": member.node.round})
                    if not view.is_bound():
                        raise RuntimeError("the model's parameters no longer live in the gossip shard")
                    if plane is not None:
                        trace("round", {"round": member.node.round, "step": step, "members": list(member.members)})
                if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
                    save_group_checkpoint(args.checkpoint_dir, step, group, model, optimizer, member, stream)
                now = time.monotonic()
                gaps.append(now - last)
                last = now
            member.finish()  # with --overlap, the last round is still in flight
            summary = member.summary()
            group.barrier()  # every rank's last round is mixed before the group says goodbye
            if plane is not None:
                plane.bye(member.node.round)
                summary.update(incarnation=plane.incarnation, events=list(plane.events))
            trace("done", {"step": step, "round": member.node.round})
        summary.update(loss=loss, steps=args.steps, intra=args.intra, device=str(group.device), first_step=first,
                       last_step=step, step_gaps=gaps, life=life)
        full = view.full_state()
        if args.out:
            port = args.group.rpartition(":")[2]
            with open(os.path.join(args.out, f"rank-{port}-{group.rank}.json"), "w") as f:
                json.dump(summary, f)
            if group.rank == 0:
                torch.save(full, os.path.join(args.out, f"params-{port}.pt"))
        return summary
    finally:
        group.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        summary = run(args)
    except GroupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json and summary["rank"] == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "sent_sizes"}))
    return 0


if __name__ == "__main__":
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID` prints every thread's stack (a rank that hangs)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    sys.exit(main())
