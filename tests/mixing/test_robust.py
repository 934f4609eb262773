"""Misbehaving peers and bad numbers: clipped gossip and the NaN guard."""

from __future__ import annotations

import math

import pytest
import torch

import gossip
from gossip.api import Simulation
from gossip.training.tasks import SyntheticTask


def test_clipped_gossip_keeps_honest_nodes_on_course_against_a_x1000_peer():
    common = dict(nodes=8, topology="ring", task="digits", steps=300, eval_every=300, seed=0)
    clean = gossip.simulate(**common).summary
    attacked = gossip.simulate(byzantine="3=1000", **common).summary
    defended = gossip.simulate(byzantine="3=1000", clip="auto", **common).summary
    clean_clipped = gossip.simulate(clip="auto", **common).summary
    assert attacked["mean_node_accuracy"] < 0.5  # unprotected: the honest nodes are ruined
    assert defended["mean_node_accuracy"] >= clean["mean_node_accuracy"] - 0.02
    assert defended["clipped"] > 0
    # robust mixing costs (almost) nothing when nobody misbehaves
    assert abs(clean_clipped["mean_node_accuracy"] - clean["mean_node_accuracy"]) <= 0.005


def test_clip_options_are_checked():
    with pytest.raises(ValueError, match="clip"):
        gossip.SimConfig(clip=-1)
    with pytest.raises(ValueError, match="synchronous uncompressed"):
        gossip.SimConfig(clip="auto", compression="topk:0.1")
    with pytest.raises(ValueError, match="byzantine node 9"):
        gossip.SimConfig(byzantine="9=10")


class PoisonedTask(SyntheticTask):
    """Node 2's data turns to NaN for three batches: its loss goes non-finite."""

    def stream(self, rank, world_size, split, seed, device="cpu"):
        inner = super().stream(rank, world_size, split, seed, device)
        if rank != 2:
            return inner
        calls = {"n": 0}
        real_next = inner.next

        def next_batch():
            calls["n"] += 1
            x, y = real_next()
            if 60 <= calls["n"] < 63:
                x = torch.full_like(x, math.nan)
            return x, y

        inner.next = next_batch
        return inner


def test_nan_guard_never_sends_non_finite_parameters_and_recovers():
    sim = Simulation(nodes=4, topology="ring", task=PoisonedTask(), steps=150, eval_every=150)
    sent_bad = []
    for node in sim.nodes:
        real = node.outgoing

        def spy(ch, rnd, real=real, node=node):
            out = real(ch, rnd)
            for _, msg in out:
                if not bool(torch.isfinite(msg.data.source).all()):
                    sent_bad.append(node.id)
            return out

        node.outgoing = spy
    r = sim.run().result()
    assert sent_bad == []
    assert sim.nodes[2].nonfinite_steps == 3 and sim.nodes[2].recoveries == 3
    assert all(bool(torch.isfinite(p).all()) for p in r.params)
    assert r.summary["mean_node_accuracy"] > 0.8
