"""Under torchrun (2 ranks, gloo): DDP with GossipNode's gossip shard built after DDP wrapped
the model (:func:`gossip.groups.group.shard_view`: FlatState re-homes the parameters
into one vector) trains bit for bit as plain DDP. Prints one JSON line per rank (for
tests/groups/test_user_loop_real.py)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gossip.core.state import FlatState
from gossip.groups.group import current_group, shard_view


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))  # buffers too


def train(variant: str, bucket_view: bool) -> torch.Tensor:
    m = model()
    if variant == "before":  # as Group.wrap does: FlatState first, then DDP
        FlatState(m)
    ddp = DistributedDataParallel(m, gradient_as_bucket_view=bucket_view)
    view = shard_view("ddp", ddp, current_group("ddp", torch.device("cpu"))) if variant.startswith("after") else None
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)  # (built before or after: the same objects)
    g = torch.Generator().manual_seed(dist.get_rank())  # each rank its own data
    for i in range(6):
        x, y = torch.randn(5, 8, generator=g), torch.randint(3, (5,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if view is not None and variant == "after-moved" and i == 2:  # a held send moved the shard
            view.moved(view.flat.clone())
            view.after_mix()  # (each rank's slice to the others: BatchNorm's statistics become a mix of the ranks')
    if view is not None:
        assert view.is_bound(), variant
    params = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    buffers = torch.cat([b.detach().reshape(-1) for b in m.buffers() if b.is_floating_point()])
    return torch.cat([params, buffers])


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = {}
    for bucket_view in (False, True):
        plain = train("plain", bucket_view)
        for variant in ("before", "after", "after-moved"):
            got = train(variant, bucket_view)
            every = [torch.empty_like(got) for _ in range(dist.get_world_size())]
            dist.all_gather(every, got)
            n = sum(p.numel() for p in model().parameters())
            out[f"{variant}/{bucket_view}"] = {"params_as_plain": torch.equal(got[:n], plain[:n]),
                                               "buffers_as_plain": torch.equal(got[n:], plain[n:]),
                                               "params_equal_on_ranks": all(torch.equal(e[:n], got[:n]) for e in every)}
    # one write per line: both ranks' stdout is torchrun's, one file (print writes the newline apart)
    sys.stdout.write(json.dumps({"rank": dist.get_rank(), **out}) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
