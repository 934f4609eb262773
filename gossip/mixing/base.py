"""What every mixing rule shares: the inbox it reads from and the rule interface.

A mixing rule decides what to send and how to combine what arrives. It never
touches a socket or a clock: the node gives it the flat parameters, the
topology, its own index and the round; the driver moves the bytes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from gossip.compression import Codec, Encoded, get_codec, get_decoder
from gossip.compression.base import DTYPES
from gossip.core.buffers import Chunked, Pieces, pooled_copy
from gossip.core.message import Message, Packet

__all__ = ["Inbox", "MixingRule", "MixReport", "all_finite", "decode_payload", "take_round_messages"]


class Inbox:
    """Messages received and not yet mixed, per sender index, in arrival order.

    Each sender's queue is capped (``per_sender``): a peer racing ahead cannot
    make a slow node hoard memory; the oldest message is evicted and counted.
    """

    def __init__(self, per_sender: int = 64) -> None:
        self.per_sender = per_sender
        self.queues: dict[int, deque[Message]] = {}
        self.evicted = 0

    def add(self, src: int, msg: Message) -> None:
        q = self.queues.get(src)
        if q is None:
            q = self.queues[src] = deque()
        if len(q) >= self.per_sender:
            q.popleft()
            self.evicted += 1
        q.append(msg)

    def has_round(self, src: int, rnd: int) -> bool:
        q = self.queues.get(src)
        if not q:
            return False
        if q[-1].round == rnd:  # the common case: the newest message is this round's
            return True
        return any(m.round == rnd for m in q)

    def count_round(self, senders: Iterable[int], rnd: int) -> int:
        """How many of ``senders`` have a message of round ``rnd`` waiting."""
        return sum(1 for j in senders if self.has_round(j, rnd))

    def take_round(self, src: int, rnd: int) -> tuple[Message | None, int]:
        """Remove and return ``src``'s message of round ``rnd``; older ones are
        discarded and counted (second value)."""
        q = self.queues.get(src)
        if not q:
            return None, 0
        if q[0].round == rnd:  # the common case: in order, nothing stale
            return q.popleft(), 0
        found, stale = None, 0
        keep: deque[Message] = deque()
        for m in q:
            if m.round < rnd:
                stale += 1
            elif m.round == rnd and found is None:
                found = m
            else:
                keep.append(m)
        self.queues[src] = keep
        return found, stale

    def take_upto(self, src: int, rnd: int) -> list[Message]:
        """Remove and return every message of ``src`` with round <= ``rnd``."""
        q = self.queues.get(src)
        if not q:
            return []
        out = [m for m in q if m.round <= rnd]
        if out:
            self.queues[src] = deque(m for m in q if m.round > rnd)
        return out

    def take_all(self, src: int) -> list[Message]:
        q = self.queues.pop(src, None)
        return list(q) if q else []

    def senders(self) -> list[int]:
        return [s for s, q in self.queues.items() if q]

    def drop_sender(self, src: int) -> None:
        self.queues.pop(src, None)

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())


@dataclass
class MixReport:
    """What one mixing step did, for metrics: how many neighbours were mixed in,
    how many expected ones were missing, and how many messages came too late."""

    mixed: int = 0
    missing: int = 0
    late: int = 0
    staleness: float = 0.0


class MixingRule:
    """Base class: subclasses implement :meth:`outgoing` and :meth:`mix`.

    ``synchronous`` rules make the node wait (up to a timeout) until
    :meth:`ready` says every expected message of the round is in.
    """

    name = "rule"
    synchronous = True
    overlap = False  # set by the node: mix a round one exchange later, while the next one computes
    # set by the node for each round: ``x`` stays unchanged until the transport has sent
    # it, so a codec that views its input may encode ``x`` itself (no snapshot)
    sends_live = False
    weight: float | None = None  # push-sum's mass (None: a rule without one)
    clipped = 0  # neighbour differences clipped so far (robust gossip)

    def __init__(self, codec: Codec | str = "none") -> None:
        self.codec = get_codec(codec) if isinstance(codec, str) else codec
        self._round_key: int | None = None
        self._round_topology: Any = None
        self._round_me: int | None = None
        self._round: tuple[dict[int, float], dict[int, float], list[int]] = ({}, {}, [])
        self.receivers: list[int] = []  # out-neighbours of the current round (set by round_weights)

    def outgoing(self, x: torch.Tensor, topology: Any, me: int, rnd: int) -> list[tuple[int, Packet]]:
        raise NotImplementedError

    def encode_state(self, x: torch.Tensor) -> Encoded:
        """``x`` encoded for sending while training goes on changing it.

        A codec whose encoding views its input (identity on CPU) encodes a
        snapshot, taken into a pooled buffer (:func:`gossip.core.buffers.pooled_copy`),
        unless the node said that ``x`` stays as it is until sent
        (:attr:`sends_live`); any other codec's encoding is a copy already, so
        ``x`` goes in as it is.
        """
        return self.codec.encode(pooled_copy(x) if self.codec.aliases_input and not self.sends_live else x)

    def ready(self, inbox: Inbox, topology: Any, me: int, rnd: int) -> bool:
        """Whether every expected message of round ``rnd`` is in (synchronous rules wait for this)."""
        for j in self.round_weights(topology, me, rnd)[2]:
            if not inbox.has_round(j, rnd):
                return False
        return True

    def mix(self, x: torch.Tensor, inbox: Inbox, topology: Any, me: int, rnd: int, progress: int) -> MixReport:
        raise NotImplementedError

    def round_weights(self, topology: Any, me: int, rnd: int) -> tuple[dict[int, float], dict[int, float], list[int]]:
        """(in-weights, out-weights, expected senders) of node ``me`` in round ``rnd``.

        Looked up once per round and reused by :meth:`outgoing`, :meth:`ready`
        (asked after every delivery) and :meth:`mix`. Callers must not mutate them.
        """
        if self._round_key != rnd or self._round_topology is not topology or self._round_me != me:
            ins, outs = topology.in_weights(me, rnd), topology.out_weights(me, rnd)
            self._round = (ins, outs, [j for j in ins if j != me])
            self.receivers = [j for j in outs if j != me]
            self._round_key, self._round_topology, self._round_me = rnd, topology, me
        return self._round

    def expected_senders(self, topology: Any, me: int, rnd: int) -> list[int]:
        """In-neighbours whose round-``rnd`` message a synchronous rule waits for."""
        return self.round_weights(topology, me, rnd)[2]

    def on_adopt(self, x: torch.Tensor) -> None:
        """The node's parameters were replaced wholesale (the start, a neighbour's state, a
        checkpoint): rules that remember them (an outer optimizer's anchor) start from ``x``."""

    def on_members_changed(self, old: list[Any], new: list[Any]) -> None:
        """Member list changed (join, death): indices now refer to ``new``. Rules
        keeping per-neighbour state re-key or reset it here."""
        self._round_key = None

    def payload_numel(self, rnd: int, numel: int) -> int:
        """Elements a state message of round ``rnd`` carries, for a model of ``numel``
        (the node checks arriving ones against it); a fragment rule sends one part."""
        return numel

    def neighbor_models(self) -> dict[int, torch.Tensor] | None:
        """The models this rule keeps of its neighbours (CHOCO's public copies), by
        index; None when it keeps none (the node then reads the last messages)."""
        return None

    def outer_state(self) -> dict[str, Any] | None:
        """The outer optimizer state a joiner takes with the parameters (None: no outer optimizer)."""
        return None

    def load_outer_state(self, state: dict[str, Any]) -> None:
        """Take a member's :meth:`outer_state` (after the parameters were adopted)."""

    # Rules with state of their own (push-sum weight, CHOCO copies) persist it in checkpoints.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def report(self) -> dict[str, Any]:
        """Rule-specific figures for summaries (the rule's name at least)."""
        return {"rule": self.name}

    def debiased(self, x: torch.Tensor) -> torch.Tensor:
        """The model this node would evaluate (push-sum divides by its weight)."""
        return x

    def decode(self, msg: Message, like: torch.Tensor) -> torch.Tensor:
        """The message's tensor in ``like``'s dtype and device (read-only: it may
        alias the received buffer). Decoded once; the node may have done it already
        while validating."""
        if msg.tensor is None:
            msg.tensor = decode_payload(msg, like)
        elif type(msg.tensor) is Pieces:
            msg.tensor = msg.tensor.join()
        return msg.tensor

    def decode_pieces(self, msg: Message, like: torch.Tensor) -> torch.Tensor | Pieces:
        """Like :meth:`decode`, but an uncompressed payload that arrived as several
        frames may come back as :class:`~gossip.core.buffers.Pieces` (for element-wise
        use: :func:`all_finite`, :func:`~gossip.mixing.gossip.weighted_sum_`)."""
        if msg.tensor is None:
            msg.tensor = decode_payload(msg, like, pieces=True)
        return msg.tensor


def take_round_messages(inbox: Inbox, weights: dict[int, float], me: int, rnd: int,
                        report: MixReport) -> tuple[float, list[tuple[float, Message]]]:
    """Each in-neighbour's message of round ``rnd``, with its weight, and this node's own
    weight; an absent neighbour's weight goes to self, so W stays row-stochastic
    (counted in ``report``: missing, late)."""
    self_w = weights.get(me, 0.0)
    terms: list[tuple[float, Message]] = []
    for j in sorted(weights):
        if j == me:
            continue
        msg, stale = inbox.take_round(j, rnd)
        report.late += stale
        if msg is None:
            self_w += weights[j]
            report.missing += 1
            continue
        terms.append((weights[j], msg))
    return self_w, terms


def decode_payload(msg: Message, like: torch.Tensor, pieces: bool = False) -> torch.Tensor | Pieces:
    """Decode ``msg.data`` with the codec it names, as ``like``'s dtype and device.

    With ``pieces=True``, an uncompressed payload of ``like``'s dtype that arrived
    as several frames comes back as :class:`~gossip.core.buffers.Pieces` viewing them,
    instead of being joined into one tensor (a copy of the whole payload)."""
    data = msg.data
    src = data.source
    if src is not None and src.dtype == like.dtype and src.device == like.device:
        return src  # delivered in-process: the payload is the sender's snapshot itself
    if pieces and data.codec == "identity" and like.device.type == "cpu" and data.buffers \
            and type(data.buffers[0]) is Chunked and DTYPES.get(data.dtype) == like.dtype:
        parts = data.buffers[0].pieces(like.dtype)  # frames come from wire.decode, which validated them
        if parts is not None:
            return parts
    t = get_decoder(msg.data.codec).decode(msg.data, device=like.device, copy=False)
    return t if t.dtype == like.dtype else t.to(like.dtype)


def all_finite(t: torch.Tensor | Pieces) -> bool:
    """Whether every element of ``t`` (a tensor or :class:`~gossip.core.buffers.Pieces`) is finite.

    A NaN or an infinity anywhere makes the sum non-finite (NaN propagates, an
    infinity stays one or meets its opposite and makes NaN), so a finite sum
    proves every element finite. A sum is the cheapest full pass torch has on
    CPU (~20% faster than ``aminmax``, ~10x faster than ``isfinite().all()``,
    which allocates a mask). Only a non-finite sum, which finite values that
    overflow also give, pays for a second pass: ``aminmax``, which answers
    exactly.
    """
    if type(t) is Pieces:
        return all(all_finite(p) for p in t.parts)
    if t.numel() == 0 or math.isfinite(t.sum().item()):
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())
