"""Rank r's side of sharded gossip: its own connection, a node program over its shard.

Every rank of a group runs one :class:`GroupMember`. It owns a
:class:`~gossip.transport.zmq.ZmqTransport` bound at the rank's address
(:func:`gossip.groups.group.rank_address`) and a :class:`~gossip.training.node.Node` whose
flat state *is* the rank's :class:`~gossip.groups.group.ShardView`: the node's mixing
rule, codec, outer optimizer, staleness rule and link policies act on the shard
exactly as on a whole model, and rank r's messages go to rank r of the
neighbour groups only. So a group of K ranks exchanges over K connections at
once, and no message carries more than one shard.

The group's optimizer trains (DDP or FSDP); the node only mixes. A driver
calls :meth:`GroupMember.exchange` on every rank at the same steps, with rank
0's :class:`~gossip.groups.group.Decision` (members, round, verdict), which
:func:`gossip.groups.group.agree` hands to the other ranks. The real peer's control
plane makes that decision on rank 0; until then :mod:`gossip.groups.run` is the
driver.

Before the first exchange, :meth:`GroupMember.connect` checks that all groups
have one size (rank 0 asks the other groups' rank 0) and waits until each
rank's connections to its partners are up (a hello each way), so no round's
message is dropped for a connection still opening.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import Counter
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from gossip.compression import get_codec
from gossip.core.actions import Release, Send, Wait
from gossip.core.message import Message
from gossip.core.state import sha256_of
from gossip.groups.group import (
    Decision,
    Group,
    GroupError,
    GroupSizeError,
    ShardView,
    agree,
    check_group_sizes,
    members_at,
    rank_address,
)
from gossip.mixing import MixReport
from gossip.mixing.base import all_finite, decode_payload
from gossip.mixing.settings import MixingSettings, build_rules
from gossip.protocol.membership import topology_for
from gossip.training.node import Node, NodeConfig
from gossip.transport import wire
from gossip.transport.links import UNSHAPED, LinkModel, SimNetwork, parse_link
from gossip.transport.zmq import ZmqTransport

__all__ = ["GroupMember", "HELLO_EVERY"]

log = logging.getLogger("gossip.group")

HELLO_EVERY = 0.1  # seconds between hellos to a partner that has not answered yet
JOIN_CHECK = 0.25  # seconds a joining group listens between comparing notes on the shards it got


class _Shard(nn.Module):
    """The shard as a one-parameter module, so a :class:`Node` can take it as its model."""

    def __init__(self, flat: torch.Tensor) -> None:
        super().__init__()
        self.shard = nn.Parameter(flat, requires_grad=False)


def _rounds_agree(group: Group, rnd: int, late: bool) -> tuple[int, int, bool]:
    """The lowest and highest of the ranks' ``rnd`` and whether any rank is ``late`` (a collective)."""
    if group.pg is None:
        return rnd, rnd, late
    t = torch.tensor([rnd, -rnd, -int(late)], dtype=torch.int64,
                     device=group.device if group.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    lo, neg_hi, neg_late = (int(v) for v in t.tolist())
    return lo, -neg_hi, neg_late < 0


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
    group, view : this rank's :class:`~gossip.groups.group.Group` and the shard from ``group.wrap``
    group_id : this group's member id, ``HOST:PORT`` (rank 0's gossip address)
    groups : every group's member id, in the order all members use (this one included)
    mixing : the mixing settings (default: synchronous uncompressed gossip)
    topology : topology spec over the groups
    timeout : how long a synchronous round waits for a neighbour, seconds
    emulate : link emulation of this rank's connection, a
        :func:`~gossip.transport.links.parse_link` spec (``bandwidth=1Gbit,latency=1ms``)
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
        self.skipped_waits = 0  # rounds that stopped waiting for a group rank 0 declared down
        self._hellos: dict[str, dict] = {}  # partner address -> its latest hello's fields
        self._partners: set[str] = set()  # addresses whose connection is up both ways
        self.plane: Any = None  # rank 0's GroupControl (gossip.groups.control), when it runs one
        self.status = "waiting"  # what rank 0's hellos say: waiting, then training
        self.donor: str | None = None  # a training group this one joins (connect), if any
        self.live: tuple[str, ...] = ()  # the groups that answered at connect
        self.stopped = False  # rank 0 decided to stop
        self.rejoining = False  # rank 0 decided to rejoin (through ``donor``): the driver calls join()
        self._down: dict[str, tuple[int, int]] = {}  # rank-r address -> rounds lo..hi not to wait for it
        self._handovers: list[Message] = []  # state-replies that arrived (a joiner's shard)
        self._early: list[Message] = []  # states that arrived while joining, filed once it has joined
        self.handed: list[dict] = []  # shards this rank handed to joiners: to, round, sha256
        self.took: dict | None = None  # the shard this rank took when it joined: from, round, step, sha256
        self._group_of: dict[str, str] = {}  # rank-r address -> group id
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
        self._group_of.update(zip(addresses, groups))
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
            old = set(self.node.members)
            self.node.set_members(addresses, topology)
            for a in addresses:
                if a not in old:  # (re)admitted: a new life numbers its messages afresh
                    self.node.forget_sender(a)
                    self._down.pop(a, None)
        self.members = groups

    # -- I/O thread ---------------------------------------------------------------------------
    def _on_frames(self, ident: bytes, frames: list) -> None:
        try:
            msg = wire.decode(frames)
        except wire.WireError as e:
            self.rejected[e.reason] += 1
            return
        plane = self.plane
        if plane is not None:
            plane.saw(msg)  # any message from a group's rank 0 is a heartbeat
            if msg.kind in ("ping", "bye", "state-request") or (msg.kind == "members" and msg.sender != self.id):
                plane.receive(msg)
                return
        if msg.kind in ("state", "hello", "state-reply", "members") or self.control is None:
            self.inbound.put(msg)
        else:
            self.control(ident, frames)

    def send_control(self, dst: str, msg: Message) -> None:
        """Send a control message (any thread)."""
        self.transport.send(dst, wire.encode(msg), droppable=False)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind this rank's address (:class:`~gossip.transport.zmq.BindError` if taken)."""
        self.transport.start()

    def close(self) -> None:
        if self.plane is not None:
            self.plane.close()
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
        :class:`~gossip.groups.group.GroupSizeError`. Then each rank r exchanges hellos
        with rank r of every other group. Returns the sizes by group id.
        """
        others = [g for g in self.members if g != self.group_id]
        outcome: tuple[str, Any] = ("ok", {}, tuple(others), None)
        if self.rank == 0:
            try:
                # a group that trains already answers: this group joins it (a new life, or a
                # late start) and need not wait for the groups that are gone
                heard = self._hello_with([rank_address(g, 0) for g in others], timeout, enough=self._one_trains)
                live = tuple(sorted(f["group"] for f in heard.values()))
                training = [f["group"] for f in heard.values() if f.get("status") == "training"]
                sizes = {self.group_id: self.group.size}
                sizes.update({f["group"]: f["group_size"] for f in heard.values()})
                check_group_sizes(sizes)
                wrong = sorted(f["group"] for f in heard.values() if f["fp"] != self.view.fingerprint)
                if wrong:
                    raise GroupError(f"group(s) {', '.join(wrong)} run a different model or sharding than "
                                     f"group {self.group_id}")
                outcome = ("ok", sizes, live, min(training) if training else None)
            except GroupError as e:
                outcome = (type(e).__name__, str(e), (), None)
        outcome = _broadcast(self.group, outcome)
        if outcome[0] != "ok":
            raise (GroupSizeError if outcome[0] == "GroupSizeError" else GroupError)(outcome[1])
        self.live, self.donor = tuple(outcome[2]), outcome[3]
        if self.rank != 0:
            self._hello_with([rank_address(g, self.rank) for g in self.live], timeout)
        self.group.barrier()  # every rank's connections are up before rank 0 asks a donor for shards
        if self.donor is None:  # everyone starts together, from round 0
            if set(self.live) != set(others):
                self._set_members(tuple(sorted({self.group_id, *self.live})))
            self.status = "training"
            if self.plane is not None:
                self.plane.training(self.members)
        return outcome[1]

    def _one_trains(self) -> bool:
        return any(self._hellos[p].get("status") == "training" for p in self._partners if p in self._hellos)

    def _hello(self, dst: str) -> None:
        x = {"group": self.group_id, "group_size": self.group.size, "rank": self.rank,
             "heard": sorted(self._hellos)}
        if self.plane is not None:
            x.update(self.plane.incarnation_fields())
        msg = Message("hello", self.id, 0, 0, 0, extra=x, fingerprint=self.view.fingerprint)
        self.transport.send(dst, wire.encode(msg), droppable=False)

    def _hello_with(self, partners: list[str], timeout: float,
                    enough: Callable[[], bool] | None = None) -> dict[str, dict]:
        """Hellos with ``partners`` until each has heard us and we each of them (or, sooner,
        until ``enough()``); the fields of those heard both ways."""
        want = set(partners)
        deadline = self.clock() + timeout
        next_hello = self.clock()
        while not want <= self._partners and not (enough is not None and enough()):
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
        return {p: self._hellos[p] for p in partners if p in self._partners}

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
            fields = {"group": x.get("group"), "group_size": x.get("group_size"), "fp": msg.fingerprint,
                      "status": x.get("status")}
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
            if self.status == "waiting" and self.donor is not None:
                # joining: the members' first round may arrive before the shards and the member
                # list do; it is filed once they have (a few rounds' worth at most)
                if len(self._early) < 64:
                    self._early.append(msg)
                return
            self.node.deliver(msg)  # validated there: member, fingerprint, size, replay, finite
        elif msg.kind == "members" and msg.sender == rank_address(self.group_id, 0):
            x = msg.extra  # rank 0's down notice: stop waiting for these groups in rounds lo..hi
            lo, hi, groups = x.get("lo"), x.get("hi"), x.get("groups")
            if x.get("op") != "down" or type(lo) is not int or type(hi) is not int or not isinstance(groups, list):
                self.rejected["control"] += 1
                return
            for g in groups:
                if isinstance(g, str):
                    a = rank_address(g, self.rank)
                    old = self._down.get(a)
                    self._down[a] = (lo, hi) if old is None else (min(lo, old[0]), max(hi, old[1]))
        elif msg.kind == "state-reply":
            if len(self._handovers) < 4 and self.status != "training":
                self._handovers.append(msg)  # a joiner's shard, from rank r of its donor
            else:
                self.rejected["unsolicited"] += 1
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
            decision = self.plane.decide(node.round) if self.plane is not None else Decision(node.round, self.members)
        d = agree(self.group, decision)
        if d.verdict == "stop":
            self.stopped = True
        elif d.verdict == "join":  # dropped by a stronger cluster: take a member's shards, as a new life
            self.donor, self.status, self.rejoining = d.donor, "waiting", True
            self._handovers.clear()
            self._early.clear()
        if d.verdict != "mix":
            return None
        if d.members != self.members:
            self._set_members(d.members)
        self._pump(0.0)  # hellos (a joiner connecting), notices; states for members, now that they are set
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
        for g in d.handover:
            self._hand_over(g, d)
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
            if self._all_down():
                self.skipped_waits += 1
                log.info("%s: round %d: %s down, not waited for", self.id, node.round, ", ".join(node.awaited()))
                return
            remaining = deadline - self.clock()
            if remaining <= 0:
                self.timed_out += 1
                log.info("%s: round %d timed out waiting for %s", self.id, node.round, ", ".join(node.awaited()))
                return
            self._pump(remaining)
        self._pump(0.0)  # hellos of partners still connecting

    def _all_down(self) -> bool:
        """Whether every sender the node still waits for is down for the round it waits in."""
        node = self.node
        assert node is not None
        if not self._down or node.waiting is None:
            return False
        rnd = node.waiting[1]
        for a in node.awaited():
            span = self._down.get(a)
            if span is None or not span[0] <= rnd <= span[1]:
                return False
        return True

    # -- joining ----------------------------------------------------------------------------------
    def _hand_over(self, joiner: str, d: Decision) -> None:
        """After round ``d.round``'s mix: this rank's shard (and the outer momentum) to rank r of ``joiner``."""
        node = self.node
        assert node is not None
        values, extra = node.handover()
        members = sorted({*d.members, *d.handover})
        x = {"group": self.group_id, "members": members, **extra}
        msg = Message("state-reply", self.id, node.round, node.step, 0, get_codec("none").encode(values.cpu()),
                      None, x, self.view.fingerprint)
        dst = rank_address(joiner, self.rank)
        self.send_control(dst, msg)
        self.handed.append({"to": dst, "round": node.round, "step": node.step, "sha256": sha256_of(values)})
        log.info("%s: handed its shard to %s for round %d", self.id, dst, node.round)

    def join(self, timeout: float = 60.0) -> int:
        """Join the training groups as a new life (a collective, after :meth:`connect` found
        a donor): rank 0 asks the donor group to take this group in; at the end of one of its
        rounds each rank r of the donor sends its shard to rank r here; every rank takes it
        and the group goes on from the donor's round and step. Returns that local step."""
        node = self.node
        assert node is not None and self.donor is not None
        donor = rank_address(self.donor, self.rank)
        deadline = self.clock() + timeout
        ask = self.clock()
        every = max(1.0, 4 * self.plane.heartbeat) if self.plane is not None else 1.0
        got: Message | None = None
        while True:
            # listen a moment, then compare notes: done once every rank holds a shard of one round
            # (a rank whose shard was lost makes rank 0 ask again, and the donor hands over anew)
            until = self.clock() + JOIN_CHECK
            while (now := self.clock()) < until:
                if self.plane is not None and now >= ask:
                    self.plane.ask_to_join(self.donor)
                    ask = now + every
                self._pump((min(until, ask) if self.plane is not None else until) - now)
                for m in self._handovers:
                    if m.sender == donor and m.data is not None and m.data.numel == node.handover_numel(m.extra) \
                            and isinstance(m.extra.get("members"), list) and (got is None or m.round >= got.round):
                        got = m
                self._handovers.clear()
            lo, hi, late = _rounds_agree(self.group, got.round if got is not None else -1, self.clock() >= deadline)
            if lo >= 0 and lo == hi:
                break
            if late:
                raise RuntimeError(f"rank {self.rank} of group {self.group_id}: no shard of one round on every rank "
                                   f"from group {self.donor} within {timeout:g} s")
        assert got is not None
        header = (got.round, got.progress, tuple(got.extra["members"]))
        rnd, step, members = _broadcast(self.group, header)  # rank 0's word, the same on every rank
        values = decode_payload(got, node.state.flat)
        if not all_finite(values):
            raise RuntimeError(f"rank {self.rank} of group {self.group_id}: the shard from {donor} is not finite")
        node.adopt_handover(values, got.extra)
        self.view.after_mix()  # (DDP: the replicas whole again)
        self._set_members(tuple(members))
        # connections to every member, not only those that answered first at connect (a joiner
        # stops listening at the first training group): a state sent before one is up is lost
        others = [rank_address(g, self.rank) for g in members if g != self.group_id]
        try:
            self._hello_with(others, max(1.0, min(10.0, deadline - self.clock())))
        except GroupError as e:  # a member that does not answer is the detector's to judge
            log.warning("%s: %s", self.id, e)
        self.group.barrier()
        node.step = step
        for ch in node.channels:
            ch.round = rnd * node.channels[0].period // ch.period
        self.took = {"from": donor, "round": rnd, "step": step, "sha256": sha256_of(self.view.flat)}
        self.status, self.rejoining = "training", False
        early, self._early = self._early, []
        for m in early:
            if m.round >= rnd:
                node.deliver(m)
        if self.plane is not None:
            self.plane.training(members)
        log.info("%s: took the shard of %s; training from step %d, round %d", self.id, donor, step, rnd)
        return step

    def summary(self) -> dict[str, Any]:
        """Figures of this rank's gossip (bytes are what its transport saw)."""
        t = self.transport
        node = self.node
        assert node is not None
        own = {rank_address(self.group_id, r) for r in range(self.group.size)}  # rank 0's down notices
        return {"id": self.id, "group": self.group_id, "rank": self.rank, "group_size": self.group.size,
                "shard_numel": self.view.flat.numel(), "model_numel": self.view.total,
                "resident_numel": self.view.resident, "round": node.round,
                "sent_sizes": list(self.sent_sizes),
                "bytes_sent": {a: n for a, n in t.bytes_sent.items() if a not in own},
                "bytes_sent_own_group": {a: n for a, n in t.bytes_sent.items() if a in own},
                "bytes_received": dict(t.bytes_received), "max_message_bytes": t.max_message_size,
                "mixed": node.mix_totals.mixed, "missing": node.mix_totals.missing, "timed_out": self.timed_out,
                "skipped_waits": self.skipped_waits, "handed": list(self.handed), "took": self.took,
                "rejected": dict(node.rejected + self.rejected), "dropped": dict(t.dropped)}
