"""Loaders for standard dataset files a user already has on disk.

Nothing here downloads anything: point a loader at the files and it reads them,
strictly. A file that is truncated, has trailing bytes, a wrong magic number, an
unexpected shape or out-of-range labels raises :class:`ValueError` naming the
file and what is wrong, instead of training on garbage.

=======================  ==========================================================
loader                   files
=======================  ==========================================================
:func:`load_idx`         one IDX file (MNIST, Fashion-MNIST), raw or gzip
:func:`load_mnist`       ``train-images-idx3-ubyte`` ... ``t10k-labels-idx1-ubyte``
:func:`load_cifar10`     CIFAR-10 "python version": ``data_batch_1..5``, ``test_batch``
:func:`load_movielens`   MovieLens ``u.data`` (user, item, rating, timestamp; tabs)
=======================  ==========================================================

Security note: the CIFAR-10 batches are Python pickles by format, and unpickling
can run code. :func:`load_cifar10` uses a restricted unpickler that only builds
the plain containers and numpy arrays those files contain and refuses any other
global, but still: load only files from a source you trust.
"""

from __future__ import annotations

import gzip
import math
import pickle
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

__all__ = ["ImageDataset", "Ratings", "load_idx", "load_mnist", "load_cifar10", "load_movielens"]

# IDX type codes (third magic byte) -> big-endian numpy dtype
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class ImageDataset:
    """An image classification dataset as numpy arrays.

    Images are ``uint8`` of shape ``(N, C, H, W)``; labels ``int64`` of shape ``(N,)``.
    """

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    classes: tuple[str, ...]

    @property
    def num_classes(self) -> int:
        return len(self.classes)


@dataclass(frozen=True)
class Ratings:
    """Explicit-feedback ratings: one entry per (user, item) rating.

    ``users`` and ``items`` are dense 0-based indices (``int64``); ``user_ids[u]``
    and ``item_ids[i]`` are the ids the file used for index ``u`` / ``i``.
    """

    users: np.ndarray
    items: np.ndarray
    ratings: np.ndarray      # float32
    timestamps: np.ndarray   # int64, as in the file (seconds since the epoch for MovieLens)
    user_ids: np.ndarray
    item_ids: np.ndarray

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    @property
    def num_items(self) -> int:
        return len(self.item_ids)

    def __len__(self) -> int:
        return len(self.ratings)


# -- IDX (MNIST) ----------------------------------------------------------------------------

def _read_exact(f: IO[bytes], n: int, path: Path, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError(f"{path}: truncated IDX file: expected {n} bytes of {what}, found {len(data)}")
    return data


def load_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (the MNIST format), raw or gzip-compressed.

    The header is two zero bytes, a type code (0x08 uint8, 0x09 int8, 0x0B int16,
    0x0C int32, 0x0D float32, 0x0E float64), the number of dimensions, then each
    dimension as a big-endian uint32; the values follow, big-endian. Compression
    is detected from the content, not the file name.

    Returns
    -------
    numpy.ndarray
        In native byte order, with the file's shape and element type.

    Raises
    ------
    ValueError
        If the magic number or type code is wrong, the file is truncated or has
        bytes beyond the declared shape, or the gzip stream is corrupt.

    Examples
    --------
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "x-idx1-ubyte")
    >>> _ = open(p, "wb").write(bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 8, 9]))
    >>> load_idx(p).tolist()
    [7, 8, 9]
    """
    path = Path(path)
    raw = open(path, "rb")  # OSError (missing file, ...) propagates as is
    try:
        f: IO[bytes] = raw
        if raw.read(2) == _GZIP_MAGIC:
            raw.seek(0)
            f = gzip.GzipFile(fileobj=raw, mode="rb")
        else:
            raw.seek(0)
        try:
            return _parse_idx(f, path)
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            raise ValueError(f"{path}: corrupt gzip stream ({e})") from None
    finally:
        raw.close()


def _parse_idx(f: IO[bytes], path: Path) -> np.ndarray:
    magic = _read_exact(f, 4, path, "header")
    if magic[0] != 0 or magic[1] != 0:
        raise ValueError(f"{path}: not an IDX file: wrong magic number 0x{magic.hex()} "
                         f"(an IDX file starts with two zero bytes)")
    code, ndim = magic[2], magic[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX type code 0x{code:02x} in magic number 0x{magic.hex()}; "
                         f"valid: {', '.join(f'0x{c:02x}' for c in _IDX_DTYPES)}")
    if ndim == 0:
        raise ValueError(f"{path}: IDX header declares 0 dimensions")
    dims = tuple(int(d) for d in np.frombuffer(_read_exact(f, 4 * ndim, path, "dimensions"), dtype=">u4"))
    dtype = _IDX_DTYPES[code]
    nbytes = math.prod(dims) * dtype.itemsize
    # read in chunks up to one byte past the declared size: a corrupt header declaring
    # terabytes cannot make us allocate more than the file holds (read(n) allocates n
    # up front), and trailing garbage is noticed
    chunks, got = [], 0
    while got <= nbytes:
        chunk = f.read(min(nbytes + 1 - got, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    data = b"".join(chunks)
    if len(data) < nbytes:
        raise ValueError(f"{path}: truncated IDX file: shape {dims} of {dtype.name} needs {nbytes} bytes of data, "
                         f"found {len(data)}")
    if len(data) > nbytes:
        raise ValueError(f"{path}: IDX file has bytes beyond its declared shape {dims} "
                         f"(wrong header or a concatenated file?)")
    return np.frombuffer(data, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


_MNIST_FILES = {
    "train_images": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    "train_labels": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    "test_images": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    "test_labels": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}


def _find_file(directory: Path, names: tuple[str, ...], suffixes: tuple[str, ...] = ("", ".gz")) -> Path:
    for name in names:
        for suffix in suffixes:
            p = directory / f"{name}{suffix}"
            if p.is_file():
                return p
    raise ValueError(f"{directory}: no {names[0]} file found (looked for "
                     f"{', '.join(n + s for n in names for s in suffixes)})")


def load_mnist(directory: str | Path) -> ImageDataset:
    """Load MNIST (or Fashion-MNIST, which uses the same files) from a directory.

    The directory holds the four standard IDX files, each raw or with ``.gz``:
    ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
    ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte`` (the dotted names
    ``train-images.idx3-ubyte`` ... are accepted too). A torchvision download
    keeps them in ``MNIST/raw``.

    Returns
    -------
    ImageDataset
        Images ``uint8`` of shape ``(N, 1, H, W)``, labels ``int64`` in 0..9.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory (expected the directory holding the MNIST IDX files)")
    arrays = {}
    for key, names in _MNIST_FILES.items():
        path = _find_file(directory, names)
        a = load_idx(path)
        want_ndim = 3 if key.endswith("images") else 1
        if a.ndim != want_ndim or a.dtype != np.uint8:
            raise ValueError(f"{path}: expected {want_ndim}-d uint8 {key.replace('_', ' ')}, "
                             f"found {a.ndim}-d {a.dtype} of shape {a.shape}")
        arrays[key] = (path, a)
    for part in ("train", "test"):
        (ipath, images), (lpath, labels) = arrays[f"{part}_images"], arrays[f"{part}_labels"]
        if len(images) != len(labels):
            raise ValueError(f"{lpath}: {len(labels)} labels for {len(images)} images in {ipath.name}")
        if len(labels) and labels.max() > 9:
            raise ValueError(f"{lpath}: label {int(labels.max())} out of range 0..9")
    return ImageDataset(arrays["train_images"][1][:, None], arrays["train_labels"][1].astype(np.int64),
                        arrays["test_images"][1][:, None], arrays["test_labels"][1].astype(np.int64),
                        tuple(str(d) for d in range(10)))


# -- CIFAR-10 python batches ------------------------------------------------------------------

def _allowed_globals() -> dict[tuple[str, str], Any]:
    """The only globals a CIFAR-10 batch may name, mapped to the objects to use.

    The functions numpy pickles arrays with are taken from numpy's own
    ``__reduce__`` output, so the table holds whatever this numpy version uses,
    under both the numpy 1 (``numpy.core``) and numpy 2 (``numpy._core``) names.
    """
    reconstruct = np.zeros(1).__reduce__()[0]          # ndarray, protocol <= 4
    frombuffer = np.zeros(1).__reduce_ex__(5)[0]       # ndarray, protocol 5
    scalar = np.uint8(0).__reduce__()[0]               # numpy scalars (e.g. labels)
    table: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): __import__("codecs").encode,  # how Python 3 writes bytes at protocol 2
        ("builtins", "bytes"): bytes,
        ("builtins", "bytearray"): bytearray,
        ("__builtin__", "bytearray"): bytearray,
    }
    for core in ("numpy.core", "numpy._core"):
        table[(f"{core}.multiarray", "_reconstruct")] = reconstruct
        table[(f"{core}.multiarray", "scalar")] = scalar
        table[(f"{core}.numeric", "_frombuffer")] = frombuffer
    return table


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, strings, numbers and numpy arrays; refuses every other global."""

    def __init__(self, file: IO[bytes], path: Path) -> None:
        # encoding="bytes": the original batches were written by Python 2, whose str is bytes
        super().__init__(file, encoding="bytes")
        self.path = path
        self.allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}: a CIFAR-10 batch holds "
                                         f"only dicts, lists and numpy arrays") from None


def _unpickle_batch(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            obj = _RestrictedUnpickler(f, path).load()
    except OSError:
        raise
    except Exception as e:  # any malformed pickle: UnpicklingError, EOFError, ValueError, TypeError ...
        raise ValueError(f"{path}: not a readable CIFAR-10 batch ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: a CIFAR-10 batch is a dict, found {type(obj).__name__}")
    # keys are bytes when written by Python 2, str when written by Python 3
    return {(k.decode("latin1") if isinstance(k, bytes) else k): v for k, v in obj.items()}


_CIFAR_PIXELS = 3 * 32 * 32


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    batch = _unpickle_batch(path)
    for key in ("data", "labels"):
        if key not in batch:
            raise ValueError(f"{path}: CIFAR-10 batch has no {key!r} entry (keys: {sorted(map(str, batch))})")
    data = batch["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _CIFAR_PIXELS:
        desc = f"{data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise ValueError(f"{path}: 'data' must be a uint8 array of shape (N, {_CIFAR_PIXELS}), found {desc}")
    try:
        labels = np.asarray(batch["labels"])
    except Exception:
        labels = np.asarray([], dtype=object)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{path}: 'labels' must be a list of integers")
    if len(labels) != len(data):
        raise ValueError(f"{path}: {len(labels)} labels for {len(data)} images")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{path}: label out of range 0..9 (found {int(labels.min())}..{int(labels.max())})")
    # rows are 1024 red, then 1024 green, then 1024 blue values, each row-major 32x32
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def load_cifar10(directory: str | Path) -> ImageDataset:
    """Load CIFAR-10 from its "python version" batches.

    ``directory`` is the extracted ``cifar-10-batches-py`` (or a directory that
    contains it) with ``data_batch_1`` ... ``data_batch_5`` and ``test_batch``;
    ``batches.meta`` supplies class names when present.

    These files are pickles. They are read with a restricted unpickler that
    builds only dicts, lists, strings, numbers and numpy arrays, but unpickling
    remains a larger attack surface than a plain binary format: load only files
    from a source you trust.

    Returns
    -------
    ImageDataset
        Images ``uint8`` of shape ``(N, 3, 32, 32)``, labels ``int64`` in 0..9.
    """
    directory = Path(directory)
    if (directory / "cifar-10-batches-py").is_dir():
        directory = directory / "cifar-10-batches-py"
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory (expected the extracted cifar-10-batches-py)")
    parts = []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        path = directory / name
        if not path.is_file():
            raise ValueError(f"{directory}: CIFAR-10 file {name} is missing")
        parts.append(_read_cifar_batch(path))
    classes = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
    meta_path = directory / "batches.meta"
    if meta_path.is_file():
        names = _unpickle_batch(meta_path).get("label_names")
        if not isinstance(names, list) or len(names) != 10:
            raise ValueError(f"{meta_path}: 'label_names' must be a list of 10 names")
        classes = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names)
    train_x = np.concatenate([p[0] for p in parts[:5]])
    train_y = np.concatenate([p[1] for p in parts[:5]])
    return ImageDataset(train_x, train_y, parts[5][0], parts[5][1], classes)


# -- MovieLens u.data ----------------------------------------------------------------------------

def load_movielens(path: str | Path) -> Ratings:
    """Load MovieLens 100K ``u.data``: one ``user item rating timestamp`` line per rating, tab separated.

    User and item ids are re-numbered densely from 0 in increasing id order
    (``Ratings.user_ids`` / ``item_ids`` keep the originals).

    Raises
    ------
    ValueError
        Naming the file and line, for a line without exactly four tab-separated
        fields, a non-integer id or timestamp, a non-finite rating, or an empty file.

    Examples
    --------
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "u.data")
    >>> _ = open(p, "w").write("196\\t242\\t3\\t881250949\\n186\\t302\\t3\\t891717742\\n")
    >>> r = load_movielens(p)
    >>> r.users.tolist(), r.items.tolist(), r.user_ids.tolist()
    ([1, 0], [0, 1], [186, 196])
    """
    path = Path(path)
    users, items, ratings, stamps = [], [], [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("ascii").rstrip("\r\n")
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{lineno}: not a text line of u.data (non-ASCII bytes)") from None
            if not line.strip():
                continue  # tolerate blank lines (a trailing newline)
            fields = line.split("\t")
            if len(fields) != 4:
                raise ValueError(f"{path}:{lineno}: expected 4 tab-separated fields (user item rating timestamp), "
                                 f"found {len(fields)}: {line[:60]!r}")
            try:
                u, i, t = int(fields[0]), int(fields[1]), int(fields[3])
            except ValueError:
                raise ValueError(f"{path}:{lineno}: user, item and timestamp must be integers: {line[:60]!r}") from None
            try:
                r = float(fields[2])
            except ValueError:
                r = math.nan
            if not math.isfinite(r):
                raise ValueError(f"{path}:{lineno}: rating must be a finite number, got {fields[2]!r}")
            users.append(u)
            items.append(i)
            ratings.append(r)
            stamps.append(t)
    if not ratings:
        raise ValueError(f"{path}: no ratings (empty u.data file)")
    user_ids, user_idx = np.unique(np.asarray(users, dtype=np.int64), return_inverse=True)
    item_ids, item_idx = np.unique(np.asarray(items, dtype=np.int64), return_inverse=True)
    return Ratings(user_idx.astype(np.int64), item_idx.astype(np.int64), np.asarray(ratings, dtype=np.float32),
                   np.asarray(stamps, dtype=np.int64), user_ids, item_ids)
