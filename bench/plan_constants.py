"""Regenerate the planner's measured defaults from the benchmarks' JSON (issue #31).

The planner's "measured" inputs for this project's stack were numbers copied by hand from
whatever benchmark was newest at the time, and they drifted: docs/planner.md and the code
quoted different recoveries for the same input. This script derives every one of them from
named result files and writes `hvd_resilient/report/plan/measured.py`; a unit test derives them
again and fails when the two differ, so a re-run benchmark cannot leave the planner behind
silently.

What each input is taken from (ours only: vanilla Horovod's and torchrun's code has not changed
since their runs, and their inputs keep their sources in `model.py`):

- detection and recovery samples: the idle random-kill runs (a random worker SIGKILLed at a
  random moment; fault -> first `failure_detected`, and from there to the first step);
- give-up probability: kill runs that never reached a first step, idle and busy together;
- join / leave stalls: `host_added` / `host_removed` of the recovery benchmark ("training
  stalled");
- rejoin: the project's mean blacklist cooldown plus the newcomer's median first step in
  `host_added` (a crashed worker's host comes back as a newcomer);
- torchrun restart: `torchrun_kill`'s median first step (warm forked workers);
- cold start: the goodput benchmark's launches (launch -> first step), median;
- checkpoint costs: the least-squares line (seconds at 0 GB, seconds per GB) through the
  medians of `bench/checkpoint_bench.py` at each size.

Usage: ``.venv/bin/python bench/plan_constants.py --kills RESULT --recovery RESULT --goodput
RESULT --checkpoint RESULT`` (names under bench/results/; a name left out keeps the one in
measured.py's `FROM`; writes measured.py and prints what changed); ``--check`` only compares
(exit 1 when measured.py is stale); ``--markdown`` prints docs/planner.md's rows for them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "hvd_resilient" / "report" / "plan" / "measured.py"
COOLDOWN_MEAN_S = 20.0
"""Mean of `hvd-resilient run`'s default blacklist cooldown range, 10-30 s."""


def _load(name: str) -> dict[str, Any]:
    try:
        return json.loads((RESULTS / name).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"plan_constants: cannot read bench/results/{name}: {e}") from None


def _scenario(doc: dict[str, Any], name: str, where: str) -> list[dict[str, Any]]:
    for s in doc.get("scenarios", []):
        if s.get("name") == name and s.get("ours_runs"):
            return list(s["ours_runs"])
    raise SystemExit(f"plan_constants: bench/results/{where} has no ours runs of {name}; "
                     f"re-run bench/recovery.py --only {name}")


def _finished(runs: list[dict[str, Any]], key: str, where: str) -> list[float]:
    out = [float(r[key]) for r in runs if r.get("finished") and r.get(key) is not None]
    if not out:
        raise SystemExit(f"plan_constants: no finished run of {where} has {key!r}; re-run that "
                         "scenario with the current bench/recovery.py")
    return out


FIT_KEYS = {"ckpt_async_stall_s": "async_stall", "ckpt_sync_s": "sync_stall",
            "ckpt_upload_s": "async_end_to_end", "restore_s": "restore_s"}
"""Planner input -> the checkpoint benchmark's median column it is fitted to."""


def checkpoint_costs(checkpoint: str) -> dict[str, Any]:
    """(seconds at 0 GB, seconds per GB) of each checkpoint cost, least squares over the
    benchmark's medians at each size, and the sentence that says where they come from."""
    doc = _load(checkpoint)
    try:
        rows = doc["results"]
        gb = [r["bytes"] / 1e9 for r in rows]
        fit = {}
        for name, key in FIT_KEYS.items():
            ys = [float(r["median_seconds"][key]) for r in rows]
            mx, my = statistics.fmean(gb), statistics.fmean(ys)
            slope = (sum((x - mx) * (y - my) for x, y in zip(gb, ys, strict=True))
                     / sum((x - mx) ** 2 for x in gb))
            fit[name] = (round(my - slope * mx, 4), round(slope, 4))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise SystemExit(f"plan_constants: bench/results/{checkpoint} is not a checkpoint "
                         f"benchmark result ({e!r})") from None
    created = doc.get("created")
    made = (datetime.datetime.fromtimestamp(created, datetime.UTC).date().isoformat()
            if isinstance(created, int | float) else "undated")
    return {"fit": fit, "source": f"measured: bench/results/{checkpoint} ({made}), linear fit "
                                  "over the 10 MB, 100 MB and 1 GB medians"}


def derive(kills: str, recovery: str, goodput: str, checkpoint: str) -> dict[str, Any]:
    """Every measured default as plain data: {name: {"value", "samples", "source"}}, and the
    checkpoint costs under "checkpoint"."""
    kd, rd, gd = _load(kills), _load(recovery), _load(goodput)
    idle = _scenario(kd, "random_kill_1host", kills)
    busy = [r for s in kd["scenarios"] if s["name"] == "random_kill_1host_busy"
            for r in s.get("ours_runs", [])]
    done = [r for r in idle if r.get("finished") and r.get("first_step_s") is not None]
    detect = [round(float(r["detect_s"]), 3) for r in done]
    recover = [round(float(r["first_step_s"]) - float(r["detect_s"]), 3) for r in done]
    kill_runs = idle + busy
    failed = sum(1 for r in kill_runs if not r.get("finished")
                 or r.get("first_step_s") is None)
    added = _scenario(rd, "host_added", recovery)
    removed = _scenario(rd, "host_removed", recovery)
    torchrun = _scenario(rd, "torchrun_kill", recovery)
    join = _finished(added, "stalled_s", f"host_added in {recovery}")
    leave = _finished(removed, "stalled_s", f"host_removed in {recovery}")
    newcomer = statistics.median(_finished(added, "first_step_s", f"host_added in {recovery}"))
    restart = statistics.median(_finished(torchrun, "first_step_s",
                                          f"torchrun_kill in {recovery}"))
    starts = [float(r["startup_s"]) for c in gd["configs"] for r in c["runs"]
              if r.get("startup_s") is not None]
    kill_src = f"measured: bench/results/{kills} random_kill_1host, {len(done)} idle runs"

    def entry(samples: list[float], source: str) -> dict[str, Any]:
        return {"value": round(statistics.median(samples), 3), "samples": tuple(samples),
                "source": source}

    return {
        "ours_detect_s": entry(detect, f"{kill_src} (fault -> first failure_detected)"),
        "ours_recover_s": entry(recover, f"{kill_src} (first step - detect)"),
        "ours_giveup": {"value": round(failed / len(kill_runs), 4), "samples": (),
                        "source": f"measured: {failed} of {len(kill_runs)} random kills never "
                                  f"trained again (bench/results/{kills}, idle and busy)"},
        "ours_join_stall_s": entry(join, f"measured: bench/results/{recovery} host_added "
                                         "(standby workers), training stalled"),
        "ours_leave_stall_s": entry(leave, f"measured: bench/results/{recovery} host_removed, "
                                           "training stalled"),
        "ours_rejoin_s": {"value": round(COOLDOWN_MEAN_S + newcomer, 3), "samples": (),
                          "source": f"project default cooldown 10-30 s (mean 20 s) + the "
                                    f"newcomer's first step {newcomer:.2f} s (bench/results/"
                                    f"{recovery} host_added, median)"},
        "ours_torchrun_restart_s": {"value": round(restart, 3), "samples": (),
                                    "source": f"measured: bench/results/{recovery} "
                                              "torchrun_kill (warm forked workers), median"},
        "cold_start_s": entry(starts, f"measured: bench/results/{goodput} start-up, "
                                      f"{len(starts)} launches"),
        "checkpoint": checkpoint_costs(checkpoint),
    }


def _text(value: str, indent: int) -> str:
    """A string literal, split into adjacent literals when it would pass 100 columns."""
    parts = textwrap.wrap(value, 96 - indent, drop_whitespace=False, break_on_hyphens=False)
    if len(parts) <= 1:
        return repr(value)
    pad = " " * (indent + 1)
    return "(" + f"\n{pad}".join(repr(x) for x in parts) + ")"


def _numbers(values: tuple[float, ...], indent: int) -> str:
    """A tuple of numbers, wrapped."""
    if not values:
        return "()"
    body = textwrap.wrap(", ".join(repr(v) for v in values), 96 - indent)
    pad = " " * (indent + 1)
    return "(" + f"\n{pad}".join(body) + ("," if len(values) == 1 else "") + ")"


def render(derived: dict[str, Any], files: dict[str, str]) -> str:
    """measured.py's text: plain literals, wrapped to the project's line length."""
    held = dict(derived)
    costs = held.pop("checkpoint")
    lines = [
        '"""The planner\'s measured defaults for this project\'s stack. GENERATED by',
        "`bench/plan_constants.py` from the benchmark results named in `FROM`; do not edit by",
        "hand: re-run the benchmarks, then the script (a unit test fails when this file and",
        'the JSON disagree)."""',
        "",
        "from __future__ import annotations",
        "",
        "from typing import Any",
        "",
        "FROM: dict[str, str] = {",
        *(f"    {k!r}: {v!r}," for k, v in files.items()),
        "}",
        "",
        "MEASURED: dict[str, dict[str, Any]] = {",
    ]
    for name, e in held.items():
        lines += [f"    {name!r}: {{",
                  f"        'value': {e['value']!r},",
                  f"        'samples': {_numbers(e['samples'], 19)},",
                  f"        'source': {_text(e['source'], 18)},",
                  "    },"]
    lines += ["}", "", f"CHECKPOINT_SOURCE = {_text(costs['source'], 20)}", "",
              "CHECKPOINT_FIT: dict[str, tuple[float, float]] = {",
              "    # name: (seconds at 0 GB, seconds per GB)",
              *(f"    {k!r}: {v!r}," for k, v in costs["fit"].items()), "}", ""]
    return "\n".join(lines)


KINDS = ("kills", "recovery", "goodput", "checkpoint")


def generated() -> tuple[dict[str, str], dict[str, Any]]:
    """What measured.py holds now, in `derive`'s form ({} on the first run)."""
    sys.path.insert(0, str(ROOT))
    try:
        from hvd_resilient.report.plan import measured
    except ImportError:
        return {}, {}
    held = {k: dict(v) for k, v in measured.MEASURED.items()}
    held["checkpoint"] = {"fit": dict(measured.CHECKPOINT_FIT),
                          "source": measured.CHECKPOINT_SOURCE}
    return dict(measured.FROM), held


def markdown(held: dict[str, Any]) -> list[str]:
    """docs/planner.md's rows for these inputs (a unit test finds each there, so the page
    cannot quote numbers the planner no longer uses)."""
    rows = []
    for name, e in held.items():
        if name == "checkpoint":
            per_gb = " / ".join(f"{line[1]:.3g}" for line in e["fit"].values())
            rows.append(f"| checkpoint stall / blocking save / upload / restore | {per_gb} s "
                        f"per GB | {e['source']} |")
            continue
        n = len(e["samples"])
        value = f"{e['value']:g}" + ("" if name == "ours_giveup" else " s")
        rows.append(f"| `{name}` | {value}" + (f" (median of {n})" if n else "")
                    + f" | {e['source']} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", help="random-kill result under bench/results/")
    ap.add_argument("--recovery", help="recovery result with host_added, host_removed and "
                                       "torchrun_kill")
    ap.add_argument("--goodput", help="goodput result")
    ap.add_argument("--checkpoint", help="checkpoint_bench result")
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 when stale")
    ap.add_argument("--markdown", action="store_true", help="print docs/planner.md's rows")
    args = ap.parse_args(argv)
    held_files, current = generated()
    files = {**held_files}
    files.update({k: v for k in KINDS if (v := getattr(args, k)) is not None})
    if missing := [k for k in KINDS if k not in files]:
        raise SystemExit(f"plan_constants: measured.py names no {', '.join(missing)} result; "
                         f"pass --{' --'.join(missing)}")
    derived = derive(**files)
    if args.markdown:
        print("\n".join(markdown(derived)))
        return 0
    for name, e in derived.items():
        old = current.get(name, {})
        new = e.get("value", e.get("fit"))
        if old.get("value", old.get("fit")) != new:
            print(f"{name}: {old.get('value', old.get('fit'))} -> {new}  ({e['source']})")
    if args.check:
        same = derived == current and files == held_files
        print("measured.py is current" if same else "measured.py is stale: re-run without "
              "--check")
        return 0 if same else 1
    OUT.write_text(render(derived, files))
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
