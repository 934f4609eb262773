"""A small character language model trained with an ordinary PyTorch loop, on text
generated from a fixed Markov chain (no download)."""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import gossip


class CharWindows(Dataset):
    """(context, next characters) windows over one long token sequence."""

    def __init__(self, tokens, context):
        self.tokens, self.context = tokens, context

    def __len__(self):
        return len(self.tokens) - self.context - 1

    def __getitem__(self, i):
        chunk = self.tokens[i:i + self.context + 1]
        return chunk[:-1], chunk[1:]


def markov_text(n, vocab, seed):
    transitions = torch.softmax(3 * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(7)), dim=1)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.empty(n, dtype=torch.long)
    tokens[0] = 0
    for i in range(1, n):
        tokens[i] = torch.multinomial(transitions[tokens[i - 1]], 1, generator=g)
    return tokens


class TinyLM(nn.Module):
    def __init__(self, vocab, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        h, _ = self.rnn(self.embed(x))
        return self.head(h)


def evaluate(model, loader, vocab):
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            total += F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1), reduction="sum").item()
            count += y.numel()
    model.train()
    return total / count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=12)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    model = TinyLM(args.vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    node = gossip.GossipNode(model, optimizer)  # listen and peers from GOSSIP_LISTEN, GOSSIP_PEERS

    train_data = CharWindows(markov_text(1600, args.vocab, 1), args.context)
    test_data = CharWindows(markov_text(400, args.vocab, 2), args.context)
    loader = DataLoader(train_data, batch_size=args.batch_size, sampler=node.sampler(train_data), drop_last=True)
    test_loader = DataLoader(test_data, batch_size=64)

    for epoch in node.epochs(args.epochs, loader):
        for step, (x, y) in enumerate(loader):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        test_loss = evaluate(model, test_loader, args.vocab)
        print(f"epoch {epoch} train loss {loss.item():.4f} test loss {test_loss:.6f} "
              f"perplexity {math.exp(test_loss):.3f}")
    node.close()


if __name__ == "__main__":
    main()
