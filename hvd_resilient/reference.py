"""The tables of docs/configuration.md, generated from the settings themselves (`TrainConfig`'s
and `hvd-resilient run`'s), so that the page cannot drift from the code:
`python -m hvd_resilient.reference` rewrites them in place, `--check` only says whether they
are current, and tests/unit/test_config_reference.py fails while they are not.

Only the text between a `<!-- generated: NAME ... -->` line and the next
`<!-- end generated -->` line is rewritten; the prose around it is the page's own.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
_BLOCK = re.compile(r"(<!-- generated: (\w+)[^\n]*-->\n)(.*?)(<!-- end generated -->)", re.S)


def blocks() -> dict[str, str]:
    """Block name -> its markdown: `training` (TrainConfig, a table per section) and `run`."""
    from hvd_resilient.config import SCHEMA, SECTIONS
    from hvd_resilient.launch.run_settings import tables as run_tables

    training = [SCHEMA.table("")]
    for name, cls in SECTIONS.items():
        what = " ".join((cls.__doc__ or "").split()).split(". ")[0].rstrip(".")
        training += ["", f"### `{name}`: {what[:1].lower()}{what[1:]}.", "", SCHEMA.table(name)]
    return {"training": "\n".join(training), "run": run_tables()}


def render(page: str) -> str:
    """``page`` with every generated block replaced by what the code says now."""
    made = blocks()

    def fill(m: re.Match[str]) -> str:
        if m.group(2) not in made:
            raise KeyError(f"docs/configuration.md: no generated block named {m.group(2)!r}")
        return f"{m.group(1)}{made[m.group(2)]}\n{m.group(4)}"

    return _BLOCK.sub(fill, page)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hvd_resilient.reference",
                                description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="exit 1 when the page is not current, changing nothing")
    args = p.parse_args(argv)
    old = PAGE.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print(f"{PAGE} is out of date: run python -m hvd_resilient.reference",
                  file=sys.stderr)
            return 1
        return 0
    if new != old:
        PAGE.write_text(new)
        print(f"rewrote the generated tables of {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
