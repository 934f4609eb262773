"""A matrix-factorisation recommender trained with an ordinary PyTorch loop, on
ratings generated from hidden user and item factors (no download)."""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class MF(nn.Module):
    def __init__(self, users, items, dim=8):
        super().__init__()
        self.user = nn.Embedding(users, dim)
        self.item = nn.Embedding(items, dim)
        self.user_bias = nn.Embedding(users, 1)
        self.item_bias = nn.Embedding(items, 1)
        for e in (self.user, self.item):
            nn.init.normal_(e.weight, std=0.1)
        for e in (self.user_bias, self.item_bias):
            nn.init.zeros_(e.weight)

    def forward(self, u, i):
        dot = (self.user(u) * self.item(i)).sum(-1)
        return dot + self.user_bias(u).squeeze(-1) + self.item_bias(i).squeeze(-1)


def ratings(users, items, n, seed):
    g = torch.Generator().manual_seed(42)
    pu, qi = torch.randn(users, 4, generator=g), torch.randn(items, 4, generator=g)
    g = torch.Generator().manual_seed(seed)
    u, i = torch.randint(users, (n,), generator=g), torch.randint(items, (n,), generator=g)
    r = (pu[u] * qi[i]).sum(-1) + 0.3 * torch.randn(n, generator=g)
    return TensorDataset(u, i, r)


def rmse(model, loader):
    model.eval()
    se, n = 0.0, 0
    with torch.no_grad():
        for u, i, r in loader:
            se += ((model(u, i) - r) ** 2).sum().item()
            n += len(r)
    model.train()
    return (se / n) ** 0.5


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--users", type=int, default=60)
    parser.add_argument("--items", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--train-size", type=int, default=3000)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    model = MF(args.users, args.items)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.03)
    loss_fn = nn.MSELoss()

    train_set = ratings(args.users, args.items, args.train_size, 1)
    test_set = ratings(args.users, args.items, 1000, 2)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=500)

    for epoch in range(args.epochs):
        for u, i, r in train_loader:
            optimizer.zero_grad()
            loss = loss_fn(model(u, i), r)
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch} train mse {loss.item():.4f} test rmse {rmse(model, test_loader):.6f}")


if __name__ == "__main__":
    main()
