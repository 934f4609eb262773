"""A loop whose nodes hold shards of unequal length (the README's old
``dataset[rank::world_size]`` idiom, with more data on higher ranks): the node
whose data ends first must not make the others wait for round timeouts."""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import gossip

parser = argparse.ArgumentParser()
parser.add_argument("--base", type=int, default=300)
parser.add_argument("--extra", type=int, default=100)
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)
X = torch.randn(3000, 8)
y = X @ torch.randn(8, 1) + 0.1 * torch.randn(3000, 1)
model = nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
node = gossip.GossipNode(model, optimizer)
mine = list(range(node.rank, len(X), node.world_size))[: args.base + args.extra * node.rank]
loader = DataLoader(Subset(TensorDataset(X, y), mine), batch_size=50, shuffle=True)
for epoch in range(args.epochs):
    for xb, yb in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(xb), yb).backward()
        optimizer.step()
print(f"batches {len(loader) * args.epochs}")
node.close()
