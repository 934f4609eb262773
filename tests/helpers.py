"""Shared test fixtures: tasks whose training does nothing, so gossip is pure averaging."""

from __future__ import annotations

import torch
from torch import nn

from gossip.training.data import BatchStream


class VectorModel(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.zeros(dim))


class FrozenTask:
    """A task whose gradient is always zero: local steps leave parameters unchanged,
    so after R rounds the nodes hold exactly W^R x0."""

    name = "frozen"

    def __init__(self, dim: int = 5) -> None:
        self.dim = dim

    def model(self) -> nn.Module:
        return VectorModel(self.dim)

    def optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)

    def stream(self, rank, world_size, split, seed, device="cpu"):
        return BatchStream((torch.zeros(4, 1),), torch.arange(4), 2, seed)

    def loss(self, model, batch):
        return (model.x * 0.0).sum()

    def evaluate(self, model, device="cpu"):
        return {"loss": float(model.x.detach().pow(2).sum()), "accuracy": 0.0}


frozen = FrozenTask()


def tick(control, now: float) -> list:
    """One tick of a control plane, carried out as its driver would: the effects applied,
    the members it declared dead returned."""
    fx = control.tick(now)
    control.apply(fx)
    return fx.dead
