"""hydra_plugins/gaexp_grid_sweeper/task_watch.py, launch=local's watched task, in real processes: the record of
how the cell's process ended, the signals passed on from the controller (this test's process) and not from
others, and the cell's process ending with the watcher. (The local sweep with a task killed in its cell:
tests/test_joblib_launcher.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from gaexp import liveness
from hydra_plugins.gaexp_grid_sweeper.task_watch import read_record

CHILD = '''
import os, signal, sys, time
from pathlib import Path

folder = Path(sys.argv[1])
def caught(signum, frame):
    (folder / "caught").open("a").write(signal.Signals(signum).name + "\\n")
    if signum != signal.SIGHUP:
        sys.exit(0)
for s in (signal.SIGINT, signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, caught)
(folder / "ready").write_text(str(os.getpid()))
while True:
    time.sleep(0.05)
'''


@pytest.fixture
def watched(tmp_path):
    """watched(*command): the watcher over `command`, as submitit's controller starts it (this process its
    parent), job 7 task 0; it and its child killed after the test, whatever the test saw."""
    started = []

    def start(*command: str) -> subprocess.Popen:
        env = {**os.environ, "SUBMITIT_LOCAL_JOB_ID": "7", "SUBMITIT_LOCAL_GLOBALID": "0"}
        started.append(subprocess.Popen([sys.executable, "-m", "hydra_plugins.gaexp_grid_sweeper.task_watch",
                                         str(tmp_path / "records"), *command], env=env))
        return started[-1]
    yield start
    for watcher in started:
        for pid in [*liveness.descendants(watcher.pid), watcher.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        watcher.wait()


def gone(pid: int) -> bool:
    """Not running: ended, or a zombie that whoever adopted it has not reaped yet (a container's first process
    may never)."""
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return not liveness.process_alive(pid)


def ready_child(tmp_path, watched) -> tuple[subprocess.Popen, int]:
    (tmp_path / "child.py").write_text(CHILD)
    watcher = watched(sys.executable, str(tmp_path / "child.py"), str(tmp_path))
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert time.monotonic() < deadline and watcher.poll() is None, "the child never got ready"
        time.sleep(0.05)
    return watcher, int((tmp_path / "ready").read_text())


@pytest.mark.parametrize("code, status, said", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 128 + signal.SIGKILL, "killed by SIGKILL"),
    ("import ctypes; ctypes.string_at(0)", 128 + signal.SIGSEGV, "killed by SIGSEGV"),
    ("raise SystemExit(3)", 3, "exited with status 3")])
def test_the_record_says_how_the_cells_process_ended(tmp_path, watched, code, status, said):
    watcher = watched(sys.executable, "-c", code)
    assert watcher.wait(timeout=60) == status
    record = read_record(tmp_path / "records", "7")
    assert liveness.death(record["exitcode"]).startswith(said)
    assert record["pid"] != watcher.pid and gone(record["pid"])
    assert read_record(tmp_path / "records", "8") == {}  # a job whose task never started


def test_without_sigtimedwait_the_watcher_becomes_the_task_and_records_nothing(tmp_path):
    """macOS's Python has no sigtimedwait: the task runs as under submitit alone, its status its own."""
    run = ("import runpy, signal, sys; del signal.sigtimedwait; "
           f"sys.argv = ['task_watch', {str(tmp_path / 'records')!r}, sys.executable, '-c', 'raise SystemExit(5)']; "
           "runpy.run_module('hydra_plugins.gaexp_grid_sweeper.task_watch', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SUBMITIT_LOCAL_JOB_ID": "7"})
    assert done.returncode == 5, done.stderr[-2000:]
    assert read_record(tmp_path / "records", "7") == {}


@pytest.mark.parametrize("signum", [signal.SIGUSR2, signal.SIGINT, signal.SIGTERM])
def test_the_controllers_signals_reach_the_cell(tmp_path, watched, signum):
    """submitit's controller sends SIGUSR2 at its timeout, SIGINT to cancel, and passes SIGTERM on."""
    watcher, _ = ready_child(tmp_path, watched)
    watcher.send_signal(signum)
    assert watcher.wait(timeout=60) == 0
    assert (tmp_path / "caught").read_text() == signal.Signals(signum).name + "\n"


def test_a_ctrl_c_sent_to_every_process_reaches_the_cell_once(tmp_path, watched):
    """A terminal's Ctrl-C and gaexp.liveness's SIGINT to each process below a sweep reach the cell directly:
    the watcher, told too, by another process than its parent, does not pass it on a second time."""
    watcher, child = ready_child(tmp_path, watched)
    subprocess.run(["kill", "-HUP", str(watcher.pid)], check=True)  # another process: not passed on
    subprocess.run(["kill", "-INT", str(watcher.pid)], check=True)
    time.sleep(1.5)  # the watcher's loop wakes each second at the latest
    assert not (tmp_path / "caught").exists() and watcher.poll() is None
    os.kill(child, signal.SIGINT)
    assert watcher.wait(timeout=60) == 0
    assert (tmp_path / "caught").read_text() == "SIGINT\n"


def test_the_cell_ends_with_its_watcher(tmp_path, watched):
    """submitit's controller SIGKILLs a task still there a second after its SIGINT: the cell goes with it."""
    watcher, child = ready_child(tmp_path, watched)
    watcher.kill()
    watcher.wait(timeout=60)
    deadline = time.monotonic() + 30
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(child)
