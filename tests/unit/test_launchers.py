"""`hvd-resilient run`'s launchers: one module each behind the `Launcher` protocol, found by
name in the registry; an option of a launcher that was not chosen refused with one line (a
flag or a config-file key, never a default); the Horovod driver's switches declared once, for
the flag and for the variable the driver reads."""

from __future__ import annotations

import ast
import signal
from pathlib import Path

import pytest

from hvd_resilient import cli as entry
from hvd_resilient.errors import FATAL_EXIT_CODE, ConfigError
from hvd_resilient.launch import cli
from hvd_resilient.launch.launchers import LAUNCHERS, owners
from hvd_resilient.launch.launchers.base import Launcher
from hvd_resilient.launch.run_settings import RUN

TRAIN = ["--", "python", "t.py"]


def resolve(*argv: str):
    return cli.resolve(cli.build_parser().parse_args([*argv, *TRAIN]))


@pytest.fixture
def discovery(tmp_path: Path) -> str:
    script = tmp_path / "d.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    return str(script)


def test_the_registry_is_what_launcher_chooses_from_and_each_is_a_launcher():
    assert tuple(LAUNCHERS) == RUN.by_name()["launcher"].choices == (
        "horovod", "mpi", "torchrun", "inplace")
    members = {*Launcher.__annotations__,
               *(n for n, v in vars(Launcher).items() if callable(v) and not n.startswith("_"))}
    for name, cls in LAUNCHERS.items():
        assert cls.name == name
        assert all(hasattr(cls, m) for m in members), (name, members)
        assert callable(cls.options)  # its section: a dataclass RUN builds it from
    assert set(members) >= {"options", "shared", "check", "probe", "command", "environment",
                            "wants_warm_pool", "stop_signal", "signal_group", "lease_group"}


def test_the_run_command_holds_no_branch_on_a_launchers_name():
    source = (Path(cli.__file__)).read_text()
    names = {n.value for n in ast.walk(ast.parse(source))
             if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not names & set(LAUNCHERS), names & set(LAUNCHERS)


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_defaults_never_count_as_set(name):
    opts, launcher = resolve("--launcher", name)
    assert launcher.name == name and opts.np == 2


def _foreign() -> list[tuple[str, str, str]]:
    """(option, a launcher that does not take it, the owners as the message names them)."""
    out = []
    for st in RUN.settings:
        own = owners(st.name)
        for name in LAUNCHERS:
            if own and name not in own:
                out.append((st.name, name, " or ".join(own)))
    return out


@pytest.mark.parametrize("option, launcher, owned", _foreign())
def test_an_option_of_another_launcher_is_refused_with_one_line(option, launcher, owned):
    st = RUN.by_name()[option]
    value = [] if st.type == "bool" else (
        ["1", "2"] if st.type.startswith("tuple[") else ["1"])
    with pytest.raises(ConfigError) as e:
        resolve("--launcher", launcher, st.flag, *value)
    assert str(e.value) == (f"run: {st.flag} applies to --launcher {owned} only; drop it or "
                            f"choose {owned}")


def test_which_options_are_whose():
    assert owners("nnodes") == ("torchrun",) and owners("standby") == ("inplace",)
    assert owners("warm_pool") == ("horovod",) and owners("standby_workers") == ("horovod",)
    assert owners("hosts") == ("horovod", "mpi", "inplace") == owners("ssh_port")
    assert owners("min_np") == ("horovod", "inplace") == owners("max_np") == owners("discovery")
    assert owners("np") == owners("run_id") == owners("launcher") == ()


def test_the_refusal_names_the_flag_as_given_and_a_file_key_where_it_was_written(tmp_path):
    with pytest.raises(ConfigError, match=r"^run: --no-slot-hosts applies to --launcher horovod "
                                          r"only; drop it or choose horovod$"):
        resolve("--launcher", "mpi", "--no-slot-hosts")
    f = tmp_path / "run.yaml"
    f.write_text("launcher: horovod\nnnodes: '1:2'\n")
    with pytest.raises(ConfigError) as e:
        resolve("--config", str(f))
    assert str(e.value) == (f"run: config file {f}: nnodes applies to --launcher torchrun only; "
                            "drop it or choose torchrun")
    # the launcher chosen by flag over the file's: the file's torchrun options now fit
    f.write_text("launcher: horovod\nnnodes: '1:2'\n")
    _, launcher = resolve("--config", str(f), "--launcher", "torchrun")
    assert launcher.own.nnodes == "1:2"


def test_the_refusal_is_a_config_error_one_line_and_its_exit_code(capsys):
    with pytest.raises(SystemExit) as e:
        entry.main(["run", "--launcher", "horovod", "--nnodes", "2", *TRAIN])
    assert e.value.code == FATAL_EXIT_CODE
    assert capsys.readouterr().err == ("hvd-resilient: error: run: --nnodes applies to "
                                       "--launcher torchrun only; drop it or choose torchrun\n")


def test_backend_is_no_longer_a_name_of_launcher(capsys, tmp_path):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--backend", "mpi", *TRAIN])
    assert "unrecognized arguments: --backend" in capsys.readouterr().err
    f = tmp_path / "run.yaml"
    f.write_text("backend: mpi\n")
    with pytest.raises(ConfigError, match="unknown field backend"):
        resolve("--config", str(f))


def test_the_drivers_switches_are_flags_handed_on_as_the_variables_it_reads(discovery, capsys):
    opts, launcher = resolve("--discovery", discovery, "--no-standby-workers",
                             "--discovery-interval", "0.25", "--no-slot-hosts")
    assert launcher.environment(opts) == {
        "HVD_RESILIENT_SLOT_HOSTS": "0", "HVD_RESILIENT_STANDBY": "0",
        "HVD_RESILIENT_DISCOVERY_INTERVAL": "0.25"}
    opts, launcher = resolve("--discovery", discovery)
    assert launcher.environment(opts) == {}  # defaults: the driver's own, nothing written
    assert cli.main(["--discovery", discovery, "--no-standby-workers", "--dry-run",
                     "--run-dir", str(Path(discovery).parent), *TRAIN]) == 0
    assert "HVD_RESILIENT_STANDBY=0" in capsys.readouterr().out.splitlines()[1:]


@pytest.mark.parametrize("argv, says", [
    (["--discovery-interval", "0.5"], "--discovery-interval needs --discovery"),
    (["--discovery", "DISCOVERY", "--discovery-interval", "0.01"],
     "--discovery-interval must be seconds between 0.05 and 3600, got 0.01"),
])
def test_a_bad_discovery_interval_flag_is_refused(discovery, argv, says):
    argv = [discovery if a == "DISCOVERY" else a for a in argv]
    with pytest.raises(ConfigError, match=says):
        resolve(*argv)


def test_how_a_signal_reaches_each_launchers_workers_and_who_shares_the_lease():
    assert LAUNCHERS["mpi"].stop_signal == signal.SIGUSR1  # the ranks' final checkpoint
    assert all(LAUNCHERS[n].stop_signal is None for n in ("horovod", "torchrun", "inplace"))
    assert not LAUNCHERS["horovod"].signal_group  # the driver ends its workers itself
    assert all(LAUNCHERS[n].signal_group for n in ("mpi", "torchrun", "inplace"))
    opts, launcher = resolve("--launcher", "torchrun", "--nnodes", "1:2", "--run-id", "j")
    assert launcher.lease_group(opts) == "torchrun:j:127.0.0.1:29400"
    opts, launcher = resolve("--launcher", "torchrun")
    assert launcher.lease_group(opts) is None
