"""gossip-plot: PNG figures from JSONL metrics, and one-line errors for bad input."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest

from gossip.plot import main, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

needs_mpl = pytest.mark.skipif(
    __import__("importlib").util.find_spec("matplotlib") is None, reason="matplotlib not installed")


def write_run(path: Path, n: int = 12, *, accuracy: bool = True, perplexity: bool = False, classes=("intra",),
              distance_key: str = "consensus_distance", summary: bool = True) -> Path:
    """A metrics file in the format gossip-sim --out writes."""
    lines = []
    for k in range(1, n + 1):
        rec = {"event": "eval", "time": 0.01 * k, "step": float(k), "train_loss": 2.0 / k, "loss": 2.0 / k + 0.1,
               "accuracy": (1 - 1 / (k + 1)) if accuracy else math.nan, distance_key: 0.5 ** k,
               "bytes_sent": 1000 * k, "wall": 0.1 * k}
        for i, cls in enumerate(classes):
            rec[f"bytes_{cls}"] = 1000 * k // (i + 1)
        if perplexity:
            rec["perplexity"] = math.exp(rec["loss"])
        lines.append(json.dumps(rec))
    if summary:
        lines.append(json.dumps({"event": "summary", "final_accuracy": 0.9, "steps": n}))
    path.write_text("\n".join(lines) + "\n")
    return path


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, data[:8]
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@needs_mpl
def test_two_runs_make_a_valid_png(tmp_path, capsys):
    a = write_run(tmp_path / "ring.jsonl")
    b = write_run(tmp_path / "hier.jsonl", classes=("inter", "intra"))
    out = tmp_path / "figs" / "cmp.png"
    assert main([str(a), str(b), "-o", str(out), "--label", "ring", "--label", "two-dc", "--title", "t"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    w, h = png_size(out)
    assert w >= 800 and h >= 800  # two columns (steps, time) by four rows of panels
    assert out.stat().st_size > 20_000  # lines and text, not an empty canvas
    import matplotlib.image

    pixels = matplotlib.image.imread(str(out))
    assert pixels.shape[:2] == (h, w)
    assert pixels[..., :3].std() > 0.05  # something was drawn


@needs_mpl
def test_default_output_is_next_to_the_first_input(tmp_path):
    a = write_run(tmp_path / "run.jsonl")
    assert main([str(a)]) == 0
    png_size(tmp_path / "run.png")


@needs_mpl
def test_without_time_there_is_one_column(tmp_path):
    p = tmp_path / "steps-only.jsonl"
    p.write_text("".join(json.dumps({"event": "eval", "step": k, "loss": 1.0 / k}) + "\n" for k in range(1, 6)))
    assert main([str(p), "-o", str(tmp_path / "o.png")]) == 0
    w, h = png_size(tmp_path / "o.png")
    assert w < h  # one column of panels: the file has no time and no accuracy, and still plots


@needs_mpl
@pytest.mark.parametrize("kwargs", [
    dict(accuracy=False, perplexity=True),          # a language model: perplexity instead of accuracy
    dict(distance_key="neighbor_distance", classes=()),  # a gossip-node log: an estimate, no link classes
])
def test_other_record_shapes_plot(tmp_path, kwargs):
    p = write_run(tmp_path / "x.jsonl", **kwargs)
    assert main([str(p), "-o", str(tmp_path / "x.png")]) == 0
    assert (tmp_path / "x.png").stat().st_size > 20_000


@needs_mpl
def test_metric_option_and_an_absent_metric(tmp_path, capsys):
    p = write_run(tmp_path / "lm.jsonl", perplexity=True)
    assert main([str(p), "--metric", "perplexity", "-o", str(tmp_path / "ppl.png")]) == 0
    # a key no record has still gives a figure, with that panel saying so
    assert main([str(p), "--metric", "bleu", "-o", str(tmp_path / "bleu.png")]) == 0
    assert (tmp_path / "ppl.png").read_bytes() != (tmp_path / "bleu.png").read_bytes()


@needs_mpl
def test_real_simulator_output(tmp_path):
    import gossip

    out = tmp_path / "sim.jsonl"
    gossip.simulate(nodes=2, topology="ring", task="synthetic", steps=6, out=out)
    run = read_metrics(out)
    assert run.summary is not None and len(run.evals) >= 5 and run.byte_classes() == ["intra"]
    assert main([str(out), "-o", str(tmp_path / "sim.png")]) == 0
    png_size(tmp_path / "sim.png")


def test_read_metrics_keeps_nan_and_null_as_nan(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"event": "eval", "step": 1, "loss": 1.0, "accuracy": NaN}\n'
                 '{"event": "eval", "step": 2, "loss": 0.5, "accuracy": null}\n'
                 '{"event": "start"}\n')
    run = read_metrics(p)
    assert run.series("loss") == [1.0, 0.5]
    assert all(math.isnan(v) for v in run.series("accuracy"))
    assert not run.has("accuracy") and run.summary is None and run.label == "m"


@pytest.mark.parametrize("content,needle", [
    ("not json at all\n", "bad.jsonl:1: not a JSON line"),
    ('{"event": "eval", "step": 1, "loss": 1}\n[1, 2]\n', "bad.jsonl:2: expected a JSON object, found list"),
    ('{"event": "summary", "final_accuracy": 0.5}\n', "no evaluation records"),
    ("", "no evaluation records"),
    ('{"event": "eval", "loss": 1.0}\n', "bad.jsonl:1: eval record without a numeric 'step'"),
    ('{"event": "eval", "step": "one", "loss": 1.0}\n', "without a numeric 'step'"),
    ('{"event": "eval", "step": 1}\n', "no numeric 'loss'"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, content, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    assert main([str(p), "-o", str(tmp_path / "o.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gossip-plot: error:") and needle in err, err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "o.png").exists()


def test_missing_file_and_argument_errors(tmp_path, capsys):
    assert main([str(tmp_path / "absent.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "No such file" in err and "absent.jsonl" in err and len(err.strip().splitlines()) == 1
    a = write_run(tmp_path / "a.jsonl")
    assert main([str(a), "--label", "x", "--label", "y"]) == 2
    assert "2 --label values for 1 files" in capsys.readouterr().err
    assert main([str(a), "-o", str(a)]) == 2
    assert "is one of the input files" in capsys.readouterr().err


def test_missing_matplotlib_is_a_clear_error(tmp_path, capsys, monkeypatch):
    a = write_run(tmp_path / "a.jsonl")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes "import matplotlib" raise ImportError
    assert main([str(a), "-o", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert "matplotlib is not installed" in err and "gossip-trainer[plot]" in err
    assert len(err.splitlines()) == 1


def test_console_script_is_declared():
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert 'gossip-plot = "gossip.plot:main"' in text
