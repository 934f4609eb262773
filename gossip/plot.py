"""``gossip-plot``: PNG figures from JSON-lines metrics files.

Reads what ``gossip-sim --out`` (or ``gossip-node --log``) writes: one record per
evaluation point (``"event": "eval"`` with ``step``, ``time``, ``loss``,
``accuracy``, ``consensus_distance`` or ``neighbor_distance``, ``bytes_sent``,
``bytes_intra``, ``bytes_inter`` ...) and a final ``"event": "summary"``. One
figure holds, against local steps (left) and against time (right):

* loss of the averaged model,
* accuracy (or perplexity / RMSE for tasks without accuracy; ``--metric`` chooses),
* consensus distance (log scale),
* bytes sent per link class (cumulative).

Each input file is one line in every panel, labelled by its file name or ``--label``.

    gossip-plot runs/ring.jsonl runs/expo.jsonl -o topologies.png
    gossip-plot runs/*.jsonl --label ring --label torus ...
    gossip-plot runs/lm.jsonl --metric perplexity

matplotlib is an optional dependency (``pip install 'gossip-trainer[plot]'``).
Figures are drawn with the Agg canvas directly, never through ``pyplot``, so
plotting does not change the backend of a program that imports this module.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

__all__ = ["Run", "read_metrics", "plot_runs", "main"]

EXIT_USAGE = 2

# the y quantities, in panel order: (record keys to try, axis label, log scale)
_ROWS = (
    (("loss",), "loss (averaged model)", False),
    (("accuracy", "perplexity", "rmse"), None, False),  # label: whichever key has data
    (("consensus_distance", "neighbor_distance"), None, True),
)


@dataclass
class Run:
    """One metrics file: its evaluation records and its summary (if it has one)."""

    path: Path
    label: str
    evals: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None

    def series(self, key: str) -> list[float]:
        """Values of ``key`` over the evaluation records (NaN where absent or null)."""
        return [_number(r.get(key)) for r in self.evals]

    def has(self, key: str) -> bool:
        return any(math.isfinite(v) for v in self.series(key))

    def byte_classes(self) -> list[str]:
        """Link classes with byte counters (``bytes_intra`` -> ``intra``), or ``[]``."""
        keys = sorted({k for r in self.evals for k in r if k.startswith("bytes_") and k not in
                       ("bytes_sent", "bytes_received")})
        return [k[len("bytes_"):] for k in keys]


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    return float(v)


def read_metrics(path: str | Path, label: str | None = None) -> Run:
    """Parse one JSON-lines metrics file.

    Raises
    ------
    ValueError
        Naming the file (and line) when a line is not a JSON object, an ``eval``
        record lacks a numeric ``step``, or the file has no ``eval`` records.
    OSError
        When the file cannot be read.
    """
    path = Path(path)
    run = Run(path, label or path.stem)
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, found {type(rec).__name__}")
            event = rec.get("event")
            if event == "summary":
                run.summary = rec
            elif event == "eval":
                if not math.isfinite(_number(rec.get("step"))):
                    raise ValueError(f"{path}:{lineno}: eval record without a numeric 'step'")
                run.evals.append(rec)
    if not run.evals:
        raise ValueError(f"{path}: no evaluation records (lines with \"event\": \"eval\"); "
                         f"is this a gossip-sim --out / gossip-node --log file?")
    if not any(math.isfinite(v) for v in run.series("loss")):
        raise ValueError(f"{path}: evaluation records have no numeric 'loss'")
    return run


_LABELS = {"accuracy": "accuracy (averaged model)", "perplexity": "perplexity (averaged model)",
           "rmse": "RMSE (averaged model)", "consensus_distance": "consensus distance",
           "neighbor_distance": "neighbour distance (estimate)"}


def plot_runs(runs: Sequence[Run], out: str | Path, *, title: str | None = None, metric: str | None = None,
              dpi: int = 100) -> Path:
    """Draw the figure for ``runs`` into the PNG file ``out`` (parent directories are created).

    ``metric`` is the record key of the second row (default: the first of ``accuracy``,
    ``perplexity``, ``rmse`` that has data).

    Raises
    ------
    ImportError
        If matplotlib is not installed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not runs:
        raise ValueError("nothing to plot: no runs given")
    has_time = any(r.has("time") for r in runs)
    xs = [("step", "local steps")] + ([("time", "time (s)")] if has_time else [])
    fig = Figure(figsize=(6.0 * len(xs), 12.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(_ROWS) + 1, len(xs), squeeze=False)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    marker = "." if max(len(r.evals) for r in runs) < 30 else None  # dots only where points are sparse
    rows = list(_ROWS)
    if metric is not None:
        rows[1] = ((metric,), None, metric == "perplexity")
    for row, (keys, ylabel, log) in enumerate(rows):
        key = next((k for k in keys if any(r.has(k) for r in runs)), None)
        for col, (xkey, xlabel) in enumerate(xs):
            ax = axes[row][col]
            if key is None:
                ax.text(0.5, 0.5, f"no {' / '.join(keys)} in these files", ha="center", va="center",
                        transform=ax.transAxes, color="gray")
            else:
                for run, color in zip(runs, colors):
                    points = [(x, y) for x, y in zip(run.series(xkey), run.series(key))
                              if math.isfinite(x) and math.isfinite(y) and (y > 0 or not log)]
                    if points:
                        ax.plot(*zip(*points), color=color, label=run.label, marker=marker)
                if log and ax.has_data():
                    ax.set_yscale("log")
                ax.set_ylabel(ylabel or _LABELS.get(key, key))
            ax.set_xlabel(xlabel)
            ax.grid(True, alpha=0.3)
    # bytes: cumulative per link class; one colour per run, one line style per class
    styles = ["-", "--", ":", "-."]
    for col, (xkey, xlabel) in enumerate(xs):
        ax = axes[len(_ROWS)][col]
        for run, color in zip(runs, colors):
            classes = run.byte_classes() or ["sent"]
            for i, cls in enumerate(classes):
                points = [(x, y) for x, y in zip(run.series(xkey), run.series(f"bytes_{cls}"))
                          if math.isfinite(x) and math.isfinite(y)]
                if points:
                    ax.plot(*zip(*points), color=color, linestyle=styles[i % len(styles)],
                            label=f"{run.label} {cls}" if len(classes) > 1 or cls != "sent" else run.label)
        if not ax.has_data():
            ax.text(0.5, 0.5, "no byte counts in these files", ha="center", va="center", transform=ax.transAxes,
                    color="gray")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("bytes sent per link class")
        ax.grid(True, alpha=0.3)
    for row in axes:
        if row[0].has_data():
            row[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=dpi)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gossip-plot",
        description="Turn JSON-lines metrics (gossip-sim --out, gossip-node --log) into a PNG figure: loss, "
                    "accuracy and consensus distance against steps and time, and bytes per link class.")
    p.add_argument("files", nargs="+", metavar="FILE.jsonl", help="metrics files; one line per file in each panel")
    p.add_argument("-o", "--out", metavar="FILE.png",
                   help="output image (default: the first input's name with .png)")
    p.add_argument("--label", action="append", default=None, metavar="NAME",
                   help="legend label for each file, in order (default: the file name); repeat per file")
    p.add_argument("--title", default=None, help="figure title")
    p.add_argument("--metric", default=None, metavar="KEY",
                   help="quantity of the second row, e.g. accuracy, perplexity (default: the first of accuracy, "
                        "perplexity, rmse present in the files)")
    p.add_argument("--dpi", type=int, default=100, help="resolution (default: 100)")
    return p


def _fail(message: str) -> int:
    print(f"gossip-plot: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """``gossip-plot``: exit 0 with the PNG written, 2 on bad input or without matplotlib."""
    args = build_parser().parse_args(argv)
    labels = args.label or []
    if len(labels) > len(args.files):
        return _fail(f"{len(labels)} --label values for {len(args.files)} files")
    if args.dpi < 10:
        return _fail(f"--dpi must be >= 10, got {args.dpi}")
    runs = []
    try:
        for i, f in enumerate(args.files):
            runs.append(read_metrics(f, labels[i] if i < len(labels) else None))
    except ValueError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
    out = Path(args.out) if args.out else Path(args.files[0]).with_suffix(".png")
    if any(out.resolve() == Path(f).resolve() for f in args.files):
        return _fail(f"output {out} is one of the input files")
    try:
        import matplotlib  # noqa: F401  (checked here so the message is ours, not a traceback)
    except ImportError:
        return _fail("matplotlib is not installed; install it with: pip install 'gossip-trainer[plot]' "
                     "(or pip install matplotlib)")
    try:
        plot_runs(runs, out, title=args.title, metric=args.metric, dpi=args.dpi)
    except OSError as e:
        return _fail(f"cannot write {out}: {e.strerror or e}")
    print(out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
