"""A stand-in for the in-place agent, for `tests/unit/test_inplace_fanout.py`: run by the
fan-out in its place (`HVD_RESILIENT_INPLACE_AGENT_MODULE=tests.scripts.fake_inplace_agent`).

It parses the agent's command line as the fan-out's contract has it (a word outside it exits 2),
prints the coordinator line when it is host 0, reads its environment line from stdin, prints
`fake agent I ready`, then obeys its stdin: `TERM` exits 143 + 10*I, `INT` 130 + 10*I (so that
the test tells whose code the fan-out returned), EOF exits 0. Everything it saw goes to
`$FAKE_AGENT_RECORDS/agent-I.json`, rewritten at each step. `$FAKE_AGENT_MODE` changes host 0:
`silent` never prints its address (and says `fake agent 0 silent` in place of ready), `die`
exits 3 at once, `exit` exits 7 once ready.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--min-np", type=int)
    p.add_argument("--last-call", type=float)
    p.add_argument("--replace", action="store_true")
    p.add_argument("--standby", type=int)
    p.add_argument("--host-index", type=int, required=True)
    p.add_argument("--hosts-count", type=int, required=True)
    p.add_argument("--job-nproc", type=int, required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--coordinator")
    p.add_argument("--control-stdin", action="store_true")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if not a.control_stdin or a.cmd[:1] != ["--"]:
        p.error("needs --control-stdin and -- CMD")
    return a


class Record:
    def __init__(self, index: int) -> None:
        self.path = Path(os.environ["FAKE_AGENT_RECORDS"]) / f"agent-{index}.json"
        self.data: dict[str, Any] = {"pid": os.getpid(), "words": [], "eof": False}

    def set(self, **kv: Any) -> None:
        """Whole or not at all: the test may read it at any moment."""
        self.data.update(kv)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        tmp.replace(self.path)


def main() -> int:
    started = time.monotonic_ns()
    a = parse(sys.argv[1:])
    me = a.host_index
    rec = Record(me)
    rec.set(argv=sys.argv, started_ns=started)
    mode = os.environ.get("FAKE_AGENT_MODE", "") if me == 0 else ""
    if mode == "die":
        return 3
    if me == 0 and mode != "silent":
        address = f"{a.address}:{20000 + os.getpid() % 40000}"
        rec.set(address=address, printed_ns=time.monotonic_ns())
        print(f"hvd-resilient-coordinator {address}", flush=True)
    rec.set(env=json.loads(sys.stdin.readline() or "null"))
    print(f"fake agent {me} {'silent' if mode == 'silent' else 'ready'}", flush=True)
    if mode == "exit":
        return 7
    for line in sys.stdin:
        word = line.strip()
        rec.set(words=[*rec.data["words"], word])
        if word in ("TERM", "INT"):
            return (143 if word == "TERM" else 130) + 10 * me
    rec.set(eof=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
