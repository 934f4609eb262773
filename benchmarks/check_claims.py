"""Check that every benchmark figure in the README is a range over recorded runs of its command.

The README's benchmark table (the first table under ``## Benchmarks``) has a
``figures`` column and a ``command`` column. Each figure there is a JSON key of
the command's last line, in backticks, then the value or the range of values
it took over the runs::

    | `sim_overhead.py` | ... | `ratio_32` 1.23-1.33x | `python benchmarks/sim_overhead.py --sizes 32` |

(ranges as ``LO-HI`` or, for signed values, ``LO to HI``; a key of a nested
object is dotted: ``crash.faulty.detect_last_s``). Any other number in a
figures cell is an error: a figure with no key cannot be traced to a run.

``benchmarks/RESULTS.md`` records the runs in tables headed
``| date | command | figures |``, one row per run, the figures as
``` `key` value``` items separated by ``;`` (a list-valued key as
``` `key` v1, v2```). A README figure passes when rows of exactly its command
(whitespace aside) hold its key, and its range is those runs' smallest and
largest value, at the README's precision. A run of code that has changed since,
kept for the record, goes in a table of its own headed
``| date | superseded run | figures |``, which counts no more.

    python benchmarks/check_claims.py [--readme README.md] [--results benchmarks/RESULTS.md]

Prints each problem (exit status 1) or a summary (0), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUM = r"[+\-−]?\d+(?:\.\d+)?"
#: `key` LO[-HI | to HI] in a README figures cell
FIGURE = re.compile(rf"`(?P<key>[A-Za-z_][\w.:]*)`\s+(?P<lo>{NUM})(?:(?:-|–|\s+to\s+)(?P<hi>{NUM}))?")
#: `key` v1[, v2 ...] in a RESULTS.md figures cell
RECORDED = re.compile(rf"`(?P<key>[A-Za-z_][\w.:]*)`\s+(?P<values>{NUM}(?:\s*,\s*{NUM})*)")
RUNS_HEADER = re.compile(r"^\|\s*date\s*\|\s*command\s*\|\s*figures\s*\|\s*$", re.IGNORECASE)
DATE = re.compile(r"^\d{4}-\d\d-\d\d$")


@dataclass(frozen=True)
class Claim:
    """One figure of the README's benchmark table."""

    script: str
    command: str
    key: str
    lo: float
    hi: float
    decimals: int  # of the README's figure: the precision it is checked at
    text: str


@dataclass(frozen=True)
class Run:
    """One recorded run: its date, command and the figures it printed."""

    date: str
    command: str
    figures: dict[str, list[float]]


def _number(text: str) -> float:
    return float(text.replace("−", "-"))


def _decimals(*texts: str) -> int:
    return max(len(t.split(".")[1]) if "." in t else 0 for t in texts)


def normalise_command(cell: str) -> str:
    """The command of a table cell: backticks and repeated spaces dropped.

    >>> normalise_command(" `python  benchmarks/codecs.py` ")
    'python benchmarks/codecs.py'
    """
    return " ".join(cell.replace("`", " ").split())


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def readme_claims(text: str) -> tuple[list[Claim], list[str]]:
    """The figures of the first table under ``## Benchmarks``, and the problems
    found reading it (a row without a command, a number without a key)."""
    problems: list[str] = []
    lines = text.splitlines()
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip().lower() == "## benchmarks")
    except StopIteration:
        return [], ["README: no '## Benchmarks' section"]
    rows = []
    for ln in lines[start + 1:]:
        if ln.startswith("## "):
            break
        if ln.lstrip().startswith("|"):
            rows.append(ln)
        elif rows:
            break  # the end of the first table
    if len(rows) < 3:
        return [], ["README: no benchmark table under '## Benchmarks'"]
    header = [c.lower() for c in _cells(rows[0])]
    try:
        fig_col = next(i for i, c in enumerate(header) if c.startswith("figure"))
        cmd_col = header.index("command")
    except (StopIteration, ValueError):
        return [], [f"README: the benchmark table needs 'figures' and 'command' columns, has {header}"]
    claims = []
    for row in rows[2:]:
        cells = _cells(row)
        if len(cells) != len(header):
            problems.append(f"README row {row!r}: {len(cells)} cells, the header has {len(header)}")
            continue
        script, figures, command = cells[0], cells[fig_col], normalise_command(cells[cmd_col])
        found = list(FIGURE.finditer(figures))
        rest = FIGURE.sub("", figures)
        if re.search(r"\d", rest):
            problems.append(f"README {script}: a figure with no JSON key in {figures!r} (write `key` LO-HI)")
        if found and not command.startswith("python "):
            problems.append(f"README {script}: figures without a command beside them")
        for m in found:
            lo_text, hi_text = m["lo"], m["hi"] or m["lo"]
            claims.append(Claim(script, command, m["key"], _number(lo_text), _number(hi_text),
                                _decimals(lo_text, hi_text), m.group(0)))
    return claims, problems


def recorded_runs(text: str) -> tuple[list[Run], list[str]]:
    """Every row of the ``| date | command | figures |`` tables, and the problems
    found reading them."""
    runs: list[Run] = []
    problems: list[str] = []
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        if not RUNS_HEADER.match(ln.strip()):
            continue
        for row in lines[i + 2:]:
            if not row.lstrip().startswith("|"):
                break
            cells = _cells(row)
            if len(cells) != 3 or not DATE.match(cells[0]):
                problems.append(f"RESULTS row {row!r}: not 'date | command | figures'")
                continue
            figures: dict[str, list[float]] = {}
            for part in cells[2].split(";"):
                m = RECORDED.search(part)
                if m is None:
                    problems.append(f"RESULTS row {row!r}: {part.strip()!r} is not `key` value")
                    continue
                figures.setdefault(m["key"], []).extend(_number(v) for v in m["values"].split(","))
            runs.append(Run(cells[0], normalise_command(cells[1]), figures))
    return runs, problems


def check(readme: str, results: str) -> tuple[list[Claim], list[str]]:
    """The README's claims and every problem: a figure with no run of its command
    behind it, or whose range is not the runs' range at its precision."""
    claims, problems = readme_claims(readme)
    runs, run_problems = recorded_runs(results)
    problems += run_problems
    if not claims and not problems:
        problems.append("README: the benchmark table holds no figures")
    for c in claims:
        values = [v for r in runs if r.command == c.command for v in r.figures.get(c.key, [])]
        if not values:
            commands = sorted({r.command for r in runs if c.key in r.figures})
            problems.append(f"README {c.script} {c.text!r}: no RESULTS.md run of {c.command!r} records "
                            f"`{c.key}`" + (f" (runs of {commands} do)" if commands else ""))
            continue
        tol = 0.5 * 10 ** -c.decimals + 1e-9
        lo, hi = min(values), max(values)
        if abs(c.lo - lo) > tol or abs(c.hi - hi) > tol:
            problems.append(f"README {c.script} {c.text!r}: the {len(values)} recorded values of `{c.key}` "
                            f"from {c.command!r} range {lo:g} to {hi:g}")
    return claims, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    args = ap.parse_args(argv)
    claims, problems = check(args.readme.read_text(), args.results.read_text())
    for p in problems:
        print(p)
    if not problems:
        print(f"{len(claims)} figures in {args.readme.name}, each the range of its command's runs in "
              f"{args.results.name}")
    print(json.dumps({"figures": len(claims), "problems": len(problems)}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
