"""`hvd-resilient`: the operator's command (demo, checkpoints, and more as they land)."""

from __future__ import annotations

import argparse
import sys

from hvd_resilient.cli_errors import exit_on_error


def _ckpt(argv: list[str]) -> int:
    from hvd_resilient.checkpoint.cli import main
    from hvd_resilient.config import refuse_credentials

    for arg in argv:  # before any store sees it: a URL's password must not reach a message
        refuse_credentials(arg, "ckpt")
    return main(argv)


def _demo(argv: list[str]) -> int:
    from hvd_resilient.launch.demo import main

    return main(argv)


def _run(argv: list[str]) -> int:
    from hvd_resilient.launch.cli import main

    return main(argv)


def _report(argv: list[str]) -> int:
    from hvd_resilient.report.cli import main

    return main(argv)


def _plan(argv: list[str]) -> int:
    from hvd_resilient.report.plan.cli import main

    return main(argv)


COMMANDS = {
    "report": (_report, "goodput, failures/MTTR, checkpoint costs, Young/Daly from a run folder"),
    "plan": (_plan, "simulate a job at scale: ETTR per strategy, best commit/checkpoint intervals"),
    "run": (_run, "launch a job with horovodrun, mpirun, torchrun or the in-place agent, and "
                  "restart it after failures"),
    "demo": (_demo, "2 min: a small GPT trains elastically here through a fault and a resize"),
    "ckpt": (_ckpt, "list | show | verify | prune | supersede durable checkpoints at a URL"),
}


@exit_on_error
def main(argv: list[str] | None = None) -> int:
    from hvd_resilient.masking import MaskingWriter

    # The terminal is a boundary too: whatever a subcommand prints goes out masked.
    for name in ("stdout", "stderr"):
        if not isinstance(getattr(sys, name), MaskingWriter):
            setattr(sys, name, MaskingWriter(getattr(sys, name)))
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = argparse.ArgumentParser(prog="hvd-resilient")
        parser.add_argument("command", choices=sorted(COMMANDS),
                            help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
        parser.parse_args(argv[:1] or ["--help"])
        return 2
    fn, _ = COMMANDS[argv[0]]
    return int(fn(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
