"""A node made of a group of K ranks, on the one protocol: rank 0 decides, the others follow.

A group (K processes under torchrun, DDP or FSDP inside) is one member of the
cluster. Its member id is rank 0's address ``HOST:PORT``; rank r listens on
``HOST:PORT+r`` (:func:`rank_address`). Rank 0 runs the peer's whole protocol
(:class:`~gossip.protocol.lifecycle.Lifecycle`, control plane, failure detector,
joins) over its own shard, exactly as a single node over its model. Ranks
1..K-1 run no control plane: each holds a :class:`ShardFollower`, a node over
its own shard that exchanges with rank r of the neighbour groups, told by rank
0 what to do through :class:`Decision` s published on the group's own channel
(:class:`GroupLink`: torchrun's store in a real group, a modelled broadcast in
the simulator).

The decisions, numbered ``seq`` = 1, 2, ... within one life of the group:

``start``
    a life begins training: its round and step, members, data shard, and for a
    life that joins a running cluster the ``donor`` whose shards every rank takes
    (those handed over at round ``donor_round``). Each rank then answers whether
    it holds its shard (``ack``); rank 0 follows with ``go`` once all do, or with
    a new ``start`` (it asked the donor again) when one does not.
``round``
    an exchange: the round's members (every rank mixes with the same neighbours
    in the same round) and the joiners to hand the shards to, before the round
    (rank r to rank r: a joiner's first round may be this one, and its members
    wait for it).
``stop``
    training ends at this exchange (a signal, or the cluster told rank 0 so).
``life``
    rank 0 starts a new life (the cluster dropped it, or it met a stronger
    cluster): a ``start`` of that life follows.
``serve``
    after training: hand the final shards to these joiners.
``exit``
    the group is done: rank 0 has finished serving the others.

Besides the decisions, rank 0 keeps its :class:`News` up to date on the link
(:meth:`GroupLink.publish_news`), which a rank waiting in a round looks at: the
members rank 0 holds dead (the rank stops waiting for them, as rank 0's own wait
does), and the joiners to hand the shards to now, in the middle of the round (a
joiner's state request that reached rank 0 while the round waited for that very
joiner: every rank hands over its shard of the round, not mixed yet).

Everything here is sans-IO: the follower yields the actions of
:mod:`gossip.core.actions` (``Send``, ``Wait``, ``Release``) from the node
program and is told what arrived (:meth:`ShardFollower.handle`); a driver
(:mod:`gossip.peer.group`, :mod:`gossip.sim.cluster`) moves the bytes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
from torch import nn

from gossip.compression import get_codec
from gossip.core.message import Message
from gossip.core.state import sha256_of
from gossip.mixing.base import all_finite, decode_payload
from gossip.mixing.settings import MixingSettings, build_rules
from gossip.protocol.membership import topology_for
from gossip.training.node import Node, NodeConfig

__all__ = ["Decision", "DECISIONS", "News", "GroupLink", "ShardFollower", "ShardModule", "bind_shard", "rank_address",
           "group_of"]

log = logging.getLogger("gossip.group")

DECISIONS = ("start", "go", "round", "stop", "life", "serve", "exit")
HELD = 64  # state messages held per follower for a round or a member list not applied yet


def rank_address(group_id: str, rank: int) -> str:
    """The gossip address of rank ``rank`` of the group whose member id is ``HOST:PORT``:
    ``HOST:PORT+rank``.

    >>> rank_address("10.0.0.5:6000", 3)
    '10.0.0.5:6003'
    """
    host, sep, port = str(group_id).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"group id must be HOST:PORT, got {group_id!r}")
    p = int(port) + rank
    if not 0 < p < 65536:
        raise ValueError(f"group {group_id!r}: rank {rank} would listen on port {p}, outside 1-65535")
    return f"{host}:{p}"


def group_of(address: str, rank: int) -> str:
    """The member id of the group whose rank ``rank`` listens at ``address`` (the inverse
    of :func:`rank_address`).

    >>> group_of("10.0.0.5:6003", 3)
    '10.0.0.5:6000'
    """
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"a rank's address must be HOST:PORT, got {address!r}")
    if not 0 < int(port) - rank < 65536:
        raise ValueError(f"{address!r} cannot be rank {rank}'s address: its group would listen on port "
                         f"{int(port) - rank}")
    return f"{host}:{int(port) - rank}"


@dataclass(frozen=True)
class Decision:
    """Rank 0's word to the other ranks of its group (see the module docstring)."""

    seq: int
    kind: str
    round: int = 0
    step: int = 0
    members: tuple[str, ...] = ()   # member ids (rank 0 addresses) in the order every member uses
    dcs: tuple[str, ...] = ()       # their datacenter labels ("" for none), for hierarchical graphs
    lives: tuple[int, ...] = ()     # their lives (incarnations; 0: not known): a new life numbers afresh
    handover: tuple[str, ...] = ()  # round: joiners to hand the shards to, before this round
    donor: str | None = None        # start of a joining life: the member whose shards every rank takes ...
    donor_round: int = -1           # ... those handed over at this round
    rank: int = 0                   # start: the group's data shard (its index among the members) ...
    world: int = 1                  # ... of this many
    origin: float = 0.0             # start: rank 0's start on the host's monotonic clock (--emulate's windows)
    why: str = ""                   # exit before a start: what stopped rank 0 ...
    finished: bool = False          # ... the cluster it would join has finished (every rank exits 0)

    def __post_init__(self) -> None:
        if self.kind not in DECISIONS:
            raise ValueError(f"decision kind must be one of {', '.join(DECISIONS)}, got {self.kind!r}")
        if not isinstance(self.origin, (int, float)) or isinstance(self.origin, bool):
            raise ValueError(f"decision origin must be a number, got {self.origin!r}")
        if not isinstance(self.why, str) or not isinstance(self.finished, bool):
            raise ValueError(f"decision why must be text and finished true or false, got {self.why!r}, "
                             f"{self.finished!r}")
        for name in ("seq", "round", "step", "rank", "world"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"decision {name} must be a non-negative integer, got {v!r}")
        object.__setattr__(self, "members", tuple(self.members))
        object.__setattr__(self, "dcs", tuple(self.dcs))
        object.__setattr__(self, "lives", tuple(self.lives))
        object.__setattr__(self, "handover", tuple(self.handover))
        if self.dcs and len(self.dcs) != len(self.members):
            raise ValueError("a decision's labels go one per member")
        if self.lives and len(self.lives) != len(self.members):
            raise ValueError("a decision's lives go one per member")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Decision":
        """A decision as rank 0 published it (ValueError names a bad field)."""
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"a decision must be JSON: {e}") from None
        if not isinstance(raw, dict) or set(raw) - {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"a decision has unknown fields: {sorted(set(raw) - {f.name for f in dataclasses.fields(cls)})}"
                             if isinstance(raw, dict) else "a decision must be a JSON object")
        for name in ("seq", "kind"):
            if name not in raw:
                raise ValueError(f"a decision needs its {name}")
        if not isinstance(raw["kind"], str):
            raise ValueError(f"decision kind must be a string, got {raw['kind']!r}")
        for name in ("members", "dcs", "handover"):
            v = raw.get(name, [])
            if not isinstance(v, list) or not all(isinstance(e, str) for e in v):
                raise ValueError(f"decision {name} must be a list of strings")
        v = raw.get("lives", [])
        if not isinstance(v, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in v):
            raise ValueError("decision lives must be a list of integers")
        if raw.get("donor") is not None and not isinstance(raw["donor"], str):
            raise ValueError(f"decision donor must be a member id or null, got {raw['donor']!r}")
        v = raw.get("donor_round", -1)
        if isinstance(v, bool) or not isinstance(v, int) or v < -1:
            raise ValueError(f"decision donor_round must be an integer >= -1, got {v!r}")
        return cls(**raw)


@dataclass(frozen=True)
class News:
    """What the other ranks need from rank 0 at once, not at the next decision: the members
    rank 0 holds dead in its round and the few before it (``(round, ids)``: a rank's wait in
    that round for them ends; a rank may still wait in a round rank 0 has left, for a
    member's old life that a new one replaces in rank 0's round), the members it knows with their lives
    (``known``: each rank opens its connection to rank r of a member, or of a member's new
    life, as soon as rank 0 hears of it, long before a round sends state on it), and
    hand-overs in the middle of a round (``(number, joiner, round, step)``: the shards of
    ``round`` at local ``step``, before it is mixed)."""

    dead: tuple[tuple[int, tuple[str, ...]], ...] = ()
    handovers: tuple[tuple[int, str, int, int], ...] = ()
    known: tuple[tuple[str, int], ...] = ()

    def dead_in(self, rnd: int) -> tuple[str, ...]:
        """The members rank 0 holds dead in round ``rnd`` (none if it did not say)."""
        return next((ids for r, ids in self.dead if r == rnd), ())

    def to_json(self) -> str:
        return json.dumps({"dead": [[r, list(ids)] for r, ids in self.dead],
                           "handovers": [list(h) for h in self.handovers], "known": [list(k) for k in self.known]})

    @classmethod
    def from_json(cls, text: str | bytes) -> "News":
        """News as rank 0 published it (ValueError names a bad field)."""
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"news must be JSON: {e}") from None
        if not isinstance(raw, dict) or set(raw) - {"dead", "handovers", "known"}:
            raise ValueError("news must be a JSON object of dead, handovers and known")

        def integer(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        dead, handovers, known = raw.get("dead", []), raw.get("handovers", []), raw.get("known", [])
        if not isinstance(dead, list) or not all(
                isinstance(d, list) and len(d) == 2 and integer(d[0]) and isinstance(d[1], list)
                and all(isinstance(x, str) for x in d[1]) for d in dead):
            raise ValueError("news dead must be a list of [round, [member ids]]")
        if not isinstance(handovers, list) or not all(
                isinstance(h, list) and len(h) == 4 and isinstance(h[1], str) and all(integer(h[i]) for i in (0, 2, 3))
                for h in handovers):
            raise ValueError("news handovers must be a list of [number, joiner, round, step]")
        if not isinstance(known, list) or not all(
                isinstance(k, list) and len(k) == 2 and isinstance(k[0], str) and integer(k[1]) for k in known):
            raise ValueError("news known must be a list of [member id, life]")
        return cls(tuple((r, tuple(ids)) for r, ids in dead), tuple(tuple(h) for h in handovers),
                   tuple(tuple(k) for k in known))


class GroupLink(Protocol):
    """The group's own channel: rank 0 publishes, the other ranks read (what a driver supplies).

    ``publish(d)`` (rank 0) makes decision ``d`` readable; ``next(seq, timeout)`` (rank r)
    returns decision ``seq`` once published, or None after ``timeout`` seconds; ``ack(seq,
    ok)`` (rank r) and ``acks(seq, timeout)`` (rank 0: every other rank's, in rank order,
    or None after ``timeout``) answer a decision that asks for it (a joining life's
    start); ``publish_news(news)`` (rank 0) and ``news()`` (rank r): rank 0's current
    :class:`News`."""

    def publish(self, decision: Decision) -> None: ...

    def next(self, seq: int, timeout: float) -> Decision | None: ...

    def ack(self, seq: int, ok: bool) -> None: ...

    def acks(self, seq: int, timeout: float) -> list[bool] | None: ...

    def publish_news(self, news: News) -> None: ...

    def news(self) -> News: ...


class ShardModule(nn.Module):
    """A shard as a one-parameter module, so a node can take it as its model."""

    def __init__(self, flat: torch.Tensor) -> None:
        super().__init__()
        self.shard = nn.Parameter(flat, requires_grad=False)


def bind_shard(node: Node, shard: torch.Tensor, fingerprint: str) -> None:
    """Make ``node`` (built over a :class:`ShardModule`) mix ``shard`` itself, as rank r's
    layout ``fingerprint``. The group's optimizer steps, not the node: no NaN-guard copy."""
    node.state.rehome(into=shard)
    node.fingerprint = fingerprint
    node._good = None


class ShardFollower:
    """Rank ``rank`` (> 0) of a group: a node over its own shard, told what to do by rank 0.

    Parameters
    ----------
    rank : this rank (1..K-1)
    group_id : the group's member id (rank 0's address)
    shard : this rank's shard, one flat tensor (the node mixes it in place)
    fingerprint : rank r's layout (equal on rank r of every group of the same model and size)
    mixing, topology, timeout, seed : as the cluster's peers run them
    """

    def __init__(self, rank: int, group_id: str, shard: torch.Tensor, fingerprint: str, *,
                 mixing: MixingSettings, topology: Any = "ring", timeout: float = 5.0, seed: int = 0) -> None:
        if rank < 1:
            raise ValueError(f"a follower is rank 1 or above of its group, got rank {rank}")
        self.rank = rank
        self.group_id = group_id
        self.id = rank_address(group_id, rank)
        self.shard = shard
        self.fingerprint = fingerprint
        self.mixing = mixing
        self.topology_spec = topology
        self.timeout = float(timeout)
        self.seed = seed
        self.node: Node | None = None
        self.members: tuple[str, ...] = ()  # this rank's member list: rank r of each member group
        self.lives: dict[str, int] = {}  # rank r address -> the life of its member that rank 0 last named
        self.status = "waiting"
        self.joining = False  # from a joining life's start to its go: state replies are wanted
        self.held: list[Message] = []  # state messages for members or rounds not applied yet
        self.replies: list[Message] = []  # state replies (a joining life's shards), a few
        self.handed: list[dict[str, Any]] = []  # shards handed to joiners: to, round, step, sha256
        self.took: dict[str, Any] | None = None  # the shard this life took: from, round, step, sha256
        self.rejected: dict[str, int] = {}
        self.timed_out_rounds = 0
        self.skipped_waits = 0  # round waits ended because rank 0 holds the awaited dead
        self.handovers_done: set[int] = set()  # mid-round hand-overs of rank 0's news, by number
        self.on_node: Any = None  # on_node(node) when a node is built (the simulator's audit)

    # -- what rank 0 decided ---------------------------------------------------------------
    def addresses(self, members: Sequence[str]) -> list[str]:
        return [rank_address(m, self.rank) for m in members]

    def apply(self, d: Decision) -> None:
        """Take a ``start`` or ``round`` decision's members (and, for start, its round and step)."""
        members = tuple(self.addresses(d.members))
        topology = topology_for(self.topology_spec, len(members), seed=self.seed,
                                dcs=list(d.dcs) if any(d.dcs) else None)
        if self.node is None or d.kind == "start":
            self._build(members, topology)
        elif members != self.members:
            old = set(self.members)
            self.node.set_members(members, topology)
            for a in members:
                if a not in old:  # (re)admitted: a new life numbers its messages afresh
                    self.node.forget_sender(a)
        self.members = members
        node = self.node
        assert node is not None
        for a, life in zip(members, d.lives):
            if life and self.lives.get(a, life) != life:
                node.forget_sender(a)  # a member's new life numbers its messages afresh
            if life:
                self.lives[a] = life
        if d.kind == "start":
            node.step = d.step
            for ch in node.channels:
                ch.round = d.step // ch.period
            # a joining life trains once it holds its shard (see take), and takes a later one
            # while rank 0 asks the donor again, until its go (see begin)
            self.status = "training" if d.donor is None else "waiting"
            self.joining = d.donor is not None
        elif d.round > node.round:
            node.align(d.round)
        self._release_held()

    def _build(self, members: tuple[str, ...], topology: Any) -> None:
        rule, policies = build_rules(self.mixing, topology)
        config = NodeConfig(steps=0, period=self.mixing.period, timeout=self.timeout, overlap=self.mixing.overlap,
                            live_sends=True, release_wait=self.timeout)
        node = Node(self.id, members, topology, None, rule, config, model=ShardModule(self.shard), policies=policies)
        bind_shard(node, self.shard, self.fingerprint)
        self.node = node
        if self.on_node is not None:
            self.on_node(node)

    # -- what arrives ----------------------------------------------------------------------
    def handle(self, msg: Message) -> None:
        """A message for this rank: a neighbour's state, or a donor's shard."""
        if msg.kind == "state":
            node = self.node
            if node is None or self.status != "training" or (msg.sender not in node.index_of
                                                              and msg.round >= node.round):
                # a joiner's first round, or a round before this life's start: held, a few.
                # The latest rounds are kept: a joining life hears its neighbours' rounds from
                # its start to its first, and only its first round's messages are of use
                if len(self.held) >= HELD:
                    oldest = min(range(len(self.held)), key=lambda i: self.held[i].round)
                    if self.held[oldest].round >= msg.round:
                        return
                    del self.held[oldest]
                self.held.append(msg)
                return
            if not node.deliver(msg):
                self._count("state")
        elif msg.kind == "state-reply":
            if self.status == "waiting" or self.joining:
                self.replies = [*self.replies[-7:], msg]  # the newest few: each holds a whole shard
            else:
                self._count("unsolicited")
        else:
            self._count("kind")

    def _release_held(self) -> None:
        node = self.node
        if not self.held or node is None or self.status != "training":
            return
        held, self.held = self.held, []
        for msg in held:
            if msg.sender in node.index_of or msg.round < node.round:
                if not node.deliver(msg):
                    self._count("state")
            else:
                self.held.append(msg)

    def _count(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    # -- a joining life: this rank's shard from rank r of the donor -------------------------
    def take(self, d: Decision) -> bool:
        """Adopt the shard the donor of start decision ``d`` handed to this rank at
        ``d.donor_round``; False if it has not arrived (rank 0 then asks again)."""
        node = self.node
        assert node is not None and d.donor is not None
        donor = rank_address(d.donor, self.rank)
        for reply in sorted(self.replies, key=lambda m: -m.round):
            if reply.sender == donor and reply.round == d.donor_round and reply.data is not None \
                    and reply.data.numel == node.handover_numel(reply.extra):
                values = decode_payload(reply, node.state.flat)
                if not all_finite(values):
                    continue
                node.adopt_handover(values, reply.extra)
                self.took = {"from": donor, "round": reply.round, "step": reply.progress,
                             "sha256": sha256_of(node.state.flat)}
                self.replies.clear()
                self.status = "training"
                self._release_held()
                log.info("%s: took the shard of %s (round %d, step %d)", self.id, donor, reply.round, reply.progress)
                return True
        log.info("%s: no shard of round %d from %s among %s", self.id, d.donor_round, donor,
                 [(m.sender, m.round) for m in self.replies] or "no replies")
        return False

    def begin(self) -> None:
        """Train from here (a joining life's go, whether or not this rank took its shard)."""
        self.joining = False
        self.replies.clear()
        if self.status != "training":
            log.warning("%s: no shard from the donor; training on with this rank's own", self.id)
            self.status = "training"
            self.replies.clear()
            self._release_held()

    def hand_over(self, joiners: Sequence[str]) -> list[tuple[str, Message]]:
        """This rank's shard (and outer momentum) for rank r of each joiner, before a round."""
        node = self.node
        assert node is not None
        values, extra = node.handover()
        out = []
        for joiner in joiners:
            msg = Message("state-reply", self.id, node.round, node.step, 0, get_codec("none").encode(values.cpu()),
                          node.rule.weight, {"inc": 0, **extra}, self.fingerprint)
            dst = rank_address(joiner, self.rank)
            out.append((dst, msg))
            self.handed.append({"to": dst, "round": node.round, "step": node.step, "sha256": sha256_of(values)})
            log.info("%s: hands its shard of round %d (step %d) to %s", self.id, node.round, node.step, dst)
        return out

    def news_handovers(self, news: News) -> list[tuple[str, Message]]:
        """The mid-round hand-overs of ``news`` this rank can make: its shard of the round it
        waits in, not mixed yet. One of a round this rank has not begun to wait in waits for
        that wait (rank 0 may be a moment ahead: it reads the joiner's request while this rank
        still takes the round's step or reads its decision, CI on a loaded machine); one of a
        round or step it has passed is left: the joiner's other ranks then miss theirs too,
        and its rank 0 asks again."""
        node = self.node
        out = []
        for number, joiner, rnd, step in news.handovers:
            if number in self.handovers_done:
                continue
            if node is not None and node.waiting is None and (node.round, node.step) <= (rnd, step):
                continue  # (at a later look: each wait looks at the news)
            self.handovers_done.add(number)
            if node is not None and node.waiting is not None and node.waiting[1] == rnd and node.step == step:
                out += self.hand_over([joiner])
            else:
                log.info("%s: cannot hand %s the shard of round %d (step %d): this rank is at round %s, step %s",
                         self.id, joiner, rnd, step, node.waiting[1] if node and node.waiting else None,
                         node.step if node else None)
        return out

    def awaited_dead(self, dead: set[str] | tuple[str, ...]) -> bool:
        """Whether every neighbour the node waits for belongs to a member rank 0 holds dead."""
        node = self.node
        if node is None or node.waiting is None:
            return False
        awaited = node.awaited()
        return bool(awaited) and all(group_of(a, self.rank) in dead for a in awaited)
