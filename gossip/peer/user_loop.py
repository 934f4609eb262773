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
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from gossip.compression import get_codec
from gossip.core.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from gossip.core.message import Message
from gossip.mixing.base import decode_payload
from gossip.mixing.settings import MixingSettings
from gossip.peer.driver import Peer
from gossip.protocol.config import PeerConfig
from gossip.protocol.errors import PeerError
from gossip.training.sampler import ShardSampler, sampler_of, shard
from gossip.training.sampler import steps_per_epoch as _steps_per_epoch

__all__ = ["GossipNode"]

log = logging.getLogger("gossip.user_loop")

_FLAG = re.compile(r"--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")


def _api_names(message: str) -> str:
    """``--world-size`` -> ``world_size``: errors of the Python API name its parameters, not CLI flags."""
    return _FLAG.sub(lambda m: m.group(1).replace("-", "_"), message)


def _default_logging() -> None:
    """A handler for the library's log (node id in every line) only if the user configured none."""
    lib = logging.getLogger("gossip")
    if lib.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    lib.addHandler(handler)
    if lib.level == logging.NOTSET:
        lib.setLevel(logging.INFO)


def _schedulers(scheduler: Any, optimizer: Any) -> list[Any]:
    """``scheduler=`` as a list, each checked to be a scheduler of ``optimizer``."""
    if scheduler is None:
        return []
    found = list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler]
    for s in found:
        if not (callable(getattr(s, "state_dict", None)) and callable(getattr(s, "load_state_dict", None))):
            raise ValueError(f"scheduler must be a learning-rate scheduler (state_dict / load_state_dict), "
                             f"got {type(s).__name__}")
        if getattr(s, "optimizer", optimizer) is not optimizer:
            raise ValueError("scheduler must schedule the optimizer given to GossipNode, not another one")
    return found


class GossipNode:
    """Gossip for a training loop of your own (the Horovod-style path).

    Wrap the model and optimizer once; the loop stays as it is::

        node = gossip.GossipNode(model, optimizer, listen="10.0.0.1:5555", peers=["10.0.0.2:5555"],
                                 checkpoint_dir="ckpt", checkpoint_every=100)
        loader = DataLoader(dataset, batch_size=64, sampler=node.sampler(dataset))
        for epoch in node.epochs(range(1, epochs + 1), loader):   # from where a restart left off
            train(model, loader, optimizer, epoch)                 # optimizer.step() gossips
            test(model, test_loader)
        node.close()

    The constructor joins the cluster (blocking until training starts, like
    ``gossip-node``). Every ``optimizer.step()`` counts a local step (a
    post-step hook; without an optimizer, call :meth:`step`) and every
    ``period`` steps the node exchanges with its neighbours and mixes.

    Parameters
    ----------
    model, optimizer : the replica this node trains and its optimizer
    listen : ``HOST:PORT`` to bind (default: the environment's ``GOSSIP_LISTEN``)
    peers : some existing members, a list or a comma-separated string (default: ``GOSSIP_PEERS``)
    mixing : a :class:`~gossip.mixing.settings.MixingSettings`, or its options flat (``period=4``)
    checkpoint_dir, checkpoint_every : a checkpoint every that many steps and at the end
    scheduler : a learning-rate scheduler of ``optimizer`` (or a list of them) whose state goes
        into every checkpoint and comes back with the optimizer's on resume
    resume : continue from the newest checkpoint in ``checkpoint_dir``; default: when there is one
    same_start : every member takes the first member's parameters before the first step (like
        Horovod's ``broadcast_parameters``); members that resume or join keep theirs
    handle_signals : SIGTERM and Ctrl+C stop at the next step with a final checkpoint and a goodbye
    options : the other :class:`~gossip.protocol.config.PeerConfig` fields (``topology``, ``timeout``, ``grace`` ...)
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 listen: str | None = None, peers: Any = None, mixing: MixingSettings | None = None, checkpoint_dir: str | Path | None = None,
                 checkpoint_every: int = 0, resume: bool | None = None, same_start: bool = True,
                 handle_signals: bool = True, scheduler: Any = None, **options: Any) -> None:
        _default_logging()
        self.schedulers = _schedulers(scheduler, optimizer)
        if listen is None:  # like torchrun's environment: one script, its addresses set per process
            listen = os.environ.get("GOSSIP_LISTEN")
            if not listen:
                raise ValueError("listen is required: HOST:PORT to bind (or set GOSSIP_LISTEN)")
        if peers is None:
            peers = os.environ.get("GOSSIP_PEERS", "")
        if isinstance(peers, str):
            peers = [p for p in peers.split(",") if p.strip()]
        if checkpoint_dir is not None:
            checkpoint_dir = str(checkpoint_dir)
            if resume is None:
                resume = latest_checkpoint(checkpoint_dir) is not None
        try:
            cfg = PeerConfig(listen=listen, peers=tuple(peers), mixing=mixing, checkpoint_dir=checkpoint_dir,
                             checkpoint_every=checkpoint_every, resume=bool(resume), **options)
        except ValueError as e:
            raise ValueError(_api_names(str(e))) from None
        if checkpoint_dir is not None:
            Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        self.peer = Peer(cfg, model=model, optimizer=optimizer)
        self.model, self.optimizer = model, optimizer
        self._averages: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self._calls = 0  # collectives so far: every member numbers its calls alike
        self.peer.on_average = self._on_average
        self._closed = False
        self._summary: dict[str, Any] | None = None
        self._signal: int | None = None
        self._handlers: dict[int, Any] = {}
        self._hook: Any = None
        self.consensus_distance: float | None = None  # of the last consensus_model() call
        try:
            try:
                if not self.peer.start():
                    raise PeerError("stopped before training started")
            except (ValueError, PeerError) as e:
                raise type(e)(_api_names(str(e))) from None
            if same_start:
                self._agree_start()
            if self.schedulers and cfg.resume and checkpoint_dir is not None:
                self._resume_schedulers(checkpoint_dir)
        except BaseException:
            self.peer.close()
            raise
        self.start_step = self.steps  # 0, a checkpoint's step, or the running cluster's
        self._t_start = time.monotonic()
        self._trained = 0
        if optimizer is not None:
            self._hook = optimizer.register_step_post_hook(lambda *_: self._count_step())
        if handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
                    self._handlers[sig] = signal.signal(sig, self._on_signal)
        atexit.register(self._at_exit)
        if self.start_step:
            log.info("%s: continuing at step %d", self.peer.id, self.start_step)

    # -- who and where ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This node's index among the members it started with (for picking a data shard)."""
        return int(self.peer.rank)

    @property
    def world_size(self) -> int:
        return int(self.peer.world_size)

    @property
    def members(self) -> list[str]:
        return list(self.peer.node.members) if self.peer.node else []

    @property
    def steps(self) -> int:
        """Local steps so far, on the cluster's count: a node that joined late, resumed
        from a checkpoint, or joined again after a stall continues from the step the
        cluster is at."""
        return int(self.peer.node.step) if self.peer.node is not None else 0

    # -- data ------------------------------------------------------------------------------
    def sampler(self, dataset: Any, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> ShardSampler:
        """A ``DistributedSampler`` for this node's shard: equal lengths on every node (padded)."""
        return ShardSampler(dataset, self.world_size, self.rank, shuffle=shuffle, seed=seed, drop_last=drop_last)

    def shard(self, dataset: Any) -> Any:
        """This node's equal-length part of a ``Dataset`` (what ``dataset[rank::world_size]`` means)."""
        return shard(dataset, self.rank, self.world_size)

    def epochs(self, epochs: int | Iterable[int], loader: Any = None, *,
               steps_per_epoch: int | None = None) -> Iterator[int]:
        """The epochs still to run: from the one this node continues in (after a restart,
        a resume or a late join), calling ``set_epoch`` on the loader's
        :class:`ShardSampler` and leaving out the batches of that epoch already done.

        ``epochs``: a count or the epoch numbers (``range(1, n + 1)``); the length of an
        epoch in optimizer steps is ``len(loader)`` unless ``steps_per_epoch`` is given.
        """
        order = list(range(epochs)) if isinstance(epochs, int) else list(epochs)
        spe = steps_per_epoch if steps_per_epoch is not None else _steps_per_epoch(loader)
        if isinstance(spe, bool) or not isinstance(spe, int) or spe < 1:
            raise ValueError(f"steps_per_epoch must be a positive integer, got {spe!r}")
        first, done = divmod(self.steps, spe)
        sampler = sampler_of(loader) if loader is not None else None
        if first and first < len(order) or done:
            log.info("%s: step %d: continuing in epoch %s, after batch %d of %d", self.peer.id, self.steps,
                     order[first] if first < len(order) else "(none left)", done, spe)
        for i in range(first, len(order)):
            if sampler is not None:
                sampler.set_epoch(order[i])
                if i == first and done:
                    sampler.skip(done * int(getattr(loader, "batch_size", None) or 1))
            yield order[i]

    # -- training --------------------------------------------------------------------------
    def step(self) -> None:
        """Count one local step; with an optimizer given, ``optimizer.step()`` does it
        already and this does nothing (calling both counts each step once)."""
        if self._hook is None:
            self._count_step()

    def _count_step(self) -> None:
        if self._closed:
            return
        if self._signal is not None:
            self._stop_on_signal()
        self.peer.step()
        self._trained += 1
        cfg = self.peer.cfg
        node = self.peer.node
        if cfg.checkpoint_dir and cfg.checkpoint_every and node is not None and node.step % cfg.checkpoint_every == 0:
            self._save_checkpoint()

    def _save_checkpoint(self) -> None:
        node, cfg = self.peer.node, self.peer.cfg
        state = node.state_dict()
        if self.schedulers:
            state["schedulers"] = [s.state_dict() for s in self.schedulers]
        save_checkpoint(state, cfg.checkpoint_dir, node.step)

    def _resume_schedulers(self, directory: str) -> None:
        path = latest_checkpoint(directory)
        if path is None:
            return
        saved = load_checkpoint(path).get("schedulers")
        if saved is None:
            log.warning("%s: %s has no scheduler state; the scheduler starts afresh", self.peer.id, path.name)
            return
        if len(saved) != len(self.schedulers):
            raise ValueError(f"checkpoint {path.name} has {len(saved)} scheduler(s), scheduler= gives "
                             f"{len(self.schedulers)}")
        for s, st in zip(self.schedulers, saved):
            s.load_state_dict(st)

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
        as_float = isinstance(value, (int, float))
        t = torch.as_tensor(value, dtype=torch.float64).detach().cpu().reshape(-1)
        if not (isinstance(weight, (int, float)) and weight > 0 and math.isfinite(weight)):
            raise ValueError(f"weight must be a positive number, got {weight!r}")
        got = self._all_gather("avg", torch.cat([t * weight, torch.tensor([float(weight)], dtype=torch.float64)]))
        total = sum(got[k] for k in sorted(got))  # the same order everywhere: the same float result
        mean = total[:-1] / total[-1]
        if as_float:
            return float(mean[0])
        if isinstance(value, torch.Tensor):
            return mean.reshape(value.shape).to(value.dtype)
        return mean.tolist()

    @contextlib.contextmanager
    def consensus_model(self) -> Iterator[torch.nn.Module]:
        """The model with the exact average of all members' parameters for the duration
        of the ``with`` block (to evaluate the cluster's model); its own afterwards.

        A collective (every member enters it at the same point); it moves every
        member's whole parameters to every other, once. Sets ``consensus_distance``,
        ``(1/n) sum_i ||x_i - x_mean||^2``.
        """
        node = self.peer.node
        assert node is not None
        own = node.state.snapshot().detach().cpu().to(torch.float64)
        got = self._all_gather("model", own)
        mean = sum(got[k] for k in sorted(got)) / len(got)
        self.consensus_distance = self.average(float(torch.sum((own - mean) ** 2)))
        node.state.load_(mean.to(node.state.flat.dtype).to(node.state.flat.device))
        try:
            yield self.model
        finally:
            node.state.load_(own.to(node.state.flat.dtype).to(node.state.flat.device))

    def _all_gather(self, op: str, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Send ``values`` to every member, wait for theirs of the same call; by member id."""
        peer, node = self.peer, self.peer.node
        assert node is not None
        self._calls += 1
        call = self._calls
        # float64 travels as the bytes of twice as many float32 (the codecs carry no float64)
        wire_values = values.to(torch.float64).contiguous().view(torch.float32)
        msg = Message("average", peer.id, call, node.step, 0, get_codec("none").encode(wire_values), None,
                      {"inc": peer.incarnation, "op": op}, peer.fingerprint)
        for m in node.members:
            if m != peer.id:
                peer._send_message(m, msg)
        got = self._averages.setdefault((op, call), {})
        got[peer.id] = values
        deadline = time.monotonic() + max(peer.cfg.timing.join_timeout, peer.cfg.timeout)
        while True:
            with peer.lock:
                alive = set(peer.membership.members)
            missing = [m for m in node.members if m not in got and m in alive]
            if not missing:
                break
            if time.monotonic() > deadline:
                log.warning("%s: %s call %d: no value from %s; averaging without them", peer.id, op, call,
                            ", ".join(missing))
                break
            peer._service(0.05)
        del self._averages[(op, call)]
        return got

    def _on_average(self, msg: Message) -> None:
        op = msg.extra.get("op")
        node = self.peer.node
        if op not in ("avg", "model", "start") or msg.data is None or msg.fingerprint != self.peer.fingerprint:
            self.peer.control.reject(str(msg.sender), "average", "a bad average message")
            return
        values = decode_payload(msg, torch.empty(0, dtype=torch.float32)).clone()
        if op != "start":
            if values.numel() % 2:
                self.peer.control.reject(str(msg.sender), "average", "an odd-sized average message")
                return
            values = values.view(torch.float64)
        if not bool(torch.isfinite(values).all()):
            self.peer.control.reject(str(msg.sender), "non-finite", "an average message")
            return
        if op != "start" and node is not None and msg.round <= self._calls - 1 and (op, msg.round) not in self._averages:
            return  # a call this node has finished (without that member)
        if len(self._averages) < 64:
            self._averages.setdefault((op, msg.round), {})[str(msg.sender)] = values

    def _agree_start(self) -> None:
        """Every member of a fresh cluster takes the first member's parameters (sorted
        member list), before anyone's first step. A member that resumed from a
        checkpoint or joined a running cluster keeps its state (then nobody is at step 0)."""
        peer, node = self.peer, self.peer.node
        assert node is not None
        if peer.joined or peer.resumed_from is not None or node.step != 0 or len(node.members) < 2:
            return
        first = node.members[0]
        if first == peer.id:
            snap = node.state.snapshot().detach().cpu().to(torch.float32).contiguous()
            msg = Message("average", peer.id, 0, 0, 0, get_codec("none").encode(snap), None,
                          {"inc": peer.incarnation, "op": "start"}, peer.fingerprint)
            for m in node.members[1:]:
                peer._send_message(m, msg)
            return
        deadline = time.monotonic() + max(peer.cfg.timeout, 5.0)
        while time.monotonic() < deadline:
            got = self._averages.get(("start", 0), {})
            if first in got:
                values = self._averages.pop(("start", 0))[first]
                if values.numel() == node.numel:
                    node.adopt(values.to(node.state.flat.dtype).to(node.state.flat.device))
                    log.info("%s: took the starting parameters of %s (the first member)", peer.id, first)
                    return
                break
            peer._service(0.05)
        log.warning("%s: no starting parameters from %s (the first member); starting from this node's own",
                    peer.id, first)

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
        # said now, not at the next ping: it reaches each member before this node's next round does,
        # so a member whose data ends later knows that nobody needs it to serve
        peer.control.apply(peer.control.announce_members())
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
        if self._hook is not None:
            self._hook.remove()
        for sig, old in self._handlers.items():
            with contextlib.suppress(ValueError):
                signal.signal(sig, old)
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
