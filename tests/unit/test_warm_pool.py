"""The warm pool (launch/warm/pool*.py): a worker forked from it must be, to whoever
launched it, the process a cold start would have been: its streams, folder, environment and
arguments; its exit code and its death by a signal; signals passed on; dead when its launch
process dies. Real processes on a real Unix socket; workers run their command at once
(tests/scripts/warm_pool_plain.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from hvd_resilient.launch.warm import pool as warm_pool
from tests.support.jobs import wait_for
from tests.support.paths import ROOT, SCRIPTS

pytestmark = pytest.mark.timeout(60)
CLIENT = ("import sys; from hvd_resilient.launch.warm import pool as warm_pool; "
          "warm_pool.run_in_pool(sys.argv[1:]); print('started cold', flush=True)")


@pytest.fixture
def pool(tmp_path: Path):
    sock = str(tmp_path / "p" / "warm-pool.sock")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    log = open(tmp_path / "pool.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "warm_pool_plain.py"), sock],
                            env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "listening\n"
        yield sock, proc
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):  # a test may have killed the pool
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
        proc.kill()
        proc.wait(10)
        log.close()


def launch(tmp_path: Path, sock: str, script: str, *args: str, python: str = sys.executable,
           name: str = "worker", prefix: tuple[str, ...] = (), **env: str) -> subprocess.Popen:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(script))
    full = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path),
                **{warm_pool.SOCKET_ENV: sock}, **env)
    return subprocess.Popen([*prefix, python, "-c", CLIENT, sys.executable, str(path), *args],
                            env=full, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def worker_pid(tmp_path: Path, proc: subprocess.Popen) -> int:
    pid_file = tmp_path / "pid"
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 20, "the worker's pid")
    assert proc.poll() is None
    return int(pid_file.read_text())


PID_THEN_WAIT = """
    import os, signal, sys, time
    def term(*_):
        print("worker got SIGTERM", flush=True)
        sys.exit(7)
    signal.signal(signal.SIGTERM, term)
    open("pid.tmp", "w").write(str(os.getpid()))
    os.rename("pid.tmp", "pid")
    while True:
        time.sleep(0.05)
"""


def test_a_forked_worker_has_the_launch_s_streams_folder_environment_and_exit_code(
        tmp_path, pool):
    sock, server = pool
    proc = launch(tmp_path, sock, """
        import logging, os, sys
        print("out", os.getcwd(), os.environ["ONLY_HERE"], sys.argv[1:], os.getppid(),
              len(logging.root.handlers))
        print("err", file=sys.stderr)
        sys.exit(3)
    """, "a", "b c", ONLY_HERE="yes")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 3, (out, err)
    assert out.split() == ["out", str(tmp_path), "yes", "['a',", "'b", "c']", str(server.pid),
                           "0"]
    assert err == "err\n"  # and not "started cold": the pool ran it


def test_a_worker_killed_by_a_signal_ends_its_launch_with_that_signal(tmp_path, pool):
    proc = launch(tmp_path, pool[0], PID_THEN_WAIT)
    os.kill(worker_pid(tmp_path, proc), signal.SIGKILL)
    assert proc.wait(20) == -signal.SIGKILL


def test_signals_sent_to_the_launch_reach_the_worker(tmp_path, pool):
    proc = launch(tmp_path, pool[0], PID_THEN_WAIT)
    worker_pid(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert (proc.returncode, out) == (7, "worker got SIGTERM\n")


def test_the_worker_dies_with_its_launch_process(tmp_path, pool):
    """Horovod ends a slot by killing its launch process tree, which the forked worker is not
    part of: the pool must kill it when the launch's connection closes."""
    proc = launch(tmp_path, pool[0], PID_THEN_WAIT)
    worker = psutil.Process(worker_pid(tmp_path, proc))
    proc.kill()
    proc.wait(10)
    worker.wait(10)  # raises TimeoutExpired if it lives on
    assert not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE


def test_the_pool_serves_launches_side_by_side(tmp_path, pool):
    procs = [launch(tmp_path, pool[0], f"import sys; print({i}); sys.exit({i})", name=f"w{i}")
             for i in range(4)]
    assert [(p.wait(30), p.stdout.read()) for p in procs] == [(i, f"{i}\n") for i in range(4)]


def test_another_python_or_network_or_no_pool_starts_cold(tmp_path, pool):
    """The pool runs only its own interpreter and environment, in its own network namespace
    (a Unix socket in a shared folder reaches network-namespace hosts and containers, whose
    workers must not run with this host's network); anything else, and a socket nobody
    listens on any more, leaves the launch to start as it would without a pool."""
    system = "/usr/bin/python3"
    if not os.path.exists(system) or sys.prefix == sys.base_prefix:
        pytest.fail("needs the venv Python and the system one (make install)")
    other = launch(tmp_path, pool[0], "print('worker')", python=system)
    assert other.communicate(timeout=30)[0] == "started cold\n"
    elsewhere = launch(tmp_path, pool[0], "print('worker')", prefix=("unshare", "--net"))
    assert elsewhere.communicate(timeout=30)[0] == "started cold\n"
    refused = (tmp_path / "pool.log").read_text()
    assert "another Python" in refused and "another network namespace" in refused, refused
    stale = tmp_path / "stale.sock"
    stale.write_text("")
    cold = launch(tmp_path, str(stale), "print('worker')")
    assert cold.communicate(timeout=30)[0] == "started cold\n"


def test_a_malformed_request_is_refused_and_the_pool_serves_on(tmp_path, pool):
    import socket

    sock = warm_pool.connect(pool[0])
    assert sock is not None
    with sock:
        socket.send_fds(sock, [b"{not json\n"], [0, 1, 2])
        assert warm_pool.read_line(sock)[0] == {"refused": "an empty request"}
    after = launch(tmp_path, pool[0], "print('served')")
    assert after.communicate(timeout=30)[0] == "served\n"


def test_two_messages_in_one_read_are_two_messages():
    """A worker that exits at once: its pid and its exit code reach the launch in one read.
    They were once parsed as one bad line, and the launch then started the worker again, cold
    (seen in test_the_pool_serves_launches_side_by_side: "2\\nstarted cold", exit 0)."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b'{"pid": 41}\n{"exit": 2}\n')
        pending = bytearray()
        assert warm_pool.read_line(b, pending=pending)[0] == {"pid": 41}
        assert warm_pool.read_line(b, pending=pending)[0] == {"exit": 2}
        a.close()
        assert warm_pool.read_line(b, pending=pending)[0] is None


EXIT_ON_FILE = """
    import os, sys, time
    open("pid.tmp", "w").write(str(os.getpid()))
    os.rename("pid.tmp", "pid")
    while not os.path.exists("go"):
        time.sleep(0.02)
    sys.exit(5)
"""


def test_a_pool_killed_mid_job_costs_its_workers_nothing(tmp_path, pool):
    """The OOM killer takes the pool: its running workers keep their launches, report their
    own exit codes, and still die with their launch process."""
    reporting = launch(tmp_path, pool[0], EXIT_ON_FILE, name="reporting")
    first = worker_pid(tmp_path, reporting)
    (tmp_path / "pid").unlink()
    killed = launch(tmp_path, pool[0], PID_THEN_WAIT, name="killed")
    second = psutil.Process(worker_pid(tmp_path, killed))
    pool[1].kill()
    pool[1].wait(10)
    assert psutil.pid_exists(first) and second.is_running(), "the workers died with the pool"
    (tmp_path / "go").touch()
    assert reporting.wait(20) == 5, reporting.communicate()
    killed.kill()  # as Horovod ends a slot; the pool is not there to end the worker
    killed.wait(10)
    second.wait(10)  # raises TimeoutExpired if it lives on


def test_a_launch_closing_after_its_worker_was_reaped_is_not_an_error(tmp_path):
    """One `select` can report a worker's exit and its launch's close together; the exit is
    handled first and reaps the worker. The close must then be nothing: it was a KeyError that
    ended the pool (CI, four launches exiting at once), and every later launch started cold."""
    from hvd_resilient.launch.warm.pool_server import Pool

    pool = Pool(str(tmp_path / "p" / "warm-pool.sock"))
    try:
        pool._launch_gone(os.getpid() + 1_000_000)  # a pid the pool no longer holds
    finally:
        pool.listener.close()


def test_a_worker_that_ends_before_the_pool_tells_its_pid_is_not_run_again(tmp_path,
                                                                            monkeypatch):
    """The forked worker holds the launch's connection and says its exit code itself; one
    that ends at once can say it before the pool has sent its pid (seen in CI on two busy
    cores). The launch exits with that code: it used to take it for a refusal and run the
    worker a second time, cold."""
    import threading

    path = str(tmp_path / "pool.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def pool_whose_worker_was_quicker() -> None:
        conn, _ = listener.accept()
        with conn:
            header, fds = warm_pool.read_line(conn, fds=3)
            for fd in fds:
                os.close(fd)
            assert header is not None and header["argv"] == ["python", "w.py"]
            for message in ({"exit": 3}, {"pid": 12345}, {"exit": 3}):
                warm_pool.send(conn, message)

    server = threading.Thread(target=pool_whose_worker_was_quicker, daemon=True)
    server.start()
    monkeypatch.setenv(warm_pool.SOCKET_ENV, path)
    monkeypatch.setattr(warm_pool, "default_socket", lambda: path)
    try:
        with pytest.raises(SystemExit) as ended:
            warm_pool.run_in_pool(["python", "w.py"], mode="script")
        assert ended.value.code == 3
    finally:
        server.join(10)
        listener.close()
