"""``hvd-resilient ckpt list|show|verify|prune|supersede URL``: look at and maintain durable
checkpoints. ``list`` also shows the memory tier segments this host holds for runs whose
``checkpoint_url`` is URL (the commits a restart on this host resumes from first).

Exit codes: 0 fine, 1 ``verify`` found a bad checkpoint (or nothing a resume could load), 2
usage or storage error, including a location without any checkpoint folder (``no checkpoints
at URL``: a mistyped URL must not pass for an empty, healthy one; ``list`` exits 0 there when
this host's memory tier holds segments for URL: a job may die before its first durable
checkpoint). Errors are one line on stderr, never a traceback, and never show credentials.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from hvd_resilient.checkpoint.errors import CheckpointError
from hvd_resilient.checkpoint.manager import CheckpointManager
from hvd_resilient.checkpoint.manifest import SHARDED, CheckpointInfo, step_dir
from hvd_resilient.checkpoint.memory.listing import HeldRun, default_root, held_segments
from hvd_resilient.checkpoint.reader import ScanResult
from hvd_resilient.checkpoint.stores import SUPPORTED_URLS, StoreError, redact_url
from hvd_resilient.checkpoint.supersede import default_supersede_tag

HEADER = ("STEP", "EPOCH", "WORLD", "CREATED (UTC)", "SIZE", "FILES", "LAYOUT", "STATE")
MEMORY_HEADER = ("STEP", "EPOCH", "WORLD", "CREATED (UTC)", "SIZE", "OWNER", "RUN", "STATE")
NOT_REHASHED = "complete (not re-hashed)"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _created(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) if ts else "-"


def _layout(info: CheckpointInfo) -> str:
    """``replicated``, or ``sharded/N`` for N shard files (one per rank at save)."""
    return f"{info.layout}/{info.shard_files}" if info.layout == SHARDED else info.layout


def _row(info: CheckpointInfo, state: str) -> tuple[str, ...]:
    return (str(info.step), str(info.epoch), str(info.world_size), _created(info.created),
            human_bytes(info.total_bytes), str(len(info.files)), _layout(info), state)


def _table(rows: list[tuple[str, ...]], out: TextIO,
           header: tuple[str, ...] = HEADER) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")


def _other_rows(scan: ScanResult) -> list[tuple[int, tuple[str, ...]]]:
    rows: list[tuple[int, tuple[str, ...]]] = [
        (s, (str(s), "-", "-", "-", "-", str(len(k)), "-", "partial (no manifest)"))
        for s, k in scan.partial.items()]
    rows += [(s, (str(s), "-", "-", "-", "-", "-", "-", f"invalid manifest: {r}"))
             for s, r in scan.invalid.items()]
    return rows


class NoCheckpointsError(CheckpointError):
    """The location holds no checkpoint folder at all (empty, missing or mistyped)."""

    def __init__(self, url: str) -> None:
        super().__init__(f"no checkpoints at {redact_url(url)}")


def _scan(mgr: CheckpointManager) -> ScanResult:
    """The listing, or :class:`NoCheckpointsError` when there is nothing at all."""
    scan = mgr.scan()
    if not (scan.checkpoints or scan.partial or scan.invalid):
        raise NoCheckpointsError(mgr.url)
    return scan


def _pick(scan: ScanResult, step: int | None) -> list[CheckpointInfo]:
    if step is None:
        return scan.checkpoints
    found = [i for i in scan.checkpoints if i.step == step]
    if not found:
        raise CheckpointError(f"no complete checkpoint {step_dir(step)}")
    return found


def _memory_rows(held: dict[str, HeldRun]) -> list[tuple[str, ...]]:
    rows: list[tuple[tuple[str, int, str], tuple[str, ...]]] = []
    for key, run in held.items():
        rows += [((key, i.step, i.owner),
                  (str(i.step), str(i.epoch), str(i.world_size), _created(i.created),
                   human_bytes(i.total_bytes), i.owner, key, NOT_REHASHED))
                 for i in run.segments]
        rows += [((key, b.step, b.owner),
                  (str(b.step), "-", "-", "-", "-", b.owner, key,
                   "bad: " + " ".join(b.reason.split())))
                 for b in run.bad]
    return [r for _, r in sorted(rows)]


def _memory_json(held: dict[str, HeldRun]) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for key, run in sorted(held.items()):
        docs += [{"run": key, "owner": i.owner, "step": i.step, "epoch": i.epoch,
                  "world_size": i.world_size, "created": i.created, "bytes": i.total_bytes,
                  "host": i.host, "state": NOT_REHASHED} for i in run.segments]
        docs += [{"run": key, "owner": b.owner, "step": b.step, "state": "bad",
                  "reason": b.reason} for b in run.bad]
    return sorted(docs, key=lambda d: (d["run"], d["step"], d["owner"]))


def _durable_json(scan: ScanResult) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = [
        {"step": i.step, "epoch": i.epoch, "world_size": i.world_size, "created": i.created,
         "bytes": i.total_bytes, "files": len(i.files), "layout": _layout(i),
         "state": NOT_REHASHED} for i in scan.checkpoints]
    docs += [{"step": s, "files": len(k), "state": "partial (no manifest)"}
             for s, k in scan.partial.items()]
    docs += [{"step": s, "state": "invalid manifest", "reason": r}
             for s, r in scan.invalid.items()]
    return sorted(docs, key=lambda d: d["step"])


def _cmd_list(mgr: CheckpointManager, args: argparse.Namespace, out: TextIO) -> int:
    """Durable checkpoints, then this host's memory tier segments for the same location
    (the URL as given and as the store spells it: a path is also its file:// URL)."""
    root = args.memory_dir or default_root()
    held = held_segments(dict.fromkeys([args.url, mgr.url]), root)
    try:
        scan: ScanResult | None = _scan(mgr)
    except NoCheckpointsError:
        if not held:
            raise
        scan = None  # died before its first durable checkpoint: the memory tier is all
    if args.json:
        doc = {"url": redact_url(mgr.url), "checkpoints": _durable_json(scan) if scan else [],
               "memory_dir": root, "memory": _memory_json(held)}
        out.write(json.dumps(doc) + "\n")
        return 0
    if scan is None:
        out.write(f"no durable checkpoints at {redact_url(mgr.url)}\n")
    else:
        rows = [(i.step, _row(i, NOT_REHASHED)) for i in scan.checkpoints]
        rows += _other_rows(scan)
        _table([r for _, r in sorted(rows)], out)
    if held:
        out.write(f"\nmemory tier on this host ({root}):\n")
        _table(_memory_rows(held), out, MEMORY_HEADER)
    else:
        out.write("\nmemory tier on this host: none for this location\n")
    return 0


def _cmd_show(mgr: CheckpointManager, args: argparse.Namespace, out: TextIO) -> int:
    scan = _scan(mgr)
    if not scan.checkpoints:
        raise CheckpointError(f"no complete checkpoints at {redact_url(mgr.url)}")
    info = _pick(scan, args.step)[-1]
    out.write(f"url:             {info.url}\n")
    out.write(f"step:            {info.step}\nepoch:           {info.epoch}\n")
    out.write(f"world size:      {info.world_size}\nrun id:          {info.run_id or '-'}\n")
    if info.layout == SHARDED:
        out.write(f"layout:          sharded (torch.distributed.checkpoint), {info.shard_files} "
                  f"shard files, reshards onto any world size\n")
    else:
        out.write("layout:          replicated (one full state, written by rank 0)\n")
    out.write(f"created (UTC):   {_created(info.created)}\n")
    out.write(f"versions:        hvd_resilient {info.library_version}, "
              f"torch {info.torch_version}\n")
    out.write(f"size:            {human_bytes(info.total_bytes)} ({info.total_bytes} bytes)\n")
    out.write("files:\n")
    for name, f in sorted(info.files.items()):
        out.write(f"  {name}  {f.size} bytes  {f.algorithm} {f.digest}\n")
    if info.meta:
        out.write(f"meta:            {json.dumps(info.meta, sort_keys=True)}\n")
    return 0


def _cmd_verify(mgr: CheckpointManager, args: argparse.Namespace, out: TextIO) -> int:
    """Exit 0 only when every complete checkpoint re-hashes fine, no manifest is unreadable
    and at least one checkpoint is good: exactly the checkpoints a resume would load."""
    scan = _scan(mgr)
    rows: list[tuple[int, tuple[str, ...]]] = []
    bad = len(scan.invalid) if args.step is None else 0
    good = 0
    for info in _pick(scan, args.step):
        problems = mgr.verify(info)  # the same manifest reading and file checks as a resume
        bad += bool(problems)
        good += not problems
        rows.append((info.step, _row(info, "BAD: " + "; ".join(problems) if problems else "ok")))
    if args.step is None:
        rows += _other_rows(scan)
    _table([r for _, r in sorted(rows)], out)
    if not good:
        out.write(f"no complete checkpoint at {redact_url(mgr.url)} verifies: a resume would "
                  "start from scratch\n")
    return 1 if bad or not good else 0


def _cmd_prune(mgr: CheckpointManager, args: argparse.Namespace, out: TextIO) -> int:
    if args.stale_uploads_after < 0:
        raise ValueError(f"--stale-uploads-after must be >= 0, got {args.stale_uploads_after}")
    aborted = mgr.abort_stale_uploads(args.stale_uploads_after, dry_run=args.dry_run)
    if not mgr.has_checkpoints() and not aborted:
        raise NoCheckpointsError(mgr.url)
    removed = mgr.prune(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    names = ", ".join(step_dir(s) for s in removed) or "nothing"
    out.write(f"{verb}: {names}\n")
    verb = "would abort" if args.dry_run else "aborted"
    out.write(f"{verb} {aborted} stale upload{'s' * (aborted != 1)} (started more than "
              f"{args.stale_uploads_after:g}s ago)\n")
    return 0


def _cmd_supersede(mgr: CheckpointManager, args: argparse.Namespace, out: TextIO) -> int:
    tag = args.tag or default_supersede_tag()
    moved = mgr.supersede(tag)
    if not moved:
        raise NoCheckpointsError(mgr.url)
    steps = ", ".join(map(str, moved))
    out.write(f"moved {len(moved)} checkpoint folder{'s' * (len(moved) != 1)} (steps {steps}) "
              f"from {redact_url(mgr.url)} to {redact_url(mgr.url)}/{tag}\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hvd-resilient ckpt", description="Inspect and maintain durable checkpoints."
    )
    sub = p.add_subparsers(dest="command", required=True)
    helps = {
        "list": "table of checkpoints, and of the memory tier segments this host holds "
                "for URL (manifests only, fast)",
        "show": "one checkpoint's manifest (default: the newest)",
        "verify": "re-download and re-hash every file; exit 1 if any is bad",
        "prune": "apply retention: keep the newest K and every M-th step; abort stale "
                 "uploads",
        "supersede": "move every checkpoint to URL/TAG/ (kept, out of the way of a fresh "
                     "start)",
    }
    for name, text in helps.items():
        sp = sub.add_parser(name, help=text, description=text)
        sp.add_argument("url", help=f"{SUPPORTED_URLS}, or a path")
        sp.add_argument("--endpoint-url", help="S3-compatible endpoint (default: AWS chain)")
        if name == "list":
            sp.add_argument("--memory-dir", metavar="DIR",
                            help="this host's memory tier (default: "
                                 "$HVD_RESILIENT_MEMORY_TIER_DIR, else "
                                 "/dev/shm/hvd_resilient)")
            sp.add_argument("--json", action="store_true",
                            help="print one JSON object instead of tables")
        if name in ("show", "verify"):
            sp.add_argument("--step", type=int, help="only this step")
        if name == "prune":
            sp.add_argument("--keep-last", type=int, required=True, help="newest K to keep")
            sp.add_argument("--keep-every", type=int, default=0,
                            help="also keep steps divisible by M (0: none)")
            sp.add_argument("--dry-run", action="store_true", help="only print")
            sp.add_argument("--stale-uploads-after", type=float, default=3600.0,
                            metavar="SECONDS",
                            help="abort unfinished uploads (S3 multipart uploads, local "
                                 "temporary files) started longer ago (default: 3600)")
        if name == "supersede":
            sp.add_argument("--tag", help="folder under URL to move them to (default: "
                                          "superseded-<UTC yyyymmddTHHMMSS>)")
    return p


COMMANDS = {"list": _cmd_list, "show": _cmd_show, "verify": _cmd_verify, "prune": _cmd_prune,
            "supersede": _cmd_supersede}


def main(argv: list[str], out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run ``hvd-resilient ckpt ARGV``; return the exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed usage / help already
        return int(e.code or 0) if isinstance(e.code, int) else 2
    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    try:
        mgr = CheckpointManager(
            args.url,
            keep_last=getattr(args, "keep_last", 0),
            keep_every=getattr(args, "keep_every", 0),
            **options,
        )
        return COMMANDS[args.command](mgr, args, out)
    except (StoreError, CheckpointError, ValueError) as e:
        text = redact_url(" ".join(str(e).split()))
        err.write(f"hvd-resilient ckpt {args.command}: error: {text}\n")
        return 2
    except KeyboardInterrupt:
        err.write("hvd-resilient ckpt: interrupted\n")
        return 130
