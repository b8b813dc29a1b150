"""The Horovod driver's entry: its switches read once into `DriverOptions`, an error of ours
before the launch as one line and its exit code, and the launcher's last word after it."""

from __future__ import annotations

import pytest

from hvd_resilient.errors import FATAL_EXIT_CODE, LaunchError
from hvd_resilient.events import EventLog
from hvd_resilient.launch.horovod import driver
from hvd_resilient.launch.horovod.options import DriverOptions
from hvd_resilient.launch.horovod.patches.context import PatchContext


def test_options_are_read_from_the_environment_and_horovodruns_arguments():
    assert DriverOptions.read({}, []) == DriverOptions()
    o = DriverOptions.read(
        {"HVD_RESILIENT_SLOT_HOSTS": "0", "HVD_RESILIENT_STANDBY": "0",
         "HVD_RESILIENT_DISCOVERY_INTERVAL": "0.25", "HVD_RESILIENT_RUN_DIR": "/r"},
        ["-np", "2", "-p", "2222", "--ssh-identity-file", "/k", "python", "t.py"])
    assert o == DriverOptions(slot_hosts=False, standby=False, discovery_interval_s=0.25,
                              run_dir="/r", ssh_port="2222", ssh_identity="/k")
    assert DriverOptions.read({"HVD_RESILIENT_STANDBY": "1"}).standby is True


@pytest.mark.parametrize("bad", ["0", "-1", "0.01", "7200", "nan"])
def test_a_bad_discovery_interval_is_one_line(bad):
    with pytest.raises(LaunchError) as e:
        DriverOptions.read({"HVD_RESILIENT_DISCOVERY_INTERVAL": bad})
    assert str(e.value) == (f"horovod driver: discovery_interval must be seconds between 0.05 "
                            f"and 3600, got {bad!r} (from HVD_RESILIENT_DISCOVERY_INTERVAL; "
                            "unset it for Horovod's 1 s)")
    with pytest.raises(LaunchError) as e:
        DriverOptions.read({"HVD_RESILIENT_DISCOVERY_INTERVAL": "fast"})
    assert str(e.value) == ("horovod driver: discovery_interval must be a number, got 'fast' "
                            "(from HVD_RESILIENT_DISCOVERY_INTERVAL)")


def test_the_switches_are_declared_once_for_the_run_flags_and_the_drivers_environment():
    """`hvd-resilient run` hands each switch to the driver as the variable the driver reads
    back: the default writes none, every other value reads back as itself."""
    from hvd_resilient.launch.horovod.options import DriverSwitches, driver_env

    assert driver_env(DriverSwitches()) == {}
    switches = DriverSwitches(slot_hosts=False, standby_workers=False, warm_pool=True,
                              discovery_interval=0.25, discovery_watch="/h/hosts.txt")
    env = driver_env(switches)
    assert env == {"HVD_RESILIENT_SLOT_HOSTS": "0", "HVD_RESILIENT_STANDBY": "0",
                   "HVD_RESILIENT_WARM_POOL": "1", "HVD_RESILIENT_DISCOVERY_INTERVAL": "0.25",
                   "HVD_RESILIENT_DISCOVERY_WATCH": "/h/hosts.txt"}
    assert DriverOptions.read(env) == DriverOptions(
        slot_hosts=False, standby=False, warm_pool=True, discovery_interval_s=0.25,
        discovery_watch="/h/hosts.txt")
    with pytest.raises(LaunchError, match="slot_hosts must be true or false, got 'maybe'"):
        DriverOptions.read({"HVD_RESILIENT_SLOT_HOSTS": "maybe"})


def test_the_entry_point_turns_a_launch_error_into_one_line_and_its_exit_code(
        monkeypatch, capsys):
    monkeypatch.setenv("HVD_RESILIENT_DISCOVERY_INTERVAL", "fast")
    with pytest.raises(SystemExit) as e:
        driver.main(["-np", "1", "true"])  # stops before any patch is installed
    assert e.value.code == LaunchError.exit_code
    assert capsys.readouterr().err == (
        "hvd-resilient: launcher: horovod driver: discovery_interval must be a number, got "
        "'fast' (from HVD_RESILIENT_DISCOVERY_INTERVAL)\n")


def failing_launcher(monkeypatch, error: Exception) -> None:
    from horovod.runner import launch

    def run_commandline() -> None:
        raise error

    monkeypatch.setattr(launch, "run_commandline", run_commandline)


def test_the_launchers_failure_is_one_line_naming_the_cause(monkeypatch, capsys):
    ctx = PatchContext()
    failing_launcher(monkeypatch, RuntimeError("Horovod detected that one or more processes\n"
                                               "exited. Exit code: 1"))
    assert driver.launch([], ctx, 0.0) == 1
    assert capsys.readouterr().err == ("hvd-resilient: launcher: Horovod detected that one or "
                                       "more processes exited. Exit code: 1\n")
    failing_launcher(monkeypatch, RuntimeError("Job has been shutdown, see above"))
    ctx.thread_errors.append("discovery script /d.sh printed nothing")
    assert driver.launch([], ctx, 0.0) == 1
    assert capsys.readouterr().err == \
        "hvd-resilient: launcher: discovery script /d.sh printed nothing\n"


def test_a_worker_that_stopped_on_a_fatal_error_leaves_the_launcher_silent(
        monkeypatch, capsys, tmp_path):
    failing_launcher(monkeypatch, RuntimeError("processes exited. Exit code: 78"))
    assert driver.launch([], PatchContext(), 0.0) == FATAL_EXIT_CODE  # static horovodrun
    failing_launcher(monkeypatch, RuntimeError("processes exited. Exit code: 1"))
    ctx = PatchContext()
    ctx.fatal = "h+0[0]"
    assert driver.launch([], ctx, 0.0) == FATAL_EXIT_CODE  # the fatal stop saw it
    ctx = PatchContext(DriverOptions(run_dir=str(tmp_path)))
    assert driver.launch([], ctx, 0.0) == 1
    capsys.readouterr()
    EventLog(tmp_path / "events.jsonl", rank=1, size=2).emit("fatal", error="config: bad")
    assert driver.launch([], ctx, 0.0) == FATAL_EXIT_CODE  # the worker recorded it
    assert capsys.readouterr().err == ""
