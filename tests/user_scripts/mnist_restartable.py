"""The MNIST-style script (mnist_after.py) with what a long run adds: a learning-rate
schedule, checkpoints, and a node that can be killed and started again. It prints,
after each epoch, the epoch, its batches, the cluster's step and the learning rate,
and writes the ids of the samples it trained on, per epoch, to --ids (JSON lines).
The test sets the last epoch later, in the file given as --last (read after every
epoch), so that the run lasts until the restarted node is back whatever the
machine's speed."""

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

import gossip


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.fc1 = nn.Linear(4 * 5 * 5, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        return F.log_softmax(self.fc2(F.relu(self.fc1(torch.flatten(x, 1)))), dim=1)


def digits(n, seed):
    prototypes = torch.randn(10, 1, 12, 12, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(10, (n,), generator=g)
    images = prototypes[labels] + 1.5 * torch.randn(n, 1, 12, 12, generator=g)
    return TensorDataset(images, labels, torch.arange(n))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", required=True)
    parser.add_argument("--last", required=True)
    parser.add_argument("--ids", required=True)
    parser.add_argument("--train-size", type=int, default=240)  # 120 a shard for 2 nodes, 80 for 3
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--join-margin", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(1)
    torch.set_num_threads(1)
    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    node = gossip.GossipNode(model, optimizer, scheduler=scheduler, checkpoint_dir=args.checkpoints,
                             checkpoint_every=5, heartbeat=0.25, dead_after=6.0, join_margin=args.join_margin)
    train_ds = digits(args.train_size, 0)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=node.sampler(train_ds))
    print(f"start step {node.steps} lr {optimizer.param_groups[0]['lr']:.8g}", flush=True)
    for epoch in node.epochs(range(1, 10**6), train_loader):
        ids, batches = [], 0
        model.train()
        for data, target, idx in train_loader:
            optimizer.zero_grad()
            F.nll_loss(model(data), target).backward()
            optimizer.step()
            ids += idx.tolist()
            batches += 1
        with open(args.ids, "a") as f:
            f.write(json.dumps({"epoch": epoch, "ids": ids, "steps": node.steps}) + "\n")
        print(f"epoch {epoch} batches {batches} steps {node.steps} lr {optimizer.param_groups[0]['lr']:.8g}",
              flush=True)
        scheduler.step()
        try:
            last = int(open(args.last).read())
        except (OSError, ValueError):
            last = 10**6
        if epoch >= last:
            break
    node.close()


if __name__ == "__main__":
    main()
