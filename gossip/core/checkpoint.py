"""Checkpoint files that are never half-written.

A checkpoint is written to a temporary file in the same directory, flushed and
fsync'ed, then renamed over the target (atomic on POSIX), and the directory is
fsync'ed so the rename survives a power cut. A process killed at any moment
leaves either the previous checkpoint or the new one, never a torn file.
Files are loaded with ``weights_only=True``: tensors and plain containers only.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_path", "checkpoint_step",
           "save_members", "load_members"]

MEMBERS = "members.json"  # the member ids a node last trained with, beside its checkpoints

_NAME = re.compile(r"^ckpt-(\d{12})\.pt$")


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"ckpt-{step:012d}.pt"


def checkpoint_step(path: str | Path) -> int:
    """The step a checkpoint file holds, read from its name (without loading it)."""
    m = _NAME.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not named like a checkpoint (ckpt-<12 digits>.pt)")
    return int(m.group(1))


def save_checkpoint(state: dict[str, Any], directory: str | Path, step: int, *, keep: int = 2) -> Path:
    """Atomically write ``state`` as the checkpoint of ``step``; keep the newest ``keep`` files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = checkpoint_path(directory, step)
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for old in sorted(p for p in directory.iterdir() if _NAME.match(p.name))[:-keep]:
        old.unlink(missing_ok=True)
    for stale in directory.glob(".ckpt-*.tmp"):  # left by a writer killed mid-write (one node per directory)
        if stale.name != os.path.basename(tmp):
            stale.unlink(missing_ok=True)
    return target


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in ``directory`` (temporary files are ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = sorted(p for p in directory.iterdir() if _NAME.match(p.name))
    return found[-1] if found else None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint; a damaged file raises ValueError naming it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"checkpoint {path} is unreadable: {e}") from None
    if not isinstance(state, dict) or "flat" not in state or "step" not in state:
        raise ValueError(f"checkpoint {path} is not a gossip node checkpoint")
    return state


def save_members(directory: str | Path, ids: list[str]) -> None:
    """Record the member ids a node trains with (atomically), so that the process,
    restarted with ``--resume``, can say hello to them and not to its seeds alone."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".members-", suffix=".tmp", dir=directory)
    with os.fdopen(fd, "w") as f:
        json.dump(sorted(ids), f)
    os.replace(tmp, directory / MEMBERS)


def load_members(directory: str | Path) -> list[str]:
    """The ids :func:`save_members` recorded ([] if none, or the file is damaged)."""
    try:
        ids = json.loads((Path(directory) / MEMBERS).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(ids, list):
        return []
    return [i for i in ids if isinstance(i, str) and 0 < len(i) <= 256][:4096]
