"""Language model: a small character-level GPT trained by gossip on Python source code.

The text is the Python standard library's own source (found with
``sysconfig.get_paths()["stdlib"]``): the top-level ``*.py`` files in sorted
order, up to a character budget, so every run and every node sees the same corpus and
nothing is downloaded. Every tenth 'window' of text is held out for evaluation;
the rest is dealt to the nodes. The figure to watch is the perplexity of the
averaged model on held-out text, against a unigram (character-frequency) baseline.

    python examples/language_model.py                 # 8 nodes, exponential graph
    python examples/language_model.py --short         # the CI form: asserts perplexity
    gossip-sim --task examples.language_model:task --nodes 4 --steps 100

The model, optimizer and data all follow ``--device`` (default: the GPU when there is one).
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import gossip
from gossip.training.data import (
    BatchStream,
    Split,
    node_seed,
    parse_split,
    split_indices,
)
from gossip.training.node import resolve_device
from gossip.training.tasks import Task

# The short form must beat the unigram baseline by this factor (it reaches ~0.4x).
SHORT_MAX_PERPLEXITY_RATIO = 0.6


# -- the corpus ---------------------------------------------------------------------------------

def stdlib_sources(max_chars: int, root: str | Path | None = None) -> list[tuple[str, str]]:
    """``(file name, text)`` of the standard library's top-level ``*.py`` files, sorted by
    name, until ``max_chars`` characters are collected (the last file is cut short).

    ``root`` defaults to ``sysconfig.get_paths()["stdlib"]``.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file()) if root.is_dir() else []
    if not files:
        raise ValueError(f"no Python source files in the standard library directory {root}; "
                         f"this example needs a Python installation with its .py sources")
    out, used = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        take = text[: max_chars - used]
        out.append((path.name, take))
        used += len(take)
        if used >= max_chars:
            break
    return out


class Corpus:
    """A character vocabulary and fixed-length windows of encoded text.

    Window k holds characters ``[k * block, (k + 1) * block + 1)``: ``block`` inputs and,
    shifted by one, their targets. Every tenth window is held out for evaluation.
    ``window_file[k]`` is the source file a window starts in, the 'label' a
    ``dirichlet`` split uses to give nodes skewed sets of files.
    """

    def __init__(self, sources: list[tuple[str, str]], block: int, holdout_every: int = 10) -> None:
        text = "".join(t for _, t in sources)
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        ids = np.fromiter((self.stoi[c] for c in text), dtype=np.int64, count=len(text))
        file_of_char = np.repeat(np.arange(len(sources)), [len(t) for _, t in sources])
        n = (len(ids) - 1) // block
        if n < 2 * holdout_every:
            raise ValueError(f"corpus too small for block {block}: {len(ids)} characters")
        starts = np.arange(n) * block
        windows = torch.from_numpy(np.stack([ids[s:s + block + 1] for s in starts]))
        test = np.arange(n) % holdout_every == holdout_every - 1
        self.train, self.test = windows[~test], windows[test]
        self.train_file = file_of_char[starts[~test]]
        self.block = block
        self.num_chars = len(text)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def unigram_perplexity(self) -> float:
        """Perplexity of predicting each held-out character from training character frequencies (add-one)."""
        counts = np.bincount(self.train[:, 1:].reshape(-1).numpy(), minlength=self.vocab_size) + 1.0
        logp = np.log(counts / counts.sum())
        targets = self.test[:, 1:].reshape(-1).numpy()
        return float(np.exp(-logp[targets].mean()))


# -- the model ----------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees only positions <= t."""

    def __init__(self, dim: int, heads: int, block: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        # a bool buffer: not a float, so it is not part of the gossiped parameter vector
        self.register_buffer("causal", torch.ones(block, block, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, h, T, d)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
        att = att.masked_fill(~self.causal[:T, :T], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: attention then a 4x MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int, block: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, block)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """Token + position embeddings, ``layers`` transformer blocks, a final LayerNorm, and an
    output layer tied to the token embedding (as in GPT-2)."""

    def __init__(self, vocab: int, block: int, dim: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.block = block
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.blocks = nn.Sequential(*[TransformerBlock(dim, heads, block) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)  # GPT-2's init; the default is too wide for tied embeddings
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        return self.head(self.ln(self.blocks(x)))


# -- the task -----------------------------------------------------------------------------------

class CharLMTask(Task):
    """Next-character prediction on a :class:`Corpus` with :class:`CharGPT` and AdamW.

    ``evaluate`` returns ``loss`` (mean cross-entropy per character, in nats),
    ``perplexity`` (its exponential) and ``accuracy`` (how often the most likely next
    character is the right one) on at most ``eval_windows`` held-out windows.
    """

    name = "char-lm"
    # the loss vectorises over replicas (torch.func): gossip-sim runs the nodes' steps as one call
    batchable = True

    def __init__(self, corpus: Corpus, *, dim: int = 64, heads: int = 4, layers: int = 2, lr: float = 3e-3,
                 batch_size: int = 32, eval_windows: int = 128) -> None:
        self.corpus = corpus
        self.dim, self.heads, self.layers = dim, heads, layers
        self.lr, self.batch_size = lr, batch_size
        pick = np.linspace(0, len(corpus.test) - 1, min(eval_windows, len(corpus.test))).round().astype(int)
        self.test = corpus.test[np.unique(pick)]  # evenly spaced over the corpus: every file kind is represented
        self._shards: dict[tuple, list[np.ndarray]] = {}

    def model(self) -> nn.Module:
        return CharGPT(self.corpus.vocab_size, self.corpus.block, self.dim, self.heads, self.layers)

    def optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, betas=(0.9, 0.99), weight_decay=0.01)

    def stream(self, rank: int, world_size: int, split: Split | str, seed: int,
               device: torch.device | str = "cpu") -> BatchStream:
        # iid: a random share of the windows; dirichlet:ALPHA: skewed shares of source files
        key = (world_size, str(parse_split(split)), seed)
        if key not in self._shards:
            self._shards[key] = split_indices(len(self.corpus.train), world_size, split,
                                              labels=self.corpus.train_file, seed=seed,
                                              min_size=self.batch_size)
        return BatchStream((self.corpus.train,), self._shards[key][rank], self.batch_size,
                           node_seed(seed, rank, 1), device)

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        (w,) = batch
        logits = model(w[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device | str = "cpu") -> dict[str, float]:
        was_training = model.training
        model.eval()
        nll, correct, count = 0.0, 0, 0
        try:
            for lo in range(0, len(self.test), 64):
                w = self.test[lo:lo + 64].to(device)
                logits, y = model(w[:, :-1]), w[:, 1:]
                nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
                correct += int((logits.argmax(-1) == y).sum())
                count += y.numel()
        finally:
            model.train(was_training)
        loss = nll / count
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "accuracy": correct / count}


def task(*, max_chars: int = 2_000_000, block: int = 64, dim: int = 96, heads: int = 4, layers: int = 2,
         lr: float = 3e-3, batch_size: int = 16, eval_windows: int = 256) -> CharLMTask:
    """The example's task (the full form's settings): ``gossip-sim --task examples.language_model:task``."""
    return CharLMTask(Corpus(stdlib_sources(max_chars), block), dim=dim, heads=heads, layers=layers, lr=lr,
                      batch_size=batch_size, eval_windows=eval_windows)



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="the quick CI form; asserts the perplexity")
    p.add_argument("--nodes", type=int, default=None, help="simulated nodes (default: 8, short: 4)")
    p.add_argument("--steps", type=int, default=None, help="local steps per node (default: 400, short: 160)")
    p.add_argument("--topology", default="exponential", help="graph spec (default: exponential)")
    p.add_argument("--algorithm", default="gossip", help="gossip or push-sum (default: gossip)")
    p.add_argument("--split", default="iid", help="iid, or dirichlet:ALPHA over source files (default: iid)")
    p.add_argument("--max-chars", type=int, default=None,
                   help="characters of source text to read (default: 2000000, short: 300000)")
    p.add_argument("--dim", type=int, default=None, help="model width (default: 96, short: 48)")
    p.add_argument("--block", type=int, default=None, help="context length in characters (default: 64, short: 32)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: 3e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=str(resolve_device("auto")),
                   help="cpu, cuda, cuda:N (default: cuda when available)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads during the run (default: 1, fastest for small models on a busy machine)")
    p.add_argument("--out", default=None, help="write JSON-lines metrics here (for gossip-plot)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the example; returns the summary (and exits non-zero if the short form fails)."""
    args = build_parser().parse_args(argv)
    nodes = args.nodes or (4 if args.short else 8)
    steps = args.steps if args.steps is not None else (160 if args.short else 400)
    max_chars = args.max_chars or (300_000 if args.short else 2_000_000)
    dim = args.dim or (48 if args.short else 96)
    block = args.block or (32 if args.short else 64)
    lr = args.lr or 3e-3
    t0 = time.perf_counter()
    the_task = task(max_chars=max_chars, block=block, dim=dim, lr=lr, batch_size=16,
                    eval_windows=48 if args.short else 256)
    corpus = the_task.corpus
    result = gossip.simulate(nodes=nodes, topology=args.topology, algorithm=args.algorithm, task=the_task,
                             split=args.split, steps=steps, seed=args.seed, device=args.device, out=args.out,
                             eval_every=max(1, steps // (4 if args.short else 10)), threads=args.threads)
    s = result.summary
    unigram = corpus.unigram_perplexity()
    params = sum(p.numel() for p in the_task.model().parameters())
    print(f"{nodes} nodes on {s['topology']} ({args.algorithm}), char-GPT with {params} parameters, "
          f"{corpus.num_chars} characters of stdlib source ({corpus.vocab_size} distinct), {steps} steps: "
          f"held-out perplexity {s['final_perplexity']:.2f} (unigram baseline {unigram:.2f}, "
          f"uniform {corpus.vocab_size}), next-char accuracy {s['final_accuracy']:.3f}, "
          f"consensus distance {s['consensus_distance']:.3g}, {time.perf_counter() - t0:.1f} s wall")
    print(json.dumps({"final_perplexity": s["final_perplexity"], "unigram_perplexity": unigram,
                      "final_accuracy": s["final_accuracy"], "final_loss": s["final_loss"],
                      "consensus_distance": s["consensus_distance"], "bytes_sent": s["bytes_sent"],
                      "sim_time_s": s["sim_time_s"], "wall_time_s": s["wall_time_s"]}))
    s = {**s, "unigram_perplexity": unigram}
    if args.short and s["final_perplexity"] > SHORT_MAX_PERPLEXITY_RATIO * unigram:
        raise SystemExit(f"short form failed: perplexity {s['final_perplexity']:.2f} > "
                         f"{SHORT_MAX_PERPLEXITY_RATIO} x unigram {unigram:.2f}")
    return s


if __name__ == "__main__":
    main()
