"""Horovod's worker middleman forked from a warm forkserver (`patches/fast_middleman.py`):
what `safe_shell_exec.execute` promises stays (prefixed output, the exit code, the exit event
ending the command) and the middleman is a child of the server, not of the driver. Run in a
fresh interpreter: the patch changes Horovod's module for the whole process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support.paths import ROOT

SCRIPT = textwrap.dedent("""
    import io, os, sys, threading, time
    from horovod.runner.common.util import safe_shell_exec
    from hvd_resilient.launch.horovod.patches import fast_middleman
    from hvd_resilient.launch.horovod.patches.context import PatchContext

    if __name__ == "__main__":
        fast_middleman.install(PatchContext())
        out, err = io.StringIO(), io.StringIO()
        # the shell's parent is the middleman; it prints the middleman's parent
        code = safe_shell_exec.execute("cut -d' ' -f4 /proc/$PPID/stat; echo oops >&2; exit 3",
                                       index=5, stdout=out, stderr=err)
        middleman_parent = int(out.getvalue().split(":", 1)[1])
        stop = threading.Event()
        threading.Timer(0.5, stop.set).start()
        t0 = time.monotonic()
        # a worker that stops on SIGTERM with 75 (a final checkpoint), under a shell that
        # takes a moment more to exit with its code: the moment Horovod's SIGTERM to the
        # shell used to land in (the slot then said 143, or 0 when psutil reaped it)
        worker = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: "
                  "sys.exit(75)); print('up', flush=True); time.sleep(60)")
        stopped = safe_shell_exec.execute(
            f'{sys.executable} -c "{worker}"; code=$?; sleep 0.5; exit $code',
            events=[stop], stdout=io.StringIO(), stderr=io.StringIO())
        print(code, out.getvalue().startswith("[5]<stdout>:"), repr(err.getvalue()),
              middleman_parent != os.getpid(), round(time.monotonic() - t0) < 30, stopped,
              sep="|")
""")


def test_the_middleman_keeps_horovod_s_contract_when_forked_from_the_server(tmp_path):
    path = tmp_path / "run.py"
    path.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    code, prefixed, err, not_ours, quick, stopped = r.stdout.strip().splitlines()[-1].split("|")
    assert (code, prefixed, err) == ("3", "True", repr("[5]<stderr>:oops\n")), r.stdout
    assert not_ours == "True", "the middleman was started by this process, not the server"
    assert quick == "True", "the exit event did not end the command"
    # `patches/shell_exit.py`: the worker's code, not its shell's SIGTERM (143) nor the 0 of a
    # shell reaped twice
    assert stopped == "75", r.stdout
