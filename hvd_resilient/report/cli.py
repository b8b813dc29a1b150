"""``hvd-resilient report RUN_FOLDER``: what a run went through, from its event log alone.

Exit codes: 0 report printed, 2 usage error or nothing to report (missing or empty event log).
Errors are one line on stderr, never a traceback: this is run by tired people on broken runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from hvd_resilient.events import read_events
from hvd_resilient.report import plot
from hvd_resilient.report.analysis import Report, analyze
from hvd_resilient.report.timeline import normalize

EVENTS_FILE = "events.jsonl"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hvd-resilient report",
        description="Goodput, failures and MTTR, checkpoint costs and a Young/Daly checkpoint "
                    "interval from a run folder's events.jsonl (finished, running or crashed).",
    )
    p.add_argument("run_folder", metavar="RUN_FOLDER",
                   help=f"the run folder (holding {EVENTS_FILE}) or the events file itself")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    png = p.add_mutually_exclusive_group()
    png.add_argument("--plot", metavar="FILE.png",
                     help="where to write the PNG (default: RUN_FOLDER/report.png when "
                          "matplotlib is installed)")
    png.add_argument("--no-plot", action="store_true", help="do not write a PNG")
    p.add_argument("--mtbf", type=float, metavar="SECONDS",
                   help="assume this mean time between failures for the Young/Daly suggestion "
                        "instead of the observed one")
    return p


def _fail(msg: str) -> int:
    print(f"hvd-resilient report: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    target = Path(args.run_folder)
    path = target / EVENTS_FILE if target.is_dir() else target
    folder = target if target.is_dir() else target.parent
    if not path.is_file():
        return _fail(f"no event log at {path}")
    if args.mtbf is not None and not args.mtbf > 0:
        return _fail("--mtbf must be a positive number of seconds")
    if args.plot and not plot.available():
        return _fail("--plot needs matplotlib (pip install matplotlib)")
    try:
        events = normalize(read_events(path))
    except OSError as e:
        return _fail(f"cannot read {path}: {e.strerror or e}")
    if not events:
        return _fail(f"no events in {path} (empty, or nothing but a torn line)")
    report = analyze(events, now=time.time(), mtbf_s=args.mtbf)

    png, why_not = _write_plot(report, args, folder)
    if args.json:
        doc = report.to_dict()
        doc["events_file"] = str(path)
        doc["plot"] = str(png) if png else None
        print(json.dumps(_finite(doc), default=str, allow_nan=False))
        if why_not:
            print(f"hvd-resilient report: {why_not}", file=sys.stderr)
    else:
        from hvd_resilient.report.text import render

        print(render(report, str(path)))
        if png or why_not:
            print(f"{'plot':<14}{png or f'({why_not})'}")
    return 0


def _finite(value: Any) -> Any:
    """NaN and infinities become null: strict JSON parsers (jq, browsers) reject them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _write_plot(report: Report, args: argparse.Namespace,
                folder: Path) -> tuple[Path | None, str | None]:
    """Writes the PNG unless told not to: (its path, None) or (None, why not, when worth
    saying). A read-only run folder must not cost the operator the text report."""
    if args.no_plot:
        return None, None
    if not plot.available():
        return None, "no plot: matplotlib is not installed"
    out = Path(args.plot) if args.plot else folder / "report.png"
    try:
        return plot.write_png(report, out), None
    except OSError as e:
        return None, f"no plot: cannot write {out}: {e.strerror or e}"
