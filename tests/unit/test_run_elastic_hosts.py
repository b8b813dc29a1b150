"""`hvd-resilient run` options the Horovod scenarios need: an elastic job on fixed hosts
(horovodrun's `-H` with `--min-np`, Horovod's FixedHosts discovery) and no blacklist cooldown
(`--blacklist-cooldown-range 0 0`, plain horovodrun's default)."""

from __future__ import annotations

import pytest

from hvd_resilient.errors import ConfigError
from hvd_resilient.launch.cli import build_parser, resolve


def command(*argv: str) -> list[str]:
    opts, launcher = resolve(build_parser().parse_args([*argv, "--", "python", "t.py"]))
    return launcher.command(opts, [])


def test_hosts_with_min_np_is_an_elastic_job_on_those_hosts():
    cmd = command("--hosts", "localhost:2,127.0.0.1:2", "--np", "2", "--min-np", "2",
                  "--max-np", "4")
    line = " ".join(cmd)
    assert "-m hvd_resilient.launch.horovod.driver" in line  # slot hosts, standby, one line
    assert "-H localhost:2,127.0.0.1:2" in line and "--min-np 2 --max-np 4" in line
    assert "--host-discovery-script" not in line
    static = " ".join(command("--hosts", "localhost:2", "--np", "2"))
    assert "--min-np" not in static and "--gloo" in static  # without sizes: static as before


def test_cooldown_0_0_means_never_readmitted_and_other_zeros_are_refused(tmp_path):
    script = tmp_path / "d.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    never = command("--discovery", str(script), "--blacklist-cooldown-range", "0", "0")
    assert "--blacklist-cooldown-range" not in never
    assert "--blacklist-cooldown-range 1 2" in " ".join(
        command("--discovery", str(script), "--blacklist-cooldown-range", "1", "2"))
    with pytest.raises(ConfigError, match=r"needs 0 < MIN <= MAX \(or 0 0"):
        command("--discovery", str(script), "--blacklist-cooldown-range", "0", "3")


def test_min_np_without_discovery_or_hosts_is_still_refused():
    with pytest.raises(ConfigError, match="they need --discovery or --hosts"):
        command("--np", "2", "--min-np", "1")
