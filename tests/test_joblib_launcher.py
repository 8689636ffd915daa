"""launch=joblib (hydra_plugins/gaexp_grid_sweeper/joblib_launcher.py): a worker killed in its cell, as the OOM
killer kills one, fails that cell alone in one line naming the signal, its run FAILED with the reason; the other
cells finish in the same command, a fresh worker taking the next; the rerun trains only the failed cell."""

from __future__ import annotations

import os
import subprocess

import pytest

from gaexp import liveness
from hydra_plugins.gaexp_grid_sweeper.joblib_launcher import slots

VICTIM = '''
import os, signal, time
from pathlib import Path

from gaexp.liveness import launching_process
from gaexp.model import SimpleModel


class Net(SimpleModel):
    """The study's CNN. Under GAEXP_TEST_KILL=FOLDER, in a launcher's worker: each training forward leaves the
    worker's pid in FOLDER, and the first worker at its 4th one while another worker trains SIGKILLs itself, as
    the OOM killer would (once per FOLDER)."""

    forwards = 0

    def forward(self, x):
        folder = os.environ.get("GAEXP_TEST_KILL")
        if self.training and folder and launching_process() is not None:
            Net.forwards += 1
            Path(folder, str(os.getpid())).write_text("")
            deadline = time.monotonic() + 120
            while Net.forwards == 4 and len(list(Path(folder).glob("[0-9]*"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)  # until a second worker trains: its cell must go on
            if Net.forwards == 4:
                try:
                    os.close(os.open(Path(folder, "killed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    pass
                else:
                    Path(folder, "killed").write_text(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


def build(norm_layer, in_channels, num_classes):
    return Net(norm_layer=norm_layer, in_channels=in_channels, num_classes=num_classes)
'''


def test_cells_at_once_are_counted_as_joblib_counts_them():
    cores = os.cpu_count() or 1
    assert slots(2, 4) == 2 and slots(8, 3) == 3 and slots(None, 4) == 1
    assert slots(-1, 1000) == cores and slots(-2, 1000) == max(1, cores - 1) and slots(-1000, 4) == 1


@pytest.mark.slow
def test_a_killed_worker_fails_its_own_cell_and_the_other_three_finish(tmp_path, gaexp_argv, training_runs):
    """The issue's case: a 4-cell joblib sweep, 2 at once, one worker SIGKILLed mid-cell while the other trains."""
    (tmp_path / "victim.py").write_text(VICTIM)
    (tmp_path / "kills").mkdir()
    grid = ["model=custom", "model.target=victim:build", "norm=bn,gn4", "seed=1,2", "regime=bs16a1",
            "train.num_iterations=6", "train.eval_period=3", "data.holdout=1000", "launch=joblib",
            "hydra.launcher.n_jobs=2"]
    env = {**os.environ, "GAEXP_TEST_KILL": str(tmp_path / "kills")}
    done = subprocess.run(gaexp_argv(tmp_path, *grid), cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=env)
    victim = int((tmp_path / "kills" / "killed").read_text())
    assert done.returncode == 1, done.stderr[-3000:]
    reason = f"worker {victim} killed by SIGKILL, holding "
    assert "Traceback" not in done.stderr + done.stdout and "TerminatedWorkerError" not in done.stderr
    head, line = done.stderr.splitlines()[-2:]  # the failure summary: the one failed cell, one line
    assert head == "error: 1 cell(s) failed, the others ran:" and reason in line and "out-of-memory killer" in line
    client, runs = training_runs(f"sqlite:///{tmp_path}/mlflow.db")
    statuses = sorted(r.info.status for r in runs.values())
    assert statuses == ["FAILED", "FINISHED", "FINISHED", "FINISHED"]  # none left RUNNING
    (failed,) = [r for r in runs.values() if r.info.status == "FAILED"]
    assert failed.data.tags["error"].startswith(reason)
    workers = {int(p.name) for p in (tmp_path / "kills").glob("[0-9]*")}
    assert len(workers) >= 3 and not any(liveness.process_alive(pid) for pid in workers)  # a fresh one; none left
    again = subprocess.run(gaexp_argv(tmp_path, *grid), cwd=tmp_path, capture_output=True, text=True, timeout=600,
                           env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    trained = [line.split()[0] for line in again.stdout.splitlines() if " FINISHED (" in line]
    assert trained == [failed.info.run_name]  # the other three skipped
