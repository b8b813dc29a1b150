"""docs/configuration.md lists every setting the code reads, and only those: its tables are
generated from the settings (`python -m hvd_resilient.reference`), and must be current."""

from __future__ import annotations

import re

from hvd_resilient import reference
from hvd_resilient.config import settings
from hvd_resilient.launch.cli import build_parser
from hvd_resilient.launch.run_settings import RUN
from tests.support.paths import ROOT

PAGE = (ROOT / "docs" / "configuration.md").read_text()
DISCOVERY_PAGE = (ROOT / "docs" / "discovery.md").read_text()
ENV_NAME = re.compile(r"HVD_RESILIENT_[A-Z0-9_]*[A-Z0-9]")


def _block(name: str) -> str:
    m = re.search(rf"<!-- generated: {name}\b[^\n]*-->\n(.*?)<!-- end generated -->", PAGE,
                  re.S)
    assert m, f"docs/configuration.md has no generated block {name!r}"
    return m.group(1)


def test_the_generated_tables_are_current():
    assert reference.render(PAGE) == PAGE, (
        "docs/configuration.md differs from the code: run python -m hvd_resilient.reference")


def test_every_training_setting_has_its_row_with_flag_env_and_default():
    block = _block("training")
    for st in settings():
        row = next((line for line in block.splitlines() if line.startswith(f"| `{st.name}` |")),
                   None)
        assert row is not None, f"{st.name} missing from docs/configuration.md"
        assert f"`{st.flag}`" in row and f"`{st.env}`" in row, row
        assert f"`{st.default!r}`" in row, f"{st.name}: default {st.default!r} not in {row}"
    rows = re.findall(r"^\| `(\w+)` \| `--", block, re.M)
    assert set(rows) == {st.name for st in settings()}, "a row for a setting that is gone"


def test_every_run_option_has_its_row_and_is_a_flag_of_the_parser():
    block = _block("run")
    rows = re.findall(r"^\| `(\w+)` \|", block, re.M)
    assert rows == [st.name for st in RUN.settings]
    options = {o for a in build_parser()._actions for o in a.option_strings
               if o.startswith("--") and o != "--help"}
    missing = sorted(o for o in options if f"`{o}`" not in PAGE)
    assert not missing, f"hvd-resilient run options missing from the page: {missing}"


def test_every_environment_variable_the_code_reads_is_documented():
    names = set()
    for path in [*(ROOT / "hvd_resilient").rglob("*.py"), *(ROOT / "discovery").iterdir()]:
        if path.is_file():
            names |= set(ENV_NAME.findall(path.read_text(errors="replace")))
    fields_env = {st.env for st in settings()}
    undocumented = sorted(
        n for n in names - fields_env
        if n not in PAGE and n not in DISCOVERY_PAGE
        and not any(n.startswith(p.rstrip("*")) and p in PAGE
                    for p in re.findall(r"HVD_RESILIENT_[A-Z0-9_]+\*", PAGE)))
    assert not undocumented, f"read by the code, documented nowhere: {undocumented}"
