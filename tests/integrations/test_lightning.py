"""Lightning as gossip members (gossip.integrations.lightning): three real processes on
loopback running tests/user_scripts/lightning_script.py, made members by one argument
(``strategy=GossipStrategy()``). Skipped without Lightning (``pip install ".[lightning]"``)."""

from __future__ import annotations

import difflib
import json
import signal
import time

import pytest
import torch

pytest.importorskip("lightning", reason="the Lightning integration needs Lightning: pip install '.[lightning]'")

from tests.cluster import free_port  # noqa: E402
from tests.peer.test_user_scripts import SCRIPTS, ScriptProc, finished, run_cluster, wait_removed  # noqa: E402
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
        # two epochs in: the first member's checkpoint of epoch 1 or later (Lightning keeps only
        # the newest, and an epoch of 8 steps can pass between two looks of a loaded machine)
        def two_epochs_in() -> bool:
            return any(int(p.name.split("-")[0][len("epoch="):]) >= 1
                       for p in (tmp_path / f"d{first}").rglob("epoch=*-*.ckpt"))

        end = time.monotonic() + 240
        while time.monotonic() < end and not two_epochs_in():
            assert procs[victim].proc.poll() is None, procs[victim].log()[-3000:]
            time.sleep(0.05)
        procs[victim].proc.send_signal(signal.SIGKILL)
        procs[victim].proc.wait(timeout=10)
        wait_removed([p for i, p in enumerate(procs) if i != victim], ports[victim])
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


def test_the_strategy_knows_a_torchrun_rank_and_refuses_what_it_cannot_do_naming_why(monkeypatch):
    from gossip.integrations.lightning import GossipStrategy
    from gossip.peer.user_loop import GossipNode

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="intra='fsdp' shards the model over the ranks of a group: start the script "
                                         "with torchrun"):
        GossipStrategy(intra="fsdp")
    with pytest.raises(ValueError, match="intra must be one of ddp, fsdp, got 'zero'"):
        GossipStrategy(intra="zero")
    with pytest.raises(ValueError, match="ddp must be a dict"):
        GossipStrategy(ddp=True)
    alone = GossipStrategy()
    assert not alone.in_group and (alone.global_rank, alone.world_size, alone.is_global_zero) == (0, 1, True)
    monkeypatch.setenv("WORLD_SIZE", "2")  # (torchrun's rank 1 of 2; the process group not started)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    rank = GossipStrategy(device="cuda")
    assert rank.in_group and rank.root_device == torch.device("cuda", 1)
    # before the node exists: this rank of its group (a validation before fit splits the group's data)
    assert (rank.global_rank, rank.world_size, rank.is_global_zero) == (1, 2, False)
    assert rank.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}
    with pytest.raises(ValueError, match="give gossip= as a dict of GossipNode's options"):
        GossipStrategy(gossip=object.__new__(GossipNode))
    with pytest.raises(ValueError, match="ddp= holds DistributedDataParallel's options"):
        GossipStrategy(intra="fsdp", ddp={})
    assert GossipStrategy(intra="fsdp").intra == "fsdp"


TORCHRUN_SCRIPT = SCRIPTS / "lightning_torchrun.py"


@pytest.mark.parametrize("intra", ["ddp", "fsdp"])
def test_two_groups_under_torchrun_shard_over_every_rank_agree_on_sync_dist_and_one_rank_saves(tmp_path, intra):
    """Two groups of 2 ranks (torchrun, gloo), each rank running the Lightning script with
    GossipStrategy(intra=...), which wraps the module in DDP or shards it with fully_shard
    (then every rank holds half of each layer, and the checkpoint is gathered from the
    shards on every rank and written by one): both train 12 steps; the 4 ranks read
    disjoint quarters of the data in each epoch (rank r of member m: shard 2m + r);
    sync_dist metrics are the same floats on every rank (the mean of the ranks' shard
    indices, the sum of their sample counts); node.average is the exact weighted mean; one
    rank of the cluster is global zero and is the only one that writes checkpoints, with
    the full state dict of the model it trained; the groups end as one model."""
    from gossip.transport.ports import free_ports
    from tests.cluster import Cluster

    pa, pb = (free_ports(2, consecutive=True)[0] for _ in range(2))
    with Cluster(tmp_path) as c:
        procs = {name: c.start(name, ["--out", str(tmp_path / name), "--dir", str(tmp_path / f"d{name}"), "--intra",
                                      intra], port=port, script=TORCHRUN_SCRIPT, torchrun=2,
                               env={"GOSSIP_PEERS": f"127.0.0.1:{other}"})
                 for name, port, other in (("a", pa, pb), ("b", pb, pa))}
        for x in procs.values():
            assert x.wait(400) == 0 and "Traceback" not in x.log(), x.log()[-3000:]
    ranks = {(name, r): json.loads((tmp_path / name / f"rank-{r}.json").read_text()) for name in "ab" for r in (0, 1)}
    ids = sorted(x.addr for x in procs.values())
    for (name, r), d in ranks.items():
        m = ids.index(procs[name].addr)
        assert d["type"] == "GroupNode" and d["id"] == procs[name].addr, d
        assert (d["global_rank"], d["world_size"]) == (2 * m + r, 4), d
        assert d["global_step"] == 12 and d["summary"]["trained_steps"] == 12, d  # 240 / 4 ranks / 10: 6 an epoch
        assert d["summary"]["timed_out_rounds"] == 0, d["summary"]
        assert d["metrics"]["val_shard"] == 1.5 and d["metrics"]["val_count"] == 80.0, d["metrics"]
        assert d["metrics"]["val_loss"] < 0.5, d["metrics"]  # (it learned: about 0.69 untrained)
        assert d["average"] == 2.0, d  # (0*1 + 1*2 + 2*3 + 3*4) / (1 + 2 + 3 + 4)
    assert len({d["metrics"]["val_loss"] for d in ranks.values()}) == 1, ranks
    for e in range(2):  # each epoch: 4 disjoint quarters of the 240 samples
        parts = [set(d["seen"][60 * e:60 * (e + 1)]) for d in ranks.values()]
        assert [len(p) for p in parts] == [60] * 4 and len(set().union(*parts)) == 240, e
    zero = [k for k, d in ranks.items() if d["is_global_zero"]]
    first = [name for name in "ab" if procs[name].addr == ids[0]][0]
    assert zero == [(first, 0)], zero
    written = {(name, r): sorted(p.name for p in (tmp_path / f"d{name}" / f"rank-{r}").rglob("*.ckpt"))
               for name in "ab" for r in (0, 1)}
    assert {k: bool(v) for k, v in written.items()} == {k: k == (first, 0) for k in written}, written
    assert "final.ckpt" in written[(first, 0)] and any(n.startswith("epoch=1-step=12") for n in written[(first, 0)])
    flats = {k: torch.load(tmp_path / k[0] / f"flat-{k[1]}.pt") for k in ranks}
    for name in "ab":
        assert torch.equal(flats[(name, 0)], flats[(name, 1)])  # (DDP's replicas alike; FSDP's gathered alike)
    assert (flats[("a", 0)] - flats[("b", 0)]).abs().max() < 1e-6  # the last step's exchange: the average
    ckpt = torch.load(tmp_path / f"d{first}" / "rank-0" / "final.ckpt", weights_only=False)
    state = ckpt["state_dict"]
    # the optimizer's state as an unsharded optimizer's: by parameter index, whole momentum buffers
    momenta = {i: tuple(v["momentum_buffer"].shape) for i, v in ckpt["optimizer_states"][0]["state"].items()}
    assert momenta == {0: (16, 8), 1: (16,), 2: (2, 16), 3: (2,)}, momenta
    assert sorted(state) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"], sorted(state)
    # (under FSDP: whole tensors gathered from both ranks' shards, not one rank's DTensor shards)
    assert all(type(v) is torch.Tensor for v in state.values()), {k: type(v) for k, v in state.items()}
    assert torch.equal(torch.cat([state[k].reshape(-1) for k in ("net.0.weight", "net.0.bias", "net.2.weight",
                                                                 "net.2.bias")]), flats[(first, 0)])
