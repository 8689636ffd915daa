"""Whether what ran a run still runs: a process on this host (pid and start time, from /proc) and a SLURM job
(its environment, and the cluster's accounting through `sacct`). No MLflow here: gaexp/tracking.py records
these and marks the runs whose process is gone."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Mapping

SLURM_LIVE = ("PENDING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED", "CONFIGURING", "COMPLETING")


def process_start(pid: int) -> str | None:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat, field 22): with the pid, it names
    one process for good, as a pid alone does not once the system reuses it. None without such a process, or
    without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # the fields after the command name start at field 3


def process_alive(pid: int, started: str | None = None) -> bool:
    """Whether process `pid` still runs; given when it `started` (`process_start`, recorded with the run),
    whether it is still that process: a pid given to a new process since counts as gone."""
    if started is not None and (now := process_start(pid)) is not None:
        return now == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def slurm_job(environ: Mapping[str, str] = os.environ) -> str | None:
    """The SLURM job this process runs in (`JOB_TASK` for a task of an array), or None outside SLURM."""
    if "SLURM_ARRAY_JOB_ID" in environ and "SLURM_ARRAY_TASK_ID" in environ:
        return f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    return environ.get("SLURM_JOB_ID")


def slurm_job_end(job: str) -> str | None:
    """How a SLURM job ended (CANCELLED, FAILED, TIMEOUT, NODE_FAIL, ...) as the cluster's accounting tells
    it; None while it is queued or running, or where `sacct` is missing or does not know the job."""
    sacct = shutil.which("sacct")
    if sacct is None:
        return None
    try:
        proc = subprocess.run([sacct, "-n", "-X", "-P", "-j", job, "-o", "State"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    states = proc.stdout.split("\n")[0].split() if proc.returncode == 0 else []  # e.g. "CANCELLED by 0"
    return states[0] if states and states[0] not in SLURM_LIVE else None
