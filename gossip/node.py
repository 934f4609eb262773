"""One node's training loop, written as a program that a driver advances.

The node never sleeps, never reads a clock and never touches a socket. Its
:meth:`Node.program` is a generator that yields what it needs from the outside
world, and the driver answers with the current time:

``Compute()``
    "I just ran one local optimizer step": the simulator advances its virtual
    clock by this node's compute time; a real driver just carries on.
``Send(messages)``
    "deliver these": the simulator schedules arrivals over its link model; the
    real driver hands them to the ZeroMQ I/O thread. Never blocks.
``Wait(timeout)``
    "resume me when :meth:`Node.ready` turns true, or after ``timeout`` seconds
    of your clock". Used by synchronous rules to collect a round's messages.

Messages that arrive go through :meth:`Node.deliver` (validation, then the
inbox); the mixing rule consumes the inbox. The same code therefore runs in
the discrete-event simulator and in ``gossip-node``.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Generator, Sequence

import torch

from gossip.message import STATE, Message
from gossip.compression import CodecError
from gossip.mixing import Inbox, MixingRule, MixReport
from gossip.mixing.base import all_finite, decode_payload
from gossip.state import FlatState

__all__ = ["Node", "NodeConfig", "Compute", "Send", "Wait", "Action"]

log = logging.getLogger("gossip.node")


@dataclass(frozen=True)
class Compute:
    """The node finished one local step."""


@dataclass(frozen=True)
class Send:
    """Messages to deliver: ``(destination id, Message)`` pairs."""

    messages: list[tuple[Any, Message]]


@dataclass(frozen=True)
class Wait:
    """Resume when the node is ready or ``timeout`` seconds have passed."""

    timeout: float


Action = Compute | Send | Wait
COMPUTE = Compute()


@dataclass(frozen=True)
class NodeConfig:
    """How a node trains.

    steps : local optimizer steps to run
    period : local steps between two exchanges (1 = D-PSGD, larger = local SGD)
    timeout : how long a synchronous round waits for a neighbour, in driver seconds
    check_payloads : decode every arriving payload and reject non-finite ones before
        they reach the inbox. Real nodes must; the simulator's in-process peers run
        this same code, which never sends non-finite parameters, so it may skip it.
    """

    steps: int
    period: int = 1
    timeout: float = 30.0
    check_payloads: bool = True  # decode and check every payload on arrival (input from a network)

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"steps must be a non-negative integer, got {self.steps!r}")
        if not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"period must be a positive integer, got {self.period!r}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive, got {self.timeout!r}")


def init_model(task: Any, seed: int, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The task's model initialised under ``seed``: every node gets the same start."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = task.model()
    return model.to(device)


class Node:
    """A gossip training node: its model replica, its data, its mixing rule.

    Parameters
    ----------
    node_id : the node's identity (an int in the simulator, an address for real peers)
    members : ordered list of all member ids; topology index i is ``members[i]``
    topology : object with ``in_weights(i, r)`` / ``out_weights(i, r)`` (see :mod:`topologies`)
    task : the task protocol object (:mod:`gossip.tasks`)
    rule : the mixing rule
    config : :class:`NodeConfig`
    seed : run seed (model init is identical on every node; batches differ per rank)
    split, rank, world_size : which data shard this node trains on
    """

    def __init__(self, node_id: Any, members: Sequence[Any], topology: Any, task: Any, rule: MixingRule,
                 config: NodeConfig, *, seed: int = 0, split: Any = "iid", rank: int | None = None,
                 world_size: int | None = None, device: torch.device | str = "cpu",
                 model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.id = node_id
        self.task = task
        self.rule = rule
        self.config = config
        self.device = torch.device(device)
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
        self.fingerprint = self.state.fingerprint  # checked against every arriving message
        self.numel = self.state.numel
        self.inbox = Inbox()
        self.step = 0
        self.round = 0
        self.seq = 0
        self.last_loss = math.nan
        self.loss_sum = 0.0  # since the last call to pop_mean_loss()
        self.loss_count = 0
        self.rejected: Counter[str] = Counter()
        self.nonfinite_steps = 0
        self.last_from: dict[Any, Message] = {}  # member id -> its latest accepted message
        self.mix_totals = MixReport()
        self.waiting = False
        self.now = 0.0

    # -- membership -------------------------------------------------------------------------
    def set_members(self, members: Sequence[Any], topology: Any) -> None:
        """Adopt a member list (ordered identically on every node) and its topology.

        Call between rounds. Messages already received are re-keyed to the new
        indices; those from nodes no longer members are dropped.
        """
        members = list(members)
        index_of = {m: i for i, m in enumerate(members)}
        if self.id not in index_of:
            raise ValueError(f"node {self.id!r} is not in its own member list")
        inbox = getattr(self, "inbox", None)
        if inbox is not None and members != self.members:
            old = inbox.queues
            inbox.queues = {index_of[self.members[i]]: q for i, q in old.items() if self.members[i] in index_of}
            self.rule.on_members_changed(self.members, members)
        self.members = members
        self.index_of = index_of
        self.index = index_of[self.id]
        self.topology = topology


    # -- the program ------------------------------------------------------------------------
    def program(self) -> Generator[Action, float, None]:
        """Train for ``config.steps`` local steps, exchanging every ``config.period``."""
        cfg = self.config
        while self.step < cfg.steps:
            self.local_step()  # compute: one optimizer step on local data
            self.now = yield COMPUTE
            if self.step % cfg.period == 0:
                yield from self.exchange()

    def exchange(self) -> Generator[Action, float, None]:
        """One gossip round: send this round's packets, wait for the neighbours'
        (synchronous rules), mix them in."""
        rnd = self.round
        out = self.outgoing(rnd)
        if out:
            self.now = yield Send(out)
        if self.rule.synchronous and not self.ready_for(rnd):
            self.waiting = True
            self.now = yield Wait(self.config.timeout)
            self.waiting = False
        self.mix(rnd)

    def outgoing(self, rnd: int) -> list[tuple[Any, Message]]:
        """The rule's packets for round ``rnd``, stamped as messages to member ids."""
        packets = self.rule.outgoing(self.state.flat, self.topology, self.index, rnd)
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

    def mix(self, rnd: int) -> MixReport:
        """Let the rule combine what arrived for round ``rnd``; advances the round."""
        report = self.rule.mix(self.state.flat, self.inbox, self.topology, self.index, rnd, self.step)
        t = self.mix_totals
        t.mixed += report.mixed
        t.missing += report.missing
        t.late += report.late
        if report.missing:
            log.debug("node %s: round %d mixed without %d neighbour(s)", self.id, rnd, report.missing)
        self.round += 1
        return report

    def local_step(self) -> float:
        """One optimizer step on the next local minibatch; returns the loss.

        A non-finite loss skips the update (NaN guard): the parameters stay as they
        were, so the node never sends non-finite values, and the step is counted.
        """
        batch = self.stream.next()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.task.loss(self.model, batch)
        value = float(loss.detach())
        self.step += 1
        if not math.isfinite(value):
            self.nonfinite_steps += 1
            log.warning("node %s: non-finite loss at step %d; update skipped", self.id, self.step)
            return value
        loss.backward()
        self.optimizer.step()
        self.last_loss = value
        self.loss_sum += value
        self.loss_count += 1
        return value

    def pop_mean_loss(self) -> float:
        """Mean training loss since the last call (nan if no step ran)."""
        mean = self.loss_sum / self.loss_count if self.loss_count else math.nan
        self.loss_sum, self.loss_count = 0.0, 0
        return mean

    # -- incoming ---------------------------------------------------------------------------
    def ready_for(self, rnd: int) -> bool:
        return self.rule.ready(self.inbox, self.topology, self.index, rnd)

    def ready(self) -> bool:
        """True when a waiting node has what it waits for (the driver asks after each delivery)."""
        return self.ready_for(self.round)

    def deliver(self, msg: Message) -> bool:
        """File an arrived state message for mixing; returns False (and counts the
        reason) when the message cannot be used. Never raises on bad input."""
        reason = self._check(msg)
        if reason is not None:
            self.rejected[reason] += 1
            return False
        self.inbox.add(self.index_of[msg.sender], msg)
        self.last_from[msg.sender] = msg
        return True

    def _check(self, msg: Message) -> str | None:
        if msg.kind != STATE:
            return "kind"
        if msg.sender == self.id or msg.sender not in self.index_of:
            return "not-member"
        if msg.fingerprint != self.fingerprint and msg.fingerprint:
            return "fingerprint"
        data = msg.data
        if data is None or data.numel != self.numel:
            return "size"
        if self.config.check_payloads:
            try:
                msg.tensor = decode_payload(msg, self.state.flat)
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
        models = self.rule.neighbor_models() if hasattr(self.rule, "neighbor_models") else None
        if models is None:
            models = {}
            for sender, msg in self.last_from.items():
                if sender in self.index_of and msg.data is not None:
                    models[sender] = decode_payload(msg, self.state.flat)
        dists = [float((self.state.flat.double() - t.double()).pow(2).sum()) for t in models.values()]
        return sum(dists) / len(dists) if dists else math.nan

    # -- persistence ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume this node exactly (see :mod:`gossip.checkpoint`)."""
        return {
            "id": self.id,
            "fingerprint": self.fingerprint,
            "step": self.step,
            "round": self.round,
            "seq": self.seq,
            "flat": self.state.snapshot().cpu(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "rule": self.rule.state_dict(),
            "stream": self.stream.state_dict() if hasattr(self.stream, "state_dict") else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError(f"checkpoint is for model fingerprint {state.get('fingerprint')!r}, "
                             f"this node's model is {self.fingerprint!r}")
        self.state.load_(state["flat"].to(self.device))
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.rule.load_state_dict(state.get("rule") or {})
        if state.get("stream") is not None and self.stream is not None and hasattr(self.stream, "load_state_dict"):
            self.stream.load_state_dict(state["stream"])
        self.step = int(state["step"])
        self.round = int(state["round"])
        self.seq = int(state.get("seq", 0))
