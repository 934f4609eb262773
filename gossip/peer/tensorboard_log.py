"""TensorBoard scalars from the JSON-lines metrics records (``--tensorboard DIR``).

The simulator and the real node write one JSON record per evaluation. Rather
than a second set of hooks, :class:`MetricsSink` is the file they write those
lines to: it passes the text on to the ``--out``/``--log`` file (if any) and
hands every complete record to :class:`TensorBoardLog`, so TensorBoard shows
exactly what the JSONL holds.

TensorBoard is optional: ``pip install 'gossip-trainer[tensorboard]'``.
"""

from __future__ import annotations

import importlib.util
import json
import math
from os import PathLike
from pathlib import Path
from typing import IO, Any, Protocol

__all__ = ["TensorBoardLog", "MetricsSink", "open_metrics", "require_tensorboard", "run_name", "SCALARS",
           "INSTALL_HINT"]

INSTALL_HINT = "pip install 'gossip-trainer[tensorboard]'"

# JSONL key -> TensorBoard tag; the part before "/" groups the charts
SCALARS = {
    "loss": "loss/eval",
    "train_loss": "loss/train",
    "mean_node_loss": "loss/mean_node",
    "perplexity": "loss/perplexity",
    "accuracy": "accuracy/eval",
    "mean_node_accuracy": "accuracy/mean_node",
    "consensus_distance": "consensus/distance",
    "neighbor_distance": "consensus/neighbor_distance",
    "bytes_sent": "bytes/sent",
    "bytes_received": "bytes/received",
    "bytes_intra": "bytes/intra",
    "bytes_inter": "bytes/inter",
    "nodes_up": "cluster/nodes_up",
    "round": "cluster/round",
}


class ScalarWriter(Protocol):
    """What :class:`TensorBoardLog` needs of ``torch.utils.tensorboard.SummaryWriter``."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any: ...

    def add_text(self, tag: str, text_string: str, global_step: int | None = None) -> Any: ...

    def flush(self) -> Any: ...

    def close(self) -> Any: ...


def require_tensorboard() -> None:
    """Raise ``ValueError`` with the install command when ``tensorboard`` is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError(f"--tensorboard needs the tensorboard package: {INSTALL_HINT}")


def run_name(node_id: str) -> str:
    """A directory name for one node's run, e.g. ``10.0.0.1:5555`` -> ``10.0.0.1_5555``."""
    from gossip.transport.addresses import node_file_name

    return node_file_name(node_id)


class TensorBoardLog:
    """Writes the numeric fields of metrics records as TensorBoard scalars.

    Parameters
    ----------
    logdir : directory of the run's event files (created); ignored when ``writer`` is given
    writer : an object with ``add_scalar``/``add_text``/``flush``/``close``
        (default: a ``torch.utils.tensorboard.SummaryWriter`` on ``logdir``)

    Examples
    --------
    >>> tb = TensorBoardLog("runs/tb")  # doctest: +SKIP
    >>> tb.record({"event": "eval", "step": 50, "loss": 0.3, "accuracy": 0.9})  # doctest: +SKIP
    2
    """

    def __init__(self, logdir: str | PathLike[str] | None = None, *, writer: ScalarWriter | None = None) -> None:
        if writer is None:
            if logdir is None:
                raise ValueError("TensorBoardLog needs a logdir or a writer")
            require_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            Path(logdir).mkdir(parents=True, exist_ok=True)
            writer = SummaryWriter(log_dir=str(logdir))
        self.writer = writer
        self.last_step = 0

    def record(self, rec: dict[str, Any]) -> int:
        """Write one metrics record; returns the number of scalars written.

        ``eval`` records become scalars at their (mean) local step; the final
        ``summary`` record becomes a text entry. Missing and non-finite values
        (NaN before the first step) are skipped.
        """
        event = rec.get("event")
        if event == "summary":
            body = {k: v for k, v in rec.items() if k != "event"}
            self.writer.add_text("summary", "```\n" + json.dumps(body, indent=1, default=str) + "\n```",
                                 self.last_step)
            return 0
        if event != "eval":
            return 0
        step = rec.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool) or not math.isfinite(step):
            return 0
        self.last_step = int(round(step))
        written = 0
        for key, tag in SCALARS.items():
            value = rec.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(tag, float(value), self.last_step)
                written += 1
        return written

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MetricsSink:
    """A write-only text stream: JSON lines go to ``path`` (if any) and to TensorBoard.

    Hand it to anything that writes JSONL metrics (``simulate(out=...)``, the
    node's ``--log`` file). Lines may arrive in pieces; each complete line is
    parsed once.
    """

    def __init__(self, path: str | PathLike[str] | None, tensorboard: TensorBoardLog) -> None:
        self.file: IO[str] | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "w")
        self.tensorboard = tensorboard
        self._partial = ""
        self.closed = False

    def write(self, text: str) -> int:
        if self.file is not None:
            self.file.write(text)
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if line.strip():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # not a record: it still reached the file
                if isinstance(rec, dict):
                    self.tensorboard.record(rec)
        return len(text)

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()
        self.tensorboard.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._partial:
            self.write("\n")
        if self.file is not None:
            self.file.close()
        self.tensorboard.close()

    def __enter__(self) -> "MetricsSink":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_metrics(path: str | PathLike[str] | None, tensorboard: str | PathLike[str] | None) -> IO[str] | MetricsSink:
    """The metrics stream for a run: a plain file, or a :class:`MetricsSink` when ``tensorboard`` is set."""
    if not tensorboard:
        if path is None:
            raise ValueError("open_metrics needs a path or a tensorboard directory")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return open(path, "w")
    return MetricsSink(path, TensorBoardLog(tensorboard))
