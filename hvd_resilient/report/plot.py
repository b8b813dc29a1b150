"""One PNG that tells a run's story: world size and throughput over time, failures as red lines,
checkpoints as ticks, lost time shaded, straggler reports as dashed orange lines.

matplotlib is imported here only, lazily and with the Agg backend, so the report works on a
head node without it and never needs a display.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hvd_resilient.report.analysis import Report
from hvd_resilient.report.text import dur

SHADES = {
    "rollback": ("#f4a261", 0.35, "rolled back (redone work\n+ detection)"),
    "recovery": ("#e63946", 0.22, "recovering"),
    "restart": ("#6c757d", 0.30, "down / restarting"),
    "startup": ("#adb5bd", 0.25, "start-up"),
}


STRAGGLER = "#e76f51"


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _time_unit(wall_s: float) -> tuple[float, str]:
    if wall_s >= 3 * 3600:
        return 3600.0, "h"
    if wall_s >= 3 * 60:
        return 60.0, "min"
    return 1.0, "s"


def coarsen(segments: list[list[Any]], col: int, most: int = 300) -> list[list[Any]]:
    """At most about `most` segments: neighbours merged into their time-weighted mean, so a
    long run with a commit every few seconds still draws a readable line (and quickly)."""
    segs = [s for s in segments if s[col] is not None]
    k = math.ceil(len(segs) / most)
    if k <= 1:
        return segs
    out: list[list[Any]] = []
    group: list[list[Any]] = []
    for seg in [*segs, None]:
        if group and (seg is None or len(group) == k or abs(seg[0] - group[-1][1]) > 1e-9):
            span = sum(g[1] - g[0] for g in group)
            mean = sum(g[col] * (g[1] - g[0]) for g in group) / span if span > 0 else group[0][col]
            row = [group[0][0], group[-1][1], None, None]
            row[col] = mean
            out.append(row)
            group = []
        if seg is not None:
            group.append(seg)
    return out


def _throughput_line(segments: list[list[Any]], col: int,
                     scale: float) -> tuple[list[float], list[float]]:
    """A step line through the measured segments, broken where nothing was measured."""
    xs: list[float] = []
    ys: list[float] = []
    for seg in coarsen(segments, col):
        if seg[col] is None:
            continue
        if xs and abs(seg[0] / scale - xs[-1]) > 1e-9:
            xs.append(math.nan)
            ys.append(math.nan)
        xs += [seg[0] / scale, seg[1] / scale]
        ys += [seg[col], seg[col]]
    return xs, ys


def write_png(r: Report, path: str | Path) -> Path:
    """Renders the report's series into `path` (PNG) and returns it."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    s = r.series
    scale, unit = _time_unit(r.wall_s)
    fig, (ax_w, ax_t) = plt.subplots(
        2, 1, sharex=True, figsize=(11, 6), height_ratios=[1, 2.2], layout="constrained"
    )
    try:
        for ax in (ax_w, ax_t):
            for a, b, cat in s["lost"]:
                color, alpha, _ = SHADES[cat]
                ax.axvspan(a / scale, b / scale, color=color, alpha=alpha, lw=0)
            for t, _kind in s["failures"]:
                ax.axvline(t / scale, color="#d62828", lw=1.6)
            for t, _old, _new in s["resets"]:
                ax.axvline(t / scale, color="#7b2cbf", lw=1.0, ls=":")
            ax.grid(alpha=0.3)

        ws = s["world_size"]
        ax_w.step([p[0] / scale for p in ws], [p[1] for p in ws], where="post", color="#1d3557",
                  lw=2)
        top = max([p[1] for p in ws] + [1])
        ax_w.set_ylim(-0.1 * top, top * 1.25 + 0.5)
        ax_w.yaxis.get_major_locator().set_params(integer=True)
        ax_w.set_ylabel("world size\n(workers)")

        col = 3 if r.samples_per_s else 2
        xs, ys = _throughput_line(s["throughput"], col, scale)
        ax_t.plot(xs, ys, color="#2a9d8f", lw=1.8)
        ax_t.set_ylabel("samples / s" if col == 3 else "steps / s")
        ax_t.set_ylim(bottom=0, top=max([y for y in ys if not math.isnan(y)] + [1.0]) * 1.15)
        ax_t.set_xlabel(f"time since the first event ({unit})")
        ax_t.set_xlim(0, max(r.wall_s / scale, 1e-9) * 1.02)
        end = {"finished": "done", "preempted": "preempted", "failed": "fatal error"}.get(
            r.status, "log ends: running or crashed")
        ax_w.annotate(end, (r.wall_s / scale, 1.0), xycoords=("data", "axes fraction"),
                      xytext=(-4, -4), textcoords="offset points", ha="right", va="top",
                      fontsize=9, color="#495057")
        trans = ax_t.get_xaxis_transform()
        saved = [c[0] / scale for c in s["checkpoints"] if c[2] == "saved"]
        failed = [c[0] / scale for c in s["checkpoints"] if c[2] == "failed"]
        ax_t.vlines(saved, 0, 0.06, transform=trans, color="#1d3557", lw=1.2)
        ax_t.plot(failed, [0.03] * len(failed), "x", transform=trans, color="#d62828", ms=7)

        stragglers = s.get("stragglers", [])
        for t, rank, ratio, evicted in stragglers:
            ax_t.axvline(t / scale, color=STRAGGLER, lw=1.2, ls="--")
            if len(stragglers) <= 12:
                text = (f" rank {rank}" + (f" {ratio:.1f}x" if ratio else "")
                        + (", evicted" if evicted else ""))
                ax_t.annotate(text, (t / scale, 0.88), xycoords=("data", "axes fraction"),
                              va="top", fontsize=8, color=STRAGGLER)

        _label_spans(ax_t, s["lost"], r.wall_s, scale)
        if len(r.failures) <= 12:
            for f in r.failures:
                if f.steps_lost:
                    ax_t.annotate(f" -{f.steps_lost} steps", (f.at / scale, 0.97),
                                  xycoords=("data", "axes fraction"), va="top", fontsize=8,
                                  color="#d62828")

        legend: list[Artist] = []
        if s["failures"]:
            legend.append(Line2D([], [], color="#d62828", lw=1.6, label="failure"))
        if saved:
            legend.append(Line2D([], [], color="#1d3557", lw=1.2, marker="|", ls="", ms=10,
                                 label="checkpoint saved"))
        if failed:
            legend.append(Line2D([], [], color="#d62828", marker="x", ls="",
                                 label="checkpoint failed"))
        if stragglers:
            legend.append(Line2D([], [], color=STRAGGLER, ls="--", label="straggler reported"))
        if any(old and new for _t, old, new in s["resets"]):
            legend.append(Line2D([], [], color="#7b2cbf", ls=":", label="reset (resize)"))
        shown = {cat for _a, _b, cat in s["lost"]}
        legend += [Patch(color=c, alpha=min(1.0, a * 2), label=lbl)
                   for cat, (c, a, lbl) in SHADES.items() if cat in shown]
        ax_t.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                    fontsize=9, frameon=False)

        goodput = "?" if r.goodput is None else f"{100 * r.goodput:.1f}%"
        n_fail, n_rst = len(r.failures), len(r.restarts)
        fig.suptitle(
            f"run {r.run_id or '?'}: goodput {goodput} over {dur(r.wall_s)}, "
            f"{n_fail} failure{'s' if n_fail != 1 else ''}, {n_rst} full restart"
            f"{'s' if n_rst != 1 else ''}, {r.status}",
            fontsize=12,
        )
        out = Path(path)
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out


def _label_spans(ax: Any, spans: list[list[Any]], wall_s: float, scale: float) -> None:
    """Writes the length of every shaded span wide enough to hold it, in its middle."""
    for a, b, cat in spans:
        if wall_s > 0 and (b - a) / wall_s >= 0.08:
            ax.text((a + b) / 2 / scale, 0.5, f"{SHADES[cat][2].split(' (')[0]}\n{dur(b - a)}",
                    transform=ax.get_xaxis_transform(), ha="center", va="center", fontsize=10,
                    color="#343a40")


