"""Shared behaviour of every discovery script: validation, output, options from the
environment, exit statuses, the time budget and the last-good-answer cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hvd_resilient.discovery import format_hosts, parse_slots, validate_hostname
from hvd_resilient.discovery.cache import AnswerCache
from hvd_resilient.discovery.errors import DiscoveryError, TransientDiscoveryError
from hvd_resilient.discovery.output import merge_hosts
from hvd_resilient.discovery.runner import Script, one_line, run
from tests.support.paths import ROOT

GOOD_HOSTS = [
    "node1", "node-01", "n", "a.b.c", "gpu_7", "ip-10-0-0-1.ec2.internal", "10.0.0.1",
    "127.0.0.1", "x" * 63, ".".join(["a" * 63] * 3) + ".bcd", "1host", "train-0.workers",
]
BAD_HOSTS = [
    ("a;rm -rf /", "';'"),
    ("$(reboot)", "'$'"),
    ("`id`", "'`'"),
    ("host name", "' '"),
    ("-oProxyCommand=x", "'='"),
    ("-leading", "starts with '-'"),
    ("trailing-", "starts or ends with '-'"),
    ("a/b", "'/'"),
    ("a'b", '"\'"'),
    ('a"b', "'\"'"),
    ("a\nb", "'\\n'"),
    ("::1", "IPv6"),
    ("fe80::1", "IPv6"),
    ("", "empty"),
    ("a..b", "empty label"),
    ("host.", "empty label"),
    ("10.0.0.256", "not a valid IPv4"),
    ("10.1", "not a valid IPv4"),
    ("x" * 64, "longer than 63"),
    ("a" * 254, "longer than 253"),
    ("nöde", "'ö'"),
    ("a(b)", "'('"),
]


@pytest.mark.parametrize("name", GOOD_HOSTS)
def test_good_hostnames_pass_unchanged(name: str) -> None:
    assert validate_hostname(name) == name


@pytest.mark.parametrize(("name", "fragment"), BAD_HOSTS)
def test_bad_hostnames_are_refused_with_a_reason(name: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        validate_hostname(name)
    assert fragment in str(info.value)


@pytest.mark.parametrize(("value", "expected"), [("1", 1), ("8", 8), ("08", 8), (4, 4)])
def test_slots_accepted(value: object, expected: int) -> None:
    assert parse_slots(value) == expected


@pytest.mark.parametrize("value", ["0", "-1", "", " 4", "+4", "4.0", "4_0", "0x4", "٤", "four",
                                   True, 0, -3, None, 2.0, "1" * 10])
def test_slots_refused(value: object) -> None:
    with pytest.raises(ValueError, match="slots must be a positive integer"):
        parse_slots(value)


def test_format_hosts_sorts_and_is_stable() -> None:
    hosts = {"node10": 2, "node2": 1, "a": 4}
    assert format_hosts(hosts) == "a:4\nnode10:2\nnode2:1\n"
    assert format_hosts(dict(reversed(list(hosts.items())))) == format_hosts(hosts)
    assert format_hosts({}) == ""


def test_format_hosts_validates_again() -> None:
    with pytest.raises(DiscoveryError, match="';'"):
        format_hosts({"a;b": 1})
    with pytest.raises(DiscoveryError, match="slots"):
        format_hosts({"a": 0})


def test_merge_hosts_refuses_duplicates() -> None:
    assert merge_hosts([("a", 1), ("b", 2)]) == {"a": 1, "b": 2}
    with pytest.raises(DiscoveryError, match="twice"):
        merge_hosts([("a", 1), ("a", 1)])


def test_one_line_collapses_and_bounds() -> None:
    assert one_line("a\nb\r\n  c") == "a b c"
    assert len(one_line("x" * 5000)) == 1000


# ---- the runner, with tiny fake scripts ------------------------------------------------------

def _script(discover, **kw) -> Script:  # type: ignore[no-untyped-def]
    def add_options(opts):  # type: ignore[no-untyped-def]
        opts.add("--slots", env="HVD_TEST_SLOTS", type=int, default=1, help="slots")
    return Script(name="fake", description="fake", add_options=add_options,
                  discover=discover, **kw)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"XDG_RUNTIME_DIR": str(tmp_path), **extra}


def test_success_prints_sorted_lines_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    script = _script(lambda ctx: {"b": ctx.args.slots, "a": 1})
    assert run(script, ["--slots", "3"], _env(tmp_path)) == 0
    out, err = capsys.readouterr()
    assert out == "a:1\nb:3\n"
    assert err == ""


def test_option_from_environment_and_flag_wins(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(lambda ctx: {"a": ctx.args.slots})
    assert run(script, [], _env(tmp_path, HVD_TEST_SLOTS="5")) == 0
    assert capsys.readouterr().out == "a:5\n"
    assert run(script, ["--slots", "2"], _env(tmp_path, HVD_TEST_SLOTS="5")) == 0
    assert capsys.readouterr().out == "a:2\n"


def test_bad_environment_value_names_the_variable(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(lambda ctx: {"a": 1})
    assert run(script, [], _env(tmp_path, HVD_RESILIENT_DISCOVERY_DEADLINE="soon")) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("fake: environment variable HVD_RESILIENT_DISCOVERY_DEADLINE='soon'")
    assert err.count("\n") == 1


def test_bad_flag_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_script(lambda ctx: {}), ["--nope"], _env(tmp_path)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "unrecognized arguments: --nope" in err


def test_internal_error_is_one_line_not_a_traceback(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    def boom(ctx):  # type: ignore[no-untyped-def]
        raise KeyError("surprise\nsecond line")
    assert run(_script(boom), [], _env(tmp_path)) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "internal error: KeyError" in err and "Traceback" not in err


def test_invalid_output_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_script(lambda ctx: {"$(reboot)": 1}), [], _env(tmp_path)) == 2
    out, err = capsys.readouterr()
    assert out == "" and "'$'" in err


class _Flaky:
    """Answers, then fails in the way the test asks."""

    def __init__(self) -> None:
        self.fail: BaseException | None = None
        self.hosts = {"n1": 2, "n2": 1}

    def __call__(self, ctx):  # type: ignore[no-untyped-def]
        if self.fail is not None:
            raise self.fail
        return self.hosts


def test_transient_failure_after_success_prints_last_good_answer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flaky = _Flaky()
    script = _script(flaky)
    assert run(script, [], _env(tmp_path)) == 0
    first = capsys.readouterr().out
    flaky.fail = TransientDiscoveryError("API down")
    assert run(script, [], _env(tmp_path)) == 0
    out, err = capsys.readouterr()
    assert out == first == "n1:2\nn2:1\n"
    assert "API down; printed the last good answer from 0 s ago" in err


def test_cache_is_keyed_by_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flaky = _Flaky()
    script = _script(flaky)
    assert run(script, ["--slots", "1"], _env(tmp_path)) == 0
    flaky.fail = TransientDiscoveryError("API down")
    assert run(script, ["--slots", "2"], _env(tmp_path)) == 1
    out, err = capsys.readouterr()
    assert out == "n1:2\nn2:1\n"  # only the first, successful run printed
    assert "API down (no earlier answer cached)" in err


def test_validation_error_is_never_masked_by_the_cache(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flaky = _Flaky()
    script = _script(flaky)
    assert run(script, [], _env(tmp_path)) == 0
    capsys.readouterr()
    flaky.fail = DiscoveryError("line 3: slots must be a positive integer, got '0'")
    assert run(script, [], _env(tmp_path)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "fake: line 3: slots must be a positive integer, got '0'\n"
    flaky.fail = None
    flaky.hosts = {"bad host": 1}
    assert run(script, [], _env(tmp_path)) == 2
    assert capsys.readouterr().out == ""


def test_cache_too_old_or_disabled_is_not_used(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    flaky = _Flaky()
    script = _script(flaky)
    cache = tmp_path / "c.json"
    assert run(script, ["--cache", str(cache)], {}) == 0
    data = json.loads(cache.read_text())
    data["written"] -= 1000
    cache.write_text(json.dumps(data))
    flaky.fail = TransientDiscoveryError("API down")
    capsys.readouterr()
    assert run(script, ["--cache", str(cache)], {}) == 1
    assert "cached answer is 1000 s old (max 300 s)" in capsys.readouterr().err
    assert run(script, ["--cache", str(cache), "--cache-max-age", "0"], {}) == 1
    assert "cache disabled" in capsys.readouterr().err
    assert run(script, ["--cache", str(cache), "--cache-max-age", "2000"], {}) == 0
    assert capsys.readouterr().out == "n1:2\nn2:1\n"


def test_tampered_cache_is_ignored(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "c.json"
    cache.write_text(json.dumps({"version": 1, "script": "fake", "written": time.time(),
                                 "hosts": {"a;reboot": 1}}))
    script = _script(_Flaky())
    script.discover.fail = TransientDiscoveryError("down")  # type: ignore[attr-defined]
    assert run(script, ["--cache", str(cache)], {}) == 1
    out, err = capsys.readouterr()
    assert out == "" and "ignoring cache" in err and "';'" in err


def test_cache_write_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    cache = AnswerCache(str(tmp_path / "c.json"), script="fake", private_dir=False)
    for i in range(1, 20):
        cache.store({f"n{i}": i})
    assert sorted(os.listdir(tmp_path)) == ["c.json"]
    loaded = cache.load(60)
    assert loaded is not None and loaded[0] == {"n19": 19}


def test_default_cache_dir_must_be_private(tmp_path: Path) -> None:
    shared = tmp_path / "hvd_resilient"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)  # e.g. pre-created by another user in a shared /tmp
    cache = AnswerCache.for_script("fake", {}, {"XDG_RUNTIME_DIR": str(tmp_path)})
    cache.store({"a": 1})
    assert cache.load(60) is None
    assert "not a private directory" in (cache.unusable or "")
    assert os.listdir(shared) == []
    os.chmod(shared, 0o700)
    cache.store({"a": 1})
    assert cache.load(60) == ({"a": 1}, pytest.approx(0, abs=5))


def test_soft_deadline_unblocks_a_stuck_discovery(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    never = threading.Event()

    def stuck(ctx):  # type: ignore[no-untyped-def]
        never.wait(10)
        return {"a": 1}

    start = time.monotonic()
    assert run(_script(stuck), ["--deadline", "0.3"], _env(tmp_path)) == 1
    assert time.monotonic() - start < 2
    assert "no answer within 0.3 s" in capsys.readouterr().err


def test_deadline_hands_back_an_outer_sigalrm_timer(tmp_path: Path) -> None:
    import signal

    fired: list[int] = []
    old = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30)
        assert run(_script(lambda ctx: {"a": 1}), [], _env(tmp_path)) == 0
        delay, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25 < delay <= 30
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert fired == []


def test_hard_deadline_ends_a_process_the_signal_cannot_reach(tmp_path: Path) -> None:
    # The main thread blocks SIGALRM (stands in for being stuck in C code): only the hard
    # watchdog thread can end the process, and it must do so right after the deadline.
    code = textwrap.dedent("""
        import signal, sys, time
        from hvd_resilient.discovery.runner import Script, run
        def stuck(ctx):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(10)
            return {"a": 1}
        sys.argv = ["fake", "--deadline", "0.5"]
        sys.exit(run(Script("fake", "", lambda o: None, stuck)))
    """)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=10, cwd=ROOT, env={**os.environ, "XDG_RUNTIME_DIR":
                                                     str(tmp_path)})
    assert time.monotonic() - start < 2.5
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "hard deadline" in proc.stderr


def test_package_imports_stay_light() -> None:
    # Every discovery run pays for these imports within its 2 s budget: no torch, no
    # horovod, no boto3 until the AWS script actually needs it.
    code = ("import sys, hvd_resilient.discovery.hostfile, hvd_resilient.discovery.slurm, "
            "hvd_resilient.discovery.kubernetes, hvd_resilient.discovery.aws, "
            "hvd_resilient.discovery.health; "
            "heavy = {'torch', 'horovod', 'boto3', 'botocore', 'numpy'} & set(sys.modules); "
            "print(sorted(heavy))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["hostfile", "slurm", "kubernetes", "aws-asg", "health-filter"])
def test_every_script_is_executable_with_help(name: str, tmp_path: Path) -> None:
    path = ROOT / "discovery" / name
    assert os.access(path, os.X_OK)
    assert path.read_text().startswith("#!/usr/bin/env python3\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
                                 f"{os.environ.get('PATH', '')}"}
    proc = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=30,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "HVD_RESILIENT_DISCOVERY_DEADLINE" in proc.stdout
