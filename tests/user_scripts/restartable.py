"""A loop that checkpoints and can be killed and restarted: it continues at the
cluster's step and epoch. The test sets the last epoch later, in the file given
as --last (read after every epoch), so that the run lasts until the restarted
node is back whatever the machine's speed."""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import gossip

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoints", required=True)
parser.add_argument("--last", required=True)
args = parser.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)
X = torch.randn(600, 8)
data = TensorDataset(X, X @ torch.randn(8, 1))
model = nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
node = gossip.GossipNode(model, optimizer, checkpoint_dir=args.checkpoints, checkpoint_every=5,
                         heartbeat=0.25, dead_after=2.0, join_margin=10)
loader = DataLoader(data, batch_size=20, sampler=node.sampler(data))
print(f"start step {node.steps} steps per epoch {len(loader)}", flush=True)
for epoch in node.epochs(10**6, loader):
    batches = 0
    for xb, yb in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(xb), yb).backward()
        optimizer.step()
        batches += 1
    print(f"epoch {epoch} batches {batches} steps {node.steps}", flush=True)
    try:
        last = int(open(args.last).read())
    except (OSError, ValueError):
        last = 10**6
    if epoch >= last:
        break
node.close()
