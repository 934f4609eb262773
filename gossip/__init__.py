"""Masterless peer-to-peer gossip training for PyTorch.

The same node code runs as a real ZeroMQ peer (``gossip-node``), inside the
one-laptop discrete-event simulator (``gossip-sim``), and from research
scripts through :func:`gossip.simulate`. A training loop of your own gossips
through :class:`gossip.GossipNode`.

The layers, each a folder, each importing only from the ones above it in this
list (``tests/test_layout.py`` checks it, and that no import runs in a circle):

=================  ===========================================================
``core``           messages, flat state, buffers, checkpoints, the actions
                   driven programs yield, settings given flat
``compression``    codecs
``mixing``         how to combine: rules, outer optimizers, settings
``transport``      how bytes move: wire format, ZeroMQ, CurveZMQ, link models,
                   addresses, ports (never imports ``mixing``, nor it this)
``training``       the node program, tasks, data, samplers, dataset loaders
``protocol``       the membership protocol, sans-IO: member table, control plane,
                   failure detectors, joins, the peer's life, its timings and settings
``peer``           the wall-clock driver, its reports, launchers, ``GossipNode``, the
                   drivers of a group's ranks
``sim``            the virtual clock: engines, simulated clusters and groups, faults,
                   the explorer (``peer`` and ``sim`` never import each other)
``groups``         torch.distributed inside a node: the process group, shards, the
                   group's checkpoints and its run on every rank (over ``peer``), and
                   ``GossipNode``'s form on each rank of a loop of your own under torchrun
``integrations``   the frameworks' hooks (Hugging Face, Lightning)
entry points       ``api`` (:func:`simulate`), ``cli``, ``plot``, ``explore``
=================  ===========================================================

``topologies`` (graphs and mixing weights) stands alone: networkx and numpy only.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "simulate", "Simulation", "SimConfig", "SimulationResult", "GossipNode",
           "MixingSettings", "ShardSampler", "shard", "init", "ClusterFinished"]

_LAZY = {"simulate": "gossip.api", "Simulation": "gossip.api", "SimConfig": "gossip.api",
         "SimulationResult": "gossip.api", "MixingSettings": "gossip.mixing.settings",
         "GossipNode": "gossip.groups.user_loop", "init": "gossip.groups.user_loop",
         "ClusterFinished": "gossip.peer.user_loop", "ShardSampler": "gossip.training.sampler", "shard": "gossip.training.sampler"}


def __getattr__(name: str):
    # Lazy so that ``import gossip.compression`` or ``gossip.transport.wire`` stays light.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gossip' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
