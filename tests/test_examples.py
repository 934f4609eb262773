"""The examples' short forms, as CI runs them, and their data paths on generated files.

Each short form asserts its own outcome (and exits non-zero when it misses); the
tests check the returned figures again, so a silently weakened threshold shows up
here. The whole file takes about a minute and a half on two cores.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")  # digits

from examples import image_classification, language_model, recommender, topology_study  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- image classification ---------------------------------------------------------------------

def test_image_classification_short_form_reaches_accuracy():
    s = image_classification.main(["--short"])
    assert s["final_accuracy"] >= image_classification.SHORT_MIN_ACCURACY
    assert s["mean_node_accuracy"] >= 0.85  # the replicas learned too, not only their average
    assert s["nodes"] == 8 and s["steps"] == 80


def _brightness_images(n: int, shape: tuple[int, ...], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images whose mean brightness encodes the class: learnable in a few steps by any CNN
    (a position-coded pattern would not be: global average pooling discards position)."""
    labels = rng.integers(0, 10, n)
    images = rng.normal(20 + 22 * labels.reshape(-1, *[1] * len(shape)), 4, (n, *shape))
    return np.clip(images, 0, 255).astype(np.uint8), labels.astype(np.uint8)


def _idx(a: np.ndarray) -> bytes:
    return bytes([0, 0, 0x08, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes()


def test_image_classification_on_generated_mnist_files(tmp_path):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 256), ("t10k", 64)):
        images, labels = _brightness_images(n, (28, 28), rng)
        (tmp_path / f"{prefix}-images-idx3-ubyte").write_bytes(_idx(images))
        (tmp_path / f"{prefix}-labels-idx1-ubyte").write_bytes(_idx(labels))
    task = image_classification.task(f"mnist:{tmp_path}")
    assert task.X.dtype == torch.uint8 and tuple(task.X.shape) == (256, 1, 28, 28)  # kept compact in memory
    s = image_classification.main(["--data", f"mnist:{tmp_path}", "--nodes", "2", "--steps", "40",
                                   "--batch-size", "16", "--width", "8"])
    assert s["final_accuracy"] > 0.3  # chance is 0.1


def test_image_classification_on_generated_cifar10_files(tmp_path):
    import pickle

    rng = np.random.default_rng(1)
    for name, n in [(f"data_batch_{i}", 48) for i in range(1, 6)] + [("test_batch", 64)]:
        images, labels = _brightness_images(n, (3, 32, 32), rng)
        batch = {b"data": images.reshape(n, -1), b"labels": [int(v) for v in labels], b"batch_label": name.encode()}
        (tmp_path / name).write_bytes(pickle.dumps(batch, protocol=2))
    task = image_classification.task(f"cifar10:{tmp_path}")
    assert tuple(task.X.shape) == (240, 3, 32, 32) and task.in_channels == 3
    s = image_classification.main(["--data", f"cifar10:{tmp_path}", "--nodes", "2", "--steps", "40",
                                   "--batch-size", "16", "--width", "8"])
    assert s["final_accuracy"] > 0.3


def test_image_classification_bad_data_spec():
    with pytest.raises(ValueError, match="expected digits, mnist:DIR or cifar10:DIR"):
        image_classification.task("imagenet:/x")


# -- language model ---------------------------------------------------------------------------

def test_language_model_short_form_beats_unigram():
    s = language_model.main(["--short"])
    assert s["final_perplexity"] < language_model.SHORT_MAX_PERPLEXITY_RATIO * s["unigram_perplexity"]
    assert math.isclose(s["final_perplexity"], math.exp(s["final_loss"]), rel_tol=1e-6)
    assert 0.3 < s["final_accuracy"] < 1.0  # next-character accuracy


def test_char_gpt_is_causal():
    torch.manual_seed(0)
    model = language_model.CharGPT(vocab=20, block=16, dim=32, heads=4, layers=2).eval()
    x = torch.randint(0, 20, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 20  # change only the future of position 9
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_corpus_is_deterministic_and_holds_out_every_tenth_window(tmp_path):
    (tmp_path / "b.py").write_text("def g():\n    return 2\n" * 40)
    (tmp_path / "a.py").write_text("x = 1\n" * 200)
    sources = language_model.stdlib_sources(1500, root=tmp_path)
    assert [name for name, _ in sources] == ["a.py", "b.py"] and sum(len(t) for _, t in sources) == 1500
    corpus = language_model.Corpus(sources, block=8)
    assert len(corpus.test) == (1499 // 8) // 10 and len(corpus.train) + len(corpus.test) == 1499 // 8
    assert corpus.unigram_perplexity() < corpus.vocab_size  # character frequencies beat uniform
    with pytest.raises(ValueError, match="no Python source files"):
        language_model.stdlib_sources(100, root=tmp_path / "empty")


# -- recommender --------------------------------------------------------------------------------

def test_recommender_short_form_compression_table():
    rows = recommender.main(["--short"])
    none, int8 = rows["none"], rows["int8"]
    base = recommender.task().baseline_rmse()
    assert none["rmse"] < recommender.SHORT_MAX_RMSE_RATIO * base
    assert int8["rmse"] < none["rmse"] + recommender.SHORT_INT8_RMSE_SLACK
    assert 3.5 < none["bytes_sent"] / int8["bytes_sent"] < 4.0  # int8 codes + one fp32 scale per block


def test_recommender_on_generated_movielens_file(tmp_path):
    r = recommender.synthetic_ratings(num_users=150, num_items=80, density=0.4, seed=3)
    p = tmp_path / "u.data"
    stars = np.clip(np.rint(r.ratings), 1, 5).astype(int)
    # MovieLens ids are 1-based and not contiguous; the loader renumbers them
    p.write_text("".join(f"{u * 2 + 1}\t{i + 7}\t{s}\t{881250949 + k}\n"
                         for k, (u, i, s) in enumerate(zip(r.users, r.items, stars))))
    task = recommender.task(f"movielens:{p}")
    assert task.ratings.num_users == 150 and task.ratings.num_items == 80
    rows = recommender.main(["--data", f"movielens:{p}", "--nodes", "4", "--steps", "150",
                             "--compression", "none"])
    assert rows["none"]["rmse"] < task.baseline_rmse()


# -- topology study -----------------------------------------------------------------------------

def test_topology_study_short_form_writes_jsonl_and_png(tmp_path):
    out = topology_study.main(["--short", "--out-dir", str(tmp_path)])
    png = Path(out["png"])
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > topology_study.SHORT_MIN_PNG_BYTES
    runs = out["runs"]
    assert set(runs) == {"ring", "torus", "exponential", "one-peer-exponential", "complete", "star"}
    assert runs["one-peer-exponential"]["algorithm"] == "push-sum"
    for spec, row in runs.items():
        records = [json.loads(line) for line in Path(row["jsonl"]).read_text().splitlines()]
        assert records[-1]["event"] == "summary" and records[-1]["topology"] == spec
        assert sum(r["event"] == "eval" for r in records) >= 10
    # a complete graph sends to every other node every round, a ring to two
    assert runs["complete"]["bytes_sent"] == pytest.approx(runs["ring"]["bytes_sent"] * 7 / 2, rel=0.01)
    assert runs["complete"]["spectral_gap"] == pytest.approx(1.0) and runs["ring"]["spectral_gap"] < 0.5


# -- the task factories through the task protocol and the CLI ----------------------------------

@pytest.mark.parametrize("spec,metric", [
    ("examples.image_classification:task", "accuracy"),
    ("examples.language_model:task", "perplexity"),
    ("examples.recommender:task", "rmse"),
])
def test_task_factories_follow_the_task_protocol(spec, metric):
    from gossip.training.tasks import get_task

    task = get_task(spec)
    model = task.model()
    stream = task.stream(1, 4, "iid", 0, "cpu")
    loss = task.loss(model, stream.next())
    loss.backward()
    assert loss.ndim == 0 and math.isfinite(loss.item())
    figures = task.evaluate(model, "cpu")
    assert math.isfinite(figures["loss"]) and math.isfinite(figures[metric])


def test_gossip_sim_console_script_finds_examples_from_the_repo_root():
    script = shutil.which("gossip-sim") or str(Path(sys.executable).parent / "gossip-sim")
    if not os.path.exists(script):
        pytest.skip("gossip-sim console script not installed")
    p = subprocess.run([script, "--task", "examples.recommender:task", "--nodes", "2", "--steps", "3", "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["bytes_sent"] > 0
