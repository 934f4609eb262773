"""What defines a simulated run: :class:`SimConfig`, and the modelled world it describes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from gossip.mixing.adversary import parse_byzantine
from gossip.mixing.settings import MixingSettings, with_mixing_options
from gossip.protocol.timing import DEFAULT_DETECTOR, DETECTORS, Timing
from gossip.sim.batched import parse_engine
from gossip.sim.engine import ComputeModel, parse_compute, parse_slow
from gossip.sim.faults import parse_faults
from gossip.training.data import parse_split
from gossip.training.node import resolve_device
from gossip.transport.links import LAN, WAN, parse_link

__all__ = ["SimConfig", "world_of", "torch_threads"]


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
    faults: Any = None               # ["crash:3@1.0", "join:3@2.5", "partition:0-3|4-7@1-2"] (gossip.sim.faults):
                                     # a run with faults runs every node's real control plane (gossip.sim.fault_runs)
    detect: float = Timing.dead_after  # with faults: the failure detector's dead_after (heartbeat detect/4;
                                     # see gossip.protocol.timing.Timing.from_detect)
    detector: str = DEFAULT_DETECTOR # with faults: the nodes' failure detector (gossip-node --detector)
    # what is recorded
    eval_every: int = 0              # local steps between evaluations (0: about 20 points per run)
    device: str = "cpu"
    threads: int = 1                 # torch intra-op threads during the run (small models are fastest on 1)
    engine: str = "auto"             # auto | lockstep (whole rounds at once, gossip.sim.lockstep) | batched (local
                                     # steps due together as one vectorised call, gossip.sim.batched) | per-node;
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
        Timing.from_detect(self.detect)  # a ValueError naming detect, before anything runs
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


def world_of(cfg: SimConfig) -> tuple[dict[str, Any], ComputeModel]:
    """The modelled world of ``cfg``: its link models by class, and its compute model."""
    links = {"intra": parse_link(cfg.link, LAN), "inter": parse_link(cfg.inter_link, WAN)}
    slow = parse_slow(cfg.slow)
    for node in slow:
        if not 0 <= node < cfg.nodes:
            raise ValueError(f"slow node {node} does not exist (nodes are 0..{cfg.nodes - 1})")
    return links, parse_compute(cfg.compute, slow)


class torch_threads:
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
