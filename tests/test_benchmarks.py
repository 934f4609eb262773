"""The transport benchmark runs end to end (tiny payload) and ends with its JSON line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

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
