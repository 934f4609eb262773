"""The simulator's lockstep engine: synchronous gossip over all nodes a round at a time.

The batched engine (:mod:`gossip.sim.batched`) vectorises local steps but still runs
every node's program, messages and mixing one node at a time; at a thousand
nodes that event loop, not arithmetic, is the cost. When every node of a run does
the same thing at (nearly) the same virtual time, the event loop computes nothing
a schedule cannot: the lockstep engine then advances all nodes a phase at a time,
one vectorised local step for all of them and one sparse product
``X <- W_r X`` over the ``[n, P]`` parameter matrix per round, and keeps the
counts the event loop keeps (steps, bytes and messages per node and link class,
rounds, sequence numbers, the virtual clock) from a schedule computed with
numpy from the same link and compute models.

When it applies (:func:`lockstep_refusal` names the first condition a run
fails, and ``engine="auto"`` then runs the batched engine; ``auto`` also runs the
batched engine when the first ``Simulation.run`` stops early with ``until``, since
a network changed between the pieces is something the schedule cannot follow):

- local steps batch (:func:`gossip.sim.batched.batch_support`);
- synchronous exact gossip: every node runs :class:`~gossip.mixing.gossip.GossipRule`
  with the identity codec, without clip or overlap, one channel (no link
  policies), no outer optimizer and no misbehaving (byzantine) node;
- fixed compute time, the same on every node (no ``slow`` node, no random or
  measured times), so every node's k-th step ends at one time up to the
  nanoseconds by which message sizes differ;
- links without jitter, loss, ``drop`` or ``down`` windows (a run with faults runs
  the real protocol, :mod:`gossip.sim.fault_runs`, never this engine);
- every node has an in-neighbour in every round of the topology (static or
  time-varying, e.g. one-peer exponential);
- the schedule keeps phases apart: every node's k-th step ends before any
  node's (k+1)-th, every message of a round leaves before the first arrives,
  every node has mixed before any starts its next round's step, no wait reaches
  its timeout, and no timer fires at the same time as its node's own events.
  The schedule is computed in full at construction, so a run that fails this
  (a slow inter-datacenter link, say) is refused before it starts.

Within those conditions the event loop's order is a function of time and
insertion order only, which the schedule reproduces (ties broken as the heap
breaks them), so the engine observes what the event loop would at each
evaluation point: the nodes that completed step s before the last one have
taken their next step or sent their messages, the last has not yet. Parameters
agree with the per-node engine to float rounding (a sparse product sums in
another order than the per-node ``lerp_`` chain); counts and times agree
exactly. What it does not keep: messages themselves (a node's ``inbox`` and
``last_from``, which only a real node's ``neighbor_distance`` reads).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from gossip.core.message import STATE, Message
from gossip.mixing.gossip import GossipRule

__all__ = ["Lockstep", "LockstepRefused", "lockstep_refusal", "choose_lockstep"]

log = logging.getLogger("gossip.lockstep")

START, STEP, SEND, FINISH, DELIVER = range(5)
_WIDTHS = np.array([128, 256, 65536, 4294967296], dtype=np.int64)  # msgpack int widths (see MessageSizes)


class LockstepRefused(ValueError):
    """The run cannot be advanced in lockstep; ``str(e)`` says why."""


@dataclass
class Phase:
    """Events of one kind, one per node (or per message for DELIVER), in processing order.

    kind : what each node does at its event: START (start a local step), STEP (a
        step ended: start the next), SEND (a step ended: send the round's messages),
        FINISH (the last step ended), DELIVER (a message arrives; its receiver mixes
        at its last one)
    times : the events' virtual times in processing order (non-decreasing)
    order : node ids (DELIVER: message indices into the round's ``_Graph`` arrays)
        in processing order
    """

    kind: int
    times: np.ndarray
    order: np.ndarray
    step: int = 0            # global step count completed at this phase (0 for START/DELIVER)
    rnd: int = 0             # the round (SEND, DELIVER)
    graph: int = 0           # the topology graph of the round (DELIVER)
    sizes: Any = None        # SEND/DELIVER: bytes of each sender's message, by node
    then: int = STEP         # DELIVER: after mixing, STEP (start the next round) or FINISH
    mix_at: Any = None       # DELIVER: per node, the position in ``order`` of its last message
    leave: Any = None        # SEND: per message, when it has left (its link is busy until then)


class _Graph:
    """One graph of the topology's cycle as arrays: messages u -> v, in sending order."""

    def __init__(self, topology: Any, r: int, n: int, links: dict[str, Any]) -> None:
        eu, ev, sub, cls = [], [], [], []
        for u in range(n):
            receivers = [j for j in topology.out_weights(u, r) if j != u]
            for k, v in enumerate(receivers):
                eu.append(u)
                ev.append(v)
                sub.append(k)
                cls.append(topology.link(u, v))
        self.eu = np.array(eu, dtype=np.int64)
        self.ev = np.array(ev, dtype=np.int64)
        self.sub = np.array(sub, dtype=np.int64)
        self.classes = sorted(set(cls))
        self.cls = np.array([self.classes.index(c) for c in cls], dtype=np.int64)
        models = [links.get(c) or links["intra"] for c in self.classes]
        self.bandwidth = np.array([models[c].bandwidth for c in self.cls], dtype=np.float64)
        self.latency = np.array([models[c].latency for c in self.cls], dtype=np.float64)
        self.outdeg = np.bincount(self.eu, minlength=n)
        self.indeg = np.bincount(self.ev, minlength=n)
        self.pairs = list(zip(eu, ev))
        # mixing weights W[v, u] = in_weights(v)[u], self included (what GossipRule.mix applies)
        rows, cols, vals = [], [], []
        for v in range(n):
            for u, w in topology.in_weights(v, r).items():
                rows.append(v)
                cols.append(u)
                vals.append(w)
        self.w_rows, self.w_cols, self.w_vals = rows, cols, vals


def _width(v: np.ndarray) -> np.ndarray:
    return np.searchsorted(_WIDTHS, v, side="right")


class Lockstep:
    """Runs a :class:`~gossip.sim.engine.Simulator` in lockstep (see the module docstring).

    Raises :class:`LockstepRefused`, naming the reason, when the run does not qualify.
    """

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        reason = _static_refusal(sim)
        if reason is not None:
            raise LockstepRefused(reason)
        nodes = sim.nodes
        self.n = n = len(nodes)
        first = nodes[0]
        self.steps = first.config.steps
        self.period = first.config.period
        self.timeout = float(first.config.timeout)
        self.c = float(sim.compute.mean)  # what ComputeModel.sampler gives every node
        self.topology = first.channels[0].topology
        self.graphs = [_Graph(self.topology, g, n, sim.network.links) for g in range(self.topology.period)]
        pair_index: dict[tuple[int, int], int] = {}
        for g in self.graphs:
            g.pair = np.array([pair_index.setdefault(p, len(pair_index)) for p in g.pairs], dtype=np.int64)
        self.pairs = list(pair_index)
        self._size_of = sim._size_of
        self._payload = first.rule.codec.encode(first.state.flat.detach().clone())
        self._sizes: dict[tuple[int, int, int, int], int] = {}
        # the whole schedule, once: a run that breaks lockstep is refused before it starts
        for _ in self._plan():
            pass
        self.batched = sim.batched
        self._w: list[torch.Tensor | None] = [None] * len(self.graphs)
        self._phases = self._plan()
        self._phase: Phase | None = next(self._phases, None)
        self._pos = 0
        self._sent: torch.Tensor | None = None  # a round's sent parameters, kept when its mixing is split
        self._done = False
        self.bytes_sent = np.zeros(n, dtype=np.int64)
        self.bytes_received = np.zeros(n, dtype=np.int64)
        self.seq = np.array([nd.seq for nd in nodes], dtype=np.int64)
        self.rounds = np.zeros(n, dtype=np.int64)
        self.mixed = np.zeros(n, dtype=np.int64)
        self.node_now = np.zeros(n, dtype=np.float64)
        self.finished = np.zeros(n, dtype=bool)
        self.busy = np.zeros(len(self.pairs), dtype=np.float64)
        self._links = dict(sim.network.links)  # what the schedule was computed for

    # -- the schedule ---------------------------------------------------------------------------
    def _size(self, i: int, seq: int, rnd: int, step: int) -> int:
        """Wire bytes of node i's round message (memoised by the header's int widths)."""
        key = (i, int(_width(np.array([seq]))[0]), int(_width(np.array([rnd]))[0]), int(_width(np.array([step]))[0]))
        size = self._sizes.get(key)
        if size is None:
            node = self.sim.nodes[i]
            msg = Message(STATE, node.id, rnd, step, seq, self._payload, None, {}, node.fingerprint)
            size = self._sizes[key] = self._size_of(msg)
        return size

    def _plan(self) -> Iterator[Phase]:
        """Every phase of the run in order, with exact times and processing order.

        The event loop breaks ties in time by insertion order: an event pushed while
        processing an earlier one comes after it. So within a phase the order is by
        time, then by the position of the event that pushed it (its node's previous
        event; for a message, its sender's, then its place among the receivers).
        Raises LockstepRefused where the event loop would interleave two phases."""
        n, c, p, steps = self.n, self.c, self.period, self.steps
        start = np.zeros(n, dtype=np.float64)
        rank = np.arange(n)  # processing position of each node's last event
        seq = np.array([nd.seq for nd in self.sim.nodes], dtype=np.int64)
        busy = np.zeros(len(self.pairs), dtype=np.float64)
        timer = np.full(n, np.inf)  # each node's pending wait timer (inf: none)
        self._final_timers = timer
        last_max = 0.0
        yield Phase(START, start.copy(), rank.copy())
        rounds = -(-steps // p)
        sizes = np.zeros(n, dtype=np.int64)
        for r in range(rounds):
            kr = min(p, steps - r * p)
            t = start
            for k in range(1, kr + 1):
                t = t + c
                order = np.lexsort((rank, t))
                times = t[order]
                if times[0] <= last_max:
                    if k == 1 and r > 0:
                        raise LockstepRefused(f"round {r}: a node ends step {r * p + k} before every node has "
                                              f"mixed round {r - 1} (rounds interleave)")
                    raise LockstepRefused(f"round {r}: a node ends step {r * p + k} before every node has ended "
                                          "the step before (the nodes do not step together)")
                last_max = float(times[-1])
                rank = np.empty(n, dtype=np.int64)
                rank[order] = np.arange(n)
                s = r * p + k
                if k < kr:
                    yield Phase(STEP, times, order, step=s)
                    continue
                if kr < p:
                    yield Phase(FINISH, times, order, step=s)
                    return
                g = self.graphs[r % len(self.graphs)]
                seq = seq + (g.outdeg > 0)
                sizes = self._round_sizes(seq, r, s)
                # each message leaves when its link is free, after size / bandwidth, and arrives latency later
                begin = np.maximum(t[g.eu], busy[g.pair])
                leave = begin + sizes[g.eu].astype(np.float64) * 8.0 / g.bandwidth
                busy[g.pair] = leave
                arrive = leave + g.latency
                yield Phase(SEND, times, order, step=s, rnd=r, graph=r % len(self.graphs), sizes=sizes,
                            leave=leave)
            order = np.lexsort((g.sub, rank[g.eu], arrive))
            times = arrive[order]
            if times[0] <= last_max:
                raise LockstepRefused(f"round {r}: a message arrives before every node has sent its own "
                                      "(messages and steps interleave)")
            pos = np.empty(len(order), dtype=np.int64)
            pos[order] = np.arange(len(order))
            mix_at = np.full(n, -1, dtype=np.int64)
            np.maximum.at(mix_at, g.ev, pos)
            mixed = arrive[order[mix_at]]  # each node mixes at its last arrival
            deadline = t + self.timeout
            if (mixed >= deadline).any():
                i = int(np.argmax(mixed - deadline))
                raise LockstepRefused(f"round {r}: node {i} would wait past its timeout of {self.timeout} s "
                                      "(and then mix without a neighbour)")
            # wait timers (one per node, re-armed while waiting): none may tie with its node's events
            if ((timer == t) | (timer == mixed)).any():
                raise LockstepRefused(f"round {r}: a wait timer fires at the same time as its node's event")
            timer = np.where((timer < t) | np.isinf(timer), deadline, timer)  # gone off: a new one
            timer = np.where((timer > t) & (timer < mixed), deadline, timer)  # goes off while waiting: re-armed
            self._final_timers = timer
            last_max = float(times[-1])
            then = STEP if (r + 1) * p < steps else FINISH
            yield Phase(DELIVER, times, order, rnd=r, graph=r % len(self.graphs), sizes=sizes, then=then,
                        mix_at=mix_at)
            rank = mix_at  # a node's next step was pushed when it mixed
            start = mixed
            if then == FINISH:
                return

    def _round_sizes(self, seq: np.ndarray, rnd: int, step: int) -> np.ndarray:
        """Bytes of each node's message this round (recomputed only when a header int changes width)."""
        widths = _width(seq)
        key = (int(_width(np.array([rnd]))[0]), int(_width(np.array([step]))[0]))
        last = getattr(self, "_last", None)
        if last is not None and last[0] == key and np.array_equal(last[1], widths) \
                and np.array_equal(last[3], seq > 0):
            return last[2]
        sizes = np.array([self._size(i, int(seq[i]), rnd, step) for i in range(self.n)], dtype=np.int64)
        self._last = (key, widths, sizes, seq > 0)
        return sizes

    # -- running it -----------------------------------------------------------------------------
    def run(self, until: float | None = None) -> None:
        """Process every event up to simulated time ``until`` (or to the end), as the event loop would."""
        sim = self.sim
        if self.changed() is not None:
            raise RuntimeError("the network changed during a lockstep run, which its "
                               "schedule cannot follow; run with engine 'batched' or 'per-node' to change them "
                               "mid-run")
        try:
            while self._phase is not None:
                ph = self._phase
                total = len(ph.order)
                k = total if until is None else int(np.searchsorted(ph.times, until, side="right"))
                if k > self._pos:
                    lo, self._pos = self._pos, k
                    self._process(ph, lo, k)
                    sim.now = float(ph.times[k - 1])
                if k < total:
                    sim.now = until  # the next event is later
                    return
                self._phase = next(self._phases, None)
                self._pos = 0
            # every node has finished; the event loop's queue holds only wait timers, which move no clock
            timers = self._final_timers
            timers = timers[np.isfinite(timers)]
            self._final_timers = timers[timers > until] if until is not None else timers[:0]
            if len(self._final_timers):
                sim.now = until
        finally:
            self._sync()

    def changed(self) -> str | None:
        """What changed since the schedule was computed that it cannot follow (None: nothing)."""
        sim = self.sim
        network = sim.network
        if network._group:
            return "the network was partitioned"
        if network.links != self._links:
            return "a link model changed"
        return None

    def _process(self, ph: Phase, lo: int, hi: int) -> None:
        sim = self.sim
        if ph.kind == DELIVER:
            self._deliver(ph, lo, hi)
            return
        ids = ph.order[lo:hi]
        self.node_now[ids] = ph.times[lo:hi]
        if ph.kind == START:
            self._step(ids)
            return
        sim.steps_done += hi - lo  # a local step ended on each of them
        if sim.on_step is not None and hi == len(ph.order) and sim.steps_done % sim.step_every == 0:
            # the observation hook runs at the last node's event, before that node acts
            self._act(ph, ids[:-1])
            sim.now = float(ph.times[hi - 1])
            self._sync()
            sim.on_step(sim)
            self._act(ph, ids[-1:])
        else:
            self._act(ph, ids)

    def _act(self, ph: Phase, ids: np.ndarray) -> None:
        if len(ids) == 0:
            return
        if ph.kind == STEP:
            self._step(ids)
        elif ph.kind == SEND:
            self._send(ph, ids)
        else:
            self.finished[ids] = True

    def _step(self, ids: np.ndarray) -> None:
        """One local step on each of ``ids``: one vectorised call."""
        self.batched.step_nodes(ids.tolist())

    def _send(self, ph: Phase, ids: np.ndarray) -> None:
        g = self.graphs[ph.graph]
        sending = np.zeros(self.n, dtype=bool)
        sending[ids] = True
        sel = sending[g.eu]
        self.seq[ids] += g.outdeg[ids] > 0
        self.bytes_sent[ids] += ph.sizes[ids] * g.outdeg[ids]
        self.busy[g.pair[sel]] = ph.leave[sel]
        network = self.sim.network
        nbytes = np.bincount(g.cls[sel], weights=ph.sizes[g.eu[sel]], minlength=len(g.classes))
        count = np.bincount(g.cls[sel], minlength=len(g.classes))
        for c, name in enumerate(g.classes):
            if count[c]:
                network.bytes_by_class[name] += int(nbytes[c])
                network.messages_by_class[name] += int(count[c])

    def _deliver(self, ph: Phase, lo: int, hi: int) -> None:
        g = self.graphs[ph.graph]
        edges = ph.order[lo:hi]
        self.bytes_received += np.bincount(g.ev[edges], weights=ph.sizes[g.eu[edges]],
                                           minlength=self.n).astype(np.int64)
        ids = np.flatnonzero((ph.mix_at >= lo) & (ph.mix_at < hi))
        if len(ids) == 0:
            return
        ids = ids[np.argsort(ph.mix_at[ids])]  # in the order they mix
        matrix = self.batched.matrix
        W = self._weights(ph.graph)
        with torch.no_grad():
            if len(ids) == self.n:  # the whole round at once: X <- W X = X + (W - I) X
                # addmm into a kept buffer, then back: the same sums as X + (W - I) X, in a third
                # of the time of sparse.mm and add_ (which allocates the product afresh each round)
                out = self.batched.scratch(self.n)
                torch.addmm(matrix, W, matrix, out=out)
                matrix.copy_(out)
            else:  # part of the round: mix these rows from what every node sent
                if self._sent is None:
                    self._sent = matrix.clone()
                rows = torch.as_tensor(self._rows[ids], device=matrix.device)
                matrix.index_add_(0, rows, torch.sparse.mm(W, self._sent).index_select(0, rows))
        if hi == len(ph.order):
            self._sent = None
        self.rounds[ids] += 1
        self.mixed[ids] += g.indeg[ids]
        self.node_now[ids] = ph.times[ph.mix_at[ids]]
        if ph.then == STEP:
            self._step(ids)
        else:
            self.finished[ids] = True

    def _weights(self, graph: int) -> torch.Tensor:
        """The round's ``W - I`` over the parameter rows, as a sparse CSR tensor.

        Mixing adds ``(W - I) X`` to ``X``: each row's weights sum to exactly zero in
        the matrix's dtype, so the product moves each node by its neighbours'
        differences, as the per-node ``lerp_`` chain does. (``W`` itself in float32,
        whose weights such as 1/3 sum to 1 + 1e-7, would scale every node up by that
        much per round.)"""
        W = self._w[graph]
        if W is None:
            g = self.graphs[graph]
            self._rows = rows = np.asarray(self.batched.row_of, dtype=np.int64)
            matrix = self.batched.matrix
            dtype = torch.empty(0, dtype=matrix.dtype).numpy().dtype if matrix.dtype != torch.bfloat16 else np.float32
            v, u = np.asarray(g.w_rows), np.asarray(g.w_cols)
            w = np.asarray(g.w_vals, dtype=np.float64)
            off = v != u
            w_off = w[off].astype(dtype).astype(np.float64)  # the weights as the product will see them
            total = np.bincount(v, weights=w, minlength=self.n)
            diag = (total - 1.0) - np.bincount(v[off], weights=w_off, minlength=self.n)
            index = np.concatenate([np.stack([rows[v[off]], rows[u[off]]]), np.stack([rows, rows])], axis=1)
            values = torch.as_tensor(np.concatenate([w_off, diag]), dtype=matrix.dtype)
            W = torch.sparse_coo_tensor(torch.as_tensor(index), values, (self.n, self.n),
                                        check_invariants=True).coalesce()
            with warnings.catch_warnings():  # "sparse CSR support is in beta": the product below is all it does
                warnings.simplefilter("ignore", UserWarning)
                W = self._w[graph] = W.to_sparse_csr().to(matrix.device)
        return W

    def _sync(self) -> None:
        """Bring the nodes and the simulator up to date with the arrays (before anyone looks)."""
        sim = self.sim
        sim.bytes_sent[:] = self.bytes_sent.tolist()
        sim.bytes_received[:] = self.bytes_received.tolist()
        seq, rounds, mixed, now = self.seq.tolist(), self.rounds.tolist(), self.mixed.tolist(), self.node_now.tolist()
        finished = self.finished.tolist()
        for i, node in enumerate(sim.nodes):
            node.seq = seq[i]
            node.channels[0].round = rounds[i]
            node.mix_totals.mixed = mixed[i]
            node.now = now[i]
            sim.finished[i] = finished[i]
        used = self.busy > 0
        sim.network.busy_until.update(zip([self.pairs[j] for j in np.flatnonzero(used)], self.busy[used].tolist()))


def _static_refusal(sim: Any) -> str | None:
    """The first condition of the module docstring, other than the schedule's, that ``sim`` fails."""
    nodes = sim.nodes
    n = len(nodes)
    if sim.batched is None:
        return "local steps run per node"
    compute = sim.compute
    if compute.kind != "fixed":
        return f"the {compute.kind} compute model gives each step its own time (lockstep needs fixed:SECONDS)"
    if any(f != 1.0 for f in compute.slow.values()):
        return "slow nodes (slow=...) end their steps at other times than the rest"
    if sim.on_step is not None and sim.step_every % n:
        return f"the observation hook runs every {sim.step_every} node-steps, not a multiple of the {n} nodes"
    if sim.steps_done or sim.now or any(sim.finished) or sim.network._group:
        return "the simulation has already started"
    for name, link in sim.network.links.items():
        for what in ("jitter", "loss", "drop", "down"):
            if getattr(link, what):
                return f"{name} links have {what} (lockstep needs a deterministic, lossless network)"
    first = nodes[0]
    for i, node in enumerate(nodes):
        if len(node.channels) != 1:
            return "link policies give the nodes more than one mixing channel"
        rule = node.channels[0].rule
        if type(rule) is not GossipRule:
            return (f"node {i} mixes with {type(rule).__name__} ({rule.name}); lockstep runs synchronous exact "
                    "gossip (D-PSGD) only")
        if rule.codec.name != "identity":
            return f"node {i} compresses with {rule.codec.spec}; lockstep needs exact messages"
        if rule.clip is not None:
            return "clipped gossip depends on each neighbour's distance"
        if rule.overlap or node.config.live_sends:
            return "overlap mixes a round one exchange later"
        cfg = node.config
        if (cfg.steps, cfg.period, cfg.timeout) != (first.config.steps, first.config.period, first.config.timeout):
            return "the nodes have different steps, periods or timeouts"
        if node.channels[0].topology is not first.channels[0].topology or (
                node.members is not first.members and node.members != first.members):
            return "the nodes do not share one topology over members 0..n-1"
        if node.step or node.round:
            return "the nodes have already trained"
    if first.members != list(range(n)):
        return "the nodes' members are not 0..n-1"
    if first.config.steps < 1:
        return "there are no steps to run"
    topology = first.channels[0].topology
    for r in range(topology.period):
        for v in range(n):
            if len(topology.in_weights(v, r)) < 2:
                return f"node {v} has no in-neighbour in round {r} of the topology (it would mix without waiting)"
    return None


def lockstep_refusal(sim: Any) -> str | None:
    """Why ``sim`` (a fresh :class:`~gossip.sim.engine.Simulator` with a batched engine)
    cannot run in lockstep, or None when it can."""
    try:
        Lockstep(sim)
    except LockstepRefused as e:
        return str(e)
    return None


def choose_lockstep(engine: str, sim: Any, note: str) -> tuple[Lockstep | None, str]:
    """Whether ``sim`` runs in lockstep: ``(Lockstep or None, why)``.

    engine : the engine asked for; ``"lockstep"`` raises ValueError with the reason
        when the run does not qualify, ``"auto"`` then keeps the engine chosen so
        far and says why, ``"batched"`` and ``"per-node"`` never run in lockstep
    note : why the engine chosen so far was chosen (:func:`gossip.sim.batched.choose_engine`)
    """
    if engine not in ("auto", "lockstep"):
        return None, note
    try:
        return Lockstep(sim), "lockstep"
    except LockstepRefused as e:
        if engine == "lockstep":
            raise ValueError(f"engine 'lockstep' cannot run this simulation: {e} "
                             "(use engine auto, batched or per-node)") from None
        if sim.batched is None:
            return None, note
        log.info("running the batched engine, not in lockstep: %s", e)
        return None, f"batched; not in lockstep: {e}"
