"""A plan as text, and as a PNG of ETTR against cluster size (matplotlib, imported lazily)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hvd_resilient.report.plan.model import CLASSES, PARAM, kind_of
from hvd_resilient.report.plan.simulate import CAUSES, Plan, Result
from hvd_resilient.report.plan.strategies import TITLES

KIND_LETTER = {"measured": "M", "published": "P", "project default": "D", "assumption": "A",
               "flag": "F"}


def duration(s: float | None) -> str:
    """Seconds as the unit a person reads: 45 s, 12 min, 3.1 h, 2.0 d."""
    if s is None or not math.isfinite(s):
        return "-"
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{s / 60:.3g} min"
    if s < 2 * 86400:
        return f"{s / 3600:.3g} h"
    return f"{s / 86400:.3g} d"


def pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def _row(cells: list[str], widths: list[int], left: set[int]) -> str:
    return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                     for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()


def table(header: list[str], rows: list[list[str]], left: set[int] | None = None) -> str:
    """A plain-text table: first column (and those in `left`) left-aligned, others right."""
    left = {0} | (left or set())
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join([_row(header, widths, left), *(_row(r, widths, left) for r in rows)])


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


def _interval(r: Result, step_s: float) -> tuple[str, str]:
    commit = "-" if r.commit_every_s is None else (
        f"{duration(r.commit_every_s)} ({r.commit_every_s / step_s:.0f} steps)")
    ckpt = f"{duration(r.checkpoint_every_s)} ({r.checkpoint_every_s / step_s:.0f} steps)"
    return commit, ckpt


def _young(r: Result) -> str:
    yd = r.young_daly["durable"]
    if yd["daly_s"] is None:
        return "- (no failure takes the durable path)"
    return (f"{duration(yd['young_s'])} / {duration(yd['daly_s'])} "
            f"(ETTR there {pct(r.young_daly['ettr_at_pair'])})")


def results_table(plan: Plan, fmt: str = "text") -> str:
    step = plan.inputs["step_s"]
    header = ["strategy", "ETTR mean ± sd", "min-max", "commit every", "checkpoint every",
              "Young/Daly checkpoint"]
    rows = []
    for r in plan.results:
        commit, ckpt = _interval(r, step)
        rows.append([r.title, f"{pct(r.ettr_mean)} ± {100 * r.ettr_sd:.2f}",
                     f"{pct(r.ettr_min, 1)}-{pct(r.ettr_max, 1)}", commit, ckpt, _young(r)])
    return (markdown if fmt == "md" else table)(header, rows)


def lost_table(plan: Plan, by: str = "cause", fmt: str = "text") -> str:
    keys = CAUSES if by == "cause" else CLASSES
    header = [by] + [r.strategy for r in plan.results]
    rows = []
    for k in keys:
        vals = [(r.lost_by_cause if by == "cause" else r.lost_by_class).get(k, 0.0)
                for r in plan.results]
        if any(abs(v) > 5e-6 for v in vals):
            rows.append([k.replace("_", " ")] + [pct(v, 3) for v in vals])
    return (markdown if fmt == "md" else table)(header, rows)


def scale_table(plan: Plan, fmt: str = "text") -> str:
    names = [r.strategy for r in plan.results]
    header = ["GPUs", "hosts"] + names
    rows = []
    for row in plan.scale:
        rows.append([f"{row['gpus']:,}", f"{row['hosts']:,}"]
                    + [f"{pct(row[n]['ettr'])} ± {100 * row[n]['sd']:.2f}" for n in names])
    return (markdown if fmt == "md" else table)(header, rows)


def inputs_table(plan: Plan, fmt: str = "text") -> str:
    rows = []
    for d in plan.inputs.describe():
        n = f" ({d['samples']} samples)" if d["samples"] and d["samples"] > 1 else ""
        rows.append([d["name"], f"{d['value']:.4g} {PARAM[d['name']].unit}",
                     KIND_LETTER.get(d["kind"], "?"), d["source"] + n])
    header = ["input", "value", "", "source"]
    return markdown(header, rows) if fmt == "md" else table(header, rows, {2, 3})


def render(plan: Plan, run: str | None = None, stack: str | None = None) -> str:
    job = plan.job
    first = plan.results[0]
    fails = sum(first.failures_per_day.values())
    per_class = ", ".join(f"{c.replace('_', ' ')} {v:.3g}" for c, v in
                          first.failures_per_day.items() if v > 0)
    mtbf = 24.0 / fails if fails > 0 else math.inf
    out = [
        f"plan: {job.gpus:,} GPUs ({job.hosts:,} hosts x {job.host_gpus}), "
        f"{job.horizon_s / 86400:g} days, {job.seeds} seeds"
        + (f"; measured inputs from {run} (stack: {stack})" if run else "; no run folder: "
           "defaults only"),
        f"failures per day: {fails:.3g} (MTBF {mtbf:.3g} h): {per_class or 'none'}",
        "",
        results_table(plan),
        "",
        "lost time by cause, share of the horizon (mean over seeds):",
        lost_table(plan, "cause"),
        "",
        "lost time by failure class (its detection, recovery, rework and join stalls):",
        lost_table(plan, "class"),
    ]
    if plan.scale:
        out += ["", "ETTR by cluster size (each size with its own best intervals, "
                f"{plan.scale_seeds} seeds):", scale_table(plan)]
    counts = {"M": 0, "P": 0, "D": 0, "A": 0, "F": 0}
    for d in plan.inputs.describe():
        counts[KIND_LETTER.get(d["kind"], "A")] += 1
    out += ["", "inputs (M measured, P published, D project default, A assumption, F flag): "
            + ", ".join(f"{v} {k}" for k, v in counts.items() if v), inputs_table(plan)]
    if plan.inputs.notes:
        out += ["", "notes:"] + [f"- {n}" for n in plan.inputs.notes]
    out += ["", "paths of " + ", ".join(r.strategy for r in plan.results) + ":"]
    for r in plan.results:
        out.append(f"  {r.strategy}:")
        out += [f"    {c}: {p}" for c, p in r.paths.items()]
    out.append(f"\n(simulated in {plan.elapsed_s:.2f} s)")
    return "\n".join(out)


def available() -> bool:
    from hvd_resilient.report import plot

    return plot.available()


def write_png(plan: Plan, out: Path) -> Path:
    """ETTR (mean, with the seed spread) against cluster size, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [row["gpus"] for row in plan.scale]
    for r in plan.results:
        ys = [100 * row[r.strategy]["ettr"] for row in plan.scale]
        sd = [100 * row[r.strategy]["sd"] for row in plan.scale]
        ax.errorbar(xs, ys, yerr=sd, marker="o", capsize=3, label=TITLES.get(r.strategy,
                                                                             r.strategy))
    ax.set_xscale("log")
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("effective training time ratio (%)")
    ax.set_title(f"hvd-resilient plan: {plan.job.horizon_s / 86400:g} days, best intervals "
                 "per size")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def summary(plan: Plan) -> dict[str, Any]:
    """The headline numbers per strategy, for a bench script's JSON."""
    return {r.strategy: {"ettr": r.ettr_mean, "sd": r.ettr_sd,
                         "commit_every_s": r.commit_every_s,
                         "checkpoint_every_s": r.checkpoint_every_s} for r in plan.results}


def kinds_used(plan: Plan) -> dict[str, list[str]]:
    """Input names grouped by where their value came from."""
    out: dict[str, list[str]] = {}
    for name, v in plan.inputs.values.items():
        out.setdefault(kind_of(v.source), []).append(name)
    return out
