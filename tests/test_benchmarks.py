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
