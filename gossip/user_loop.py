"""Gossip inside a training loop of the user's own: :class:`GossipNode` drives a
:class:`~gossip.peer.Peer` one local step at a time instead of running a task."""

from __future__ import annotations

from typing import Any

import torch

from gossip.mixing.settings import MixingSettings
from gossip.peer import Peer, PeerConfig, PeerError

__all__ = ["GossipNode"]


class GossipNode:
    """Gossip for a training loop of your own (the Horovod-style path).

    Wrap the model once, call :meth:`step` after every ``optimizer.step()``::

        node = GossipNode(model, optimizer, listen="tcp://10.0.0.1:5555", peers=["10.0.0.2:5555"],
                          topology="exponential", period=4)
        shard = my_dataset[node.rank::node.world_size]   # any data split of yours
        for x, y in loader(shard):
            optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
            node.step()
        node.close()

    The constructor joins the cluster (blocking until training starts, like
    ``gossip-node``). Keyword options are :class:`PeerConfig` fields; how the
    node mixes is ``mixing`` (a :class:`~gossip.mixing.settings.MixingSettings`)
    or its options given flat (``period=4, compression="int8"``), merged into it.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, listen: str,
                 peers: Any = (), mixing: MixingSettings | None = None, **options: Any) -> None:
        if isinstance(peers, str):
            peers = [p for p in peers.split(",") if p.strip()]
        cfg = PeerConfig(listen=listen, peers=tuple(peers), mixing=mixing, **options)
        self.peer = Peer(cfg, model=model, optimizer=optimizer)
        try:
            if not self.peer.start():
                raise PeerError("stopped before training started")
        except BaseException:
            self.peer.close()
            raise

    @property
    def rank(self) -> int:
        """This node's index among the members it started with (for picking a data shard)."""
        return int(self.peer.rank)

    @property
    def world_size(self) -> int:
        return int(self.peer.world_size)

    @property
    def members(self) -> list[str]:
        return list(self.peer.node.members) if self.peer.node else []

    @property
    def steps(self) -> int:
        """Local steps so far, on the cluster's count: a node that joined late, or
        joined again after a stall made the others drop it, continues from the
        step the cluster is at. Loop ``while node.steps < total:`` to end
        together with the others."""
        return int(self.peer.node.step) if self.peer.node is not None else 0

    def step(self) -> None:
        """After ``optimizer.step()``: exchange and mix every ``period`` calls."""
        self.peer.step()

    def neighbor_distance(self) -> float:
        return self.peer.neighbor_distance()

    def close(self) -> dict[str, Any]:
        """Finish (serve slower peers for up to ``grace`` s), say goodbye; returns the summary."""
        try:
            self.peer.complete_pending()
            self.peer.finish()
            return self.peer.summary()
        finally:
            self.peer.close()

    def __enter__(self) -> "GossipNode":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
