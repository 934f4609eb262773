"""The settings of one peer: everything ``gossip-node`` (and :class:`~gossip.peer.user_loop.GossipNode`)
passes to the protocol and its driver, checked once when made."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gossip.mixing.settings import MixingSettings, build_rules, with_mixing_options
from gossip.protocol.timing import (
    DEFAULT_DETECTOR,
    DETECTORS,
    Timing,
    with_timing_options,
)
from gossip.transport.addresses import parse_address
from gossip.transport.links import emulated_links

__all__ = ["PeerConfig"]


@with_mixing_options
@with_timing_options
@dataclass(frozen=True)
class PeerConfig:
    """Everything a real node needs; :mod:`gossip.cli` fills it from flags or a TOML file."""

    listen: str                          # tcp://HOST:PORT (or HOST:PORT) to bind
    peers: tuple[str, ...] = ()          # seeds HOST:PORT: any existing members
    advertise: str | None = None         # HOST:PORT others reach us at (default: listen)
    topology: str = "ring"
    # how the node mixes: one MixingSettings; its options (algorithm, compression, gamma, period,
    # asynchronous, staleness, overlap, clip, link_policy) are also accepted as flat keywords
    # (and the older options={"gamma": ...}) and read back flat (cfg.period)
    mixing: MixingSettings | None = None
    task: Any = "synthetic"
    split: str = "iid"
    steps: int = 200
    seed: int = 0
    rank: int | None = None              # explicit data shard; default: index in the sorted member list
    world_size: int | None = None
    device: str = "auto"
    dc: str = ""                         # datacenter label (links between different labels are "inter")
    timeout: float = 5.0                 # synchronous round timeout (s)
    # the protocol's timings: one Timing (heartbeat, dead_after, settle, grace, join_timeout,
    # join_margin, leave_margin), also accepted as flat keywords and read back flat (cfg.dead_after)
    timing: Timing | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0            # local steps between checkpoints (0: only at the end)
    resume: bool = False
    log: str | None = None               # JSON-lines metrics file
    eval_every: int = 0                  # local steps between evaluations in the metrics log (0: steps/10)
    max_message_mb: float = 0.0          # incoming size cap in MiB (0: three models (+ outer momenta) + 1 MiB)
    emulate: tuple[str, ...] = ()        # link emulation: "CLASS:latency=50ms,bandwidth=100Mbit,loss=0,drop=N"
    emulate_origin: float | None = None  # UNIX seconds the emulated down windows count from (None: the node's start)
    curve_keys: str | None = None        # CurveZMQ key directory (see gossip.transport.security); None: no encryption
    tensorboard: str | None = None       # TensorBoard directory: scalars of the metrics in DIR/<node id>/
    detector: str = DEFAULT_DETECTOR     # failure detector: heartbeat (all-to-all pings) or swim (gossip.protocol.swim_detector)
    # a synchronous round waits for a neighbour the failure detector suspects until it is
    # declared dead (or --timeout); by default the round goes on without one that is
    # suspected and silent (see Lifecycle.gone)
    wait_for_suspects: bool = False

    def __post_init__(self) -> None:
        parse_address(self.listen, "--listen")
        if self.advertise is not None:
            parse_address(self.advertise, "--advertise")
        for p in self.peers:
            parse_address(p, "--peers entry")
        for name in ("steps", "checkpoint_every", "eval_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0 and math.isfinite(self.timeout)):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        if not isinstance(self.wait_for_suspects, bool):
            raise ValueError(f"wait_for_suspects must be true or false, got {self.wait_for_suspects!r}")
        if not (isinstance(self.max_message_mb, (int, float)) and self.max_message_mb >= 0
                and math.isfinite(self.max_message_mb)):
            raise ValueError(f"max_message_mb must be a number >= 0, got {self.max_message_mb!r}")
        if (self.rank is None) != (self.world_size is None):
            raise ValueError("--rank and --world-size go together")
        if self.world_size is not None:
            if not (isinstance(self.world_size, int) and self.world_size >= 1):
                raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
            if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
                raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")
        if not isinstance(self.dc, str) or len(self.dc) > 64:
            raise ValueError("dc must be a short string")
        emulated_links(self.emulate)  # fails early on a bad spec
        if self.emulate_origin is not None:
            if isinstance(self.emulate_origin, bool) or not isinstance(self.emulate_origin, (int, float)) \
                    or not (math.isfinite(self.emulate_origin) and self.emulate_origin >= 0):
                raise ValueError(f"--emulate-origin must be a time in UNIX seconds (a number >= 0), got "
                                 f"{self.emulate_origin!r}")
            if not self.emulate:
                raise ValueError("--emulate-origin needs --emulate (it says when the emulated links' down windows "
                                 "count from)")
        if self.detector not in DETECTORS:
            raise ValueError(f"detector must be one of {', '.join(DETECTORS)}, got {self.detector!r}")
        from gossip.training.data import parse_split
        from topologies import SPEC_NAMES

        parse_split(self.split)
        name = self.topology.split(":", 1)[0].strip().lower().replace("_", "-") if isinstance(self.topology, str) else ""
        if isinstance(self.topology, str) and name not in SPEC_NAMES:
            raise ValueError(f"unknown topology {self.topology!r}; valid: {', '.join(SPEC_NAMES)}")
        if isinstance(self.topology, str):
            # the rules checked against the graph now (CHOCO needs a static one), not at the first round;
            # the cluster's size is not known yet, so on the graph of world_size members, or of 8
            from topologies import build

            try:
                probe = build(self.topology, self.world_size or 8, seed=self.seed)
            except ValueError:
                probe = None  # a spec for a fixed size (hierarchical:4,4, torus:3x3): checked at the start
            if probe is not None:
                build_rules(self.mixing, probe)

    @property
    def node_id(self) -> str:
        listen = parse_address(self.listen, "--listen")
        node_id = parse_address(self.advertise, "--advertise") if self.advertise else listen
        if node_id.split(":")[0] in ("0.0.0.0", "*", "[::]"):
            raise ValueError(f"listening on {listen} needs --advertise HOST:PORT (the address peers can reach)")
        return node_id
