"""A node is a group of devices: what runs inside one group, in this process.

torchrun's environment (``group_env``), the group and its wrap of the model
(``start_group``, ``Group.wrap``), the shard each rank gossips (``ReplicaSlice``,
``FsdpShards``), sharded checkpoints, and the simulator's model of K streams. The
protocol between groups (rank 0 leads, the ranks follow) is in
tests/protocol/test_group.py; real groups under torchrun in test_groups_real.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gossip.groups.checkpoint import (
    latest_group_checkpoint,
    load_group_checkpoint,
    restore_node,
    save_group_checkpoint,
)
from gossip.groups.group import Group, GroupEnv, GroupError, group_env, start_group
from gossip.mixing.settings import MixingSettings
from gossip.protocol.group import Decision, ShardFollower
from gossip.core.state import FlatState
from gossip.protocol.group import ShardModule
from gossip.training.shards import ReplicaSlice, SlicePlace, take_slices
from gossip.training.tasks import get_task
from gossip.transport.ports import free_ports

TORCHRUN = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


# -- torchrun's environment ----------------------------------------------------------------------

def test_without_torchrun_a_process_is_a_group_of_one() -> None:
    assert group_env({}) == GroupEnv()
    assert group_env({"PATH": "/bin", "LOCAL_RANK": "3"}).launched is False  # RANK and WORLD_SIZE decide
    g = start_group("ddp", "auto", environ={})
    assert (g.size, g.rank, g.pg, g.backend) == (1, 0, None, None)
    assert g.device == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    assert g.link() is None  # no other rank to tell anything
    model, view = g.wrap(torch.nn.Linear(3, 2))
    assert isinstance(view, ReplicaSlice) and view.flat.numel() == view.total == 8 and view.is_bound()
    with torch.no_grad():
        view.flat.fill_(0.5)  # the view is the model's memory
    assert float(model.weight.detach().sum()) == pytest.approx(3.0)
    g.barrier()  # nothing to wait for
    g.close()


def test_torchruns_variables_are_read_and_each_error_names_the_variable() -> None:
    env = group_env(dict(TORCHRUN, RANK="1", LOCAL_RANK="1"))
    assert (env.rank, env.local_rank, env.size, env.local_size, env.master_addr, env.master_port, env.launched) == \
        (1, 1, 2, 2, "127.0.0.1", 29500, True)
    for environ, needle in [
        ({k: v for k, v in TORCHRUN.items() if k != "LOCAL_RANK"}, "LOCAL_RANK is not set, but torchrun's other"),
        (dict(TORCHRUN, RANK="2"), "RANK 2 is not below WORLD_SIZE 2"),
        (dict(TORCHRUN, LOCAL_RANK="2"), "LOCAL_RANK 2 is not below LOCAL_WORLD_SIZE 2"),
        (dict(TORCHRUN, WORLD_SIZE="two"), "WORLD_SIZE must be an integer, got 'two'"),
        (dict(TORCHRUN, WORLD_SIZE="0"), "WORLD_SIZE must be >= 1, got 0"),
        (dict(TORCHRUN, MASTER_PORT="0"), "MASTER_PORT must be >= 1, got 0"),
        (dict(TORCHRUN, MASTER_ADDR=""), "MASTER_ADDR is not set: launch with torchrun"),
    ]:
        with pytest.raises(GroupError) as e:
            group_env(environ)
        assert needle in str(e.value)
    assert issubclass(GroupError, ValueError)  # the driver's one-line exit 2


def test_a_bad_intra_or_fsdp_without_torchrun_is_refused_before_anything_starts() -> None:
    with pytest.raises(GroupError, match="intra must be one of ddp, fsdp, got 'zero3'"):
        start_group("zero3", "cpu", environ={})
    with pytest.raises(GroupError, match="torchrun --nproc-per-node K"):
        start_group("fsdp", "cpu", environ={})


def test_the_examples_in_the_docstrings_hold() -> None:
    import doctest

    import gossip.groups.group

    result = doctest.testmod(gossip.groups.group)
    assert result.attempted >= 2 and result.failed == 0


# -- the shard each rank gossips -----------------------------------------------------------------

def _replica(rank: int, size: int, seed: int = 0) -> tuple[torch.nn.Module, ReplicaSlice]:
    torch.manual_seed(seed)
    group = Group(GroupEnv(rank=rank, size=size), "ddp", torch.device("cpu"), None)  # no process group: no DDP
    model, view = group.wrap(torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)))
    assert isinstance(view, ReplicaSlice)
    return model, view


def test_under_ddp_rank_r_gossips_slice_r_of_the_replica_and_rank_r_of_every_group_has_the_same_layout() -> None:
    k = 3
    parts = [_replica(r, k) for r in range(k)]
    n = 7 * 5 + 5 + 5 * 3 + 3  # 58: not a multiple of 3
    assert [v.bounds[r] for r, (_, v) in enumerate(parts)] == [(0, 19), (19, 38), (38, 58)]
    assert [v.flat.numel() for _, v in parts] == [19, 19, 20]  # slices differ by one value at most
    assert all(v.total == v.resident == n for _, v in parts)
    whole = parts[0][1].state.flat  # the replica's flat vector
    for r, (model, view) in enumerate(parts):  # (the same seed: equal replicas)
        lo, hi = view.bounds[r]
        assert torch.equal(view.flat, whole[lo:hi]) and view.is_bound()
    assert len({v.fingerprint for _, v in parts}) == k  # rank r only mixes with rank r
    _, other = _replica(1, k, seed=5)  # rank 1 of another group: other values, the same layout
    assert other.fingerprint == parts[1][1].fingerprint
    assert _replica(1, 2)[1].fingerprint != parts[1][1].fingerprint  # another group size: another layout
    model, view = parts[2]
    with torch.no_grad():
        view.flat.fill_(7.0)
    assert torch.equal(model[1].bias.detach(), torch.full((3,), 7.0))  # the last 20 values: the second layer's
    assert float(model[0].weight.detach().abs().max()) < 1.0  # the first layer is rank 0's and 1's to mix
    fresh = torch.arange(20, dtype=torch.float32)
    home = view.moved(fresh)  # a send still held the old memory: the replica moves, the values come along
    assert torch.equal(home, fresh) and home.data_ptr() != fresh.data_ptr() and view.is_bound()
    assert torch.equal(model[1].bias.detach(), fresh[-3:])


def test_a_slice_whose_send_is_still_in_flight_is_never_written_by_the_model_taking_it_back() -> None:
    """``gossip-node --as-group 2``: one model, a node per slice. Node 1's send still held
    its slice when it mixed, so node 1 mixed into fresh memory; taking the slices back moves
    the whole model and leaves the memory being sent as it was sent (it once got node 1's
    mixed values written into it mid-send, and a neighbour took half-mixed values)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    state = FlatState(model)
    views = [ReplicaSlice(state, SlicePlace(r, 2)) for r in range(2)]
    nodes = [FlatState(ShardModule(v.flat)) for v in views]
    for v, st in zip(views, nodes):
        st.rehome(into=v.flat)  # each node mixes its slice of the model in place
    assert not take_slices(views, nodes)  # nothing moved: nothing to do
    sending = views[1].flat  # what node 1's transport still reads
    sent = sending.clone()
    nodes[1].rehome()  # node 1 mixed with its send in flight (Node.settle): fresh memory
    with torch.no_grad():
        nodes[0].flat.add_(1.0)  # the round's mixing
        nodes[1].flat.add_(2.0)
    mixed = [nodes[0].flat.clone(), nodes[1].flat.clone()]
    assert take_slices(views, nodes)
    assert torch.equal(sending, sent)  # the message in flight is as it was sent
    whole = state.flat
    for r, (v, st) in enumerate(zip(views, nodes)):
        lo, hi = v.bounds[r]
        assert torch.equal(whole[lo:hi], mixed[r]) and v.is_bound()  # the model holds the mixed values
        assert st.flat.data_ptr() == whole[lo:].data_ptr()  # and each node mixes the model's memory again
    assert torch.equal(model[1].bias.detach(), mixed[1][-3:])


def test_a_single_process_as_a_group_steps_only_once_every_slice_s_node_is_bound() -> None:
    """``gossip-node --as-group 2`` alone, slice 1's thread slow to start (its node bound 0.5 s
    after it was built): a node takes its slice's values when it is built and writes them back
    when it binds to the slice, so the process must not step in between. It once did, and
    slice 1 lost the first step's update (CI: 0.003 off the reference, 1 run in 3). The model
    must end exactly where plain local training on the same batches ends."""
    code = r"""
import sys, threading, time
import torch
import gossip.groups.run as run
import gossip.protocol.group as group
from gossip.cli import node_config_from_args
from gossip.training.node import init_model
from gossip.training.tasks import get_task

port, steps, task_spec = int(sys.argv[1]), 6, "synthetic:hidden=15,classes=3"
bind = group.bind_shard
def slow_bind(node, shard, fingerprint):
    if threading.current_thread().name.startswith("slice-"):
        time.sleep(0.5)  # built over its slice's values, not bound yet: the process waits
    bind(node, shard, fingerprint)
group.bind_shard = slow_bind
models = []
def keep(*args, **kwargs):
    models.append(init_model(*args, **kwargs))
    return models[-1]
run.init_model = keep
cfg, _ = node_config_from_args(["--listen", f"127.0.0.1:{port}", "--task", task_spec, "--steps", str(steps),
                                "--seed", "3", "--period", "2", "--heartbeat", "0.1", "--settle", "0.2",
                                "--grace", "0.5"])
summary = run.run_slices(cfg, 2)
assert summary["steps"] == steps, summary
task = get_task(task_spec)
ref = init_model(task, 3, "cpu")
opt = task.optimizer(ref.parameters())
streams = [task.stream(r, 2, "iid", 3) for r in range(2)]  # the one member's data: both slices' shards
for _ in range(steps):
    opt.zero_grad(set_to_none=True)
    task.loss(ref, tuple(torch.cat(ts) for ts in zip(*(s.next() for s in streams)))).backward()
    opt.step()
got = torch.cat([p.detach().reshape(-1) for p in models[0].parameters()])
want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
print("max_diff", float((got - want).abs().max()))
"""
    root = Path(__file__).resolve().parents[2]
    port = free_ports(2, consecutive=True)[0]
    proc = subprocess.run([sys.executable, "-c", code, str(port)], capture_output=True, text=True, timeout=120,
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.split()[-1]) == 0.0, proc.stdout


def test_under_fsdp_the_local_shards_are_rehomed_into_one_vector_that_is_the_model() -> None:
    """FSDP in a one-rank process group (gloo, in a process of its own): the view's vector is
    what FSDP's all-gather reads, and its fingerprint names the group size."""
    code = r"""
import torch, torch.distributed as dist
from gossip.groups.group import Group, GroupEnv
from gossip.training.shards import FsdpShards
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
group = Group(GroupEnv(size=1, launched=True), "fsdp", torch.device("cpu"), "gloo", dist.group.WORLD)
model, view = group.wrap(torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)))
assert isinstance(view, FsdpShards) and view.is_bound()
assert view.flat.numel() == view.total == view.resident == 58, (view.flat.numel(), view.total)
with torch.no_grad():
    view.flat.copy_(torch.arange(58, dtype=torch.float32))
full = view.full_state()
got = torch.cat([full[n].reshape(-1) for n in ("0.weight", "0.bias", "1.weight", "1.bias")])
assert torch.equal(got, torch.arange(58, dtype=torch.float32)), got
out = model(torch.ones(1, 7))  # the forward all-gathers from the vector
assert torch.allclose(out, torch.nn.functional.linear(torch.nn.functional.linear(torch.ones(1, 7), full["0.weight"],
                      full["0.bias"]), full["1.weight"], full["1.bias"]))
fresh = torch.full((58,), 2.0)
assert view.moved(fresh) is fresh and view.is_bound() and view.flat is fresh
assert float(view.full_state()["1.bias"].sum()) == 6.0
print("fingerprint", view.fingerprint)
dist.destroy_process_group()
"""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    fingerprint = proc.stdout.split()[-1]
    assert fingerprint != _replica(0, 1)[1].fingerprint  # FSDP's padded layout is not a replica's


# -- checkpoints ---------------------------------------------------------------------------------

def _trained(ck: Path | None = None):
    """A group of one (no torchrun) a few SGD steps in, with its follower's node over the shard
    (an outer optimizer: the rule has state of its own)."""
    task = get_task("synthetic:hidden=16,classes=3")
    torch.manual_seed(0)
    group = Group(GroupEnv(), "ddp", torch.device("cpu"), None)
    model, view = group.wrap(task.model())
    optimizer = task.optimizer(model.parameters())
    stream = task.stream(0, 1, "iid", 0)
    follower = ShardFollower(1, "127.0.0.1:7000", view.flat, view.fingerprint,
                             mixing=MixingSettings(outer="nesterov:lr=0.7,momentum=0.9"))
    follower.apply(Decision(1, "start", members=("127.0.0.1:7000",)))
    for _ in range(3):
        optimizer.zero_grad()
        task.loss(model, stream.next()).backward()
        optimizer.step()
    return task, group, model, view, optimizer, stream, follower.node


def test_a_checkpoint_gives_back_the_model_optimizer_data_position_and_mixing_state(tmp_path: Path) -> None:
    task, group, model, view, optimizer, stream, node = _trained()
    with torch.no_grad():  # an outer step's momentum: state the rule keeps per shard
        view.flat.add_(0.1)
    node.rule.mix(node.state.flat, node.inbox, node.topology, node.index, 0, 3)
    node.seq, node.step, node.channels[0].round = 5, 3, 2
    saved = {"params": view.flat.clone(), "rule": node.rule.state_dict(),
             "momentum": [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]}
    path = save_group_checkpoint(tmp_path, 3, group, model, optimizer, node, view, stream, members=["a:1", "b:1"])
    assert path == tmp_path / "step-00000003" and sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]
    assert {"group.pt", "rank-0.pt"} <= {p.name for p in path.iterdir()}
    after = stream.next()  # the batch a resumed run must read next
    # change everything the checkpoint holds
    for _ in range(2):
        optimizer.zero_grad()
        task.loss(model, stream.next()).backward()
        optimizer.step()
    node.rule.mix(node.state.flat, node.inbox, node.topology, node.index, 2, 5)
    node.seq, node.step, node.channels[0].round = 9, 5, 4
    assert not torch.equal(view.flat, saved["params"])
    state = load_group_checkpoint(path, group, model, optimizer, view, stream)
    restore_node(node, state)
    assert torch.equal(view.flat, saved["params"]) and view.is_bound()
    assert all(torch.equal(optimizer.state[p]["momentum_buffer"], m) for p, m in zip(model.parameters(),
                                                                                     saved["momentum"]))
    assert torch.equal(stream.next()[0], after[0])  # the data stream continues where it was
    assert (state["step"], state["members"], node.seq, node.step, node.channels[0].round) == (3, ["a:1", "b:1"],
                                                                                              5, 3, 2)
    rule = node.rule.state_dict()
    assert rule.keys() == saved["rule"].keys()
    for key, value in saved["rule"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(rule[key], value), key


def test_only_complete_checkpoints_count_and_a_mismatch_is_refused_naming_both_sides(tmp_path: Path) -> None:
    assert latest_group_checkpoint(tmp_path / "none") is None
    _, group, model, view, optimizer, stream, node = _trained()
    for step in (2, 10):
        save_group_checkpoint(tmp_path, step, group, model, optimizer, node, view, stream)
    (tmp_path / "step-00000020.tmp").mkdir()  # a save that never finished
    (tmp_path / "step-30").mkdir()  # not a checkpoint's name
    latest = latest_group_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step-00000010"
    for size, intra, words in ((2, "ddp", "written by a group of 1 ranks; this group has 2: resume with torchrun "
                                          "--nproc-per-node 1"),
                               (1, "fsdp", "written with intra 'ddp', this group runs 'fsdp'")):
        other = Group(GroupEnv(size=size), intra, torch.device("cpu"), None)
        with pytest.raises(GroupError, match=words.replace("(", r"\(")):  # refused before anything is loaded
            load_group_checkpoint(latest, other, None, None, None)


def test_a_step_saved_twice_keeps_the_newer_checkpoint(tmp_path: Path) -> None:
    """The last step of a run that is also a --checkpoint-every step is saved twice (in the
    loop, then as the final checkpoint): the second replaces the first."""
    _, group, model, view, optimizer, stream, node = _trained()
    save_group_checkpoint(tmp_path, 4, group, model, optimizer, node, view, stream, members=["a:1"])
    with torch.no_grad():
        view.flat.fill_(3.0)
    path = save_group_checkpoint(tmp_path, 4, group, model, optimizer, node, view, stream, members=["b:1"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]  # no .tmp, no .old left
    with torch.no_grad():
        view.flat.zero_()
    state = load_group_checkpoint(path, group, model, optimizer, view, stream)
    assert state["members"] == ["b:1"] and torch.equal(view.flat, torch.full_like(view.flat, 3.0))


# -- the simulator: a group's exchange as K streams ------------------------------------------------

def test_the_simulator_models_a_group_as_one_node_whose_exchange_runs_k_streams() -> None:
    import gossip
    from gossip.transport.links import LinkModel, SimNetwork, group_link, parse_link

    link = parse_link("latency=5ms,bandwidth=100Mbit,streams=4")
    assert link.bandwidth == 4e8 and link.latency == 0.005
    net = SimNetwork({"intra": link}, lambda u, v: "intra")
    n = 10**6
    assert net.transmit(0, 1, n, 0.0) == pytest.approx(n * 8 / 4e8 + 0.005)  # K shards at once, one latency
    assert net.bytes_by_class["intra"] == n  # every byte still crosses the link
    assert group_link(LinkModel(bandwidth=1e9), 1) == LinkModel(bandwidth=1e9)
    with pytest.raises(ValueError, match="streams must be an integer"):
        parse_link("streams=four")
    with pytest.raises(ValueError, match="streams must be a positive integer"):
        parse_link("streams=0")
    runs = {k: gossip.simulate(gossip.SimConfig(nodes=2, task="synthetic", steps=4, seed=1,
                                                link=f"latency=0,bandwidth=10Mbit,streams={k}")).summary
            for k in (1, 4)}
    assert runs[1]["bytes_sent"] == runs[4]["bytes_sent"]
    message = runs[1]["bytes_sent"] / (2 * 4)  # two nodes, four rounds, one message each
    saved = 4 * message * 8 / 10e6 * (1 - 1 / 4)  # each round's transfer takes a quarter as long
    assert runs[1]["sim_time_s"] - runs[4]["sim_time_s"] == pytest.approx(saved, rel=1e-6)


# -- a real group, resumed --------------------------------------------------------------------------

@pytest.mark.slow
def test_a_group_resumes_from_its_sharded_checkpoint_where_it_left_off(tmp_path: Path) -> None:
    """gossip-node --nproc-per-node 2 --intra fsdp, alone, 4 steps with a checkpoint every 2;
    the same again with --resume from step 2 ends bit for bit where the straight run ended."""
    from tests.cluster import Cluster
    from tests.groups.test_groups_real import FAST, LIMIT, TASK, full_params

    ck = tmp_path / "ck"
    common = ["--task", TASK, "--seed", "3", "--steps", "4", "--period", "1", "--intra", "fsdp",
              "--checkpoint-dir", str(ck), "--json", *FAST]
    port = free_ports(2, consecutive=True)[0]
    with Cluster(tmp_path) as c:
        first = c.start("first", [*common, "--checkpoint-every", "2"], port=port, group=2)
        assert first.wait(LIMIT) == 0, first.log()[-3000:]
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000002", "step-00000004"]  # no .tmp left
    straight = full_params(ck)
    import shutil

    shutil.rmtree(ck / "step-00000004")
    with Cluster(tmp_path) as c:
        again = c.start("again", [*common, "--resume"], port=port, group=2)
        assert again.wait(LIMIT) == 0, again.log()[-3000:]
        summary = again.summary()
    assert summary["steps"] == 4 and summary["resumed_from"] == str(ck / "step-00000002")
    resumed = full_params(ck)
    assert sorted(resumed) == sorted(straight)
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)  # momentum and data position came back
