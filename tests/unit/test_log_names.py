"""Every module logs under `hvd_resilient.` (where `log.setup` puts the one handler): a module
that also runs as `python -m ...` is `__main__` then, and `getLogger(__name__)` there loses
every line below WARNING (the in-place agent's "generation N: members ..." went missing so)."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hvd_resilient"


def test_a_module_that_runs_as_main_names_its_logger():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if '__name__ == "__main__"' in text and re.search(
                r"^logger = logging\.getLogger\(__name__\)", text, re.M):
            wrong.append(str(path.relative_to(PACKAGE)))
    assert not wrong, f"logger named __main__ when run with -m: {wrong}"


def test_every_named_logger_is_under_the_package():
    names = re.compile(r'getLogger\("([^"]+)"\)')
    outside = [(str(p.relative_to(PACKAGE)), n) for p in sorted(PACKAGE.rglob("*.py"))
               for n in names.findall(p.read_text()) if not n.startswith("hvd_resilient")]
    assert not outside, outside
