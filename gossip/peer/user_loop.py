"""Gossip inside a training loop of the user's own: :class:`GossipNode` drives a
:class:`~gossip.peer.driver.Peer` one optimizer step at a time instead of running a task.

What a PyTorch user expects from Horovod or DDP, without a master: the
optimizer's steps are counted by a post-step hook (the loop stays as it is),
every member starts from the parameters of the first member in the sorted
member list, shards have equal lengths (:meth:`GossipNode.sampler`), a node
whose data ends first keeps taking part in rounds until the others end (like
DDP's ``Join``), checkpoints are written and resumed (:meth:`GossipNode.epochs`
says where to continue), metrics and the model can be averaged over the cluster,
and SIGTERM / Ctrl+C end with a final checkpoint and a goodbye.

A node that joins a running cluster takes the whole training state of a member at
the join: parameters, the optimizer's state and learning rates, the schedulers'
state and the data position (:mod:`gossip.peer.data_plan`); its own checkpoint
only when that is newer. :func:`init` is the early form (``hvd.init()``): it
joins before any loader or framework object exists, and :meth:`GossipNode.attach`
hands over the optimizer and schedulers afterwards.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from gossip.core.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_members
from gossip.core.train_state import TrainStateError, plain, restore_plain
from gossip.mixing.settings import MIXING_OPTIONS, MixingSettings
from gossip.peer.collectives import Collectives
from gossip.peer.data_plan import EpochPlan, roll_forward
from gossip.peer.driver import Peer
from gossip.protocol import joining
from gossip.protocol.config import PeerConfig
from gossip.protocol.errors import PeerError
from gossip.protocol.timing import TIMING_OPTIONS
from gossip.training.node import resolve_device
from gossip.training.sampler import ShardSampler, sampler_of, shard
from gossip.training.sampler import steps_per_epoch as _steps_per_epoch

__all__ = ["GossipNode", "init", "ClusterFinished", "OPTIONS"]

log = logging.getLogger("gossip.user_loop")

_FLAG = re.compile(r"--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")

# gossip-node's options that mean nothing to a loop of the user's own, and why
REFUSED = {
    "steps": "a training loop of your own ends when its data does (node.epochs(...)); leave steps out",
    "task": "the model and optimizer given to GossipNode are what it trains; leave task out",
    "split": "your loader decides the data (node.sampler(dataset) shards it); leave split out",
    "slurm": "pass listen=, peers= (or GOSSIP_LISTEN / GOSSIP_PEERS) from the srun environment instead",
    "slurm_port": "pass listen=, peers= (or GOSSIP_LISTEN / GOSSIP_PEERS) from the srun environment instead",
    "config": "pass the options as keywords",
    "json": "close() returns the summary",
    "progress": "a loop of your own draws its own progress",
    "nproc_per_node": "for a group of K processes, start your script with torchrun --nproc-per-node K and wrap "
                      "the model (DDP or fully_shard) before GossipNode: each process is one rank of the group",
    "intra": "the group's intra is how you wrapped the model (DistributedDataParallel or fully_shard), under torchrun",
    "max_restarts": "a group's restarts are torchrun's own (torchrun --max-restarts N)",
    "as_group": "one process as a group of K slices is gossip-node's (gossip-node --as-group K)",
}
_OWN = ("listen", "peers", "mixing", "checkpoint_dir", "checkpoint_every", "resume")
#: the gossip-node options GossipNode takes as keywords (besides its own parameters)
OPTIONS = tuple(sorted({f.name for f in dataclasses.fields(PeerConfig)} - set(_OWN) - set(REFUSED)
                       | set(MIXING_OPTIONS) | set(TIMING_OPTIONS) | {"threads", "peers_file"}))


class ClusterFinished(joining.ClusterFinished, SystemExit):
    """Every member of the cluster this node would join has finished training: there is
    nothing left to train. Uncaught, it ends the script with exit status 0 (it is a
    ``SystemExit``), after one line in the log; catch it to do something else."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = 0


def _api_names(message: str) -> str:
    """``--world-size`` -> ``world_size``: errors of the Python API name its parameters, not CLI flags."""
    message = re.sub(r"--advertise HOST:PORT", "advertise='HOST:PORT'", message)
    return _FLAG.sub(lambda m: m.group(1).replace("-", "_"), message)


def default_logging() -> None:
    """A handler for the library's log (node id in every line) only if the user configured none."""
    lib = logging.getLogger("gossip")
    if lib.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    lib.addHandler(handler)
    if lib.level == logging.NOTSET:
        lib.setLevel(logging.INFO)


def check_options(options: dict[str, Any]) -> None:
    """Every keyword is an option GossipNode uses: refuse the others, saying why."""
    for name in options:
        if name in REFUSED:
            raise ValueError(f"{name} is not an option of GossipNode: {REFUSED[name]}")
        if name not in OPTIONS and name != "options":
            raise ValueError(f"unknown option {name!r} for GossipNode; valid: {', '.join(OPTIONS)}")


def set_threads(threads: Any) -> None:
    """``threads=``: torch's intra-op threads for this process (None: leave them)."""
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        torch.set_num_threads(threads)


def user_config(listen: str | None, peers: Any, mixing: MixingSettings | None, checkpoint_dir: str | Path | None,
                checkpoint_every: int, resume: bool, options: dict[str, Any]) -> PeerConfig:
    """GossipNode's keywords as gossip-node's settings, checked once: ``listen`` and ``peers``
    default to ``GOSSIP_LISTEN`` and ``GOSSIP_PEERS``; errors name the API's parameters.
    ``options``: the flat options left (``threads`` and ``device`` taken out already)."""
    if listen is None:  # like torchrun's environment: one script, its addresses set per process
        listen = os.environ.get("GOSSIP_LISTEN")
        if not listen:
            raise ValueError("listen is required: HOST:PORT to bind (or set GOSSIP_LISTEN)")
    if peers is None:
        peers = os.environ.get("GOSSIP_PEERS", "")
    if isinstance(peers, str):
        peers = [p for p in peers.split(",") if p.strip()]
    options = dict(options)
    peers_file = options.pop("peers_file", None)
    if peers_file:
        from gossip.peer.launch import read_peers_file

        peers = [*peers, *read_peers_file(peers_file)]
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be a non-negative integer, got {checkpoint_every!r}")
    if checkpoint_every and checkpoint_dir is None:
        raise ValueError("checkpoint_every needs checkpoint_dir (where to write the checkpoints)")
    if checkpoint_dir is not None:
        checkpoint_dir = str(checkpoint_dir)
    try:
        cfg = PeerConfig(listen=listen, peers=tuple(peers), mixing=mixing, checkpoint_dir=checkpoint_dir,
                         checkpoint_every=checkpoint_every, resume=resume, **options)
        cfg.node_id  # noqa: B018 - checks listen / advertise now, with the API's names
    except ValueError as e:
        raise ValueError(_api_names(str(e))) from None
    if checkpoint_dir is not None:
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
    return cfg


def distributed_world() -> int:
    """How many processes this one trains with under torch.distributed: the default process
    group's size once it exists (the user's ``init_process_group``), else torchrun's
    ``WORLD_SIZE``, else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (Accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``): the one whose step hooks run."""
    seen = 0
    while seen < 8:
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            inner = getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer or not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer, seen = inner, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer (or wrap one), got {type(optimizer).__name__}")
    return optimizer


def unwrap_scheduler(scheduler: Any) -> Any:
    """The torch scheduler inside Accelerate's ``AcceleratedScheduler``."""
    inner = getattr(scheduler, "scheduler", None)
    return inner if inner is not None and callable(getattr(inner, "state_dict", None)) else scheduler


def _schedulers(scheduler: Any, optimizer: torch.optim.Optimizer | None) -> list[Any]:
    """``scheduler=`` as a list, each checked to be a scheduler of ``optimizer``."""
    if scheduler is None:
        return []
    found = [unwrap_scheduler(s) for s in (scheduler if isinstance(scheduler, (list, tuple)) else [scheduler])]
    for s in found:
        if not (callable(getattr(s, "state_dict", None)) and callable(getattr(s, "load_state_dict", None))):
            raise ValueError(f"scheduler must be a learning-rate scheduler (state_dict / load_state_dict), "
                             f"got {type(s).__name__}")
        if optimizer is None:
            raise ValueError("scheduler needs the optimizer it schedules: pass optimizer too")
        theirs = getattr(s, "optimizer", None)
        if theirs is not None and unwrap_optimizer(theirs) is not optimizer:
            raise ValueError("scheduler must schedule the optimizer given to GossipNode, not another one")
    return found


def _set_last_lrs(schedulers: list[Any]) -> None:
    """The optimizer's learning rates as the schedulers last set them (a scheduler made
    after the optimizer's state was loaded reset them to its base rates)."""
    for s in schedulers:
        last = getattr(s, "_last_lr", None)
        opt = getattr(s, "optimizer", None)
        if isinstance(last, (list, tuple)) and opt is not None and len(last) == len(opt.param_groups):
            for group, lr in zip(opt.param_groups, last):
                if isinstance(group.get("lr"), torch.Tensor):
                    group["lr"].fill_(float(lr))
                else:
                    group["lr"] = lr


class GossipNode:
    """Gossip for a training loop of your own (the Horovod-style path).

    Wrap the model and optimizer once; the loop stays as it is::

        node = gossip.GossipNode(model, optimizer, listen="10.0.0.1:5555", peers=["10.0.0.2:5555"],
                                 checkpoint_dir="ckpt", checkpoint_every=100, scheduler=sched)
        loader = DataLoader(dataset, batch_size=64, sampler=node.sampler(dataset))
        for epoch in node.epochs(range(1, epochs + 1), loader):   # from where a restart left off
            train(model, loader, optimizer, epoch)                 # optimizer.step() gossips
            test(model, test_loader)
        node.close()

    The constructor joins the cluster (blocking until training starts, like
    ``gossip-node``). Every ``optimizer.step()`` counts a local step (a
    post-step hook; without an optimizer, call :meth:`step`) and every
    ``period`` steps the node exchanges with its neighbours and mixes.
    Without an optimizer (:func:`init`), :meth:`attach` gives it later.

    Parameters
    ----------
    model, optimizer : the replica this node trains and its optimizer (or a framework's
        wrapper of one)
    listen : ``HOST:PORT`` to bind (default: the environment's ``GOSSIP_LISTEN``)
    peers : some existing members, a list or a comma-separated string (default: ``GOSSIP_PEERS``)
    mixing : a :class:`~gossip.mixing.settings.MixingSettings`, or its options flat (``period=4``)
    checkpoint_dir, checkpoint_every : a checkpoint every that many steps and at the end
    scheduler : learning-rate scheduler(s) of ``optimizer``: their state goes into every
        checkpoint and to a joiner, and comes back on resume
    resume : continue from the newest checkpoint in ``checkpoint_dir``; default: when there is one
    same_start : every member takes the first member's parameters before the first step (like
        Horovod's ``broadcast_parameters``); members that resume or join keep theirs
    handle_signals : SIGTERM and Ctrl+C stop at the next step with a final checkpoint and a goodbye
    resume_step : the step of a framework's own checkpoint this node resumes from (told to the
        others while it waits: a cluster restarted as a whole starts at the furthest member's step)
    options : any of :data:`OPTIONS` (``topology``, ``timeout``, ``device``, ``threads`` ...);
        gossip-node's ``steps``, ``task`` and ``split`` are refused (they would be ignored)

    Raises :class:`ClusterFinished` (exit status 0 when uncaught) when the cluster it
    would join has finished training.

    **Under torchrun** (a torch.distributed world of more than one process: the default
    process group's size, else ``WORLD_SIZE``), each process is one rank of a group
    member, and ``GossipNode(model, optimizer)`` on every rank returns a
    :class:`gossip.groups.user_loop.GroupNode`: wrap the model first
    (``DistributedDataParallel`` or ``fully_shard``); ``listen`` is the group's address
    on every rank (rank r binds its port + r); rank 0 runs the member's protocol and the
    others follow it; :meth:`sampler` gives rank r of member m shard ``m*K + r``;
    :meth:`average`, :meth:`all_gather` and :meth:`barrier` run over every rank of every
    member. A plain module there, and what a group cannot do (``scheduler``,
    ``same_start=True``, :meth:`consensus_model`), are errors naming why (docs/GROUPS.md).
    """

    #: what GossipNode is in a process of a torch.distributed world of more than one (torchrun):
    #: one rank of a group member (:class:`gossip.groups.user_loop.GroupNode`). That module
    #: registers it here, since groups sits above peer; ``gossip.GossipNode`` imports it.
    group_form: type | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "GossipNode":
        if cls is GossipNode and distributed_world() > 1:
            form = GossipNode.group_form
            if form is None:
                raise ValueError(f"GossipNode runs in a torch.distributed world of {distributed_world()} processes "
                                 "(torchrun): each is one rank of a group member, the part gossip.groups.user_loop "
                                 "adds; use gossip.GossipNode (import gossip), not gossip.peer.user_loop's")
            return super().__new__(form)
        return super().__new__(cls)

    def __init__(self, model: torch.nn.Module, optimizer: Any = None, *,
                 listen: str | None = None, peers: Any = None, mixing: MixingSettings | None = None,
                 checkpoint_dir: str | Path | None = None, checkpoint_every: int = 0, resume: bool | None = None,
                 same_start: bool = True, handle_signals: bool = True, scheduler: Any = None,
                 resume_step: int = 0, **options: Any) -> None:
        default_logging()
        check_options(options)
        if optimizer is not None:
            optimizer = unwrap_optimizer(optimizer)
        schedulers = _schedulers(scheduler, optimizer)
        set_threads(options.pop("threads", None))
        device = options.pop("device", "auto")
        if device != "auto":
            dev = resolve_device(str(device))  # a device that is not here is an error, not a silent CPU run
            if any(p.device != dev for p in model.parameters()):
                model.to(dev)
        if checkpoint_dir is not None and resume is None:
            resume = latest_checkpoint(checkpoint_dir) is not None
        cfg = user_config(listen, peers, mixing, checkpoint_dir, checkpoint_every, bool(resume), options)
        self.model, self.optimizer = model, optimizer
        self.schedulers: list[Any] = []
        self.peer = Peer(cfg, model=model, optimizer=optimizer)
        if resume_step:
            if isinstance(resume_step, bool) or not isinstance(resume_step, int) or resume_step < 0:
                raise ValueError(f"resume_step must be a non-negative integer, got {resume_step!r}")
            self.peer.life.resume_step = max(self.peer.life.resume_step, resume_step)
        self.collectives = Collectives(self.peer)
        self.peer.life.on_node = self._on_node
        self._closed = False
        self._summary: dict[str, Any] | None = None
        self._signal: int | None = None
        self._handlers: dict[int, Any] = {}
        self._hooks: list[Any] = []
        self._checkpoint: dict[str, Any] | None = None  # the one resumed from, while parts of it wait for attach
        self.plan: EpochPlan | None = None
        try:
            try:
                if not self.peer.start():
                    raise PeerError("stopped before training started")
            except joining.ClusterFinished as e:
                log.warning("%s: %s: nothing left to train; exiting", self.peer.id, e)
                raise ClusterFinished(str(e)) from None
            except (ValueError, PeerError) as e:
                raise type(e)(_api_names(str(e))) from None
            if same_start:
                self.collectives.agree_start()
            self._take_state()
        except BaseException:
            self.peer.close()
            raise
        self.start_step = self.steps  # 0, a checkpoint's step, or the running cluster's
        self._t_start = time.monotonic()
        self._trained = 0
        self._every = cfg.eval_every or 100  # steps between records in the metrics log (log=, tensorboard=)
        if cfg.log or cfg.tensorboard:
            self.peer.report.last_eval = self.steps
        if optimizer is not None or schedulers:
            self.attach(optimizer, scheduler=schedulers or None)
        self._take_signals(handle_signals)
        if self.start_step:
            log.info("%s: continuing at step %d", self.peer.id, self.start_step)

    # -- who and where ---------------------------------------------------------------------
    @property
    def id(self) -> str:
        """This node's member id (``HOST:PORT``)."""
        return self.peer.id

    @property
    def rank(self) -> int:
        """This node's shard in the current epoch (its place among the epoch's members;
        ``rank=`` when given); a node that joined in the middle of an epoch has its
        place among the members it joined until the next one begins."""
        shard = self._shard()
        return shard[0] if shard is not None else int(self.peer.rank)

    @property
    def world_size(self) -> int:
        """How many shards the current epoch's data has (see :attr:`rank`)."""
        shard = self._shard()
        return shard[1] if shard is not None else int(self.peer.world_size)

    @property
    def is_first(self) -> bool:
        """Whether this node is the first of the current members (one node of the cluster,
        like DDP's rank 0: the one that saves the final model, say)."""
        members = self.members
        return not members or members[0] == self.peer.id

    @property
    def members(self) -> list[str]:
        return list(self.peer.node.members) if self.peer.node else []

    @property
    def steps(self) -> int:
        """Local steps so far, on the cluster's count: a node that joined late, resumed
        from a checkpoint, or joined again after a stall continues from the step the
        cluster is at."""
        return int(self.peer.node.step) if self.peer.node is not None else 0

    @property
    def consensus_distance(self) -> float | None:
        """(1/n) sum_i ||x_i - x_mean||^2 at the last :meth:`consensus_model` call."""
        return self.collectives.consensus_distance

    def _shard(self) -> tuple[int, int] | None:
        cfg = self.peer.cfg
        if cfg.world_size is not None:
            return int(cfg.rank), int(cfg.world_size)  # type: ignore[arg-type]
        return self.plan.shard_of(self.peer.id) if self.plan is not None else None

    # -- the state this node starts from -----------------------------------------------------
    def _on_node(self, node: Any) -> None:
        """Each life's node hands joiners this loop's part of the training state."""
        node.handover_extra = self._handover_extra

    def _handover_extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {"calls": self.collectives.calls}  # the collectives so far: numbered alike
        if self.plan is not None:
            out["epoch"] = self.plan.to_list()
        try:
            out["schedulers"] = [plain(s.state_dict()) for s in self.schedulers]
        except TypeError as e:
            log.warning("%s: a scheduler's state cannot travel (%s); a joiner starts its schedule afresh",
                        self.peer.id, e)
        return out

    def _take_state(self) -> None:
        """After the start: where this node's state came from (its checkpoint, a member, or
        neither) and the epoch it is in."""
        peer = self.peer
        node = peer.node
        assert node is not None
        extra: dict[str, Any] = {}
        if peer.resumed_from is not None:  # its own checkpoint (newer than any member's state)
            node.handed_over.pop("optimizer", None)
            self._checkpoint = load_checkpoint(peer.resumed_from)
            extra = {"epoch": self._checkpoint.get("epoch"), "schedulers": self._checkpoint.get("schedulers")}
            if node.optimizer is not None:
                self._checkpoint.pop("optimizer", None)  # loaded with the parameters already
        elif peer.state_from is not None:
            extra = node.handed_over.get("extra") or {}
            self._checkpoint = {"schedulers": extra.get("schedulers"), "from": peer.state_from}
            calls = extra.get("calls") if isinstance(extra, dict) else None
            if type(calls) is int and calls >= 0:
                self.collectives.calls = calls  # its next collective is the members' next
        plan = EpochPlan.from_list(extra.get("epoch")) if isinstance(extra, dict) else None
        owner = (self._checkpoint or {}).get("id")
        if plan is not None and peer.resumed_from is not None and owner in plan.members \
                and peer.id not in plan.members:  # its own checkpoint, written under another address
            plan = dataclasses.replace(plan, members=tuple(peer.id if m == owner else m for m in plan.members))
        self.plan = plan if plan is not None else EpochPlan(0, 0, tuple(self._members_at(0)))

    def attach(self, optimizer: Any = None, *, scheduler: Any = None, count_steps: bool = True) -> "GossipNode":
        """Give the node the optimizer (or a framework's wrapper of it) whose steps it
        counts, and the learning-rate schedulers, after :func:`init`: the state a member
        handed over at the join (or this node's checkpoint) goes into them now. Returns
        the node. Attaching another optimizer replaces the first.

        ``count_steps=False``: the optimizer's steps are not counted by its hooks; the
        caller calls :meth:`step` after each update, once the schedulers stepped too (a
        framework's end-of-step event: its own count then never differs from the node's)."""
        node = self.peer.node
        assert node is not None
        if not node.state.is_bound():  # a framework put new tensors in the model (loading a checkpoint, say)
            node.state.rebind()
            log.info("%s: the model's tensors were replaced since the join; gossiping the new ones", self.peer.id)
        if optimizer is not None:
            optimizer = unwrap_optimizer(optimizer)
            for h in self._hooks:
                h.remove()
            self._hooks = [optimizer.register_step_pre_hook(lambda *_: self._before_step()),
                           optimizer.register_step_post_hook(lambda *_: self._count_step())] if count_steps else []
            if optimizer is not node.optimizer:
                node.optimizer = self.peer.life.user_optimizer = optimizer
                self.optimizer = optimizer
                took = node.take_optimizer_state(optimizer)
                ck = self._checkpoint or {}
                if not took and ck.get("optimizer") is not None:
                    optimizer.load_state_dict(ck.pop("optimizer"))
            self.peer.life.defer_requests = True  # a joiner's state: between two steps (see _before_step)
        schedulers = _schedulers(scheduler, self.optimizer)
        if schedulers:
            self.schedulers = [*self.schedulers, *(s for s in schedulers if s not in self.schedulers)]
            saved = (self._checkpoint or {}).get("schedulers")
            if saved is not None:
                self._load_schedulers(saved, schedulers)
        return self

    def _load_schedulers(self, saved: Any, schedulers: list[Any]) -> None:
        """The schedulers' state from the checkpoint or member this node started from."""
        ck = self._checkpoint or {}
        where = f"the state of {ck['from']}" if "from" in ck else "the checkpoint"
        if not isinstance(saved, list) or len(saved) != len(self.schedulers):
            if self.start_step or self.steps:
                log.warning("%s: %s has %s scheduler(s), this node %d; its schedule starts afresh", self.peer.id,
                            where, len(saved) if isinstance(saved, list) else "no", len(self.schedulers))
            return
        for s in schedulers:
            st = saved[self.schedulers.index(s)]
            try:
                s.load_state_dict(restore_plain(st, s.state_dict()))
            except (TrainStateError, ValueError, KeyError, TypeError) as e:
                log.warning("%s: %s's scheduler state does not fit this node's %s (%s); it starts afresh",
                            self.peer.id, where, type(s).__name__, e)
                continue
        _set_last_lrs(schedulers)
        lrs = sorted({float(lr) for s in schedulers for lr in (getattr(s, "_last_lr", None) or [])})
        log.info("%s: took the schedule from %s (learning rate %s)", self.peer.id, where,
                 ", ".join(f"{lr:g}" for lr in lrs) or "-")

    def fixed_shard(self) -> tuple[int, int]:
        """``(rank, world_size)`` for a framework that shards its data once for the whole run
        (its sampler is built before training): its place among the members the cluster
        started with, which a joiner takes from its donor. A restarted member takes its own
        place again; a node new to the cluster the place of a starter that is gone, if any
        (else it shares one, with a warning)."""
        shard = self._shard()
        if self.peer.cfg.world_size is not None and shard is not None:
            return shard
        plan = self.plan or EpochPlan(0, 0, tuple(self._members_at(0)))
        first = EpochPlan(0, 0, plan.members)
        mine = first.shard_of(self.peer.id)
        if mine is not None:
            return mine
        current = set(self.members)
        gone = [m for m in plan.members if m not in current]
        if gone:
            log.info("%s: takes the shard of %s (a member the cluster started with, gone)", self.peer.id, gone[0])
            return plan.members.index(gone[0]), len(plan.members)
        rank = self.members.index(self.peer.id) % len(plan.members) if self.peer.id in self.members else 0
        log.warning("%s: the %d shards of this run are all taken (a framework shards once, when the cluster starts); "
                    "this node trains on the shard of %s too", self.peer.id, len(plan.members), plan.members[rank])
        return rank, len(plan.members)

    def keep_own_state(self) -> None:
        """A framework restored this node from a checkpoint of its own that is newer than the
        state a member handed over: do not load the member's optimizer and schedulers."""
        node = self.peer.node
        if node is not None:
            node.handed_over.pop("optimizer", None)
        self._checkpoint = None

    # -- data ------------------------------------------------------------------------------
    def sampler(self, dataset: Any, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> ShardSampler:
        """A ``DistributedSampler`` for this node's shard: equal lengths on every node (padded).
        :meth:`epochs` shares each epoch anew among the members of its start."""
        return ShardSampler(dataset, self.world_size, min(self.rank, self.world_size - 1), shuffle=shuffle,
                            seed=seed, drop_last=drop_last)

    def shard(self, dataset: Any) -> Any:
        """This node's equal-length part of a ``Dataset`` (what ``dataset[rank::world_size]`` means)."""
        return shard(dataset, self.rank, self.world_size)

    def _members_at(self, step: int) -> list[str]:
        """The members sharing the data of an epoch that begins at ``step`` (its first
        batch is step + 1): those of the round that step belongs to."""
        peer, node = self.peer, self.peer.node
        period = node.channels[0].period if node is not None else 1
        with peer.lock:
            members = peer.membership.at_round(step // period)
        return members or ([peer.id] if node is None else list(node.members))

    def epochs(self, epochs: int | Iterable[int], loader: Any = None, *,
               steps_per_epoch: int | None = None) -> Iterator[int]:
        """The epochs still to run: from the one the cluster is in (after a restart, a
        resume or a join), sharing each epoch's data among the members of its start
        (``reshard`` of the loader's :class:`ShardSampler`, ``set_epoch``) and leaving
        out the batches of it already done. A node new to the cluster joins in the
        middle of an epoch without a shard of it: it takes part in the rounds without
        training until the epoch ends, then runs that epoch's body with a loader that
        yields nothing, so that what the loop does after each epoch (an evaluation, the
        collectives, a scheduler's step) happens as on the others (see
        :mod:`gossip.peer.data_plan`). A loader of your own sharding (no
        :class:`ShardSampler`), or ``rank=`` and ``world_size=`` given, keeps its shards.

        ``epochs``: a count or the epoch numbers (``range(1, n + 1)``); the length of an
        epoch in optimizer steps is ``len(loader)`` unless ``steps_per_epoch`` is given.
        """
        order = list(range(epochs)) if isinstance(epochs, int) else list(epochs)
        if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int)
                                            or steps_per_epoch < 1):
            raise ValueError(f"steps_per_epoch must be a positive integer, got {steps_per_epoch!r}")
        if steps_per_epoch is None and loader is None:
            raise ValueError("epochs needs the loader (or steps_per_epoch) to know an epoch's length")
        sampler = sampler_of(loader) if loader is not None else None
        # equal shards of node.sampler(): each epoch shared among the members of its start. A
        # loader of the user's own sharding, or rank= / world_size= given: every epoch is this node's
        elastic = sampler is not None and self.peer.cfg.world_size is None

        def length(world: int) -> int:
            if steps_per_epoch is not None:
                return steps_per_epoch
            if elastic:
                sampler.reshard(world, 0)
            return _steps_per_epoch(loader)

        plan = self.plan or EpochPlan(0, 0, tuple(self._members_at(0)))
        first = True
        while True:
            plan = self.plan = roll_forward(plan, self.steps, length, self._members_at)
            if plan.index >= len(order):
                if first and self.steps:
                    log.info("%s: step %d: the cluster has run every epoch (%d)", self.peer.id, self.steps,
                             len(order))
                return
            spe = length(len(plan.members))
            done = self.steps - plan.start
            shard = plan.shard_of(self.peer.id) if elastic else None
            if elastic and shard is None:
                end = plan.start + spe
                log.info("%s: joined in epoch %s, whose data its %d members share; taking part in its rounds "
                         "without training until it ends at step %d", self.peer.id, order[plan.index],
                         len(plan.members), end)
                self._serve_until(end)
                if self.steps < end:
                    return  # stopped
                # the epoch's own code (evaluation, collectives, a scheduler's step) runs as on the
                # others; its loader yields nothing
                sampler.reshard(len(plan.members), 0)
                sampler.set_epoch(order[plan.index])
                sampler.skip(len(sampler))
            elif sampler is not None:
                if shard is not None:
                    sampler.reshard(shard[1], shard[0])
                sampler.set_epoch(order[plan.index])
                if done:
                    sampler.skip(done * int(getattr(loader, "batch_size", None) or 1))
            if first and (done or plan.index) and not (elastic and shard is None):
                log.info("%s: step %d: continuing in epoch %s, after batch %d of %d", self.peer.id, self.steps,
                         order[plan.index], done, spe)
            yield order[plan.index]
            first = False
            plan = self.plan = EpochPlan(plan.index + 1, self.steps, tuple(self._members_at(self.steps)))

    # -- training --------------------------------------------------------------------------
    def step(self) -> None:
        """Count one local step; with an optimizer given, ``optimizer.step()`` does it
        already and this does nothing (calling both counts each step once)."""
        if not self._hooks:
            self._before_step()  # (messages that arrived meanwhile)
            self._count_step()
            if not self._closed:
                self.peer.life.answer_requests()  # the state after this step, as the next one starts from

    def _before_step(self) -> None:
        """Before an optimizer step: the optimizer, the schedulers and the data position
        agree, so this is where a joiner waiting for this node's state gets it."""
        if self._closed:
            return
        peer = self.peer
        peer._service(0.0)
        peer.life.answer_requests()

    def _count_step(self) -> None:
        if self._closed:
            return
        if self._signal is not None:
            self._stop_on_signal()
        self.peer.step()
        self._trained += 1
        cfg = self.peer.cfg
        node = self.peer.node
        if node is None:
            return
        if cfg.checkpoint_dir and cfg.checkpoint_every and node.step % cfg.checkpoint_every == 0:
            self._save_checkpoint()
        report = self.peer.report
        if report.metrics is not None and node.step - report.last_eval >= self._every:
            report.last_eval = node.step
            report.log_metrics("eval", time=self.peer.clock() - self.peer.t0)

    def _serve_until(self, target: int) -> None:
        """Take part in the rounds without local steps until the cluster's step ``target``
        (a node new to the cluster, in the middle of an epoch it has no shard of)."""
        peer = self.peer
        node = peer.node
        assert node is not None
        if not any(ch.rule.synchronous for ch in node.channels):
            node.jump_to(target)  # asynchronous rules wait for nobody: nothing to take part in
            return
        while node.step < target and not peer.stop.is_set():
            if self._signal is not None:
                self._stop_on_signal()
            peer.life.answer_requests()
            peer.step()
            node = peer.node  # (a new life after the cluster dropped this node)
            assert node is not None

    def _save_checkpoint(self) -> None:
        node, cfg = self.peer.node, self.peer.cfg
        state = node.state_dict()
        state["schedulers"] = [s.state_dict() for s in self.schedulers]
        if self.plan is not None:
            state["epoch"] = self.plan.to_list()
        save_checkpoint(state, cfg.checkpoint_dir, node.step)
        save_members(cfg.checkpoint_dir, [m for m in node.members if m != self.peer.id])

    def neighbor_distance(self) -> float:
        """Squared distance to the neighbours' last sent parameters (a cheap local estimate)."""
        return self.peer.neighbor_distance()

    # -- the cluster's figures -------------------------------------------------------------
    def average(self, value: Any, weight: float = 1.0) -> Any:
        """The mean of ``value`` over the cluster's members (weighted by ``weight``, e.g. the
        number of test samples): a float, a sequence of floats, or a tensor.

        A collective: every member calls it at the same point of its loop (members
        that are gone are left out). The result is the same on every member.
        """
        return self.collectives.average(value, weight)

    def barrier(self) -> None:
        """Wait until every member reached its matching call (members that are gone are left out)."""
        self.collectives.barrier()

    def all_gather(self, value: Any) -> list[torch.Tensor]:
        """Every member's ``value`` (a tensor of the same shape on each), in member-id order.
        A collective, like :meth:`average`."""
        return self.collectives.all_gather(value)

    @contextlib.contextmanager
    def consensus_model(self) -> Iterator[torch.nn.Module]:
        """The model with the exact average of all members' parameters for the duration
        of the ``with`` block (to evaluate the cluster's model); its own afterwards.

        A collective (every member enters it at the same point); it moves every
        member's whole parameters to every other, once. Sets ``consensus_distance``,
        ``(1/n) sum_i ||x_i - x_mean||^2``.
        """
        with self.collectives.consensus_model(self.model) as m:
            yield m

    # -- the end ---------------------------------------------------------------------------
    def _serve_rounds(self) -> None:
        """This node's data ended: take part in the rounds (mixing, no local steps) while
        another member still trains, so that nobody waits for a round timeout (DDP's
        ``Join``). Asynchronous rules wait for nobody, so there is nothing to serve."""
        peer, node = self.peer, self.peer.node
        assert node is not None
        if not any(ch.rule.synchronous for ch in node.channels):
            return
        peer.status, peer.serving = "done", True
        peer.life.answer_requests(every=True)  # no more steps to answer between
        # said now, not at the next ping: it reaches each member before this node's next round does,
        # so a member whose data ends later knows that nobody needs it to serve
        peer.control.apply(peer.control.announce_status())
        step, served = node.step, 0
        try:
            while not peer.stop.is_set() and peer._excluded is None:
                # a member of this round's topology that has not said "done" still trains: right
                # after a fresh start its last word may still be "waiting" (its first ping as a
                # training node not here yet), and a node whose data ended at once served nobody
                with peer.lock:
                    busy = [k for k, m in peer.membership.members.items()
                            if k != peer.id and k in node.members and m.status != "done"]
                if not busy:
                    break
                node.step += 1  # the virtual step that schedules the next round; restored below
                due = [ch for ch in node.channels if node.step % ch.period == 0]
                if due:
                    peer._apply_members()
                    for ch in due:
                        peer._drive(node.exchange(ch), lambda: True)
                    served += 1
                else:
                    continue
        finally:
            node.step = step
            peer.serving = False
        if served:
            log.info("%s: data ended at step %d; took part in %d more round(s) while others trained", peer.id,
                     step, served)

    def close(self) -> dict[str, Any]:
        """Finish: take part in rounds until every other member's data ended too, write
        the final checkpoint, say goodbye; returns the summary. Idempotent."""
        if self._closed:
            return self._summary or {}
        self._closed = True
        self._let_go()
        peer = self.peer
        try:
            peer.complete_pending()
            if not peer.interrupted:
                self._serve_rounds()
            node, cfg = peer.node, peer.cfg
            if cfg.checkpoint_dir and node is not None and peer._excluded is None:
                self._save_checkpoint()
            peer.finish()
            summary = peer.summary()
            train = time.monotonic() - self._t_start
            for k in ("final_loss", "final_accuracy"):  # figures of a task; this loop's are the user's
                summary.pop(k, None)
            summary.update(train_time_s=train, trained_steps=self._trained, start_step=self.start_step,
                           steps_per_s=self._trained / train if train > 0 else None,
                           consensus_distance=self.consensus_distance)
            self._summary = summary
            log.info("%s: finished at step %d (%d trained here), round %d; %d round(s) timed out", peer.id,
                     summary["steps"], self._trained, summary["rounds"], summary["timed_out_rounds"])
            return summary
        finally:
            peer.close()

    def _take_signals(self, handle_signals: bool) -> None:
        """SIGTERM and Ctrl+C stop at the next step (when the user left them at their defaults),
        and the interpreter's exit closes the node."""
        if handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
                    self._handlers[sig] = signal.signal(sig, self._on_signal)
        atexit.register(self._at_exit)

    def _let_go(self) -> None:
        """At the end: the optimizer's step hooks off, the signals back to the user's handlers."""
        for h in self._hooks:
            h.remove()
        for sig, old in self._handlers.items():
            with contextlib.suppress(ValueError):
                signal.signal(sig, old)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._signal is not None:  # a second one: stop now
            signal.signal(signum, self._handlers.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)
        self._signal = signum
        self.peer.request_stop()  # a round being waited for ends now; the loop stops at its next step
        log.warning("%s: %s: stopping at the next step (final checkpoint, goodbye)", self.peer.id,
                    signal.Signals(signum).name)

    def _stop_on_signal(self) -> None:
        signum = self._signal
        assert signum is not None
        self.close()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _at_exit(self) -> None:
        if not self._closed:
            with contextlib.suppress(Exception):
                self.close()

    def __enter__(self) -> "GossipNode":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def init(model: torch.nn.Module, **kwargs: Any) -> GossipNode:
    """Join the cluster early, like ``hvd.init()``: before any loader or framework object
    exists. Returns the :class:`GossipNode` (``rank``, ``world_size``, ``start_step``,
    ``sampler(dataset)`` ...); give it the optimizer and schedulers with
    :meth:`GossipNode.attach` once they exist::

        node = gossip.init(model, listen="10.0.0.1:5555", peers="10.0.0.2:5555")
        loader = DataLoader(ds, batch_size=32, sampler=node.sampler(ds))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        node.attach(optimizer, scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.7))

    The cluster counts this node in from the moment it returns: build what the first
    step needs promptly (a synchronous round waits ``timeout`` seconds for a member).
    Takes the keywords of :class:`GossipNode` (not ``optimizer``).
    """
    if "optimizer" in kwargs:
        raise ValueError("init takes no optimizer: give it with node.attach(optimizer) once it exists")
    return GossipNode(model, None, **kwargs)
