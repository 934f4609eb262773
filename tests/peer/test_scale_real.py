"""Many real processes seeded in a chain form one cluster (the bounded form of
``benchmarks/real_scale.py``, which runs 64)."""

from __future__ import annotations

import pytest

from benchmarks.real_scale import run


@pytest.mark.slow
def test_sixteen_real_nodes_seeded_in_a_chain_form_one_cluster_and_all_finish(tmp_path):
    # run() raises unless every node started training as one of all 16, every one did all
    # its steps with no timed-out round, and all exited 0
    r = run(tmp_path, 16, 20, limit=600.0)
    assert r["members"] == [16] and r["steps"] == 20 and r["nodes"] == 16
