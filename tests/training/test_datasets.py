"""Dataset loaders on small files generated here: shapes, dtypes, values, and strict errors."""

from __future__ import annotations

import gzip
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from gossip.training.datasets import load_cifar10, load_idx, load_mnist, load_movielens

IDX_CODES = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D, np.float64: 0x0E}


def idx_bytes(a: np.ndarray) -> bytes:
    """An IDX file for ``a``, written from the format description (big-endian)."""
    header = bytes([0, 0, IDX_CODES[a.dtype.type], a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape)
    return header + a.astype(a.dtype.newbyteorder(">")).tobytes()


def write_mnist(directory: Path, n_train: int = 12, n_test: int = 5, *, compress: bool = False, seed: int = 0):
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    directory.mkdir(parents=True, exist_ok=True)
    for name, a in arrays.items():
        data = idx_bytes(a)
        if compress:
            (directory / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (directory / name).write_bytes(data)
    return arrays


# -- IDX --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(IDX_CODES))
def test_idx_round_trips_every_type_code(tmp_path, dtype):
    a = (np.arange(24).reshape(2, 3, 4) - 7).astype(dtype)
    p = tmp_path / "a.idx"
    p.write_bytes(idx_bytes(a))
    b = load_idx(p)
    assert b.dtype == np.dtype(dtype) and b.dtype.isnative
    assert b.shape == (2, 3, 4)
    np.testing.assert_array_equal(b, a)


def test_idx_multibyte_values_are_big_endian(tmp_path):
    p = tmp_path / "a.idx"
    p.write_bytes(bytes([0, 0, 0x0C, 1, 0, 0, 0, 2]) + bytes([0, 0, 1, 2, 0xFF, 0xFF, 0xFF, 0xFE]))
    assert load_idx(p).tolist() == [258, -2]


def test_idx_gzip_is_detected_from_content_not_name(tmp_path):
    a = np.arange(10, dtype=np.uint8)
    p = tmp_path / "labels-without-gz-suffix"
    p.write_bytes(gzip.compress(idx_bytes(a)))
    np.testing.assert_array_equal(load_idx(p), a)


@pytest.mark.parametrize("mutate,needle", [
    (lambda b: b"\x01\x00" + b[2:], "wrong magic number"),
    (lambda b: b[:2] + b"\x07" + b[3:], "unknown IDX type code 0x07"),
    (lambda b: b[:3] + b"\x00", "0 dimensions"),
    (lambda b: b[:3], "truncated IDX file"),
    (lambda b: b[:9], "truncated IDX file"),     # dims cut short
    (lambda b: b[:-1], "truncated IDX file"),    # data cut short
    (lambda b: b + b"\x00", "beyond its declared shape"),
    (lambda b: b"", "truncated IDX file"),
])
def test_idx_errors_name_the_file_and_the_problem(tmp_path, mutate, needle):
    good = idx_bytes(np.arange(12, dtype=np.uint8).reshape(3, 4))
    p = tmp_path / "bad-idx3-ubyte"
    p.write_bytes(mutate(good))
    with pytest.raises(ValueError, match=needle) as e:
        load_idx(p)
    assert str(p) in str(e.value)


def test_idx_huge_declared_shape_does_not_allocate(tmp_path):
    p = tmp_path / "huge"
    p.write_bytes(bytes([0, 0, 0x0E, 3]) + struct.pack(">3I", 2**31, 2**31, 2**31) + b"\x00" * 16)
    with pytest.raises(ValueError, match="truncated"):
        load_idx(p)


def test_idx_corrupt_or_truncated_gzip(tmp_path):
    data = gzip.compress(idx_bytes(np.arange(1000, dtype=np.int32)))
    p = tmp_path / "cut.gz"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.gz") as e:
        load_idx(p)
    assert "gzip" in str(e.value) or "truncated" in str(e.value)
    p.write_bytes(data[:10] + bytes(b ^ 0xFF for b in data[10:]))
    with pytest.raises(ValueError, match="gzip"):
        load_idx(p)


def test_idx_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_idx(tmp_path / "nope")


# -- MNIST ------------------------------------------------------------------------------------

@pytest.mark.parametrize("compress", [False, True])
def test_load_mnist_shapes_dtypes_values(tmp_path, compress):
    arrays = write_mnist(tmp_path, compress=compress)
    d = load_mnist(tmp_path)
    assert d.train_images.shape == (12, 1, 28, 28) and d.train_images.dtype == np.uint8
    assert d.test_images.shape == (5, 1, 28, 28)
    assert d.train_labels.dtype == np.int64 and d.train_labels.shape == (12,)
    np.testing.assert_array_equal(d.train_images[:, 0], arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(d.test_labels, arrays["t10k-labels-idx1-ubyte"])
    assert d.num_classes == 10


def test_load_mnist_accepts_dotted_names(tmp_path):
    write_mnist(tmp_path)
    for name in ("train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        os.rename(tmp_path / name, tmp_path / name.replace("-idx", ".idx"))
    assert load_mnist(tmp_path).train_images.shape[0] == 12


def test_load_mnist_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_mnist(tmp_path / "absent")
    write_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(ValueError, match="no t10k-labels-idx1-ubyte file"):
        load_mnist(tmp_path)
    # label count disagrees with the image count
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(4, dtype=np.uint8)))
    with pytest.raises(ValueError, match="4 labels for 5 images"):
        load_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.full(5, 10, dtype=np.uint8)))
    with pytest.raises(ValueError, match="label 10 out of range"):
        load_mnist(tmp_path)
    # images stored as labels' shape
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(5, dtype=np.uint8)))
    (tmp_path / "train-images-idx3-ubyte").write_bytes(idx_bytes(np.zeros(12, dtype=np.uint8)))
    with pytest.raises(ValueError, match="expected 3-d uint8 train images"):
        load_mnist(tmp_path)


# -- CIFAR-10 ---------------------------------------------------------------------------------

def write_cifar(directory: Path, per_batch: int = 4, test: int = 3, *, protocol: int = 2, bytes_keys: bool = True,
                meta: bool = True) -> dict[str, tuple[np.ndarray, list[int]]]:
    rng = np.random.default_rng(1)
    key = (lambda s: s.encode()) if bytes_keys else (lambda s: s)
    written = {}
    directory.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        n = test if name == "test_batch" else per_batch
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, n)]
        obj = {key("batch_label"): key(name), key("labels"): labels, key("data"): data,
               key("filenames"): [key(f"img{i}.png") for i in range(n)]}
        (directory / name).write_bytes(pickle.dumps(obj, protocol=protocol))
        written[name] = (data, labels)
    if meta:
        names = [key(f"class{i}") for i in range(10)]
        (directory / "batches.meta").write_bytes(
            pickle.dumps({key("label_names"): names, key("num_vis"): 3072}, protocol=protocol))
    return written


@pytest.mark.parametrize("protocol,bytes_keys", [(2, True), (2, False), (4, False), (5, True)])
def test_load_cifar10_shapes_and_channel_layout(tmp_path, protocol, bytes_keys):
    written = write_cifar(tmp_path / "cifar-10-batches-py", protocol=protocol, bytes_keys=bytes_keys)
    d = load_cifar10(tmp_path)  # the parent directory is accepted too
    assert d.train_images.shape == (20, 3, 32, 32) and d.train_images.dtype == np.uint8
    assert d.test_images.shape == (3, 3, 32, 32)
    assert d.train_labels.dtype == np.int64
    assert d.train_labels.tolist() == sum((written[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    data2 = written["data_batch_2"][0]
    # image 0 of batch 2 is train image 4; its row holds R (1024), G, B planes, each row-major
    np.testing.assert_array_equal(d.train_images[4, 1, 0, :5], data2[0, 1024:1029])
    np.testing.assert_array_equal(d.train_images[4, 2, 31, 31], data2[0, 3071])
    assert d.classes == tuple(f"class{i}" for i in range(10))


def test_load_cifar10_without_meta_uses_standard_names(tmp_path):
    write_cifar(tmp_path, meta=False)
    assert load_cifar10(tmp_path).classes[0] == "airplane"


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_load_cifar10_refuses_foreign_globals(tmp_path):
    write_cifar(tmp_path)
    (tmp_path / "data_batch_3").write_bytes(pickle.dumps({b"data": Evil(), b"labels": []}, protocol=2))
    with pytest.raises(ValueError, match=r"data_batch_3.*refusing to load global (posix|nt)\.system"):
        load_cifar10(tmp_path)


@pytest.mark.parametrize("obj_or_bytes,needle", [
    (b"\x80\x02}q\x00(U\x04data", "not a readable CIFAR-10 batch"),   # truncated pickle
    (b"this is not a pickle", "not a readable CIFAR-10 batch"),
    ([1, 2, 3], "is a dict, found list"),
    ({b"labels": [0]}, "no 'data' entry"),
    ({b"data": np.zeros((1, 3072), np.uint8)}, "no 'labels' entry"),
    ({b"data": np.zeros((1, 100), np.uint8), b"labels": [0]}, r"shape \(N, 3072\)"),
    ({b"data": np.zeros((1, 3072), np.float32), b"labels": [0]}, "must be a uint8 array"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "1 labels for 2 images"),
    ({b"data": np.zeros((1, 3072), np.uint8), b"labels": [10]}, "label out of range"),
    ({b"data": np.zeros((1, 3072), np.uint8), b"labels": ["cat"]}, "list of integers"),
])
def test_load_cifar10_bad_batches(tmp_path, obj_or_bytes, needle):
    write_cifar(tmp_path)
    raw = obj_or_bytes if isinstance(obj_or_bytes, bytes) else pickle.dumps(obj_or_bytes, protocol=2)
    (tmp_path / "test_batch").write_bytes(raw)
    with pytest.raises(ValueError, match=needle) as e:
        load_cifar10(tmp_path)
    assert "test_batch" in str(e.value)


def test_load_cifar10_missing_batch(tmp_path):
    write_cifar(tmp_path)
    (tmp_path / "data_batch_5").unlink()
    with pytest.raises(ValueError, match="data_batch_5 is missing"):
        load_cifar10(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        load_cifar10(tmp_path / "absent")


# -- MovieLens ----------------------------------------------------------------------------------

def test_load_movielens_reindexes_ids(tmp_path):
    p = tmp_path / "u.data"
    p.write_text("196\t242\t3\t881250949\n186\t302\t3\t891717742\n22\t377\t1\t878887116\n196\t377\t5\t1\n\n")
    r = load_movielens(p)
    assert len(r) == 4 and r.num_users == 3 and r.num_items == 3
    assert r.user_ids.tolist() == [22, 186, 196] and r.item_ids.tolist() == [242, 302, 377]
    assert r.users.tolist() == [2, 1, 0, 2] and r.items.tolist() == [0, 1, 2, 2]
    assert r.ratings.dtype == np.float32 and r.ratings.tolist() == [3.0, 3.0, 1.0, 5.0]
    assert r.timestamps.dtype == np.int64 and r.timestamps[0] == 881250949
    # the original ids are recovered from the dense indices
    assert r.user_ids[r.users].tolist() == [196, 186, 22, 196]


@pytest.mark.parametrize("text,needle", [
    ("", "no ratings"),
    ("1 2 3 4\n", r"u.data:1: expected 4 tab-separated fields"),
    ("1\t2\t3\t4\n1\t2\t3\n", r"u.data:2: expected 4 tab-separated fields .* found 3"),
    ("1\t2\t3\t4\t5\n", "found 5"),
    ("a\t2\t3\t4\n", r"u.data:1: user, item and timestamp must be integers"),
    ("1\t2\tthree\t4\n", "rating must be a finite number"),
    ("1\t2\tnan\t4\n", "rating must be a finite number"),
])
def test_load_movielens_errors(tmp_path, text, needle):
    p = tmp_path / "u.data"
    p.write_text(text)
    with pytest.raises(ValueError, match=needle):
        load_movielens(p)


def test_load_movielens_binary_garbage(tmp_path):
    p = tmp_path / "u.data"
    p.write_bytes(b"1\t2\t3\t4\n\xff\xfe\x00\x01\n")
    with pytest.raises(ValueError, match="u.data:2: not a text line"):
        load_movielens(p)
