"""The transport benchmark runs end to end (tiny payload) and ends with its JSON line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_transport_benchmark_smoke():
    # its own process group, so a hang ends with every process it spawned
    proc = subprocess.Popen([sys.executable, "benchmarks/transport.py", "--mib", "3", "--repeat", "1", "--rounds", "1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-2000:]
    lines = stdout.strip().splitlines()
    result = json.loads(lines[-1])
    for key in ("exchange_over_raw_zmq", "exchange_over_raw_zmq_one_frame", "exchange_over_gloo",
                "encode_decode_over_memcpy", "encode_decode_over_clone", "encode_decode_joined_over_memcpy",
                "exchange_over_torch_averager", "raw_mix_over_gloo", "exchange_over_raw_mix",
                "pipelined_over_mix_after"):
        assert 0 < result[key] < 1000, (key, result)
    assert isinstance(result["sends_moved"], int) and result["sends_moved"] >= 0
    assert result["mib"] == 3
    assert set(result["cpu_ms"]) == {"raw", "raw_chunked", "raw_mix", "raw_pipelined", "gossip", "gloo", "averager"}
    assert all(v > 0 for v in result["cpu_ms"].values()), result["cpu_ms"]  # every path moved its bytes on a CPU
    assert any(line.startswith("raw pyzmq, 1 MiB frames") for line in lines)
    assert any(line.startswith("raw in 3 parts, each mixed") for line in lines)  # 3 MiB: 3 messages of 1 MiB


def _run(args: list[str], timeout: float = 300) -> tuple[list[str], dict]:
    """Run a benchmark script in its own process group (a hang ends with everything it
    spawned); its stdout lines and its final JSON line."""
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    lines = stdout.strip().splitlines()
    return lines, json.loads(lines[-1])


def test_codecs_benchmark_smoke():
    lines, r = _run(["benchmarks/codecs.py", "--numel", "65536", "--repeat", "2", "--steps", "10"])
    for spec in ("identity", "fp16", "bf16", "int8", "topk:0.01", "randk:0.01", "sign"):
        assert 0 < r[spec] < 10**5, (spec, r)
    assert r["memcpy_ms"] > 0 and r["clone_ms"] > 0
    assert isinstance(r["targets_met"], bool)
    assert "memcpy (warm copy_)" in lines[0] and "clone (fresh memory)" in lines[0], lines[0]
    rows = r["accuracy"]
    assert len(rows) == 9
    none, topk = rows["gossip none"], rows["gossip topk:0.01"]
    # the headline keys are the table's own figures, not separate measurements
    assert r["topk_fewer_bytes"] == topk["ratio"] > 10
    assert r["topk_minus_none_pts"] == round(100 * (topk["final_accuracy"] - none["final_accuracy"]), 2)
    assert r["topk_minus_none_node_pts"] == round(
        100 * (topk["mean_node_accuracy"] - none["mean_node_accuracy"]), 2)


def test_cross_dc_reports_the_worst_seed():
    _, r = _run(["benchmarks/cross_dc.py", "--seeds", "2", "--steps", "30"])
    per_seed = r["overlap_loss_change_per_seed"]
    assert len(per_seed) == 2
    assert r["overlap_loss_change"] == max(per_seed, key=abs)
    assert r["targets_met"]["overlap_loss_change"] == (abs(r["overlap_loss_change"]) <= 0.02)
    assert r["targets_met"]["overlap_speedup"] == (r["overlap_speedup_min"] >= 1.6)
    assert r["overlap_speedup_min"] <= r["overlap_speedup"]
    assert r["async_time_over_sync_max"] >= r["async_time_over_sync"]
    assert r["targets_met"]["async_time_over_sync"] == (r["async_time_over_sync_max"] <= 1 / 3)


def test_gpu_check_parameter_count_is_the_model_s():
    from benchmarks.gpu_check import WideTask, parameter_count

    model = WideTask(4096).model()
    assert sum(p.numel() for p in model.parameters()) == parameter_count(4096) == 18_948_112


def test_gpu_check_dry_run_compares_gossip_with_the_same_two_nodes_not_exchanging():
    lines, r = _run(["benchmarks/gpu_check.py", "--dry-run"])
    from benchmarks.gpu_check import parameter_count

    assert r["cuda"] is False and r["params"] == parameter_count(64)
    assert (r["steps"], r["warmup"], r["repeat"]) == (24, 4, 2)
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in r["runs_ms"].values()), r["runs_ms"]
    for key in ("off_ms", "gossip_ms", "period4_ms"):
        assert r[key] > 0
    # (the ratio is of the unrounded medians; the medians are printed to 3 decimals)
    assert r["gossip_over_off"] == pytest.approx(r["gossip_ms"] / r["off_ms"], abs=2e-3)
    # off exchanged nothing, gossip a model per node and step, period4 a quarter of that
    model = r["params"] * 4
    assert r["bytes_sent"]["off"] < model
    assert 2 * 24 * model <= r["bytes_sent"]["gossip"] < 2 * 24 * model + model
    assert 2 * 6 * model <= r["bytes_sent"]["period4"] < 2 * 6 * model + model
    assert any(line.strip().startswith("no exchange") for line in lines)


def test_gpu_check_without_cuda_says_so():
    import torch

    if torch.cuda.is_available():
        return  # the full run is the GPU machine's to make
    _, r = _run(["benchmarks/gpu_check.py"], timeout=120)
    assert r == {"cuda": False}


def test_faults_removals_name_the_victim_and_follow_the_kill():
    from datetime import datetime

    from benchmarks.faults import removals

    line = "2026-12-01 10:00:0{s},{ms:03d} WARNING [127.0.0.1:6000] gossip.protocol.membership: member {m} removed: {why}"
    log = "\n".join([
        line.format(s=1, ms=0, m="127.0.0.1:5002", why="silent for more than 2 s"),  # before the kill
        line.format(s=3, ms=0, m="127.0.0.1:50021", why="silent for more than 2 s"),  # another member
        line.format(s=4, ms=0, m="127.0.0.1:5002", why="said goodbye (done)"),  # not a crash verdict
        line.format(s=5, ms=250, m="127.0.0.1:5002", why="silent for more than 2 s"),
    ])
    kill = datetime(2026, 12, 1, 10, 0, 2).timestamp()
    assert [round(t - kill, 3) for t in removals(log, "127.0.0.1:5002", kill)] == [3.25]
    assert [round(t - kill, 3) for t in removals(log, "127.0.0.1:50021", kill)] == [1.0]
    assert removals(log, "127.0.0.1:5002", kill + 4) == []


def _texts() -> tuple[str, str]:
    return (ROOT / "README.md").read_text(), (ROOT / "benchmarks" / "RESULTS.md").read_text()


def test_every_readme_figure_is_the_range_of_recorded_runs_of_its_command():
    from benchmarks.check_claims import check

    claims, problems = check(*_texts())
    assert problems == []
    assert {c.script for c in claims} >= {"`sim_overhead.py`", "`codecs.py`", "`transport.py`", "`cross_dc.py`",
                                          "`faults.py`"}, claims
    assert all(c.command.startswith("python ") for c in claims)


def test_check_claims_fails_on_a_doctored_readme(tmp_path):
    from benchmarks.check_claims import check, main

    readme, results = _texts()
    claims, _ = check(readme, results)
    c = claims[0]
    # a range that is not the runs' range
    wider = readme.replace(c.text, f"`{c.key}` {c.lo:.{c.decimals}f}-{c.hi + 1:.{c.decimals}f}", 1)
    assert any(f"`{c.key}`" in p and "range" in p for p in check(wider, results)[1])
    # the same figure beside a command no run was made with
    other = readme.replace(f"`{c.command}`", f"`{c.command} --steps 7`", 1)
    assert any("no RESULTS.md run" in p for p in check(other, results)[1])
    # a number with no JSON key in a figures cell
    bare = readme.replace(c.text, c.text + "; 1.5x faster", 1)
    assert any("no JSON key" in p for p in check(bare, results)[1])
    # the runs of that command gone from RESULTS.md
    kept = "\n".join(ln for ln in results.splitlines()
                     if not (ln.startswith("| 2") and f"`{c.command}`" in ln))
    assert any("no RESULTS.md run" in p for p in check(readme, kept)[1])
    # and the command line says so with its exit status
    (tmp_path / "README.md").write_text(wider)
    assert main(["--readme", str(tmp_path / "README.md")]) == 1
    assert main([]) == 0


def test_sim_scale_benchmark_quick():
    # the quick form: 64 nodes x 20 steps batched, the engines side by side, memory fitted at 128 and 1024 nodes
    proc = subprocess.run([sys.executable, "benchmarks/sim_scale.py", "--quick"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["nodes"] == 64 and result["steps"] == 20 and result["memory_sizes"] == [128, 1024]
    assert 0 < result["wall_s_64x20"] < 600
    assert result["final_accuracy"] > 0.3  # it trained (chance is 0.1)
    assert result["per_node_ms_per_step"] > 0 and result["batched_ms_per_step"] > 0
    # peaks grow with the node count, and the fit extrapolates past both sizes
    assert result["peak_gib"][1] > result["peak_gib"][0] > 0
    assert result["kib_per_node"] > 19  # at least one float32 copy of the 4810-parameter model per node
    assert result["max_nodes_8gib"] > 1024


def test_faults_refuses_a_heal_whose_cut_missed_training(monkeypatch, capsys):
    """A heal run where a node was not training at its cut measures no partition:
    it is tried again with a cut 10 s after the slowest start measured, and when
    every try misses, the JSON line holds no heal figures and the exit status is 1."""
    import benchmarks.faults as faults

    tries = []

    def heal(workdir, cut):
        tries.append(cut)
        raise faults.CutBeforeTraining("heal0 began training 31.0 s after its start", 31.0)

    monkeypatch.setattr(faults, "heal", heal)
    monkeypatch.setattr(faults, "crash", lambda steps, dead_after: {
        "faulty": {"victims": {}, "survivors": 6, "max_step_gap_s": 2.0, "mean_accuracy": 0.9},
        "clean": {"max_step_gap_s": 0.1, "mean_accuracy": 0.9}})
    monkeypatch.setattr(faults, "partition", lambda: {"consensus_before": 0.02, "consensus_end_of_split": 0.9,
                                                      "consensus_final": 0.01, "final_accuracy": 0.95})
    monkeypatch.setattr(faults, "byzantine", lambda seeds: {"mean_clean": 0.96, "mean_attack": 0.1,
                                                            "mean_attack_clip": 0.95, "mean_clean_clip": 0.96})
    monkeypatch.setattr(sys, "argv", ["faults.py", "--heal-attempts", "2", "--cut", "15-25"])
    assert faults.main() == 1
    assert tries == [(15.0, 25.0), (41.0, 51.0)]
    out = capsys.readouterr().out.strip().splitlines()
    assert sum("discarded" in line for line in out) == 2
    assert json.loads(out[-1])["heal"] == {"attempts": 2, "refused": "heal0 began training 31.0 s after its start"}


def test_protocol_scale_measures_the_whole_control_plane_of_a_small_cluster():
    """The benchmark's bounded form: 8 members, the figures it reports in their range."""
    from benchmarks.protocol_scale import run

    lines = []
    r = run(8, steady=3.0, crashes=2, progress=lines.append)
    assert 0 < r["form_s"] < 15, r
    # each figure reported as it is measured: formation, traffic, each crash, the join
    assert [ln.split(": ", 1)[1].split(" ")[0] for ln in lines] == \
        ["form_s", "ctrl_msgs_per_node_s", "crash", "crash", "join_s"], lines
    assert f"form_s {r['form_s']:.3f}" in lines[0] and 0 < r["wall_s_start"] <= r["wall_s"], (lines, r)
    assert 1 < r["ctrl_msgs_per_node_s"] < 10 and 50 < r["ctrl_bytes_per_msg"] < 1000, r
    assert 1.0 < r["detect_s"] < 15 and 0 < r["join_s"] < 15 and r["false_deaths"] == 0, r
    assert set(r["traffic_by_kind"]) >= {"hello", "members", "swim"} and "state" not in r["traffic_by_kind"], r
    assert r["biggest_ctrl_msg_bytes"]["swim"] < 1024, r  # a digest of fixed size, whatever the cluster
    # a crash's window: the survivors' control traffic until all removed it, whole tables counted
    assert 0 < r["crash_ctrl_bytes_per_node_s"] < 20_000 and 0 <= r["crash_tables"] < 1000, r
