"""Lightning as gossip members (gossip.integrations.lightning): three real processes on
loopback running tests/user_scripts/lightning_script.py, made members by one argument
(``strategy=GossipStrategy()``). Skipped without Lightning (``pip install ".[lightning]"``)."""

from __future__ import annotations

import difflib
import json
import signal
import time

import pytest

pytest.importorskip("lightning", reason="the Lightning integration needs Lightning: pip install '.[lightning]'")

from tests.cluster import free_port  # noqa: E402
from tests.peer.test_user_scripts import SCRIPTS, ScriptProc, finished, run_cluster  # noqa: E402
from tests.integrations.test_transformers import wait_all  # noqa: E402

SCRIPT = SCRIPTS / "lightning_script.py"


def test_the_trainer_is_made_a_member_by_one_argument():
    after = SCRIPT.read_text()
    before = after.replace("from gossip.integrations.lightning import GossipStrategy\n", "") \
        .replace("strategy=GossipStrategy(), ", "")
    diff = [d for d in difflib.unified_diff(before.splitlines(), after.splitlines(), n=0, lineterm="")
            if d[:1] == "+" and d[:3] != "+++"]
    assert len(diff) == 2, diff


def test_three_lightning_trainers_shard_agree_on_sync_dist_metrics_and_one_saves(tmp_path):
    procs = run_cluster(tmp_path, SCRIPT, [], per_node=[["--ids", str(tmp_path / f"n{i}.ids"), "--dir",
                                                          str(tmp_path / f"d{i}")] for i in range(3)], timeout=400)
    for p in procs:
        assert p.proc.returncode == 0 and "Traceback" not in p.log(), p.log()[-3000:]
    results = [json.loads(p.stdout().strip().splitlines()[-1]) for p in procs]
    # 240 samples, 3 shards of 80, batches of 10: 8 steps an epoch, 3 epochs
    assert [r["global_step"] for r in results] == [24, 24, 24], results
    # each node validates its own data; sync_dist made the logged loss the members' mean, on all alike
    assert len({r["val_loss"] for r in results}) == 1, results
    assert sorted(r["is_global_zero"] for r in results) == [False, False, True], results
    ends = [finished(p) for p in procs]
    assert all(e == (24, 24, 0) for e in ends), ends
    reads = [json.loads((tmp_path / f"n{i}.ids").read_text()) for i in range(3)]
    assert [len(r) for r in reads] == [240] * 3, [len(r) for r in reads]
    for e in range(3):
        parts = [set(r[80 * e:80 * (e + 1)]) for r in reads]
        assert [len(p) for p in parts] == [80] * 3 and len(parts[0] | parts[1] | parts[2]) == 240, e
    # one node saves: the final checkpoint and Lightning's own
    zero = [i for i, r in enumerate(results) if r["is_global_zero"]][0]
    for i in range(3):
        written = list((tmp_path / f"d{i}").rglob("*.ckpt"))
        assert bool(written) == (i == zero), (i, written)


def test_the_callback_refuses_a_loader_every_node_would_read_alike(tmp_path):
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import gossip
    from gossip.integrations.lightning import GossipCallback

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Tiny()
    node = gossip.init(model, listen=f"127.0.0.1:{free_port()}", world_size=2, rank=0, settle=0.2,
                       handle_signals=False)
    try:
        data = TensorDataset(torch.randn(8, 2))
        trainer = L.Trainer(max_epochs=1, callbacks=[GossipCallback(node)], accelerator="cpu", devices=1,
                            logger=False, enable_progress_bar=False, enable_checkpointing=False,
                            default_root_dir=str(tmp_path))
        with pytest.raises(ValueError, match="not sharded among the cluster's 2 members"):
            trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True))
        t0 = time.monotonic()
        trainer = L.Trainer(max_epochs=1, callbacks=[GossipCallback(node)], accelerator="cpu", devices=1,
                            logger=False, enable_progress_bar=False, enable_checkpointing=False,
                            default_root_dir=str(tmp_path))
        trainer.fit(model, DataLoader(data, batch_size=4, sampler=node.sampler(data)))
        assert node.steps == 1 and time.monotonic() - t0 < 60  # its shard: 4 samples, one step
    finally:
        node.close()


def test_a_lightning_node_killed_and_restarted_continues_at_the_clusters_step(tmp_path):
    ports = [free_port() for _ in range(3)]
    stop = tmp_path / "stop"

    def start(i: int, name: str) -> ScriptProc:
        return ScriptProc(tmp_path, name, SCRIPT, ports[i], ports[(i + 1) % 3],
                          ["--ids", str(tmp_path / f"{name}.ids"), "--dir", str(tmp_path / f"d{i}"), "--epochs",
                           "1000", "--stop-at", str(stop)])

    # the node killed is not the first member (that one writes Lightning's checkpoints)
    victim = max(range(3), key=lambda i: f"127.0.0.1:{ports[i]}")
    first = min(range(3), key=lambda i: f"127.0.0.1:{ports[i]}")
    procs = [start(i, f"n{i}") for i in range(3)]
    try:
        end = time.monotonic() + 240  # two epochs in: the first member's checkpoint of epoch 1
        while time.monotonic() < end and not list((tmp_path / f"d{first}").rglob("epoch=1-*.ckpt")):
            assert procs[victim].proc.poll() is None, procs[victim].log()[-3000:]
            time.sleep(0.05)
        procs[victim].proc.send_signal(signal.SIGKILL)
        procs[victim].proc.wait(timeout=10)
        back = start(victim, "back")
        m = back.wait_for(r"Lightning continues at the cluster's step (\d+) \(epoch (\d+), after batch (\d+)\)", 300)
        joined, epoch, done = map(int, m.groups())
        stop.write_text(str(joined + 24))
        survivors = [p for i, p in enumerate(procs) if i != victim]
        wait_all([*survivors, back], 400)
    finally:
        for p in [*procs, *([back] if "back" in locals() else [])]:
            p.reap()
    assert (epoch, done) == divmod(joined, 8), (joined, epoch, done)
    results = [json.loads(p.stdout().strip().splitlines()[-1]) for p in (*survivors, back)]
    assert {r["global_step"] for r in results} == {joined + 24}, results
    assert len({r["val_loss"] for r in results}) == 1, results
    assert finished(back) == (joined + 24, 24, 0), back.log()[-3000:]
    assert "took the member's optimizer state" in back.log() and "took the schedule from the state of" in back.log()
    # from its join: the rest of its shard of that epoch, then whole shards, none read by another node
    mine = json.loads((tmp_path / "back.ids").read_text())
    assert len(mine) >= 240, len(mine)
    others = [json.loads((tmp_path / f"n{i}.ids").read_text()) for i in range(3) if i != victim]
    def epoch_sets(reads: list[int], first_step: int) -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for k, i in enumerate(reads[:240]):
            out.setdefault((first_step + k // 10) // 8, set()).add(i)
        return out
    theirs = [epoch_sets(r[10 * joined:], joined) for r in others]
    for e, ids in epoch_sets(mine, joined).items():
        assert not ids & (theirs[0].get(e, set()) | theirs[1].get(e, set())), e
    assert len(epoch_sets(mine, joined)[epoch]) == 10 * (8 - done)
