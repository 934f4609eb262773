"""Image classification: a small residual CNN trained by gossip across simulated nodes.

By default it learns scikit-learn's bundled 8x8 handwritten digits (no download).
With ``--data mnist:DIR`` or ``--data cifar10:DIR`` it reads the standard MNIST
IDX files or CIFAR-10 python batches you already have (see :mod:`gossip.training.datasets`).

    python examples/image_classification.py                  # 8 nodes, exponential graph, digits
    python examples/image_classification.py --short          # the CI form: asserts accuracy
    python examples/image_classification.py --data mnist:~/data/MNIST/raw --steps 500
    gossip-sim --task examples.image_classification:task --nodes 16 --topology ring

The model, optimizer and data all follow ``--device`` (default: the GPU when there is one).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import gossip
from gossip.training.node import resolve_device
from gossip.training.tasks import ClassificationTask

SHORT_MIN_ACCURACY = 0.90  # the short form's pass mark on digits (it reaches ~0.99)


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with a skip connection (a 1x1 projection when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.skip(x))


class SmallResNet(nn.Module):
    """A stem convolution, one residual block per stage (each stage halves the
    resolution and doubles the width), global average pooling, a linear head.

    Works for any input size: 8x8 digits, 28x28 MNIST, 32x32 CIFAR-10.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16, stages: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks, w = [], width
        for s in range(stages):
            blocks.append(ResidualBlock(w, w * 2 if s else w, stride=2 if s else 1))
            w = w * 2 if s else w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


class ImageTask(ClassificationTask):
    """Classification of ``(N, C, H, W)`` images with :class:`SmallResNet`.

    Images may be float (used as they are) or ``uint8`` (kept that way in memory,
    a quarter of the size, and scaled to [0, 1] and normalised per channel batch by
    batch on the device). Evaluation runs over at most ``test_limit`` test images,
    in chunks, so a 10 000-image test set does not need one giant activation.
    """

    name = "image"

    def __init__(self, train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor], *,
                 width: int = 16, stages: int = 2, test_limit: int | None = None, eval_batch: int = 500,
                 **kwargs: Any) -> None:
        if train[0].ndim != 4:
            raise ValueError(f"images must be (N, C, H, W), got shape {tuple(train[0].shape)}")
        if test_limit is not None:
            test = (test[0][:test_limit], test[1][:test_limit])
        super().__init__(train, test, model_fn=self._make_model, **kwargs)
        self.width, self.stages, self.eval_batch = int(width), int(stages), int(eval_batch)
        self.in_channels = int(train[0].shape[1])
        if train[0].dtype == torch.uint8:
            # per-channel statistics of the training images, from a bounded sample
            sample = train[0][:10000].float() / 255
            self.mean = sample.mean(dim=(0, 2, 3)).view(1, -1, 1, 1)
            self.std = sample.std(dim=(0, 2, 3)).clamp_min(1e-3).view(1, -1, 1, 1)
        self._norm: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _make_model(self) -> nn.Module:
        return SmallResNet(self.in_channels, self.num_classes, self.width, self.stages)

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Float model input from a batch of stored images."""
        if x.dtype != torch.uint8:
            return x
        if x.device not in self._norm:
            self._norm[x.device] = (self.mean.to(x.device), self.std.to(x.device))
        mean, std = self._norm[x.device]
        return (x.float() / 255 - mean) / std

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(self.prepare(x)), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device | str = "cpu") -> dict[str, float]:
        was_training = model.training
        model.eval()
        total_loss, correct, n = 0.0, 0, len(self.y_test)
        try:
            for lo in range(0, n, self.eval_batch):
                x = self.prepare(self.X_test[lo:lo + self.eval_batch].to(device))
                y = self.y_test[lo:lo + self.eval_batch].to(device)
                logits = model(x)
                total_loss += F.cross_entropy(logits, y, reduction="sum").item()
                correct += int((logits.argmax(1) == y).sum())
        finally:
            model.train(was_training)
        return {"loss": total_loss / n, "accuracy": correct / n}


def digits_data(data_seed: int = 0) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """scikit-learn's digits as 1x8x8 float images in [0, 1], split 80/20 as the built-in ``digits`` task does."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on environment
        raise ValueError("the digits data need scikit-learn: pip install scikit-learn") from e
    d = load_digits()
    X = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(data_seed))
    cut = int(0.8 * len(y))
    return (X[perm[:cut]], y[perm[:cut]]), (X[perm[cut:]], y[perm[cut:]])


def file_data(spec: str) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``mnist:DIR`` or ``cifar10:DIR`` through :mod:`gossip.training.datasets` (uint8 images)."""
    from gossip.training.datasets import load_cifar10, load_mnist

    kind, sep, directory = spec.partition(":")
    loaders = {"mnist": load_mnist, "cifar10": load_cifar10}
    if kind not in loaders or not sep or not directory:
        raise ValueError(f"--data {spec!r}: expected digits, mnist:DIR or cifar10:DIR")
    d = loaders[kind](Path(directory).expanduser())

    def tensors(images: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(labels)

    return tensors(d.train_images, d.train_labels), tensors(d.test_images, d.test_labels)


def task(data: str = "digits", *, lr: float = 0.05, batch_size: int = 32, width: int = 16,
         test_limit: int | None = None) -> ImageTask:
    """The example's task: ``gossip-sim --task examples.image_classification:task``.

    ``data`` is ``digits`` or ``mnist:DIR`` / ``cifar10:DIR``. For the large file
    datasets the test set is cut to 2000 images by default: every evaluation point
    of a simulation evaluates every node's replica.
    """
    if data == "digits":
        train, test = digits_data()
    else:
        train, test = file_data(data)
        test_limit = 2000 if test_limit is None else test_limit
    return ImageTask(train, test, lr=lr, momentum=0.9, weight_decay=5e-4, batch_size=batch_size, width=width,
                     test_limit=test_limit)



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="the quick CI form; asserts the accuracy on digits")
    p.add_argument("--nodes", type=int, default=8, help="simulated nodes (default: 8)")
    p.add_argument("--steps", type=int, default=None, help="local steps per node (default: 400, short: 80)")
    p.add_argument("--topology", default="exponential", help="graph spec (default: exponential)")
    p.add_argument("--algorithm", default="gossip", help="gossip or push-sum (default: gossip)")
    p.add_argument("--split", default="iid", help="iid or dirichlet:ALPHA (default: iid)")
    p.add_argument("--data", default="digits", help="digits, mnist:DIR or cifar10:DIR (default: digits)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: 0.05)")
    p.add_argument("--batch-size", type=int, default=32, help="per-node minibatch (default: 32)")
    p.add_argument("--width", type=int, default=16, help="channels of the first stage (default: 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=str(resolve_device("auto")),
                   help="cpu, cuda, cuda:N (default: cuda when available)")
    p.add_argument("--out", default=None, help="write JSON-lines metrics here (for gossip-plot)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the example; returns the simulation summary (and exits non-zero if the short form fails)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (80 if args.short else 400)
    t0 = time.perf_counter()
    try:
        the_task = task(args.data, lr=args.lr, batch_size=args.batch_size, width=args.width)
    except (ValueError, OSError) as e:  # a bad --data spec or data file: one line, exit 2
        parser.error(str(e))
    result = gossip.simulate(nodes=args.nodes, topology=args.topology, algorithm=args.algorithm, task=the_task,
                             split=args.split, steps=steps, seed=args.seed, device=args.device, out=args.out,
                             eval_every=max(1, steps // 10))
    s = result.summary
    params = sum(p.numel() for p in the_task.model().parameters())
    print(f"{args.nodes} nodes on {s['topology']} ({args.algorithm}), {params} parameters, {steps} steps, "
          f"data {args.data}: averaged-model accuracy {s['final_accuracy']:.4f}, mean node accuracy "
          f"{s['mean_node_accuracy']:.4f}, consensus distance {s['consensus_distance']:.3g}, "
          f"{s['bytes_sent'] / 1e6:.1f} MB sent, {time.perf_counter() - t0:.1f} s wall")
    print(json.dumps({k: s[k] for k in ("final_accuracy", "mean_node_accuracy", "final_loss", "consensus_distance",
                                         "bytes_sent", "sim_time_s", "wall_time_s")}))
    if args.short and args.data == "digits" and s["final_accuracy"] < SHORT_MIN_ACCURACY:
        raise SystemExit(f"short form failed: accuracy {s['final_accuracy']:.4f} < {SHORT_MIN_ACCURACY}")
    return s


if __name__ == "__main__":
    main()
