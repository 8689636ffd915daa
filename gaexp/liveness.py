"""Whether what ran a run still runs: a process on this host (pid and start time, from /proc) and a SLURM job
(its environment, and the cluster's accounting through `sacct`); and a launcher's worker watching the sweep's
process, to stop with it (`SweepWatch`); and the signals that end a command as Ctrl-C does (`ending_as_ctrl_c`:
SIGTERM from a scheduler's time limit, `timeout` or `systemctl stop`, SIGHUP from a closed terminal). No MLflow
here: gaexp/tracking/ records these and marks the runs whose process is gone."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

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


OOM_EVENTS = Path("/sys/fs/cgroup/memory.events")  # cgroup v2: `oom_kill N`, the processes its OOM killer ended


def oom_kills(events: Path = OOM_EVENTS) -> int | None:
    """How many processes the kernel's out-of-memory killer has ended in this cgroup; None where unreadable."""
    try:
        lines = events.read_text().splitlines()
    except OSError:
        return None
    counts = dict(line.split() for line in lines if len(line.split()) == 2)
    return int(counts["oom_kill"]) if counts.get("oom_kill", "").isdigit() else None


def death(exitcode: int | None, held: int | None = None, oom_killed: bool = False) -> str:
    """Why a worker process ended without a result, from its exit code (-N: signal N): `killed by SIGKILL, holding
    1.2 GiB` and, for SIGKILL, who sends it (the kernel's OOM killer, when its count went up meanwhile)."""
    if exitcode is None:
        what = "ended (its exit code unknown)"
    elif exitcode < 0:
        try:
            what = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            what = f"killed by signal {-exitcode}"
    else:
        what = f"exited with status {exitcode}"
    if held:
        what += f", holding {held / 2**30:.1f} GiB"
    if exitcode == -signal.SIGKILL:
        what += (" (the kernel's out-of-memory killer)" if oom_killed
                 else " (the kernel's out-of-memory killer sends it, as does `kill -9`)")
    elif exitcode == -signal.SIGSEGV:
        what += " (a crash in native code: torch, a driver, a C extension)"
    return what


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (its children, theirs, ...), from /proc's parent ids; [] without /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


ENDING = (signal.SIGTERM, signal.SIGHUP)  # what a scheduler, `timeout`, systemd and a closed terminal send
GRACE_S = 10  # how long the workers, told as Ctrl-C tells them, have to end their cells' runs before this stops
_ended: int | None = None  # the signal that is ending this command, once one is


class Ended(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised as Ctrl-C's KeyboardInterrupt is (so the same code ends the runs KILLED and says
    how many cells finished), with the signal for the exit status (128 + it: 143, 129)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def ended() -> int | None:
    """The signal ending this command (SIGTERM, SIGHUP), None while none has: whatever is raised after it (a
    worker's KeyboardInterrupt sent back, a pool broken by the end) is that end, said as such."""
    return _ended


def exit_status(e: BaseException) -> int:
    """The status a shell reports for a command this ended: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP."""
    return 128 + (getattr(e, "signum", None) or _ended or signal.SIGINT)


def _raise_ended(signum: int, frame: object) -> None:
    raise Ended(_ended or signum)


def _end(signum: int, frame: object) -> None:
    """The workers below this process are told as a terminal's Ctrl-C tells them (SIGINT): each ends its cell's run
    KILLED and sends the interrupt back, which ends this process as Ctrl-C does. Without workers this process
    raises Ended at once, and otherwise after GRACE_S if nothing came back by then (SIGALRM)."""
    global _ended
    _ended = signum
    workers = descendants(os.getpid())
    for pid in workers:
        try:
            os.kill(pid, signal.SIGINT)
        except OSError:
            pass
    if not workers:
        raise Ended(signum)
    signal.signal(signal.SIGALRM, _raise_ended)
    signal.alarm(GRACE_S)


@contextmanager
def ending_as_ctrl_c() -> Iterator[None]:
    """SIGTERM and SIGHUP end what runs inside as Ctrl-C does (`Ended`); the handlers before are put back after.
    Only in the main thread, where Python runs signal handlers."""
    global _ended
    _ended = None  # kept after: what catches the end outside says it with its signal
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in (*ENDING, signal.SIGALRM)}  # SIGALRM: _end may set it
    for s in ENDING:
        signal.signal(s, _end)
    try:
        yield
    finally:
        signal.alarm(0)
        for s, handler in before.items():
            signal.signal(s, handler)


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


# --- a sweep's cells die with it ---------------------------------------------------------------------------

SWEEP_PROCESS = "GAEXP_SWEEP_PROCESS"  # environment: `host:pid:start` of the process that launches a sweep's cells


def this_process() -> str:
    """This process as SWEEP_PROCESS names it, for the processes it starts."""
    return f"{socket.gethostname()}:{os.getpid()}:{process_start(os.getpid()) or ''}"


def launching_process(environ: Mapping[str, str] = os.environ) -> tuple[int, str | None] | None:
    """(pid, start) of the process that launched this one's cell, where it runs on this host and is another
    process than this one (a launcher's worker: joblib's, Ray's); None otherwise (a cell in the launching process
    itself, a SLURM job on another node, a process no sweep launched)."""
    host, _, rest = environ.get(SWEEP_PROCESS, "").partition(":")
    pid, _, start = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return None
    return int(pid), start or None


class SweepWatch:
    """Whether the process that launched this worker's cells still runs, asked every `poll_s` from a daemon
    thread. Once it is gone (killed with SIGKILL, say, which its workers never hear of): `gone` is true, so the
    cell training here stops at its next step (gaexp/hooks.py `StopWhenSweepGone`) and ends its run KILLED,
    and this worker process exits as soon as no cell runs in it, or after `grace_s` whatever it does, instead
    of finishing its cells for nobody and idling for minutes as an orphan, while a rerun trains them again."""

    def __init__(self, pid: int, started: str | None, poll_s: float = 1.0, grace_s: float = 120.0) -> None:
        self.pid, self.started, self.poll_s, self.grace_s = pid, started, poll_s, grace_s
        self.gone, self.cells = False, 0
        self.lock = threading.Lock()
        threading.Thread(target=self._watch, name="gaexp-sweep-watch", daemon=True).start()

    @property
    def reason(self) -> str:
        return f"the sweep's process {self.pid} is gone"

    def _watch(self) -> None:
        while process_alive(self.pid, self.started):
            time.sleep(self.poll_s)
        self.gone = True
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:
            with self.lock:
                if not self.cells:
                    os._exit(1)
            time.sleep(self.poll_s)
        os._exit(1)

    @contextmanager
    def running_cell(self) -> Iterator[None]:
        """A cell runs in this process: once it ends, a worker whose sweep is gone exits."""
        with self.lock:
            self.cells += 1
        try:
            yield
        finally:
            with self.lock:
                self.cells -= 1
                if self.gone and not self.cells:
                    os._exit(1)


_watch: SweepWatch | None = None


def sweep_watch(environ: Mapping[str, str] = os.environ) -> SweepWatch | None:
    """This process's SweepWatch, started on first use, where a sweep's process launched it on this host."""
    global _watch
    if _watch is None and (launcher := launching_process(environ)) is not None:
        _watch = SweepWatch(*launcher)
    return _watch
