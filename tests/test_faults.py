"""Storage faults (gaexp/faults.py) in one line, and a fuzz of faults against the invariants a long sweep needs:

- each storage fault, found however deep MLflow and SQLAlchemy wrap it, said in one line naming the path;
- the disk full from each point where a cell writes on, one point after another on one store: the cell raises
  the one line, the store stays intact, no run ends FINISHED that did not finish, and with room again the cell
  trains once more: one FINISHED run;
- a real sweep on a 3 MB file system (root only: it mounts a tmpfs): one line, status 1, no traceback, the store
  intact; the same command on the same folder with room resumes, skipping the finished cells.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import sqlite3
import subprocess
import sys

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from gaexp import app, faults, tracking
from gaexp.callbacks import prepare
from tests.conftest import TINY


def raised_by_mlflow(inner: BaseException) -> MlflowException:
    """`inner` as MLflow's SQLAlchemy store raises it: sqlite3's error, inside SQLAlchemy's, inside MLflow's."""
    try:
        try:
            raise inner
        except BaseException as e:
            raise MlflowException(f"(sqlite3.OperationalError) {e}\n[SQL: INSERT INTO tags ...]") from e
    except MlflowException as e:
        return e


@pytest.mark.parametrize("error, line", [
    (OSError(errno.ENOSPC, "No space left on device", "/data/out/mlartifacts/model.pth"),
     "no space left on device at /data/out/mlartifacts/model.pth: free space there, or set paths.outputs"),
    (OSError(errno.EDQUOT, "Disk quota exceeded", "/home/me/out/multirun/x/.hydra/config.yaml"),
     "disk quota exceeded at /home/me/out/multirun/x/.hydra/config.yaml: free space within your quota"),
    (OSError(errno.EROFS, "Read-only file system", "/ro/gaexp.log"),
     "read-only file system at /ro/gaexp.log: set paths.outputs (and mlflow.tracking_uri) to a writable folder"),
    (OSError(errno.EIO, "Input/output error"), "input/output error under /data/out: the disk failed a read or write"),
    (raised_by_mlflow(sqlite3.OperationalError("database or disk is full")),
     "no space left on device at /data/out/mlflow.db: free space there"),
    (raised_by_mlflow(sqlite3.OperationalError("database is locked")),
     "the SQLite store is locked beyond its retries at /data/out/mlflow.db: another process holds it"),
    (raised_by_mlflow(sqlite3.OperationalError("attempt to write a readonly database")),
     "read-only file system at /data/out/mlflow.db"),
    (raised_by_mlflow(sqlite3.OperationalError("disk I/O error")), "input/output error at /data/out/mlflow.db"),
])
def test_each_storage_fault_is_one_line_naming_the_path_cause_and_what_to_do(error, line):
    fault = faults.storage_fault(error, "sqlite:////data/out/mlflow.db", "/data/out")
    said = str(fault)
    assert said.startswith(line) and "\n" not in said
    assert said.endswith("then rerun the same command: finished cells are skipped")
    again = pickle.loads(pickle.dumps(fault))  # it crosses from a launcher's worker to the sweep
    assert str(again) == said and isinstance(again, faults.StorageFault)


def test_other_errors_are_no_storage_fault():
    assert faults.storage_fault(ValueError("no space left on device")) is None  # words alone are not a fault
    assert faults.storage_fault(OSError(errno.ENOENT, "No such file", "/x")) is None
    assert faults.storage_fault(raised_by_mlflow(sqlite3.OperationalError("no such table: runs"))) is None
    assert faults.store_path("sqlite:////a/b%20c/mlflow.db") == "/a/b c/mlflow.db"
    assert faults.store_path("http://127.0.0.1:5000") is None


WRITES = ("create_", "set_", "log_", "finalize_", "update_", "delete_")  # MlflowClient's methods that write


class FullDisk:
    """MlflowClient's writes counted; from the `full_at`-th on, each raises ENOSPC as a full disk does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, full_at: int | None, where: str) -> None:
        self.count, self.full_at = 0, full_at
        for name in dir(MlflowClient):
            if name.startswith(WRITES) and callable(getattr(MlflowClient, name)):
                monkeypatch.setattr(MlflowClient, name, self.wrapped(getattr(MlflowClient, name), where))

    def wrapped(self, method, where):
        def write(*args, **kwargs):
            self.count += 1
            if self.full_at is not None and self.count >= self.full_at:
                raise OSError(errno.ENOSPC, "No space left on device", where)
            return method(*args, **kwargs)
        return write


def job(tmp_path):
    """What Hydra gives a sweep's job (gaexp.app.sweep_cell reads these)."""
    return OmegaConf.create({"verbose": False, "output_subdir": ".hydra", "sweep": {"dir": str(tmp_path / "multirun" / "s")},
                             "job": {"override_dirname": "norm=gn4"}})


@pytest.mark.slow
def test_a_disk_full_from_each_point_a_cell_writes_costs_that_attempt_alone(tmp_path, compose, monkeypatch):
    """One cell, tried once per write point with the disk full from there on (one store, as repeated commands
    leave it), then once with room: every try raises the one line; nothing FINISHED before the end; the store
    intact; at the end one FINISHED run, and the tries' runs FAILED or left RUNNING for the next command."""
    cfg = compose(*TINY, "norm=gn4", "regime=bs4a1", "train.num_iterations=2", "train.eval_period=1",
                  "data.holdout=100", outputs=tmp_path)
    prepare(cfg)
    out = tmp_path / "multirun" / "s" / "0"
    out.mkdir(parents=True)
    counting = FullDisk(monkeypatch, None, str(tmp_path))
    app.sweep_cell(cfg, job(tmp_path), out)  # a first run counts the writes of one cell
    writes = counting.count
    client = MlflowClient(cfg.mlflow.tracking_uri)
    experiment_id = tracking.experiment_id(client, "gaexp")
    (first,) = client.search_runs([experiment_id])
    client.delete_run(first.info.run_id)  # the cell to train again
    assert writes >= 10  # the run, its inputs, evaluations, model, end
    for full_at in range(1, writes + 1):
        monkeypatch.undo()
        monkeypatch.setattr(app, "_storage_fault", None)  # each try a command of its own
        FullDisk(monkeypatch, full_at, str(tmp_path / "mlflow.db"))
        with pytest.raises(faults.StorageFault) as raised:
            app.sweep_cell(cfg, job(tmp_path), out)
        assert str(raised.value).startswith(f"no space left on device at {tmp_path}/mlflow.db: ")
        assert not (out / "FAILED.txt").exists()  # not a failed cell: the sweep stops (gaexp.faults)
        statuses = [r.info.status for r in client.search_runs([experiment_id])]
        assert len(statuses) == full_at - 1  # a run for each try whose first write, create_run, went through
        assert "FINISHED" not in statuses, (full_at, statuses)
    monkeypatch.undo()
    monkeypatch.setattr(app, "_storage_fault", None)
    app.sweep_cell(cfg, job(tmp_path), out)  # room again
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        assert db.execute("pragma integrity_check").fetchall() == [("ok",)]
    statuses = sorted(r.info.status for r in client.search_runs([experiment_id]))
    assert statuses.count("FINISHED") == 1 and set(statuses) <= {"FINISHED", "FAILED", "RUNNING"}
    assert len(statuses) == writes  # the tries' runs (all but the first try's) and the last one


SMALL = ["norm=gn4,none", "regime=bs16a1,bs4a4", "data.holdout=1000", "launch=joblib", "hydra.launcher.n_jobs=2"]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="mounts a 3 MB tmpfs: root only")
def test_a_sweep_on_a_full_disk_says_one_line_and_resumes_once_there_is_room(tmp_path, gaexp_argv):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(small)], check=True)
    try:
        argv = gaexp_argv(small, *SMALL)
        full = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert full.returncode == 1, full.stderr[-3000:]
        (line,) = full.stderr.splitlines()
        assert line.startswith((f"error: no space left on device at {small}/",
                                f"error: no space left on device under {small}: ")), line
        assert " cells finished; free space there, or set paths.outputs" in line
        assert line.endswith("then rerun the same command to resume, finished cells are skipped: gaexp "
                             + " ".join(argv[3:]).replace("data.sources=[local]", "'data.sources=[local]'"))
        assert "Traceback" not in full.stdout and len(full.stdout.splitlines()) < 20
        with sqlite3.connect(small / "mlflow.db") as db:
            assert db.execute("pragma integrity_check").fetchall() == [("ok",)]
            finished = {row[0] for row in db.execute("SELECT run_uuid FROM runs WHERE status = 'FINISHED' "
                                                     "AND name NOT LIKE 'sweep-%'")}
        subprocess.run(["mount", "-o", "remount,size=300m", str(small)], check=True)
        again = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        client = MlflowClient(f"sqlite:///{small}/mlflow.db")
        runs = client.search_runs([client.get_experiment_by_name("gaexp").experiment_id], "tags.norm != ''")
        now = {r.info.run_id for r in runs if r.info.status == "FINISHED"}
        assert finished <= now and len(now) == 4  # the finished kept and skipped, the others trained once
        assert "RUNNING" not in {r.info.status for r in runs}  # the full disk's leftovers marked KILLED
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


@pytest.mark.slow
def test_a_store_another_process_keeps_locked_beyond_the_retries_is_one_line(tmp_path, compose, monkeypatch):
    """Another process holds the SQLite store's write lock longer than MLflow waits (its busy_timeout, 20 s): the
    cell raises the one line naming the store, records nothing, and the store stays intact."""
    cfg = compose(*TINY, "norm=gn4", "regime=bs4a1", "train.num_iterations=2", outputs=tmp_path)
    prepare(cfg)
    out = tmp_path / "multirun" / "s" / "0"
    out.mkdir(parents=True)
    monkeypatch.setattr(app, "_storage_fault", None)
    hold = ("import sqlite3, sys, time; db = sqlite3.connect(sys.argv[1], isolation_level=None); "
            "db.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(300)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "mlflow.db")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(faults.StorageFault) as raised:
            app.sweep_cell(cfg, job(tmp_path), out)
    finally:
        holder.kill()
        holder.wait()
    assert str(raised.value).startswith(f"the SQLite store is locked beyond its retries at {tmp_path}/mlflow.db: "
                                        "another process holds it")
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        assert db.execute("pragma integrity_check").fetchall() == [("ok",)]
        assert db.execute("SELECT count(*) FROM runs").fetchone() == (0,)


def test_a_report_the_disk_cannot_take_is_one_warning_with_the_command_that_makes_it_again(tmp_path, compose,
                                                                                           monkeypatch, caplog):
    """The sweep's report at its end (gaexp.callbacks.ReportCallback), the disk full: one warning naming the path,
    what to do and the gaexp-report command, where Hydra said MLflow's error with its SQL."""
    from gaexp import analysis
    from gaexp.callbacks import ReportCallback

    cfg = compose(*TINY, outputs=tmp_path, hydra=True)
    full = tmp_path / "reports" / "x" / "table.md"

    def no_room(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(full))
    monkeypatch.setattr(analysis, "report_each_part", no_room)
    with caplog.at_level("WARNING", logger="gaexp.app"):
        ReportCallback().on_multirun_end(cfg)
    (line,) = [r.getMessage() for r in caplog.records]
    sweep = cfg.hydra.sweep.dir.rsplit("/", 1)[-1]
    assert line.startswith(f"no report for sweep {sweep}: no space left on device at {full}; free space there")
    assert f", then: gaexp-report --tracking-uri sqlite:///{tmp_path}/mlflow.db --experiment gaexp --sweep {sweep}" \
        in line and "\n" not in line
