"""The batched engine (gossip.sim.batched, gossip.sim.replicas) against the per-node engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from gossip.api import SimConfig, Simulation, simulate
from gossip.cli import sim_main
from gossip.core.state import FlatState
from gossip.sim.batched import ENGINES, BatchedSteps, batch_support, parse_engine
from gossip.sim.replicas import ReplicaRows, stacked_optimizer
from gossip.training.tasks import SyntheticTask


TOL = 2e-4  # float rounding of batched matmuls, carried through a few hundred steps of mixing


# the four rules, each with uniform and with heterogeneous compute speeds. CHOCO compresses
# with random-k: top-k's choice of entries is a discontinuity (a rounding-sized difference between
# the engines' matmuls swaps two near-equal entries, and after 200 steps the runs are ~5e-3 apart),
# while random-k draws its entries from the seed, so the engines still agree to float rounding
RULES = {
    "sync-gossip": dict(topology="ring", algorithm="gossip"),
    "async-staleness": dict(topology="exponential", algorithm="gossip", asynchronous=True, staleness="poly:1"),
    "choco-randk": dict(topology="ring", algorithm="choco", compression="randk:0.1", gamma=0.1),
    "push-sum-time-varying": dict(topology="one-peer-exponential", algorithm="push-sum"),
}


SPEEDS = {
    "uniform": dict(compute="fixed:0.01"),
    "heterogeneous": dict(compute="lognormal:0.01,0.5", slow="1=3,5=1.7"),
}


def run_both(**kw):
    cfg = SimConfig(**{"nodes": 8, "task": "digits", "steps": 200, "seed": 3, "eval_every": 100, **kw})
    per = simulate(dataclasses.replace(cfg, engine="per-node"))
    bat = simulate(dataclasses.replace(cfg, engine="batched"))
    return per, bat


def assert_same(per, bat, tol=TOL):
    assert per.summary["engine"] == "per-node" and bat.summary["engine"] == "batched"
    a, b = torch.stack(per.params), torch.stack(bat.params)
    assert a.shape == b.shape
    assert (a - b).abs().max().item() <= tol, (a - b).abs().max().item()
    # the same schedule: the same simulated time, bytes and mixing figures
    for key in ("sim_time_s", "bytes_sent", "missing_neighbors", "steps"):
        assert per.summary[key] == bat.summary[key], key
    assert per.summary["final_accuracy"] == pytest.approx(bat.summary["final_accuracy"], abs=0.02)


@pytest.mark.numeric
@pytest.mark.parametrize("speed", sorted(SPEEDS))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_batched_engine_gives_the_per_node_parameters(rule, speed):
    per, bat = run_both(**RULES[rule], **SPEEDS[speed])
    assert_same(per, bat)
    params = torch.stack(bat.params)
    init = torch.stack(Simulation(SimConfig(nodes=8, task="digits", steps=0, seed=3)).run().result().params)
    assert (params - init).abs().max() > 0.05  # they trained: agreement is not two untouched copies
    assert bat.summary["final_accuracy"] > 0.5
    if rule == "async-staleness":
        assert bat.summary["mean_staleness"] > 0
    if speed == "heterogeneous":  # rows stepped in different groups: not all nodes at once
        assert params.std(0).max() > 0


def test_batched_engine_is_deterministic_for_a_seed():
    cfg = SimConfig(nodes=6, task="synthetic", steps=60, seed=11, engine="batched", compute="exponential:0.01",
                    asynchronous=True)
    a, b = simulate(cfg), simulate(cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.params, b.params))
    c = simulate(dataclasses.replace(cfg, seed=12))
    assert not torch.equal(a.params[0], c.params[0])


def test_a_run_with_faults_runs_the_real_protocol_whatever_the_engine_allows():
    # faults run every node's real control plane (gossip.sim.fault_runs), one model at a time:
    # auto and per-node both mean that engine, and give the same run; the vectorised
    # engines cannot run it and say so
    cfg = SimConfig(nodes=8, task="digits", steps=150, seed=3, eval_every=100, topology="ring",
                    faults=["crash:2@0.4", "join:2@0.9"], detect=0.1)
    auto, per = simulate(cfg), simulate(dataclasses.replace(cfg, engine="per-node"))
    assert auto.summary["engine"] == per.summary["engine"] == "protocol"
    assert "real control plane" in auto.summary["engine_note"]
    assert all(torch.equal(a, b) for a, b in zip(auto.params, per.params))
    assert auto.summary["sim_time_s"] == per.summary["sim_time_s"]
    assert auto.summary["faults"] == ["0.400s crash 2", "0.900s join 2"]
    for engine in ("batched", "lockstep"):
        with pytest.raises(ValueError, match=f"engine '{engine}' cannot run a simulation with faults"):
            Simulation(dataclasses.replace(cfg, engine=engine))


@pytest.mark.numeric
def test_nonfinite_steps_recover_alike():
    # node 1's data hold infinities now and then: the NaN guard restores, in both engines the same way
    base = SyntheticTask(samples=800, test_samples=200, batch_size=8)
    X = base.X.clone()
    shard = base.shard(1, 4, "iid", 5)
    X[shard[::5]] = float("inf")
    task = SyntheticTask(samples=800, test_samples=200, batch_size=8)
    task.X = X
    cfg = SimConfig(nodes=4, task=task, steps=120, seed=5, eval_every=60)
    sims = {e: Simulation(dataclasses.replace(cfg, engine=e)).run() for e in ("per-node", "batched")}
    rec = {e: s.sim.nodes[1].recoveries for e, s in sims.items()}
    assert rec["per-node"] > 0 and rec["per-node"] == rec["batched"]
    assert sims["batched"].sim.nodes[0].recoveries == 0
    a = torch.stack([n.state.flat for n in sims["per-node"].sim.nodes])
    b = torch.stack([n.state.flat for n in sims["batched"].sim.nodes])
    assert torch.isfinite(b).all() and (a - b).abs().max() <= TOL


def test_node_state_is_a_view_of_its_row():
    sim = Simulation(SimConfig(nodes=5, task="synthetic", steps=10, engine="batched"))
    steps = sim.batched
    assert isinstance(steps, BatchedSteps)
    for i, node in enumerate(sim.nodes):
        assert node.state.is_bound() and steps.rows.is_bound(steps.row_of[i], node.state)
    sim.run()
    # the steps ran vectorised: fewer calls than node-steps, and every node took all its steps
    assert steps.steps == 5 * 10 and steps.flushes < steps.steps
    assert all(n.step == 10 for n in sim.nodes)
    row = steps.matrix[steps.row_of[3]]
    assert torch.equal(row, sim.nodes[3].state.flat)
    with torch.no_grad():
        row.add_(1.0)
    assert torch.equal(sim.nodes[3].state.flat, row)  # same memory, not a copy


def test_auto_falls_back_to_per_node_and_batched_says_why():
    class Unbatchable(SyntheticTask):
        batchable = False

    task = Unbatchable(samples=200, test_samples=50)
    assert simulate(SimConfig(nodes=3, task=task, steps=5)).summary["engine"] == "per-node"
    with pytest.raises(ValueError, match="does not declare batchable"):
        simulate(SimConfig(nodes=3, task=task, steps=5, engine="batched"))
    # a measured compute time is each node's own wall time: per node
    auto = Simulation(SimConfig(nodes=3, task="synthetic", steps=5, compute="measured"))
    assert auto.batched is None and "measured" in auto.engine_note
    with pytest.raises(ValueError, match="measured"):
        Simulation(SimConfig(nodes=3, task="synthetic", steps=5, compute="measured", engine="batched"))


class _Variant(SyntheticTask):
    """A synthetic task with another model or optimizer."""

    def __init__(self, model_fn=None, opt_fn=None) -> None:
        super().__init__(samples=200, test_samples=50, dim=8, model_fn=model_fn)
        self.opt_fn = opt_fn

    def optimizer(self, params):
        return self.opt_fn(params) if self.opt_fn else super().optimizer(params)


@pytest.mark.parametrize("task,needle", [
    (_Variant(opt_fn=lambda p: torch.optim.RMSprop(p, lr=0.01)), "RMSprop has no stacked form"),
    (_Variant(opt_fn=lambda p: torch.optim.LBFGS(p)), "LBFGS has no stacked form"),
    (_Variant(model_fn=lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 10))), "buffers"),
    (_Variant(model_fn=lambda: nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 10))),
     "does not vectorise"),
])
def test_tasks_that_cannot_batch_are_refused_with_the_reason(task, needle):
    sim = Simulation(SimConfig(nodes=2, task=task, steps=3))
    assert sim.batched is None and needle in sim.engine_note
    assert batch_support(task, sim.nodes) == sim.engine_note
    with pytest.raises(ValueError, match=needle):
        Simulation(SimConfig(nodes=2, task=task, steps=3, engine="batched"))


class _OwnLoss(_Variant):
    def loss(self, model, batch):  # changes the loss, inherits batchable from SyntheticTask
        return super().loss(model, batch) * 2.0


class _OwnLossDeclared(_OwnLoss):
    batchable = True  # its author says the new loss still batches


def test_a_subclass_that_changes_loss_or_batches_must_declare_batchable_itself():
    """A task subclass that overrides loss() or stream(), or a stream whose next() was
    replaced, runs per node unless it says it still batches: the batched engine draws
    batches by index and computes the loss functionally, and would bypass them (the
    NaN-guard test patched a stream's next() and the batched engine never saw it)."""
    sim = Simulation(SimConfig(nodes=2, task=_OwnLoss(), steps=3))
    assert sim.batched is None and "overrides loss() without declaring batchable" in sim.engine_note
    assert Simulation(SimConfig(nodes=2, task=_OwnLossDeclared(), steps=3)).batched is not None
    sim = Simulation(SimConfig(nodes=2, task=_Variant(), steps=3))
    sim.nodes[1].stream.next = sim.nodes[1].stream.next
    assert "its own next()" in batch_support(sim.task, sim.nodes)


def test_engine_names_are_checked():
    assert parse_engine("batched") == "batched" and ENGINES == ("auto", "lockstep", "batched", "per-node")
    with pytest.raises(ValueError, match="unknown engine 'fast'; valid: auto, lockstep, batched, per-node"):
        SimConfig(engine="fast")


def test_cli_engine_flag(capsys):
    assert sim_main(["--nodes", "3", "--steps", "4", "--engine", "per-node", "--json"]) == 0
    assert '"engine": "per-node"' in capsys.readouterr().out
    assert sim_main(["--nodes", "3", "--steps", "4", "--engine", "batched", "--json"]) == 0
    assert '"engine": "batched"' in capsys.readouterr().out
    assert sim_main(["--nodes", "3", "--steps", "4", "--engine", "lockstep", "--json"]) == 0
    assert '"engine": "lockstep"' in capsys.readouterr().out
    assert sim_main(["--nodes", "3", "--steps", "4", "--async", "--engine", "lockstep"]) == 2
    assert "engine 'lockstep' cannot run this simulation: node 0 mixes with AsyncGossipRule" in capsys.readouterr().err
    assert sim_main(["--nodes", "3", "--steps", "4", "--engine", "vector"]) == 2
    assert "unknown engine 'vector'" in capsys.readouterr().err


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum-dampening-wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.3, weight_decay=1e-2),
    "sgd-nesterov-maximize": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True, maximize=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-3),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, betas=(0.8, 0.9)),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}


@pytest.mark.numeric
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_stacked_optimizer_steps_each_row_as_its_own_optimizer(name):
    make = OPTIMIZERS[name]
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)) for _ in range(5)]
    refs = [nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)) for _ in range(5)]
    for m, r in zip(models, refs):
        r.load_state_dict(m.state_dict())
    states = [FlatState(m) for m in models]
    ref_states = [FlatState(r) for r in refs]
    ref_opts = [make(r.parameters()) for r in refs]
    rows = ReplicaRows(states)
    P = states[0].numel
    opt = stacked_optimizer(make(models[0].parameters()), states[0].slots, 5, P, torch.float32, torch.device("cpu"))
    assert not isinstance(opt, str)
    init = rows.matrix.clone()
    gen = torch.Generator().manual_seed(1)
    # rows step in changing groups (a block, a scattered set), and row 2 restarts once
    schedule = [[0, 1, 2, 3, 4], [1, 2], [0, 3, 4], [4, 2, 0], [0, 1, 2, 3, 4], [3], [1, 2, 3]] * 3
    for t, chosen in enumerate(schedule):
        if t == 9:
            opt.reset(2)
            ref_opts[2] = make(refs[2].parameters())
        chosen = sorted(chosen)
        grad = torch.randn(len(chosen), P, generator=gen)
        for g, r in zip(grad, chosen):
            for s, p in zip(ref_states[r].slots, refs[r].parameters()):
                p.grad = g[s.offset:s.offset + s.numel].view(s.shape).clone()
            ref_opts[r].step()
        if chosen == list(range(chosen[0], chosen[-1] + 1)):
            sel = slice(chosen[0], chosen[-1] + 1)
            opt.step(rows.matrix[sel], grad, sel)
        else:
            idx = torch.tensor(chosen)
            x = rows.matrix.index_select(0, idx)
            opt.step(x, grad, idx)
            rows.matrix.index_copy_(0, idx, x)
    expected = torch.stack([s.flat for s in ref_states])
    assert (rows.matrix - expected).abs().max().item() < 1e-6
    assert (expected - init).abs().min() > 0  # every value moved: a no-op would not pass


@pytest.mark.numeric
def test_parameter_groups_keep_their_own_settings():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    state = FlatState(model)
    groups = [{"params": list(model[0].parameters()), "lr": 0.5}, {"params": list(model[1].parameters()), "lr": 0.0}]
    opt = stacked_optimizer(torch.optim.SGD(groups, lr=0.1), state.slots, 1, state.numel, torch.float32,
                            torch.device("cpu"))
    rows = ReplicaRows([state])
    before = rows.matrix.clone()
    opt.step(rows.matrix[0:1], torch.ones(1, state.numel), slice(0, 1))
    first = model[0].weight.numel() + model[0].bias.numel()
    assert torch.allclose(rows.matrix[0, :first], before[0, :first] - 0.5)
    assert torch.equal(rows.matrix[0, first:], before[0, first:])  # lr 0: untouched


def test_memoised_message_sizes_are_exact():
    # the simulator memoises wire sizes by field widths; every width boundary must agree
    from gossip.compression import get_codec
    from gossip.core.message import STATE, Message
    from gossip.sim.engine import MessageSizes
    from gossip.transport.wire import message_size

    sizes = MessageSizes()
    payloads = [get_codec("identity").encode(torch.zeros(n)) for n in (10, 300)]
    edges = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32]
    checked = 0
    for data in payloads:
        for seq in edges:
            for rnd in (0, 128, 70000):
                for weight in (None, 0.25):
                    for sender in (3, 300, "tcp://10.0.0.1:5555"):
                        msg = Message(STATE, sender, rnd, seq // 2, seq, data, weight, {}, "abcd")
                        assert sizes(msg) == message_size(msg), (seq, rnd, weight, sender)
                        checked += 1
    assert checked == 2 * len(edges) * 3 * 2 * 3 and len(sizes._known) < checked  # it did memoise
    extra = Message(STATE, 1, 0, 0, 1, payloads[0], None, {"cseq": 5}, "abcd")
    assert sizes(extra) == message_size(extra)


@pytest.mark.numeric
def test_outer_optimizer_runs_alike():
    # an outer optimizer (DiLoCo-style Nesterov over the period's pseudo-gradient) acts in the mixing layer
    per, bat = run_both(topology="ring", steps=120, outer="nesterov", period=4)
    assert_same(per, bat)


def test_character_language_model_batches():
    # the example's transformer (tied embeddings, a causal bool mask, LayerNorm, AdamW) vectorises too
    from examples import language_model as lm

    corpus = lm.Corpus(lm.stdlib_sources(30_000), block=16)
    task = lm.CharLMTask(corpus, dim=32, heads=2, layers=1, batch_size=4, eval_windows=16)
    cfg = SimConfig(nodes=4, task=task, steps=40, seed=1, eval_every=20, topology="ring")
    per = simulate(dataclasses.replace(cfg, engine="per-node"))
    bat = simulate(dataclasses.replace(cfg, engine="batched"))
    # Adam divides by sqrt(v): where a gradient is ~0, a rounding-sized difference moves that
    # coordinate by up to lr, so bound the worst coordinate by lr and nearly all by rounding
    assert_same(per, bat, tol=task.lr)
    diff = (torch.stack(per.params) - torch.stack(bat.params)).abs()
    assert (diff < 1e-5).float().mean() > 0.99 and diff.median() < 1e-7
    init = torch.stack(simulate(dataclasses.replace(cfg, steps=0)).params)
    assert (torch.stack(bat.params) - init).abs().max() > 1e-3  # AdamW moved them


@pytest.mark.numeric
def test_batched_evaluation_matches_each_nodes_own():
    sim = Simulation(SimConfig(nodes=7, task="digits", steps=30, seed=4, engine="batched", slow="2=3"))
    sim.run(until=0.15)
    assert len({n.step for n in sim.nodes}) > 1  # nodes at different steps: different models
    stacked = sim.batched.evaluate(sim.nodes, block=3)  # blocks of 3 rows: 3 vectorised calls
    own = [sim.task.evaluate(n.model) for n in sim.nodes]
    assert len(stacked) == 7
    n_test = len(sim.task.y_test)
    for s, o, node in zip(stacked, own, sim.nodes):
        assert s["loss"] == pytest.approx(o["loss"], abs=1e-5)
        # accuracy counts argmaxes, and the two forwards round differently: a sample whose top two
        # logits are closer than 1e-4 (far above the ~1e-6 the forwards can differ by) may be
        # counted either way, no other may
        with torch.no_grad():
            top2 = node.model(sim.task.X_test).topk(2, dim=1).values
        ties = int((top2[:, 0] - top2[:, 1] < 1e-4).sum())
        assert round(abs(s["accuracy"] - o["accuracy"]) * n_test) <= ties
    assert len({round(o["loss"], 6) for o in own}) > 1
    # a task without a stacked evaluation is evaluated per node
    class Plain(SyntheticTask):
        evaluate_stacked = None

    plain = Simulation(SimConfig(nodes=3, task=Plain(samples=200, test_samples=50), steps=4, engine="batched"))
    assert plain.batched.evaluate(plain.nodes) is None
    assert plain.run().result().summary["mean_node_accuracy"] > 0


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_stacked_draws_are_each_streams_own(batch):
    """StackedDraws.draw() is every stream's next_indices() stacked, and leaves every
    stream (order, position, epoch, generator) where those calls leave it: shards of
    the batch size (a new epoch every call, one sample drawing nothing) and larger
    ones, mixed, and a stream restored mid-epoch."""
    from gossip.training.data import BatchStream, StackedDraws

    data = (torch.arange(100),)
    sizes = [batch, batch, 5, batch, 7, batch] if batch > 1 else [1, 1, 4, 1, 1]

    def streams():
        out, lo = [], 0
        for j, n in enumerate(sizes):
            out.append(BatchStream(data, list(range(lo, lo + n)), batch, seed=100 + j))
            lo += n
        return out

    mine, theirs = streams(), streams()
    draws = StackedDraws(mine)
    for k in range(9):
        if k == 4:  # a stream restored from another's state mid-epoch
            theirs[2].next_indices()
            for s in (mine[2], theirs[2]):
                s.load_state_dict(theirs[2].state_dict())
            state = dict(theirs[0].state_dict(), pos=0)  # a whole-shard stream whose order is not used up
            for s in (mine[0], theirs[0]):
                s.load_state_dict(state)
        got = draws.draw()
        want = torch.stack([s.next_indices() for s in theirs])
        assert torch.equal(got, want), k
    for a, b in zip(mine, theirs):
        assert torch.equal(a.generator.get_state(), b.generator.get_state())
        assert (a._pos, a.epoch) == (b._pos, b.epoch) and torch.equal(a._order, b._order)
        assert torch.equal(a.next_indices(), b.next_indices())
    with pytest.raises(ValueError, match="different batch sizes"):
        StackedDraws([BatchStream(data, [0, 1], 2, seed=0), BatchStream(data, [2, 3, 4], 3, seed=0)])
