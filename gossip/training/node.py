"""One node's training loop, written as a program that a driver advances.

The node never sleeps, never reads a clock and never touches a socket. Its
:meth:`Node.program` is a generator that yields what it needs from the outside
world (``Compute``, ``Send``, ``Wait``, ``Release``: the action vocabulary of
:mod:`gossip.core.actions`), and the driver answers with the current time. ``Release``
comes only with ``NodeConfig.live_sends``, which a driver sets when its transport
holds what it sends until sent (ZeroMQ's zero-copy frames do).

Messages that arrive go through :meth:`Node.deliver` (validation, then the
inbox); the mixing rule consumes the inbox. The same code therefore runs in
the discrete-event simulator and in ``gossip-node``.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Generator, Sequence

import torch

from gossip.compression import CodecError
from gossip.core.actions import COMPUTE, Action, Release, Send, Wait
from gossip.core.buffers import Pieces, SendLease
from gossip.core.message import STATE, Message
from gossip.core.state import FlatState, sha256_of
from gossip.core.train_state import (
    TrainStateError,
    decode_meta,
    encode_meta,
    optimizer_numel,
    pack_optimizer,
    unpack_optimizer,
)
from gossip.mixing import Inbox, MixingRule, MixReport
from gossip.mixing.base import all_finite, decode_payload

__all__ = ["Node", "NodeConfig", "init_model", "resolve_device"]

log = logging.getLogger("gossip.node")


GUARD_EVERY = 50  # good local steps between snapshots the NaN guard can go back to


@dataclass(frozen=True)
class NodeConfig:
    """How a node trains.

    steps : local optimizer steps to run
    period : local steps between two exchanges (1 = D-PSGD, larger = local SGD)
    timeout : how long a synchronous round waits for a neighbour, in driver seconds
    check_payloads : decode every arriving payload and reject non-finite ones, and
        messages not newer (by sequence number) than the sender's last accepted one,
        before they reach the inbox. Real nodes must; the simulator's in-process peers run
        this same code, which never sends non-finite parameters, so it may skip it.
    overlap : a synchronous round's messages travel while the next local steps
        compute; they are mixed at the following exchange (SGP's overlap variant)
    live_sends : a synchronous round sends the parameters themselves, not a copy:
        they do not change until the round mixes anyway. Set by a driver whose
        transport keeps what it sends referenced until it is sent (the ZeroMQ one);
        before mixing the node waits up to ``release_wait`` seconds for the
        transport to let go, then moves its parameters to fresh memory instead (a
        slow link still sending), leaving the old memory to the transport.
    """

    steps: int
    period: int = 1
    timeout: float = 30.0
    check_payloads: bool = True  # decode and check every payload on arrival (input from a network)
    overlap: bool = False
    live_sends: bool = False
    release_wait: float = 0.2

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"steps must be a non-negative integer, got {self.steps!r}")
        if not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"period must be a positive integer, got {self.period!r}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive, got {self.timeout!r}")


@dataclass
class Channel:
    """One mixing rule over one class of links, on its own schedule.

    A node has one channel over every link (``name="all"``) unless link
    policies split intra- and inter-datacenter links into two channels, each
    with its own rule (sync or async, codec) and period. A channel mixes over
    the node's topology restricted to its links, has its own inbox (messages
    are routed by the sender's link class) and its own round counter.
    """

    name: str
    rule: MixingRule
    period: int
    inbox: Inbox = field(default_factory=Inbox)
    round: int = 0
    topology: Any = None
    pending: int | None = None  # overlap: a round sent but not mixed yet


_restricted: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()


def _lrs(optimizer: Any) -> str:
    """An optimizer's learning rates, for the log."""
    lrs = sorted({float(g["lr"]) for g in optimizer.param_groups if "lr" in g})
    return ", ".join(f"{lr:.8g}" for lr in lrs) or "-"


def _links_of(topology: Any, link: str) -> Any:
    """``topology`` restricted to one link class, built once per topology object."""
    from topologies import restrict_links

    per = _restricted.setdefault(topology, {})
    if link not in per:
        per[link] = restrict_links(topology, link)
    return per[link]


_member_tables: "OrderedDict[tuple, tuple[list[Any], dict[Any, int]]]" = OrderedDict()


def _member_table(members: Sequence[Any]) -> tuple[list[Any], dict[Any, int]]:
    """A member list and its index (member -> position), shared by every node of this
    process that adopts the same list: a simulation of n nodes would otherwise hold
    n copies of an n-long list and dict, memory quadratic in n. Both are read-only."""
    key = tuple(members)
    table = _member_tables.get(key)
    if table is None:
        table = _member_tables[key] = (list(key), {m: i for i, m in enumerate(key)})
        if len(_member_tables) > 16:  # the lists of a few recent memberships are enough
            _member_tables.popitem(last=False)
    else:
        _member_tables.move_to_end(key)
    return table


def resolve_device(spec: str) -> torch.device:
    """``auto`` (CUDA when available: ``cuda:LOCAL_RANK`` under torchrun, else
    ``cuda:0``; otherwise CPU), ``cpu``, ``cuda`` or ``cuda:N``; ValueError otherwise."""
    if spec == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        local = os.environ.get("LOCAL_RANK", "0")
        index = int(local) if local.isdigit() else 0
        return torch.device("cuda", index % torch.cuda.device_count())
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ValueError(f"unknown device {spec!r}; valid: auto, cpu, cuda, cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} requested but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"unsupported device {spec!r}; valid: auto, cpu, cuda, cuda:N")
    return dev


def init_model(task: Any, seed: int, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The task's model initialised under ``seed``: every node gets the same start."""
    with torch.random.fork_rng(devices=[]):
        # the CPU generator initialises the model; torch.manual_seed would also queue a lazy
        # seeding (with a formatted stack) for each device type that is not there, per node
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(seed)  # as torch.manual_seed does: a CUDA run's generators as before
        model = task.model()
    return model.to(device)


class Node:
    """A gossip training node: its model replica, its data, its mixing rule.

    Parameters
    ----------
    node_id : the node's identity (an int in the simulator, an address for real peers)
    members : ordered list of all member ids; topology index i is ``members[i]``
    topology : object with ``in_weights(i, r)`` / ``out_weights(i, r)`` (see :mod:`topologies`)
    task : the task protocol object (:mod:`gossip.training.tasks`)
    rule : the mixing rule
    config : :class:`NodeConfig`
    seed : run seed (model init is identical on every node; batches differ per rank)
    split, rank, world_size : which data shard this node trains on
    """

    def __init__(self, node_id: Any, members: Sequence[Any], topology: Any, task: Any, rule: MixingRule,
                 config: NodeConfig, *, seed: int = 0, split: Any = "iid", rank: int | None = None,
                 world_size: int | None = None, device: torch.device | str = "cpu",
                 model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 policies: dict[str, tuple[MixingRule, int]] | None = None) -> None:
        self.id = node_id
        self.task = task
        self.config = config
        self.device = torch.device(device)
        if policies:
            for link in policies:
                if link not in ("intra", "inter"):
                    raise ValueError(f"link policies are per 'intra' or 'inter' links, got {link!r}")
            # intra before inter: average within the datacenter, then across
            order = {"intra": 0, "inter": 1}
            self.channels = [Channel(link, r, period)
                             for link, (r, period) in sorted(policies.items(), key=lambda kv: order[kv[0]])]
        else:
            self.channels = [Channel("all", rule, config.period)]
        for ch in self.channels:
            ch.rule.overlap = config.overlap and ch.rule.synchronous
        self.rule = self.channels[0].rule
        self.waiting: tuple[Channel, int] | None = None
        self._align: int | None = None
        self.members: list[Any] = []
        self.set_members(members, topology)
        if task is not None:
            rank = self.index if rank is None else rank
            world_size = len(self.members) if world_size is None else world_size
            self.model = init_model(task, seed, self.device)
            self.optimizer = task.optimizer(self.model.parameters())
            self.stream = task.stream(rank, world_size, split, seed, self.device)
        elif model is not None:
            # the caller's own training loop: it steps its optimizer, we only mix
            self.model, self.optimizer, self.stream = model, optimizer, None
        else:
            raise ValueError("a node needs a task, or a model for a training loop of your own")
        self.state = FlatState(self.model)
        self._rules_adopt()  # an outer optimizer's anchor: the starting parameters
        self.fingerprint = self.state.fingerprint  # checked against every arriving message
        self.numel = self.state.numel
        self.step = 0
        self.seq = 0
        self.last_loss = math.nan
        self.loss_sum = 0.0  # since the last call to pop_mean_loss()
        self.loss_count = 0
        self.rejected: Counter[str] = Counter()
        self.nonfinite_steps = 0
        self.recoveries = 0
        self._good: torch.Tensor | None = self.state.snapshot()  # last parameters known to train finitely
        self.last_from: dict[Any, Message] = {}  # member id -> its latest accepted message
        self.newest_round: dict[Any, int] = {}  # member id -> the latest round it sent (in this life)
        self.last_seq: dict[Any, int] = {}  # member id -> seq of its latest accepted message
        self.mix_totals = MixReport()
        self.now = 0.0
        self._lease: SendLease | None = None  # the parameters, while a send made in place is in flight
        self.held_sends = 0  # rounds whose send was still in flight at mixing time (parameters moved)
        # the hand-over to a joiner (see handover): the driver's JSON-able extras (a training loop's
        # schedulers and data position), the most bytes a state reply may take (a peer's size cap),
        # and on the joiner what came besides the parameters: {"optimizer": (description, values)
        # until an optimizer takes it, "extra": the donor's extras}
        self.handover_extra: Any = None
        self.handover_limit: int | None = None
        self.handed_over: dict[str, Any] = {}
        self.handover_note = ""
        self._warned_handover = False

    # -- membership -------------------------------------------------------------------------
    def set_members(self, members: Sequence[Any], topology: Any) -> None:
        """Adopt a member list (ordered identically on every node) and its topology.

        Call between rounds. Messages already received are re-keyed to the new
        indices; those from nodes no longer members are dropped.
        """
        members, index_of = _member_table(members)
        if self.id not in index_of:
            raise ValueError(f"node {self.id!r} is not in its own member list")
        if self.members and members != self.members:
            for ch in self.channels:
                old = ch.inbox.queues
                ch.inbox.queues = {index_of[self.members[i]]: q for i, q in old.items() if self.members[i] in index_of}
                ch.rule.on_members_changed(self.members, members)
        self.members = members
        self.index_of = index_of
        for gone in [s for s in getattr(self, "last_seq", {}) if s not in index_of]:
            del self.last_seq[gone]  # a member that left and comes back numbers afresh
        self.index = me = index_of[self.id]
        self.topology = topology
        if len(self.channels) == 1:
            self.channels[0].topology = topology
            self._channel_of: list[Channel] | None = None  # one channel takes every message
        else:
            by_name = {ch.name: ch for ch in self.channels}
            for ch in self.channels:
                ch.topology = _links_of(topology, ch.name)
            self._channel_of = [by_name.get(topology.link(j, me), self.channels[0]) for j in range(len(members))]

    @property
    def round(self) -> int:
        """The first channel's round (the only one without link policies)."""
        return self.channels[0].round

    @property
    def inbox(self) -> Inbox:
        return self.channels[0].inbox

    def adopt(self, values: torch.Tensor) -> None:
        """Take these parameters (a neighbour's state, a checkpoint) as our own and as
        the NaN guard's restore point."""
        self.settle()
        self.state.load_(values)
        self._good = self.state.snapshot()
        self._rules_adopt()

    def _rules_adopt(self) -> None:
        for ch in self.channels:
            ch.rule.on_adopt(self.state.flat)

    def outer_state(self) -> list[dict[str, Any] | None]:
        """Per channel, the outer optimizer state a joiner takes with the parameters (None: no outer)."""
        return [ch.rule.outer_state() for ch in self.channels]

    def load_outer_state(self, states: list[dict[str, Any] | None]) -> None:
        """Take a member's :meth:`outer_state` (after :meth:`adopt` of its parameters)."""
        for ch, st in zip(self.channels, states):
            if st is not None:
                ch.rule.load_outer_state(st)

    def handover(self) -> tuple[torch.Tensor, dict[str, Any]]:
        """What a joiner pulls from this node, as one flat payload: the parameters, the momentum
        of each outer optimizer that has one (``extra["outer"]`` lists their channels), then the
        inner optimizer's state tensors; ``extra["train"]`` describes the optimizer state and
        carries :attr:`handover_extra` (see :mod:`gossip.core.train_state`)."""
        flat = self.state.snapshot()
        parts, channels = [flat], []
        for k, st in enumerate(self.outer_state()):
            if st is not None and st.get("momentum") is not None:
                parts.append(st["momentum"].to(device=flat.device, dtype=flat.dtype))
                channels.append(k)
        extra: dict[str, Any] = {"outer": channels} if channels else {}
        meta: dict[str, Any] = {}
        tensors: list[torch.Tensor] = []
        try:
            if self.optimizer is not None:
                tensors, meta["optimizer"] = pack_optimizer(self.optimizer, flat.dtype)
                size = (sum(p.numel() for p in parts) + sum(t.numel() for t in tensors)) * flat.element_size()
                if self.handover_limit is not None and size > self.handover_limit:
                    raise ValueError(f"with the optimizer state a state reply takes {size} bytes, over the "
                                     f"peers' message size cap of {self.handover_limit} (max_message_mb)")
            if self.handover_extra is not None:
                meta["extra"] = self.handover_extra()
            if meta:
                extra["train"] = encode_meta(meta)
        except (TypeError, ValueError) as e:
            if not self._warned_handover:
                self._warned_handover = True
                log.warning("node %s: hands joiners its parameters without its optimizer state: %s", self.id, e)
            tensors = []
            extra.pop("train", None)
        parts += [t.to(device=flat.device) for t in tensors]
        # for the log of whoever sends it: what a joiner can check it took
        self.handover_note = (f"learning rate {_lrs(self.optimizer)}, optimizer state sha256 "
                              f"{sha256_of(torch.cat(tensors))[:16]}") if tensors else "parameters only"
        return (torch.cat(parts) if len(parts) > 1 else flat), extra

    def _train_meta(self, extra: Any) -> dict[str, Any]:
        """The training-state description of a state reply's ``extra`` ({} if none); raises
        :class:`~gossip.core.train_state.TrainStateError` when malformed."""
        chunks = extra.get("train") if isinstance(extra, dict) else None
        if chunks is None:
            return {}
        meta = decode_meta(chunks)
        if not isinstance(meta, dict):
            raise TrainStateError("the training state's description is not a map")
        return meta

    def handover_numel(self, extra: Any) -> int | None:
        """The payload size of a :meth:`handover` described by ``extra`` (a message's, so
        checked), or None when ``extra`` cannot describe one for this node."""
        channels = extra.get("outer", []) if isinstance(extra, dict) else []
        if not isinstance(channels, list) or len(set(channels)) != len(channels) \
                or any(type(k) is not int or not 0 <= k < len(self.channels) for k in channels):
            return None
        try:
            meta = self._train_meta(extra)
            opt = optimizer_numel(meta["optimizer"]) if "optimizer" in meta else 0
        except TrainStateError:
            return None
        return self.numel * (1 + len(channels)) + opt

    def adopt_handover(self, values: torch.Tensor, extra: Any) -> None:
        """Take a member's :meth:`handover` (checked by :meth:`handover_numel`): its parameters,
        its outer momentum for the channels that have an outer optimizer here too, and its
        inner optimizer's state (kept in :attr:`handed_over` until :meth:`take_optimizer_state`
        when this node has no optimizer yet)."""
        n = self.numel
        self.adopt(values[:n])
        states: list[dict[str, Any] | None] = [None] * len(self.channels)
        outer = extra.get("outer", []) if isinstance(extra, dict) else []
        for i, k in enumerate(outer):
            states[k] = {"momentum": values[n * (i + 1):n * (i + 2)].clone()}
        if any(st is not None for st in states):
            log.info("node %s: took the outer momentum of channel(s) %s with the parameters", self.id,
                     ", ".join(self.channels[k].name for k, st in enumerate(states) if st is not None))
        self.load_outer_state(states)
        meta = self._train_meta(extra)  # (checked by handover_numel already)
        self.handed_over = {"extra": meta.get("extra")}
        if "optimizer" in meta:
            self.handed_over["optimizer"] = (meta["optimizer"], values[n * (1 + len(outer)):].clone())
            if self.optimizer is not None:
                self.take_optimizer_state(self.optimizer)

    def take_optimizer_state(self, optimizer: torch.optim.Optimizer) -> bool:
        """Load the inner optimizer state a member handed over into ``optimizer`` (once);
        False if there was none or it does not fit (then ``optimizer`` keeps its own)."""
        got = self.handed_over.pop("optimizer", None)
        if got is None:
            return False
        desc, values = got
        try:
            optimizer.load_state_dict(unpack_optimizer(desc, values, optimizer))
        except (TrainStateError, ValueError, KeyError, TypeError, RuntimeError) as e:
            log.warning("node %s: the member's optimizer state does not fit this node's optimizer (%s); keeping "
                        "this node's own", self.id, e)
            return False
        log.info("node %s: took the member's optimizer state: learning rate %s, optimizer state sha256 %s", self.id,
                 _lrs(optimizer), sha256_of(values)[:16] if values.numel() else "-")
        return True

    def align(self, rnd: int) -> None:
        """Continue from round ``rnd`` at the next exchange if behind it (groups that
        merge after a partition pick up the same round counter)."""
        self._align = rnd if self._align is None else max(self._align, rnd)

    def jump_to(self, step: int) -> None:
        """Continue from local step ``step`` (a late joiner adopting the cluster's clock)."""
        self.step = step
        for ch in self.channels:
            ch.round = step // ch.period

    # -- the program ------------------------------------------------------------------------
    def program(self) -> Generator[Action, float, None]:
        """Train for ``config.steps`` local steps, exchanging on each channel's period."""
        cfg = self.config
        channels = self.channels
        while self.step < cfg.steps:
            self.local_step()  # compute: one optimizer step on local data
            self.now = yield COMPUTE
            for ch in channels:
                if self.step % ch.period == 0:
                    yield from self.exchange(ch)
        for ch in channels:  # with overlap, the last round is still in flight
            if ch.pending is not None:
                yield from self.complete(ch)

    def exchange(self, ch: Channel | None = None) -> Generator[Action, float, None]:
        """One gossip round on ``ch``: send this round's packets, wait for the
        neighbours' (synchronous rules), mix them in. With overlap, mix the
        previous round instead and leave this one in flight."""
        ch = ch or self.channels[0]
        if self._align is not None:  # adopt a merged group's round counter (scaled per channel)
            base = self.channels[0].period
            for c in self.channels:
                c.round = max(c.round, self._align * base // c.period)
            self._align = None
        if ch.rule.overlap:
            if ch.pending is not None:
                yield from self.complete(ch)
            rnd = ch.round
            out = self.outgoing(ch, rnd)
            if out:
                self.now = yield Send(out)
            ch.pending = rnd
            ch.round += 1
            return
        rnd = ch.round
        out = self.outgoing(ch, rnd)
        if out:
            self.now = yield Send(out)
        del out  # a send made in place is done once the transport lets go of it
        if ch.rule.synchronous and not ch.rule.ready(ch.inbox, ch.topology, self.index, rnd):
            self.waiting = (ch, rnd)
            self.now = yield Wait(self.config.timeout)
            self.waiting = None
        lease = self._lease
        if lease is not None and not lease.released():
            self.now = yield Release(lease, self.config.release_wait)
        del lease
        self.mix(ch, rnd)
        ch.round += 1

    def complete(self, ch: Channel) -> Generator[Action, float, None]:
        """Wait for (synchronous rules) and mix the round ``ch`` has in flight."""
        rnd = ch.pending
        assert rnd is not None
        if ch.rule.synchronous and not ch.rule.ready(ch.inbox, ch.topology, self.index, rnd):
            self.waiting = (ch, rnd)
            self.now = yield Wait(self.config.timeout)
            self.waiting = None
        ch.pending = None
        self.mix(ch, rnd)

    def outgoing(self, ch: Channel, rnd: int) -> list[tuple[Any, Message]]:
        """``ch``'s packets for round ``rnd``, stamped as messages to member ids.

        With ``live_sends``, a synchronous round without overlap hands the rule
        the parameters themselves through a :class:`SendLease`: nothing changes
        them before this round's :meth:`mix`, which waits for the lease."""
        rule = ch.rule
        x = self.state.flat
        live = self.config.live_sends and rule.synchronous and not rule.overlap and x.device.type == "cpu"
        rule.sends_live = live
        if live:
            self.settle()  # another channel's send, still in flight
            self._lease = SendLease(x)
            x = self._lease.tensor()
        packets = rule.outgoing(x, ch.topology, self.index, rnd)
        del x
        if not packets:
            return []
        self.seq += 1
        out, last_packet, msg = [], None, None
        for j, p in packets:
            if p is not last_packet:  # one message object per distinct packet, shared by its receivers
                msg = Message(STATE, self.id, rnd, self.step, self.seq, p.data, p.weight, p.extra, self.fingerprint)
                last_packet = p
            out.append((self.members[j], msg))
        return out

    def mix(self, ch: Channel, rnd: int) -> MixReport:
        """Let ``ch``'s rule combine what arrived for round ``rnd``."""
        self.settle()
        report = ch.rule.mix(self.state.flat, ch.inbox, ch.topology, self.index, rnd, self.step)
        t = self.mix_totals
        t.mixed += report.mixed
        t.missing += report.missing
        t.late += report.late
        if report.missing:
            log.debug("node %s: round %d mixed without %d neighbour(s)", self.id, rnd, report.missing)
        return report

    def settle(self) -> None:
        """Make the parameters safe to change: if a send made in place is still in
        flight, move them to fresh memory (the transport keeps the old)."""
        lease, self._lease = self._lease, None
        if lease is not None and not lease.released():
            self.state.rehome()
            self.held_sends += 1
            log.debug("node %s: a send was still in flight at mixing time; parameters moved", self.id)

    def awaited(self) -> list[Any]:
        """Member ids whose message the node waits for and has not got yet."""
        if self.waiting is None:
            return []
        ch, rnd = self.waiting
        return [self.members[j] for j in ch.rule.expected_senders(ch.topology, self.index, rnd)
                if not ch.inbox.has_round(j, rnd)]

    #: set by a driver that runs many nodes' local steps as one vectorised call (the
    #: simulator's batched engine, :class:`gossip.sim.batched.BatchedSteps`): ``local_step``
    #: then only asks it to, and it calls :meth:`count_step` and :meth:`after_update`
    stepper: Any = None

    def local_step(self) -> float:
        """One optimizer step on the next local minibatch; returns the loss (nan when
        :attr:`stepper` runs it later).

        NaN guard: a non-finite loss means the parameters (or the data) went bad,
        by divergence or by mixing in something hostile. The update is skipped, the
        parameters go back to the last good snapshot (taken every ``GUARD_EVERY``
        good steps) with fresh optimizer state, and the step is counted, so the node
        never sends non-finite values and carries on.
        """
        self.settle()
        if self.stepper is not None:  # run later, in one call with the other nodes' steps due
            self.stepper.defer(self)
            return math.nan
        batch = self.stream.next()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.task.loss(self.model, batch)
        value = float(loss.detach())
        if self.count_step(value):
            loss.backward()
            self.optimizer.step()
            self.after_update()
        return value

    def count_step(self, value: float) -> bool:
        """Count one local step whose loss was ``value``. False when it is not finite:
        the update must be skipped (the last good parameters are back already)."""
        self.step += 1
        if not math.isfinite(value):
            self._recover(value)
            return False
        self.last_loss = value
        self.loss_sum += value
        self.loss_count += 1
        return True

    def after_update(self) -> None:
        """The optimizer has applied a counted step: keep the NaN guard's restore point fresh."""
        if self.step % GUARD_EVERY == 0:
            self._good = self.state.snapshot()

    def _recover(self, value: float) -> None:
        self.nonfinite_steps += 1
        n = self.nonfinite_steps
        if n & (n - 1) == 0:  # logged at the 1st, 2nd, 4th, 8th, ... occurrence
            log.warning("node %s: non-finite loss (%s) at step %d, %d so far: restoring the last good parameters",
                        self.id, value, self.step, n)
        if self._good is not None:
            self.state.load_(self._good)
        if self.optimizer is not None:
            self.optimizer.state.clear()  # momentum built from bad gradients goes too
        self.recoveries += 1

    def pop_mean_loss(self) -> float:
        """Mean training loss since the last call (nan if no step ran)."""
        mean = self.loss_sum / self.loss_count if self.loss_count else math.nan
        self.loss_sum, self.loss_count = 0.0, 0
        return mean

    # -- incoming ---------------------------------------------------------------------------
    def ready(self) -> bool:
        """True when a waiting node has what it waits for (the driver asks after each delivery)."""
        if self.waiting is None:
            return True
        ch, rnd = self.waiting
        return ch.rule.ready(ch.inbox, ch.topology, self.index, rnd)

    def deliver(self, msg: Message) -> bool:
        """File an arrived state message for mixing; returns False (and counts the
        reason) when the message cannot be used. Never raises on bad input."""
        reason = self._check(msg)
        if reason is not None:
            self.rejected[reason] += 1
            return False
        src = self.index_of[msg.sender]
        channel_of = self._channel_of
        (self.channels[0] if channel_of is None else channel_of[src]).inbox.add(src, msg)
        self.last_from[msg.sender] = msg
        self.last_seq[msg.sender] = msg.seq
        self.newest_round[msg.sender] = max(msg.round, self.newest_round.get(msg.sender, msg.round))
        return True

    def forget_sender(self, sender: Any) -> None:
        """``sender`` restarted (a new life of the same id): its sequence numbers start again."""
        self.last_seq.pop(sender, None)
        self.newest_round.pop(sender, None)

    def out_of_reach(self, sender: Any, behind: bool = True) -> str | None:
        """Why the round this node waits in will not get ``sender``'s message, whatever the
        wait: "ahead" when its queue holds a whole inbox (``Inbox.per_sender``) of later
        rounds and none of this one (that message was evicted, or never sent: messages on
        a link arrive in order); "behind" when the latest round it sent is a whole inbox or
        more behind this one (its inbox has lost this node's messages of the rounds
        between: it runs through them on its own, "ahead" for it, before it is here).
        None otherwise: a neighbour within an inbox of this round is waited for.
        ``behind`` False: the latest round known is an earlier life's (the caller knows
        lives), and says nothing of this one.

        A stopped process (SIGSTOP for longer than ``--dead-after``) comes back hundreds
        of rounds behind the neighbours that went on without it: each side waited out
        ``--timeout`` for the other before (benchmarks/churn.py --mixed)."""
        if self.waiting is None:
            return None
        ch, rnd = self.waiting
        j = self.index_of.get(sender)
        if j is None:
            return None
        inbox = ch.inbox
        q = inbox.queues.get(j)
        if q is not None and len(q) >= inbox.per_sender and not inbox.has_round(j, rnd):
            return "ahead"
        last = self.newest_round.get(sender) if behind else None
        return "behind" if last is not None and last <= rnd - inbox.per_sender else None

    def _check(self, msg: Message) -> str | None:
        if msg.kind != STATE:
            return "kind"
        if msg.sender == self.id or msg.sender not in self.index_of:
            return "not-member"
        if msg.fingerprint != self.fingerprint and (msg.fingerprint or self.config.check_payloads):
            return "fingerprint"  # only in-process messages may leave it empty
        data = msg.data
        ch = self.channels[0] if self._channel_of is None else self._channel_of[self.index_of[msg.sender]]
        if data is None or data.numel != ch.rule.payload_numel(msg.round, self.numel):  # (a fragment: a part)
            return "size"
        if self.config.check_payloads:
            # a sender numbers its messages 1, 2, ...: anything not newer than the last
            # accepted one is a duplicate or a replay (checked before the costly decode)
            last = self.last_seq.get(msg.sender)
            if last is not None and msg.seq <= last:
                return "replay"
            try:
                msg.tensor = decode_payload(msg, self.state.flat, pieces=True)  # checked where it lies
            except CodecError:
                return "codec-data"
            if not all_finite(msg.tensor):
                msg.tensor = None
                return "nonfinite"
        if msg.weight is not None and not (msg.weight > 0 and math.isfinite(msg.weight)):
            return "weight"
        return None

    def neighbor_distance(self) -> float:
        """Mean squared distance to the parameters last received from each current
        neighbour (what a real node can measure of consensus); nan if none yet."""
        # current in-neighbours: those of the last topology period (a time-varying graph
        # changes them every round); a member that was a neighbour before the last
        # membership change holds parameters from back then and does not count
        current: set[int] = set()
        for ch in self.channels:
            period = min(64, max(1, int(getattr(ch.topology, "period", 1) or 1)))
            for r in range(max(0, self.round - period + 1), self.round + 1):
                current.update(j for j in ch.topology.in_weights(self.index, r) if j != self.index)
        kept = [ch.rule.neighbor_models() for ch in self.channels]
        models = None
        if all(k is not None for k in kept):
            models = {}
            for k in kept:
                models.update((j, t) for j, t in k.items() if j in current)  # type: ignore[union-attr]
        if models is None:
            models = {}
            for sender, msg in self.last_from.items():
                if self.index_of.get(sender) in current and msg.data is not None:
                    models[sender] = decode_payload(msg, self.state.flat, pieces=True)
        x = self.state.flat
        dists = []
        for t in models.values():
            parts = t if type(t) is Pieces else [(0, t)]
            dists.append(sum(float((x[o:o + p.numel()].double() - p.double()).pow(2).sum()) for o, p in parts))
        return sum(dists) / len(dists) if dists else math.nan

    # -- persistence ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume this node exactly (see :mod:`gossip.core.checkpoint`)."""
        return {
            "id": self.id,
            "fingerprint": self.fingerprint,
            "step": self.step,
            "round": self.round,
            "rounds": [ch.round for ch in self.channels],
            "seq": self.seq,
            "flat": self.state.snapshot().cpu(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "rule": self.rule.state_dict(),
            "rules": [ch.rule.state_dict() for ch in self.channels],
            "stream": self.stream.state_dict() if hasattr(self.stream, "state_dict") else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError(f"checkpoint is for model fingerprint {state.get('fingerprint')!r}, "
                             f"this node's model is {self.fingerprint!r}")
        self.adopt(state["flat"].to(self.device))
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        rules = state.get("rules") or [state.get("rule") or {}]
        if len(rules) != len(self.channels):
            raise ValueError(f"checkpoint has {len(rules)} mixing channel(s), this node {len(self.channels)}")
        for ch, rs in zip(self.channels, rules):
            ch.rule.load_state_dict(rs or {})
        if state.get("stream") is not None and self.stream is not None and hasattr(self.stream, "load_state_dict"):
            self.stream.load_state_dict(state["stream"])
        self.step = int(state["step"])
        for ch, r in zip(self.channels, state.get("rounds") or [int(state["round"])]):
            ch.round = int(r)
        self.seq = int(state.get("seq", 0))
