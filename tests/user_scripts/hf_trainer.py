"""A Hugging Face Trainer script (a tiny GPT-2 built from a config, no download; token
sequences generated here) made a gossip member by two lines: the import and
``GossipTrainer`` for ``Trainer``. Listen and peers come from GOSSIP_LISTEN and
GOSSIP_PEERS. It writes the ids of the training samples it read to --ids, evaluates
at the end and prints one JSON line; the test stops every node at the step written
in --stop-at (read after every step), so that the run lasts until a restarted node
is back whatever the machine's speed."""

import argparse
import json
import os

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from gossip.integrations.transformers import GossipTrainer


class Sequences(Dataset):
    """Counting sequences mod 64 from a random start and stride; remembers what was read."""

    def __init__(self, n, seed, length=16):
        g = torch.Generator().manual_seed(seed)
        start, stride = torch.randint(64, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
        self.tokens = (start + stride * torch.arange(length)) % 64
        self.seen = []

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        self.seen.append(int(i))
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class StopAt(TrainerCallback):
    """Stop every node at the step the test writes (all read the same file)."""

    def __init__(self, path):
        self.path = path

    def on_step_end(self, args, state, control, **kwargs):
        try:
            stop = int(open(self.path).read())
        except (OSError, ValueError):
            return
        if state.global_step >= stop:
            control.should_training_stop = True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ids", required=True)
    parser.add_argument("--stop-at", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    train, test = Sequences(192, 0), Sequences(48, 1 + int(os.environ["GOSSIP_LISTEN"].rsplit(":", 1)[1]) % 7)
    targs = TrainingArguments(output_dir=args.out, per_device_train_batch_size=8, num_train_epochs=1000,
                              learning_rate=3e-3, warmup_steps=5, lr_scheduler_type="linear", save_steps=5,
                              save_total_limit=2, logging_steps=10, report_to=[], use_cpu=True,
                              disable_tqdm=True, seed=0, dataloader_num_workers=0)
    trainer = GossipTrainer(model=model, args=targs, train_dataset=train, eval_dataset=test,
                            callbacks=[StopAt(args.stop_at)])
    out = trainer.train(resume_from_checkpoint=True if args.resume else None)
    with open(args.ids, "w") as f:
        json.dump(train.seen, f)
    metrics = trainer.evaluate()
    trainer.save_model(args.final)
    print(json.dumps({"global_step": out.global_step, "eval_loss": metrics["eval_loss"]}), flush=True)


if __name__ == "__main__":
    main()
