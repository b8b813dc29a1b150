"""The text report: one screen an operator reads top to bottom, numbers with units.

Plain ASCII so it survives any terminal, log collector or `LANG=C` pipe.
"""

from __future__ import annotations

from hvd_resilient.report import data, jobs
from hvd_resilient.report.analysis import Failure, Report
from hvd_resilient.report.checkpoints import Summary


def dur(seconds: float | None) -> str:
    """A duration with a unit that fits its size: 0.042 s, 3.4 s, 12m 05s, 3h 02m."""
    if seconds is None:
        return "-"
    s = float(seconds)
    if s == 0:
        return "0 s"
    if abs(s) < 1:
        return f"{s:.3f} s"
    if abs(s) < 60:
        return f"{s:.2f} s" if abs(s) < 10 else f"{s:.1f} s"
    if abs(s) < 3600:
        return f"{int(s // 60)}m {int(s % 60):02d}s"
    return f"{int(s // 3600)}h {int(s % 3600 // 60):02d}m"


def size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _line(label: str, text: str) -> str:
    return f"{label:<14}{text}"


def _summary(label: str, s: Summary) -> str:
    return f"{label} {dur(s.median)} median, {dur(s.max)} max"


def _unit(r: Report) -> str:
    """"step", or "commit" where the run's steps are its commits (`Report.step_unit`)."""
    return "commit" if r.step_unit == "commit" else "step"


def _status(r: Report) -> str:
    where = f"{_unit(r)} {r.final_step}"
    if r.status == "finished":
        text = f"finished at {where}"
    elif r.status == "failed":
        text = f"FAILED at {where}: {r.fatal_error or '?'}"
    elif r.status == "preempted":
        text = f"preempted at {where} (final checkpoint written)"
    elif r.silent_s is not None:
        usual = f"; it commits every {dur(r.usual_gap_s)}" if r.usual_gap_s else ""
        text = f"SILENT for {dur(r.silent_s)} at {where}{usual}: hung or dead"
    else:
        ago = f", last event {dur(r.since_last_event_s)} ago" if r.since_last_event_s else ""
        text = f"no 'done' yet at {where}: still running or crashed{ago}"
    sizes = "/".join(str(s) for s in r.world_sizes) or "?"
    plural = "es" if r.launches != 1 else ""
    return f"{text}; {r.launches} launch{plural}; world size {sizes}"


def _rate(steps: float | None, samples: float | None) -> str:
    text = f"{_num(steps, '.2f')} steps/s"
    return text + (f", {samples:.0f} samples/s" if samples else "")


def _changes(changes: list[list[float]], most: int = 8) -> str:
    """"2 at 0 s -> 1 at 4.68 s -> ..." (0 workers: "down"), the middle elided when long."""
    parts = [f"{int(n) if n else 'down'} at {dur(t)}" for t, n in changes]
    if len(parts) > most:
        parts = [*parts[: most // 2], f"... ({len(parts) - most} more)", *parts[-most // 2:]]
    return " -> ".join(parts)


def _failure_rows(failures: list[Failure]) -> list[str]:
    head = (f"  {'#':>2} {'at':>9}  {'kind':<11} {'lost':>5} {'detect<=':>9} {'reset':>9} "
            f"{'restore':>9} {'restart':>9} {'MTTR':>9}  world")
    rows = [head]
    for i, f in enumerate(failures, 1):
        world = f"{f.old_size}->{f.new_size}" if f.old_size and f.new_size else (
            f"->{f.new_size}" if f.new_size else "-")
        rows.append(
            f"  {i:>2} {dur(f.at):>9}  {f.kind:<11} {f.steps_lost:>5} {dur(f.detect_s):>9} "
            f"{dur(f.reset_s):>9} {dur(f.restore_s):>9} {dur(f.restart_s):>9} "
            f"{dur(f.total_s):>9}  {world}"
        )
    return rows


def _straggler_rows(r: Report, most: int = 10) -> list[str]:
    """Totals and the rule, what the windows showed, then one line per report (the newest
    `most`); nothing when the log has no straggler report and no record of detection."""
    rule = r.straggler_rule
    how = (f"; rule {rule['ratio']}x for {rule['windows']} windows of {rule['window_steps']} "
           f"steps{', eviction on' if rule.get('evict') else ''}" if rule else "")
    st = r.step_times
    seen = []
    if st:
        high = (f", highest ratio {st['max_ratio']:.2f}x (rank {st['max_ratio_rank']} at "
                f"{dur(st['max_ratio_at'])})" if st["max_ratio"] is not None else "")
        seen.append(_line("", f"windows: {st['judged']} of {st['windows']} judged{high}"))
        seen.append(_line("", f"per step: compute {dur(st['compute_s'])}, waiting for peers "
                              f"{dur(st['wait_s'])} (medians)"))
    if not r.stragglers:
        return [_line("stragglers", f"none reported{how}"), *seen] if rule or st else []
    evicted = sum(s["evicted"] for s in r.stragglers)
    ranks = sorted({s["rank"] for s in r.stragglers})
    out = [_line("stragglers", (
        f"{_plural(len(r.stragglers), 'report')} (rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(map(str, ranks))}), {evicted} evicted{how}")), *seen]
    shown = r.stragglers[-most:]
    if len(shown) < len(r.stragglers):
        out.append(_line("", f"... {len(r.stragglers) - len(shown)} earlier reports"))
    for s in shown:
        ratio = "?" if s["ratio"] is None else f"{s['ratio']:.2f}x"
        per_step = (f" ({s['compute_s']:.4f} s vs {s['others_s']:.4f} s)"
                    if s["compute_s"] is not None and s["others_s"] is not None else "")
        fate = ("evicted" if s["evicted"] else
                f"kept pace again at {dur(s['cleared_at'])}" if s["cleared_at"] is not None
                else "still slow at the end of the log")
        out.append(_line("", (
            f"  rank {s['rank']} on {s['host'] or '?'} (pid {s['pid'] or '?'}): {ratio} the "
            f"others' compute{per_step} at {dur(s['at'])}, step {s['step']}; {fate}")))
    return out


def render(r: Report, source: str = "") -> str:
    """The whole text report for `r`; `source` names the file it came from."""
    out = [f"run {r.run_id or '?'}  {source}".rstrip()]
    out.append(_line("status", _status(r)))
    goodput = "-" if r.goodput is None else f"{100 * r.goodput:.1f} %"
    to_now = ("" if r.goodput_to_now is None else
              f"   ({100 * r.goodput_to_now:.1f} % to now, the silence counted as lost)")
    out.append(_line("wall", f"{dur(r.wall_s)}   productive {dur(r.productive_s)}   "
                             f"goodput {goodput}{to_now}"))
    lost = [f"{k.replace('checkpoint_', 'ckpt ')} {dur(v)}" for k, v in r.lost_s.items() if v > 0]
    out.append(_line("lost", " | ".join(lost) if lost else "nothing"))
    resumed = f" ({r.resumes} from a checkpoint)" if r.restarts else ""
    out.append(_line("failures", (
        f"{len(r.failures)}; resets {r.resets}; full restarts {len(r.restarts)}{resumed}; "
        f"{_unit(r)}s redone {r.steps_lost}")))
    if r.failures:
        out += _failure_rows(r.failures)
        m = r.mttr
        if m["total"].median is not None:
            parts = [_summary("MTTR", m["total"])]
            parts += [f"{k} {dur(m[k].median)}" for k in ("detect", "reset", "restore", "restart")
                      if m[k].median is not None]
            out.append(_line("recovery", "; ".join(parts) + " (medians)"))
        out.append(_line("", "detect<= is an upper bound: the log has the last progress "
                             "before a fault, not the fault"))
    for rs in r.restarts:
        out.append(_line("restart", (
            f"at {dur(rs['after_s'])} ({rs['reason']}): down {dur(rs['down_s'])}, start-up "
            f"{dur(rs['startup_s'])}, resumed from {_unit(r)} {rs['from_step']}"
            + (f" ({rs['source']})" if rs.get("source") else "") + ", "
            f"{rs['steps_lost']} {_unit(r)}s redone")))
    together = jobs.problems(r.jobs)
    jobs_line = jobs.line(r.jobs, together)
    if jobs_line:
        out.append(_line("jobs", jobs_line))
    out += [_line("PROBLEM", p) for p in together]
    label = ""
    for kind, text in data.lines(r.data_epochs):  # the first data row is labelled, as above
        out.append(_line(kind if kind == "PROBLEM" or kind != label else "", text))
        label = kind
    out += _straggler_rows(r)
    out.append(_line("throughput", _rate(r.step_rate, r.samples_per_s) + " (mean between commits)"))
    if len(r.throughput_by_size) > 1:
        out.append(_line("  by size", "; ".join(
            f"{_plural(n, 'worker')}: {_rate(v['steps_per_s'], v['samples_per_s'])}"
            for n, v in r.throughput_by_size.items())))
    if len(r.world_size_changes) > 1:
        out.append(_line("world size", _changes(r.world_size_changes)))
    c = r.checkpoints
    skipped = ", ".join(f"{n} {k}" for k, n in c["skipped"].items()) or "0"
    dropped = "".join(f"; {c[key]} {what}" for key, what in (
        ("superseded", "superseded"), ("already_published", "published already")) if c[key])
    out.append(_line("checkpoints", (
        f"{c['saved']} saved, newest step {c['newest_step'] if c['saved'] else '-'}; "
        f"{c['failed']} failed{dropped}; skipped {skipped}; {size(c['bytes_last'])} each")))
    st, up = Summary(**c["stall_s"]), Summary(**c["upload_s"])
    if c["saved"]:
        out.append(_line("  stall", f"{dur(st.total)} total; {dur(st.median)} median, "
                                    f"{dur(st.max)} max per checkpoint"))
        out.append(_line("  upload", f"{dur(up.median)} median, {dur(up.max)} max (background)"))
    risk = r.at_risk
    now = (f"; {dur(risk['seconds_now'])} by now" if risk["seconds_now"] is not None
           and r.status == "unfinished" else "")
    base = (f"checkpoint step {risk['newest_checkpoint_step']}"
            if risk["newest_checkpoint_step"] is not None else "the start (no checkpoint)")
    out.append(_line("if it died", f"lose {risk['steps']} steps, {dur(risk['seconds'])} of work "
                                   f"since {base}{now}"))
    out += _young_daly(r)
    if r.memory:
        out.append(_line("memory", ", ".join(f"{k} max {size(v)}" for k, v in r.memory.items())))
    return "\n".join(out)


def _young_daly(r: Report) -> list[str]:
    y = r.young_daly
    src = {"stall_seconds": "median stall", "seconds": "median write, no stall measured"}
    cost = f"C {dur(y.checkpoint_cost_s)} ({src.get(y.cost_source or '', 'no checkpoint')})"
    if y.mtbf_source == "none":
        first = f"{cost}; MTBF unknown: no failure observed, no suggestion"
    else:
        how = (f"observed, {_plural(y.failures, 'failure')}" if y.mtbf_source == "observed"
               else "given")
        first = f"{cost}; MTBF {dur(y.mtbf_s)} ({how})"
    lines = [_line("Young/Daly", first)]
    if y.young_s is not None:
        steps = (f" = {y.young_steps:.0f} steps" if y.young_steps is not None else "")
        lines.append(_line("", f"checkpoint every {dur(y.young_s)}{steps} "
                               f"(Young; Daly {dur(y.daly_s)})"))
    every = y.configured_every_steps
    if every is not None:
        conf = (f"{every} steps" + (f" = {dur(y.configured_every_s)}" if y.configured_every_s
                                    else "") if every else "0 (epoch ends only)")
        lines.append(_line("", f"configured checkpoint_every {conf}"))
    if y.failures and y.restart_failures < y.failures:
        restart_mtbf = dur(r.wall_s / y.restart_failures) if y.restart_failures else "unknown"
        lines.append(_line("", (
            f"note: {y.failures - y.restart_failures} of {y.failures} recovered in memory "
            f"without reading a checkpoint; MTBF of full restarts only: {restart_mtbf}")))
    return lines


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
