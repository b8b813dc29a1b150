"""``hvd-resilient plan [RUN_FOLDER]``: predicted ETTR of a job at scale, per strategy.

Exit codes: 0 plan printed; bad input is a `ConfigError`, printed as one line by the
`hvd-resilient` entry point (`cli_errors.exit_on_error`), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any, NoReturn

from hvd_resilient.errors import ConfigError
from hvd_resilient.report.plan import render
from hvd_resilient.report.plan.calibrate import calibrate
from hvd_resilient.report.plan.model import PARAMS, Inputs, Job, parse_sizes
from hvd_resilient.report.plan.simulate import plan
from hvd_resilient.report.plan.strategies import STRATEGIES, TITLES

logger = logging.getLogger(__name__)

DEFAULT_SIZES = "1,8,64,1000,16384,100000"


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError (one line) instead of printing usage and exiting 2."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"plan: {message} (see hvd-resilient plan --help)")


def _number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return v


def _param_help(p: Any) -> str:
    if math.isnan(p.default):
        default = "derived when the plan runs"
    else:
        default = f"{p.default:g}"
    return f"{p.help} [{p.unit}] (default: {default}; {p.source})"


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="hvd-resilient plan",
        description="Discrete-event simulation of a job of N hosts x G workers over a long "
                    "horizon: predicted effective training time ratio (ETTR) per strategy "
                    "with its spread over seeds, time lost per cause and per failure class, "
                    "the commit and durable-checkpoint intervals that maximize it (next to "
                    "Young/Daly), and ETTR against cluster size. Recovery and checkpoint "
                    "costs come from RUN_FOLDER's event log where it has them, else from this "
                    "project's benchmarks; failure rates from published fleet data. Every "
                    "input is listed with its source (measured, published, project default, "
                    "assumption or flag). See docs/planner.md.")
    p.add_argument("run_folder", metavar="RUN_FOLDER", nargs="?",
                   help="a run folder (holding events.jsonl) or an events file to take "
                        "measured costs from (default: none, every input from its default)")
    job = p.add_argument_group("job and simulation")
    job.add_argument("--gpus", type=int, default=16384,
                     help="GPUs (workers) in the job (default: 16384, Llama 3's pre-training)")
    job.add_argument("--gpus-per-host", type=int, default=8,
                     help="GPUs per host: a host failure takes them all (default: 8, as in "
                          "Llama 3's servers)")
    job.add_argument("--hosts-per-replica", type=int, default=1,
                     help="hosts that hold one data-parallel replica; an elastic job short "
                          "of a host loses its whole replica (default: 1)")
    job.add_argument("--days", type=_number, default=30.0,
                     help="simulated horizon in days (default: 30)")
    job.add_argument("--seeds", type=int, default=20,
                     help="independent simulations; ETTR is their mean, the spread their sd "
                          "(default: 20)")
    job.add_argument("--seed", type=int, default=0, help="first random seed (default: 0)")
    job.add_argument("--strategy", action="append", choices=STRATEGIES, metavar="NAME",
                     help="simulate only this strategy (repeatable; default: all of "
                          + ", ".join(f"{k} = {v}" for k, v in TITLES.items()) + ")")
    job.add_argument("--commit-every", type=_number, metavar="SECONDS",
                     help="in-memory commit interval instead of searching it (default: "
                          "searched around Young's interval)")
    job.add_argument("--checkpoint-every", type=_number, metavar="SECONDS",
                     help="durable checkpoint interval instead of searching it (default: "
                          "searched around Young/Daly, at most one day)")
    out = p.add_argument_group("output")
    out.add_argument("--sizes", default=DEFAULT_SIZES,
                     help=f"cluster sizes (GPUs) of the ETTR-vs-size table and plot; k = "
                          f"1000 (default: {DEFAULT_SIZES})")
    out.add_argument("--scale-seeds", type=int, default=10,
                     help="seeds per size in the ETTR-vs-size table (default: 10)")
    out.add_argument("--no-scale", action="store_true",
                     help="skip the ETTR-vs-size table and plot (default: made)")
    out.add_argument("--json", action="store_true",
                     help="print one JSON object instead of text (default: text)")
    png = out.add_mutually_exclusive_group()
    png.add_argument("--plot", metavar="FILE.png",
                     help="where to write the ETTR-vs-size plot (default: RUN_FOLDER/plan.png "
                          "when matplotlib is installed and a run folder is given)")
    png.add_argument("--no-plot", action="store_true",
                     help="do not write a plot (default: written when a run folder or --plot "
                          "is given)")
    inputs = p.add_argument_group(
        "inputs (each overrides the measured value and the default)")
    for prm in PARAMS:
        inputs.add_argument(f"--{prm.name.replace('_', '-')}", dest=prm.name,
                            type=_number, metavar="X", help=_param_help(prm))
    return p


def _job(args: argparse.Namespace) -> Job:
    return Job(gpus=args.gpus, gpus_per_host=args.gpus_per_host,
               hosts_per_replica=args.hosts_per_replica, horizon_s=args.days * 86400.0,
               seeds=args.seeds, seed=args.seed)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    job = _job(args)
    if not 1 <= args.scale_seeds <= 10_000:
        raise ConfigError(f"plan: --scale-seeds must be 1..10000, got {args.scale_seeds}")
    sizes = parse_sizes(args.sizes)  # checked even when not used: a typo is still a typo
    if args.no_scale:
        sizes = []
    overrides = {prm.name: getattr(args, prm.name) for prm in PARAMS}
    cal = calibrate(args.run_folder, gloo_timeout_s=args.gloo_timeout_s or 30.0) \
        if args.run_folder else None
    inp = Inputs.defaults(overrides, cal.measured if cal else None)
    if cal:
        inp.capacity_by_size = dict(cal.capacity_by_size)
        inp.notes.extend(cal.notes)
    strategies = tuple(args.strategy) if args.strategy else STRATEGIES
    result = plan(job, inp, strategies, sizes, args.scale_seeds,
                  commit_every_s=args.commit_every, checkpoint_every_s=args.checkpoint_every)
    png, why_not = _plot(result, args)
    if args.json:
        doc = result.to_dict()
        doc["run_folder"] = cal.source if cal else None
        doc["calibration"] = ({"stack": cal.stack, "observed": cal.observed} if cal else None)
        doc["measured"] = render.kinds_used(result).get("measured", [])
        doc["plot"] = str(png) if png else None
        print(json.dumps(_finite(doc), default=str, allow_nan=False))
    else:
        print(render.render(result, cal.source if cal else None, cal.stack if cal else None))
        if cal:
            o = cal.observed
            print(f"\nthe run itself: {o['failures']} failures, {o['joins']} joins, "
                  f"{o['restarts']} full restarts, {o['preempted']} preemptions, "
                  f"{o['hangs_detected']} hangs over {o['wall_s']:.0f} s at world sizes "
                  f"{o['world_sizes']} (its failure counts are not used as rates: a benchmark's "
                  "are injected, and minutes say nothing of a month)")
        if png or why_not:
            print(f"plot: {png or f'({why_not})'}")
    return 0


def _plot(result: Any, args: argparse.Namespace) -> tuple[Path | None, str | None]:
    """(the PNG written, None) or (None, why not, when worth saying)."""
    if args.no_plot or not result.scale:
        return None, None
    if args.plot:
        out = Path(args.plot)
    elif args.run_folder:
        folder = Path(args.run_folder)
        out = (folder if folder.is_dir() else folder.parent) / "plan.png"
    else:
        return None, None
    if not render.available():
        if args.plot:
            raise ConfigError("plan: --plot needs matplotlib (pip install matplotlib)")
        return None, "no plot: matplotlib is not installed"
    try:
        return render.write_png(result, out), None
    except OSError as e:
        return None, f"no plot: cannot write {out}: {e.strerror or e}"


def _finite(value: Any) -> Any:
    """NaN and infinities become null: strict JSON parsers reject them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
