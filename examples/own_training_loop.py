"""Gossip inside a training loop of your own (the Horovod-style path).

Start one copy per node, each naming another as its peer:

    python examples/own_training_loop.py --listen 127.0.0.1:5555 --peers 127.0.0.1:5556 &
    python examples/own_training_loop.py --listen 127.0.0.1:5556 --peers 127.0.0.1:5555

The loop below is an ordinary PyTorch loop; the lines marked "gossip" are all
it takes to make it decentralized: ``optimizer.step()`` itself counts the steps
and exchanges every ``period`` of them. (With a ``DataLoader``, give it
``sampler=node.sampler(dataset)`` and loop ``for epoch in node.epochs(n, loader)``;
see the README.)
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import gossip
from gossip.training.tasks import SyntheticTask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--listen", required=True)
    ap.add_argument("--peers", default="")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--period", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)

    data = SyntheticTask()                       # any data of yours
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    node = gossip.GossipNode(model, opt, listen=args.listen, peers=args.peers,        # gossip
                             topology="ring", period=args.period, settle=1.0, heartbeat=0.2)
    X, y = data.X[node.rank::node.world_size], data.y[node.rank::node.world_size]      # this node's shard
    g = torch.Generator().manual_seed(node.rank)
    while node.steps < args.steps:              # the cluster's step count: everyone ends together
        idx = torch.randint(len(y), (32,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()                               # counts the step; every period-th exchanges and mixes
    ours = data.evaluate(model)
    cluster_accuracy = node.average(ours["accuracy"])                                   # gossip
    summary = node.close()                                                              # gossip
    print(json.dumps({"rank": node.rank, "world_size": node.world_size, **ours,
                      "cluster_accuracy": cluster_accuracy, "steps": summary["steps"],
                      "neighbor_distance": summary["neighbor_distance"], "bytes_sent": summary["bytes_sent"]}))


if __name__ == "__main__":
    main()
