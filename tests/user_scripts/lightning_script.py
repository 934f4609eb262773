"""A Lightning script (a small classifier on generated data) made a gossip member by
one argument, ``strategy=GossipStrategy()``; listen and peers come from GOSSIP_LISTEN
and GOSSIP_PEERS. It logs a validation loss with ``sync_dist=True``, writes the ids
of the training samples it read per epoch to --ids, saves a checkpoint with
``trainer.save_checkpoint`` and prints one JSON line. With --stop-at, every node stops
at the step the test writes in that file."""

import argparse
import json
import os

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from gossip.integrations.lightning import GossipStrategy


class Points(Dataset):
    """Two Gaussian blobs; remembers which samples were read."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(2, (n,), generator=g)
        self.x = torch.randn(n, 8, generator=g) + 1.5 * self.y[:, None].float()
        self.seen = []

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        self.seen.append(int(i))
        return self.x[i], self.y[i]


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


class StopAt(L.Callback):
    """Stop every node at the step the test writes in --stop-at (all read the same file)."""

    def __init__(self, path):
        self.path = path

    def on_train_batch_end(self, trainer, *args):
        try:
            stop = int(open(self.path).read())
        except (OSError, ValueError):
            return
        if trainer.global_step >= stop:
            trainer.should_stop = True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ids", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--stop-at", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train = Points(240, 0)
    val = Points(60, 1 + int(os.environ["GOSSIP_LISTEN"].rsplit(":", 1)[1]) % 7)  # each node its own
    trainer = L.Trainer(max_epochs=args.epochs, strategy=GossipStrategy(), accelerator="cpu", devices=1,
                        default_root_dir=args.dir, enable_progress_bar=False, logger=False,
                        num_sanity_val_steps=0, callbacks=[StopAt(args.stop_at)] if args.stop_at else [])
    model = Classifier()
    trainer.fit(model, DataLoader(train, batch_size=10, shuffle=True), DataLoader(val, batch_size=20))
    with open(args.ids, "w") as f:
        json.dump(train.seen, f)
    trainer.save_checkpoint(os.path.join(args.dir, "final.ckpt"))
    print(json.dumps({"global_step": trainer.global_step, "val_loss": float(trainer.callback_metrics["val_loss"]),
                      "is_global_zero": trainer.is_global_zero}), flush=True)


if __name__ == "__main__":
    main()
