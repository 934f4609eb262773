"""A training loop of the user's own under torchrun, with GossipNode on every rank (for
tests/groups/test_user_loop_real.py).

    GOSSIP_LISTEN=127.0.0.1:7000 GOSSIP_PEERS=127.0.0.1:7100 \\
        python -m torch.distributed.run --standalone --nproc-per-node 2 tests/groups/own_loop.py \\
        --intra fsdp --steps 20 --out DIR

The model, optimizer and data are gossip-node's task's (``--task``, ``--seed``), so that a
group of this loop trains bit for bit as ``gossip-node --nproc-per-node 2`` on the same
schedule. Each rank writes ``DIR/rank-R.json`` (its summary, its data shard, the
sampler's indices, how it ended); rank 0 writes the group's whole parameters to
``DIR/params.pt``. With ``--collectives``, every rank calls the collectives across members
after its last step (after sleeping ``--pause`` seconds) and records what they returned.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import gossip
from gossip.training.node import init_model
from gossip.training.tasks import get_task


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--intra", choices=("ddp", "fsdp"), required=True)
    ap.add_argument("--task", default="synthetic:hidden=63,classes=5")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--period", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--metrics", default=None)  # (not --log: torchrun would take it for its --log-dir)
    ap.add_argument("--collectives", action="store_true")
    ap.add_argument("--pause", type=float, default=0.0)
    ap.add_argument("--pg-timeout", type=float, default=1800.0)  # the process group's collective timeout
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    task = get_task(args.task)
    model = init_model(task, args.seed, "cpu")  # the same start in every group
    if args.intra == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child)
        fully_shard(model)
    optimizer = task.optimizer(model.parameters())

    node = gossip.GossipNode(model, optimizer, topology="ring", period=args.period, seed=args.seed,
                             heartbeat=0.25, dead_after=10, settle=1, grace=5, timeout=60, wait_for_suspects=True,
                             checkpoint_dir=args.checkpoint_dir, log=args.metrics, eval_every=10)
    stream = task.stream(node.rank, node.world_size, "iid", args.seed)
    for _ in range(node.steps):  # the data position is the loop's own: a resumed group goes on from its step
        stream.next()
    start = node.steps
    ended = "steps"
    try:
        while node.steps < args.steps:
            optimizer.zero_grad(set_to_none=True)
            task.loss(model, stream.next()).backward()
            optimizer.step()  # counts the step; every period-th exchanges
        collectives = run_collectives(node, args.pause) if args.collectives else None
        summary = node.close()
    except SystemExit as e:  # a signal: the group stopped at one exchange, every rank closed there
        ended = f"exit {e.code}"
        collectives = None
        summary = node.close()
    if args.intra == "ddp":
        params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    else:
        params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # (a collective)
    rank = dist.get_rank()
    if rank == 0:
        torch.save(params, out / "params.pt")
    indices = [int(i) for i in node.sampler(range(40), shuffle=False)]
    record = {"group_rank": rank, "rank": node.rank, "world_size": node.world_size, "steps": node.steps,
              "members": node.members, "sampler": indices, "ended": ended, "id": node.id,
              "type": type(node).__name__, "start": start, "summary": summary, "collectives": collectives}
    (out / f"rank-{rank}.json").write_text(json.dumps(record, default=str))
    dist.destroy_process_group()
    return 0 if ended == "steps" else 143


def run_collectives(node: gossip.GossipNode, pause: float) -> dict:
    """The collectives across members, on every rank: an average weighted by 1 + the data
    shard, a tensor's average, every rank's (shard, group rank), and a barrier."""
    time.sleep(pause)  # (the other group's rank 0 waits for this one meanwhile)
    t0 = time.monotonic()
    shard = node.rank
    out = {"average": node.average(float(shard), weight=1.0 + shard),
           "tensor": node.average(torch.tensor([shard, 1.0]), weight=2.0).tolist(),
           "gather": [t.tolist() for t in node.all_gather(torch.tensor([shard, dist.get_rank()]))]}
    node.barrier()
    out["wait_s"] = time.monotonic() - t0
    return out


if __name__ == "__main__":
    sys.exit(main())
