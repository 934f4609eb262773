"""lightning_script.py's classifier under torchrun: every process one rank of a group member,
the same one argument (``strategy=GossipStrategy(intra=...)``), which wraps the module in DDP
(``--intra ddp``) or shards it with ``fully_shard`` (``--intra fsdp``).

    GOSSIP_LISTEN=127.0.0.1:7000 GOSSIP_PEERS=127.0.0.1:7100 \\
        python -m torch.distributed.run --standalone --nproc-per-node 2 tests/user_scripts/lightning_torchrun.py \\
        --out OUT --dir DIR [--intra fsdp]

The validation logs with ``sync_dist=True`` its loss (mean), the rank's data shard (mean)
and its sample count (sum). Each rank writes ``OUT/rank-R.json``: what Lightning and the
node say of it, the training samples it read per epoch, its metrics, and ``node.average``
of its shard weighted by 1 + shard; and the group's whole parameters at the end (gathered
from the shards under FSDP) to ``OUT/flat-R.pt``.
Rank R's ``default_root_dir`` (where a final checkpoint goes) is ``DIR/rank-R``.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_script import Classifier, Points  # noqa: E402

from gossip.integrations.lightning import GossipStrategy  # noqa: E402


class Logged(Classifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)
        self.log("val_shard", float(self.global_rank), sync_dist=True)
        self.log("val_count", float(len(y)), reduce_fx="sum", sync_dist=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--intra", choices=("ddp", "fsdp"), default="ddp")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, val = Points(240, 0), Points(80, 1)
    strategy = GossipStrategy(intra=args.intra, gossip={"period": 2, "heartbeat": 0.25, "dead_after": 2, "settle": 1,
                                                        "grace": 5, "timeout": 30})
    root = os.path.join(args.dir, f"rank-{os.environ['RANK']}")
    trainer = L.Trainer(max_epochs=args.epochs, strategy=strategy, accelerator="cpu", devices=1,
                        default_root_dir=root, enable_progress_bar=False, logger=False, num_sanity_val_steps=0)
    model = Logged()
    trainer.fit(model, DataLoader(train, batch_size=10, shuffle=True), DataLoader(val, batch_size=10))
    trainer.save_checkpoint(os.path.join(root, "final.ckpt"))
    node = strategy.node
    record = {"group_rank": dist.get_rank(), "id": node.id, "type": type(node).__name__,
              "global_rank": trainer.global_rank, "world_size": trainer.world_size,
              "is_global_zero": trainer.is_global_zero, "global_step": trainer.global_step,
              "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}, "seen": train.seen,
              "average": node.average(float(node.rank), weight=1.0 + node.rank)}
    record["summary"] = node.close()  # (on every rank; a round still in flight is mixed here)
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]  # (FSDP: a collective)
    torch.save(torch.cat([p.detach().reshape(-1) for p in whole]), out / f"flat-{dist.get_rank()}.pt")
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(record, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
