"""Gossip in a training loop of your own under torchrun: each group of K processes (DDP or
FSDP inside) is one gossip member, and the groups gossip with each other.

Two groups of two processes on this machine (CPU, gloo):

    GOSSIP_LISTEN=127.0.0.1:7000 GOSSIP_PEERS=127.0.0.1:7100 \\
        torchrun --standalone --nproc-per-node 2 examples/torchrun_own_loop.py --intra fsdp &
    GOSSIP_LISTEN=127.0.0.1:7100 GOSSIP_PEERS=127.0.0.1:7000 \\
        torchrun --standalone --nproc-per-node 2 examples/torchrun_own_loop.py --intra fsdp

Every rank of a group gets the same ``GOSSIP_LISTEN``, the group's address: rank r binds
its port + r (leave K ports free per group). The loop is an ordinary DDP / FSDP loop; the
lines marked "gossip" are all it takes: ``GossipNode`` after wrapping the model, its
sampler (rank r of member m takes shard m*K + r of the data), its epochs, and ``close()``
on every rank. ``optimizer.step()`` counts the steps and exchanges every ``period``.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import gossip


def dataset(n: int = 2048, features: int = 32, classes: int = 10) -> TensorDataset:
    """A learnable classification set (a fixed random teacher), the same on every process."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(1))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--intra", choices=("ddp", "fsdp"), default="ddp")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--period", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # ("nccl" and the model on cuda:LOCAL_RANK on GPUs)

    ds = dataset()
    torch.manual_seed(0)  # the same starting model in every group
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    if args.intra == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    node = gossip.GossipNode(model, optimizer, period=args.period, topology="ring")          # gossip
    loader = DataLoader(ds, batch_size=32, sampler=node.sampler(ds))                          # gossip
    for epoch in node.epochs(args.epochs, loader):                                            # gossip
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()  # counts the step; every period-th exchanges with the other groups

    with torch.no_grad():  # the group's model on all the data (every rank: FSDP's forward is a collective)
        x, y = ds.tensors
        accuracy = float((model(x).argmax(1) == y).float().mean())
    summary = node.close()                                                                    # gossip
    out = {"member": node.id, "group_rank": dist.get_rank(), "shard": [node.rank, node.world_size],
           "members": node.members, "steps": summary["steps"], "accuracy": accuracy,
           "timed_out_rounds": summary["timed_out_rounds"]}
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
