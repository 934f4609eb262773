"""Simulated runs with faults: every node's real control plane, on the virtual clock.

``gossip.simulate(..., faults=[...])`` and ``gossip-sim --fault ...`` run here. A
fault acts only on processes and links, as on real machines; membership, failure
detection, leave rounds, joins with a state pull and the merge of healed
partitions are the protocol's own (:mod:`gossip.protocol.control`, :mod:`gossip.protocol.lifecycle`,
:mod:`gossip.protocol.joining`), run by :class:`gossip.sim.cluster.SimCluster`: one
``gossip-node`` lifecycle per node, real encoded wire frames over the modelled
links. The fault-free engines (:mod:`gossip.sim.engine`) never see a fault.

What the :class:`~gossip.sim.config.SimConfig` becomes, per node (a
:class:`~gossip.protocol.config.PeerConfig`, as ``gossip-node`` would be configured):

* ``task``, ``topology`` (a spec string), ``mixing`` (the same settings object:
  algorithm, codec, period, outer optimizer, ...), ``split``, ``steps``,
  ``timeout``, ``device`` as given; ``seed`` is every node's model and data seed (the
  fault-free engines' seed) and the links' draws; node ``i`` trains on shard ``i`` of
  ``nodes`` (``rank``/``world_size``), its datacenter label is the topology's
  (``hierarchical``: links between labels use ``inter_link``);
* ``compute`` (and ``slow``) give each local step its simulated time; ``link`` is
  every link's model;
* every node names every node up at time 0 as ``--peers`` (a late joiner reaches
  whoever is up);
* ``detect`` (seconds) is the failure detector's timing
  (:meth:`Timing.from_detect <gossip.protocol.timing.Timing.from_detect>`):
  ``dead_after = detect``, ``heartbeat = detect / 4``, ``settle`` one heartbeat (the
  start-up: discovery, then a stable member set this long), ``grace = 2.5 * detect``,
  ``join_timeout = 20 * detect`` (at least 1 s), ``start_hold`` five heartbeats,
  and ``join_margin`` the rounds a heartbeat lasts (2 to 20);
* ``detector`` names the nodes' failure detector (``gossip-node --detector``).

The faults (:mod:`gossip.sim.faults`): ``crash:N@T`` kills process N (no goodbye);
``join:N@T`` starts it (a late first start when its first fault is a join, else a
fresh process after its crash, with no checkpoint: it joins and pulls a member's
state); ``partition:A|B@T1-T2`` cuts the network between the groups from T1 and
heals it at T2.

Start-up is real too: nodes discover each other and wait ``settle`` before the
first step, so training starts a little after time 0 (a fault-free run starts at 0).
The run ends when every process has exited and no fault is left: a fault
scheduled after that still moves the clock to its time, and a node started
after the others finished finds nobody, waits ``join_timeout`` and trains
alone from the initial model, as a real one would.
Bytes count the control traffic (pings, member lists, state transfer) with the
gossip.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import IO, Any

from gossip.core.progress import ProgressBar
from gossip.protocol.timing import Timing
from gossip.sim.cluster import FAULT, SimCluster, SimProcess
from gossip.sim.config import SimConfig, torch_threads, world_of
from gossip.sim.faults import parse_faults
from gossip.sim.record import Recorder, SimulationResult, open_out, summarize

__all__ = ["FaultSimulation"]

ENGINE = "protocol"

log = logging.getLogger("gossip.simfaults")


class FaultSimulation:
    """A simulated run with faults on the real control plane; what
    :class:`gossip.sim.simulation.Simulation` makes for a config with ``faults``.

    The same methods (``run(until=)``, ``result()``, ``now``, ``done``, ``engine``,
    ``close``) and the same :class:`~gossip.sim.record.SimulationResult`; ``cluster`` is the
    :class:`~gossip.sim.cluster.SimCluster` (its processes, their lifecycles and logs)
    and ``nodes`` each index's current node (None before its first start).
    """

    def __init__(self, cfg: SimConfig, *, out: str | Path | IO[str] | None = None, progress: bool | None = False) -> None:
        from gossip.training.tasks import get_task
        from topologies import build

        self.config = cfg
        self.wall_start = time.perf_counter()
        if not isinstance(cfg.topology, str):
            raise ValueError("faults need a topology spec string (the real nodes each build the graph from it); "
                             f"got a {type(cfg.topology).__name__}")
        if cfg.engine not in ("auto", "per-node"):
            raise ValueError(f"engine {cfg.engine!r} cannot run a simulation with faults: faults run every node's "
                             "real control plane, one model at a time (engine 'auto' or 'per-node')")
        if cfg.byzantine:
            raise ValueError("byzantine nodes cannot be combined with faults (real nodes have no byzantine option)")
        links, compute = world_of(cfg)
        if compute.kind == "measured":
            raise ValueError("the measured compute model cannot be combined with faults: give step times "
                             "(fixed:SEC, lognormal:MEAN,CV or exponential:MEAN)")
        self.faults = parse_faults(cfg.faults, cfg.nodes)
        self.task = get_task(cfg.task)
        self.topology = build(cfg.topology, cfg.nodes, seed=cfg.seed)
        dcs = [self.topology.dc(i) for i in range(cfg.nodes)]
        labels = [f"dc{d:03d}" for d in dcs] if len(set(dcs)) > 1 else None
        sampler = compute.sampler(cfg.seed)
        self.timing = Timing.from_detect(cfg.detect, cfg.mixing.period * compute.mean)
        first: dict[int, str] = {}
        for ev in self.faults:
            if ev.kind in ("crash", "join"):
                first.setdefault(ev.node, ev.kind)
        late = sorted(i for i, kind in first.items() if kind == "join")  # absent until their join
        starters = [i for i in range(cfg.nodes) if i not in late]
        n = cfg.nodes

        def configure(i: int) -> dict[str, Any]:
            own: dict[str, Any] = {"rank": i, "world_size": n}
            if labels is not None:
                own["dc"] = labels[i]
            return own

        with torch_threads(cfg.threads):
            self.cluster = c = SimCluster(
                n, steps=cfg.steps, seed=cfg.seed, model_seed=cfg.seed, link=links["intra"],
                inter_link=links["inter"] if labels is not None else None,
                step_time=lambda i: sampler(i, 0.0), peers=lambda i: starters, late=late, configure=configure,
                device=cfg.device, task=self.task, topology=cfg.topology, mixing=cfg.mixing, split=cfg.split,
                timeout=float(cfg.timeout), detector=cfg.detector, timing=self.timing)
        for ev in self.faults:
            if ev.kind == "crash":
                c.crash(ev.node, at=ev.time)
            elif ev.kind == "join":
                c.start(ev.node, at=ev.time)
            elif ev.kind == "partition":
                c.partition([list(g) for g in ev.groups], at=ev.time)
            else:
                c.heal(at=ev.time)
        self._skip = len(starters)  # the log's first entries: the starts at time 0
        # long enough for every node to finish, however the faults fall; a run still going
        # then has a node that never finished (see result()["exits"])
        slowest = max([1.0, *compute.slow.values()]) * compute.mean * (1 + 3 * compute.cv)
        last = max([0.0, *(ev.time for ev in self.faults)])
        self.horizon = last + 10 * cfg.steps * slowest + 10 * (self.timing.join_timeout + cfg.timeout) + 60.0
        self._out, self._close = open_out(out)
        self.bar = ProgressBar(cfg.steps, enabled=progress)
        with torch_threads(cfg.threads):
            self.recorder = Recorder(cfg, self.task, c.network, self._out, self.bar, self.wall_start)
        self._next = self.recorder.every
        c.on_step = self._on_step
        self.engine_note = "protocol: faults run every node's real control plane (gossip.sim.cluster)"
        self._done = False

    engine = ENGINE  # what runs: the real protocol (``engine_note`` says so)

    # -- what the recorder sees ------------------------------------------------------------
    @staticmethod
    def _counts(p: SimProcess) -> bool:
        """Whether process ``p``'s node counts: it trains (or finished) in a life that is not dead."""
        life = p.life
        return life is not None and life.node is not None and life.status in ("training", "done") \
            and (p.up or p.exit == "done")

    def live(self) -> list[Any]:
        """The nodes of the processes that train now (or finished)."""
        return [p.life.node for p in self.cluster.procs if self._counts(p)]

    @property
    def nodes(self) -> list[Any]:
        """Each index's current (or last) node; None before it first built one."""
        return [p.life.node if p.life is not None else None for p in self.cluster.procs]

    def _sample(self) -> dict[str, Any] | None:
        live = self.live()
        if not live:
            return None
        c = self.cluster
        return self.recorder.record(c.now, sum(n.step for n in live) / len(live), live,
                                    sum(c.network.bytes_by_class.values()))

    def _on_step(self, p: SimProcess) -> None:
        live = self.live()
        mean = sum(n.step for n in live) / len(live) if live else 0.0
        if mean >= self._next:
            self._next = (math.floor(mean / self.recorder.every) + 1) * self.recorder.every
            self.recorder.progress(mean, self.cluster.now, self._sample())
        else:
            self.recorder.progress(mean, self.cluster.now)

    # -- running ---------------------------------------------------------------------------
    @property
    def now(self) -> float:
        return self.cluster.now

    @property
    def done(self) -> bool:
        return self._done

    def run(self, until: float | None = None) -> "FaultSimulation":
        """Advance to simulated time ``until`` (or until every process has exited)."""
        c = self.cluster
        with torch_threads(self.config.threads):
            c.run(until=self.horizon if until is None else min(until, self.horizon))
        self._done = not any(p.up for p in c.procs) and not any(e[2] == FAULT for e in c.events) \
            or c.now >= self.horizon
        if c.now >= self.horizon and any(p.up for p in c.procs):
            log.warning("the simulation with faults stopped at its horizon, %.0f simulated seconds, with processes "
                        "still running: %s", self.horizon, ", ".join(str(p.index) for p in c.procs if p.up))
        return self

    def faults_applied(self) -> list[str]:
        """The faults applied so far, as ``"1.000s crash 3"``: the cluster logs each
        scheduled one when it acts, after the starts at time 0, in the schedule's order."""
        return [f"{t:.3f}s {_label(ev)}" for (t, _), ev in zip(self.cluster.log[self._skip:], self.faults)]

    def result(self) -> Any:
        """The final figures; runs to the end first if needed (and writes the summary line)."""
        if not self._done:
            self.run()
        cfg, c, rec = self.config, self.cluster, self.recorder
        with torch_threads(cfg.threads):
            if not rec.history or rec.history[-1]["time"] != c.now:
                self._sample()
        self.bar.close()
        if not rec.history:
            raise RuntimeError("no node ever trained in this simulation with faults; process exits: "
                               + ", ".join(f"{p.index}: {p.exit}" for p in c.procs))
        nodes = [p.life.node for p in c.procs if p.life is not None and p.life.node is not None]
        lives = [life for p in c.procs if p.life is not None for life in [p.life]]
        summary = summarize(
            cfg, self.topology.spec, rec.history[-1], nodes, c.network, sum(c.network.bytes_by_class.values()),
            faults=self.faults_applied(), engine=self.engine, engine_note=self.engine_note, sim_time_s=c.now,
            wall_time_s=time.perf_counter() - self.wall_start)
        summary.update({
            "exits": [p.exit if not p.up else "running" for p in c.procs],
            "rejoins": sum(life.rejoins for life in lives), "merges": sum(life.merges for life in lives),
            "timed_out_rounds": sum(life.timed_out_rounds for life in lives),
            "detector": {"name": cfg.detector,
                         **{k: getattr(self.timing, k) for k in ("dead_after", "heartbeat", "settle", "join_margin")}},
        })
        if self._out is not None:
            import json

            self._out.write(json.dumps({"event": "summary", **summary}) + "\n")
            self._out.flush()
        self.close()
        init = None
        params = []
        for p in c.procs:
            node = p.life.node if p.life is not None else None
            if node is None:  # never started: the initial model
                if init is None:
                    from gossip.core.state import FlatState
                    from gossip.training.node import init_model

                    init = FlatState(init_model(self.task, cfg.seed, "cpu")).snapshot().cpu()
                params.append(init.clone())
            else:
                params.append(node.state.snapshot().cpu())
        return SimulationResult(cfg, rec.history, summary, params)

    def close(self) -> None:
        if self._close and self._out is not None:
            self._out.close()
            self._out = None

    def __enter__(self) -> "FaultSimulation":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _label(ev: Any) -> str:
    """A fault as the summary names it: ``crash 3``, ``join 3``, ``partition 0-3|4-7``, ``heal``."""
    if ev.kind == "partition":
        return "partition " + "|".join(_ranges(list(g)) for g in ev.groups)
    return ev.kind if ev.kind == "heal" else f"{ev.kind} {ev.node}"


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 3, 7] -> "0-3,7" (the fault grammar's groups)."""
    out, k = [], 0
    while k < len(ids):
        j = k
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[k]) if j == k else f"{ids[k]}-{ids[j]}")
        k = j + 1
    return ",".join(out)

