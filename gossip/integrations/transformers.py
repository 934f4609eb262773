"""Hugging Face's ``Trainer`` as one member of a gossip cluster.

Two lines in a training script::

    from gossip.integrations.transformers import GossipTrainer
    trainer = GossipTrainer(model=model, args=args, train_dataset=train, eval_dataset=test)   # was Trainer(...)
    trainer.train(resume_from_checkpoint=True)   # as before; also after a restart into a running cluster

Start the same script once per machine with ``GOSSIP_LISTEN`` and ``GOSSIP_PEERS``
set (or pass ``gossip={"listen": ..., "peers": ...}``, any :class:`gossip.GossipNode`
option, or a node made by :func:`gossip.init`). At ``train()`` the Trainer joins the
cluster; then:

- its sampler is this node's shard of the training data (:class:`gossip.ShardSampler`
  over the members the cluster started with; a restarted member takes its own again);
- every optimizer step counts once, whatever wraps the optimizer (Accelerate's
  ``AcceleratedOptimizer``): the node counts the Trainer's steps at ``on_step_end``,
  after the scheduler stepped, so its count is the Trainer's ``global_step``;
- the Trainer's optimizer and scheduler are the node's: a joiner takes a member's
  state of both, and the Trainer continues at the cluster's ``global_step`` (epoch and
  batch included). Its own ``resume_from_checkpoint`` wins only when newer than the
  cluster's state; the Trainer's step is the cluster's either way;
- evaluation metrics are the mean over the members (weighted by their evaluation
  samples): the same numbers on every node;
- ``save_model()`` (called on every node, like the other collectives) writes the
  cluster's model, the exact average of the members' parameters, on one node only
  (:attr:`gossip.GossipNode.is_first`); the Trainer's own checkpoints stay per node.

Why a ``Trainer`` subclass and not only a ``TrainerCallback``: the Trainer builds its
sampler and computes the epoch and batch to resume from (``trainer_state.json``)
before it sends any callback event, and no event can replace either. A callback
added to a plain Trainer would train every node on the same batches, and a
restarted node would start from its own checkpoint's step. :class:`GossipCallback`
does the part a callback can (counting steps, handing the optimizer and scheduler
over), and :class:`GossipTrainer` adds it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import TrainerState
    from transformers.trainer_utils import EvalLoopOutput, get_last_checkpoint
except ImportError as e:  # pragma: no cover - the optional extra
    raise ImportError("gossip.integrations.transformers needs Hugging Face transformers: "
                      "pip install \".[hf]\" (transformers and accelerate)") from e

from gossip.peer.user_loop import GossipNode, init
from gossip.training.sampler import ShardSampler

__all__ = ["GossipTrainer", "GossipCallback"]

log = logging.getLogger("gossip.integrations.transformers")

STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME
SPEED = ("_runtime", "_samples_per_second", "_steps_per_second")  # a node's own timings: not averaged


class GossipCallback(TrainerCallback):
    """Counts the Trainer's optimizer steps on the node and hands it the Trainer's
    optimizer and scheduler (see the module). Added by :class:`GossipTrainer`."""

    def __init__(self, trainer: "GossipTrainer") -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, lr_scheduler: Any = None,
                       **kwargs: Any) -> None:
        node = self.trainer.gossip_node
        if node is not None:
            # (Accelerate's wrappers are looked through; the state a member handed over goes in now)
            node.attach(optimizer, scheduler=lr_scheduler, count_steps=False)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        node = self.trainer.gossip_node
        if node is not None:
            node.step()  # after the optimizer and the scheduler: a joiner takes this state
            if node.steps != state.global_step:
                log.warning("%s: the Trainer is at step %d, the cluster at %d", node.id, state.global_step,
                            node.steps)


class GossipTrainer(Trainer):
    """A ``transformers.Trainer`` that is one member of a gossip cluster (see the module).

    Parameters
    ----------
    gossip : a :class:`gossip.GossipNode` made by :func:`gossip.init` (with this model), or the
        keywords to make one at ``train()`` (``listen``, ``peers``, ``period``, ``timeout`` ...;
        default: ``GOSSIP_LISTEN`` / ``GOSSIP_PEERS`` from the environment)
    average_metrics : evaluation metrics are the members' mean (a collective: every node
        evaluates at the same points, as the Trainer's eval strategy makes them)
    *args, **kwargs : the ``Trainer``'s
    """

    def __init__(self, *args: Any, gossip: GossipNode | dict[str, Any] | None = None, average_metrics: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if gossip is not None and not isinstance(gossip, (GossipNode, dict)):
            raise ValueError(f"gossip must be a GossipNode (gossip.init) or a dict of its options, "
                             f"got {type(gossip).__name__}")
        self.gossip_node: GossipNode | None = gossip if isinstance(gossip, GossipNode) else None
        self._gossip_options = dict(gossip) if isinstance(gossip, dict) else {}
        self.average_metrics = average_metrics
        self.add_callback(GossipCallback(self))

    # -- joining -------------------------------------------------------------------------
    def join(self, resume_step: int = 0) -> GossipNode:
        """Join the cluster now (``train()`` does; the Trainer's own checkpoint, if it resumes
        from one, is of step ``resume_step``)."""
        if self.gossip_node is None:
            options = {"handle_signals": False, **self._gossip_options}
            self.gossip_node = init(self.model, resume_step=resume_step, **options)
        return self.gossip_node

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> ShardSampler:
        dataset = args[0] if args and args[0] is not None else kwargs.get("train_dataset") or self.train_dataset
        rank, world = self.join().fixed_shard()
        return ShardSampler(dataset, world, rank, seed=self.args.seed)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, starting where the cluster is (see the module)."""
        own = resume_from_checkpoint
        if own is True:
            own = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
            if own is None:
                log.info("resume_from_checkpoint=True: no checkpoint in %s yet; starting from the cluster",
                         self.args.output_dir)
        own = own or None
        own_step = _global_step(own) if own is not None else 0
        node = self.join(resume_step=own_step)
        step = node.steps
        took_member = node.peer.state_from is not None and node.peer.resumed_from is None
        if step == 0 and own is None:
            return super().train(None, *args, **kwargs)
        if own is not None and step == own_step and not took_member:
            return super().train(own, *args, **kwargs)  # its own checkpoint is where the cluster is
        if own is not None and (own_step > step or not took_member):
            # its own state is the newer (or the only one): the Trainer's step is the cluster's anyway
            node.keep_own_state()
            start = self._checkpoint_at(step, weights_from=own, state_from=own)
        else:  # the state a member handed over (already in the model; optimizer and schedule at train begin)
            start = self._checkpoint_at(step, weights_from=None, state_from=own)
        log.info("%s: the Trainer starts at the cluster's step %d (its own checkpoint: %s)", node.id, step,
                 f"step {own_step}" if own is not None else "none")
        try:
            return super().train(str(start), *args, **kwargs)
        finally:
            shutil.rmtree(start, ignore_errors=True)

    def _checkpoint_at(self, step: int, *, weights_from: str | None, state_from: str | None) -> Path:
        """A checkpoint of the Trainer's own format whose ``global_step`` is ``step``: the
        Trainer's resume then skips to the cluster's epoch and batch. Its weights are the
        model's now, or those of checkpoint ``weights_from`` (with its optimizer and
        scheduler)."""
        path = Path(self.args.output_dir) / f"gossip-start-{step}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        if weights_from is not None:
            for f in Path(weights_from).iterdir():
                if f.is_file() and f.name != STATE_FILE:
                    os.symlink(f.resolve(), path / f.name)
        else:
            Trainer.save_model(self, str(path), _internal_call=True)
        if state_from is not None and (Path(state_from) / STATE_FILE).is_file():
            state = TrainerState.load_from_json(str(Path(state_from) / STATE_FILE))
        else:
            state = TrainerState()
            for name in ("logging_steps", "eval_steps", "save_steps"):
                value = getattr(self.args, name, None)
                if isinstance(value, int) and hasattr(state, name):
                    setattr(state, name, value)
        state.global_step = step
        state.save_to_json(str(path / STATE_FILE))
        return path

    # -- the cluster's figures and model -----------------------------------------------------
    def evaluation_loop(self, *args: Any, **kwargs: Any) -> EvalLoopOutput:
        out = super().evaluation_loop(*args, **kwargs)
        node = self.gossip_node
        if node is None or not self.average_metrics or not out.metrics:
            return out
        keys = sorted(k for k, v in out.metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                      and not k.endswith(SPEED))
        weight = float(out.num_samples or 1)
        means = node.average([float(out.metrics[k]) for k in keys], weight=weight)
        metrics = {**out.metrics, **dict(zip(keys, means))}
        return EvalLoopOutput(predictions=out.predictions, label_ids=out.label_ids, metrics=metrics,
                              num_samples=out.num_samples)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The cluster's model (the members' exact average), written by one node. A
        collective when called by the script (every node calls it); the Trainer's own
        checkpoints (``_internal_call``) are this node's replica, on every node."""
        node = self.gossip_node
        if _internal_call or node is None:
            return super().save_model(output_dir, _internal_call)
        with node.consensus_model():
            if node.is_first:
                super().save_model(output_dir, _internal_call)
                log.info("%s: saved the cluster's model to %s", node.id, output_dir or self.args.output_dir)
            else:
                log.info("%s: not saving the model: %s (the first member) saves the cluster's", node.id,
                         node.members[0])
        return None


def _global_step(checkpoint: str) -> int:
    """The ``global_step`` of a Trainer checkpoint directory (0 when it has no state)."""
    path = Path(checkpoint) / STATE_FILE
    if not path.is_file():
        return 0
    return int(json.loads(path.read_text()).get("global_step", 0))
