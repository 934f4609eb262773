"""Hugging Face's Trainer as gossip members (gossip.integrations.transformers), three real
processes on loopback running tests/user_scripts/hf_trainer.py: a tiny GPT-2 from a
config, the Trainer made a member by two lines. Skipped without transformers
(``pip install ".[hf]"``)."""

from __future__ import annotations

import difflib
import json
import re
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the Hugging Face integration needs transformers: pip install '.[hf]'")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate: pip install '.[hf]'")

from tests.cluster import free_port  # noqa: E402
from tests.peer.test_user_scripts import SCRIPTS, ScriptProc, finished, wait_removed  # noqa: E402

SCRIPT = SCRIPTS / "hf_trainer.py"


class HFRun:
    def __init__(self, tmp: Path, n: int = 3) -> None:
        self.tmp, self.ports = tmp, [free_port() for _ in range(n)]
        self.stop = tmp / "stop"
        self.procs: list[ScriptProc] = []

    def start(self, i: int, name: str, resume: bool = False) -> ScriptProc:
        args = ["--out", str(self.tmp / f"out{i}"), "--ids", str(self.tmp / f"{name}.ids"), "--stop-at",
                str(self.stop), "--final", str(self.tmp / f"final{i}")] + (["--resume"] if resume else [])
        p = ScriptProc(self.tmp, name, SCRIPT, self.ports[i], self.ports[(i + 1) % len(self.ports)], args)
        self.procs.append(p)
        return p

    def result(self, p: ScriptProc) -> dict:
        lines = [ln for ln in p.stdout().splitlines() if ln.startswith('{"global_step"')]
        assert lines, p.log()[-3000:]
        return json.loads(lines[-1])

    def ids(self, name: str) -> list[int]:
        return json.loads((self.tmp / f"{name}.ids").read_text())

    def reap(self) -> None:
        for p in self.procs:
            p.reap()


def wait_all(procs: list[ScriptProc], timeout: float) -> None:
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.proc.wait(timeout=max(0.1, end - time.monotonic()))
        except Exception:
            raise AssertionError(f"{p.name} did not finish:\n{p.log()[-3000:]}") from None
    for p in procs:
        assert p.proc.returncode == 0 and "Traceback" not in p.log(), f"{p.name}:\n{p.log()[-3000:]}"


def cluster_step(p: ScriptProc) -> int:
    """The furthest step a node's Trainer logged a checkpoint at, or 0."""
    steps = [int(s) for s in re.findall(r"checkpoint-(\d+)", p.log())]
    return max(steps, default=0)


def test_the_trainer_is_made_a_member_by_two_lines():
    before = SCRIPT.read_text().replace("from gossip.integrations.transformers import GossipTrainer\n", "") \
        .replace("GossipTrainer(", "Trainer(").replace("TrainerCallback, TrainingArguments",
                                                        "Trainer, TrainerCallback, TrainingArguments")
    diff = [d for d in difflib.unified_diff(before.splitlines(), SCRIPT.read_text().splitlines(), n=0, lineterm="")
            if d[:1] in "+-" and d[:3] not in ("+++", "---")]
    assert len([d for d in diff if d.startswith("+")]) <= 3, diff


def test_three_trainers_train_disjoint_shards_agree_on_evaluation_and_one_saves(tmp_path):
    run = HFRun(tmp_path)
    run.stop.write_text("24")  # 3 epochs of 8 steps (192 samples, 3 shards, batches of 8)
    try:
        procs = [run.start(i, f"n{i}") for i in range(3)]
        wait_all(procs, 400)
    finally:
        run.reap()
    results = [run.result(p) for p in procs]
    assert [r["global_step"] for r in results] == [24, 24, 24], results
    # each node evaluated its own data (another seed per node); the averaged loss is the same float
    assert len({r["eval_loss"] for r in results}) == 1, results
    local = [float(m) for p in procs for m in re.findall(r"'eval_loss': '([\d.]+)'", p.stdout())]
    assert len(local) == 3 and len(set(local)) == 1
    ends = [finished(p) for p in procs]
    assert all(s == 24 and t == 24 and timed_out == 0 for s, t, timed_out in ends), ends
    # each epoch (8 steps of 8 samples), three shards of the epoch's permutation: disjoint, covering the data
    reads = [run.ids(f"n{i}") for i in range(3)]
    assert [len(r) for r in reads] == [24 * 8] * 3
    for e in range(3):
        parts = [set(r[64 * e:64 * (e + 1)]) for r in reads]
        assert [len(p) for p in parts] == [64] * 3 and len(parts[0] | parts[1] | parts[2]) == 192, e
    saved = [i for i in range(3) if (tmp_path / f"final{i}" / "model.safetensors").exists()]
    assert len(saved) == 1, saved
    assert sum("saved the cluster's model" in p.log() for p in procs) == 1


def test_a_trainer_killed_and_restarted_with_resume_from_checkpoint_ends_at_the_clusters_step(tmp_path):
    run = HFRun(tmp_path)
    try:
        procs = [run.start(i, f"n{i}") for i in range(3)]
        # killed once it wrote a checkpoint of its own (older than the cluster's state at its return)
        end = time.monotonic() + 300
        while not list((tmp_path / "out1").glob("checkpoint-*/trainer_state.json")) and time.monotonic() < end:
            time.sleep(0.05)
        assert list((tmp_path / "out1").glob("checkpoint-*")), procs[1].log()[-3000:]
        procs[1].proc.send_signal(signal.SIGKILL)
        procs[1].proc.wait(timeout=10)
        wait_removed([procs[0], procs[2]], run.ports[1])
        back = run.start(1, "n1b", resume=True)
        m = back.wait_for(r"the Trainer starts at the cluster's step (\d+) \(its own checkpoint: step (\d+)\)", 300)
        joined, own = int(m.group(1)), int(m.group(2))
        run.stop.write_text(str(joined + 24))
        wait_all([procs[0], procs[2], back], 400)
    finally:
        run.reap()
    assert joined > own > 0, (joined, own)
    results = [run.result(p) for p in (procs[0], procs[2], back)]
    assert {r["global_step"] for r in results} == {joined + 24}, results
    assert len({r["eval_loss"] for r in results}) == 1, results
    steps, trained, timed_out = finished(back)
    assert (steps, trained, timed_out) == (joined + 24, 24, 0), back.log()[-3000:]
    assert "took the member's optimizer state" in back.log() and "took the schedule from the state of" in back.log()
    # its own shard again, from the cluster's batch: in each epoch, nothing another node read in it
    reads = {name: run.ids(name) for name in ("n0", "n2", "n1b")}
    # (a stop in the middle of an epoch: Accelerate's loader had fetched the next batch already)
    assert len(reads["n1b"]) in (24 * 8, 25 * 8), len(reads["n1b"])
    reads = {name: r[:8 * (joined + 24)] if name != "n1b" else r[:8 * 24] for name, r in reads.items()}
    spe, first = 8, joined % 8  # the restarted node's reads start at batch `first` of the cluster's epoch
    def by_epoch(r: list[int], skip: int) -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for k, i in enumerate(r):
            out.setdefault((skip + k // 8) // spe, set()).add(i)
        return out
    survivors = [by_epoch(reads[n][8 * joined:], joined) for n in ("n0", "n2")]
    mine = by_epoch(reads["n1b"], joined)
    for e, ids in mine.items():
        assert ids and not ids & (survivors[0].get(e, set()) | survivors[1].get(e, set())), e
    assert first == 0 or len(mine[joined // spe]) == 8 * (spe - first)
