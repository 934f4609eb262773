"""The discrete-event simulator: many nodes, one process, a virtual clock.

The simulator is a driver for :meth:`gossip.training.node.Node.program` plus a network
model; it contains no gossip algorithm of its own. Events are a node finishing
a local step (its compute time drawn from a :class:`ComputeModel`), a message
arriving (from :class:`~gossip.transport.links.SimNetwork`), and a wait timing
out. Ties are broken by insertion order, so a run is a pure function of its seed.

It runs fault-free simulations only: a run with faults (crashes, joins,
partitions) runs every node's real control plane instead (:mod:`gossip.sim.fault_runs`
on :class:`gossip.sim.cluster.SimCluster`), so that membership, detection, joins
and merges are the protocol's, not a model of it.
"""

from __future__ import annotations

import heapq
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from gossip.core.actions import Compute, Send, Wait
from gossip.training.node import Node
from gossip.transport.links import SimNetwork
from gossip.transport.wire import message_size, same_header_size

__all__ = ["ComputeModel", "parse_compute", "parse_slow", "Simulator"]

RESUME, DELIVER, TIMEOUT = 0, 1, 2
STEP = 1  # RESUME data: STEP when a local step just completed, else 0


@dataclass(frozen=True)
class ComputeModel:
    """How long one local step takes on each node, in simulated seconds.

    kind : "fixed" (always ``mean``), "lognormal" (mean ``mean``, coefficient of
        variation ``cv``), "exponential" (mean ``mean``) or "measured" (the wall
        time the step really took, times ``scale``)
    slow : node index -> slowdown factor (heterogeneous hardware)
    """

    kind: str = "fixed"
    mean: float = 0.01
    cv: float = 0.0
    scale: float = 1.0
    slow: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "lognormal", "exponential", "measured"):
            raise ValueError(f"unknown compute model {self.kind!r}; valid: fixed, lognormal, exponential, measured")
        if not (self.mean > 0 and math.isfinite(self.mean)):
            raise ValueError(f"compute time must be a positive number of seconds, got {self.mean!r}")
        if not self.cv >= 0:
            raise ValueError(f"compute cv must be >= 0, got {self.cv!r}")
        for node, factor in self.slow.items():
            if not (factor > 0 and math.isfinite(factor)):
                raise ValueError(f"slowdown of node {node} must be a positive number, got {factor!r}")

    def sampler(self, seed: int) -> Callable[[int, float], float]:
        """A function (node, measured wall seconds) -> simulated seconds."""
        rng = np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, 0xC0DE]))
        slow = self.slow
        if self.kind == "fixed":
            return lambda i, wall: self.mean * slow.get(i, 1.0)
        if self.kind == "measured":
            return lambda i, wall: wall * self.scale * slow.get(i, 1.0)
        if self.kind == "exponential":
            return lambda i, wall: rng.exponential(self.mean) * slow.get(i, 1.0)
        sigma2 = math.log1p(self.cv**2)
        mu = math.log(self.mean) - sigma2 / 2
        sigma = math.sqrt(sigma2)
        return lambda i, wall: float(rng.lognormal(mu, sigma)) * slow.get(i, 1.0)


def parse_compute(spec: str | ComputeModel | None, slow: dict[int, float] | None = None) -> ComputeModel:
    """Parse ``fixed:0.01``, ``lognormal:0.01,0.3``, ``exponential:0.01`` or ``measured[:SCALE]``."""
    if isinstance(spec, ComputeModel):
        return spec if slow is None else ComputeModel(spec.kind, spec.mean, spec.cv, spec.scale, dict(slow))
    spec = (spec or "fixed:0.01").strip()
    kind, _, args = spec.partition(":")
    nums: list[float] = []
    for a in filter(None, args.split(",")):
        try:
            nums.append(float(a))
        except ValueError:
            raise ValueError(f"compute spec {spec!r}: {a!r} is not a number") from None
    slow = dict(slow or {})
    if kind == "fixed" and len(nums) <= 1:
        return ComputeModel("fixed", nums[0] if nums else 0.01, slow=slow)
    if kind == "lognormal" and len(nums) <= 2:
        return ComputeModel("lognormal", nums[0] if nums else 0.01, nums[1] if len(nums) > 1 else 0.3, slow=slow)
    if kind == "exponential" and len(nums) <= 1:
        return ComputeModel("exponential", nums[0] if nums else 0.01, slow=slow)
    if kind == "measured" and len(nums) <= 1:
        return ComputeModel("measured", 0.01, scale=nums[0] if nums else 1.0, slow=slow)
    raise ValueError(f"bad compute spec {spec!r}; valid: fixed:SECONDS, lognormal:MEAN,CV, exponential:MEAN, "
                     "measured[:SCALE]")


def parse_slow(spec: str | dict[int, float] | None) -> dict[int, float]:
    """Parse ``3=5,7=2.5`` (node 3 five times slower, node 7 2.5 times)."""
    if spec is None or spec == "":
        return {}
    if isinstance(spec, dict):
        return {int(k): float(v) for k, v in spec.items()}
    out: dict[int, float] = {}
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*[=:x]\s*([0-9.eE+-]+)\s*", item)
        if not m:
            raise ValueError(f"slow-node spec {spec!r}: expected NODE=FACTOR items, e.g. 3=5,7=2")
        out[int(m.group(1))] = float(m.group(2))
    return out


def _int_bytes(v: Any) -> int:
    """Which msgpack width a non-negative int takes (-1: not one, do not memoise)."""
    if type(v) is not int or v < 0:
        return -1
    return 0 if v < 128 else 1 if v < 256 else 2 if v < 65536 else 3 if v < 4294967296 else 4


class MessageSizes:
    """:func:`gossip.transport.wire.message_size`, memoised by everything that decides it.

    A message's size depends on the lengths of its header fields, not on their
    values: the same strings, the same payload size and integers of the same
    msgpack width (a push-sum weight is always a 9-byte float) give the same
    bytes. Messages with codec metadata or extra fields (CHOCO's numbering and
    resync requests) are measured every time.
    """

    def __init__(self) -> None:
        self._known: dict[tuple, int] = {}

    def __call__(self, msg: Any) -> int:
        data = msg.data
        if data is None or data.meta or msg.extra or len(data.buffers) != 1:
            return message_size(msg)
        widths = (_int_bytes(msg.seq), _int_bytes(msg.round), _int_bytes(msg.progress))
        if -1 in widths:
            return message_size(msg)
        key = (msg.kind, msg.sender, msg.fingerprint, msg.weight is None, data.codec, data.dtype, data.numel,
               data.nbytes, widths)
        size = self._known.get(key)
        if size is None:
            size = self._known[key] = message_size(msg)
        return size


class Simulator:
    """Advance ``nodes`` over ``network`` on one virtual clock.

    Parameters
    ----------
    nodes : the nodes; node i must have id i and index i
    network : the modelled links
    compute : step-time model
    on_step : called as ``on_step(sim)`` after every ``step_every``-th completed
        local step (counted over all nodes): the observation hook for metrics
        and progress
    batched : a :class:`gossip.sim.batched.BatchedSteps` the nodes' local steps are
        deferred to; the simulator runs the steps asked for (``flush``) before a
        node that asked resumes, before ``on_step`` looks at the nodes, and
        whenever :meth:`run` returns

    Set :attr:`lockstep` (a :class:`gossip.sim.lockstep.Lockstep` over this simulator)
    before the first :meth:`run` to advance every node a phase at a time instead
    of event by event.
    """

    def __init__(self, nodes: Sequence[Node], network: SimNetwork, compute: ComputeModel, *, seed: int = 0,
                 on_step: Callable[["Simulator"], None] | None = None, step_every: int = 1,
                 batched: Any = None) -> None:
        self.nodes = list(nodes)
        self.batched = batched  # a gossip.sim.batched.BatchedSteps running the nodes' local steps, or None
        self.lockstep: Any = None  # a gossip.sim.lockstep.Lockstep advancing every node at once, or None
        self.compute = compute
        self._size_of = MessageSizes()
        self.network = network
        self.compute_time = compute.sampler(seed)
        self.measure = compute.kind == "measured"
        self.on_step = on_step
        self.step_every = max(1, int(step_every))
        self.now = 0.0
        self.events: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        self._gens = [n.program() for n in self.nodes]
        self._primed = [False] * len(self.nodes)
        self._waiting = [False] * len(self.nodes)
        self._deadline = [0.0] * len(self.nodes)
        self._timer_pending = [False] * len(self.nodes)
        self.finished = [False] * len(self.nodes)
        self.steps_done = 0
        self.bytes_sent = [0] * len(self.nodes)
        self.bytes_received = [0] * len(self.nodes)
        for i, n in enumerate(self.nodes):
            if n.index != i:
                raise ValueError(f"node {i} has topology index {n.index}; simulated nodes must be numbered 0..n-1")
        for i in range(len(self.nodes)):
            self._push(0.0, RESUME, i, 0)

    def _push(self, t: float, kind: int, node: int, data: Any) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, node, data))

    def _advance(self, i: int) -> None:
        """Run node i's program until it needs time to pass."""
        gen = self._gens[i]
        now = self.now
        measure = self.measure
        while True:
            if measure:
                t0 = time.perf_counter()
            try:
                if self._primed[i]:
                    action = gen.send(now)
                else:  # a fresh generator must be started with next()
                    self._primed[i] = True
                    action = next(gen)
            except StopIteration:
                self.finished[i] = True
                return
            kind = type(action)
            if kind is Compute:
                wall = time.perf_counter() - t0 if measure else 0.0
                self._push(now + self.compute_time(i, wall), RESUME, i, STEP)
                return
            if kind is Send:
                size, sized = 0, None
                for dst, msg in action.messages:
                    if msg is not sized and (sized is None or not same_header_size(msg, sized)):
                        size = self._size_of(msg)
                    sized = msg
                    self.bytes_sent[i] += size
                    arrival = self.network.transmit(i, dst, size, now)
                    if arrival is not None:
                        self._push(arrival, DELIVER, dst, (msg, size))
                continue
            if kind is Wait:  # the node checked ready() just before yielding this
                self._waiting[i] = True
                self._deadline[i] = now + action.timeout
                if not self._timer_pending[i]:
                    # At most one timer per node is queued: deliveries usually end a wait
                    # long before its timeout, so a timer that fires early is re-armed
                    # for the current deadline instead of piling up stale heap entries.
                    self._timer_pending[i] = True
                    self._push(self._deadline[i], TIMEOUT, i, None)
                return
            raise TypeError(f"node {i} yielded {action!r}")

    def run(self, until: float | None = None) -> None:
        """Process events until every node has finished (or simulated time ``until``)."""
        try:
            if self.lockstep is not None:
                self.lockstep.run(until)
            else:
                self._run(until)
        finally:
            if self.batched is not None:
                self.batched.flush()  # whoever looks next sees every step asked for

    def _run(self, until: float | None) -> None:
        events = self.events
        batched = self.batched
        while events:
            if until is not None and events[0][0] > until:
                self.now = until
                return
            t, _, kind, i, data = heapq.heappop(events)
            if kind == TIMEOUT:
                self._timer_pending[i] = False
                if not self._waiting[i]:
                    continue  # the wait it was armed for ended with a delivery
                if t < self._deadline[i]:  # armed for an earlier wait: re-arm for this one
                    self._timer_pending[i] = True
                    self._push(self._deadline[i], TIMEOUT, i, None)
                    continue
            if kind == DELIVER and self.finished[i]:
                msg, size = data
                self.bytes_received[i] += size
                continue  # does not move the clock: nobody is left to act on it
            self.now = t
            if kind == RESUME:
                if data >= STEP:  # a local step just completed
                    if batched is not None and batched.asked[i]:
                        batched.flush()  # node i reads its parameters next: run the steps due
                    self.steps_done += 1
                    if self.on_step is not None and self.steps_done % self.step_every == 0:
                        if batched is not None:
                            batched.flush()
                        self.on_step(self)
                self._advance(i)
            elif kind == DELIVER:
                node = self.nodes[i]
                msg, size = data
                self.bytes_received[i] += size
                node.deliver(msg)
                if self._waiting[i] and node.ready():
                    self._waiting[i] = False
                    self._advance(i)
            else:  # TIMEOUT
                self._waiting[i] = False
                self._advance(i)

    @property
    def done(self) -> bool:
        return all(self.finished)
