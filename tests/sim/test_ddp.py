"""The data-parallel reference (gossip.sim.ddp): exact gradient averaging every step."""

from __future__ import annotations

import pytest
import torch

import gossip
from gossip.sim.ddp import allreduce_bytes, ddp_reference
from gossip.training.tasks import SyntheticTask


class AdamTask(SyntheticTask):
    def optimizer(self, params):
        return torch.optim.Adam(params, lr=0.01)


@pytest.mark.numeric
def test_ddp_equals_every_step_averaging_for_a_linear_optimizer():
    """With SGD (momentum and weight decay are linear), averaging the parameters every
    step on a complete graph is averaging the gradients: the two must agree."""
    cfg = gossip.SimConfig(nodes=4, topology="complete", task="synthetic", steps=20, seed=0)
    ddp = ddp_reference(cfg)
    gossiped = gossip.simulate(cfg)
    for p in gossiped.params:
        torch.testing.assert_close(ddp.params[0], p, rtol=0, atol=1e-6)
    assert ddp.summary["final_loss"] == gossiped.summary["final_loss"] or \
        abs(ddp.summary["final_loss"] - gossiped.summary["final_loss"]) < 1e-5


@pytest.mark.numeric
def test_ddp_is_not_parameter_averaging_for_adam():
    cfg = gossip.SimConfig(nodes=4, topology="complete", task=AdamTask(), steps=20, seed=0)
    ddp = ddp_reference(cfg)
    gossiped = gossip.simulate(cfg)
    assert (ddp.params[0] - gossiped.params[0]).abs().max() > 1e-4
    # one worker: DDP is plain training, the same as one gossip node (on the per-node engine, whose
    # step is DDP's: Adam turns a rounding-sized change of a gradient near 0 into a step of up to lr,
    # so the batched engine's other matmul rounding would agree by chance only)
    one = gossip.SimConfig(nodes=1, topology="complete", task=AdamTask(), steps=20, seed=0, engine="per-node")
    torch.testing.assert_close(ddp_reference(one).params[0], gossip.simulate(one).params[0], rtol=0, atol=1e-7)


def test_ddp_counts_ring_allreduce_bytes():
    assert allreduce_bytes(1000, 8) == 2 * 7 / 8 * 4000
    assert allreduce_bytes(1000, 1) == 0.0
    cfg = gossip.SimConfig(nodes=8, task="synthetic", steps=10, seed=0, eval_every=5)
    r = ddp_reference(cfg)
    numel = r.params[0].numel()
    assert r.summary["bytes_sent"] == allreduce_bytes(numel, 8) * 8 * 10
    assert [h["step"] for h in r.history] == [0, 5, 10]


@pytest.mark.numeric
def test_fused_batches_give_the_same_gradient():
    cfg = gossip.SimConfig(nodes=4, task="synthetic", steps=15, seed=1)
    a, b = ddp_reference(cfg), ddp_reference(cfg, fused=True)
    torch.testing.assert_close(a.params[0], b.params[0], rtol=0, atol=1e-6)
