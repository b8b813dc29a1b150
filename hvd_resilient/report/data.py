"""Exactly-once data use, checked from the `epoch_end` events alone.

At each epoch's end rank 0 records how many samples the whole job consumed in that epoch and
an order-independent digest of their ids, across every reset, restore, join and leave (the
samplers' tally, committed with their position: `hvd_resilient/state/sampler.py`), beside the
count and digest the data set expects. Here each event is compared with its expectation:
equal count and digest is each sample used exactly once; otherwise the difference is named,
down to the sample when one is missing or duplicated (`ids_digest.single_id`).

An epoch can end more than once in a log: a rollback to a commit before its end (a failure
right after it), or a run stopped by max_steps at an epoch's last step and resumed. Each of
its events must hold; equal events are one line.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.state.ids_digest import MASK, METHOD, from_hex, single_id

MOST_LINES = 10
"""More epochs than this that all check out are shown as ranges."""


def _int(v: Any) -> int | None:
    return v if type(v) is int else None


def check(e: dict[str, Any]) -> tuple[bool | None, str]:
    """(True: exactly once, False: a problem, None: not checkable; the sentence) for one
    `epoch_end` event."""
    epoch = e.get("epoch", "?")
    head = f"epoch {epoch}"
    if e.get("digest") != METHOD:
        return None, f"{head}: not checked: digest method {e.get('digest')!r} is unknown here"
    samples, n = _int(e.get("samples")), _int(e.get("expected_samples"))
    got, want = from_hex(e.get("ids_digest")), from_hex(e.get("expected_ids_digest"))
    if n is None or want is None:
        return False, f"{head}: the event has no valid expected count or digest"
    if e.get("samples") is None and e.get("ids_digest") is None:
        return None, (f"{head}: not checked: resumed mid-epoch from a checkpoint written before "
                      "consumed ids were tallied")
    if samples is None or got is None:
        return False, f"{head}: the event has no valid sample count or digest"
    extra, diff = samples - n, (got - want) & MASK
    if extra == 0 and diff == 0:
        return True, f"{head}: {samples} samples, digest matches the dataset (exactly once)"
    if extra > 0:
        what = f"{extra} duplicated"
        one = single_id(diff, n) if extra == 1 else None
        what += f" (sample {one} used twice)" if one is not None else ""
    elif extra < 0:
        what = f"{-extra} missing"
        one = single_id(-diff, n) if extra == -1 else None
        what += f" (sample {one} never used)" if one is not None else ""
    else:
        what = "the right count but other ids: some missing and as many duplicated"
    if diff == 0:
        what += "; yet the digest matches: the event contradicts itself"
    return False, f"{head}: {samples} samples, the dataset has {n}: {what}"


def epochs_of(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per distinct `epoch_end` record, in order of first appearance: epoch, samples,
    expected_samples, exactly_once (True, False or None), text, times (events alike)."""
    out: list[dict[str, Any]] = []
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in events:
        if e.get("event") != ev.EPOCH_END:
            continue
        key = tuple(str(e.get(k)) for k in ("epoch", "samples", "ids_digest", "expected_samples",
                                             "expected_ids_digest", "digest"))
        if key in seen:
            seen[key]["times"] += 1
            continue
        ok, text = check(e)
        seen[key] = {"epoch": e.get("epoch"), "samples": e.get("samples"),
                     "expected_samples": e.get("expected_samples"), "exactly_once": ok,
                     "text": text, "times": 1}
        out.append(seen[key])
    return out


def lines(epochs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(label, text) rows for the text report: `data` rows, `PROBLEM` rows for mismatches.
    Beyond MOST_LINES epochs, consecutive epochs that check out share a row."""
    rows: list[tuple[str, str]] = []
    run: list[dict[str, Any]] = []

    def flush() -> None:
        if len(run) > 1 and len(epochs) > MOST_LINES:
            counts = {x["samples"] for x in run}
            each = f"{run[0]['samples']} samples each" if len(counts) == 1 else "samples"
            rows.append(("data", f"epochs {run[0]['epoch']}-{run[-1]['epoch']}: {each}, "
                                 "digest matches the dataset (exactly once)"))
        else:
            rows.extend(("data", x["text"]) for x in run)
        run.clear()

    for x in epochs:
        if x["exactly_once"] is True:
            follows = bool(run) and _int(run[-1]["epoch"]) is not None and (
                _int(x["epoch"]) == run[-1]["epoch"] + 1)
            if run and not follows:  # a range never hides a gap or a repeat
                flush()
            run.append(x)
            continue
        flush()
        rows.append(("PROBLEM" if x["exactly_once"] is False else "data", x["text"]))
    flush()
    return rows


def problems(epochs: list[dict[str, Any]]) -> list[str]:
    return [x["text"] for x in epochs if x["exactly_once"] is False]
