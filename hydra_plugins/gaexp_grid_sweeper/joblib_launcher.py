"""Hydra's joblib launcher (`launch=joblib`, conf/launch/joblib.yaml) where a worker that dies costs its own cell.

joblib runs a sweep's cells on one pool of loky workers. When the kernel kills one (the OOM killer's SIGKILL, a
segfault), loky calls the whole pool broken: it kills the other workers in their cells, and joblib raises
TerminatedWorkerError, a 43-line traceback that ended the sweep with its other runs left RUNNING. This launcher
runs the same job function (hydra_joblib_launcher's `execute_job`, so a cell runs exactly as there, in a loky
worker with joblib's thread limits) on `n_jobs` pools of one worker each, the next cell starting in a slot as soon
as its last one ended. A worker that dies breaks its own slot alone:

- its cell fails in one line naming the signal and the memory the worker held (sampled every second),
  `norm=gn4 regime=bs16a1: worker 4711 killed by SIGKILL, holding 1.3 GiB (the kernel's out-of-memory killer)`,
  with a FAILED.txt the failure summary lists (failed.py);
- the run it left RUNNING ends FAILED with that reason as its `error` tag (gaexp.tracking.fail_runs_of);
- the slot gets a fresh worker, and the sweep goes on, ending as any sweep with failed cells: the report, the
  summary and exit status 1. The same command reruns only the cells without a FINISHED run.

Ctrl-C, SIGTERM and SIGHUP: the workers, told by the terminal or by gaexp.liveness, end their cells' runs KILLED;
this launcher gives them liveness.GRACE_S to, then stops every worker, so none is left behind. Of joblib's
settings, n_jobs counts here (negative: as joblib counts, -1 every core); the others shape joblib's batching
and memory mapping, which one cell per task never uses. Imported by Hydra's plugin scan at every start: loky,
MLflow and gaexp are imported only when a launch runs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher as HydraJoblibLauncher

from hydra_plugins.gaexp_grid_sweeper.failed import fail_runs_of, failed_cell

log = logging.getLogger(__name__)
POLL_S = 1.0  # how often the running workers' memory is read while waiting for a cell to end
IDLE_S = 300  # a slot's worker, idle this long, exits (joblib's loky default)


def slots(n_jobs: Optional[int], cells: int) -> int:
    """How many cells run at once: joblib's count of `n_jobs` (None: 1; -1: every core it sees, -2: all but one),
    at most `cells`."""
    from joblib import effective_n_jobs

    return max(1, min(effective_n_jobs(n_jobs), cells))


def worker_env(n_jobs: int) -> Dict[str, str]:
    """The thread limits joblib gives its loky workers (OMP_NUM_THREADS=cores // n_jobs, ...): the same here."""
    from joblib._parallel_backends import LokyBackend

    return LokyBackend()._prepare_worker_env(n_jobs=n_jobs)


def storage_fault(ret: JobReturn) -> bool:
    """Whether a cell failed on a storage fault (gaexp/faults.py: a full disk, a locked store)."""
    from gaexp.faults import StorageFault

    return ret.status == JobStatus.FAILED and isinstance(ret._return_value, StorageFault)


class Slot:
    """One worker's pool: its loky executor, the cell it runs and what its worker was last seen holding."""

    def __init__(self, env: Dict[str, str]) -> None:
        from joblib.externals.loky import ProcessPoolExecutor

        self.executor = ProcessPoolExecutor(max_workers=1, timeout=IDLE_S, env=env)
        self.cell: Optional[int] = None
        self.future: Any = None
        self.pid: Optional[int] = None
        self.process: Any = None  # loky's process object: its exit code once it died
        self.held: Optional[int] = None

    def start(self, cell: int, fn: Any, *args: Any) -> None:
        self.cell, self.held = cell, None
        self.future = self.executor.submit(fn, *args)
        self.pid, self.process = next(iter(self.executor._processes.items()), (None, None))  # started by submit

    def sample(self) -> None:
        from gaexp.memory import rss_bytes

        if self.pid is not None and (held := rss_bytes(self.pid)) is not None:
            self.held = held


class JoblibLauncher(HydraJoblibLauncher):
    """hydra-joblib-launcher's JoblibLauncher (the same settings) whose killed worker fails its own cell alone."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from concurrent.futures import FIRST_COMPLETED, wait

        from hydra_plugins.hydra_joblib_launcher._core import execute_job
        from joblib.externals.loky.process_executor import TerminatedWorkerError

        from gaexp import liveness

        setup_globals()
        assert self.config is not None and self.task_function is not None and self.hydra_context is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        n = slots(self.joblib.get("n_jobs"), len(job_overrides))
        log.info("Joblib.Parallel(n_jobs=%s,backend=loky) is launching %d jobs", n, len(job_overrides))
        log.info("Launching jobs, sweep output dir : %s", sweep_dir)
        for idx, overrides in enumerate(job_overrides):
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
        state, env = Singleton.get_state(), worker_env(n)
        todo = list(range(len(job_overrides)))
        results: List[Optional[JobReturn]] = [None] * len(job_overrides)
        pool: List[Slot] = []
        oom_before = liveness.oom_kills()
        try:
            while todo or any(s.future is not None for s in pool):
                if liveness.ended():  # SIGTERM, SIGHUP: no cell starts, a worker that ends is that end, not a fault
                    raise liveness.Ended(liveness.ended())
                for slot in [s for s in pool if s.future is None] + [None] * (n - len(pool)):
                    if not todo:
                        break
                    if slot is None:
                        slot = Slot(env)
                        pool.append(slot)
                    i = todo.pop(0)
                    slot.start(i, execute_job, initial_job_idx + i, job_overrides[i], self.hydra_context, self.config,
                               self.task_function, state)
                running = {s.future: s for s in pool if s.future is not None}
                done, _ = wait(running, timeout=POLL_S, return_when=FIRST_COMPLETED)
                if liveness.ended():
                    raise liveness.Ended(liveness.ended())
                for slot in pool:
                    slot.sample()
                for future in done:
                    slot = running[future]
                    cell, slot.future = slot.cell, None
                    try:
                        results[cell] = future.result()
                        if storage_fault(results[cell]):  # no other cell could record either: none starts
                            todo.clear()
                    except TerminatedWorkerError:
                        oom_now = liveness.oom_kills()
                        reason = f"worker {slot.pid} " + liveness.death(
                            getattr(slot.process, "exitcode", None), slot.held, oom_now is not None and oom_now != oom_before)
                        oom_before = oom_now
                        results[cell] = self.died(job_overrides[cell], slot.pid, reason)
                        slot.executor.shutdown(wait=False)
                        pool.remove(slot)  # the next cell gets a fresh worker
        except BaseException:  # Ctrl-C, SIGTERM, a job's own error: the workers end their runs, then stop
            wait([s.future for s in pool if s.future is not None], timeout=liveness.GRACE_S)
            raise
        finally:
            for slot in pool:
                slot.executor.shutdown(wait=True, kill_workers=True)
        return [r for r in results if r is not None]

    def died(self, overrides: Sequence[str], pid: Optional[int], reason: str) -> JobReturn:
        """The cell of a worker that died: its run ended FAILED with the reason, and a failed cell."""
        assert self.config is not None and self.hydra_context is not None
        if pid is not None:
            try:
                fail_runs_of(self.config, pid, reason)
            except Exception as e:  # noqa: BLE001 - the store unwritable now: the next command marks the run KILLED
                log.warning("could not end the run of worker %s FAILED (%s); the next gaexp command marks it KILLED",
                            pid, e)
        return failed_cell(self.config, self.hydra_context, overrides, reason)
