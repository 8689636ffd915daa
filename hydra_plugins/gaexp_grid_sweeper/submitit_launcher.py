"""Hydra's submitit launchers, waiting for every task (`launch=slurm`, `launch=local`: conf/launch/).

hydra-submitit-launcher collects the tasks' results in order and raises on the first task that ended without
one (submitit's UncompletedJobError: cancelled, out of time, node lost, killed), so the command stopped there
while the other tasks ran on, unreported. These launchers wait for every task, in the order they end, and turn
each task that ends without a result into a failed cell as soon as it has ended, as a cell that raises is one
(gaexp.app.main):

- a FAILED.txt in its job folder with the reason, which the failure summary lists
  (gaexp.callbacks.FailuresCallback): `SLURM job 1234_5 ended CANCELLED`; on this machine, `task 4321 killed by
  SIGKILL, holding 0.8 GiB (...)`, from what task_watch.py saw of the cell's process and this launcher sampled;
- its MLflow run, left RUNNING by the task: under SLURM marked KILLED with the reason as `gaexp.killed_reason`,
  at once, by gaexp.tracking.mark_stale_runs (the cluster's accounting), or by the state submitit saw where the
  accounting does not say yet; on this machine ended FAILED with the reason as its `error`
  (gaexp.tracking.fail_runs_of), as launch=joblib ends a killed worker's;
- nan as its return value, status COMPLETED, as gaexp.app.main returns for a failed cell.

The sweep then ends as any sweep with failed cells: the report, then the summary and exit code 1; the same
command run again redoes only the cells without a FINISHED run. The module is imported by Hydra's plugin scan at
every start: submitit, MLflow and gaexp are imported only when a launch runs.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.gaexp_grid_sweeper.failed import fail_runs_of, failed_cell
from hydra_plugins.gaexp_grid_sweeper.task_watch import read_record

log = logging.getLogger(__name__)


def ended_reason(job_id: str, state: str | None) -> str:
    """Why a task has no result, as gaexp.tracking.mark_stale_runs words it: `SLURM job 1234_5 ended CANCELLED`
    (submitit's state reads `CANCELLED by 0`: its first word, as sacct's)."""
    words = (state or "").split()
    return f"SLURM job {job_id} ended {words[0] if words else 'UNKNOWN'}"


def has_ended(job: Any) -> bool | None:
    """Whether a submitted task is over: True when it left a result or submitit saw it end (CANCELLED, TIMEOUT,
    ...), False while it is queued or running. None when submitit calls it ended in a state that goes on
    (SUSPENDED, RESIZING, CONFIGURING): submitit then stops asking, and only the cluster's accounting can say."""
    from gaexp.liveness import SLURM_LIVE

    if job.paths.result_pickle.exists():
        return True
    if not job.done():
        return False
    state = job.state.split()
    return None if state and state[0] in SLURM_LIVE else True


def wait_for_every(jobs: Sequence[Any], on_end: Callable[[int], None], poll_s: float = 1.0,
                   sacct_every_s: float = 30.0, on_poll: Callable[[List[int]], None] = lambda pending: None) -> None:
    """on_end(i) for each job as it ends, in the order they end, until every job has: one that ends without a
    result stops nothing, and is known at once, not after the jobs before it in the array. A suspended job is
    waited for; sacct (gaexp.liveness.slurm_job_end) is asked every `sacct_every_s` whether it has ended since.
    on_poll(pending) each `poll_s` before the jobs are asked."""
    from gaexp.liveness import slurm_job_end

    pending = list(range(len(jobs)))
    ask_at: Dict[int, float] = {}
    while pending:
        on_poll(pending)
        for i in list(pending):
            ended = has_ended(jobs[i])
            if ended is None and time.monotonic() >= ask_at.get(i, 0.0):
                ask_at[i] = time.monotonic() + sacct_every_s
                ended = slurm_job_end(jobs[i].job_id) is not None
            if ended:
                pending.remove(i)
                on_end(i)
        if pending:
            time.sleep(poll_s)  # as submitit's own Job.wait; its sacct calls are spaced out by its watcher


def mark_killed(config: DictConfig, job_id: str, reason: str) -> List[str]:
    """The run a task that ended without a result left RUNNING, marked KILLED now: by the tracking store's rule
    for stale runs (gaexp.tracking.mark_stale_runs, which every command applies: sacct says how each job ended),
    else, where sacct does not report the job ended yet, with `reason`. Returns `run name (reason)` per run
    marked (mark_stale_runs may mark others, as it would at the next command's start)."""
    from mlflow.entities import RunStatus
    from mlflow.tracking import MlflowClient

    from gaexp import tracking
    from gaexp.tags import KILLED_REASON, SLURM_JOB, filter_equals

    client = MlflowClient(config.mlflow.tracking_uri)
    experiment_id = tracking.experiment_id(client, config.mlflow.experiment_name)
    marked = tracking.mark_stale_runs(client, experiment_id, config.mlflow.stale_after_s)
    for run in tracking.search_all(client, [experiment_id],
                                   f"attributes.status = 'RUNNING' and {filter_equals(SLURM_JOB, job_id)}"):
        client.set_tag(run.info.run_id, KILLED_REASON, reason)
        client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.KILLED))
        marked.append(f"{run.info.run_name} ({reason})")
    return marked


class WaitingLauncher(submitit_launcher.BaseSubmititLauncher):
    """hydra-submitit-launcher's launcher (same settings) that waits for every task; its subclass says why a task
    ended without a result and ends the run the task left RUNNING (`without_result`)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from submitit.core.utils import UncompletedJobError

        jobs = self.submit(job_overrides, initial_job_idx)
        outcomes: List[Any] = [None] * len(jobs)

        def collect(i: int) -> None:
            job = jobs[i]
            try:
                outcomes[i] = job.results()[0]
            except Exception as e:  # noqa: BLE001 - raised below, once every task has ended
                outcomes[i] = e
                if type(e) is not UncompletedJobError:  # e.g. FailedJobError: the task raised outside its cell
                    return
                reason, end_runs = self.without_result(job)
                outcomes[i] = self.failed_cell(job_overrides[i], reason)
                try:
                    for run in end_runs():
                        log.warning("marked %s", run)
                except Exception as err:  # noqa: BLE001 - the store unreachable now: the next command marks it
                    log.warning("could not end the run of job %s (%s); the next gaexp command marks it KILLED",
                                job.job_id, err)

        wait_for_every(jobs, collect, on_poll=lambda pending: self.sample([jobs[i] for i in pending]))
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome  # as hydra-submitit-launcher: a task that raised outside its cell stops the sweep
        return outcomes

    def without_result(self, job: Any) -> Tuple[str, Callable[[], List[str]]]:
        """Why `job` ended without a result, and how its run is ended (returning `run name (how)` per run)."""
        raise NotImplementedError

    def sample(self, running: Sequence[Any]) -> None:
        """Called each second with the jobs not ended yet."""

    def executor_options(self, sweep_dir: Path) -> Dict[str, Any]:
        """The executor's own init arguments (`local_python`, ...) beyond hydra-submitit-launcher's."""
        return {}

    def failed_cell(self, overrides: Sequence[str], reason: str) -> JobReturn:
        assert self.config is not None and self.hydra_context is not None
        return failed_cell(self.config, self.hydra_context, overrides, reason)

    def submit(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> List[Any]:
        """hydra-submitit-launcher 1.2's `launch` up to the submission: the array's jobs, not yet waited for."""
        import submitit

        assert self.config is not None
        assert len(job_overrides) > 0
        init_params: Dict[str, Any] = {"folder": self.params["submitit_folder"]}
        specific_init_keys = {"max_num_timeout"}
        init_params.update(**{f"{self._EXECUTOR}_{x}": y for x, y in self.params.items() if x in specific_init_keys})
        init_keys = specific_init_keys | {"submitit_folder"}
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init_params, **self.executor_options(sweep_dir))
        baseparams = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{x if x in baseparams else f"{self._EXECUTOR}_{x}": y
                                      for x, y in self.params.items() if x not in init_keys})
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {self.config.hydra.sweep.dir}")
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        job_params: List[Tuple[Any, ...]] = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        jobs: List[Any] = [None] * len(job_overrides)
        for cells, params in self.arrays(job_overrides, sweep_dir):
            executor.update_parameters(**params)
            for i, job in zip(cells, executor.map_array(self, *zip(*[job_params[i] for i in cells]))):
                jobs[i] = job
        return jobs

    def arrays(self, job_overrides: Sequence[Sequence[str]], sweep_dir: Path) -> List[Tuple[List[int], Dict]]:
        """The job arrays to submit: their cells and their own executor settings; one array by default."""
        return [(list(range(len(job_overrides))), {})]


class SlurmLauncher(WaitingLauncher):
    """hydra-submitit-launcher's SlurmLauncher (same settings, same sbatch script) that waits for every task."""

    _EXECUTOR = "slurm"

    def without_result(self, job: Any) -> Tuple[str, Callable[[], List[str]]]:
        from gaexp.liveness import slurm_job_end

        reason = ended_reason(job.job_id, slurm_job_end(job.job_id) or job.state)
        return reason, lambda: [f"KILLED: {run}" for run in mark_killed(self.config, job.job_id, reason)]

    def arrays(self, job_overrides: Sequence[Sequence[str]], sweep_dir: Path) -> List[Tuple[List[int], Dict]]:
        """One array per replica count: a DP cell's job asks for w tasks."""
        by_replicas: Dict[int, List[int]] = {}
        for i, overrides in enumerate(job_overrides):
            by_replicas.setdefault(self.replicas_of(overrides), []).append(i)
        return [(cells, self.replica_tasks(replicas, sweep_dir)) for replicas, cells in by_replicas.items()]

    def replicas_of(self, overrides: Sequence[str]) -> int:
        """A cell's replica count (regime.replicas: `w2b8a1`'s 2), as its job will compose it."""
        assert self.config is not None and self.hydra_context is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        return int(cfg.regime.replicas)

    def replica_tasks(self, replicas: int, sweep_dir: Path) -> Dict[str, Any]:
        """The sbatch settings of a cell's job: the launch config's for one replica; for a DP cell, `replicas`
        tasks on one node sharing the cell's CPUs (cpus_per_task, at least one each), each told the file on the
        shared file system its replicas meet through (gaexp/replicas.py `launched`: SLURM_PROCID is its rank).
        Across nodes: torchrun (docs/cluster.md)."""
        from gaexp.replicas import STORE_FILE_ENV

        setup = list(self.params.get("setup") or [])
        if replicas == 1:
            return {"tasks_per_node": self.params.get("tasks_per_node", 1), "nodes": self.params.get("nodes", 1),
                    "cpus_per_task": self.params.get("cpus_per_task"), "slurm_setup": setup}
        meet = sweep_dir.resolve() / ".replicas"
        meet.mkdir(parents=True, exist_ok=True)
        cpus = self.params.get("cpus_per_task") or replicas
        return {"tasks_per_node": replicas, "nodes": 1, "cpus_per_task": max(1, int(cpus) // replicas),
                "slurm_setup": [*setup, f'export {STORE_FILE_ENV}="{meet}/$SLURM_JOB_ID"']}


class LocalLauncher(WaitingLauncher):
    """hydra-submitit-launcher's LocalLauncher (same settings) whose killed task fails its own cell alone: each
    task runs under task_watch.py, which records its pid and how it ended; its memory is sampled here."""

    _EXECUTOR = "local"

    def executor_options(self, sweep_dir: Path) -> Dict[str, Any]:
        from gaexp import liveness

        self.records = sweep_dir.resolve() / ".submitit" / "tasks"
        self.held: Dict[str, int] = {}
        self.pids: Dict[str, int] = {}  # each running task's, read once from its record
        self.oom_before = liveness.oom_kills()
        watch = f"{shlex.quote(sys.executable)} -m hydra_plugins.gaexp_grid_sweeper.task_watch"
        return {"local_python": f"{watch} {shlex.quote(str(self.records))} {shlex.quote(sys.executable)}"}

    def sample(self, running: Sequence[Any]) -> None:
        from gaexp.memory import rss_bytes

        for job in running:
            if job.job_id not in self.pids and "pid" in (record := read_record(self.records, job.job_id)):
                self.pids[job.job_id] = record["pid"]
            pid = self.pids.get(job.job_id)
            if pid is not None and (held := rss_bytes(pid)) is not None:
                self.held[job.job_id] = held

    def without_result(self, job: Any) -> Tuple[str, Callable[[], List[str]]]:
        from gaexp import liveness

        record = read_record(self.records, job.job_id)
        if "pid" not in record:  # the task never started (no run either), or ran unwatched (macOS)
            return f"submitit local job {job.job_id} ended {job.state} without a result", lambda: []
        oom_now = liveness.oom_kills()
        reason = f"task {record['pid']} " + liveness.death(record.get("exitcode"), self.held.get(job.job_id),
                                                           oom_now is not None and oom_now != self.oom_before)
        self.oom_before = oom_now
        return reason, lambda: [f"FAILED: {run}" for run in fail_runs_of(self.config, record["pid"], reason)]
