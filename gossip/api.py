"""The research entry point: :func:`simulate` runs one simulated training job.

>>> import gossip
>>> r = gossip.simulate(nodes=8, topology="ring", task="synthetic", steps=50)  # doctest: +SKIP
>>> r.summary["final_accuracy"]  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, IO

import torch

from gossip.batched import choose_engine, parse_engine
from gossip.data import parse_split
from gossip.detector import DEFAULT_DETECTOR, DETECTORS
from gossip.faults import parse_faults
from gossip.lockstep import choose_lockstep
from gossip.mixing.adversary import parse_byzantine
from gossip.mixing.settings import MixingSettings, build_rules, with_mixing_options
from gossip.node import Node, NodeConfig, init_model, resolve_device
from gossip.progress import ProgressBar
from gossip.simulator import ComputeModel, Simulator, parse_compute, parse_slow
from gossip.state import FlatState
from gossip.tasks import get_task
from gossip.transport.sim import LAN, WAN, SimNetwork, parse_link

__all__ = ["SimConfig", "MixingSettings", "Simulation", "SimulationResult", "simulate", "consensus_distance", "average_params"]


@with_mixing_options
@dataclass(frozen=True)
class SimConfig:
    """Everything that defines a simulated run. Every field has a sensible default.

    The mixing options live in ``mixing`` (a :class:`~gossip.mixing.settings.MixingSettings`);
    they may be given flat, ``SimConfig(compression="topk:0.01", period=4)``, and are
    merged into it at construction. The run is a pure function of this config: same
    config, same numbers.
    """

    # what is trained, by how many nodes, on which graph
    nodes: int = 8
    topology: Any = "ring"           # a spec string (see topologies.build) or a networkx graph
    # how nodes mix: one MixingSettings; its options (algorithm, compression, gamma, period,
    # asynchronous, staleness, overlap, clip, link_policy) are also accepted as flat keywords,
    # SimConfig(period=4, compression="int8"), and read back flat (cfg.period)
    mixing: MixingSettings | None = None
    byzantine: Any = None            # misbehaving nodes: {3: 1000} or "3=1000" (node 3 sends x1000)
    task: Any = "synthetic"          # synthetic | digits | module:attr | a task object
    split: str = "iid"               # iid | dirichlet:ALPHA
    steps: int = 200                 # local steps per node
    seed: int = 0
    # the modelled world
    link: Any = LAN                  # intra-datacenter link (LinkModel or spec string)
    inter_link: Any = WAN            # inter-datacenter link
    compute: Any = "fixed:0.01"      # step-time model (ComputeModel or spec string)
    slow: Any = None                 # {node: slowdown factor} or "3=5,7=2"
    timeout: float = 30.0            # how long a synchronous round waits (simulated seconds)
    faults: Any = None               # ["crash:3@1.0", "join:3@2.5", "partition:0-3|4-7@1-2"] (gossip.faults):
                                     # a run with faults runs every node's real control plane (gossip.simfaults)
    detect: float = 3.0              # with faults: the failure detector's dead_after (heartbeat detect/4; see
                                     # gossip.simfaults.detector_settings)
    detector: str = DEFAULT_DETECTOR # with faults: the nodes' failure detector (gossip-node --detector)
    # what is recorded
    eval_every: int = 0              # local steps between evaluations (0: about 20 points per run)
    device: str = "cpu"
    threads: int = 1                 # torch intra-op threads during the run (small models are fastest on 1)
    engine: str = "auto"             # auto | lockstep (whole rounds at once, gossip.lockstep) | batched (local
                                     # steps due together as one vectorised call, gossip.batched) | per-node;
                                     # with faults: auto or per-node (the real control plane, engine "protocol")

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"nodes must be a positive integer, got {self.nodes!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"steps must be a non-negative integer, got {self.steps!r}")
        if isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ValueError(f"eval_every must be a non-negative integer, got {self.eval_every!r}")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        if not (isinstance(self.detect, (int, float)) and self.detect >= 0):
            raise ValueError(f"detect must be a number of seconds >= 0, got {self.detect!r}")
        if self.detector not in DETECTORS:
            raise ValueError(f"detector must be one of {', '.join(DETECTORS)}, got {self.detector!r}")
        parse_faults(self.faults, self.nodes)
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads must be a positive integer, got {self.threads!r}")
        parse_engine(self.engine)
        parse_split(self.split)
        # the mixing settings were checked when they were made (a bad codec, gamma,
        # staleness or pairing fails there, not at the first round)
        parse_byzantine(self.byzantine, self.nodes)
        object.__setattr__(self, "device", str(resolve_device(str(self.device))))  # "auto" -> cpu or cuda:N

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "mixing":
                out.update(v.to_dict())
                continue
            out[f.name] = v if isinstance(v, (int, float, str, type(None))) else repr(v)
        return out


@dataclass
class SimulationResult:
    """What a simulation produced.

    history : one record per evaluation point (time, mean step, losses,
        consensus distance, accuracies, bytes)
    summary : the final figures (what ``gossip-sim --json`` prints)
    params : final flat parameters of each node (a list of CPU tensors; with faults, of
        each node's last life: a node that crashed for good holds its parameters then)
    """

    config: SimConfig
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    params: list[torch.Tensor] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        summary = self.__dict__.get("summary", {})
        if name in summary:
            return summary[name]
        raise AttributeError(name)


_BLOCK = 256  # nodes stacked at a time: a copy of every replica at once would cost more than the replicas


def average_params(flats: list[torch.Tensor]) -> torch.Tensor:
    """The exact average x_bar of the nodes' parameters."""
    if len(flats) <= _BLOCK:
        return torch.stack([f.detach() for f in flats]).mean(0)
    total = torch.zeros_like(flats[0], dtype=torch.float64)
    for lo in range(0, len(flats), _BLOCK):
        total += torch.stack([f.detach() for f in flats[lo:lo + _BLOCK]]).sum(0, dtype=torch.float64)
    return (total / len(flats)).to(flats[0].dtype)


def consensus_distance(flats: list[torch.Tensor]) -> float:
    """(1/n) sum_i ||x_i - x_bar||^2, computed in float64."""
    if len(flats) <= _BLOCK:
        X = torch.stack([f.detach().double() for f in flats])
        return float(((X - X.mean(0)) ** 2).sum(1).mean())
    mean = torch.zeros_like(flats[0], dtype=torch.float64)
    for lo in range(0, len(flats), _BLOCK):
        mean += torch.stack([f.detach() for f in flats[lo:lo + _BLOCK]]).sum(0, dtype=torch.float64)
    mean /= len(flats)
    total = 0.0
    for lo in range(0, len(flats), _BLOCK):
        X = torch.stack([f.detach() for f in flats[lo:lo + _BLOCK]]).double()
        total += float(((X - mean) ** 2).sum())
    return total / len(flats)


class _Recorder:
    """Samples a run every ``every`` mean local steps: the history records.

    Both engines use it: :class:`Simulation` (``sample``, from the simulator's
    ``on_step``) and the fault runs of :mod:`gossip.simfaults` (``record`` with the
    nodes of the processes that are up)."""

    def __init__(self, cfg: SimConfig, task: Any, network: SimNetwork, out: IO[str] | None,
                 bar: ProgressBar, wall_start: float) -> None:
        self.cfg, self.task, self.network, self.out, self.bar = cfg, task, network, out, bar
        self.n = cfg.nodes
        self.every = cfg.eval_every or max(1, cfg.steps // 20)
        self.history: list[dict[str, Any]] = []
        self.wall_start = wall_start
        self.scratch = init_model(task, cfg.seed, cfg.device)
        self.scratch_state = FlatState(self.scratch)
        self.last_sample = -1
        self.bad = parse_byzantine(cfg.byzantine, cfg.nodes)  # honest figures only

    def honest(self, nodes: list[Node]) -> list[Node]:
        """The nodes that count: byzantine ones are out."""
        return [n for i, n in enumerate(nodes) if i not in self.bad] or nodes

    def record(self, now: float, mean_step: float, live: list[Node], bytes_sent: int,
               batched: Any = None) -> dict[str, Any]:
        """The record of one evaluation point over the nodes ``live`` (written to ``out``)."""
        self.scratch_state.load_(average_params([n.state.flat for n in live]))
        avg = self.task.evaluate(self.scratch, self.cfg.device)
        # the batched engine evaluates every row in a few vectorised calls
        per_node = (batched.evaluate(live) if batched is not None else None) \
            or [self.task.evaluate(n.model, self.cfg.device) for n in live]
        train = [n.pop_mean_loss() for n in live]
        train = [x for x in train if not math.isnan(x)]
        rec = {
            "event": "eval",
            "time": now,
            "step": mean_step,
            "train_loss": sum(train) / len(train) if train else math.nan,
            "loss": avg["loss"],
            "accuracy": avg.get("accuracy", math.nan),
            "mean_node_loss": sum(p["loss"] for p in per_node) / len(per_node),
            "mean_node_accuracy": sum(p.get("accuracy", math.nan) for p in per_node) / len(per_node),
            "consensus_distance": consensus_distance([n.state.flat for n in live]),
            "nodes_up": len(live),
            "bytes_sent": bytes_sent,
            **{f"bytes_{cls}": b for cls, b in sorted(self.network.bytes_by_class.items())},
            "wall": time.perf_counter() - self.wall_start,
        }
        for k in ("perplexity",):
            if k in avg:
                rec[k] = avg[k]
        self.history.append(rec)
        if self.out is not None:
            self.out.write(json.dumps(rec) + "\n")
        return rec

    def sample(self, sim: Simulator) -> dict[str, Any]:
        return self.record(sim.now, sim.steps_done / self.n, self.honest(sim.nodes), sum(sim.bytes_sent),
                           getattr(sim, "batched", None))

    def progress(self, step: float, now: float, rec: dict[str, Any] | None = None) -> None:
        """Draw the progress bar at mean step ``step`` (with the accuracy of a record just taken)."""
        if rec is not None:
            self.bar.update(step, f"step {rec['step']:.0f}/{self.cfg.steps} sim {now:.2f}s "
                            f"acc {rec['accuracy']:.3f}", force=True)
        elif self.bar.enabled:
            self.bar.update(step, f"step {step:.0f}/{self.cfg.steps} sim {now:.2f}s")

    def on_step(self, sim: Simulator) -> None:
        done = sim.steps_done
        if done % (self.every * self.n) == 0:
            if done != self.last_sample:
                self.last_sample = done
                self.progress(done / self.n, sim.now, self.sample(sim))
        else:
            self.progress(done / self.n, sim.now)


def summarize(cfg: SimConfig, topology: str, last: dict[str, Any], nodes: list[Node], network: SimNetwork,
              bytes_sent: int, **figures: Any) -> dict[str, Any]:
    """The summary of a run (what ``gossip-sim --json`` prints): the config, the last
    record ``last``, the mixing figures of ``nodes``, and ``figures`` (faults, engine,
    engine_note, sim_time_s, wall_time_s, ...) in that order."""
    summary = {
        "nodes": cfg.nodes,
        "topology": topology,
        "algorithm": cfg.algorithm,
        "compression": cfg.compression,
        "period": cfg.period,
        "asynchronous": cfg.asynchronous,
        "overlap": cfg.overlap,
        "outer": str(cfg.mixing.outer),
        "task": cfg.task if isinstance(cfg.task, str) else type(cfg.task).__name__,
        "split": str(parse_split(cfg.split)),
        "steps": cfg.steps,
        "seed": cfg.seed,
        "final_accuracy": last["accuracy"],
        "mean_node_accuracy": last["mean_node_accuracy"],
        "final_loss": last["loss"],
        "mean_node_loss": last["mean_node_loss"],
        "train_loss": last["train_loss"],
        "consensus_distance": last["consensus_distance"],
        "bytes_sent": bytes_sent,
        "bytes_intra": network.bytes_by_class.get("intra", 0),
        "bytes_inter": network.bytes_by_class.get("inter", 0),
        "messages_lost": network.lost,
        "clipped": sum(getattr(ch.rule, "clipped", 0) for n in nodes for ch in n.channels),
        "faults": [],
        "missing_neighbors": sum(n.mix_totals.missing for n in nodes),
        "rejected": sum(sum(n.rejected.values()) for n in nodes),
        **figures,
    }
    if "perplexity" in last:
        summary["final_perplexity"] = last["perplexity"]
    for ch_index, ch in enumerate(nodes[0].channels):
        prefix = "" if ch.name == "all" else f"{ch.name}_"
        report = ch.rule.report()
        summary[prefix + "rule"] = report["rule"]
        if "gamma" in report:
            summary[prefix + "gamma"] = report["gamma"]
        for key in ("gaps", "resyncs", "superseded"):
            if key in report:
                summary[prefix + key] = sum(n.channels[ch_index].rule.report()[key] for n in nodes)
        if "mean_staleness" in report:
            summary[prefix + "mean_staleness"] = sum(
                n.channels[ch_index].rule.report()["mean_staleness"] for n in nodes) / len(nodes)
    return summary


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

    A config with ``faults`` makes a :class:`gossip.simfaults.FaultSimulation`
    instead (the real control plane of every node; same methods and result).
    """

    def __new__(cls, config: SimConfig | None = None, *, out: str | Path | IO[str] | None = None,
                progress: bool | None = False, **overrides: Any) -> Any:
        cfg = dataclasses.replace(config, **overrides) if config is not None else SimConfig(**overrides)
        if cfg.faults:
            from gossip.simfaults import FaultSimulation

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
        with _threads(cfg.threads):
            self.nodes = build_nodes(cfg, self.task, self.topology)
            # the batched engine moves every node's parameters onto a row of one matrix
            self.batched, self.engine_note = choose_engine(cfg.engine, self.task, self.nodes, compute.kind == "measured")
            self._out, self._close = open_out(out)
            self.bar = ProgressBar(cfg.steps, enabled=progress)
            self.recorder = _Recorder(cfg, self.task, self.network, self._out, self.bar, self.wall_start)
            # the hook runs at every sample point, or once per mean step when a progress bar is drawn
            every = self.recorder.every * cfg.nodes if not self.bar.enabled else cfg.nodes
            self.sim = Simulator(self.nodes, self.network, compute, seed=cfg.seed, on_step=self.recorder.on_step,
                                 step_every=every, batched=self.batched)
            # synchronous exact gossip with every node in step: whole rounds at once (gossip.lockstep)
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
        with _threads(self.config.threads):
            self.sim.run(until)
        return self

    def result(self) -> SimulationResult:
        """The final figures; runs to the end first if needed (and writes the summary line)."""
        if not self.sim.done:
            self.run()
        cfg, rec, sim, network = self.config, self.recorder, self.sim, self.network
        nodes = sim.nodes
        with _threads(cfg.threads):
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


def world_of(cfg: SimConfig) -> tuple[dict[str, Any], ComputeModel]:
    """The modelled world of ``cfg``: its link models by class, and its compute model."""
    links = {"intra": parse_link(cfg.link, LAN), "inter": parse_link(cfg.inter_link, WAN)}
    slow = parse_slow(cfg.slow)
    for node in slow:
        if not 0 <= node < cfg.nodes:
            raise ValueError(f"slow node {node} does not exist (nodes are 0..{cfg.nodes - 1})")
    return links, parse_compute(cfg.compute, slow)


def open_out(out: str | Path | IO[str] | None) -> tuple[IO[str] | None, bool]:
    """The metrics file (an open one, or one opened from a path) and whether to close it."""
    if out is None or hasattr(out, "write"):
        return out, False  # type: ignore[return-value]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    return open(out, "w"), True


class _threads:
    """Set torch's intra-op thread count for a block, then restore it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        if self.before != self.n:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc: Any) -> None:
        if torch.get_num_threads() != self.before:
            torch.set_num_threads(self.before)


def simulate(config: SimConfig | None = None, *, out: str | Path | IO[str] | None = None,
             progress: bool | None = False, **overrides: Any) -> SimulationResult:
    """Run one simulated decentralized training job and return its results.

    Parameters
    ----------
    config : a :class:`SimConfig`; keyword ``overrides`` replace its fields
        (``simulate(nodes=16, topology="exponential")`` works without one)
    out : path or open file for JSON-lines metrics (one line per evaluation, then the summary)
    progress : draw a progress bar on stderr (None: only if stderr is a terminal)

    Examples
    --------
    >>> r = simulate(nodes=4, topology="ring", steps=20, task="synthetic")  # doctest: +SKIP
    >>> r.summary["final_accuracy"] > 0.5  # doctest: +SKIP
    True
    """
    with Simulation(config, out=out, progress=progress, **overrides) as sim:
        return sim.run().result()
