"""Tasks: what a node trains.

A task is a small object with five methods; write your own and pass it as
``module:attr`` (an instance, a class, or a function returning one):

``model()``
    a fresh ``nn.Module`` (called under a fixed seed, so every node starts equal)
``optimizer(params)``
    a ``torch.optim.Optimizer`` over those parameters
``stream(rank, world_size, split, seed, device)``
    this node's endless minibatches: an object with ``next()`` returning a batch
``loss(model, batch)``
    the training loss of one batch (a scalar tensor)
``evaluate(model, device)``
    held-out figures, a dict with at least ``loss`` (and ``accuracy`` when it makes sense)

and may say ``batchable = True``: its ``loss`` is a pure function of the parameters
and the batch that ``torch.func`` can vectorise (no random numbers, no in-place
buffer updates, no ``.item()``) and its stream yields tuples of tensors, so the
simulator may run many nodes' steps as one call (:mod:`gossip.sim.batched`; a task
that does not say so, or whose model or optimizer does not fit, runs per node).

:class:`ClassificationTask` implements all of it for in-memory ``(X, y)`` data;
the built-ins ``synthetic`` and ``digits`` are two of those.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gossip.training.data import BatchStream, Split, parse_split, split_indices

__all__ = ["Task", "ClassificationTask", "SyntheticTask", "DigitsTask", "get_task", "BUILTIN_TASKS", "mlp"]

REQUIRED_METHODS = ("model", "optimizer", "stream", "loss", "evaluate")


class Task:
    """Base class documenting the task protocol; subclassing it is optional."""

    name = "task"

    def model(self) -> nn.Module:  # pragma: no cover - protocol
        raise NotImplementedError

    def optimizer(self, params) -> torch.optim.Optimizer:  # pragma: no cover - protocol
        raise NotImplementedError

    def stream(self, rank: int, world_size: int, split: Split | str, seed: int, device: torch.device | str = "cpu"):
        raise NotImplementedError  # pragma: no cover - protocol

    def loss(self, model: nn.Module, batch) -> torch.Tensor:  # pragma: no cover - protocol
        raise NotImplementedError

    def evaluate(self, model: nn.Module, device: torch.device | str = "cpu") -> dict[str, float]:
        raise NotImplementedError  # pragma: no cover - protocol

    #: whether the simulator may vectorise this task's local steps over nodes (see above)
    batchable = False


def mlp(sizes: list[int]) -> nn.Sequential:
    """A ReLU multi-layer perceptron with the given layer widths."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class ClassificationTask(Task):
    """Supervised classification on in-memory tensors, with SGD + momentum.

    Parameters
    ----------
    train, test : (X, y) tensor pairs
    hidden : widths of the MLP's hidden layers (ignored when ``model_fn`` is given)
    lr, momentum, weight_decay : optimizer settings
    batch_size : per-node minibatch size
    """

    name = "classification"
    batchable = True  # loss and stream suit the simulator's batched engine (gossip.sim.batched)

    def __init__(self, train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor], *,
                 hidden: int | tuple[int, ...] = (64,), lr: float = 0.05, momentum: float = 0.9,
                 weight_decay: float = 0.0, batch_size: int = 32,
                 model_fn: Callable[[], nn.Module] | None = None) -> None:
        _check_positive("lr", lr)
        _check_positive("batch_size", batch_size)
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.X, self.y = train
        self.X_test, self.y_test = test
        self.num_classes = int(max(self.y.max(), self.y_test.max())) + 1
        self.hidden = (int(hidden),) if isinstance(hidden, int) else tuple(int(h) for h in hidden)
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.batch_size = int(batch_size)
        self.model_fn = model_fn
        self._shards: dict[tuple, list[np.ndarray]] = {}

    @property
    def labels(self) -> np.ndarray:
        return self.y.numpy()

    def model(self) -> nn.Module:
        if self.model_fn is not None:
            return self.model_fn()
        return mlp([self.X.shape[1], *self.hidden, self.num_classes])

    def optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)

    def shard(self, rank: int, world_size: int, split: Split | str, seed: int) -> np.ndarray:
        """Indices of the training samples that node ``rank`` of ``world_size`` owns."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        key = (world_size, str(parse_split(split)), seed)
        if key not in self._shards:  # a simulation asks once per node; compute the split once
            self._shards[key] = split_indices(len(self.y), world_size, parse_split(split), labels=self.labels,
                                              seed=seed, min_size=min(self.batch_size, len(self.y) // world_size))
        return self._shards[key][rank]

    def stream(self, rank: int, world_size: int, split: Split | str, seed: int,
               device: torch.device | str = "cpu") -> BatchStream:
        from gossip.training.data import node_seed

        return BatchStream((self.X, self.y), self.shard(rank, world_size, split, seed), self.batch_size,
                           node_seed(seed, rank, 1), device)

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device | str = "cpu") -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            logits = model(self.X_test.to(device))
            y = self.y_test.to(device)
            loss = F.cross_entropy(logits, y).item()
            acc = (logits.argmax(1) == y).float().mean().item()
        finally:
            model.train(was_training)
        return {"loss": loss, "accuracy": acc}


    @torch.no_grad()
    def evaluate_stacked(self, forward: Callable[[torch.Tensor], torch.Tensor],
                         device: torch.device | str = "cpu") -> list[dict[str, float]]:
        """:meth:`evaluate` for many replicas at once (the batched engine's evaluation).

        forward : inputs ``[N, ...]`` -> every replica's logits ``[k, N, classes]``
            (in eval mode); returns one dict per replica
        """
        logits = forward(self.X_test.to(device))
        y = self.y_test.to(device)
        k, n, classes = logits.shape
        loss = F.cross_entropy(logits.reshape(k * n, classes), y.repeat(k), reduction="none").view(k, n).mean(1)
        acc = (logits.argmax(2) == y).float().mean(1)
        return [{"loss": lo, "accuracy": a} for lo, a in zip(loss.tolist(), acc.tolist())]


class SyntheticTask(ClassificationTask):
    """Generated classification: a Gaussian mixture with several clusters per class.

    Needs no package beyond torch and numpy. The data depend only on
    ``data_seed``, so every node (and every run) sees the same dataset; the run
    seed only changes the split, initialisation and batch order.
    """

    name = "synthetic"

    def __init__(self, *, classes: int = 10, dim: int = 32, clusters: int = 2, samples: int = 4000,
                 test_samples: int = 1000, noise: float = 3.0, data_seed: int = 1234, **kwargs: Any) -> None:
        for arg, val in (("classes", classes), ("dim", dim), ("clusters", clusters), ("samples", samples),
                         ("test_samples", test_samples)):
            _check_positive(arg, val)
        if classes < 2:
            raise ValueError(f"classes must be >= 2, got {classes}")
        rng = np.random.default_rng(data_seed)
        centers = rng.normal(size=(classes * clusters, dim)) * 2.0
        center_label = np.repeat(np.arange(classes), clusters)

        scale = np.sqrt(4.0 + noise**2)  # keeps features near unit variance, so one lr suits any noise

        def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            which = rng.integers(0, classes * clusters, size=n)
            x = (centers[which] + noise * rng.normal(size=(n, dim))) / scale
            return torch.tensor(x, dtype=torch.float32), torch.tensor(center_label[which], dtype=torch.long)

        super().__init__(draw(int(samples)), draw(int(test_samples)), **kwargs)


class DigitsTask(ClassificationTask):
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, no download).

    A fixed 80/20 train/test split (by ``data_seed``); pixels scaled to [0, 1].
    """

    name = "digits"

    def __init__(self, *, data_seed: int = 0, **kwargs: Any) -> None:
        try:
            from sklearn.datasets import load_digits
        except ImportError as e:  # pragma: no cover - depends on environment
            raise ValueError("task 'digits' needs scikit-learn: pip install scikit-learn") from e
        d = load_digits()
        X = torch.tensor(d.data / 16.0, dtype=torch.float32)
        y = torch.tensor(d.target, dtype=torch.long)
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(data_seed))
        cut = int(0.8 * len(y))
        tr, te = perm[:cut], perm[cut:]
        super().__init__((X[tr], y[tr]), (X[te], y[te]), **kwargs)


BUILTIN_TASKS: dict[str, type[Task]] = {"synthetic": SyntheticTask, "digits": DigitsTask}


def _check_positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if "x" in text and all(p.isdigit() for p in text.split("x")):
        return tuple(int(p) for p in text.split("x"))  # hidden=64x64
    return text


def _parse_kwargs(spec: str, text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"task {spec!r}: expected key=value options, got {item!r}")
        out[key.strip()] = _parse_value(value.strip())
    return out


def check_task(task: Any, spec: str = "task") -> Any:
    """Raise ValueError if ``task`` lacks a method of the task protocol."""
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(task, m, None))]
    if missing:
        raise ValueError(f"{spec}: not a task, missing method(s) {', '.join(missing)} "
                         f"(a task needs {', '.join(REQUIRED_METHODS)})")
    return task


def _import_from_cwd(name: str) -> Any:
    """Import ``name``; if its top-level package is missing, try the current directory.

    ``python -m gossip.cli`` puts the current directory on ``sys.path``, console
    scripts such as ``gossip-sim`` do not; a task module next to the user
    (``examples/``, ``my_task.py``) should be found either way. Only a missing
    top-level package triggers the retry, never a missing dependency of the module.
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if e.name != name.partition(".")[0] or "" in sys.path or cwd in sys.path:
            raise
        sys.path.insert(0, cwd)
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(cwd)


def get_task(spec: str | Task) -> Task:
    """Resolve a task spec.

    ``synthetic`` or ``digits``, optionally with options
    (``digits:lr=0.1,batch_size=64,hidden=64x32``), or ``module:attr`` naming a
    task instance, a task class, or a function returning a task.
    """
    if not isinstance(spec, str):
        return check_task(spec, type(spec).__name__)
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name in BUILTIN_TASKS:
        try:
            return BUILTIN_TASKS[name](**_parse_kwargs(spec, rest))
        except TypeError as e:
            sig = inspect.signature(ClassificationTask.__init__)
            opts = [p for p in sig.parameters if p not in ("self", "train", "test", "model_fn")]
            raise ValueError(f"task {spec!r}: {e}; options: {', '.join(opts)}") from None
    if not rest:
        raise ValueError(f"unknown task {spec!r}; valid: {', '.join(BUILTIN_TASKS)}, or module:attr")
    try:
        module = _import_from_cwd(name)
    except ImportError as e:
        raise ValueError(f"task {spec!r}: cannot import module {name!r} ({e})") from None
    obj = module
    for part in rest.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"task {spec!r}: module {name!r} has no attribute {rest!r}")
        obj = getattr(obj, part)
    if inspect.isclass(obj) or (callable(obj) and not all(callable(getattr(obj, m, None)) for m in REQUIRED_METHODS)):
        obj = obj()
    return check_task(obj, f"task {spec!r}")
