"""Recommendation: matrix factorization trained by gossip, and what compression does to it.

A recommender's parameters are mostly embedding tables (one row per user, one per
item), so they dominate what gossip sends; this example trains the same model
with several codecs and prints bytes on the wire against test RMSE.

By default the ratings are synthetic: drawn from hidden low-rank user and item
factors plus biases and noise (so the best achievable RMSE is the noise level).
``--data movielens:PATH`` reads a MovieLens ``u.data`` file you already have.

    python examples/recommender.py                                  # none vs fp16 vs int8 vs topk
    python examples/recommender.py --short                          # the CI form: asserts RMSE and bytes
    python examples/recommender.py --data movielens:~/ml-100k/u.data --compression none,int8
    gossip-sim --task examples.recommender:task --compression int8

``evaluate`` returns ``loss`` (the test mean squared error) and ``rmse``; the
simulator records ``loss``, so RMSE over time is ``sqrt(loss)``.
"""

from __future__ import annotations

import argparse
import json
import math
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
from gossip.training.datasets import Ratings, load_movielens
from gossip.training.node import resolve_device
from gossip.training.tasks import Task

# Short-form pass marks: the uncompressed model must beat predicting the training mean
# by this factor, and int8 must cost at most this much extra RMSE for ~1/4 of the bytes.
SHORT_MAX_RMSE_RATIO = 0.8
SHORT_INT8_RMSE_SLACK = 0.05


def synthetic_ratings(num_users: int = 1000, num_items: int = 500, rank: int = 8, density: float = 0.1,
                      noise: float = 0.3, seed: int = 0) -> Ratings:
    """Ratings ``mu + b_u + b_i + <p_u, q_i> + noise`` on a random ``density`` fraction of (user, item) pairs.

    The interaction term has standard deviation ~0.8 and the biases 0.3 (users) and
    0.5 (items), on a mean of 3.5: roughly the spread of MovieLens ratings. The
    noise standard deviation is the best RMSE any model can reach.
    """
    rng = np.random.default_rng(seed)
    p = rng.normal(0, (0.8 / math.sqrt(rank)) ** 0.5, (num_users, rank))
    q = rng.normal(0, (0.8 / math.sqrt(rank)) ** 0.5, (num_items, rank))
    bu, bi = rng.normal(0, 0.3, num_users), rng.normal(0, 0.5, num_items)
    n = int(density * num_users * num_items)
    pairs = rng.choice(num_users * num_items, size=n, replace=False)
    users, items = pairs // num_items, pairs % num_items
    r = 3.5 + bu[users] + bi[items] + (p[users] * q[items]).sum(1) + rng.normal(0, noise, n)
    return Ratings(users.astype(np.int64), items.astype(np.int64), r.astype(np.float32),
                   np.zeros(n, dtype=np.int64), np.arange(num_users), np.arange(num_items))


class MatrixFactorization(nn.Module):
    """Predicted rating = global mean + user bias + item bias + <user embedding, item embedding>."""

    def __init__(self, num_users: int, num_items: int, dim: int = 16, mean: float = 0.0) -> None:
        super().__init__()
        self.user = nn.Embedding(num_users, dim)
        self.item = nn.Embedding(num_items, dim)
        self.user_bias = nn.Embedding(num_users, 1)
        self.item_bias = nn.Embedding(num_items, 1)
        self.mean = nn.Parameter(torch.tensor(float(mean)))
        for emb in (self.user, self.item):
            nn.init.normal_(emb.weight, std=0.1)  # small: the dot products start near zero
        for emb in (self.user_bias, self.item_bias):
            nn.init.zeros_(emb.weight)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted ratings, and the squared norms of the embedding rows used (for regularisation)."""
        p, q = self.user(users), self.item(items)
        pred = self.mean + self.user_bias(users).squeeze(-1) + self.item_bias(items).squeeze(-1) + (p * q).sum(-1)
        return pred, (p * p).sum(-1) + (q * q).sum(-1)


class RatingTask(Task):
    """Rating prediction with :class:`MatrixFactorization`, mean squared error and Adam.

    The L2 penalty ``reg`` applies to the embedding rows in each batch, as in classic
    matrix factorization; optimizer weight decay would instead shrink every row at
    every step, and Adam would turn that into full-size steps for rows with no data.

    The ratings are split once, 90/10, into training and test sets (by ``data_seed``).
    A ``dirichlet:ALPHA`` split deals each user's ratings to nodes by Dirichlet(ALPHA)
    shares, so with a small ALPHA a user's data lives mostly on one node, as on devices.
    """

    name = "ratings"

    def __init__(self, ratings: Ratings, *, dim: int = 16, lr: float = 0.05, reg: float = 0.02,
                 batch_size: int = 256, test_fraction: float = 0.1, data_seed: int = 0) -> None:
        if not 0 < test_fraction < 1:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        self.ratings, self.dim, self.lr, self.reg = ratings, dim, lr, reg
        self.batch_size = batch_size
        perm = np.random.default_rng(data_seed).permutation(len(ratings))
        cut = int(round(len(ratings) * (1 - test_fraction)))
        tr, te = perm[:cut], perm[cut:]

        def tensors(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return (torch.from_numpy(ratings.users[idx]), torch.from_numpy(ratings.items[idx]),
                    torch.from_numpy(ratings.ratings[idx]))

        self.train, self.test = tensors(tr), tensors(te)
        self.train_mean = float(self.train[2].mean())
        self._shards: dict[tuple, list[np.ndarray]] = {}

    def baseline_rmse(self) -> float:
        """Test RMSE of always predicting the training mean."""
        return float(((self.test[2] - self.train_mean) ** 2).mean().sqrt())

    def model(self) -> nn.Module:
        return MatrixFactorization(self.ratings.num_users, self.ratings.num_items, self.dim, self.train_mean)

    def optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=self.lr)

    def stream(self, rank: int, world_size: int, split: Split | str, seed: int,
               device: torch.device | str = "cpu") -> BatchStream:
        key = (world_size, str(parse_split(split)), seed)
        if key not in self._shards:
            self._shards[key] = split_indices(len(self.train[2]), world_size, split, labels=self.train[0].numpy(),
                                              seed=seed, min_size=self.batch_size)
        return BatchStream(self.train, self._shards[key][rank], self.batch_size, node_seed(seed, rank, 1), device)

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        users, items, ratings = batch
        pred, sq_norms = model(users, items)
        return F.mse_loss(pred, ratings) + self.reg * sq_norms.mean()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device | str = "cpu") -> dict[str, float]:
        users, items, ratings = (t.to(device) for t in self.test)
        mse = F.mse_loss(model(users, items)[0], ratings).item()
        return {"loss": mse, "rmse": math.sqrt(mse)}


def task(data: str = "synthetic", *, dim: int = 16, lr: float = 0.05, batch_size: int = 256) -> RatingTask:
    """The example's task: ``gossip-sim --task examples.recommender:task``.

    ``data`` is ``synthetic`` or ``movielens:PATH`` (a ``u.data`` file).
    """
    if data == "synthetic":
        ratings = synthetic_ratings()
    else:
        kind, sep, path = data.partition(":")
        if kind != "movielens" or not sep or not path:
            raise ValueError(f"--data {data!r}: expected synthetic or movielens:PATH")
        ratings = load_movielens(Path(path).expanduser())
    return RatingTask(ratings, dim=dim, lr=lr, batch_size=batch_size)



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="the quick CI form; asserts RMSE and bytes")
    p.add_argument("--nodes", type=int, default=8, help="simulated nodes (default: 8)")
    p.add_argument("--steps", type=int, default=None, help="local steps per node (default: 600, short: 120)")
    p.add_argument("--topology", default="ring", help="graph spec (default: ring)")
    p.add_argument("--algorithm", default="gossip", help="gossip or push-sum (default: gossip)")
    p.add_argument("--split", default="iid", help="iid, or dirichlet:ALPHA over each user's ratings (default: iid)")
    p.add_argument("--compression", default=None,
                   help="comma-separated codecs to compare (default: none,fp16,int8,topk:0.1; short: none,int8)")
    p.add_argument("--data", default="synthetic", help="synthetic or movielens:PATH (default: synthetic)")
    p.add_argument("--dim", type=int, default=16, help="embedding width (default: 16)")
    p.add_argument("--lr", type=float, default=0.05, help="Adam learning rate (default: 0.05)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=str(resolve_device("auto")),
                   help="cpu, cuda, cuda:N (default: cuda when available)")
    p.add_argument("--out", default=None, metavar="PREFIX",
                   help="write JSON-lines metrics to PREFIX-CODEC.jsonl, one file per codec (for gossip-plot)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """Run the comparison; returns ``{codec: figures}`` (and exits non-zero if the short form fails)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (120 if args.short else 600)
    spec = args.compression or ("none,int8" if args.short else "none,fp16,int8,topk:0.1")
    codecs = [c.strip() for c in spec.split(",") if c.strip()]
    if args.short and "none" not in codecs:
        codecs.insert(0, "none")
    try:
        the_task = task(args.data, dim=args.dim, lr=args.lr)
    except (ValueError, OSError) as e:  # a bad --data spec or u.data file: one line, exit 2
        parser.error(str(e))
    params = sum(p.numel() for p in the_task.model().parameters())
    baseline = the_task.baseline_rmse()
    print(f"{len(the_task.ratings)} ratings by {the_task.ratings.num_users} users of {the_task.ratings.num_items} "
          f"items ({args.data}); {params} parameters, {args.nodes} nodes on {args.topology} ({args.algorithm}), "
          f"{steps} steps; predicting the mean gives RMSE {baseline:.4f}")
    print(f"{'codec':<12} {'MB sent':>9} {'vs none':>8} {'test RMSE':>10} {'node RMSE':>10} {'consensus':>10} {'wall s':>7}")
    rows: dict[str, dict[str, Any]] = {}
    for codec in codecs:
        out = f"{args.out}-{codec.replace(':', '_')}.jsonl" if args.out else None
        t0 = time.perf_counter()
        s = gossip.simulate(nodes=args.nodes, topology=args.topology, algorithm=args.algorithm, compression=codec,
                            task=the_task, split=args.split, steps=steps, seed=args.seed, device=args.device,
                            out=out, eval_every=max(1, steps // 10)).summary
        rows[codec] = {"bytes_sent": s["bytes_sent"], "rmse": math.sqrt(s["final_loss"]),
                       "mean_node_rmse": math.sqrt(s["mean_node_loss"]), "consensus_distance": s["consensus_distance"],
                       "wall_s": time.perf_counter() - t0}
        r, ref = rows[codec], rows.get("none")
        ratio = f"{ref['bytes_sent'] / r['bytes_sent']:.1f}x" if ref else "-"
        print(f"{codec:<12} {r['bytes_sent'] / 1e6:>9.2f} {ratio:>8} {r['rmse']:>10.4f} {r['mean_node_rmse']:>10.4f} "
              f"{r['consensus_distance']:>10.3g} {r['wall_s']:>7.1f}")
    print(json.dumps({"baseline_rmse": baseline, "codecs": rows}))
    if args.short:
        none = rows["none"]
        if none["rmse"] > SHORT_MAX_RMSE_RATIO * baseline:
            raise SystemExit(f"short form failed: RMSE {none['rmse']:.4f} > {SHORT_MAX_RMSE_RATIO} x mean "
                             f"predictor {baseline:.4f}")
        if "int8" in rows and (rows["int8"]["rmse"] > none["rmse"] + SHORT_INT8_RMSE_SLACK
                               or rows["int8"]["bytes_sent"] > 0.3 * none["bytes_sent"]):
            raise SystemExit(f"short form failed: int8 {rows['int8']} vs none {none}")
    return rows


if __name__ == "__main__":
    main()
