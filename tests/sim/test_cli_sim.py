"""gossip-sim from the command line: the acceptance interface, JSON output, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gossip.cli import sim_main


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gossip.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_acceptance_interface_prints_one_json_line_and_writes_jsonl(tmp_path):
    out = tmp_path / "m.jsonl"
    p = run_cli("--nodes", "4", "--topology", "ring", "--algorithm", "push-sum", "--period", "2", "--task",
                "synthetic", "--split", "dirichlet:0.5", "--steps", "40", "--seed", "3", "--out", str(out), "--json")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    for key in ("final_accuracy", "mean_node_accuracy", "final_loss", "consensus_distance", "bytes_sent",
                "sim_time_s", "wall_time_s"):
        assert isinstance(summary[key], (int, float)), key
    assert summary["bytes_sent"] > 0 and summary["steps"] == 40 and summary["algorithm"] == "push-sum"
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert records[-1]["event"] == "summary" and records[-1]["final_accuracy"] == summary["final_accuracy"]
    evals = [r for r in records if r["event"] == "eval"]
    assert len(evals) >= 10 and evals[-1]["step"] == 40
    assert [r["step"] for r in evals] == sorted(r["step"] for r in evals)
    assert p.stderr == ""  # no progress bar in a pipe


def test_human_summary_without_json(capsys):
    assert sim_main(["--nodes", "2", "--steps", "5", "--task", "synthetic"]) == 0
    assert "averaged-model accuracy" in capsys.readouterr().out


@pytest.mark.parametrize("args,needle", [
    (["--topology", "moebius"], "unknown topology 'moebius'"),
    (["--topology", "torus:4x4", "--nodes", "8"], "16"),
    (["--topology", "random-regular:9", "--nodes", "4"], "degree"),
    (["--task", "imagenet"], "unknown task 'imagenet'"),
    (["--task", "no_such_module_xyz:task"], "cannot import"),
    (["--period", "-1"], "--period must be >= 1"),
    (["--period", "abc"], "--period must be an integer"),
    (["--nodes", "0"], "--nodes must be >= 1"),
    (["--split", "dirichlet:-1"], "ALPHA"),
    (["--split", "shuffled"], "unknown split"),
    (["--compression", "zip"], "zip"),
    (["--link", "latency=fast"], "latency"),
    (["--compute", "gaussian"], "compute"),
    (["--slow", "99=2"], "slow node 99"),
])
def test_bad_input_is_one_line_error_with_exit_2(args, needle, capsys):
    with pytest.raises(SystemExit) as e:
        sys.exit(sim_main(["--steps", "2", *args]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err, err
    assert len(err.splitlines()) == 1 or err.startswith("usage:"), err


def test_disconnected_graph_file_is_rejected(tmp_path, capsys):
    f = tmp_path / "g.txt"
    f.write_text("0 1\n2 3\n")  # undirected edge list: two separate pairs
    assert sim_main(["--nodes", "4", "--topology", f"file:{f}", "--steps", "2"]) == 2
    assert "not strongly connected" in capsys.readouterr().err


def test_unwritable_out_path_is_a_clear_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert sim_main(["--nodes", "2", "--steps", "2", "--out", str(blocker / "m.jsonl")]) == 2
    assert "error" in capsys.readouterr().err
