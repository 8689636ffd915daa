"""launch=joblib (hydra_plugins/gaexp_grid_sweeper/joblib_launcher.py): a worker killed in its cell, as the OOM
killer kills one, fails that cell alone in one line naming the signal, its run FAILED with the reason; the other
cells finish in the same command, a fresh worker taking the next. launch=local's task too (submitit_launcher.py's
LocalLauncher, task_watch.py: tests/test_task_watch.py). (The rerun of failed cells: test_reliability.py.)"""

from __future__ import annotations

import os
import subprocess

import joblib
import pytest

from gaexp import liveness
from hydra_plugins.gaexp_grid_sweeper.joblib_launcher import slots

VICTIM = '''
import os, signal, time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig

from gaexp.liveness import launching_process
from gaexp.model import SimpleModel


class Net(SimpleModel):
    """The study's CNN. In a launcher's worker, under GAEXP_TEST_KILL=FOLDER and GAEXP_TEST_KILL_AT=JOB:N,...:
    each training forward leaves the worker's pid in FOLDER, and job JOB's worker SIGKILLs itself at its N-th
    one, as the OOM killer would, once another worker has trained (so that one is mid-cell), once per FOLDER."""

    forwards = 0

    def forward(self, x):
        folder = os.environ.get("GAEXP_TEST_KILL")
        if self.training and folder and launching_process() is not None:
            Net.forwards += 1
            Path(folder, str(os.getpid())).write_text("")
            plan = dict(e.split(":") for e in os.environ["GAEXP_TEST_KILL_AT"].split(","))
            job = str(HydraConfig.get().job.num)
            mark = Path(folder, f"killed-{job}")
            if int(plan.get(job, 0)) == Net.forwards and not mark.exists():
                deadline = time.monotonic() + 120
                while len(list(Path(folder).glob("[0-9]*"))) < 2 and time.monotonic() < deadline:
                    time.sleep(0.1)
                mark.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


def build(norm_layer, in_channels, num_classes):
    return Net(norm_layer=norm_layer, in_channels=in_channels, num_classes=num_classes)
'''
CELL = ["model=custom", "model.target=victim:build", "regime=bs16a1", "train.num_iterations=6", "train.eval_period=3",
        "data.holdout=1000", "hydra.sweeper.order=given"]
JOBLIB = ["launch=joblib", "hydra.launcher.n_jobs=2"]


def sweep(tmp_path, gaexp_argv, kill_at: str, *grid: str, launch: list[str] = JOBLIB
          ) -> tuple[list[str], dict, subprocess.CompletedProcess]:
    """The sweep of `grid` through `launch`, two cells at once, with jobs' processes killed as `kill_at` says
    (VICTIM); its argv, env and outcome."""
    (tmp_path / "victim.py").write_text(VICTIM)
    (tmp_path / "kills").mkdir(exist_ok=True)
    env = {**os.environ, "GAEXP_TEST_KILL": str(tmp_path / "kills"), "GAEXP_TEST_KILL_AT": kill_at}
    argv = gaexp_argv(tmp_path, *CELL, *launch, *grid)
    return argv, env, subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)


def test_cells_at_once_are_counted_as_joblib_counts_them():
    cores = joblib.cpu_count()  # what joblib counts: affinity and a cgroup's quota too
    assert slots(2, 4) == 2 and slots(8, 3) == 3 and slots(None, 4) == 1
    assert slots(-1, 1000) == cores and slots(-2, 1000) == max(1, cores - 1) and slots(-1000, 4) == 1


@pytest.mark.slow
@pytest.mark.parametrize("launch, who", [(JOBLIB, "worker"), (["launch=local", "hydra.sweeper.max_batch_size=2"],
                                                               "task")], ids=["joblib", "local"])
def test_a_killed_worker_fails_its_own_cell_and_the_other_three_finish(tmp_path, gaexp_argv, training_runs, launch,
                                                                       who):
    """The issue's case: a 4-cell sweep, 2 at once, one cell's process SIGKILLed mid-cell while the other trains:
    under joblib a worker of its pool; under launch=local a submitit task (its end seen by task_watch.py)."""
    _, _, done = sweep(tmp_path, gaexp_argv, "0:4", "norm=bn,gn4", "seed=1,2", launch=launch)
    victim = int((tmp_path / "kills" / "killed-0").read_text())
    assert done.returncode == 1, done.stderr[-3000:]
    reason = f"{who} {victim} killed by SIGKILL, holding "
    assert "Traceback" not in done.stderr + done.stdout and "TerminatedWorkerError" not in done.stderr
    head, line = done.stderr.splitlines()[-2:]  # the failure summary: the one failed cell, one line
    assert head == "error: 1 cell(s) failed, the others ran:" and reason in line and "out-of-memory killer" in line
    assert "norm=bn" in line and "seed=1" in line
    client, runs = training_runs(f"sqlite:///{tmp_path}/mlflow.db")
    assert {name: r.info.status for name, r in runs.items()} == {
        "custom-bn-bs16a1-s1": "FAILED", "custom-bn-bs16a1-s2": "FINISHED", "custom-gn4-bs16a1-s1": "FINISHED",
        "custom-gn4-bs16a1-s2": "FINISHED"}  # none left RUNNING
    assert runs["custom-bn-bs16a1-s1"].data.tags["error"].startswith(reason)
    workers = {int(p.name) for p in (tmp_path / "kills").glob("[0-9]*")}
    assert len(workers) >= 3 and not any(liveness.process_alive(pid) for pid in workers)  # a fresh one; none left


@pytest.mark.slow
def test_a_worker_killed_at_its_cells_first_or_last_step_fails_that_cell_alone(tmp_path, gaexp_argv, training_runs):
    """The fault fuzz's kills: job 0's worker at its first training forward (the cell's memory check, before its
    run exists), job 1's at its last training step, job 2 untouched: two failed cells, each said in one line."""
    _, _, done = sweep(tmp_path, gaexp_argv, "0:1,1:6", "norm=gn4", "seed=1,2,3")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr + done.stdout
    head, *failed = done.stderr.splitlines()[-3:]
    assert head == "error: 2 cell(s) failed, the others ran:"
    for job, line in enumerate(failed):
        pid = (tmp_path / "kills" / f"killed-{job}").read_text()
        assert f"seed={job + 1}" in line and f"worker {pid} killed by SIGKILL" in line
    _, runs = training_runs(f"sqlite:///{tmp_path}/mlflow.db")
    assert {name: r.info.status for name, r in runs.items()} == {"custom-gn4-bs16a1-s2": "FAILED",
                                                                 "custom-gn4-bs16a1-s3": "FINISHED"}
    pid = (tmp_path / "kills" / "killed-1").read_text()
    assert runs["custom-gn4-bs16a1-s2"].data.tags["error"].startswith(f"worker {pid} killed by SIGKILL")
    workers = {int(p.name) for p in (tmp_path / "kills").glob("[0-9]*")}
    assert not any(liveness.process_alive(pid) for pid in workers)
