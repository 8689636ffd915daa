"""launch=local's task, watched: `python -m hydra_plugins.gaexp_grid_sweeper.task_watch RECORDS COMMAND...` runs
COMMAND (submitit's task: the cell) as its child and records in RECORDS, as `<job id>_<task>.json`, the child's
pid when it starts and its exit status when it ends (-N: killed by signal N).

submitit's local controller starts each task and exits 0 however the task ended, so a cell the kernel killed
(out of memory, a segfault) left no trace of why. The LocalLauncher (submitit_launcher.py) reads the record to
fail that cell alone, naming the signal, and samples the pid's memory meanwhile. The signals the controller
sends (its cancel's SIGINT, its timeout's SIGUSR2, SIGTERM) are passed on. A terminal's Ctrl-C, and the SIGINT a
sweep ending on SIGTERM sends to every process below it (gaexp.liveness), reach the child directly: not twice.
The child dies with this process (PR_SET_PDEATHSIG), as it did with the controller's SIGKILL before. Only the
standard library: it starts before each cell. Where Python has no sigtimedwait (macOS), it becomes the task
(exec) and records nothing.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
REACH_THE_CHILD = (signal.SIGINT, signal.SIGHUP)  # a terminal's, and gaexp.liveness's, go to every process
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def record_path(records: Path, job_id: str, task: int | str) -> Path:
    """The record of submitit local job `job_id`'s task `task` (SUBMITIT_LOCAL_JOB_ID, _GLOBALID)."""
    return Path(records) / f"{job_id}_{task}.json"


def read_record(records: Path, job_id: str, task: int | str = 0) -> dict:
    """{"pid": ..., "exitcode": ...} as the watcher wrote them; {} where it wrote none (never started)."""
    try:
        return json.loads(record_path(records, job_id, task).read_text())
    except (OSError, ValueError):
        return {}


def write_record(path: Path, record: dict) -> None:
    part = path.with_suffix(".part")
    part.write_text(json.dumps(record))
    os.replace(part, path)


def child_setup() -> None:
    """In the child before it runs: the signals blocked here unblocked; killed when this process dies."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (*PASSED_ON, signal.SIGCHLD))
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the controller's SIGKILL reaches this process only
        pass


def watch(records: Path, command: List[str]) -> int:
    if not hasattr(signal, "sigtimedwait"):  # macOS: no sender to tell the signals apart; the task runs unwatched,
        os.execv(command[0], command)  # as under submitit alone (its death a cell failed without its signal)
    path = record_path(records, os.environ.get("SUBMITIT_LOCAL_JOB_ID", str(os.getppid())),
                       os.environ.get("SUBMITIT_LOCAL_GLOBALID", "0"))
    path.parent.mkdir(parents=True, exist_ok=True)
    signal.pthread_sigmask(signal.SIG_BLOCK, (*PASSED_ON, signal.SIGCHLD))  # taken by sigtimedwait below
    child = subprocess.Popen(command, preexec_fn=child_setup)
    write_record(path, {"pid": child.pid})
    code: Optional[int] = None
    while code is None:
        info = signal.sigtimedwait((*PASSED_ON, signal.SIGCHLD), 1.0)
        if info is not None and info.si_signo != signal.SIGCHLD and (
                info.si_pid == os.getppid() or info.si_signo not in REACH_THE_CHILD):
            child.send_signal(info.si_signo)
        code = child.poll()
    write_record(path, {"pid": child.pid, "exitcode": code})
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(watch(Path(sys.argv[1]), sys.argv[2:]))
