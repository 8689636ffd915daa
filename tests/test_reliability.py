"""Faults injected into real sweeps and real stores: kills, failing cells, parallel writers, bad input."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from gaexp import tracking
from gaexp.app import CONFIG_DIR, run_cell
from gaexp.data import MD5, raw_dir

TINY = ["train.num_iterations=40", "train.eval_period=20", "device=cpu", "hydra.callbacks.report.window_start=0"]


def sweep_cmd(out, data_root, *overrides):
    return [sys.executable, "-m", "gaexp", "-m", *overrides, *TINY, f"paths.outputs={out}",
            f"data.root={data_root}", "data.sources=[local]"]


def cell_runs(out):
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    experiment = client.get_experiment_by_name("gaexp")
    runs = client.search_runs([experiment.experiment_id]) if experiment else []
    return client, [r for r in runs if "norm" in r.data.tags]


def run_statuses(db):
    """Read-only peek at run statuses: an MlflowClient here could race the sweep's own store creation."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            return [row[0] for row in con.execute("SELECT status FROM runs")]
    except sqlite3.Error:
        return []


def test_killed_sweep_resumes_without_rerunning_finished_cells(tmp_path, data_root):
    cmd = sweep_cmd(tmp_path, data_root, "norm=gn4,none", "regime=bs16a1,bs4a4", "seed=1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.3)
        statuses = run_statuses(tmp_path / "mlflow.db")
        if "FINISHED" in statuses and "RUNNING" in statuses:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _, before = cell_runs(tmp_path)
    finished_before = {r.info.run_name: r.info.run_id for r in before if r.info.status == "FINISHED"}
    killed = [r.info.run_id for r in before if r.info.status == "RUNNING"]
    assert finished_before and len(killed) == 1 and len(before) < 4

    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(f"{name}: skipped, already FINISHED" in again.stdout + again.stderr for name in finished_before)
    client, after = cell_runs(tmp_path)
    finished = {r.info.run_name: r.info.run_id for r in after if r.info.status == "FINISHED"}
    assert sorted(finished) == ["gn4-bs16a1-s1", "gn4-bs4a4-s1", "none-bs16a1-s1", "none-bs4a4-s1"]
    assert all(finished[name] == run_id for name, run_id in finished_before.items())  # not rerun
    assert not [r for r in after if r.info.status == "RUNNING"]
    stale = client.get_run(killed[0])
    assert stale.info.status == "KILLED" and "is gone" in stale.data.tags["gaexp.killed_reason"]
    newest_report = max((tmp_path / "reports").iterdir())  # the resumed sweep's report counts all four cells
    assert pd.read_csv(newest_report / "runs.csv").run_id.nunique() == 4

    forced = subprocess.run([*cmd[:4], "norm=none", "regime=bs16a1", "seed=1", "rerun=true", *cmd[7:]],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert len([r for r in cell_runs(tmp_path)[1] if r.info.run_name == "none-bs16a1-s1"]) == 2


def test_a_failing_cell_fails_alone_and_the_sweep_says_so(tmp_path, data_root):
    cmd = sweep_cmd(tmp_path, data_root, "norm=gn4", "regime=bs16a1", "train.lr=1e-3,1e30")
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    output = proc.stdout + proc.stderr
    assert "1 cell(s) failed, the others ran" in output
    assert "train.lr=1e+30" in output and "non-finite training loss (nan) at optimizer step 2" in output
    _, runs = cell_runs(tmp_path)
    by_lr = {r.data.params["train.lr"]: r for r in runs}
    assert by_lr["0.001"].info.status == "FINISHED"
    failed = by_lr["1e+30"]
    assert failed.info.status == "FAILED" and failed.data.tags["diverged_step"] == "2"
    assert failed.data.tags["error"].startswith("DivergedError: non-finite training loss")
    assert "Traceback" in failed.data.tags["error.traceback"]


def test_parallel_jobs_on_a_fresh_store_lose_nothing(tmp_path, data_root):
    cmd = sweep_cmd(tmp_path, data_root, "norm=gn4,none", "regime=bs16a1,bs4a4", "seed=1",
                    "hydra/launcher=joblib", "hydra.launcher.n_jobs=4")
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client, runs = cell_runs(tmp_path)
    assert len(runs) == 4 and all(r.info.status == "FINISHED" for r in runs)
    for run in runs:
        for metric in ("valid_acc", "train_loss"):
            assert [m.step for m in client.get_metric_history(run.info.run_id, metric)] == [20, 40]
        assert run.data.tags["threads"] == "1"  # threads=auto with 4 jobs on this machine's cores


# --- bad input: one clear message, a non-zero exit, and the store unchanged -----------------------

@pytest.fixture
def store(tmp_path):
    """A store that already holds one finished run: bad input must leave it as it is."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    experiment_id = tracking.prepare_store(uri, "gaexp", str(tmp_path / "mlartifacts"))
    client = MlflowClient(uri)
    with tracking.tracked_run(client, experiment_id, "gn4-bs16a1-s1", {"norm": "gn4"}):
        pass

    def snapshot():
        return sorted((r.info.run_id, r.info.status) for r in client.search_runs([experiment_id]))

    return tmp_path, snapshot, snapshot()


def cfg_for(tmp_path, data_root, *overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("config", overrides=[f"paths.outputs={tmp_path}", f"data.root={data_root}",
                                            "data.sources=[local]", *TINY[:3], *overrides])


BAD = {
    "batch size": (["regime.batch_size=0"], ValueError, r"regime.batch_size=0; valid: an integer >= 1"),
    "accumulation": (["regime.num_accum=-2"], ValueError, r"regime.num_accum=-2; valid: an integer >= 1"),
    "iterations": (["train.num_iterations=0"], ValueError, r"train.num_iterations=0; valid: an integer >= 1"),
    "eval period": (["train.eval_period=0"], ValueError, r"train.eval_period=0; valid: an integer >= 1"),
    "learning rate": (["train.lr=-1"], ValueError, r"train.lr=-1; valid: a finite number > 0"),
    "groups": (["norm=gn", "norm.groups=5"], ValueError,
               r"norm.groups=5 does not divide the channels \[32, 64, 128, 256\]; valid: \[1, 2, 4, 8, 16, 32\]"),
    "device": (["device=tpu"], ValueError, r"device='tpu'; valid: auto, cpu, cuda"),
    "file store": (["mlflow.tracking_uri=./mlruns"], ValueError, r"mlflow.tracking_uri='./mlruns'; valid: sqlite"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_before_any_run(case, store, data_root):
    tmp_path, snapshot, before = store
    overrides, error, message = BAD[case]
    with pytest.raises(error, match=message):
        run_cell(cfg_for(tmp_path, data_root, *overrides), sweep_id="bad")
    assert snapshot() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_asked_for_without_one(store, data_root):
    tmp_path, snapshot, before = store
    with pytest.raises(ValueError, match=r"device='cuda' but torch.cuda.is_available\(\) is False; valid here: auto, cpu"):
        run_cell(cfg_for(tmp_path, data_root, "device=cuda"), sweep_id="bad")
    assert snapshot() == before


def test_unreachable_tracking_server_fails_fast_naming_it(store, data_root, free_port):
    tmp_path, snapshot, before = store
    uri = f"http://127.0.0.1:{free_port()}"
    tic = time.perf_counter()
    with pytest.raises(ConnectionError, match=f"MLflow tracking server {uri} unreachable"):
        run_cell(cfg_for(tmp_path, data_root, f"mlflow.tracking_uri={uri}"), sweep_id="bad")
    assert time.perf_counter() - tic < 10
    assert snapshot() == before


def test_missing_and_corrupted_data_name_the_file_and_md5(store, data_root):
    tmp_path, snapshot, before = store
    empty = tmp_path / "nodata"
    with pytest.raises(Exception, match=f"train-images-idx3-ubyte  md5 {MD5['train-images-idx3-ubyte']}"):
        run_cell(cfg_for(tmp_path, data_root, f"data.root={empty}"), sweep_id="bad")
    broken = tmp_path / "broken"
    shutil.copytree(raw_dir(data_root), raw_dir(broken))
    (raw_dir(broken) / "t10k-images-idx3-ubyte").write_bytes(b"\0" * 100)
    with pytest.raises(Exception, match=f"corrupted .*t10k-images-idx3-ubyte: md5 .*, expected {MD5['t10k-images-idx3-ubyte']}"):
        run_cell(cfg_for(tmp_path, data_root, f"data.root={broken}"), sweep_id="bad")
    assert snapshot() == before


def test_unknown_group_choice_exits_non_zero_with_the_choices(tmp_path, data_root):
    proc = subprocess.run(sweep_cmd(tmp_path, data_root, "norm=batchnorm"), cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1
    assert "Could not find 'norm/batchnorm'" in proc.stderr
    assert all(f"\t{name}\n" in proc.stderr for name in ("bn", "gn16", "gn4", "in", "none"))
    assert not (tmp_path / "mlflow.db").exists()
