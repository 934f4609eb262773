"""A node is a group of devices: DDP or FSDP inside, sharded gossip between groups.

Real processes on loopback with gloo: each rank is started as torchrun starts it
(its own process with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), on free ports, with
hard time limits, every process reaped by its PID.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from gossip.core.state import FlatState
from gossip.groups.group import (
    Decision,
    GroupError,
    GroupSizeError,
    check_group_sizes,
    group_env,
    rank_address,
    start_group,
)
from gossip.groups.run import main
from gossip.protocol.membership import topology_for
from gossip.training.node import init_model
from gossip.training.tasks import get_task
from gossip.transport.ports import free_ports

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LIMIT = 90  # seconds a group run may take before it counts as hung
STEPS, PERIOD, SEED = 7, 2, 3  # exchanges at steps 2, 4, 6; one local step after the last
TASK = "synthetic:hidden=63,classes=5"  # odd rows: FSDP pads the last rank's shards


def free_base(k: int) -> int:
    """A port P with P .. P+k-1 free (rank r of a group listens on P+r)."""
    return free_ports(k, consecutive=True)[0]


def _rank_main(env: dict[str, str], argv: list[str], out: str, err: str) -> None:
    """One rank's process: torchrun's environment, then the driver (stdout and stderr to files)."""
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    for var in TORCHRUN_VARS:
        os.environ.pop(var, None)
    os.environ.update(env)
    torch.set_num_threads(1)
    from gossip.groups.run import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_CTX = None


def _context():
    """Rank processes come from a fork server that has imported torch and the driver once:
    each is a fresh process, without paying for the imports again."""
    global _CTX
    if _CTX is None:
        import multiprocessing

        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed.fsdp", "gossip.groups.run", "tests.groups.test_group"])
    return _CTX


class Ranks:
    """The processes of several groups; killed and reaped (by PID) on exit."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[tuple[str, object]] = []

    def group(self, k: int, group: str, groups: list[str], *args: str, torchrun: bool = True) -> None:
        master = free_base(1)
        for r in range(k):
            env = {}
            if torchrun:
                env = dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(k), LOCAL_WORLD_SIZE=str(k),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master))
            name = f"{group.rpartition(':')[2]}-{r}"
            argv = ["--group", group, "--groups", ",".join(groups), "--seed", str(SEED), "--out", str(self.tmp),
                    "--timeout", "30", "--connect-timeout", "60", *args]
            p = _context().Process(target=_rank_main, args=(env, argv, str(self.tmp / f"{name}.out"),
                                                            str(self.tmp / f"{name}.err")), daemon=True)
            p.start()
            self.procs.append((name, p))

    def wait(self) -> dict[str, int]:
        codes = {}
        for name, p in self.procs:
            p.join(timeout=LIMIT)
            if p.exitcode is None:
                raise AssertionError(f"rank {name} still running after {LIMIT} s:\n{self.err(name)[-3000:]}")
            codes[name] = p.exitcode
        return codes

    def err(self, name: str) -> str:
        return (self.tmp / f"{name}.err").read_text()

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc: object) -> None:
        for _, p in self.procs:
            if p.exitcode is None and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=10)


def reference(groups: int, k: int, *, mix: bool = True) -> list[dict[str, torch.Tensor]]:
    """``groups`` single-process nodes on the same schedule: node g trains on the union of
    group g's batches (rank r's stream is shard g*k + r) and mixes with the ring's weights."""
    task = get_task(TASK)
    models = [init_model(task, SEED, "cpu") for _ in range(groups)]
    states = [FlatState(m) for m in models]
    opts = [task.optimizer(m.parameters()) for m in models]
    streams = [[task.stream(g * k + r, groups * k, "iid", SEED) for r in range(k)] for g in range(groups)]
    topo = topology_for("ring", groups, seed=SEED)
    rnd = 0
    for step in range(1, STEPS + 1):
        for g in range(groups):
            parts = [s.next() for s in streams[g]]
            batch = tuple(torch.cat(ts) for ts in zip(*parts))
            opts[g].zero_grad(set_to_none=True)
            task.loss(models[g], batch).backward()
            opts[g].step()
        if mix and step % PERIOD == 0:
            old = [st.flat.clone() for st in states]
            for g in range(groups):
                w = topo.in_weights(g, rnd)
                states[g].flat.copy_(sum(wj * old[j] for j, wj in w.items()))
            rnd += 1
    return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.parametrize("intra", ["fsdp", "ddp"])
def test_groups_match_single_nodes_on_the_union_of_their_batches(tmp_path: Path, intra: str) -> None:
    k = 2
    groups = [f"127.0.0.1:{free_base(k)}" for _ in range(2)]
    with Ranks(tmp_path) as ranks:
        for g in groups:
            ranks.group(k, g, groups, "--intra", intra, "--task", TASK, "--steps", str(STEPS), "--period", str(PERIOD))
        codes = ranks.wait()
        assert all(c == 0 for c in codes.values()), {n: (c, ranks.err(n)[-2000:]) for n, c in codes.items() if c}
    ref = reference(2, k)
    alone = reference(2, k, mix=False)
    order = sorted(groups)
    for g, gid in enumerate(order):
        port = gid.rpartition(":")[2]
        got = torch.load(tmp_path / f"params-{port}.pt")
        assert _max_diff(got, ref[g]) < 1e-5
        assert _max_diff(got, alone[g]) > 1e-3  # the gossip mattered: without it the result is far off
        summaries = [json.loads((tmp_path / f"rank-{port}-{r}.json").read_text()) for r in range(k)]
        for s in summaries:
            assert s["mixed"] == STEPS // PERIOD and s["missing"] == 0 and s["timed_out"] == 0
            assert s["rejected"] == {}  # (hellos to a partner still starting may expire: no state was lost)
            # what the transport saw: one shard per message, never the whole model
            full_bytes = s["model_numel"] * 4
            shard_bytes = s["shard_numel"] * 4
            assert len(s["sent_sizes"]) == STEPS // PERIOD
            assert all(shard_bytes <= n < shard_bytes + 2048 for n in s["sent_sizes"])
            if intra == "fsdp":  # padded as FSDP pads: rank 1's shards hold a row of padding
                assert s["shard_numel"] * k > s["model_numel"]
            assert max(s["sent_sizes"]) < full_bytes * 0.6
            partner = rank_address(order[1 - g], s["rank"])
            assert list(s["bytes_sent"]) == [partner]  # rank r talks to rank r only
            assert s["bytes_sent"][partner] >= sum(s["sent_sizes"])
        assert sum(s["shard_numel"] for s in summaries) >= summaries[0]["model_numel"]  # the shards cover it
        if intra == "fsdp":
            assert all(s["resident_numel"] < s["model_numel"] * 0.6 for s in summaries)  # nobody holds it all
    assert _max_diff(ref[0], ref[1]) > 1e-4  # the last local step made the groups differ: each is checked


def test_groups_of_different_sizes_exit_2_naming_both_sizes(tmp_path: Path, monkeypatch, capsys) -> None:
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    a, b = f"127.0.0.1:{free_base(2)}", f"127.0.0.1:{free_base(1)}"
    with Ranks(tmp_path) as ranks:
        ranks.group(2, a, [a, b], "--intra", "ddp", "--steps", "2")
        # group b is a group of one: this very process, without torchrun
        code = main(["--group", b, "--groups", f"{a},{b}", "--steps", "2", "--connect-timeout", "60"])
        codes = ranks.wait()
        assert codes == {n: 2 for n in codes}, {n: ranks.err(n)[-2000:] for n in codes}
        errors = [ranks.err(n) for n in codes] + [capsys.readouterr().err]
    assert code == 2
    for err in errors:
        assert "group sizes differ" in err and f"group {a} has 2 ranks" in err and f"group {b} has 1 rank" in err


def test_fsdp_without_torchrun_exits_2(monkeypatch, capsys) -> None:
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    assert main(["--group", "127.0.0.1:9", "--groups", "127.0.0.1:9", "--intra", "fsdp"]) == 2
    err = capsys.readouterr().err
    assert "intra 'fsdp'" in err and "torchrun --nproc-per-node" in err
    with pytest.raises(GroupError, match="torchrun --nproc-per-node"):
        start_group("fsdp", "cpu", environ={})


def test_group_of_one_without_torchrun() -> None:
    g = start_group("ddp", "auto", environ={})
    assert (g.size, g.rank, g.pg) == (1, 0, None)
    assert g.device == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    model, view = g.wrap(torch.nn.Linear(3, 2))
    assert view.flat.numel() == view.total == 8 and view.is_bound()
    with torch.no_grad():
        view.flat.fill_(0.5)
    assert float(model.weight.detach().sum()) == pytest.approx(3.0)


def test_environment_and_argument_errors_name_what_is_wrong() -> None:
    base = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    env = group_env(base)
    assert (env.rank, env.size, env.local_size, env.master_port, env.launched) == (0, 2, 2, 29500, True)
    with pytest.raises(GroupError, match="LOCAL_RANK is not set"):
        group_env({k: v for k, v in base.items() if k != "LOCAL_RANK"})
    with pytest.raises(GroupError, match="RANK 2 is not below WORLD_SIZE 2"):
        group_env(dict(base, RANK="2"))
    with pytest.raises(GroupError, match="WORLD_SIZE must be an integer"):
        group_env(dict(base, WORLD_SIZE="two"))
    with pytest.raises(GroupError, match="intra must be one of ddp, fsdp"):
        start_group("zero3", "cpu", environ={})
    with pytest.raises(GroupSizeError, match="group a:1 has 4 ranks, group b:1 has 2 ranks"):
        check_group_sizes({"b:1": 2, "a:1": 4, "c:1": 4})
    check_group_sizes({"a:1": 3, "b:1": 3})
    assert rank_address("h:65534", 1) == "h:65535"
    with pytest.raises(ValueError, match="outside 1-65535"):
        rank_address("h:65535", 1)
    with pytest.raises(ValueError, match="HOST:PORT"):
        rank_address("nohost", 0)
    with pytest.raises(ValueError, match="verdict must be one of mix, skip, stop"):
        Decision(0, ("a:1",), "maybe")


def _member(gid: str, groups: list[str], values: torch.Tensor, **kwargs):
    from gossip.groups.member import GroupMember

    group = start_group("ddp", "cpu", environ={})
    model = torch.nn.Linear(64, 32)
    model, view = group.wrap(model)
    with torch.no_grad():
        view.flat.copy_(values)
    return model, view, GroupMember(group, view, gid, groups, **kwargs)


def _both(*calls, limit: float = 60.0) -> None:
    """Run members' collective steps at once (each group of one is its own thread here)."""
    import threading

    errors: list[BaseException] = []

    def call(f):
        try:
            f()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(f,), daemon=True) for f in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit)
    assert not any(t.is_alive() for t in threads), "a member is still running"
    assert not errors, errors


def test_a_send_still_in_flight_when_mixing_moves_the_parameters_and_sends_the_values_as_they_were(monkeypatch) -> None:
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    a, b = sorted(f"127.0.0.1:{free_base(1)}" for _ in range(2))
    n = 64 * 32 + 32
    xa, xb = torch.arange(n, dtype=torch.float32), torch.full((n,), -1.0)
    # a's link holds each message 1 s, longer than a waits for its transport to let go (0.3 s)
    model_a, view_a, ma = _member(a, [a, b], xa, timeout=0.3, emulate="latency=1s")
    model_b, view_b, mb = _member(b, [a, b], xb, timeout=30.0)
    with ma, mb:
        _both(lambda: ma.connect(30), lambda: mb.connect(30))
        old = view_a.flat
        _both(lambda: ma.exchange(1), lambda: mb.exchange(1))
        mean = (xa + xb) / 2
        assert ma.node.held_sends == 1 and mb.node.held_sends == 0
        assert view_a.flat.data_ptr() != old.data_ptr()  # a mixed in fresh memory ...
        assert torch.equal(old, xa)  # ... so what its transport was sending stayed as it was ...
        assert torch.allclose(view_b.flat, mean)  # ... and b mixed a's values from before the round
        assert torch.allclose(view_a.flat, mean) and view_a.is_bound()
        assert ma.node.state.flat is view_a.flat  # the node mixes the model's memory again
        w = model_a.weight.detach().reshape(-1)
        assert torch.allclose(w, mean[:w.numel()])


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


def test_control_traffic_reaches_rank_0s_control_plane_through_the_rank_s_own_connection(monkeypatch) -> None:
    import threading

    from gossip.core.message import Message
    from gossip.transport import wire

    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    a, b = sorted(f"127.0.0.1:{free_base(1)}" for _ in range(2))
    got: list[str] = []
    arrived = threading.Event()

    def control(ident: bytes, frames: list) -> None:
        got.append(wire.decode(frames).kind)
        arrived.set()

    x = torch.zeros(64 * 32 + 32)
    _, _, ma = _member(a, [a, b], x)
    _, _, mb = _member(b, [a, b], x, control=control)
    with ma, mb:
        _both(lambda: ma.connect(30), lambda: mb.connect(30))
        ma.transport.send(b, wire.encode(Message("ping", a, 0, 0, 1)), droppable=False)
        assert arrived.wait(30)
        assert got == ["ping"]  # hellos and state stay with the member; the rest goes to the hook
        mb.transport.send(a, wire.encode(Message("ping", b, 0, 0, 1)), droppable=False)
        _both(lambda: ma.exchange(1), lambda: mb.exchange(1))  # a round after the ping: it has arrived
        assert ma.rejected["kind"] == 1  # without a hook, a kind the member does not handle is counted


def test_the_examples_in_the_docstrings_hold() -> None:
    import doctest

    import gossip.groups.group

    result = doctest.testmod(gossip.groups.group)
    assert result.attempted >= 5 and result.failed == 0


def test_rank_0s_decision_sets_the_members_and_the_round_and_can_skip(monkeypatch) -> None:
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    ids = sorted(f"127.0.0.1:{free_base(1)}" for _ in range(3))
    n = 64 * 32 + 32
    made = [_member(g, ids, torch.full((n,), float(3 * i))) for i, g in enumerate(ids)]
    views = [v for _, v, _ in made]
    a, b, c = (m for _, _, m in made)
    with a, b, c:
        _both(*(lambda m=m: m.connect(30) for m in (a, b, c)))
        _both(*(lambda m=m: m.exchange(1) for m in (a, b, c)))  # a ring of three: everyone's mean
        assert all(torch.allclose(v.flat, torch.full((n,), 3.0)) for v in views)
        for v, value in zip(views, (0.0, 10.0, 100.0)):
            v.flat.fill_(value)
        pair = Decision(4, (ids[0], ids[1]))  # rank 0 of a and b: c has left; round 4
        reports = {}

        def run(m, d, key):
            reports[key] = m.exchange(2, d)

        _both(lambda: run(a, pair, "a"), lambda: run(b, pair, "b"), lambda: run(c, Decision(4, tuple(ids), "skip"), "c"))
        assert torch.allclose(views[0].flat, torch.full((n,), 5.0))  # a and b only: c's 100 stayed out
        assert torch.allclose(views[1].flat, torch.full((n,), 5.0))
        assert torch.allclose(views[2].flat, torch.full((n,), 100.0)) and reports["c"] is None
        assert reports["a"].mixed == 1 and reports["a"].missing == 0
        assert (a.node.round, a.members, c.node.round) == (5, pair.members, 1)


def test_a_decision_names_joiners_apart_from_members_and_a_donor_only_to_join() -> None:
    d = Decision(3, ("a:1",), handover=["b:1"])
    assert d.handover == ("b:1",) and d.donor is None
    assert Decision(3, ("b:1",), "join", donor="a:1").donor == "a:1"
    with pytest.raises(ValueError, match="cannot be a member of this one"):
        Decision(3, ("a:1", "b:1"), handover=("b:1",))
    with pytest.raises(ValueError, match="a donor goes with the verdict 'join'"):
        Decision(3, ("b:1",), "join")
    with pytest.raises(ValueError, match="a donor goes with the verdict 'join'"):
        Decision(3, ("b:1",), donor="a:1")


def test_rank_0s_control_plane_drops_a_silent_group_and_ends_the_wait_for_it_in_the_round_under_way(
        monkeypatch) -> None:
    """Two groups of one in this process, each with its control plane: b goes silent in the
    middle of a round; a stops waiting once b is declared dead, not at the round's timeout."""
    from gossip.groups.control import GroupControl
    from gossip.protocol.timing import Timing

    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    a, b = sorted(f"127.0.0.1:{free_base(1)}" for _ in range(2))
    n = 64 * 32 + 32
    _, va, ma = _member(a, [a, b], torch.zeros(n), timeout=60.0)
    _, vb, mb = _member(b, [a, b], torch.full((n,), 2.0), timeout=60.0)
    dead_after, heartbeat = 0.6, 0.05
    timing = Timing(heartbeat=heartbeat, dead_after=dead_after)
    pa = ma.plane = GroupControl(ma, timing=timing)
    mb.plane = GroupControl(mb, timing=timing)
    with ma, mb:
        ma.plane.start()
        mb.plane.start()
        _both(lambda: ma.connect(30), lambda: mb.connect(30))
        assert pa.members() == (a, b) and pa.status == "training"
        _both(lambda: ma.exchange(1), lambda: mb.exchange(1))
        assert torch.allclose(va.flat, torch.full((n,), 1.0))  # they mixed
        mb.close()  # b's rank 0 dies: no more pings, no round-1 state
        t0 = time.monotonic()
        report = ma.exchange(2)
        waited = time.monotonic() - t0
        assert report.missing == 1 and ma.skipped_waits == 1 and ma.timed_out == 0
        assert waited < dead_after + heartbeat + 2.0  # the detection time (and a loaded machine), not 60 s
        assert [e["event"] for e in pa.events] == ["dropped"] and "silent" in pa.events[0]["reason"]
        assert ma.exchange(3) is not None and ma.members == (a,)  # the next round is a's alone
        assert ma.skipped_waits == 1


@pytest.mark.numeric
@pytest.mark.parametrize("options", [{"compression": "int8"}, {"outer": "nesterov:lr=0.7,momentum=0.9"},
                                     {"compression": "int8", "outer": "nesterov:lr=0.7,momentum=0.9"}])
def test_a_compressed_rule_or_an_outer_optimizer_on_each_shard_is_the_same_on_the_whole_model(monkeypatch,
                                                                                             options) -> None:
    """CHOCO with int8 and DiLoCo's outer Nesterov per shard (each rank its own connection)
    against the same on whole models: with shard boundaries on the codec's block
    boundaries they agree exactly."""
    from gossip.groups.group import Group, GroupEnv
    from gossip.groups.member import GroupMember
    from gossip.mixing.settings import MixingSettings

    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    mixing = MixingSettings(**options)  # int8: blocks of 256 values; 512 per shard
    n, k = 1024, 2
    gen = torch.Generator().manual_seed(0)
    start = {g: torch.randn(n, generator=gen) for g in "ab"}
    steps = [{g: torch.randn(n, generator=gen) * 0.1 for g in "ab"} for _ in range(3)]

    def build(size: int) -> dict:
        ids = {g: f"127.0.0.1:{free_base(size)}" for g in "ab"}
        members = {}
        for g in "ab":
            for r in range(size):
                group = Group(GroupEnv(rank=r, size=size), "ddp", torch.device("cpu"), None)
                _, view = group.wrap(torch.nn.Linear(256, 4, bias=False))
                with torch.no_grad():
                    view.state.flat.copy_(start[g])
                members[g, r] = GroupMember(group, view, ids[g], sorted(ids.values()), mixing=mixing)
        return members

    def run(members: dict) -> dict:
        for m in members.values():
            m.start()
        try:
            _both(*(lambda m=m: m.connect(30) for m in members.values()))
            for i, delta in enumerate(steps):
                for (g, _), m in members.items():  # "a local step": the same change on every rank's replica
                    with torch.no_grad():
                        m.view.state.flat.add_(delta[g])
                # no process group links these ranks here: each is handed rank 0's decision itself
                _both(*(lambda m=m, i=i: m.exchange(i + 1, Decision(i, m.members)) for m in members.values()))
        finally:
            for m in members.values():
                m.close()
        return members

    whole, sharded = run(build(1)), run(build(k))
    for g in "ab":
        full = whole[g, 0].view.flat
        joined = torch.cat([sharded[g, r].view.flat for r in range(k)])  # rank r's slice is r's to mix
        assert torch.equal(joined, full)
        assert not torch.allclose(full, start[g] + sum(d[g] for d in steps))  # it mixed
        sizes = [sharded[g, r].sent_sizes for r in range(k)]
        assert all(len(s) == 3 and max(s) < max(whole[g, 0].sent_sizes) * 0.6 for s in sizes)
        if "outer" in options:  # the outer optimizer's state is per shard too: its momentum, sliced
            outer = [sharded[g, r].node.rule for r in range(k)]
            assert torch.equal(torch.cat([o.momentum for o in outer]), whole[g, 0].node.rule.momentum)


def test_a_group_resumes_from_its_sharded_checkpoint_where_it_left_off(tmp_path: Path) -> None:
    k = 2
    ck = tmp_path / "ck"
    a = f"127.0.0.1:{free_base(k)}"
    port = a.rpartition(":")[2]
    common = ["--intra", "fsdp", "--steps", "4", "--period", "1", "--checkpoint-dir", str(ck)]
    with Ranks(tmp_path) as ranks:
        ranks.group(k, a, [a], *common, "--checkpoint-every", "2")
        codes = ranks.wait()
        assert all(c == 0 for c in codes.values()), {n: ranks.err(n)[-2000:] for n in codes}
    straight = torch.load(tmp_path / f"params-{port}.pt")
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000002", "step-00000004"]  # no .tmp left
    import shutil

    shutil.rmtree(ck / "step-00000004")
    with Ranks(tmp_path) as ranks:  # the same group again, from step 2
        ranks.group(k, a, [a], *common, "--resume")
        codes = ranks.wait()
        assert all(c == 0 for c in codes.values()), {n: ranks.err(n)[-2000:] for n in codes}
    resumed = torch.load(tmp_path / f"params-{port}.pt")
    assert _max_diff(resumed, straight) == 0.0  # the optimizer's momentum and the data position came back too
    from gossip.groups.checkpoint import latest_group_checkpoint, load_group_checkpoint
    from gossip.groups.group import Group, GroupEnv

    latest = latest_group_checkpoint(ck)
    assert latest is not None and latest.name == "step-00000002"
    for size, intra, words in ((1, "fsdp", "written by a group of 2 ranks; this group has 1"),
                               (2, "ddp", "written with intra 'fsdp', this group runs 'ddp'")):
        other = Group(GroupEnv(size=size), intra, torch.device("cpu"), None)
        with pytest.raises(GroupError, match=words):  # refused before anything is loaded
            load_group_checkpoint(latest, other, None, None, None)


def test_with_overlap_a_round_is_mixed_at_the_next_exchange_and_the_last_at_finish(monkeypatch) -> None:
    from gossip.mixing.settings import MixingSettings

    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    a, b = sorted(f"127.0.0.1:{free_base(1)}" for _ in range(2))
    n = 64 * 32 + 32
    overlap = MixingSettings(overlap=True)
    _, va, ma = _member(a, [a, b], torch.zeros(n), mixing=overlap)
    _, vb, mb = _member(b, [a, b], torch.full((n,), 4.0), mixing=overlap)
    with ma, mb:
        _both(lambda: ma.connect(30), lambda: mb.connect(30))
        _both(lambda: ma.exchange(1), lambda: mb.exchange(1))
        assert float(va.flat.max()) == 0.0 and ma.node.mix_totals.mixed == 0  # still in flight
        with torch.no_grad():
            va.flat.add_(1.0)  # a local step while round 0 travels
        done: dict = {}
        _both(lambda: done.setdefault("a", ma.finish()), lambda: done.setdefault("b", mb.finish()))
        assert done["a"].mixed == 1 and done["b"].mixed == 1
        # x += w (x_j - sent): the local step is kept, the correction is round 0's
        assert torch.allclose(va.flat, torch.full((n,), 1.0 + 0.5 * 4.0))
        assert torch.allclose(vb.flat, torch.full((n,), 4.0 + 0.5 * (0.0 - 4.0)))
        assert ma.finish().mixed == 0  # nothing left


# -- a group dies, torchrun brings it back, it rejoins -------------------------------------------

DEAD_AFTER, HEARTBEAT = 2.0, 0.25  # the detection time is DEAD_AFTER + HEARTBEAT


def _traces(path: Path) -> list[dict]:
    """The ``trace {...}`` lines a group's ranks wrote (``--trace``) so far."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        if line.startswith("trace {"):
            try:
                out.append(json.loads(line[6:]))
            except ValueError:  # a line still being written
                pass
    return out


def _untraced(path: Path, n: int = 3000) -> str:
    """The end of a group's stderr, without its trace lines."""
    return "\n".join(line for line in path.read_text(errors="replace").splitlines()
                     if not line.startswith("trace {"))[-n:]


def _wait_for(what: str, check, procs: dict, errs: dict, limit: float = LIMIT):
    """Poll ``check()`` (every 50 ms) until it returns something true; fail if a torchrun
    ends first or ``limit`` seconds pass."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        for name, p in procs.items():
            if p.poll() is not None:
                raise AssertionError(f"torchrun of group {name} ended (rc {p.returncode}) while waiting for {what}:\n"
                                     f"{_untraced(errs[name])}")
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {limit:g} s:\n" + "\n".join(_untraced(e, 1500) for e in errs.values()))


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


class Torchruns:
    """Groups A and B, each started by a real torchrun (2 ranks, FSDP, gloo) training until
    ``stop`` exists, with --trace; torchrun and its ranks are stopped and reaped on exit."""

    def __init__(self, tmp_path: Path, k: int = 2, restarts: dict[str, int] | None = None) -> None:
        self.tmp, self.k = tmp_path, k
        self.restarts = restarts or {}
        self.groups: dict[str, str] = {}
        self.masters: dict[str, int] = {}
        taken: set[int] = set()
        for name in "AB":  # no port twice: a group's ranks listen on base .. base+k-1, torchrun on its own
            while True:
                base, master = free_base(k), free_base(1)
                ports = {*range(base, base + k), master}
                if len(ports) == k + 1 and not ports & taken:
                    break
            taken |= ports
            self.groups[name], self.masters[name] = f"127.0.0.1:{base}", master
        if self.groups["A"] > self.groups["B"]:  # A's id first: between two lone groups, A's cluster is the stronger
            self.groups["A"], self.groups["B"] = self.groups["B"], self.groups["A"]
        self.stop = tmp_path / "stop"
        self.procs: dict[str, object] = {}
        self.errs = {name: tmp_path / f"{name}.err" for name in self.groups}

    def start(self) -> None:
        import subprocess

        env = {v: os.environ[v] for v in os.environ if v not in TORCHRUN_VARS}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        for name, gid in self.groups.items():
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(self.k),
                   "--master-addr", "127.0.0.1", "--master-port", str(self.masters[name]), "--monitor-interval", "0.1",
                   "--max-restarts", str(self.restarts.get(name, 0)),
                   "-m", "gossip.groups.run", "--group", gid, "--groups", ",".join(self.groups.values()),
                   "--intra", "fsdp", "--task", TASK, "--seed", str(SEED), "--steps", "1000000", "--period", "2",
                   "--timeout", "30", "--connect-timeout", "60", "--join-timeout", "60",
                   "--heartbeat", str(HEARTBEAT), "--dead-after", str(DEAD_AFTER),
                   "--stop-file", str(self.stop), "--out", str(self.tmp), "--trace"]
            # the ranks share torchrun's stderr: opened to append, their lines never overwrite each other
            with open(self.tmp / f"{name}.out", "w") as out, open(self.errs[name], "a") as err:
                self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=self.tmp)

    def traces(self, name: str) -> list[dict]:
        return _traces(self.errs[name])

    def rounds(self, name: str, life: str) -> list[dict]:
        return [t for t in self.traces(name) if t["event"] == "round" and t["life"] == life]

    def wait_for(self, what: str, check):
        return _wait_for(what, check, self.procs, self.errs)

    def finish(self) -> None:
        """Stop both groups through the stop file; both must exit 0."""
        import subprocess

        self.stop.touch()
        for name, p in self.procs.items():
            try:
                p.wait(timeout=LIMIT)
            except subprocess.TimeoutExpired:
                for rank in _children(p.pid):  # what each rank still does: its threads' stacks
                    os.kill(rank, signal.SIGUSR1)
                time.sleep(2.0)
                raise AssertionError(f"torchrun of group {name} still running {LIMIT} s after the stop:\n"
                                     f"{_untraced(self.errs[name], 6000)}") from None
        logs = {name: _untraced(self.errs[name]) for name in self.groups}
        assert {name: p.returncode for name, p in self.procs.items()} == {"A": 0, "B": 0}, logs

    def figures(self, name: str) -> list[dict]:
        port = self.groups[name].rpartition(":")[2]
        return [json.loads((self.tmp / f"rank-{port}-{r}.json").read_text()) for r in range(self.k)]

    def __enter__(self) -> "Torchruns":
        return self

    def __exit__(self, *exc: object) -> None:
        import subprocess

        for p in self.procs.values():  # what is left of a failed run: torchrun and the ranks it started
            if p.poll() is None:
                workers = _children(p.pid)
                for w in workers:  # (a rank stopped by a test must be able to take torchrun's SIGTERM)
                    try:
                        os.kill(w, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    for w in workers:
                        try:
                            os.kill(w, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    p.kill()
                    p.wait(timeout=10)


def _assert_no_long_wait(figures: dict) -> None:
    """A never waited for a dead or silent group longer than the detection time: its longest
    gap between two local steps is within it, plus what a step and an ordinary round take
    here, or this machine's worst hiccup of the run when that is longer (on a loaded
    machine the detector's own ticks are late by as much)."""
    gaps = sorted(figures["step_gaps"])
    assert len(gaps) >= 40
    # the 90th percentile: a step and its round's wait (every other step exchanges), on this machine now
    ordinary = gaps[len(gaps) * 9 // 10]
    hiccup = gaps[-2]  # the longest gap but the one the death is in
    bound = DEAD_AFTER + HEARTBEAT + max(0.5 + 4 * ordinary, hiccup)
    assert max(gaps) <= bound, (max(gaps), bound, gaps[-5:])


def _assert_took_the_donors_shards(donor: list[dict], joiner: list[dict], groups: tuple[str, str]) -> int:
    """Every rank r of the joiner started from the shard rank r of the donor handed it, at one round."""
    rounds = set()
    for r, (d, j) in enumerate(zip(donor, joiner)):
        handed = d["handed"][-1]
        took = j["took"]
        assert took["from"] == rank_address(groups[0], r) and handed["to"] == rank_address(groups[1], r)
        assert took["sha256"] == handed["sha256"] and took["round"] == handed["round"]
        assert took["step"] == handed["step"]
        rounds.add(took["round"])
    assert len(rounds) == 1
    return rounds.pop()


def test_a_group_killed_mid_run_restarts_through_torchrun_and_rejoins_while_the_other_keeps_training(
        tmp_path: Path) -> None:
    with Torchruns(tmp_path, restarts={"B": 1}) as run:
        run.start()
        # both groups train together ...
        run.wait_for("rounds of A and B", lambda: len(run.rounds("B", "0")) >= 10 and len(run.rounds("A", "0")) >= 10)
        victim = next(t["pid"] for t in run.traces("B") if t["event"] == "training" and t["rank"] == 1)
        os.kill(victim, signal.SIGKILL)  # ... until one rank of B dies: B's whole group goes down
        # torchrun restarts B; B's new life takes each rank's shard from A
        joined = run.wait_for("B's new life joining", lambda: [t for t in run.traces("B")
                                                              if t["event"] == "joined" and t["life"] == "1"])
        first = joined[0]["round"]
        run.wait_for("rounds of A and B after the join",
                     lambda: sum(1 for t in run.rounds("B", "1") if t["round"] >= first) >= 10
                     and sum(1 for t in run.rounds("A", "0") if t["round"] >= first) >= 10)
        run.finish()  # both finish
    groups = run.groups
    a, b = run.figures("A"), run.figures("B")
    lives = {t["life"] for t in run.traces("B") if t["event"] == "training"}
    assert lives == {"0", "1"} and all(s["life"] == "1" for s in b)  # B's figures are its second life's
    # A detected the death on its own (rank 0's heartbeats) and went on alone until B was back
    events = [e["event"] for e in a[0]["events"]]
    assert events[:2] == ["dropped", "handover"], a[0]["events"]
    assert "silent" in a[0]["events"][0]["reason"] or "new life" in a[0]["events"][0]["reason"]
    assert any(t["members"] == [groups["A"]] for t in run.rounds("A", "0"))
    assert _assert_took_the_donors_shards(a, b, (groups["A"], groups["B"])) == first
    assert all(s["first_step"] - 1 == s["took"]["step"] for s in b)
    # then it trained in step with A: the same rounds, mixed with A's, neither waiting out a timeout
    for s in a + b:
        assert s["timed_out"] == 0 and s["rejected"] == {}, s
    assert all(s["mixed"] >= 10 for s in b)
    assert abs(a[0]["round"] - b[0]["round"]) <= 1
    assert run.rounds("B", "1")[0]["members"] == sorted(groups.values())
    _assert_no_long_wait(a[0])


def test_a_group_paused_past_the_detection_time_is_dropped_and_rejoins_as_a_new_life(tmp_path: Path) -> None:
    """SIGSTOP of a whole group for longer than dead_after: the other group drops it and trains
    on; the paused one, back, hears that it was dropped and (its cluster the weaker) rejoins,
    taking each rank's shard, without any torchrun restart."""
    with Torchruns(tmp_path) as run:
        run.start()
        run.wait_for("rounds of A and B", lambda: len(run.rounds("B", "0")) >= 10 and len(run.rounds("A", "0")) >= 10)
        ranks = [t["pid"] for t in run.traces("B") if t["event"] == "training"]
        assert len(ranks) == 2
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        try:
            run.wait_for("A dropping B", lambda: [t for t in run.traces("A") if t["event"] == "dropped"])
            before = len(run.rounds("A", "0"))
            run.wait_for("A training alone", lambda: len(run.rounds("A", "0")) >= before + 5)
        finally:
            for pid in ranks:
                os.kill(pid, signal.SIGCONT)
        joined = run.wait_for("B rejoining", lambda: [t for t in run.traces("B") if t["event"] == "joined"])
        first = joined[0]["round"]
        run.wait_for("rounds of A and B after the rejoin",
                     lambda: sum(1 for t in run.rounds("B", "0") if t["round"] >= first) >= 10
                     and sum(1 for t in run.rounds("A", "0") if t["round"] >= first) >= 10)
        run.finish()
    groups = run.groups
    a, b = run.figures("A"), run.figures("B")
    assert all(s["life"] == "0" for s in a + b)  # no restart: B's first life took A's shards
    assert [e["event"] for e in a[0]["events"]][:2] == ["dropped", "handover"], a[0]["events"]
    assert "rejoin" in [e["event"] for e in b[0]["events"]], b[0]["events"]
    assert _assert_took_the_donors_shards(a, b, (groups["A"], groups["B"])) == first
    for s in a + b:
        assert s["timed_out"] == 0, s
    assert abs(a[0]["round"] - b[0]["round"]) <= 1
    _assert_no_long_wait(a[0])
