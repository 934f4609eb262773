"""GossipNode under torchrun: each process of a training loop of the user's own is one
rank of a group member (:class:`GroupNode`).

The user wraps the model as usual (``DistributedDataParallel`` or ``fully_shard``) and
calls ``gossip.GossipNode(model, optimizer)`` on every rank. In a torch.distributed
world of more than one process, :class:`~gossip.peer.user_loop.GossipNode` becomes a
:class:`GroupNode` (this module registers it there, since groups sits above peer): the
pieces ``gossip-node --nproc-per-node K`` runs, around the user's loop instead of a task.

- The group is the user's process group (:func:`~gossip.groups.group.current_group`),
  never initialised or destroyed here; rank 0 is a :class:`~gossip.peer.group.GroupLeader`
  (the member's protocol, over its shard), ranks 1..K-1 :class:`~gossip.peer.group.GroupFollower`s;
  the ranks' channel is torchrun's store (:class:`~gossip.groups.link.StoreLink`).
- Rank r gossips its :class:`~gossip.training.shards.ShardView`: with DDP, slice r of the
  replica's flat vector (:class:`~gossip.training.shards.ReplicaSlice`; its
  :class:`~gossip.core.state.FlatState` is built over the DDP-wrapped module's
  parameters, which is safe: see :func:`~gossip.groups.group.shard_view`); with
  ``fully_shard``, the rank's
  local shards (:class:`~gossip.training.shards.FsdpShards`).
- ``optimizer.step()`` on every rank counts the step and, every ``period`` steps, runs
  the exchange the group's loop runs (``gossip.groups.run``): rank 0's decision first,
  then each rank's shard mixed, then the group made whole again (``after_mix``).
- ``average``, ``all_gather`` and ``barrier`` across members, on every rank: inside the
  group first, then rank 0 in the members' collective (as a single-process member), then
  rank 0's result to the other ranks through the store (:mod:`gossip.groups.collectives`).

What the single-process node does and a group cannot (yet) raises an error naming it:
see :data:`GROUP_REFUSED` and :data:`NOT_FOR_GROUPS`.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from gossip.groups.collectives import GroupCollectives, TorchIntra, follower_wait
from gossip.groups.group import current_group, shard_view, wrapped
from gossip.mixing.settings import MixingSettings
from gossip.peer.collectives import Collectives
from gossip.peer.group import GroupFollower, GroupLeader, rank_counts
from gossip.peer.user_loop import (ClusterFinished, GossipNode, check_options, default_logging, init, set_threads,
                                   unwrap_optimizer, user_config)
from gossip.protocol import joining
from gossip.protocol.group import group_of
from gossip.training.sampler import ShardSampler, sampler_of, shard
from gossip.training.sampler import steps_per_epoch as _steps_per_epoch

__all__ = ["GroupNode", "GossipNode", "init", "ClusterFinished", "GROUP_REFUSED", "NOT_FOR_GROUPS"]

log = logging.getLogger("gossip.user_loop")

# GossipNode's keywords that a group cannot honour, and why
GROUP_REFUSED = {
    "scheduler": "a joining group takes the parameters' shards only, and a group's checkpoint holds the model and "
                 "optimizer: a scheduler's state would neither travel nor come back. Leave scheduler out and step "
                 "your scheduler yourself",
    "same_start": "a group cannot take the first member's parameters at the start yet: build the model alike in "
                  "every group (torch.manual_seed before building it) and leave same_start out",
    "resume_step": "a group resumes from its own sharded checkpoints (checkpoint_dir=), not a framework's",
    "device": "the model already lives on this rank's device (DDP or fully_shard placed it); leave device out",
}

# GossipNode's methods that a group cannot run, and why (average, all_gather and barrier have a
# group form: gossip.groups.collectives)
NOT_FOR_GROUPS = {
    "consensus_model": "the exact average of the members' models would move every rank's shard to rank r of "
                       "every other member, and only rank 0 takes part in the collectives across members; "
                       "evaluate each group's model on its own and combine the figures with node.average",
}
NOT_FOR_GROUPS["neighbor_distance"] = ("rank 0 sees only its own shard, so its distance to the neighbours is not "
                                       "the model's; the summary of close() on each rank holds its shard's figures")


def _refuse(name: str) -> None:
    raise ValueError(f"{name} is not supported for a group under torchrun: {GROUP_REFUSED[name]}")


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    raise ValueError("the model has no parameters to gossip")


class GroupNode(GossipNode):
    """One rank of a group member in a training loop of the user's own, under torchrun.

    Made by ``gossip.GossipNode(model, optimizer, ...)`` in a process of a torch.distributed
    world of more than one (see :mod:`gossip.groups.user_loop`); takes the same keywords,
    less :data:`GROUP_REFUSED`. ``listen`` (or ``GOSSIP_LISTEN``) is the group's address,
    the same on every rank: rank r binds its port + r, and the member's id is rank 0's.

    The constructor blocks until the group trains (rank 0 finds the cluster; the others
    wait for its start). Every rank's ``optimizer.step()`` counts the step; at an exchange
    every rank mixes its shard with rank r of the neighbour groups. Call :meth:`close`
    on every rank (collectives inside), before ``destroy_process_group``.
    """

    def __init__(self, model: nn.Module, optimizer: Any = None, *, listen: str | None = None, peers: Any = None,
                 mixing: MixingSettings | None = None, checkpoint_dir: str | Path | None = None,
                 checkpoint_every: int = 0, resume: bool | None = None, same_start: bool | None = None,
                 handle_signals: bool = True, scheduler: Any = None, resume_step: int = 0, **options: Any) -> None:
        from gossip.groups.checkpoint import latest_group_checkpoint, load_group_checkpoint, restore_node

        default_logging()
        check_options(options)
        if scheduler is not None:
            _refuse("scheduler")
        if same_start:
            _refuse("same_start")
        if resume_step:
            _refuse("resume_step")
        if options.pop("device", "auto") != "auto":
            _refuse("device")
        intra, _ = wrapped(model)
        if optimizer is not None:
            optimizer = unwrap_optimizer(optimizer)
        set_threads(options.pop("threads", None))
        if checkpoint_dir is not None and resume is None:
            resume = latest_group_checkpoint(checkpoint_dir) is not None
        if checkpoint_dir is not None and optimizer is None:
            raise ValueError("checkpoint_dir in a group needs the optimizer at once (a group's checkpoint holds the "
                             "model and the optimizer): pass optimizer to GossipNode, not later to attach")
        cfg = user_config(listen, peers, mixing, checkpoint_dir, checkpoint_every, bool(resume), options)
        group = current_group(intra, _device_of(model))
        view = shard_view(intra, model, group)
        self.model, self.optimizer, self.cfg = model, optimizer, cfg
        self.group, self.view, self.intra = group, view, intra
        self._closed = False
        self._summary: dict[str, Any] | None = None
        self._signal: int | None = None
        self._handlers: dict[int, Any] = {}
        self._hooks: list[Any] = []
        k, r = group.size, group.rank
        link = group.link()
        member: GroupLeader | GroupFollower
        across: Collectives | None = None
        if r == 0:
            member = GroupLeader(cfg, view.flat, view.fingerprint, link, k)
            across = self._speak_for_the_group(member)
        else:
            member = GroupFollower(cfg, r, view.flat, view.fingerprint, link)
        self.member = member
        self.collectives = GroupCollectives(r, k, link, TorchIntra(group.device), across,
                                            follower_wait(cfg.timing.join_timeout, cfg.timeout))
        try:
            resumed = None
            path = latest_group_checkpoint(checkpoint_dir) if cfg.resume and checkpoint_dir else None
            if path is not None:  # (every rank reads the same directory's newest)
                resumed = load_group_checkpoint(path, group, model, optimizer, view)
                if isinstance(member, GroupLeader):
                    member.life.resume_step = resumed["step"]
                    member.resumed = (str(path), resumed)
            member.listen()
            group.barrier()  # every rank listens before rank 0 says hello: a joiner's ranks are all there
            try:
                start = member.start()  # (rank 0 stopping first tells the other ranks why)
            except joining.ClusterFinished as e:
                log.warning("%s: %s: nothing left to train; exiting", cfg.node_id, e)
                raise ClusterFinished(str(e)) from None
            if resumed is not None and member.node.step <= resumed["step"] and not member.joined:
                restore_node(member.node, resumed)  # a cluster restarted as a whole: this group's own state
            view.after_mix()  # DDP: a joiner's slices taken, the replicas whole again
        except BaseException:
            member.__exit__(None, None, None)
            raise
        if member.joined:
            log.info("%s rank %d: took the member's shard; this rank's optimizer state (momentum, learning rates) "
                     "is its own: a group hands over parameters only", cfg.node_id, r)
            extra = member.node.handed_over.get("extra") if across is not None else None
            calls = extra.get("calls") if isinstance(extra, dict) else None
            if across is not None and type(calls) is int and calls >= 0:
                across.calls = calls  # the group's next collective is the members' next
        self._shard = (start.rank * k + r, start.world * k)  # rank r of member m: shard m*K + r of world*K
        self.start_step = self.steps
        self._t_start = time.monotonic()
        self._trained = 0
        self._every = cfg.eval_every or 100
        if isinstance(member, GroupLeader) and (cfg.log or cfg.tensorboard):
            member.peer.report.last_eval = self.steps
        if optimizer is not None:
            self.attach(optimizer)
        self._take_signals(handle_signals)
        log.info("%s rank %d of %d (%s): training from step %d on data shard %d of %d", cfg.node_id, r, k, intra,
                 self.start_step, *self._shard)

    # -- who and where ---------------------------------------------------------------------
    @property
    def id(self) -> str:
        """The group's member id (rank 0's ``HOST:PORT``), the same on every rank."""
        return self.cfg.node_id

    @property
    def rank(self) -> int:
        """This rank's data shard: ``m*K + r`` for rank r of the member with shard m."""
        return self._shard[0]

    @property
    def world_size(self) -> int:
        """How many data shards there are: ``K`` per member."""
        return self._shard[1]

    @property
    def group_rank(self) -> int:
        return self.group.rank

    @property
    def group_size(self) -> int:
        return self.group.size

    @property
    def is_first(self) -> bool:
        """Rank 0 of the first member: one process of the whole cluster."""
        members = self.members
        return self.group.rank == 0 and (not members or members[0] == self.id)

    @property
    def members(self) -> list[str]:
        """The members of the current round by member id (rank 0's address), on every rank
        (rank r's node mixes with rank r of each: ``HOST:PORT+r``)."""
        node = self.member.node
        r = self.group.rank
        return [group_of(a, r) for a in node.members] if node is not None else []

    @property
    def steps(self) -> int:
        node = self.member.node
        return int(node.step) if node is not None else 0

    @property
    def consensus_distance(self) -> float | None:
        return None  # (no consensus_model in a group)

    def fixed_shard(self) -> tuple[int, int]:
        """``(rank, world_size)``: a group's data shard is fixed when it starts."""
        return self._shard

    def keep_own_state(self) -> None:
        """Nothing to do: a group takes no optimizer or scheduler state from a member."""

    # -- data ------------------------------------------------------------------------------
    def sampler(self, dataset: Any, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> ShardSampler:
        """A ``DistributedSampler`` for this rank's shard (:attr:`rank` of :attr:`world_size`):
        the K ranks of every member take disjoint parts of the data, all of equal length."""
        return ShardSampler(dataset, self.world_size, self.rank, shuffle=shuffle, seed=seed, drop_last=drop_last)

    def shard(self, dataset: Any) -> Any:
        return shard(dataset, self.rank, self.world_size)

    def epochs(self, epochs: int | Iterable[int], loader: Any = None, *,
               steps_per_epoch: int | None = None) -> Iterator[int]:
        """The epochs still to run, from the one the group's step is in (after a resume or a
        join), leaving out the batches of it already done (``set_epoch`` and ``skip`` of the
        loader's :class:`ShardSampler`). The shards stay as the group started: a group's
        data is not shared anew when members come and go."""
        order = list(range(epochs)) if isinstance(epochs, int) else list(epochs)
        if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int)
                                            or steps_per_epoch < 1):
            raise ValueError(f"steps_per_epoch must be a positive integer, got {steps_per_epoch!r}")
        if steps_per_epoch is None and loader is None:
            raise ValueError("epochs needs the loader (or steps_per_epoch) to know an epoch's length")
        spe = steps_per_epoch or _steps_per_epoch(loader)
        sampler = sampler_of(loader) if loader is not None else None
        index = self.steps // spe
        while index < len(order) and not self._closed:
            done = self.steps - index * spe
            if sampler is not None:
                sampler.set_epoch(order[index])
                if done:
                    sampler.skip(done * int(getattr(loader, "batch_size", None) or 1))
            if done:
                log.info("%s rank %d: step %d: continuing in epoch %s, after batch %d of %d", self.id,
                         self.group.rank, self.steps, order[index], done, spe)
            yield order[index]
            index = max(index + 1, self.steps // spe)

    # -- training --------------------------------------------------------------------------
    def attach(self, optimizer: Any = None, *, scheduler: Any = None, count_steps: bool = True) -> "GroupNode":
        """Give the node the optimizer whose steps it counts (after :func:`gossip.init`)."""
        if scheduler is not None:
            _refuse("scheduler")
        if optimizer is not None:
            optimizer = unwrap_optimizer(optimizer)
            for h in self._hooks:
                h.remove()
            self._hooks = [optimizer.register_step_post_hook(lambda *_: self._count_step())] if count_steps else []
            self.optimizer = optimizer
        return self

    def step(self) -> None:
        """Count one local step (on every rank); with an optimizer given, ``optimizer.step()``
        does it already and this does nothing."""
        if not self._hooks:
            self._count_step()

    def _count_step(self) -> None:
        if self._closed:
            return
        member = self.member
        step = member.node.step + 1
        if member.step(step):  # an exchange (or a new life's shards): every rank takes part
            self._mixed()
        self._trained += 1
        if member.stopped:  # rank 0 decided (a signal): every rank stops at this same step
            self._stop()
        step = member.node.step  # (a new life continues at its donor's step)
        cfg = self.cfg
        if isinstance(member, GroupLeader):
            report = member.peer.report
            if report.metrics is not None and step - report.last_eval >= self._every:
                report.last_eval = step
                report.log_metrics("eval", time=member.peer.clock() - member.peer.t0)
        if cfg.checkpoint_dir and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            self._save_checkpoint()

    def _mixed(self) -> None:
        """After an exchange, as the group's own loop does: the shard back where the model
        reads it (a send held in place moved it), then the group whole again."""
        node, view = self.member.node, self.view
        if node.state.flat is not view.flat:
            home = view.moved(node.state.flat)
            if home is not node.state.flat:
                node.state.rehome(into=home)
        view.after_mix()
        if not view.is_bound():
            raise RuntimeError("the model's parameters no longer live in the gossip shard (something replaced "
                               "them after GossipNode was made)")

    def _save_checkpoint(self) -> None:
        from gossip.groups.checkpoint import save_group_checkpoint

        node = self.member.node
        save_group_checkpoint(self.cfg.checkpoint_dir, node.step, self.group, self.model, self.optimizer, node,
                              self.view, members=list(node.members))

    # -- collectives across members ----------------------------------------------------------
    @staticmethod
    def _speak_for_the_group(leader: GroupLeader) -> Collectives:
        """Rank 0's part in the members' collectives, as a single-process member's; a joiner
        takes the count of collectives so far with rank 0's shard (``calls``)."""
        across = Collectives(leader.peer)
        life = leader.peer.life
        then = life.on_node  # (GroupLead's: binds the shard)

        def on_node(node: Any) -> None:
            if then is not None:
                then(node)
            node.handover_extra = lambda: {"calls": across.calls}

        life.on_node = on_node
        return across

    def _open(self, name: str) -> None:
        if self._closed:
            raise RuntimeError(f"GossipNode.{name} after close(): the node has left the cluster")

    def average(self, value: Any, weight: float = 1.0) -> Any:
        """The weighted mean of ``value`` (a float, a sequence of floats, or a tensor) over
        every rank of every member, the same on every rank: each rank's ``weight * value``
        and ``weight`` are summed inside the group, then the members' weighted mean is
        taken (see :mod:`gossip.groups.collectives`). A collective: every rank of every
        member calls it at the same point of its loop."""
        self._open("average")
        return self.collectives.average(value, weight)

    def all_gather(self, value: Any) -> list[torch.Tensor]:
        """Every rank's ``value`` (the same shape everywhere): one tensor per rank of every
        live member, in member id order and, within a member, rank order. A collective."""
        self._open("all_gather")
        return self.collectives.all_gather(value)

    def barrier(self) -> None:
        """Return once every rank of every live member has reached its matching call."""
        self._open("barrier")
        self.collectives.barrier()

    # -- what a group cannot do --------------------------------------------------------------
    def _not_for_groups(self, name: str) -> Any:
        raise NotImplementedError(f"GossipNode.{name} is not supported for a group under torchrun: "
                                  f"{NOT_FOR_GROUPS[name]}")

    def consensus_model(self) -> Any:
        return self._not_for_groups("consensus_model")

    def neighbor_distance(self) -> float:
        return self._not_for_groups("neighbor_distance")

    # -- the end ---------------------------------------------------------------------------
    def close(self) -> dict[str, Any]:
        """Finish, on every rank: mix a round still in flight, write the final checkpoint,
        wait for the group's other ranks, then rank 0 says goodbye (and serves joiners for
        at most ``grace``) while the others follow it; returns this rank's summary. Idempotent."""
        if self._closed:
            return self._summary or {}
        self._closed = True
        self._let_go()
        member = self.member
        try:
            member.complete_pending()
            self._mixed()
            if self.cfg.checkpoint_dir:
                self._save_checkpoint()
            counts = self.group.gather_ints(member.round_counts)  # (a barrier: every rank's last round
            member.finish()                                       # is mixed before the group says goodbye)
            summary = member.summary()
            summary.update(rank_counts(counts))
            train = time.monotonic() - self._t_start
            summary.update(group_size=self.group.size, rank=self.group.rank, intra=self.intra,
                           member_ids=self.members, rounds=self.member.node.round, shard=list(self._shard),
                           trained_steps=self._trained,
                           start_step=self.start_step, train_time_s=train,
                           steps_per_s=self._trained / train if train > 0 else None)
            summary.pop("final_loss", None)
            summary.pop("final_accuracy", None)
            self._summary = summary
            log.info("%s rank %d: finished at step %d (%d trained here)", self.id, self.group.rank,
                     summary["steps"], self._trained)
            return summary
        finally:
            member.__exit__(None, None, None)

    def _abandon(self) -> None:
        """Leave without the group's collectives (an error, or the interpreter's exit): the
        other ranks may be gone, and a collective would wait for them."""
        if not self._closed:
            self._closed = True
            for h in self._hooks:
                h.remove()
            self.member.__exit__(None, None, None)

    def _at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self._abandon()

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abandon()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._signal is not None:  # a second one: stop now
            signal.signal(signum, self._handlers.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)
        self._signal = signum
        if isinstance(self.member, GroupLeader):
            self.member.peer.request_stop()  # the group stops at its next exchange
            log.warning("%s: %s: the group stops at its next exchange", self.id, signal.Signals(signum).name)
        else:  # (torchrun passes a signal to every rank) rank 0 decides when the group stops
            log.info("%s rank %d: %s: stopping when rank 0 says", self.id, self.group.rank,
                     signal.Signals(signum).name)

    def _stop(self) -> None:
        """Rank 0 stopped the group at this step: every rank finishes here, then leaves as a
        signalled single node does (SystemExit(128 + signal), KeyboardInterrupt for SIGINT)."""
        signum = self._signal if self._signal is not None else signal.SIGTERM
        self.close()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)


GossipNode.group_form = GroupNode
