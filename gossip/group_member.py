"""Rank r's side of sharded gossip: its own connection, a node program over its shard.

Every rank of a group runs one :class:`GroupMember`. It owns a
:class:`~gossip.transport.zmq.ZmqTransport` bound at the rank's address
(:func:`gossip.group.rank_address`) and a :class:`~gossip.node.Node` whose
flat state *is* the rank's :class:`~gossip.group.ShardView`: the node's mixing
rule, codec, outer optimizer, staleness rule and link policies act on the shard
exactly as on a whole model, and rank r's messages go to rank r of the
neighbour groups only. So a group of K ranks exchanges over K connections at
once, and no message carries more than one shard.

The group's optimizer trains (DDP or FSDP); the node only mixes. A driver
calls :meth:`GroupMember.exchange` on every rank at the same steps, with rank
0's :class:`~gossip.group.Decision` (members, round, verdict), which
:func:`gossip.group.agree` hands to the other ranks. The real peer's control
plane makes that decision on rank 0; until then :mod:`gossip.group_run` is the
driver.

Before the first exchange, :meth:`GroupMember.connect` checks that all groups
have one size (rank 0 asks the other groups' rank 0) and waits until each
rank's connections to its partners are up (a hello each way), so no round's
message is dropped for a connection still opening.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections import Counter
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from gossip import wire
from gossip.group import Decision, Group, GroupError, GroupSizeError, ShardView, agree, check_group_sizes, \
    members_at, rank_address
from gossip.membership import topology_for
from gossip.message import Message
from gossip.mixing import MixReport
from gossip.mixing.settings import MixingSettings, build_rules
from gossip.node import Node, NodeConfig, Release, Send, Wait
from gossip.transport.sim import LinkModel, SimNetwork, parse_link
from gossip.transport.zmq import ZmqTransport

__all__ = ["GroupMember", "UNSHAPED", "HELLO_EVERY"]

log = logging.getLogger("gossip.group")

UNSHAPED = LinkModel(latency=0.0, bandwidth=math.inf)
HELLO_EVERY = 0.1  # seconds between hellos to a partner that has not answered yet


class _Shard(nn.Module):
    """The shard as a one-parameter module, so a :class:`Node` can take it as its model."""

    def __init__(self, flat: torch.Tensor) -> None:
        super().__init__()
        self.shard = nn.Parameter(flat, requires_grad=False)


def _broadcast(group: Group, obj: Any) -> Any:
    if group.pg is None:
        return obj
    box = [obj if group.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, device=group.device if group.backend == "nccl" else None)
    return box[0]


class GroupMember:
    """Rank ``group.rank``'s gossip over its shard.

    Parameters
    ----------
    group, view : this rank's :class:`~gossip.group.Group` and the shard from ``group.wrap``
    group_id : this group's member id, ``HOST:PORT`` (rank 0's gossip address)
    groups : every group's member id, in the order all members use (this one included)
    mixing : the mixing settings (default: synchronous uncompressed gossip)
    topology : topology spec over the groups
    timeout : how long a synchronous round waits for a neighbour, seconds
    emulate : link emulation of this rank's connection, a
        :func:`~gossip.transport.sim.parse_link` spec (``bandwidth=1Gbit,latency=1ms``)
    bind : host to bind (default: the address's own host)
    control : ``control(routing_id, frames)`` for every arriving message that is neither
        a shard's state nor a hello (called on the I/O thread, frames as they came):
        the hook through which rank 0's control plane (membership, joins, failure
        detection) shares this rank's connection and address
    """

    def __init__(self, group: Group, view: ShardView, group_id: str, groups: Sequence[str], *,
                 mixing: MixingSettings | None = None, topology: str = "ring", timeout: float = 30.0,
                 emulate: str | LinkModel | None = None, bind: str | None = None, seed: int = 0,
                 control: Callable[[bytes, list], None] | None = None) -> None:
        groups = tuple(groups)
        if group_id not in groups:
            raise GroupError(f"group {group_id} is not in the group list {', '.join(groups)}")
        if len(set(groups)) != len(groups):
            raise GroupError(f"the group list names a group twice: {', '.join(groups)}")
        self.group = group
        self.view = view
        self.group_id = group_id
        self.rank = group.rank
        self.id = rank_address(group_id, self.rank)
        self.mixing = mixing or MixingSettings()
        self.topology_spec = topology
        self.timeout = float(timeout)
        self.seed = seed
        self.control = control
        self.clock = time.monotonic
        self.t0 = self.clock()
        self.inbound: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.rejected: Counter[str] = Counter()  # wire-level: messages that could not be decoded
        self.sent_sizes: list[int] = []  # bytes of each state message handed to the transport
        self.timed_out = 0  # synchronous rounds that waited ``timeout`` in vain
        self._hellos: dict[str, dict] = {}  # partner address -> its latest hello's fields
        self._partners: set[str] = set()  # addresses whose connection is up both ways
        self.members: tuple[str, ...] = ()
        self.node: Node | None = None
        self._set_members(groups)
        shard_bytes = view.flat.numel() * view.flat.element_size()
        shaper = None
        if emulate is not None:
            shaper = SimNetwork({"intra": parse_link(emulate, UNSHAPED), "inter": parse_link(emulate, UNSHAPED)},
                                lambda u, v: "inter", seed=seed, origin=self.t0)
        host = bind or self.id.rpartition(":")[0]
        self.transport = ZmqTransport(self.id, f"tcp://{host}:{self.id.rpartition(':')[2]}",
                                      on_frames=self._on_frames, max_message_size=2 * shard_bytes + 2**20,
                                      shaper=shaper)

    # -- membership ---------------------------------------------------------------------------
    def _set_members(self, groups: tuple[str, ...]) -> None:
        topology = topology_for(self.topology_spec, len(groups), seed=self.seed)
        addresses = members_at(groups, self.rank)
        if self.node is None:
            rule, policies = build_rules(self.mixing, topology)
            config = NodeConfig(steps=0, period=self.mixing.period, timeout=self.timeout,
                                overlap=self.mixing.overlap, live_sends=True, release_wait=self.timeout)
            node = Node(self.id, addresses, topology, None, rule, config, model=_Shard(self.view.flat),
                        policies=policies)
            node.state.rehome(into=self.view.flat)  # the node's flat state is the shard itself
            node.fingerprint = self.view.fingerprint  # rank r's layout, not the one-parameter module's
            node._good = None  # the group's optimizer steps, not the node: no NaN-guard copy of the shard
            self.node = node
        else:
            self.node.set_members(addresses, topology)
        self.members = groups

    # -- I/O thread ---------------------------------------------------------------------------
    def _on_frames(self, ident: bytes, frames: list) -> None:
        try:
            msg = wire.decode(frames)
        except wire.WireError as e:
            self.rejected[e.reason] += 1
            return
        if msg.kind in ("state", "hello") or self.control is None:
            self.inbound.put(msg)
        else:
            self.control(ident, frames)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind this rank's address (:class:`~gossip.transport.zmq.BindError` if taken)."""
        self.transport.start()

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> "GroupMember":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- connecting ---------------------------------------------------------------------------
    def connect(self, timeout: float = 60.0) -> dict[str, int]:
        """Check group sizes and open this rank's connections (a collective).

        Rank 0 exchanges hellos with every other group's rank 0 and checks that
        all sizes agree; its verdict reaches every rank, so all raise the same
        :class:`~gossip.group.GroupSizeError`. Then each rank r exchanges hellos
        with rank r of every other group. Returns the sizes by group id.
        """
        others = [g for g in self.members if g != self.group_id]
        outcome: tuple[str, Any] = ("ok", {})
        if self.rank == 0:
            try:
                heard = self._hello_with([rank_address(g, 0) for g in others], timeout)
                sizes = {self.group_id: self.group.size}
                sizes.update({f["group"]: f["group_size"] for f in heard.values()})
                check_group_sizes(sizes)
                wrong = sorted(f["group"] for f in heard.values() if f["fp"] != self.view.fingerprint)
                if wrong:
                    raise GroupError(f"group(s) {', '.join(wrong)} run a different model or sharding than "
                                     f"group {self.group_id}")
                outcome = ("ok", sizes)
            except GroupError as e:
                outcome = (type(e).__name__, str(e))
        outcome = _broadcast(self.group, outcome)
        if outcome[0] != "ok":
            raise (GroupSizeError if outcome[0] == "GroupSizeError" else GroupError)(outcome[1])
        if self.rank != 0:
            self._hello_with([rank_address(g, self.rank) for g in others], timeout)
        return outcome[1]

    def _hello(self, dst: str) -> None:
        x = {"group": self.group_id, "group_size": self.group.size, "rank": self.rank,
             "heard": sorted(self._hellos)}
        msg = Message("hello", self.id, 0, 0, 0, extra=x, fingerprint=self.view.fingerprint)
        self.transport.send(dst, wire.encode(msg), droppable=False)

    def _hello_with(self, partners: list[str], timeout: float) -> dict[str, dict]:
        """Hellos with ``partners`` until each has heard us and we each of them; their fields."""
        want = set(partners)
        deadline = self.clock() + timeout
        next_hello = self.clock()
        while not want <= self._partners:
            now = self.clock()
            if now >= deadline:
                missing = sorted(want - self._partners)
                raise GroupError(f"rank {self.rank} of group {self.group_id}: no hello from {', '.join(missing)} "
                                 f"within {timeout:g} s (is that group running, with the same size?)")
            if now >= next_hello:
                for p in sorted(want - self._partners):
                    self._hello(p)
                next_hello = now + HELLO_EVERY
            self._pump(min(deadline, next_hello) - now)
        return {p: self._hellos[p] for p in partners}

    # -- incoming -------------------------------------------------------------------------------
    def _pump(self, block: float) -> None:
        """Handle what arrived, waiting up to ``block`` seconds for the first message."""
        try:
            msg = self.inbound.get(timeout=block) if block > 0 else self.inbound.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self.inbound.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: Message) -> None:
        if msg.kind == "hello":
            x = msg.extra
            fields = {"group": x.get("group"), "group_size": x.get("group_size"), "fp": msg.fingerprint}
            if not isinstance(fields["group"], str) or not isinstance(x.get("heard"), list):
                self.rejected["hello"] += 1
                return
            self._hellos[msg.sender] = fields
            if self.id not in x["heard"]:
                self._hello(msg.sender)  # it has not heard us yet: answer
            elif msg.sender not in self._partners:
                self._partners.add(msg.sender)  # up both ways; tell it we heard it too
                self._hello(msg.sender)
        elif msg.kind == "state":
            assert self.node is not None
            self.node.deliver(msg)  # validated there: member, fingerprint, size, replay, finite
        else:
            self.rejected["kind"] += 1

    # -- the exchange ---------------------------------------------------------------------------
    def exchange(self, step: int, decision: Decision | None = None) -> MixReport | None:
        """One synchronous gossip round of this rank's shard at local step ``step`` (a collective).

        ``decision`` is rank 0's (the others' is ignored); None on rank 0 means
        "mix with the current members at the next round". Runs every channel
        whose period divides ``step``, then lets the group make its replicas
        consistent (DDP). Returns what the mixing did (None when the verdict
        was not ``mix``).
        """
        node = self.node
        assert node is not None
        if self.group.rank == 0 and decision is None:
            decision = Decision(node.round, self.members)
        d = agree(self.group, decision)
        if d.verdict != "mix":
            return None
        if d.members != self.members:
            self._set_members(d.members)
        if d.round > node.round:
            node.align(d.round)
        node.step = step
        before = MixReport(node.mix_totals.mixed, node.mix_totals.missing, node.mix_totals.late)
        for ch in node.channels:
            if step % ch.period == 0:
                self._drive(node.exchange(ch))
        if node.state.flat is not self.view.flat:
            # a send still held the shard when the round mixed: the node moved to fresh memory
            home = self.view.moved(node.state.flat)
            if home is not node.state.flat:
                node.state.rehome(into=home)
        self.view.after_mix()
        node.last_from.clear()  # it would keep a shard's worth of received frames alive until next round
        t = node.mix_totals
        return MixReport(t.mixed - before.mixed, t.missing - before.missing, t.late - before.late)

    def finish(self) -> MixReport:
        """Mix the rounds still in flight (with ``overlap``, the last round's messages are
        mixed at the next exchange, and there is none after the last; a collective)."""
        node = self.node
        assert node is not None
        before = node.mix_totals.mixed
        pending = [ch for ch in node.channels if ch.pending is not None]
        for ch in pending:
            self._drive(node.complete(ch))
        if pending:
            self.view.after_mix()
            node.last_from.clear()
        return MixReport(node.mix_totals.mixed - before)

    def _drive(self, program: Any) -> None:
        """Advance one exchange of the node program with the wall clock."""
        try:
            action = next(program)
            while True:
                kind = type(action)
                if kind is Send:
                    self._send(action.messages)
                elif kind is Wait:
                    self._wait(action.timeout)
                elif kind is Release:
                    action.lease.wait(action.timeout)
                del action  # nothing here may keep a message sent in place alive
                action = program.send(self.clock() - self.t0)
        except StopIteration:
            return

    def _send(self, messages: list) -> None:
        encoded: dict[int, list] = {}
        for dst, msg in messages:
            frames = encoded.get(id(msg))
            if frames is None:  # one encoding per distinct message, shared by its receivers
                frames = encoded[id(msg)] = wire.encode(msg)
                self.sent_sizes.append(sum(memoryview(f).nbytes for f in frames))
            self.transport.send(dst, frames)

    def _wait(self, timeout: float) -> None:
        node = self.node
        assert node is not None
        deadline = self.clock() + timeout
        while not node.ready():
            remaining = deadline - self.clock()
            if remaining <= 0:
                self.timed_out += 1
                log.info("%s: round %d timed out waiting for %s", self.id, node.round, ", ".join(node.awaited()))
                return
            self._pump(remaining)
        self._pump(0.0)  # hellos of partners still connecting

    def summary(self) -> dict[str, Any]:
        """Figures of this rank's gossip (bytes are what its transport saw)."""
        t = self.transport
        node = self.node
        assert node is not None
        return {"id": self.id, "group": self.group_id, "rank": self.rank, "group_size": self.group.size,
                "shard_numel": self.view.flat.numel(), "model_numel": self.view.total,
                "resident_numel": self.view.resident, "round": node.round,
                "sent_sizes": list(self.sent_sizes), "bytes_sent": dict(t.bytes_sent),
                "bytes_received": dict(t.bytes_received), "max_message_bytes": t.max_message_size,
                "mixed": node.mix_totals.mixed, "missing": node.mix_totals.missing, "timed_out": self.timed_out,
                "rejected": dict(node.rejected + self.rejected), "dropped": dict(t.dropped)}
