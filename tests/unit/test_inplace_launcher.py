"""`hvd-resilient run --launcher inplace --hosts` input checks: what would run but never work
across hosts gets one line before anything starts."""

from __future__ import annotations

import pytest

from hvd_resilient.errors import ConfigError
from hvd_resilient.launch.cli import build_parser, resolve
from hvd_resilient.launch.hosts import is_loopback


def resolved(*argv: str) -> None:
    resolve(build_parser().parse_args(["--launcher", "inplace", *argv, "--", "python", "t.py"]))


@pytest.mark.parametrize("name", ["localhost", "127.0.0.1", "127.0.0.2"])
def test_a_loopback_name_beside_other_hosts_is_refused_with_one_line(name):
    """Each agent tells the others where its store listens by its --hosts name: 127.0.0.1
    would send every other host to itself."""
    with pytest.raises(ConfigError) as e:
        resolved("--hosts", f"{name}:2,10.9.8.7:2", "--np", "4")
    said = str(e.value)
    assert "\n" not in said and said.startswith(f"run: --hosts {name}:2,10.9.8.7:2: {name} ")
    assert "an address the other hosts reach" in said


def test_loopback_alone_is_one_machine_and_other_names_are_not_loopback():
    resolved("--hosts", "localhost:2", "--np", "2")  # no error: every agent on this machine
    assert is_loopback("::1") and not is_loopback("10.9.8.7")
    assert not is_loopback("no-such-host.invalid")  # unresolvable: the ssh probe says so
