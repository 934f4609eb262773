"""A simulated run that can be advanced piece by piece: :class:`Simulation`."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import IO, Any

from gossip.core.progress import ProgressBar
from gossip.mixing.adversary import parse_byzantine
from gossip.mixing.settings import build_rules
from gossip.sim.batched import choose_engine
from gossip.sim.config import SimConfig, torch_threads, world_of
from gossip.sim.engine import Simulator
from gossip.sim.lockstep import choose_lockstep
from gossip.sim.record import Recorder, SimulationResult, open_out, summarize
from gossip.training.node import Node, NodeConfig
from gossip.training.tasks import get_task
from gossip.transport.links import SimNetwork

__all__ = ["Simulation", "build_node", "build_nodes"]


def build_node(cfg: SimConfig, task: Any, topology: Any, i: int, members: list[int]) -> Node:
    """Simulated node ``i``: id i, data shard i, mixing rules of its own."""
    # in-process peers run this same node code and never send non-finite values
    mixing = cfg.mixing
    node_cfg = NodeConfig(cfg.steps, mixing.period, float(cfg.timeout), check_payloads=False, overlap=mixing.overlap)
    # a misbehaving node of a robustness experiment sends scaled parameters on every link class
    rule, per_class = build_rules(mixing, topology, sender_scale=parse_byzantine(cfg.byzantine, cfg.nodes).get(i))
    return Node(i, members, topology, task, rule, node_cfg, seed=cfg.seed, split=cfg.split, rank=i,
                world_size=cfg.nodes, device=cfg.device, policies=per_class)


def build_nodes(cfg: SimConfig, task: Any, topology: Any) -> list[Node]:
    """The simulated nodes: ids and indices 0..n-1."""
    members = list(range(cfg.nodes))
    return [build_node(cfg, task, topology, i, members) for i in members]


class Simulation:
    """A simulated run that can be advanced piece by piece.

    ``simulate()`` is ``Simulation(cfg).run().result()``. Use the object directly
    to stop at a simulated time, look at (or change) the nodes, and continue:

    >>> sim = Simulation(SimConfig(nodes=4, steps=50))  # doctest: +SKIP
    >>> sim.run(until=0.2)                              # doctest: +SKIP
    >>> sim.nodes[0].step                               # doctest: +SKIP
    >>> sim.run().result().summary["final_accuracy"]    # doctest: +SKIP

    The torch thread count is set to ``config.threads`` only while ``run`` works.
    Call :meth:`close` (or use ``with``) to close a metrics file opened from a path.

    A config with ``faults`` makes a :class:`gossip.sim.fault_runs.FaultSimulation`
    instead (the real control plane of every node; same methods and result).
    """

    def __new__(cls, config: SimConfig | None = None, *, out: str | Path | IO[str] | None = None,
                progress: bool | None = False, **overrides: Any) -> Any:
        cfg = dataclasses.replace(config, **overrides) if config is not None else SimConfig(**overrides)
        if cfg.faults:
            from gossip.sim.fault_runs import FaultSimulation

            return FaultSimulation(cfg, out=out, progress=progress)
        self = super().__new__(cls)
        self.config = cfg
        return self

    def __init__(self, config: SimConfig | None = None, *, out: str | Path | IO[str] | None = None,
                 progress: bool | None = False, **overrides: Any) -> None:
        from topologies import build

        cfg = self.config
        self.wall_start = time.perf_counter()
        self.task = get_task(cfg.task)
        self.topology = build(cfg.topology, cfg.nodes, seed=cfg.seed)
        links, compute = world_of(cfg)
        self.network = SimNetwork(links, self.topology.link, seed=cfg.seed)
        with torch_threads(cfg.threads):
            self.nodes = build_nodes(cfg, self.task, self.topology)
            # the batched engine moves every node's parameters onto a row of one matrix
            self.batched, self.engine_note = choose_engine(cfg.engine, self.task, self.nodes, compute.kind == "measured")
            self._out, self._close = open_out(out)
            self.bar = ProgressBar(cfg.steps, enabled=progress)
            self.recorder = Recorder(cfg, self.task, self.network, self._out, self.bar, self.wall_start)
            # the hook runs at every sample point, or once per mean step when a progress bar is drawn
            every = self.recorder.every * cfg.nodes if not self.bar.enabled else cfg.nodes
            self.sim = Simulator(self.nodes, self.network, compute, seed=cfg.seed, on_step=self.recorder.on_step,
                                 step_every=every, batched=self.batched)
            # synchronous exact gossip with every node in step: whole rounds at once (gossip.sim.lockstep)
            self.sim.lockstep, self.engine_note = choose_lockstep(cfg.engine, self.sim, self.engine_note)
            # auto's lockstep is provisional until the first run(): see run()
            self._provisional = cfg.engine == "auto" and self.sim.lockstep is not None

    @property
    def engine(self) -> str:
        """The engine that runs: ``lockstep``, ``batched`` or ``per-node`` (``engine_note`` says why)."""
        return "lockstep" if self.sim.lockstep is not None else "per-node" if self.batched is None else "batched"

    @property
    def now(self) -> float:
        """Simulated seconds so far."""
        return self.sim.now

    @property
    def done(self) -> bool:
        return self.sim.done

    def run(self, until: float | None = None) -> "Simulation":
        """Advance to simulated time ``until`` (or to the end); returns self.

        With ``engine="auto"``, lockstep (which cannot follow a network, fault or
        node changed mid-run) is kept only for a run that goes to the end from its
        first call and that nothing changed before it; a first call with ``until``
        (to look at or disturb the nodes mid-run) runs the batched event loop from
        the start instead, and ``engine_note`` says so."""
        if self._provisional:
            self._provisional = False
            reason = ("run piecewise with run(until=...), and the network may change between the pieces"
                      if until is not None else self.sim.lockstep.changed())
            if reason is not None:
                self.sim.lockstep = None
                self.engine_note = f"batched; not in lockstep: {reason}"
        with torch_threads(self.config.threads):
            self.sim.run(until)
        return self

    def result(self) -> SimulationResult:
        """The final figures; runs to the end first if needed (and writes the summary line)."""
        if not self.sim.done:
            self.run()
        cfg, rec, sim, network = self.config, self.recorder, self.sim, self.network
        nodes = sim.nodes
        with torch_threads(cfg.threads):
            if not rec.history or rec.last_sample != sim.steps_done:
                rec.sample(sim)
        self.bar.close()
        last = rec.history[-1]
        summary = summarize(cfg, self.topology.spec, last, nodes, network, sum(sim.bytes_sent),
                            engine=self.engine, engine_note=self.engine_note, sim_time_s=sim.now,
                            wall_time_s=time.perf_counter() - self.wall_start)
        if self._out is not None:
            self._out.write(json.dumps({"event": "summary", **summary}) + "\n")
            self._out.flush()
        self.close()
        return SimulationResult(cfg, rec.history, summary, [n.state.snapshot().cpu() for n in sim.nodes])

    def close(self) -> None:
        if self._close and self._out is not None:
            self._out.close()
            self._out = None

    def __enter__(self) -> "Simulation":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
