"""benchmarks/low_comm.py in a tiny form: its rows, its JSON line and its WAN model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import low_comm  # noqa: E402


def test_crossing_messages_between_the_two_datacenters():
    # ring 0..7: from the first datacenter 3 -> 4 and 0 -> 7 cross
    assert low_comm.crossing_per_round("ring", 8) == 2
    # complete: each of 4 nodes sends to the 4 on the other side
    assert low_comm.crossing_per_round("complete", 8) == 16
    assert low_comm._messages("ring", 8) == 16 and low_comm._messages("complete", 8) == 56


def test_wan_time_is_the_first_evaluation_at_the_target():
    history = [{"step": 0, "loss": 3.0}, {"step": 10, "loss": 2.0}, {"step": 20, "loss": 1.5}]
    assert low_comm.wan_time_to(history, 2.0, round_time=4.0, period=5) == 8.0
    assert low_comm.wan_time_to(history, 1.0, round_time=4.0, period=5) is None


def test_tiny_run_prints_its_figures(capsys):
    pytest.importorskip("examples.language_model")
    code = low_comm.main(["--seeds", "1", "--outer-steps", "2", "--rows", "ddp,localsgd,diloco,gossip-diloco-1peer"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = out["rows"]
    assert set(rows) == {"ddp", "localsgd", "diloco", "gossip-diloco-1peer"}
    assert out["diloco_loss_over_ddp"] == pytest.approx(rows["diloco"]["loss"] / rows["ddp"]["loss"])
    assert out["localsgd_loss_over_diloco"] == pytest.approx(rows["localsgd"]["loss"] / rows["diloco"]["loss"])
    # DDP all-reduces every step; the others exchange once per 10 steps, one peer fewest of all
    assert rows["ddp"]["bytes_per_node"] > rows["diloco"]["bytes_per_node"] > rows["gossip-diloco-1peer"]["bytes_per_node"]
    assert set(out["targets"]) == {"diloco_within_2pct_of_ddp", "gossip_1peer_within_1pct_of_diloco",
                                   "compressed_within_2pct_of_ddp_at_500x_fewer_bytes", "wan_time_10x_less_than_ddp"}


def test_cached_rows_make_one_table_without_running_again(tmp_path, capsys, monkeypatch):
    pytest.importorskip("examples.language_model")
    argv = ["--seeds", "1", "--outer-steps", "2", "--cache", str(tmp_path), "--rows", "ddp",
            "--row", "pg=complete;nesterov:lr=0.7,momentum=0.5,exchange=pseudograd;topk:0.05"]
    assert low_comm.main(argv) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(list(tmp_path.glob("*.json"))) == 2

    def no_run(*a, **k):
        raise AssertionError("a cached row ran again")

    monkeypatch.setattr(low_comm, "run_row", no_run)
    assert low_comm.main(argv) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["rows"] == first["rows"] and first["rows"]["pg"]["bytes_per_node"] < first["rows"]["ddp"]["bytes_per_node"]
    assert low_comm.ROWS["pg"] == ("complete", "nesterov:lr=0.7,momentum=0.5,exchange=pseudograd", "topk:0.05")
