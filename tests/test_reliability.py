"""Faults injected into real sweeps and real stores: kills, failing cells, parallel writers, bad input."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import time

import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient

from gaexp import tracking
from gaexp.callbacks import prepare
from gaexp.machine import threads_for
from gaexp.data.catalog import data_config
from gaexp.data.idx import raw_dir

MD5 = data_config("mnist").files
from tests.conftest import TINY, kill_when

LONGER = ["train.num_iterations=40", "train.eval_period=20"]  # long enough for a kill to land mid-sweep
# The cells evaluate 1,000 held-out training images instead of the 10,000 test images (a tenth of the cost of
# each evaluation): what is checked here (a failure, parallel writers) does not depend on which images.
HOLDOUT = "data.holdout=1000"
# Not in the killed sweep, whose cells must stay RUNNING long enough for the kill to land.


def run_statuses(db):
    """Read-only peek at the cells' run statuses (not the sweep's plan run, RUNNING throughout): an
    MlflowClient here could race the sweep's own store creation."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            return [row[0] for row in con.execute("SELECT status FROM runs WHERE name NOT LIKE 'sweep-%'")]
    except sqlite3.Error:
        return []


@pytest.mark.slow
def test_killed_sweep_resumes_without_rerunning_finished_cells(tmp_path, gaexp_argv, gaexp_command, training_runs):
    """training_runs (by name) is read only before the resume, while every cell has one run."""
    grid = ["norm=gn4,none", "regime=bs16a1,bs4a4", "seed=1", *LONGER]
    proc = subprocess.Popen(gaexp_argv(tmp_path, *grid), cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    kill_when(proc, lambda: {"FINISHED", "RUNNING"} <= set(run_statuses(tmp_path / "mlflow.db")))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    _, before = training_runs(uri)
    finished_before = {name: r.info.run_id for name, r in before.items() if r.info.status == "FINISHED"}
    killed = [r.info.run_id for r in before.values() if r.info.status == "RUNNING"]
    assert finished_before and len(killed) == 1 and len(before) < 4

    again = gaexp_command(tmp_path, *grid)
    assert again.returncode == 0, again.stderr[-3000:]
    skipped = [line.split()[0] for line in again.stdout.splitlines() if " SKIPPED (" in line]  # progress lines
    assert sorted(skipped) == sorted(finished_before)
    client = MlflowClient(uri)
    after = client.search_runs([client.get_experiment_by_name("gaexp").experiment_id], "tags.norm != ''")
    finished = {r.info.run_name: r.info.run_id for r in after if r.info.status == "FINISHED"}
    assert sorted(finished) == ["gn4-bs16a1-s1", "gn4-bs4a4-s1", "none-bs16a1-s1", "none-bs4a4-s1"]
    assert all(finished[name] == run_id for name, run_id in finished_before.items())  # not rerun
    assert sorted(r.info.status for r in after) == ["FINISHED"] * 4 + ["KILLED"]  # none left RUNNING
    stale = client.get_run(killed[0])
    assert stale.info.status == "KILLED" and "is gone" in stale.data.tags["gaexp.killed_reason"]
    plans = client.search_runs([stale.info.experiment_id], "tags.`gaexp.role` = 'sweep'",
                               order_by=["attributes.start_time ASC"])
    assert [p.info.status for p in plans] == ["KILLED", "FINISHED"]  # the killed sweep's plan, the resume's
    newest_report = max((tmp_path / "reports").iterdir())  # the resumed sweep's report counts all four cells
    assert pd.read_csv(newest_report / "runs.csv").run_id.nunique() == 4

    forced = gaexp_command(tmp_path, "norm=none", "regime=bs16a1", "seed=1", *LONGER, "rerun=true")
    assert forced.returncode == 0, forced.stderr[-3000:]
    experiment_id = client.get_experiment_by_name("gaexp").experiment_id
    assert len(client.search_runs([experiment_id], "attributes.run_name = 'none-bs16a1-s1'")) == 2


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_a_sweep_killed_alone_leaves_no_worker_and_its_rerun_trains_each_cell_once(tmp_path, gaexp_argv, gaexp_command):
    """SIGKILL of the sweep's own process only, as `kill -9 $!` does: its joblib workers, which never hear of it,
    stop at their next step (runs KILLED, the reason said) and exit; the rerun started at once waits for a cell
    still training in such a worker instead of training it beside it: one FINISHED run per cell."""
    grid = ["norm=gn4,none", "regime=bs4a4", "seed=1", "train.num_iterations=60", "train.eval_period=30", HOLDOUT,
            "launch=joblib", "hydra.launcher.n_jobs=2"]
    proc = subprocess.Popen(gaexp_argv(tmp_path, *grid), cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while run_statuses(tmp_path / "mlflow.db").count("RUNNING") < 2 and proc.poll() is None:
            assert time.monotonic() < deadline, "the cells never ran"
            time.sleep(0.2)
        assert proc.poll() is None, "the sweep ended before its cells ran"
        os.kill(proc.pid, signal.SIGKILL)  # the sweep's process alone: its workers are orphans now
        proc.wait()
        again = gaexp_command(tmp_path, *grid)
        assert again.returncode == 0, again.stderr[-3000:]
        deadline = time.monotonic() + 60
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not group_alive(proc.pid), "a worker of the killed sweep still runs"
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("gaexp").experiment_id], "tags.norm != ''")
    finished = sorted(r.info.run_name for r in runs if r.info.status == "FINISHED")
    assert finished == ["gn4-bs4a4-s1", "none-bs4a4-s1"]  # each cell trained to its end once
    stopped = [r for r in runs if r.info.status != "FINISHED"]
    assert len(stopped) == 2 and {r.info.status for r in stopped} == {"KILLED"}
    assert all("is gone" in r.data.tags.get("gaexp.stopped_reason", r.data.tags.get("gaexp.killed_reason", ""))
               for r in stopped)


@pytest.mark.slow
def test_a_failing_cell_fails_alone_and_the_sweep_says_so(tmp_path, gaexp_command, training_runs):
    proc = gaexp_command(tmp_path, "norm=gn4", "regime=bs16a1", "train.lr=1e-3,1e30", HOLDOUT)
    assert proc.returncode == 1
    output = proc.stdout + proc.stderr
    assert "1 cell(s) failed, the others ran" in output
    assert "train.lr=1e+30" in output and "non-finite training loss (nan) at optimizer step 2" in output
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("gaexp").experiment_id], "tags.norm = 'gn4'")
    by_lr = {r.data.params["train.lr"]: r for r in runs}
    assert by_lr["0.001"].info.status == "FINISHED"
    failed = by_lr["1e+30"]
    assert failed.info.status == "FAILED" and failed.data.tags["diverged_step"] == "2"
    assert failed.data.tags["error"].startswith("DivergedError: non-finite training loss")
    assert "Traceback" in failed.data.tags["error.traceback"]


@pytest.mark.slow
def test_parallel_jobs_on_a_fresh_store_lose_nothing(tmp_path, gaexp_command, training_runs):
    proc = gaexp_command(tmp_path, "norm=gn4,none", "regime=bs16a1,bs4a4", "seed=1", "launch=joblib",
                         "hydra.launcher.n_jobs=4", HOLDOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client, runs = training_runs(f"sqlite:///{tmp_path}/mlflow.db")
    assert len(runs) == 4 and all(r.info.status == "FINISHED" for r in runs.values())
    for run in runs.values():
        for metric in ("valid_acc", "train_loss"):
            assert [m.step for m in client.get_metric_history(run.info.run_id, metric)] == [2, 4]
        # threads=auto with 4 jobs (the launch config's cells_at_once): the cores shared by 4, at least 1
        assert run.data.tags["threads"] == str(threads_for("auto", 4))


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


# Each bad value reaches `prepare`, the first thing a command does (PrepareCallback), and stops it there.
BAD = {
    "batch size": (["regime.batch_size=0"], ValueError, r"regime.batch_size=0; valid: an integer >= 1"),
    "accumulation": (["regime.num_accum=-2"], ValueError, r"regime.num_accum=-2; valid: an integer >= 1"),
    "iterations": (["train.num_iterations=0"], ValueError, r"train.num_iterations=0; valid: an integer >= 1"),
    "eval period": (["train.eval_period=0"], ValueError, r"train.eval_period=0; valid: an integer >= 1"),
    "learning rate": (["train.lr=-1"], ValueError, r"train.lr=-1.0; valid: a finite number > 0"),
    "device": (["device=tpu"], ValueError, r"device='tpu'; valid: auto, cpu, cuda"),
    "file store": (["mlflow.tracking_uri=./mlruns"], ValueError, r"mlflow.tracking_uri='./mlruns'; valid: sqlite"),
    "data source": (["data.sources=[usb]"], ValueError, r"data.sources=\['usb'\]; valid: a list of local, torchvision, pypi"),
    "dataset's source": (["data=fashion_mnist", "data.sources=[pypi]"], ValueError,
                         r"data.sources=\['pypi'\]; valid: a list of local, torchvision, debian \(the sources of "
                         r"data=fashion_mnist\)"),
    "dataset": (["data=cifar"], Exception, r"Could not find 'data/cifar'(.|\n)*Available options in 'data':\n\tcifar10\n"
                                           r"\tcifar100\n\tcustom\n\tfashion_mnist\n\tfortunes\n\timagefolder\n\tmnist\n\tsvhn\n"
                                           r"\ttextfolder"),
    "dataset offline": (["data=cifar10"], Exception, r"data=cifar10: no CIFAR10 files in .*/CIFAR10 \(looked for "
                                                     r"cifar-10-batches-py/data_batch_1, .*; put them there"),
    "hold-out": (["data.holdout=60000"], ValueError, r"data.holdout=60000; valid: an integer in \[0, 60000\)"),
    "training images": (["data.num_train=50000"], ValueError,
                        r"data.num_train=50000; valid: 60000 \(the images in train-images-idx3-ubyte of data=mnist\)"),
    "groups": (["norm=gn", "norm.groups=3"], ValueError,
               r"norm.groups=3 does not divide the channels \[32, 64, 128, 256\] of model=simple; "
               r"valid: \[1, 2, 4, 8, 16, 32\]"),
    "model": (["model=resnet"], Exception, r"Could not find 'model/resnet'(.|\n)*Available options in 'model':\n\tcustom\n\tgpt\n\tgpt_moe\n\tresnet20\n\tsimple"),
    "model target": (["model=custom", "model.target=mynets:build"], ValueError,
                     r"model.target='mynets:build': cannot import 'mynets' \(No module named 'mynets'\)"),
    "model groups": (["model=resnet20", "norm=gn", "norm.groups=32"], ValueError,
                     r"norm.groups=32 does not divide the channels \[16, 32, 64\] of model=resnet20; valid: \[1, 2, 4, 8, 16\]"),
    "device type": (["device=cpu", "device_type=cuda"], ValueError,
                    r"device_type='cuda'; valid: cpu, what device=cpu is here \(leave device_type to the run\)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_before_any_run(case, store, compose):
    tmp_path, snapshot, before = store
    overrides, error, message = BAD[case]
    with pytest.raises(error, match=message):
        prepare(compose(*TINY, *overrides, outputs=tmp_path))
    assert snapshot() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_asked_for_without_one(store, compose):
    tmp_path, snapshot, before = store
    with pytest.raises(ValueError, match=r"device='cuda' but torch.cuda.is_available\(\) is False; valid here: auto, cpu"):
        prepare(compose(*TINY, "device=cuda", outputs=tmp_path))
    assert snapshot() == before


def test_unreachable_tracking_server_fails_naming_it(store, compose, free_port):
    tmp_path, snapshot, before = store
    uri = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=f"MLflow tracking server {uri} unreachable"):
        prepare(compose(*TINY, f"mlflow.tracking_uri={uri}", outputs=tmp_path))
    assert snapshot() == before


def test_a_server_that_never_answers_fails_at_the_timeout():
    with socket.socket() as listener:  # accepts connections into its backlog, never replies
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        uri = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(ConnectionError, match=f"MLflow tracking server {uri} unreachable: .*timed out"):
            tracking.check_server(uri, timeout=0.5)


def test_missing_and_corrupted_data_name_the_file_and_md5(store, compose, data_root):
    tmp_path, snapshot, before = store
    empty = tmp_path / "nodata"
    with pytest.raises(Exception, match=f"train-images-idx3-ubyte  md5 {MD5['train-images-idx3-ubyte']}"):
        prepare(compose(*TINY, f"data.root={empty}", outputs=tmp_path))
    broken = tmp_path / "broken"
    shutil.copytree(raw_dir(data_config("mnist", data_root)), raw_dir(data_config("mnist", broken)))
    (raw_dir(data_config("mnist", broken)) / "t10k-images-idx3-ubyte").write_bytes(b"\0" * 100)
    with pytest.raises(Exception, match=f"corrupted .*t10k-images-idx3-ubyte: md5 .*, expected {MD5['t10k-images-idx3-ubyte']}"):
        prepare(compose(*TINY, f"data.root={broken}", outputs=tmp_path))
    assert snapshot() == before


@pytest.mark.slow
def test_the_command_refuses_bad_input_in_one_line_and_records_nothing(tmp_path, gaexp_command):
    unknown = gaexp_command(tmp_path, "norm=batchnorm")
    assert unknown.returncode == 1 and unknown.stderr.strip().splitlines() == [  # one line, not Hydra's 21
        "error: norm=batchnorm: no such norm; valid: bn, bn_kmom, bn_microeval, bn_precise, bn_sync, brn, custom, gn, gn16, gn4, "
        "in, in_affine, ln, none"]
    out_of_range = gaexp_command(tmp_path, "regime=bs4a4", "regime.batch_size=0")
    assert out_of_range.returncode == 1
    assert out_of_range.stderr.strip().splitlines()[-1] == "error: regime.batch_size=0; valid: an integer >= 1"
    assert not (tmp_path / "mlflow.db").exists()
    # a bad value on a swept axis: every cell is checked before the sweep records its plan or runs a cell (the
    # good cell norm.groups=8 comes first and would have run)
    swept = gaexp_command(tmp_path, "norm=gn", "norm.groups=8,3", "regime.batch_size=4")
    assert swept.returncode == 1
    assert swept.stderr.strip().splitlines() == ["error: cell norm.groups=3: norm.groups=3 does not divide the "
                                                 "channels [32, 64, 128, 256] of model=simple; valid: [1, 2, 4, 8, 16, 32]"]
    assert not (tmp_path / "mlflow.db").exists()  # every value of a swept axis checked before the store is made
    assert not list((tmp_path / "multirun").glob("*/*/"))  # no job folder either
