"""The two-datacenter study's short form, as CI runs it, and the figures it reports.

The short form runs once per module (about 20 s on two busy cores); the tests
check its returned figures against each other, against the metrics files, and
against what the modelled links imply.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sklearn")  # digits

from examples import two_dc_study  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CONFIGS = {"sync", "async", "async+staleness", "async+staleness+compressed", "sync+outer"}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("two_dc")
    return two_dc_study.main(["--short", "--out-dir", str(out_dir), "--device", "cpu"])


def test_runs_the_four_configurations(study):
    runs = study["runs"]
    assert set(runs) == CONFIGS
    assert [runs[c]["asynchronous"] for c in ("sync", "async", "async+staleness", "async+staleness+compressed")] \
        == [False, True, True, True]
    assert runs["async"]["staleness"] == "constant" and runs["async+staleness"]["staleness"] == "hinge:1,2"
    setup = study["setup"]
    assert setup["nodes_per_dc"] == 4 and setup["steps"] == 80 and setup["task"] == "digits"


def test_async_does_not_wait_on_the_wan(study):
    runs, steps = study["runs"], study["setup"]["steps"]
    # a sync round cannot finish before the 160 ms WAN message arrives; an async node only computes (10 ms a step)
    assert runs["sync"]["sim_time_s"] >= steps * 0.160
    for name in ("async", "async+staleness", "async+staleness+compressed"):
        assert runs[name]["sim_time_s"] == pytest.approx(steps * 0.010, rel=0.05)
        assert runs[name]["sim_time_s"] < runs["sync"]["sim_time_s"] / 5


def test_compression_cuts_inter_dc_bytes_only(study):
    plain, packed = study["runs"]["async+staleness"], study["runs"]["async+staleness+compressed"]
    # top-k 5%: a value and an int32 index per kept entry, 1/10 of the float32 bytes
    assert packed["bytes_inter"] < plain["bytes_inter"] / 5
    assert packed["bytes_inter"] > 0  # the DCs still talk
    assert packed["bytes_intra"] == pytest.approx(plain["bytes_intra"], rel=0.01)  # intra links stay exact
    assert plain["bytes_inter"] == study["runs"]["sync"]["bytes_inter"]  # same messages, only timing differs


def test_diloco_across_the_wan_waits_once_per_outer_period(study):
    runs, steps = study["runs"], study["setup"]["steps"]
    outer, sync = runs["sync+outer"], runs["sync"]
    assert outer["outer"] == study["setup"]["outer"] and study["setup"]["outer_period"] == 16
    # intra links as in sync (every step); the WAN carries one exchange in 16
    assert outer["bytes_intra"] == pytest.approx(sync["bytes_intra"], rel=0.01)
    assert outer["bytes_inter"] == pytest.approx(sync["bytes_inter"] * (steps // 16) / steps, rel=0.05)
    # one 160 ms wait per 16 steps instead of one per step
    assert outer["sim_time_s"] < sync["sim_time_s"] / 4
    summary = json.loads(Path(outer["jsonl"]).read_text().splitlines()[-1])
    assert summary["inter_rule"] == "gossip" and summary["intra_rule"] == "gossip"


def test_every_configuration_learns(study):
    assert two_dc_study.SHORT_MIN_ACCURACY >= 0.6  # chance is 0.1; a weakened threshold shows up here
    for name, row in study["runs"].items():
        assert row["final_accuracy"] >= two_dc_study.SHORT_MIN_ACCURACY, name
        assert row["mean_node_accuracy"] >= 0.6, name  # the replicas learned too, not only their average


def test_staleness_weights_beat_constant_weights_across_the_wan(study):
    runs = study["runs"]
    # 16-step-old models mixed at full weight drag every node back (what benchmarks/cross_dc.py measures)
    assert runs["async+staleness"]["final_accuracy"] > runs["async"]["final_accuracy"] + 0.03
    assert runs["async+staleness"]["time_to_target_s"] is not None
    assert runs["async+staleness"]["time_to_target_s"] < runs["sync"]["time_to_target_s"]


def test_metrics_files_match_the_returned_figures(study):
    for name, row in study["runs"].items():
        records = [json.loads(line) for line in Path(row["jsonl"]).read_text().splitlines()]
        summary = records[-1]
        assert summary["event"] == "summary" and summary["nodes"] == 8
        assert summary["final_accuracy"] == row["final_accuracy"]
        assert (summary["bytes_intra"], summary["bytes_inter"]) == (row["bytes_intra"], row["bytes_inter"])
        assert sum(r["event"] == "eval" for r in records) >= 10
    compressed = json.loads(Path(study["runs"]["async+staleness+compressed"]["jsonl"]).read_text().splitlines()[-1])
    assert compressed["intra_rule"] == "async" and compressed["inter_rule"] == "choco"


def test_png_is_drawn(study):
    if study["png"] is None:
        pytest.importorskip("matplotlib")  # skips only when matplotlib is missing
        pytest.fail("matplotlib is installed but no PNG was drawn")
    data = Path(study["png"]).read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > two_dc_study.SHORT_MIN_PNG_BYTES


def test_short_form_check_catches_misses(study):
    runs = {name: dict(row) for name, row in study["runs"].items()}
    assert two_dc_study.short_form_problems(runs, None) == []
    runs["async"]["final_accuracy"] = 0.1
    runs["async+staleness"]["sim_time_s"] = runs["sync"]["sim_time_s"]
    problems = two_dc_study.short_form_problems(runs, None)
    assert len(problems) == 2 and problems[0].startswith("async:") and "async+staleness:" in problems[1]


def test_short_form_check_rejects_a_bad_png(study, tmp_path):
    bad = tmp_path / "empty.png"
    bad.write_bytes(PNG_MAGIC + b"\0" * 100)
    assert [p for p in two_dc_study.short_form_problems(study["runs"], bad) if "not a PNG" in p]


@pytest.mark.parametrize("args,needle", [
    (["--nodes-per-dc", "0"], "--nodes-per-dc"),
    (["--inter-latency", "-5"], "--inter-latency"),
    (["--inter-codec", "zip"], "zip"),
    (["--outer", "adam"], "--outer: unknown optimizer 'adam'"),
    (["--outer-period", "0"], "--outer-period"),
])
def test_bad_arguments_are_rejected_before_any_run(args, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        two_dc_study.main([*args, "--out-dir", str(tmp_path)])
    assert e.value.code == 2 and needle in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing was run
