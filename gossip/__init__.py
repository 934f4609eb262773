"""Masterless peer-to-peer gossip training for PyTorch.

The same node code runs as a real ZeroMQ peer (``gossip-node``), inside the
one-laptop discrete-event simulator (``gossip-sim``), and from research
scripts through :func:`gossip.simulate`. A training loop of your own gossips
through :class:`gossip.GossipNode`.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "simulate", "Simulation", "SimConfig", "SimulationResult", "GossipNode",
           "MixingSettings", "ShardSampler", "shard"]

_LAZY = {"simulate": "gossip.api", "Simulation": "gossip.api", "SimConfig": "gossip.api",
         "SimulationResult": "gossip.api", "MixingSettings": "gossip.mixing.settings",
         "GossipNode": "gossip.peer.user_loop", "ShardSampler": "gossip.training.sampler", "shard": "gossip.training.sampler"}


def __getattr__(name: str):
    # Lazy so that ``import gossip.compression`` or ``gossip.transport.wire`` stays light.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gossip' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
