"""Lightning's ``Trainer`` as one member of a gossip cluster.

One argument in a training script::

    from gossip.integrations.lightning import GossipStrategy
    trainer = L.Trainer(max_epochs=5, strategy=GossipStrategy())   # listen, peers: GOSSIP_LISTEN, GOSSIP_PEERS

Start the same script once per machine. :class:`GossipStrategy` joins the cluster when
the Trainer sets up (``gossip={...}``: any :class:`gossip.GossipNode` option), and then:

- the training data is sharded: Lightning builds its ``DistributedSampler`` from the
  strategy's ``distributed_sampler_kwargs`` (this node's place among the members the
  cluster started with; a restarted member takes its own again);
- every optimizer step counts once (hooks on the torch optimizer) and every ``period``
  of them the node exchanges with its neighbours and mixes;
- ``self.log(..., sync_dist=True)`` reduces through the members (``reduce``: mean, sum,
  max, min), ``barrier``, ``all_gather`` and ``reduce_boolean_decision`` are collectives
  over the live members, and ``trainer.is_global_zero`` holds on one node (the first
  member): Lightning's checkpoints and anything ``rank_zero_only`` happen there once;
- a node that joins a running cluster takes a member's parameters, optimizer state and
  schedulers, and Lightning's loops move to the cluster's step (epoch, batch, global
  step); a checkpoint of its own (``ckpt_path``) wins only when it is newer.

:class:`GossipCallback` is the plain case: the default strategy, a loader sharded by
the script itself (``sampler=node.sampler(dataset)`` from :func:`gossip.init`). It counts
steps and hands the optimizer and schedulers over; it refuses to start when the
training loader is not sharded, so that no node trains the same batches as another
unnoticed.

Inside a group of devices started by torchrun (DDP or FSDP within a node, gossip
between nodes), the strategy would wrap Lightning's DDP/FSDP strategy; that waits for
gossip-node's groups to run on the one control plane (see docs/GROUPS.md), and this
strategy is for one process per member today.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.utilities.data import _update_dataloader
except ImportError as e:  # pragma: no cover - the optional extra
    raise ImportError("gossip.integrations.lightning needs Lightning: pip install \".[lightning]\"") from e

from torch.utils.data import DataLoader, DistributedSampler

from gossip.peer.user_loop import GossipNode, init
from gossip.training.sampler import ShardSampler, sampler_of

__all__ = ["GossipStrategy", "GossipCallback"]

log = logging.getLogger("gossip.integrations.lightning")


def _op_name(reduce_op: Any) -> str:
    """"mean", "sum", "max" or "min" from Lightning's or torch.distributed's spelling."""
    if reduce_op is None:
        return "mean"
    name = str(getattr(reduce_op, "name", reduce_op)).lower().rsplit(".", 1)[-1]
    name = {"avg": "mean", "product": "prod"}.get(name, name)
    if name not in ("mean", "sum", "max", "min"):
        raise ValueError(f"reduce_op must be mean, sum, max or min for gossip, got {reduce_op!r}")
    return name


def _reduce(node: GossipNode, tensor: torch.Tensor, op: str) -> torch.Tensor:
    values = torch.stack([v.to(torch.float64) for v in node.all_gather(tensor)])
    out = {"mean": values.mean(0), "sum": values.sum(0), "max": values.max(0).values, "min": values.min(0).values}[op]
    return out.to(tensor.dtype)


def _schedulers(trainer: Any) -> list[Any]:
    return [c.scheduler for c in getattr(trainer, "lr_scheduler_configs", [])]


def _attach(node: GossipNode, trainer: Any) -> None:
    """The Trainer's optimizer and schedulers to the node (a joiner's state goes in now)."""
    optimizers = list(trainer.optimizers)
    if len(optimizers) != 1:
        raise ValueError(f"gossip counts the steps of one optimizer; configure_optimizers gave {len(optimizers)}")
    node.attach(optimizers[0], scheduler=_schedulers(trainer) or None)


def _move_loops(trainer: Any, step: int) -> tuple[int, int]:
    """Lightning's loops at the cluster's ``step`` (epoch and global step; the batches of
    that epoch done are left out by the sampler). Returns (epoch, batches done)."""
    fit = trainer.fit_loop
    steps_per_epoch = max(1, math.ceil(trainer.num_training_batches / max(1, trainer.accumulate_grad_batches)))
    epoch, done = divmod(step, steps_per_epoch)
    for p in (fit.epoch_progress.current, fit.epoch_progress.total):
        p.ready = p.started = p.processed = p.completed = epoch
    loop = fit.epoch_loop
    counter = loop.automatic_optimization.optim_progress.optimizer.step.total
    counter.ready = counter.completed = step
    loop._batches_that_stepped = step
    return epoch, done


class GossipStrategy(ParallelStrategy):
    """A Lightning strategy for one gossip member per process (see the module).

    Parameters
    ----------
    gossip : a :class:`gossip.GossipNode` made by :func:`gossip.init` with this model, or the
        keywords to make one (``listen``, ``peers``, ``period``, ``timeout`` ...; default:
        ``GOSSIP_LISTEN`` / ``GOSSIP_PEERS`` from the environment)
    device : where the model trains (``"cpu"``, ``"cuda:0"``)
    """

    strategy_name = "gossip"

    def __init__(self, gossip: GossipNode | dict[str, Any] | None = None, device: str | torch.device = "cpu",
                 **kwargs: Any) -> None:
        super().__init__(parallel_devices=[torch.device(device)], **kwargs)
        if gossip is not None and not isinstance(gossip, (GossipNode, dict)):
            raise ValueError(f"gossip must be a GossipNode (gossip.init) or a dict of its options, "
                             f"got {type(gossip).__name__}")
        self.node: GossipNode | None = gossip if isinstance(gossip, GossipNode) else None
        self._options = dict(gossip) if isinstance(gossip, dict) else {}
        self._device = torch.device(device)
        self._shard: tuple[int, int] | None = None
        self._resume: tuple[int, int] | None = None  # (epoch, batches done) a joiner's loader leaves out
        # collectives from the start of training on: before it, a node joining a running cluster
        # sets up alone (its barriers, its sanity check's sync_dist have no partners)
        self._together = False

    # -- who this node is ---------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:  # (Lightning injects the sampler for such strategies)
        return True

    @property
    def root_device(self) -> torch.device:
        return self._device

    @property
    def global_rank(self) -> int:
        return self._shard[0] if self._shard is not None else 0

    @property
    def world_size(self) -> int:
        return self._shard[1] if self._shard is not None else 1

    @property
    def is_global_zero(self) -> bool:
        return self.node.is_first if self.node is not None else True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        rank, world = self._join().fixed_shard()
        return {"num_replicas": world, "rank": rank}

    def _join(self) -> GossipNode:
        if self.node is None:
            model = self.lightning_module
            if model is None:
                raise RuntimeError("GossipStrategy joins once the Trainer has the model (trainer.fit)")
            self.node = init(model, **{"handle_signals": False, **self._options})
        if self._shard is None:
            self._shard = self.node.fixed_shard()
        return self.node

    # -- the Trainer's life -------------------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        self._join()  # before anything asks who is global zero

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def process_dataloader(self, dataloader: Any) -> Any:
        """The training loader: this node's shard, leaving out what the cluster has done of
        the epoch a joiner starts in."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if not isinstance(dataloader, DataLoader) or trainer is None or not trainer.training:
            return dataloader
        sampler = sampler_of(dataloader)
        if sampler is None and isinstance(dataloader.sampler, DistributedSampler):
            s = dataloader.sampler
            sampler = ShardSampler(dataloader.dataset, s.num_replicas, s.rank, shuffle=s.shuffle, seed=s.seed,
                                   drop_last=s.drop_last)
            dataloader = _update_dataloader(dataloader, sampler)
        node = self._join()
        if sampler is not None and node.steps:
            steps_per_epoch = max(1, math.ceil(len(dataloader) / max(1, trainer.accumulate_grad_batches)))
            epoch, done = divmod(node.steps, steps_per_epoch)
            batch = int(dataloader.batch_size or 1) * max(1, trainer.accumulate_grad_batches)
            sampler.resume_at(epoch, done * batch)
            self._resume = (epoch, done)
        return dataloader

    def on_train_start(self) -> None:
        super().on_train_start()
        node = self._join()
        trainer = self.lightning_module.trainer
        if trainer.global_step > node.steps:  # its own checkpoint (ckpt_path) is the newer state
            node.keep_own_state()
            log.info("%s: its checkpoint (step %d) is newer than the cluster's state (step %d)", node.id,
                     trainer.global_step, node.steps)
        _attach(node, trainer)
        self._together = True
        if trainer.global_step != node.steps:
            epoch, done = _move_loops(trainer, node.steps)
            log.info("%s: Lightning continues at the cluster's step %d (epoch %d, after batch %d)", node.id,
                     node.steps, epoch, done)

    # -- collectives ------------------------------------------------------------------------------
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not self._together or not isinstance(tensor, torch.Tensor):
            return tensor
        return _reduce(self.node, tensor, _op_name(reduce_op))

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        if not self._together:
            return tensor
        return torch.stack(self.node.all_gather(tensor))

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not self._together:
            return decision
        votes = [bool(v) for v in self.node.all_gather(torch.tensor(float(decision)))]
        return builtins_all(votes) if all else any(votes)

    def barrier(self, name: str | None = None) -> None:
        if self._together:
            self.node.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        # objects do not travel (nothing is pickled between members); Lightning broadcasts what
        # every member computes alike (a checkpoint's file name), so each keeps its own
        return obj

    def teardown(self) -> None:
        # the node stays a member for what the script does after fit (validate, test: their
        # sync_dist metrics are collectives too); it leaves at node.close() or at the script's exit.
        # (ParallelStrategy's own teardown asks a cluster environment, which gossip has none of)
        pl.strategies.Strategy.teardown(self)


builtins_all = all


class GossipCallback(pl.Callback):
    """Gossip with Lightning's default strategy, for a script that shards its own loader
    with ``node.sampler(dataset)`` (see the module)::

        node = gossip.init(model)
        loader = DataLoader(ds, batch_size=32, sampler=node.sampler(ds))
        L.Trainer(callbacks=[GossipCallback(node)]).fit(model, loader)
    """

    def __init__(self, node: GossipNode) -> None:
        if not isinstance(node, GossipNode):
            raise ValueError(f"node must be a GossipNode (gossip.init), got {type(node).__name__}")
        self.node = node

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        loaders = trainer.train_dataloader
        flat = getattr(loaders, "flattened", None) or (loaders if isinstance(loaders, (list, tuple)) else [loaders])
        for dl in flat:
            s = getattr(dl, "sampler", None)
            world = self.node.world_size
            if world > 1 and not (isinstance(s, DistributedSampler) and s.num_replicas == world):
                raise ValueError("GossipCallback: the training loader is not sharded among the cluster's "
                                 f"{world} members (its sampler is a {type(s).__name__}): every node would train "
                                 "the same batches. Give it sampler=node.sampler(dataset), or use "
                                 "strategy=GossipStrategy()")
        _attach(self.node, trainer)
