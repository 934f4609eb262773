"""A join hands over the whole training state, real processes on loopback
(tests/user_scripts/mnist_restartable.py: the MNIST-style script with a StepLR
schedule and checkpoints): a node killed and started again takes a member's
learning rate, optimizer state and epoch at its join; a node started after the
cluster formed trains its own share of the epochs after its join, on a shard
that overlaps no other; a node whose cluster finishes before its join round
exits with status 0 and one line."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from tests.cluster import free_port
from tests.peer.test_user_scripts import SCRIPTS, ScriptProc, finished, wait_removed

SCRIPT = SCRIPTS / "mnist_restartable.py"
HANDS = re.compile(r"(\S+): handed its state of step (\d+) to \S+ \(learning rate ([\d.e-]+), "
                   r"optimizer state sha256 ([0-9a-f]+)\)")
TOOK = re.compile(r"took the member's optimizer state: learning rate ([\d.e-]+), optimizer state sha256 ([0-9a-f]+)")
EPOCH = re.compile(r"epoch (\d+) batches (\d+) steps (\d+) lr ([\d.e-]+)")


class Run:
    """Nodes of mnist_restartable.py in ``tmp``; each node index has its own port,
    checkpoint directory and ids file (a restarted node keeps them)."""

    def __init__(self, tmp: Path, n: int, join_margin: int = 10) -> None:
        self.tmp, self.ports, self.join_margin = tmp, [free_port() for _ in range(n)], join_margin
        self.last = tmp / "last"
        self.procs: list[ScriptProc] = []

    def start(self, i: int, name: str, seed: int | None = None) -> ScriptProc:
        peer = self.ports[(i + 1) % len(self.ports)] if seed is None else self.ports[seed]
        p = ScriptProc(self.tmp, name, SCRIPT, self.ports[i], peer,
                       ["--checkpoints", str(self.tmp / f"ck{i}"), "--last", str(self.last), "--ids",
                        str(self.tmp / f"ids{i}.jsonl"), "--join-margin", str(self.join_margin)])
        self.procs.append(p)
        return p

    def ids(self, i: int) -> dict[int, list[int]]:
        path = self.tmp / f"ids{i}.jsonl"
        return {r["epoch"]: r["ids"] for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}

    def epochs_printed(self, p: ScriptProc) -> list[tuple[int, int, int, float]]:
        return [(int(e), int(b), int(s), float(lr)) for e, b, s, lr in EPOCH.findall(p.stdout())]

    def stop_after(self, epoch: int) -> None:
        self.last.write_text(str(epoch))

    def reap(self) -> None:
        for p in self.procs:
            p.reap()


def wait_until(what, timeout: float, why: str, procs=()):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"{why} within {timeout} s:\n" + "\n".join(f"--- {p.name}\n{p.log()[-2500:]}" for p in procs))


def the_handover(joiner: ScriptProc, donors: list[ScriptProc]) -> tuple[str, int, float, str]:
    """(donor, step, learning rate, optimizer sha) of the state ``joiner`` took, checked
    to be what a donor logged it handed over."""
    took = TOOK.search(joiner.log())
    assert took, joiner.log()[-3000:]
    lr, sha = float(took.group(1)), took.group(2)
    handed = [(m.group(1), int(m.group(2)), float(m.group(3)), m.group(4)) for d in donors
              for m in HANDS.finditer(d.log())]
    match = [h for h in handed if h[2] == lr and h[3] == sha]
    assert match, (lr, sha, handed)
    return match[-1]


def epoch_at(printed: list[tuple[int, int, int, float]], step: int) -> tuple[int, float]:
    """(epoch, learning rate) of the epoch a donor trained step ``step`` in."""
    for epoch, batches, end, lr in printed:
        if end - batches < step <= end:
            return epoch, lr
    raise AssertionError(f"no epoch holds step {step}: {printed}")


def disjoint(parts: list[list[int]]) -> bool:
    seen: set[int] = set()
    for ids in parts:
        if seen & set(ids):
            return False
        seen |= set(ids)
    return True


def test_a_restarted_node_takes_the_learning_rate_optimizer_state_and_epoch_of_its_donor(tmp_path):
    run = Run(tmp_path, 3)
    try:
        n0, n1, n2 = (run.start(i, f"n{i}") for i in range(3))
        # killed once its schedule has moved (epoch 2 under way: its learning rate is no longer
        # the starting one) and a checkpoint of its own exists (older than the cluster's state)
        wait_until(lambda: len(run.epochs_printed(n1)) >= 1 and list((tmp_path / "ck1").glob("ckpt-*.pt")), 240,
                   "n1 finished no epoch", [n1])
        n1.proc.send_signal(signal.SIGKILL)
        n1.proc.wait(timeout=10)
        wait_removed([n0, n2], run.ports[1])
        back = run.start(1, "n1b")
        resumed = int(back.wait_for(r"continuing at step (\d+)", 240).group(1))
        run.stop_after(max(e for p in (n0, n2) for e, *_ in run.epochs_printed(p)) + 2)
        for p in (n0, n2, back):
            p.proc.wait(timeout=300)
    finally:
        run.reap()
    for p in (n0, n2, back):
        assert p.proc.returncode == 0 and "Traceback" not in p.log(), p.log()[-3000:]
    donor, step, lr, _ = the_handover(back, [n0, n2])
    assert step == resumed > 0, (step, resumed)
    # the donor's learning rate, for the epoch the cluster was in at the join: the schedule went on
    printed = run.epochs_printed(n0 if donor.endswith(str(n0.port)) else n2)
    epoch, cluster_lr = epoch_at(printed, step + 1)
    assert lr == cluster_lr == pytest.approx(0.05 * 0.7 ** (epoch - 1)) and epoch >= 2, (lr, cluster_lr, epoch)
    assert f"took the schedule from the state of {donor}" in back.log()
    # its epoch: the one its donor was in, continued on its own shard, or (the epoch began while it
    # was away, shared by the two others) taken part in without training until it ended
    cont = re.search(r"continuing in epoch (\d+), after batch (\d+) of (\d+)", back.log())
    serve = re.search(r"joined in epoch (\d+), whose data its (\d+) members share", back.log())
    assert (cont is None) != (serve is None), back.log()[-3000:]
    mine = run.epochs_printed(back)
    if cont:
        assert int(cont.group(1)) == epoch and mine[0][0] == epoch, (cont.group(0), epoch, mine)
        assert mine[0][1] == int(cont.group(3)) - int(cont.group(2))  # the rest of its shard of that epoch
    else:  # (that epoch's body ran over no batches: its evaluation and scheduler step as on the others)
        assert int(serve.group(1)) == epoch and mine[0][:2] == (epoch, 0) and mine[1][0] == epoch + 1, mine
    # it goes on with the cluster's schedule (not its checkpoint's, not afresh)
    others = {e: lr for e, _, _, lr in printed}
    for e, _, _, lr_e in mine:
        assert lr_e == others[e], (e, lr_e, others[e])
    ends = [finished(p)[0] for p in (n0, n2, back)]
    assert len(set(ends)) == 1, ends
    # every epoch all three trained in full: shards that overlap no other and cover the data
    ids = [run.ids(1), run.ids(0), run.ids(2)]
    for e in ids[0]:
        if e > mine[0][0] and all(e in d for d in ids):
            assert disjoint([d[e] for d in ids]) and len(set().union(*(d[e] for d in ids))) == 240, e


def test_a_node_started_after_the_cluster_formed_trains_its_own_share(tmp_path):
    run = Run(tmp_path, 3)
    try:
        n0, n1 = run.start(0, "n0", seed=1), run.start(1, "n1", seed=0)
        wait_until(lambda: run.epochs_printed(n0), 240, "the cluster of two trained no epoch", [n0, n1])
        n2 = run.start(2, "n2", seed=0)
        n2.wait_for(r"training as \d of 3", 240)
        wait_until(lambda: run.epochs_printed(n2), 240, "n2 ran no epoch", [n2])
        run.stop_after(run.epochs_printed(n2)[0][0] + 2)
        for p in (n0, n1, n2):
            p.proc.wait(timeout=300)
    finally:
        run.reap()
    for p in (n0, n1, n2):
        assert p.proc.returncode == 0 and "Traceback" not in p.log(), p.log()[-3000:]
    serve = re.search(r"joined in epoch (\d+), whose data its 2 members share; taking part in its rounds "
                      r"without training until it ends at step (\d+)", n2.log())
    # the join round is wherever the founders were when it said hello: it may also be the very
    # end of an epoch, and then it starts the next one with its own shard
    fresh = re.search(r"step (\d+): continuing in epoch (\d+), after batch 0 of 10", n2.log())
    assert (serve is None) != (fresh is None), n2.log()[-3000:]
    joined_epoch, ends_at = (int(serve.group(1)), int(serve.group(2))) if serve else \
        (int(fresh.group(2)) - 1, int(fresh.group(1)))
    a, b, c = (run.epochs_printed(p) for p in (n0, n1, n2))
    assert a == [(e, n, s, lr) for e, n, s, lr in b], (a, b)  # the two founders agree on everything
    # epochs of 15 batches (240 samples, 2 shards of 8-sample batches) until the one it joined in
    # ended, of 10 (3 shards) from then on; it trained only those
    assert all(n == (15 if s <= ends_at else 10) for _, n, s, _ in a), (a, ends_at)
    if serve:  # the epoch it joined in: its body ran over no batches (the learning rate stepped as on the others)
        assert c[0][:3] == (joined_epoch, 0, ends_at), (c, ends_at)
    assert c == [x if x[2] > ends_at else (x[0], 0, x[2], x[3]) for x in a if x[2] >= ends_at + (fresh is not None)], \
        (a, c)
    assert all(n == 10 for _, n, _, _ in c[bool(serve):]) and len(c) >= 2
    ids = [run.ids(i) for i in range(3)]
    for e, *_ in c[1:]:  # three shards that overlap no other and cover the data
        assert disjoint([d[e] for d in ids]) and len(set().union(*(d[e] for d in ids))) == 240, e
    for e, *_ in a:
        if e <= joined_epoch:
            assert not ids[2].get(e) and disjoint([ids[0][e], ids[1][e]]), e
    ends = [finished(p) for p in (n0, n1, n2)]
    assert len({s for s, _, _ in ends}) == 1 and ends[2][2] == 0, ends
    # no round timed out from the join on (before it, a loaded machine may stall the two founders:
    # that is not what this test is about)
    join_round = int(re.search(rf"127.0.0.1:{n2.port} joins the running cluster from round (\d+)",
                               n0.log() + n1.log()).group(1))
    late = [int(r) for p in (n0, n1) for r in re.findall(r"round (\d+) timed out", p.log()) if int(r) >= join_round]
    assert late == [], (late, join_round)
    assert ends[2][1] == 10 * (len(c) - bool(serve)), ends  # its share only: no step of an epoch it had no shard of
    donor, step, lr, _ = the_handover(n2, [n0, n1])
    assert lr == epoch_at(a, step + 1)[1], (lr, a)


@pytest.mark.parametrize("how", ["started later", "restarted"])
def test_a_node_whose_cluster_finishes_before_its_join_round_exits_cleanly(tmp_path, how):
    """Its join is scheduled 200 rounds ahead; the cluster stops after its current epoch:
    nobody will ever hand it a state. It says so in one line and exits with status 0,
    whether it is new to the cluster or a member killed and started again (with a
    checkpoint of its own: a restart near the end, which once crashed with ClusterGone)."""
    run = Run(tmp_path, 3, join_margin=200)
    try:
        if how == "started later":
            n0, n1 = run.start(0, "n0", seed=1), run.start(1, "n1", seed=0)
            wait_until(lambda: run.epochs_printed(n0), 240, "the cluster of two trained no epoch", [n0, n1])
        else:
            n0, n1, n2 = run.start(0, "n0", seed=1), run.start(1, "n1", seed=0), run.start(2, "n2", seed=0)
            wait_until(lambda: run.epochs_printed(n2) and list((tmp_path / "ck2").glob("ckpt-*.pt")), 240,
                       "n2 finished no epoch", [n0, n1, n2])
            n2.proc.send_signal(signal.SIGKILL)
            n2.proc.wait(timeout=10)
        joins = rf"127.0.0.1:{run.ports[2]} joins the running cluster from round"
        before = len(re.findall(joins, n0.log() + n1.log()))  # (the killed life may have joined late too)
        n2 = run.start(2, "n2" if how == "started later" else "n2b", seed=0)
        wait_until(lambda: len(re.findall(joins, n0.log() + n1.log())) > before, 240,
                   "no member scheduled n2's join", [n0, n1, n2])
        run.stop_after(0)
        for p in (n0, n1, n2):
            p.proc.wait(timeout=240)
    finally:
        run.reap()
    for p in (n0, n1):
        assert p.proc.returncode == 0, p.log()[-3000:]
    assert n2.proc.returncode == 0, n2.log()[-3000:]
    assert "Traceback" not in n2.log(), n2.log()[-3000:]
    lines = [ln for ln in n2.log().splitlines() if "has finished training" in ln]
    assert len(lines) == 1 and "nothing left to train; exiting" in lines[0] and "WARNING" in lines[0], n2.log()
    assert "start step" not in n2.stdout()  # the script did not go on past GossipNode
