"""Masterless peer-to-peer gossip training for PyTorch.

The same node code runs as a real ZeroMQ peer (``gossip-node``), inside the
one-laptop discrete-event simulator (``gossip-sim``), and from research
scripts through :func:`gossip.simulate`.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "simulate", "Simulation", "SimConfig", "SimulationResult", "GossipNode",
           "MixingSettings"]


def __getattr__(name: str):
    # Lazy so that ``import gossip.compression`` or ``gossip.wire`` stays light.
    if name in ("simulate", "Simulation", "SimConfig", "SimulationResult"):
        from gossip import api

        return getattr(api, name)
    if name == "MixingSettings":
        from gossip.mixing.settings import MixingSettings

        return MixingSettings
    if name == "GossipNode":
        from gossip.user_loop import GossipNode

        return GossipNode
    raise AttributeError(f"module 'gossip' has no attribute {name!r}")
