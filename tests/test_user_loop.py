"""GossipNode: gossip inside the user's own training loop, two real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.cluster import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_two_user_loops_gossip_and_agree():
    p0, p1 = free_port(), free_port()
    script = str(ROOT / "examples" / "own_training_loop.py")
    procs = [subprocess.Popen([sys.executable, script, "--listen", f"127.0.0.1:{a}", "--peers", f"127.0.0.1:{b}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for a, b in ((p0, p1), (p1, p0))]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    a, b = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert {a["rank"], b["rank"]} == {0, 1} and a["world_size"] == b["world_size"] == 2
    assert a["accuracy"] > 0.8 and b["accuracy"] > 0.8
    # two nodes on a ring average exactly: after the last exchange they hold the same model
    # (neighbor_distance is measured against the neighbour's last *sent*, pre-mixing parameters)
    assert a["loss"] == b["loss"] and a["neighbor_distance"] < 0.05
    assert a["bytes_sent"] > 150 * 2762 * 4
