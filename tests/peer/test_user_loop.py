"""GossipNode: gossip inside the user's own training loop, two real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_two_user_loops_gossip_and_agree():
    p0, p1 = free_port(), free_port()
    script = str(ROOT / "examples" / "own_training_loop.py")
    procs = [subprocess.Popen([sys.executable, script, "--listen", f"127.0.0.1:{a}", "--peers", f"127.0.0.1:{b}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for a, b in ((p0, p1), (p1, p0))]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    a, b = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert {a["rank"], b["rank"]} == {0, 1} and a["world_size"] == b["world_size"] == 2
    assert a["accuracy"] > 0.8 and b["accuracy"] > 0.8
    # two nodes on a ring average exactly: after the last exchange they hold the same model, up to
    # the last bit (a mixes lerp(x_a, x_b, 1/2), b the mirror lerp(x_b, x_a, 1/2): where x_b - x_a
    # rounds, the two midpoints may round apart)
    # (neighbor_distance is measured against the neighbour's last *sent*, pre-mixing parameters)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0) and a["neighbor_distance"] < 0.05
    # unseeded models: equal only because GossipNode starts both from the first member's
    assert a["steps"] == b["steps"] >= 300
    assert a["cluster_accuracy"] == b["cluster_accuracy"] == (a["accuracy"] + b["accuracy"]) / 2
    assert a["bytes_sent"] > 150 * 2762 * 4


# -- in one process: the API's own behaviour --------------------------------------------------

import logging  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import gossip  # noqa: E402
from gossip.core.checkpoint import latest_checkpoint  # noqa: E402

FAST = dict(settle=0.2, heartbeat=0.2, handle_signals=False)


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def test_dir_lists_the_api():
    names = dir(gossip)
    for name in ("GossipNode", "ShardSampler", "shard", "simulate", "MixingSettings"):
        assert name in names and getattr(gossip, name) is not None


def test_shards_of_a_torch_dataset_have_equal_lengths():
    ds = TensorDataset(torch.arange(10))
    parts = [gossip.shard(ds, r, 3) for r in range(3)]
    assert [len(p) for p in parts] == [4, 4, 4]
    assert sorted(int(x) for p in parts for (x,) in p) == [0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # padded from the start
    samplers = [gossip.ShardSampler(ds, 3, r, seed=1) for r in range(3)]
    for s in samplers:
        s.set_epoch(2)
    epoch = [list(s) for s in samplers]
    assert [len(e) for e in epoch] == [4, 4, 4] and set(sum(epoch, [])) == set(range(10))
    samplers[0].set_epoch(2)
    samplers[0].skip(3)
    assert list(samplers[0]) == epoch[0][3:] and list(samplers[0]) == epoch[0]  # skips one iteration only
    with pytest.raises(ValueError, match="rank must be in"):
        gossip.shard(ds, 3, 3)


def test_errors_name_the_apis_parameters(monkeypatch):
    model, opt = _model(0)
    with pytest.raises(ValueError, match=r"^listen '5555' is not HOST:PORT"):
        gossip.GossipNode(model, opt, listen="5555")
    with pytest.raises(ValueError, match="^rank and world_size go together"):
        gossip.GossipNode(model, opt, listen=f"127.0.0.1:{free_port()}", rank=0)
    monkeypatch.delenv("GOSSIP_LISTEN", raising=False)
    with pytest.raises(ValueError, match="listen is required"):
        gossip.GossipNode(model, opt)


def test_a_lone_node_says_what_it_waits_for(caplog):
    caplog.set_level(logging.INFO, logger="gossip")
    model, opt = _model(0)
    t0 = time.monotonic()
    node = gossip.GossipNode(model, opt, listen=f"127.0.0.1:{free_port()}", peers=[f"127.0.0.1:{free_port()}"],
                             join_timeout=3.0, **FAST)
    try:
        assert time.monotonic() - t0 < 30 and node.world_size == 1
        assert "no peer has answered yet" in caplog.text and "training alone in" in caplog.text
    finally:
        node.close()


def test_checkpoints_are_written_and_resumed_at_the_step_and_epoch(tmp_path):
    """A lone node: checkpoints every 3 steps and at close; a new process (here: a new
    node and a new model) continues from the newest one, in the right epoch, skipping
    the batches of that epoch already done."""
    ck = tmp_path / "ck"
    data = TensorDataset(torch.randn(40, 4), torch.randint(2, (40,)))
    model, opt = _model(0)
    node = gossip.GossipNode(model, opt, listen=f"127.0.0.1:{free_port()}", checkpoint_dir=ck,
                             checkpoint_every=3, **FAST)
    assert ck.is_dir()  # made at once, not at the first checkpoint
    loader = DataLoader(data, batch_size=4, sampler=node.sampler(data))
    assert len(loader) == 10
    for epoch in node.epochs(5, loader):
        for i, (x, y) in enumerate(loader):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()  # counted by the optimizer hook: no node.step() in the loop
            if node.steps == 6:
                assert latest_checkpoint(ck).name == "ckpt-000000000006.pt"
            if node.steps == 13:
                break
        if node.steps == 13:
            break
    saved = _flat(model)
    summary = node.close()
    assert summary["steps"] == 13 and summary["trained_steps"] == 13
    assert latest_checkpoint(ck).name == "ckpt-000000000013.pt"

    model2, opt2 = _model(1)
    assert not torch.equal(_flat(model2), saved)
    node2 = gossip.GossipNode(model2, opt2, listen=f"127.0.0.1:{free_port()}", checkpoint_dir=ck, **FAST)
    try:
        assert node2.steps == 13 and node2.start_step == 13
        assert torch.equal(_flat(model2), saved)
        assert opt2.state_dict()["state"], "the optimizer's momentum comes back too"
        loader2 = DataLoader(data, batch_size=4, sampler=node2.sampler(data))
        seen = []
        for epoch in node2.epochs(range(1, 4), loader2):
            seen.append((epoch, sum(1 for _ in loader2)))
        assert seen == [(2, 7), (3, 10)]  # epoch 2 (of 1..3) after its 3rd batch, then a whole one
    finally:
        node2.close()


def test_a_scheduler_is_checkpointed_and_resumed_with_the_optimizer(tmp_path):
    """scheduler= : its state rides in each checkpoint; a restart continues the schedule
    where the checkpoint left it (learning rate and step count), not from its start."""
    ck = tmp_path / "ck"
    model, opt = _model(0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
    node = gossip.GossipNode(model, opt, listen=f"127.0.0.1:{free_port()}", checkpoint_dir=ck,
                             scheduler=sched, **FAST)
    x, y = torch.randn(8, 4), torch.randint(2, (8,))
    for _ in range(7):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
    lr7 = opt.param_groups[0]["lr"]
    node.close()
    model2, opt2 = _model(1)
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=20)
    assert opt2.param_groups[0]["lr"] != lr7
    node2 = gossip.GossipNode(model2, opt2, listen=f"127.0.0.1:{free_port()}", checkpoint_dir=ck,
                              scheduler=[sched2], **FAST)
    try:
        assert node2.start_step == 7 and sched2.last_epoch == 7
        assert opt2.param_groups[0]["lr"] == pytest.approx(lr7, rel=1e-12)
        opt2.step()
        sched2.step()
        sched.step()  # the uninterrupted schedule's next value
        assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12)
    finally:
        node2.close()


def test_a_scheduler_of_another_optimizer_is_refused():
    model, opt = _model(0)
    other = torch.optim.SGD(_model(1)[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="scheduler must schedule the optimizer given"):
        gossip.GossipNode(model, opt, listen=f"127.0.0.1:{free_port()}",
                          scheduler=torch.optim.lr_scheduler.StepLR(other, 3), **FAST)
    with pytest.raises(ValueError, match="scheduler must be a learning-rate scheduler"):
        gossip.GossipNode(model, opt, listen=f"127.0.0.1:{free_port()}", scheduler=3, **FAST)


def _in_threads(fns):
    out, errors = [None] * len(fns), []

    def run(i):
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a node did not finish in 120 s"
    return out


def test_two_nodes_agree_on_a_start_average_metrics_and_evaluate_the_consensus():
    ports = [free_port(), free_port()]
    models = [_model(10), _model(11)]
    inits = [_flat(m) for m, _ in models]
    assert not torch.equal(inits[0], inits[1])

    def make(i, same_start):
        m, o = models[i]
        return gossip.GossipNode(m, o, listen=f"127.0.0.1:{ports[i]}", peers=[f"127.0.0.1:{ports[1 - i]}"],
                                 same_start=same_start, **FAST)

    nodes = _in_threads([lambda: make(0, False), lambda: make(1, False)])
    try:
        assert torch.equal(_flat(models[0][0]), inits[0]) and torch.equal(_flat(models[1][0]), inits[1])
        means = _in_threads([lambda: nodes[0].average(float(nodes[0].rank + 1), weight=1 + nodes[0].rank),
                             lambda: nodes[1].average(float(nodes[1].rank + 1), weight=1 + nodes[1].rank)])
        assert means == [5 / 3, 5 / 3]  # (1*1 + 2*2) / 3, the same float on both
        vec = _in_threads([lambda: nodes[0].average([1.0, float(nodes[0].rank)]),
                           lambda: nodes[1].average([1.0, float(nodes[1].rank)])])
        assert vec == [[1.0, 0.5], [1.0, 0.5]]

        def consensus(i):
            with nodes[i].consensus_model() as m:
                inside = _flat(m)
            return inside, _flat(models[i][0]), nodes[i].consensus_distance

        (a, a_after, da), (b, b_after, db) = _in_threads([lambda: consensus(0), lambda: consensus(1)])
        mean = (inits[0] + inits[1]) / 2
        assert torch.allclose(a, mean, atol=1e-6) and torch.equal(a, b)
        assert torch.equal(a_after, inits[0]) and torch.equal(b_after, inits[1])  # own parameters back
        want = float(((inits[0] - inits[1]) ** 2).sum()) / 4
        assert da == db and da == pytest.approx(want, rel=1e-5)
    finally:
        _in_threads([nodes[0].close, nodes[1].close])

    # the same two again with same_start (the default): both take the first member's parameters
    ports[:] = [free_port(), free_port()]
    models[:] = [_model(10), _model(11)]
    nodes = _in_threads([lambda: make(0, True), lambda: make(1, True)])
    try:
        first = 0 if nodes[0].rank == 0 else 1
        assert torch.equal(_flat(models[0][0]), inits[first]) and torch.equal(_flat(models[1][0]), inits[first])
    finally:
        _in_threads([nodes[0].close, nodes[1].close])


SIGTERMED = """
import sys, torch
import gossip
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
node = gossip.GossipNode(model, opt, listen=sys.argv[1], checkpoint_dir=sys.argv[2], settle=0.2)
x = torch.randn(8, 4)
while True:
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    if node.steps == 20:
        print("stepping", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_a_user_loop_with_a_checkpoint_and_a_goodbye(tmp_path, sig):
    script = tmp_path / "loop.py"
    script.write_text(SIGTERMED)
    ck = tmp_path / "ck"
    # a shell that starts the test run in the background hands its children SIGINT
    # ignored, and GossipNode leaves an ignored signal alone: give the script the default
    p = subprocess.Popen([sys.executable, str(script), f"127.0.0.1:{free_port()}", str(ck)], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert p.stdout.readline().strip() == "stepping", p.stderr.read()[-2000:]
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    # logged by the library without any logging set up by the script
    assert f"{signal.Signals(sig).name}: stopping at the next step" in err, err[-2000:]
    assert "training as 0 of 1" in err
    # SIGTERM: exit status 143; Ctrl+C: KeyboardInterrupt, which Python ends with SIGINT
    assert p.returncode == (128 + sig if sig == signal.SIGTERM else -signal.SIGINT), err[-2000:]
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in err
    step = int(re.search(r"ckpt-(\d+)\.pt", latest_checkpoint(ck).name).group(1))
    assert step >= 20, step
