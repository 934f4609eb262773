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

**Under torchrun** (``torchrun --nproc-per-node K script.py``: a world of K > 1 processes),
each process is one rank of a group member (docs/GROUPS.md), with the same one argument:

- the strategy starts the process group if the script did not (gloo on CPU, NCCL on CUDA,
  Lightning's ``_init_dist_connection``), and when fitting, with ``intra="ddp"`` (the
  default) wraps the LightningModule in ``DistributedDataParallel``, as Lightning's
  ``DDPStrategy`` does (its forward redirection and ``prepare_for_backward`` included);
  with ``intra="fsdp"`` shards it with FSDP2's ``fully_shard`` over a 1-D mesh of the
  group, as :meth:`gossip.groups.group.Group.wrap` does (each direct child with
  parameters, then the LightningModule itself, in place; what ``configure_model`` sharded
  already is kept), and sends ``training_step`` (and the validation, test and predict
  steps) through the root module's forward, so FSDP's root hooks run. Then it makes the
  node on every rank: :class:`gossip.GossipNode` over the wrapped model is a
  :class:`~gossip.groups.user_loop.GroupNode` (rank 0 runs the member's protocol, rank r
  gossips slice r of the replica, or its FSDP shards, with rank r of the other groups).
  Lightning's ``configure_optimizers`` runs after that, over the sharded parameters;
- ``global_rank`` / ``world_size`` (and the sampler's arguments) are ``m*K + r`` of ``M*K``
  for rank r of the member with shard m: the K ranks of every member read disjoint data;
- ``reduce`` (``sync_dist``), ``all_gather``, ``barrier`` and ``reduce_boolean_decision``
  go over every rank of every member through the group forms of the collectives
  (:mod:`gossip.groups.collectives`); ``broadcast`` is rank 0's object inside the group;
  before training starts they stay inside the group (a joining group has no partners yet);
- ``trainer.is_global_zero`` holds on rank 0 of the first member only: Lightning's
  checkpoints are written by that one process, a full state dict either way (DDP's
  replica; under FSDP the model and optimizer state gathered from the shards, in the
  checkpoint dump Lightning makes on every rank, so the gathering cannot wait for a rank
  that does not save; the file is a plain Lightning checkpoint). A ``ckpt_path`` loads
  the model before sharding and the optimizer state into the shards.

The schedulers stay each group's own (a group hands a joiner its parameters only). Call
``trainer.strategy.node.close()`` on every rank at the end (before ``destroy_process_group``).
"""

from __future__ import annotations

import logging
import math
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.overrides.distributed import _sync_module_states, prepare_for_backward
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
    from lightning.pytorch.strategies.strategy import _ForwardRedirection
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.data import _update_dataloader
except ImportError as e:  # pragma: no cover - the optional extra
    raise ImportError("gossip.integrations.lightning needs Lightning: pip install \".[lightning]\"") from e

from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from gossip.groups.user_loop import GroupNode  # (GossipNode's form on each rank under torchrun)
from gossip.peer.user_loop import GossipNode, distributed_world, init
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
    """The Trainer's optimizer and schedulers to the node (a joiner's state goes in now); a
    group's node takes the optimizer only, its schedulers staying each rank's own."""
    optimizers = list(trainer.optimizers)
    if len(optimizers) != 1:
        raise ValueError(f"gossip counts the steps of one optimizer; configure_optimizers gave {len(optimizers)}")
    if not isinstance(node, GroupNode):
        node.attach(optimizers[0], scheduler=_schedulers(trainer) or None)
        return
    node.attach(optimizers[0])
    if _schedulers(trainer):
        log.info("%s rank %d: the learning-rate schedulers are stepped by Lightning on every rank; a group hands a "
                 "joiner its parameters only, not their state", node.id, node.group_rank)


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
    """A Lightning strategy for one gossip member per process, or, under torchrun, for each
    rank of a group member (see the module).

    Parameters
    ----------
    gossip : a :class:`gossip.GossipNode` made by :func:`gossip.init` with this model, or the
        keywords to make one (``listen``, ``peers``, ``period``, ``timeout`` ...; default:
        ``GOSSIP_LISTEN`` / ``GOSSIP_PEERS`` from the environment); under torchrun, the
        keywords only (the node is made after the model is wrapped)
    device : where the model trains (``"cpu"``, ``"cuda:0"``; under torchrun ``"cuda"`` is
        ``cuda:LOCAL_RANK``)
    intra : under torchrun, how the group trains inside: ``"ddp"`` (a replica per rank) or
        ``"fsdp"`` (FSDP2's ``fully_shard``: each rank holds a shard of the parameters,
        gradients and optimizer state)
    ddp : under torchrun, keywords for ``DistributedDataParallel`` (``find_unused_parameters``, ...)
    timeout : under torchrun, the process group's collective timeout, when the strategy starts it
    """

    strategy_name = "gossip"

    def __init__(self, gossip: GossipNode | dict[str, Any] | None = None, device: str | torch.device = "cpu",
                 intra: str = "ddp", ddp: dict[str, Any] | None = None, timeout: timedelta = timedelta(minutes=30),
                 **kwargs: Any) -> None:
        if intra not in ("ddp", "fsdp"):
            raise ValueError(f"intra must be one of ddp, fsdp, got {intra!r}")
        if ddp is not None and not isinstance(ddp, dict):
            raise ValueError(f"ddp must be a dict of DistributedDataParallel's keywords, got {type(ddp).__name__}")
        if gossip is not None and not isinstance(gossip, (GossipNode, dict)):
            raise ValueError(f"gossip must be a GossipNode (gossip.init) or a dict of its options, "
                             f"got {type(gossip).__name__}")
        # a rank of a group member: torchrun started this process in a world of more than one
        self.in_group = distributed_world() > 1
        if intra == "fsdp" and not self.in_group:
            raise ValueError("intra='fsdp' shards the model over the ranks of a group: start the script with "
                             "torchrun --nproc-per-node K (K > 1; WORLD_SIZE is not set above 1 here)")
        if intra == "fsdp" and ddp is not None:
            raise ValueError("ddp= holds DistributedDataParallel's options, which intra='fsdp' does not use")
        if self.in_group and isinstance(gossip, GossipNode):
            raise ValueError("under torchrun GossipStrategy wraps the model (DistributedDataParallel or fully_shard) "
                             "and makes the node on every rank after that: give gossip= as a dict of GossipNode's "
                             "options")
        dev = torch.device(device)
        if self.in_group and dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        super().__init__(parallel_devices=[dev], **kwargs)
        self.node: GossipNode | None = gossip if isinstance(gossip, GossipNode) else None
        self._options = dict(gossip) if isinstance(gossip, dict) else {}
        self._device = dev
        self._ddp_kwargs = dict(ddp or {})
        self.intra = intra
        self._timeout = timeout
        if self.in_group:
            # training_step and the others go through the wrapper's forward: DDP's hooks (and
            # prepare_for_backward for manual optimisation, as DDPStrategy), or the root FSDP
            # module's (its lazy init, unsharding its own parameters, the post-backward callback)
            self._forward_redirection = _DDPForwardRedirection() if intra == "ddp" else _ForwardRedirection()
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

    def _group_rank(self) -> tuple[int, int]:
        """This process's rank and its group's size (torch.distributed's, else torchrun's)."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return int(os.environ.get("RANK", "0")), distributed_world()

    @property
    def global_rank(self) -> int:
        if self._shard is not None:
            return self._shard[0]
        return self._group_rank()[0] if self.in_group else 0

    @property
    def world_size(self) -> int:
        if self._shard is not None:
            return self._shard[1]
        return self._group_rank()[1] if self.in_group else 1

    @property
    def is_global_zero(self) -> bool:
        if self.node is not None:
            return self.node.is_first
        return self._group_rank()[0] == 0 if self.in_group else True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self.in_group and self.node is None:
            # (before fit made the node: a validation of its own splits the group's data among its ranks)
            rank, world = self._group_rank()
        else:
            rank, world = self._join().fixed_shard()
        return {"num_replicas": world, "rank": rank}

    def _join(self) -> GossipNode:
        if self.node is None:
            if self.in_group:
                raise RuntimeError("under torchrun GossipStrategy makes the node when the Trainer sets up the model "
                                   "for fitting (trainer.fit)")
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
        if not self.in_group:
            self._join()  # before anything asks who is global zero
        elif not dist.is_initialized():
            if self.cluster_environment is None:
                self.cluster_environment = TorchElasticEnvironment()
            backend = "nccl" if self._device.type == "cuda" else "gloo"
            kwargs: dict[str, Any] = {"timeout": self._timeout}
            if backend == "nccl":
                kwargs["device_id"] = self._device
            _init_dist_connection(self.cluster_environment, backend, **kwargs)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Under torchrun, when fitting: the module in DDP, or sharded with ``fully_shard``,
        then the group's node over it (every rank blocks here until the group trains: rank 0
        finds the cluster). Lightning calls ``configure_optimizers`` after this, so the
        optimizer is built over the sharded parameters."""
        if not self.in_group:
            return model
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            if not _is_sharded(model):  # (sharded by an earlier fit: it stays so, each rank its shard)
                _sync_module_states(model)  # (no gradients to reduce: the group's ranks alike, as DDPStrategy)
            return model
        if self.intra == "fsdp":
            wrapped = self._fully_shard(model)
        else:
            ids = [self._device.index] if self._device.type == "cuda" else None
            wrapped = DistributedDataParallel(model, device_ids=ids, **self._ddp_kwargs)
        if self.node is None:
            self.node = GossipNode(wrapped, None, **{"handle_signals": False, **self._options})
            assert isinstance(self.node, GroupNode)
            self._shard = self.node.fixed_shard()
        return wrapped

    def _fully_shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """FSDP2 over a 1-D mesh of the whole group, as :meth:`gossip.groups.group.Group.wrap`
        shards: each direct child with parameters, then the root (the LightningModule itself,
        in place: its parameter names stay). What ``configure_model`` sharded already is kept
        (a child that is an FSDP module is left as it is; fully_shard of a parent takes only
        the parameters no nested one manages); a module sharded whole there is taken as it is."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(model, FSDPModule):
            return model
        mesh = init_device_mesh(self._device.type, (dist.get_world_size(),))
        for child in model.children():
            if not isinstance(child, FSDPModule) and any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- the steps: through the root FSDP module's forward -------------------------------------
    # (fully_shard changes the LightningModule in place, so self.model is the LightningModule
    # and Lightning would call training_step directly: the root's hooks would never run, and a
    # child's forward would take the root's part)
    def _redirect(self, name: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        with context():
            return self._forward_redirection(self.model, self.lightning_module, name, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not _is_sharded(self.model):
            return super().training_step(*args, **kwargs)
        return self._redirect("training_step", self.precision_plugin.train_step_context, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not _is_sharded(self.model):
            return super().validation_step(*args, **kwargs)
        return self._redirect("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if not _is_sharded(self.model):
            return super().test_step(*args, **kwargs)
        return self._redirect("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if not _is_sharded(self.model):
            return super().predict_step(*args, **kwargs)
        return self._redirect("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)

    # -- checkpoints of a sharded module: full state dicts, gathered on every rank ------------
    # Lightning dumps a checkpoint on every rank (trainer.save_checkpoint, ModelCheckpoint) and
    # only is_global_zero writes it; the gathering below is a collective inside the group, so it
    # happens here, in the dump every rank makes, never in the write one rank makes. Rank 0 of
    # each group gets the whole state (cpu_offload: the others an empty dict); the first
    # member's writes it. The file is a plain Lightning checkpoint (names as without FSDP,
    # optimizer state keyed by parameter index), loadable without FSDP.
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not _is_sharded(self.model):
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if not _is_sharded(self.model):
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        state = get_optimizer_state_dict(self.model, optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if state:  # (rank 0 of the group) by parameter index, as an unsharded optimizer's
            state = FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
        return state

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """A full optimizer state (every rank read the file: ``ckpt_path``) into the sharded
        optimizer, each rank taking its part (a collective, as Lightning loads on every rank)."""
        if not _is_sharded(self.model):
            return super().load_optimizer_state_dict(checkpoint)
        from lightning.fabric.strategies.model_parallel import _rekey_optimizer_state_if_needed
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            if isinstance(optimizer, LightningOptimizer):
                optimizer = optimizer._optimizer
            set_optimizer_state_dict(self.model, optimizer, _rekey_optimizer_state_if_needed(state, self.model),
                                     options=StateDictOptions(full_state_dict=True))

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if isinstance(self.model, DistributedDataParallel) and not self.lightning_module.automatic_optimization:
            prepare_for_backward(self.model, closure_loss)

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
    # (before training, a group's ranks reduce, gather and wait among themselves only)
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if not self._together:
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op) if self.in_group else tensor
        return _reduce(self.node, tensor, _op_name(reduce_op))

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        if not self._together:
            return super().all_gather(tensor, group, sync_grads) if self.in_group else tensor
        return torch.stack(self.node.all_gather(tensor))

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not self._together:
            return super().reduce_boolean_decision(decision, all) if self.in_group else decision
        votes = [bool(v) for v in self.node.all_gather(torch.tensor(float(decision)))]
        return builtins_all(votes) if all else any(votes)

    def barrier(self, name: str | None = None) -> None:
        if self._together:
            self.node.barrier()
        elif self.in_group and dist.is_initialized():  # (inside the group, as DDPStrategy's)
            if self._device.type == "cuda":
                dist.barrier(device_ids=[self._device.index])
            else:
                dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        # objects do not travel between members (nothing is pickled between them); Lightning
        # broadcasts what every member computes alike (a checkpoint's file name), so each keeps
        # its own. Inside a group, rank 0's (as DDP's): the ranks of a member agree
        if self.in_group and dist.is_initialized():
            box = [obj]
            dist.broadcast_object_list(box, 0)
            return box[0]
        return obj

    def teardown(self) -> None:
        # the node stays a member for what the script does after fit (validate, test: their
        # sync_dist metrics are collectives too); it leaves at node.close() or at the script's exit.
        # (ParallelStrategy's own teardown asks a cluster environment, which gossip has none of)
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module  # (DDP's wrapper goes, as DDPStrategy's teardown does)
        if self.in_group and self.node is not None and (self._device.type != "cpu" or _is_sharded(self.model)):
            # Strategy.teardown would move the module to the CPU, out of the shard the group's
            # node gossips until node.close() (which checks that the parameters are still there);
            # a sharded module stays where its shards are
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        pl.strategies.Strategy.teardown(self)


builtins_all = all


def _is_sharded(model: Any) -> bool:
    """The module is FSDP2's (``fully_shard``): its parameters are this rank's shards."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


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
