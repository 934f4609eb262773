"""GossipNode in a training loop of the user's own under torchrun (``gossip.groups.user_loop``):
real ``torch.distributed.run`` launchers on loopback (CPU, gloo), each process one rank of
a group member, the model wrapped by the script (DDP or ``fully_shard``) before GossipNode.

The script (tests/groups/own_loop.py) trains gossip-node's task with its data streams, so a
group of it must end exactly where single nodes on the same schedule end
(``tests.groups.test_groups_real.reference``), as a ``gossip-node --nproc-per-node`` group does.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from gossip.transport.ports import free_ports
from tests.cluster import Cluster, wait_for_step
from tests.groups.test_groups_real import (EXACT, LIMIT, SEED, TASK, _max_diff, every_round_mixed_everyone,
                                          full_params, reference)

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "own_loop.py"
K = 2


def _ranks(out: Path) -> list[dict]:
    """What each rank of a group of the script wrote at its end."""
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(K)]


def _script_args(intra: str, steps: int, out: Path, *extra: str) -> list[str]:
    return ["--intra", intra, "--steps", str(steps), "--period", "2", "--task", TASK, "--seed", str(SEED),
            "--out", str(out), *extra]


def test_ddp_wrapped_before_gossip_builds_its_shard_trains_bit_for_bit_as_plain_ddp(tmp_path):
    """GossipNode gets the model DDP wrapped already, so its FlatState re-homes the
    parameters after DDP built its reducer: two ranks, each on its own data, end bit for
    bit where plain DDP ends (parameters and BatchNorm buffers), with and without
    ``gradient_as_bucket_view``, and after the shard moved (a held send) and was
    broadcast; the ranks' parameters stay equal."""
    with Cluster(tmp_path) as c:
        x = c.start("check", [], script=HERE / "ddp_flat_check.py", torchrun=K)
        assert x.wait(LIMIT) == 0, x.log()[-3000:]
        lines = [json.loads(ln) for ln in x.out.read_text().splitlines() if ln.startswith("{")]
    assert sorted(d["rank"] for d in lines) == [0, 1], x.out.read_text()[-2000:]
    for d in lines:
        for variant, got in d.items():
            if variant == "rank":
                continue
            assert got["params_as_plain"] and got["params_equal_on_ranks"], (d["rank"], variant, got)
            # (after_mix broadcasts each rank's slice of the replica, BatchNorm's statistics included)
            assert got["buffers_as_plain"] == (not variant.startswith("after-moved")), (d["rank"], variant, got)


@pytest.mark.slow
def test_two_fsdp_groups_in_loops_of_their_own_train_as_single_nodes_on_the_same_schedule(tmp_path):
    """Two groups of 2 ranks, each ``fully_shard``-ing its model and calling GossipNode on every
    rank: they find each other, every rank reports the same members and step count, rank r
    of member m trains data shard m*2 + r of 4 (disjoint), and each group ends where two
    single nodes on the union of its ranks' batches end (1e-5), the groups differing. The
    final sharded checkpoint holds exactly the model the group ended with."""
    steps = 21  # (odd: after the last exchange each group steps alone, so the two differ)
    pa, pb = (free_ports(K, consecutive=True)[0] for _ in range(2))
    out = {"a": tmp_path / "a", "b": tmp_path / "b"}
    with Cluster(tmp_path) as c:
        a = c.start("a", _script_args("fsdp", steps, out["a"], "--checkpoint-dir", str(tmp_path / "ck")), port=pa,
                    script=SCRIPT, torchrun=K, env={"GOSSIP_PEERS": f"127.0.0.1:{pb}"})
        b = c.start("b", _script_args("fsdp", steps, out["b"]), port=pb, script=SCRIPT, torchrun=K,
                    env={"GOSSIP_PEERS": f"127.0.0.1:{pa}"})
        for x in (a, b):
            assert x.wait(LIMIT) == 0, x.log()[-3000:]
    ids = sorted(x.addr for x in (a, b))
    ref = reference(2, K, steps, 2)
    shards, indices = [], []
    for name, x in (("a", a), ("b", b)):
        m = ids.index(x.addr)
        for d in _ranks(out[name]):
            r = d["group_rank"]
            assert d["type"] == "GroupNode" and d["id"] == x.addr and d["ended"] == "steps", d
            assert d["steps"] == steps and d["members"] == ids, d
            s = d["summary"]
            assert s["steps"] == steps and s["member_ids"] == ids and every_round_mixed_everyone(s), s
            assert s["rounds"] == steps // 2 and s["intra"] == "fsdp" and s["rank"] == r, s
            assert (d["rank"], d["world_size"]) == (m * K + r, 2 * K), d
            shards.append(d["rank"])
            indices.extend(d["sampler"])
        got = torch.load(out[name] / "params.pt", weights_only=True)
        assert _max_diff(got, ref[m]) < 1e-5, (x.addr, _max_diff(got, ref[m]))
    assert sorted(shards) == [0, 1, 2, 3]
    assert sorted(indices) == list(range(40))  # node.sampler: every rank of every group its own part
    assert _max_diff(ref[0], ref[1]) > 1e-4  # each group is checked against its own reference
    assert _max_diff(full_params(tmp_path / "ck"), torch.load(out["a"] / "params.pt", weights_only=True)) == 0.0


def test_two_groups_average_gather_and_barrier_across_members_on_every_rank(tmp_path):
    """The collectives across members on every rank of two DDP groups of 2: the average is
    the exact weighted mean over the 4 ranks (weight 1 + shard), the same float everywhere;
    all_gather gives the 4 ranks' values in member then rank order. Group b reaches the
    collectives 15 s late: group a's rank 0 waits on the members and its rank 1 on the
    store, longer than the process group's collective timeout (8 s), and nothing fails."""
    pa, pb = (free_ports(K, consecutive=True)[0] for _ in range(2))
    out = {"a": tmp_path / "a", "b": tmp_path / "b"}
    pause = {"a": "0", "b": "15"}
    with Cluster(tmp_path) as c:
        procs = {name: c.start(name, _script_args("ddp", 4, out[name], "--collectives", "--pause", pause[name],
                                                  "--pg-timeout", "8"),
                               port=port, script=SCRIPT, torchrun=K, env={"GOSSIP_PEERS": f"127.0.0.1:{other}"})
                 for name, port, other in (("a", pa, pb), ("b", pb, pa))}
        for x in procs.values():
            assert x.wait(LIMIT) == 0, x.log()[-3000:]
    ranks = {name: _ranks(out[name]) for name in out}
    every = [d for name in out for d in ranks[name]]
    assert sorted(d["rank"] for d in every) == [0, 1, 2, 3], every
    shards = [d["rank"] for d in every]
    exact = sum(s * (1.0 + s) for s in shards) / sum(1.0 + s for s in shards)  # (20 / 10: exact in floats)
    for d in every:
        got = d["collectives"]
        assert got["average"] == exact == 2.0, got
        assert got["tensor"] == [1.5, 1.0], got
        order = sorted(every, key=lambda e: (e["id"], e["group_rank"]))
        assert got["gather"] == [[e["rank"], e["group_rank"]] for e in order], got
    for d in ranks["a"]:  # (b paused 15 s before its collectives: a's ranks waited that long, outside torch's)
        assert d["collectives"]["wait_s"] > 8.0, d["collectives"]


@pytest.mark.slow
def test_a_ddp_group_in_a_loop_of_its_own_trains_with_a_single_process_gossiping_as_a_group(tmp_path):
    """A DDP group of 2 running GossipNode in its own loop and one ``gossip-node --as-group 2``
    process (its model as the two slices of a DDP group: the same layout) form one cluster;
    the group ends where two single nodes on the same schedule end, so its parameters took
    the single process's at every round (rank r's slice from its slice r)."""
    steps = 21
    pa, pb = (free_ports(K, consecutive=True)[0] for _ in range(2))
    with Cluster(tmp_path) as c:
        a = c.start("group", _script_args("ddp", steps, tmp_path / "a"), port=pa, script=SCRIPT, torchrun=K,
                    env={"GOSSIP_PEERS": f"127.0.0.1:{pb}"})
        b = c.start("single", ["--peers", f"127.0.0.1:{pa}", "--task", TASK, "--steps", str(steps), "--seed",
                               str(SEED), "--json", *EXACT, "--period", "2", "--as-group", str(K)], port=pb)
        for x in (a, b):
            assert x.wait(LIMIT) == 0, x.log()[-3000:]
        single = b.summary()
    ids = sorted(x.addr for x in (a, b))
    assert single["members"] == 2 and single["steps"] == steps and every_round_mixed_everyone(single), single
    for d in _ranks(tmp_path / "a"):
        assert d["members"] == ids and d["steps"] == steps and d["summary"]["intra"] == "ddp", d
    got = torch.load(tmp_path / "a" / "params.pt", weights_only=True)
    ref = reference(2, K, steps, 2)
    m = ids.index(a.addr)
    assert _max_diff(got, ref[m]) < 1e-5, _max_diff(got, ref[m])
    assert _max_diff(ref[0], ref[1]) > 1e-4


def test_sigterm_to_torchrun_stops_every_rank_of_the_group_at_the_same_exchange(tmp_path):
    """SIGTERM to torchrun (which passes it to every rank) while a lone DDP group trains:
    rank 0 decides, and both ranks stop at the same exchange, close there (final
    checkpoint of that step) and leave with SystemExit(143), as a signalled single node."""
    metrics = tmp_path / "m.jsonl"
    with Cluster(tmp_path) as c:
        x = c.start("solo", _script_args("ddp", 10**6, tmp_path / "a", "--metrics", str(metrics), "--checkpoint-dir",
                                         str(tmp_path / "ck")), script=SCRIPT, torchrun=K)
        wait_for_step(metrics, 20, LIMIT)
        x.proc.send_signal(signal.SIGTERM)
        x.wait(LIMIT)  # (torchrun itself reports the signal as a failure)
    ranks = _ranks(tmp_path / "a")
    steps = {d["steps"] for d in ranks}
    assert len(steps) == 1, ranks
    step = steps.pop()
    assert 20 <= step < 10**6 and step % 2 == 0  # an exchange step
    assert all(d["ended"] == "exit 143" for d in ranks), [d["ended"] for d in ranks]
    assert ranks[0]["summary"]["interrupted"]
    from gossip.groups.checkpoint import latest_group_checkpoint

    path = latest_group_checkpoint(tmp_path / "ck")
    assert path is not None and path.name == f"step-{step:08d}", path


@pytest.mark.slow
def test_the_torchrun_example_trains_two_groups_to_one_model(tmp_path):
    """examples/torchrun_own_loop.py as the README starts it, two DDP groups of 2: both learn,
    and after the last step (an exchange of a ring of two: the exact average) the two groups'
    models are one, so their accuracies on the same data are equal."""
    example = HERE.parents[1] / "examples" / "torchrun_own_loop.py"
    pa, pb = (free_ports(K, consecutive=True)[0] for _ in range(2))
    with Cluster(tmp_path) as c:
        a = c.start("a", ["--epochs", "2"], port=pa, script=example, torchrun=K, env={"GOSSIP_PEERS": f"127.0.0.1:{pb}"})
        b = c.start("b", ["--epochs", "2"], port=pb, script=example, torchrun=K, env={"GOSSIP_PEERS": f"127.0.0.1:{pa}"})
        for x in (a, b):
            assert x.wait(LIMIT) == 0, x.log()[-3000:]
        outs = [json.loads([ln for ln in x.out.read_text().splitlines() if ln.startswith("{")][-1]) for x in (a, b)]
    ids = sorted(x.addr for x in (a, b))
    for x, o in zip((a, b), outs):
        assert o["member"] == x.addr and o["members"] == ids and o["timed_out_rounds"] == 0, o
        assert o["shard"] == [ids.index(x.addr) * K, 2 * K], o  # rank 0 of member m: shard m*2 of 4
    assert outs[0]["steps"] == outs[1]["steps"] == 2 * 2048 // (2 * K) // 32  # 2 epochs of 512 samples, batches of 32
    assert outs[0]["accuracy"] == outs[1]["accuracy"] >= 0.7, outs


@pytest.mark.slow
def test_a_group_in_a_loop_of_its_own_resumes_from_its_sharded_checkpoint(tmp_path):
    """A lone FSDP group runs 10 steps with checkpoint_dir, then the same script again for
    20: it resumes at step 10 (model, optimizer momentum, mixing state from the sharded
    checkpoint; the data position is the loop's, from node.steps) and ends where a
    straight 20-step run ends."""
    ck = str(tmp_path / "ck")
    with Cluster(tmp_path) as c:
        first = c.start("first", _script_args("fsdp", 10, tmp_path / "first", "--checkpoint-dir", ck), script=SCRIPT,
                        torchrun=K)
        assert first.wait(LIMIT) == 0, first.log()[-3000:]
        again = c.start("again", _script_args("fsdp", 20, tmp_path / "again", "--checkpoint-dir", ck), script=SCRIPT,
                        torchrun=K)
        assert again.wait(LIMIT) == 0, again.log()[-3000:]
    for d in _ranks(tmp_path / "again"):
        assert d["start"] == 10 and d["steps"] == 20 and d["summary"]["trained_steps"] == 10, d
    got = torch.load(tmp_path / "again" / "params.pt", weights_only=True)
    ref = reference(1, K, 20, 2)[0]
    assert _max_diff(got, ref) < 1e-5, _max_diff(got, ref)
    assert _max_diff(torch.load(tmp_path / "first" / "params.pt", weights_only=True), ref) > 1e-4
