"""The warm pool: one process per machine that imported what a worker needs, forking standbys.

    python -m hvd_resilient.launch.warm.pool_server [--socket PATH] [-- COMMAND...]

It imports what a standby imports (torch, torch._dynamo, Horovod, ours) and, given the
training command, what its script imports; then it listens on a Unix socket only its own user
may use. Each launch that connects (`pool.py`, the launch side) hands over its command,
environment, folder and standard streams; the pool forks a child that takes them on and runs
the standby's wait-for-release and the script, or the script at once when the launch asks for
it (an mpirun rank, `warm/mpirun.py`), with nothing left to import.

Why fork and not a pool of idle workers: a fork costs a few milliseconds and any number of
slots can be served, the workers share the imported pages, and no worker exists for a world
that never forms. Forking is safe while this process has no threads of its own and has not
initialized CUDA: nothing here does (checked before each fork; a pool that finds CUDA
initialized refuses, and the launch starts cold).

A worker lives exactly as long as the launch that asked for it: it kills itself when that
connection closes (its launch process died or was killed, as Horovod kills a slot), and so
does the pool; the worker tells the launch its exit code, and the pool tells it again, or
the signal that ended the worker. So a pool that dies mid-job costs its running workers
nothing: they keep their launches, end with them, and report how they ended. The pool ends
with the driver that started it, or on SIGTERM.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable

from hvd_resilient.launch.warm import pool as warm_pool
from hvd_resilient.launch.warm import standby
from hvd_resilient.launcher_env import FORKED_ENV

logger = logging.getLogger("hvd_resilient.launch.warm.pool_server")  # run as __main__

HEADER_TIMEOUT_S = 5.0


def warm_up(cmd: list[str]) -> None:
    from hvd_resilient.launch.warm.imports import import_script_modules, settle_heap

    standby.warm_up()
    if len(cmd) >= 2 and not cmd[1].startswith("-"):
        import_script_modules(cmd[1])
    settle_heap()  # before any fork


def refusal(header: dict, peer: tuple[int, int]) -> str:
    """Why this pool will not run a launch's command ("" when it will)."""
    pid, uid = peer
    if uid != os.getuid():
        return f"uid {uid} is not this pool's"
    theirs, ours = warm_pool.network_namespace(pid), warm_pool.network_namespace()
    if not theirs or theirs != ours:
        return f"a launch from another network namespace ({theirs or 'unknown'})"
    if header.get("python") != warm_pool.this_python():
        return f"another Python ({header.get('python')})"
    if not isinstance(header.get("argv"), list) or not isinstance(header.get("env"), dict):
        return "a malformed request"
    if header.get("mode", "standby") not in ("standby", "script"):
        return f"an unknown mode {header.get('mode')!r}"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA initialized in the pool (no fork)"
    if "mpi4py.MPI" in sys.modules:
        return "MPI initialized in the pool (no fork)"
    return ""


class Pool:
    """The listening pool; `run(cmd)` is what a forked standby does (the standby's
    wait-for-release, then the script); a launch in "script" mode runs its script at once."""

    def __init__(self, path: str, run: Callable[[list[str]], None] = standby.released_run
                 ) -> None:
        self.path = path
        self.run = run
        self.sel = selectors.DefaultSelector()
        self.workers: dict[int, tuple[socket.socket, int]] = {}  # pid -> (conn, pidfd)
        self.listener = self._listen(path)
        self.stopping = False

    @staticmethod
    def _listen(path: str) -> socket.socket:
        folder = os.path.dirname(path)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a pool that died left it; nobody listens there
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        os.chmod(path, 0o600)
        s.listen(64)
        return s

    def serve(self) -> None:
        self.sel.register(self.listener, selectors.EVENT_READ, ("listen", None))
        while not self.stopping or self.workers:
            for key, _ in self.sel.select(timeout=1.0):
                kind, pid = key.data
                if kind == "listen":
                    self._accept()
                elif kind == "exited":
                    self._reap(pid)
                else:  # the launch's connection: readable means it closed
                    self._launch_gone(pid)
        self.listener.close()  # `stop` removed its path already

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(HEADER_TIMEOUT_S)
        try:
            header, fds = warm_pool.read_line(conn, fds=3)
        except OSError:
            conn.close()
            return
        if header is not None and header.get("ping"):
            for fd in fds:
                os.close(fd)
            conn.close()  # a launcher checking that the pool listens
            return
        try:
            why = "a request without its streams" if len(fds) != 3 else (
                refusal(header or {}, warm_pool.peer(conn)) if header else "an empty request")
            if why:
                logger.warning("warm pool: refused %s", why)
                with contextlib.suppress(OSError):
                    warm_pool.send(conn, {"refused": why})
                conn.close()
                return
            assert header is not None
            pid = self._fork(conn, fds, header)
        finally:
            for fd in fds:
                os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.workers[pid] = (conn, pidfd)
        self.sel.register(pidfd, selectors.EVENT_READ, ("exited", pid))
        self.sel.register(conn, selectors.EVENT_READ, ("launch", pid))
        with contextlib.suppress(OSError):  # a launch gone already: seen as its close next
            warm_pool.send(conn, {"pid": pid})

    def _fork(self, conn: socket.socket, fds: list[int], header: dict) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._become_worker(conn, fds, header)  # never returns
        return pid

    def _become_worker(self, conn: socket.socket, fds: list[int], header: dict) -> None:
        code, script = 1, header.get("mode") == "script"
        try:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            keep = conn.fileno()  # held open: the launch sees it close when this worker ends
            for key in list(self.sel.get_map().values()):
                if key.fd not in (keep, self.listener.fileno()):
                    os.close(key.fd)  # the other workers' connections and exit watches
            self.listener.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            os.chdir(header["cwd"])
            os.environ.clear()
            os.environ.update(header["env"])
            os.environ[FORKED_ENV] = str(os.getpid())
            # as `python` would have set them up: the script's folder (run_in_process) or the
            # launch's for -m, then PYTHONPATH; logging unconfigured, so that the script's own
            # basicConfig is not a no-op
            extra = [p for p in header["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
            sys.path[0] = header["cwd"]
            sys.path[1:1] = [p for p in extra if p not in sys.path]
            logging.root.handlers.clear()
            logging.root.setLevel(logging.WARNING)
            _die_with_launch(conn)
            (standby.run_in_process if script else self.run)(list(header["argv"]))
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - the worker's traceback, as Python prints it
            traceback.print_exc()
        finally:
            if script:  # as the interpreter's exit would (os._exit below skips it)
                with contextlib.suppress(Exception):
                    atexit._run_exitfuncs()
                _finalize_mpi()
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            with contextlib.suppress(Exception):  # the pool says it again, if it is alive
                warm_pool.send(conn, {"exit": code})
            os._exit(code)

    def _reap(self, pid: int) -> None:  # the worker told its own exit unless a signal ended it
        conn, pidfd = self.workers.pop(pid)
        _, status = os.waitpid(pid, 0)
        for fileobj in (pidfd, conn):
            with contextlib.suppress(KeyError):  # the connection is gone already if it closed
                self.sel.unregister(fileobj)
        os.close(pidfd)
        with contextlib.suppress(OSError):
            warm_pool.send(conn, {"exit": os.waitstatus_to_exitcode(status)})
        conn.close()

    def _launch_gone(self, pid: int) -> None:
        """The launch process closed its end: it died or was killed; so does its worker. One
        `select` can report a worker's exit and its launch's close together: the exit, handled
        first, has reaped the worker (a KeyError here ended the pool, seen in CI with four
        launches that exit at once)."""
        if pid not in self.workers:
            return
        conn, _ = self.workers[pid]
        self.sel.unregister(conn)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def stop(self, *_: object) -> None:
        """Takes no new launches; the workers it runs end with their launches."""
        self.stopping = True
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(self.listener)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _finalize_mpi() -> None:
    """mpi4py finalizes MPI at the interpreter's exit from C (`Py_AtExit`), which `os._exit`
    skips, and mpirun takes a rank that ends without MPI_Finalize for a failed one ("exiting
    improperly"): the job would fail at its end."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return
    with contextlib.suppress(Exception):
        if mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()


def _die_with_launch(conn: socket.socket) -> None:
    """A forked worker ends when its launch does, even when this pool is gone: the pool kills
    it on the launch's hang-up, but a pool that was killed itself (the OOM killer, an operator)
    leaves workers whose launch Horovod may kill later (an eviction, the job's end), and
    nothing else would end them. The launch never writes after its request, so anything
    readable on the connection is its hang-up. A daemon thread: this child may have them."""
    import threading

    def watch() -> None:
        conn.settimeout(None)
        with contextlib.suppress(OSError):
            while conn.recv(4096):
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="hvdr-launch-watch", daemon=True).start()


READY_TIMEOUT_S = 120.0


class Started:
    """A pool this process started for its own machine (the driver's); it ends with it."""

    def __init__(self, cmd: list[str]) -> None:
        import subprocess
        import tempfile

        from hvd_resilient.die_with_parent import die_with_parent

        self.folder = tempfile.mkdtemp(prefix="hvdr-pool-")
        self.path = os.path.join(self.folder, "warm-pool.sock")
        parent = os.getpid()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hvd_resilient.launch.warm.pool_server", "--quiet",
             "--socket", self.path, "--", *cmd],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            preexec_fn=lambda: die_with_parent(parent))

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        """Whether the pool listens (its imports done) before it ended or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            if warm_pool.alive(self.path):
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        import shutil

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except Exception:  # noqa: BLE001 - it ends with this process anyway
                self.proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def hold(cmd: list[str], env: dict[str, str]) -> Started | None:
    """This machine's warm pool, held by `hvd-resilient run` across launches: mpirun relaunches
    every rank after a failure, and a relaunched horovodrun driver every worker; both fork this
    machine's ranks from it with their imports done (`warm/mpirun.py`, the standby stand-in).
    Held by the driver, Horovod's pool died with it, and a relaunch started cold. Ready before
    the first launch: its imports are the ones the ranks would do, once. Its socket goes into
    ``env`` (mpirun forwards it with -x; the driver's environment has it). None: a pool that
    did not come up (the ranks start cold). Whether a launch wants one at all is its
    launcher's call (`Launcher.wants_warm_pool`)."""
    pool = Started(cmd)
    if not pool.wait_ready():
        pool.stop()
        return None
    env[warm_pool.SOCKET_ENV] = pool.path
    return pool


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hvd_resilient.launch.warm.pool_server",
                                description=__doc__.splitlines()[0])
    p.add_argument("--socket", default=warm_pool.default_socket(),
                   help="where to listen (default: %(default)s, where launches look)")
    p.add_argument("--quiet", action="store_true", help="warnings only")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the training command: its script's imports are done ahead too")
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    t0 = time.monotonic()
    warm_up(cmd)
    try:
        pool = Pool(args.socket)
    except OSError as e:
        sys.exit(f"hvd-resilient warm pool: cannot listen on {args.socket}: {e}")
    signal.signal(signal.SIGTERM, pool.stop)
    signal.signal(signal.SIGINT, pool.stop)
    logger.info("warm pool ready at %s after %.1f s of imports", args.socket,
                time.monotonic() - t0)
    pool.serve()


if __name__ == "__main__":
    main()
