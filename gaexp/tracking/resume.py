"""Resume: the protocol key that says two runs computed the same thing, the FINISHED run a cell skips on, the runs
still live elsewhere, a resumed sweep's runs counted, and stale runs (their process or SLURM job gone) marked KILLED.
Whether a process or job still runs is asked of gaexp/liveness.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from typing import Any, Mapping

from mlflow.entities import Run, RunStatus
from mlflow.tracking import MlflowClient

from gaexp import liveness
from gaexp.config import protocol_part
from gaexp.tags import (ARITHMETIC_KEY, ERROR, HEARTBEAT, HOST, KILLED_REASON, PROCESS_START, PROTOCOL_KEY, SAME_AS, SLURM_JOB,
                        SWEEPS, filter_equals)
from gaexp.tracking.search import search_all, sweeps_of

log = logging.getLogger("gaexp.app")  # the application log, one name across its modules


def protocol_key(resolved: Mapping[str, Any]) -> str:
    """A stable digest of everything that can change a run's result: the config without its runtime keys."""
    kept = protocol_part(resolved)
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def find_finished(client: MlflowClient, experiment_id: str, key: str) -> Run | None:
    """A FINISHED run of the same protocol, if any (the oldest one)."""
    runs = client.search_runs([experiment_id], f"{filter_equals(PROTOCOL_KEY, key)} and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time ASC"], max_results=1)
    return runs[0] if runs else None


def recorded_process(run: Run) -> tuple[str, str, float]:
    """The host and pid a run recorded (tag HOST, `host:pid`) and its last heartbeat (its start, without one)."""
    host, _, pid = run.data.tags.get(HOST, ":").rpartition(":")
    return host, pid, float(run.data.tags.get(HEARTBEAT, run.info.start_time / 1000))


def live_runs(client: MlflowClient, experiment_id: str, key: str, stale_after_s: float,
              now: float | None = None, tag: str = PROTOCOL_KEY) -> list[Run]:
    """The RUNNING runs of the same protocol whose process still runs on this host (another process than this
    one) with a heartbeat younger than `stale_after_s`: a cell that a killed sweep's worker may still train."""
    now = time.time() if now is None else now
    live = []
    for run in client.search_runs([experiment_id], f"{filter_equals(tag, key)} and attributes.status = 'RUNNING'"):
        tags = run.data.tags
        host, pid, beat = recorded_process(run)
        if (host == socket.gethostname() and pid.isdigit() and int(pid) != os.getpid() and now - beat <= stale_after_s
                and liveness.process_alive(int(pid), tags.get(PROCESS_START))):
            live.append(run)
    return live


def wait_for_live_runs(client: MlflowClient, experiment_id: str, key: str, stale_after_s: float,
                       poll_s: float = 1.0, tag: str = PROTOCOL_KEY) -> list[str]:
    """Wait while a run of the same protocol (`tag`: or of the same arithmetic, ARITHMETIC_KEY) runs in another live
    process on this host (`live_runs`), so that a cell is never trained twice at once; returns the names of the runs
    waited for."""
    waited: list[str] = []
    while runs := live_runs(client, experiment_id, key, stale_after_s, tag=tag):
        for run in runs:
            if run.info.run_name not in waited:
                waited.append(run.info.run_name)
                log.info("%s: waiting for its run %s, RUNNING in process %s", run.info.run_name, run.info.run_id,
                         run.data.tags[HOST])
        time.sleep(poll_s)
    return waited


def shared_source(client: MlflowClient, experiment_id: str, key: str, stale_after_s: float) -> Run | None:
    """The FINISHED run that computed the steps of arithmetic key `key` (gaexp/engine.py `arithmetic_key`), once
    a run of that key still training in another live process here has ended; None: no run computed them yet. A run
    that itself shared them points to the one that computed them (SAME_AS)."""
    wait_for_live_runs(client, experiment_id, key, stale_after_s, tag=ARITHMETIC_KEY)
    runs = client.search_runs([experiment_id], f"{filter_equals(ARITHMETIC_KEY, key)} and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time ASC"], max_results=1)
    if not runs:
        return None
    source = runs[0].data.tags.get(SAME_AS)
    return runs[0] if source is None else client.get_run(source)


def add_to_sweep(client: MlflowClient, run: Run, sweep_id: str) -> None:
    """Count a FINISHED run, skipped on resume, as part of `sweep_id` too (its own sweep_id stays)."""
    sweeps = sweeps_of(run)
    if sweep_id not in sweeps:
        client.set_tag(run.info.run_id, SWEEPS, ",".join([*sweeps, sweep_id]))


def mark_stale_runs(client: MlflowClient, experiment_id: str, stale_after_s: float,
                    now: float | None = None) -> list[str]:
    """Mark RUNNING runs whose process is gone KILLED, so nobody reads them as results.

    A run is stale when its SLURM job has ended (`sacct`, where the run ran in one), when its
    process on this host no longer exists, or when its heartbeat (refreshed at each evaluation)
    is older than `stale_after_s` at `now` (default: the current time).
    """
    now = time.time() if now is None else now
    marked = []
    for run in search_all(client, [experiment_id], "attributes.status = 'RUNNING'"):
        tags = run.data.tags
        host, pid, beat = recorded_process(run)
        ended = liveness.slurm_job_end(tags[SLURM_JOB]) if SLURM_JOB in tags else None
        if ended:
            reason = f"SLURM job {tags[SLURM_JOB]} ended {ended}"
        elif (host == socket.gethostname() and pid.isdigit()
              and not liveness.process_alive(int(pid), tags.get(PROCESS_START))):
            reason = f"process {pid} on {host} is gone"
        elif now - beat > stale_after_s:
            reason = f"no heartbeat for {now - beat:.0f} s"
        else:
            continue
        client.set_tag(run.info.run_id, KILLED_REASON, reason)
        client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.KILLED))
        marked.append(f"{run.info.run_name} ({reason})")
    return marked


def fail_runs_of(client: MlflowClient, experiment_id: str, pid: int, reason: str) -> list[str]:
    """End FAILED, with `reason` as the error, the RUNNING runs that process `pid` on this host left when it died
    (a launcher's worker killed in its cell); returns their names."""
    failed = []
    for run in search_all(client, [experiment_id],
                          f"attributes.status = 'RUNNING' and {filter_equals(HOST, f'{socket.gethostname()}:{pid}')}"):
        client.set_tag(run.info.run_id, ERROR, reason)
        client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.FAILED))
        failed.append(run.info.run_name)
    return failed
