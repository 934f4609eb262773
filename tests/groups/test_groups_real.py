"""Groups of processes as members of one cluster, started with ``gossip-node --nproc-per-node``:
real torchrun launchers and workers on loopback (CPU, gloo), rank 0 running the same
protocol as a single node, the other ranks following its decisions."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from gossip.core.state import FlatState
from gossip.protocol.membership import topology_for
from gossip.training.node import init_model
from gossip.training.tasks import get_task
from gossip.transport.ports import free_ports
from tests.cluster import EXACT, Cluster, records, run_node, wait_for_step

SEED = 3
TASK = "synthetic:hidden=63,classes=5"  # odd rows: FSDP pads the last rank's shards
FAST = ["--heartbeat", "0.25", "--dead-after", "2", "--settle", "1", "--grace", "5", "--timeout", "10"]
LIMIT = 300  # seconds a group may take (a loaded 2-core machine runs several launchers at once)


def full_params(checkpoint: Path) -> dict[str, torch.Tensor]:
    """A group's whole model from its newest sharded checkpoint (the ranks' shards joined)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from gossip.groups.checkpoint import latest_group_checkpoint

    path = latest_group_checkpoint(checkpoint)
    assert path is not None, f"no checkpoint in {checkpoint}"
    out = checkpoint.parent / f"{checkpoint.name}-full.pt"
    dcp_to_torch_save(str(path), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state["model"].items()}


def reference(groups: int, k: int, steps: int, period: int) -> list[dict[str, torch.Tensor]]:
    """``groups`` single nodes on the same schedule: node g trains on the union of group g's
    batches (rank r's stream is shard g*k + r of groups*k) and mixes with the ring's weights."""
    task = get_task(TASK)
    models = [init_model(task, SEED, "cpu") for _ in range(groups)]
    states = [FlatState(m) for m in models]
    opts = [task.optimizer(m.parameters()) for m in models]
    streams = [[task.stream(g * k + r, groups * k, "iid", SEED) for r in range(k)] for g in range(groups)]
    topo = topology_for("ring", groups, seed=SEED)
    rnd = 0
    for step in range(1, steps + 1):
        for g in range(groups):
            parts = [s.next() for s in streams[g]]
            batch = tuple(torch.cat(ts) for ts in zip(*parts))
            opts[g].zero_grad(set_to_none=True)
            task.loss(models[g], batch).backward()
            opts[g].step()
        if step % period == 0:
            old = [st.flat.clone() for st in states]
            for g in range(groups):
                w = topo.in_weights(g, rnd)
                states[g].flat.copy_(sum(wj * old[j] for j, wj in w.items()))
            rnd += 1
    return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _args(peer: str, steps: int, *extra: str, timing: list[str] = FAST) -> list[str]:
    return ["--peers", peer, "--task", TASK, "--steps", str(steps), "--seed", str(SEED), "--json", *timing, *extra]


def every_round_mixed_everyone(s: dict) -> bool:
    """Whether a member (single or group, every rank) started with the others and mixed every
    round with every neighbour: what a comparison with single nodes assumes."""
    if "rank_timed_out_rounds" in s:  # a group's: every rank's counters
        counts = [*s["rank_timed_out_rounds"], *s["rank_skipped_rounds"]]
    else:
        counts = [s["timed_out_rounds"], s["skipped_rounds"]]
    return not s["joined"] and not any(counts)


@pytest.mark.slow
def test_three_fsdp_groups_started_with_gossip_node_match_single_nodes_on_the_same_schedule(tmp_path):
    """3 groups x 2 ranks, FSDP inside, each seeded only with the next (a chain): they find
    each other, start together, and end where 3 single nodes on the union of each group's
    batches end; rank r exchanges only its shard, with rank r of the others."""
    k, n, steps, period = 2, 3, 41, 2  # (an odd last step: after the last exchange each group steps alone)
    with Cluster(tmp_path) as c:
        ports = [free_ports(k, consecutive=True)[0] for _ in range(n)]
        nodes = [c.start(f"g{g}", _args(f"127.0.0.1:{ports[(g + 1) % n]}", steps, "--intra", "fsdp", "--period",
                                        str(period), "--checkpoint-dir", str(tmp_path / f"ck{g}"), timing=EXACT),
                         port=ports[g], group=k) for g in range(n)]
        for x in nodes:
            assert x.wait(LIMIT) == 0, x.log()[-3000:]
        summaries = [x.summary() for x in nodes]
    ids = sorted(x.addr for x in nodes)
    ref = reference(n, k, steps, period)
    for x, s in zip(nodes, summaries):
        assert s["group_size"] == k and s["steps"] == steps and s["members"] == n and every_round_mixed_everyone(s), s
        assert len(s["rank_timed_out_rounds"]) == k, s
        got = full_params(tmp_path / f"ck{nodes.index(x)}")
        g = ids.index(x.addr)
        assert _max_diff(got, ref[g]) < 1e-5, (x.addr, _max_diff(got, ref[g]))
    assert _max_diff(ref[0], ref[1]) > 1e-4  # the last local steps made the groups differ: each is checked
    for x in nodes:  # rank 1 talked to rank 1 of the others only (the launcher's stderr holds every rank's log)
        log = x.log()
        assert "rank 0 of a group of 2" in log


@pytest.mark.slow
def test_a_mixed_cluster_of_two_single_processes_and_a_ddp_group_trains_as_one(tmp_path):
    """Two single processes (``--as-group 2``: one process gossiping its model as the two
    slices of a DDP group of 2) and one DDP group of 2, in a ring seeded as a chain: they
    form one cluster and train together. Each single process trains on both slices' data
    at once (DDP's gradient), so the group ends exactly where three single nodes on the
    same schedule end: the group's parameters depend on the two others' at every round."""
    k, n, steps, period = 2, 3, 31, 2
    with Cluster(tmp_path) as c:
        ports = [free_ports(k, consecutive=True)[0] for _ in range(n)]
        nodes = []
        for g in range(n):
            args = _args(f"127.0.0.1:{ports[(g + 1) % n]}", steps, "--period", str(period), timing=EXACT)
            if g == 0:
                nodes.append(c.start("group", [*args, "--intra", "ddp", "--checkpoint-dir", str(tmp_path / "ck")],
                                     port=ports[g], group=k))
            else:
                nodes.append(c.start(f"single{g}", [*args, "--as-group", str(k)], port=ports[g]))
        for x in nodes:
            assert x.wait(LIMIT) == 0, x.log()[-3000:]
        summaries = [x.summary() for x in nodes]
    for s in summaries:
        assert s["group_size"] == k and s["steps"] == steps and s["members"] == n and every_round_mixed_everyone(s), s
        assert len(s["rank_skipped_rounds"]) == k, s
    assert summaries[1]["intra"] == "slices" and summaries[0]["intra"] == "ddp"
    ids = sorted(x.addr for x in nodes)
    ref = reference(n, k, steps, period)
    got = full_params(tmp_path / "ck")
    assert _max_diff(got, ref[ids.index(nodes[0].addr)]) < 1e-5


def test_sigterm_to_a_single_process_gossiping_as_a_group_finishes_at_the_next_exchange(tmp_path):
    """--as-group 2 alone, SIGTERM while it trains: the slice threads see the stop at the
    same exchange as slice 0 (they once left a step early and the process hung), it
    finishes and prints its summary."""
    metrics = tmp_path / "m.jsonl"
    with Cluster(tmp_path) as c:
        x = c.start("solo", ["--task", TASK, "--steps", str(10**6), "--seed", str(SEED), "--json", *FAST,
                             "--as-group", "2", "--period", "2", "--log", str(metrics), "--eval-every", "10"],
                    port=free_ports(2, consecutive=True)[0])
        wait_for_step(metrics, 40, LIMIT)
        x.proc.send_signal(signal.SIGTERM)
        assert x.wait(60) == 0, x.log()[-3000:]
        s = x.summary()
    assert s["group_size"] == 2 and s["intra"] == "slices" and s["interrupted"] and 40 <= s["steps"] < 10**6


@pytest.mark.slow
def test_a_rank_killed_restarts_its_group_through_the_launcher_and_it_rejoins(tmp_path):
    """kill -9 of rank 1 of group B mid-run: torchrun (--max-restarts 1) starts B again, a
    new life that joins the cluster with every rank's shard from the same donor round;
    A waits for B no longer than the detection bound, and both finish."""
    k, steps = 2, 10**6
    pa, pb = free_ports(k, consecutive=True)[0], free_ports(k, consecutive=True)[0]
    metrics = tmp_path / "a.jsonl"
    with Cluster(tmp_path) as c:
        a = c.start("a", _args(f"127.0.0.1:{pb}", steps, "--intra", "fsdp", "--log", str(metrics),
                                "--eval-every", "20"), port=pa, group=k)
        b = c.start("b", _args(f"127.0.0.1:{pa}", steps, "--intra", "fsdp", "--max-restarts", "1"), port=pb, group=k)
        first = wait_for_step(metrics, 100, LIMIT)
        ranks = b.ranks()
        assert len(ranks) == k, ranks
        os.kill(ranks[1], signal.SIGKILL)
        end = time.monotonic() + LIMIT
        while "took the state of" not in b.log() and time.monotonic() < end:
            time.sleep(0.5)
        assert "took the state of" in b.log(), b.log()[-3000:]
        seen = records(metrics)
        later = wait_for_step(metrics, seen[-1]["step"] + 200, LIMIT, since=len(seen))  # after B's join round
        for x in (a, b):
            x.proc.send_signal(signal.SIGTERM)
        assert a.wait(LIMIT) == 0 and b.wait(LIMIT) == 0, (a.log()[-2000:], b.log()[-2000:])
        sa, sb = a.summary(), b.summary()
    assert later["members"] == 2  # B is back in A's rounds
    assert sb["joined"] and sb["state_from"] == a.addr
    assert sa["max_step_gap_s"] < 2.0 + 0.25 + 6.0  # detection (and a loaded machine), never a 10 s round timeout


@pytest.mark.slow
def test_a_late_group_joins_with_no_round_timing_out_anywhere(tmp_path):
    """Two groups train; a third group, seeded with one of them only, starts later: it joins
    at a round the cluster schedules, every rank takes its shard from the same donor round,
    and no round of any group times out (every rank connects before the round that admits it)."""
    k = 2
    pa, pb, pc = (free_ports(k, consecutive=True)[0] for _ in range(3))
    metrics = tmp_path / "a.jsonl"
    with Cluster(tmp_path) as c:
        a = c.start("a", _args(f"127.0.0.1:{pb}", 10**6, "--log", str(metrics), "--eval-every", "20"), port=pa,
                    group=k)
        b = c.start("b", _args(f"127.0.0.1:{pa}", 10**6), port=pb, group=k)
        wait_for_step(metrics, 100, LIMIT)
        late = c.start("c", _args(f"127.0.0.1:{pb}", 10**6), port=pc, group=k)
        end = time.monotonic() + LIMIT
        while "took the state of" not in late.log() and time.monotonic() < end:
            time.sleep(0.5)
        assert "took the state of" in late.log(), late.log()[-3000:]
        seen = records(metrics)
        later = wait_for_step(metrics, seen[-1]["step"] + 200, LIMIT, since=len(seen))
        for x in (a, b, late):
            x.proc.send_signal(signal.SIGTERM)
        for x in (a, b, late):
            assert x.wait(LIMIT) == 0, x.log()[-2000:]
        summaries = [x.summary() for x in (a, b, late)]
    assert later["members"] == 3
    assert all(s["timed_out_rounds"] == 0 for s in summaries), [s["timed_out_rounds"] for s in summaries]
    assert summaries[2]["joined"] and summaries[2]["state_from"] in (a.addr, b.addr)
    for x in (a, b, late):
        assert "timed out" not in x.log(), [ln for ln in x.log().splitlines() if "timed out" in ln][:3]


@pytest.mark.slow
def test_a_partition_between_two_groups_heals_into_one_cluster(tmp_path):
    """Two groups in different datacenters, the link between them down from 15 s to 30 s
    after each starts (--emulate, on every rank): each drops the other and trains on
    alone; when the link is back they meet, one joins the other as a new life (a merge),
    and no round times out after the heal."""
    k = 2
    pa, pb = (free_ports(k, consecutive=True)[0] for _ in range(2))
    cut = ["--emulate", "inter:down=15s-30s"]
    metrics = tmp_path / "a.jsonl"
    with Cluster(tmp_path) as c:
        a = c.start("a", _args(f"127.0.0.1:{pb}", 10**6, "--dc", "west", "--log", str(metrics), "--eval-every", "20",
                               *cut), port=pa, group=k)
        b = c.start("b", _args(f"127.0.0.1:{pa}", 10**6, "--dc", "east", *cut), port=pb, group=k)
        end = time.monotonic() + LIMIT
        while not ("took the state of" in a.log() + b.log()) and time.monotonic() < end:
            time.sleep(0.5)
        merged = a if "took the state of" in a.log() else b
        assert "took the state of" in merged.log(), (a.log()[-2000:], b.log()[-2000:])
        healed = len(records(metrics))
        seen = records(metrics)
        later = wait_for_step(metrics, seen[-1]["step"] + 200, LIMIT, since=healed)
        for x in (a, b):
            x.proc.send_signal(signal.SIGTERM)
        for x in (a, b):
            assert x.wait(LIMIT) == 0, x.log()[-2000:]
        sa, sb = a.summary(), b.summary()
    assert later["members"] == 2
    assert sa["merges"] + sb["merges"] == 1
    after = merged.log().split("took the state of", 1)[1]
    assert "timed out" not in after, [ln for ln in after.splitlines() if "timed out" in ln][:3]


@pytest.mark.slow
def test_sigterm_to_a_group_gives_a_final_sharded_checkpoint_and_a_goodbye(tmp_path):
    k = 2
    pa, pb = (free_ports(k, consecutive=True)[0] for _ in range(2))
    metrics = tmp_path / "a.jsonl"
    ck = tmp_path / "ck"
    with Cluster(tmp_path) as c:
        a = c.start("a", _args(f"127.0.0.1:{pb}", 10**6, "--intra", "fsdp", "--log", str(metrics), "--eval-every",
                               "20", "--checkpoint-dir", str(ck)), port=pa, group=k)
        b = c.start("b", _args(f"127.0.0.1:{pa}", 10**6, "--intra", "fsdp"), port=pb, group=k)
        wait_for_step(metrics, 60, LIMIT)
        a.proc.send_signal(signal.SIGTERM)
        assert a.wait(LIMIT) == 0, a.log()[-3000:]
        end = time.monotonic() + 30
        while "said goodbye (stopped)" not in b.log() and time.monotonic() < end:
            time.sleep(0.2)
        assert f"member {a.addr} removed: said goodbye (stopped)" in b.log()
        sa = a.summary()
    from gossip.groups.checkpoint import latest_group_checkpoint

    path = latest_group_checkpoint(ck)
    assert path is not None and int(path.name.split("-")[1]) == sa["steps"] and sa["interrupted"]
    meta = torch.load(path / "group.pt", weights_only=True)
    assert meta["group_size"] == k and meta["intra"] == "fsdp"
    assert {"group.pt", "rank-0.pt", "rank-1.pt"} <= {p.name for p in path.iterdir()}  # every rank's part
    params = full_params(ck)
    assert all(torch.isfinite(v).all() for v in params.values())


@pytest.mark.parametrize("args,needle", [
    (["--period", "0"], "--period must be >= 1, got 0"),
    (["--compression", "bogus"], "compression"),
    (["--task", "nosuchtask"], "unknown task 'nosuchtask'"),
    (["--timeout", "-1"], "--timeout must be a positive number, got -1"),
    (["--topology", "bogus"], "unknown topology 'bogus'"),
    (["--steps", "-1"], "--steps must be >= 0, got -1"),
    (["--intra", "zero3"], "invalid choice: 'zero3'"),
    (["--heartbeat", "3", "--dead-after", "2"], "heartbeat (3 s) must be shorter than dead_after (2 s)"),
    (["--max-restarts", "2", "--nproc-per-node", "1"], "--max-restarts goes with --nproc-per-node"),
    (["--intra", "fsdp", "--nproc-per-node", "1"], "--intra fsdp shards the model over a group's ranks"),
    (["--listen", "tcp://127.0.0.1"], "is not HOST:PORT"),
])
def test_bad_input_on_a_group_is_one_line_and_exit_2_before_any_launch(tmp_path, args, needle):
    """Checked in the launching process, once: never a traceback that torchrun would restart."""
    base = ["--listen", f"tcp://127.0.0.1:{free_ports(2, consecutive=True)[0]}", "--nproc-per-node", "2"]
    if "--nproc-per-node" in args:
        base = base[:2]
    if "--listen" in args:
        base = base[2:]
    proc = run_node([*base, *args], tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert needle in lines[-1] and lines[-1].startswith("gossip-node: error:"), proc.stderr[-2000:]  # (after argparse's usage)
    assert "Traceback" not in proc.stderr and "torch.distributed" not in proc.stderr
