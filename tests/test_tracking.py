from __future__ import annotations

import copy
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from mlflow.entities import LoggedModelStatus
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from gaexp import liveness, tracking
from gaexp.config import RegimeConfig, TrainConfig
from gaexp.data.catalog import data_config
from gaexp.data.idx import raw_dir

MD5 = data_config("mnist").files
from gaexp.hooks import EvalPoint
from gaexp.model import SimpleModel
from gaexp.layers import MicroBatchEvalBatchNorm2d
from gaexp.norms import norm_layer
from gaexp.train import StepPlan, evaluate, train
from gaexp import memory
from gaexp import tags as runtags


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path}/db/mlflow.db"
    experiment_id = tracking.prepare_store(uri, "exp", str(tmp_path / "artifacts"))
    return MlflowClient(uri), experiment_id, tmp_path


def test_prepare_store_is_idempotent_with_an_explicit_artifact_location(store):
    client, experiment_id, tmp_path = store
    assert (tmp_path / "db" / "mlflow.db").is_file()
    assert tracking.prepare_store(f"sqlite:///{tmp_path}/db/mlflow.db", "exp", "ignored") == experiment_id
    assert client.get_experiment(experiment_id).artifact_location == (tmp_path / "artifacts").as_uri()


def test_a_deleted_experiment_is_a_clear_error(store):
    client, experiment_id, tmp_path = store
    client.delete_experiment(experiment_id)
    with pytest.raises(ValueError, match="'exp' .* is deleted"):
        tracking.prepare_store(f"sqlite:///{tmp_path}/db/mlflow.db", "exp", None)


def test_a_run_that_raises_ends_failed_with_the_error(store):
    client, experiment_id, _ = store
    with pytest.raises(RuntimeError):
        with tracking.tracked_run(client, experiment_id, "bn-bs1a16-s1", {"seed": 1}) as run_id:
            raise RuntimeError("boom")
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and run.info.run_name == "bn-bs1a16-s1"
    assert run.data.tags["error"] == "RuntimeError: boom" and "boom" in run.data.tags["error.traceback"]
    assert run.data.tags["seed"] == "1"


def test_histories_params_and_summary(store):
    client, experiment_id, _ = store
    history = [EvalPoint(300, 0.5, {"valid_acc": 0.9}, 100.0), EvalPoint(600, 0.25, {"valid_acc": 0.95}, 120.0),
               EvalPoint(900, 0.2, {"valid_acc": 0.94}, 130.0)]
    with tracking.tracked_run(client, experiment_id, "run", {}) as run_id:
        tracking.log_params(client, run_id, {"train": {"lr": 0.001, "num_iterations": 900}, "seed": 1})
        for point in history:
            tracking.log_eval_point(client, run_id, point)
        tracking.log_summary(client, run_id, history, wall_seconds=12.5)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"train.lr": "0.001", "train.num_iterations": "900", "seed": "1"}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "valid_acc")] == [(300, 0.9), (600, 0.95), (900, 0.94)]
    assert [m.value for m in client.get_metric_history(run_id, "train_loss")] == [0.5, 0.25, 0.2]
    assert run.data.metrics == {"valid_acc": 0.94, "train_loss": 0.2, "final_valid_acc": 0.94, "best_valid_acc": 0.95,
                                "wall_seconds": 12.5, "samples_per_sec": 130.0}


def test_flatten():
    assert tracking.flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": None}) == {"a.b": 1, "a.c.d": [1, 2], "e": None}


def test_protocol_key_ignores_what_cannot_change_a_result():
    base = {"norm": {"name": "bn"}, "regime": {"batch_size": 1, "num_accum": 16}, "seed": 1, "train": {"lr": 0.001},
            "device": "auto", "paths": {"outputs": "/a"}, "mlflow": {"tracking_uri": "sqlite:////a/m.db"},
            "progress": None, "threads": "auto", "compile": False, "rerun": False, "data": {"root": "/a/data"},
            "cells_at_once": None, "analysis": {"window_start": 250}}
    key = tracking.protocol_key(base)
    moved = {**base, "paths": {"outputs": "/b"}, "mlflow": {"tracking_uri": "http://h:5000"}, "threads": 1,
             "progress": True, "rerun": True, "data": {"root": "/b/data"}, "cells_at_once": 4,
             "analysis": {"window_start": 0}}
    assert tracking.protocol_key(moved) == key and len(key) == 16
    assert tracking.protocol_key({**base, "seed": 2}) != key
    assert tracking.protocol_key({**base, "train": {"lr": 0.01}}) != key


def test_stale_running_runs_are_marked_killed(store):
    """A run names its process by host, pid and the process's start time: a pid the system has given to a new
    process since (here: this very test process, with another start time) is gone. No process is killed or
    waited for: nothing depends on when the system reuses a pid."""
    client, experiment_id, _ = store
    now = float(int(time.time()))  # whole seconds, as heartbeats are stored: the ages below are exact
    here, me = socket.gethostname(), os.getpid()
    with tracking.tracked_run(client, experiment_id, "alive", {}) as alive:
        assert client.get_run(alive).data.tags[runtags.PROCESS_START] == liveness.process_start(me)
        reused = client.create_run(experiment_id, run_name="reused", tags={
            runtags.HOST: f"{here}:{me}", runtags.PROCESS_START: "1", runtags.HEARTBEAT: f"{now:.0f}"})
        older = client.create_run(experiment_id, run_name="older", tags={  # recorded before the start time was
            runtags.HOST: f"{here}:{me}", runtags.HEARTBEAT: f"{now:.0f}"})
        silent = client.create_run(experiment_id, run_name="silent", tags={runtags.HOST: "elsewhere:1",
                                                                            runtags.HEARTBEAT: f"{now - 7200:.0f}"})
        recent = client.create_run(experiment_id, run_name="recent", tags={runtags.HOST: "elsewhere:2",
                                                                            runtags.HEARTBEAT: f"{now - 3599:.0f}"})
        marked = tracking.mark_stale_runs(client, experiment_id, stale_after_s=3600, now=now)
        assert sorted(marked) == [f"reused (process {me} on {here} is gone)", "silent (no heartbeat for 7200 s)"]
        assert client.get_run(alive).info.status == "RUNNING"  # this very process: alive
        assert client.get_run(older.info.run_id).info.status == "RUNNING"  # its pid runs: taken as alive
        assert client.get_run(recent.info.run_id).info.status == "RUNNING"  # heard from 3599 s ago: not yet stale
    assert client.get_run(reused.info.run_id).info.status == "KILLED"
    assert client.get_run(silent.info.run_id).data.tags["gaexp.killed_reason"] == "no heartbeat for 7200 s"


def test_the_runs_a_dead_worker_left_running_end_failed_with_why(store):
    """A launcher's worker killed in its cell (gaexp_grid_sweeper/joblib_launcher.py): its RUNNING run ends FAILED
    with the reason as its error; another process's runs, and its own that had ended, stay as they are."""
    client, experiment_id, _ = store
    here = socket.gethostname()
    left = client.create_run(experiment_id, run_name="left", tags={runtags.HOST: f"{here}:4711"}).info.run_id
    other = client.create_run(experiment_id, run_name="other", tags={runtags.HOST: f"{here}:4712"}).info.run_id
    done = client.create_run(experiment_id, run_name="done", tags={runtags.HOST: f"{here}:4711"}).info.run_id
    client.set_terminated(done, "FINISHED")
    elsewhere = client.create_run(experiment_id, run_name="elsewhere", tags={runtags.HOST: "elsewhere:4711"}).info.run_id
    assert tracking.fail_runs_of(client, experiment_id, 4711, "worker 4711 killed by SIGKILL") == ["left"]
    assert client.get_run(left).info.status == "FAILED"
    assert client.get_run(left).data.tags["error"] == "worker 4711 killed by SIGKILL"
    assert [client.get_run(r).info.status for r in (other, done, elsewhere)] == ["RUNNING", "FINISHED", "RUNNING"]


def test_a_dead_worker_is_said_by_its_signal_memory_and_who_sends_it(tmp_path):
    assert liveness.death(-9, 1_395_864_371, oom_killed=True) == (
        "killed by SIGKILL, holding 1.3 GiB (the kernel's out-of-memory killer)")
    assert liveness.death(-9) == "killed by SIGKILL (the kernel's out-of-memory killer sends it, as does `kill -9`)"
    assert liveness.death(-11).startswith("killed by SIGSEGV (a crash in native code")
    assert liveness.death(3) == "exited with status 3" and liveness.death(None) == "ended (its exit code unknown)"
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n")  # cgroup v2's format
    assert liveness.oom_kills(events) == 2 and liveness.oom_kills(tmp_path / "none") is None
    assert memory.rss_bytes(os.getpid()) > 10 * 2**20 and memory.rss_bytes(2**22 + 1) is None


def test_a_process_is_known_by_its_pid_and_start_time():
    me = os.getpid()
    started = liveness.process_start(me)
    assert started.isdigit() and liveness.process_start(me) == started  # stable for the process's life
    assert liveness.process_alive(me, started) and liveness.process_alive(me)
    assert not liveness.process_alive(me, str(int(started) + 1))  # same pid, another process
    assert liveness.process_start(2**22 + 1) is None and not liveness.process_alive(2**22 + 1)  # above pid_max


def fake_sacct(tmp_path, monkeypatch, states: dict[str, str]) -> None:
    """An `sacct` on PATH that answers `-j JOB ... -o State` from `states` (nothing for other jobs)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cases = "".join(f'    {job}) echo "{state}";;\n' for job, state in states.items())
    (bin_dir / "sacct").write_text(f'#!/bin/sh\nwhile [ "$1" != "-j" ]; do shift; done\ncase "$2" in\n{cases}esac\n')
    (bin_dir / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_runs_of_ended_slurm_jobs_are_marked_killed(store, monkeypatch):
    client, experiment_id, tmp_path = store
    fake_sacct(tmp_path, monkeypatch, {"41_0": "CANCELLED by 0", "41_1": "RUNNING", "42": "TIMEOUT"})
    now = float(int(time.time()))
    runs = {job: client.create_run(experiment_id, run_name=f"job-{job}", tags={
        runtags.HOST: "node7:123", runtags.HEARTBEAT: f"{now:.0f}", runtags.SLURM_JOB: job}).info.run_id
        for job in ("41_0", "41_1", "42", "43")}  # 43: unknown to accounting (too old, or another cluster)
    marked = tracking.mark_stale_runs(client, experiment_id, stale_after_s=3600, now=now)
    assert sorted(marked) == ["job-41_0 (SLURM job 41_0 ended CANCELLED)", "job-42 (SLURM job 42 ended TIMEOUT)"]
    assert [client.get_run(runs[j]).info.status for j in ("41_0", "41_1", "42", "43")] == [
        "KILLED", "RUNNING", "KILLED", "RUNNING"]
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # no SLURM here: the heartbeat decides
    assert sorted(tracking.mark_stale_runs(client, experiment_id, stale_after_s=3600, now=now + 3601)) == [
        "job-41_1 (no heartbeat for 3601 s)", "job-43 (no heartbeat for 3601 s)"]


def test_a_run_in_a_slurm_job_is_tagged_with_it(store, monkeypatch):
    client, experiment_id, _ = store
    assert liveness.slurm_job({"SLURM_JOB_ID": "77", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3"}) == "70_3"
    assert liveness.slurm_job({"SLURM_JOB_ID": "77"}) == "77" and liveness.slurm_job({}) is None
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    with tracking.tracked_run(client, experiment_id, "here", {}) as here:
        pass
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    with tracking.tracked_run(client, experiment_id, "in-a-job", {}) as in_job:
        pass
    assert runtags.SLURM_JOB not in client.get_run(here).data.tags
    assert client.get_run(in_job).data.tags[runtags.SLURM_JOB] == "77"


def test_a_resumed_sweep_claims_the_runs_it_skipped(store):
    client, experiment_id, _ = store
    with tracking.tracked_run(client, experiment_id, "r", {"sweep_id": "s1", runtags.SWEEPS: "s1"}) as run_id:
        pass
    tracking.add_to_sweep(client, client.get_run(run_id), "s2")
    tracking.add_to_sweep(client, client.get_run(run_id), "s2")
    run = client.get_run(run_id)
    assert tracking.sweeps_of(run) == ["s1", "s2"] and run.data.tags["sweep_id"] == "s1"


# --- a run's datasets and model --------------------------------------------------------------------

def test_the_data_is_logged_as_the_runs_inputs_named_digested_and_in_context(store):
    client, experiment_id, tmp_path = store
    directory = raw_dir(data_config("mnist", tmp_path / "data"))
    with tracking.tracked_run(client, experiment_id, "test-set", {}) as plain:
        tracking.log_data_inputs(client, plain, "mnist", directory, MD5, holdout=0, num_training=60_000,
                                 num_validation=10_000)
    with tracking.tracked_run(client, experiment_id, "held-out", {}) as held:
        tracking.log_data_inputs(client, held, "mnist", directory, MD5, holdout=10_000, num_training=50_000,
                                 num_validation=10_000)

    def logged(run_id):
        return [(d.dataset.name, d.dataset.digest, {t.key: t.value for t in d.tags}["mlflow.data.context"],
                 json.loads(d.dataset.profile)["num_samples"], json.loads(d.dataset.profile)["selection"])
                for d in client.get_run(run_id).inputs.dataset_inputs]

    assert sorted(logged(plain)) == [
        ("mnist-test", "cb2a29a1639ddd87e498b526f8599460", "validation", 10_000, "all"),
        ("mnist-train", "67971ad41c74e2135ae051b67d0e5f16", "training", 60_000, "all")]
    assert sorted(logged(held)) == [
        ("mnist-holdout10000", "8c4a97811100da113d41187c6d4c43c6", "validation", 10_000, "held:holdout=10000:seed=0"),
        ("mnist-train-minus10000", "020a0dfbe6a3713eacd4ea600b9a25b8", "training", 50_000, "kept:holdout=10000:seed=0")]
    # the digest: MD5 of the files' sorted MD5s and the selection, 32 characters (MLflow keeps 36)
    train_md5s = sorted([MD5["train-images-idx3-ubyte"], MD5["train-labels-idx1-ubyte"]])
    assert hashlib.md5(json.dumps([train_md5s, "all"]).encode()).hexdigest() == "67971ad41c74e2135ae051b67d0e5f16"
    test = next(d.dataset for d in client.get_run(plain).inputs.dataset_inputs if d.dataset.name == "mnist-test")
    assert json.loads(test.profile)["files_md5"] == {"t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
                                                     "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637"}
    assert test.source_type == "local" and json.loads(test.source) == {"uri": directory.as_uri()}


def test_files_that_are_not_a_train_and_a_test_split_are_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"mnist: expected train-\* and t10k-\* files, got \['a', 'b'\]"):
        tracking.data_inputs("mnist", tmp_path, {"a": "0", "b": "1"}, 0, 1, 1)


def batch_statistics(model: torch.nn.Module, micro_batch: int) -> torch.nn.Module:
    """As in docs/tracking.md#reloading-a-runs-model: every BatchNorm2d evaluated with the statistics of each group
    of `micro_batch` images (bn_microeval's layer) instead of its running averages, same weights."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is torch.nn.BatchNorm2d:
                swap = MicroBatchEvalBatchNorm2d(child.num_features, micro_batch)
                swap.load_state_dict(child.state_dict())
                setattr(parent, name, swap)
    return model


@pytest.fixture(scope="module")
def trained_bn(train_split, small_valid):
    """The study's model (bn, channels_last as app.build makes it) after 40 steps of 16 images, and its history."""
    torch.manual_seed(1)
    model = SimpleModel(norm_layer("bn")).to("cpu", memory_format=torch.channels_last)
    history = train(model, train_split, small_valid, TrainConfig(num_iterations=40, eval_period=20), StepPlan(RegimeConfig(16, 1),
                    1))
    return model, history


def test_the_model_is_logged_reloaded_and_evaluated_again_without_retraining(store, trained_bn, small_valid):
    client, experiment_id, _ = store
    model, history = trained_bn
    with tracking.tracked_run(client, experiment_id, "bn-bs16a1-s1", {"norm": "bn"}) as run_id:
        tracking.log_params(client, run_id, {"norm": {"name": "bn"}, "seed": 1})
        for point in history:
            tracking.log_eval_point(client, run_id, point)
        tracking.log_summary(client, run_id, history, wall_seconds=1.0)
        model_id = tracking.log_model(client, run_id, model, step=40)

    logged = client.get_logged_model(model_id)
    assert (logged.name, logged.source_run_id, logged.status, logged.params) == (
        "model", run_id, LoggedModelStatus.READY, {"norm.name": "bn", "seed": "1"})
    assert [(o.model_id, o.step) for o in client.get_run(run_id).outputs.model_outputs] == [(model_id, 40)]
    assert {m.key: m.value for m in logged.metrics}["final_valid_acc"] == history[-1].value

    reloaded = tracking.load_model(client.tracking_uri, run_id)
    assert type(reloaded) is SimpleModel and not reloaded.training and reloaded is not model
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))
    running = evaluate(model, small_valid)  # BatchNorm's running averages
    assert running["valid_acc"] == history[-1].value > 0.2  # trained: above chance (0.41 here)
    assert evaluate(reloaded, small_valid) == running
    # another BatchNorm evaluation mode on the reloaded weights: the statistics of each 16 images, as trained
    as_trained = evaluate(batch_statistics(reloaded, 16), small_valid)
    assert as_trained == evaluate(batch_statistics(copy.deepcopy(model), 16), small_valid)
    assert as_trained["valid_acc"] > running["valid_acc"] + 0.2  # 0.866 here: 40 steps leave the running averages behind


def test_a_model_is_saved_with_requirements_read_from_this_environment_and_no_scan_of_every_package(
        store, trained_bn, monkeypatch):
    """MLflow's check of a model's requirements against the installed packages maps every distribution's files
    first (1.7 s a process here): gaexp's requirements are read from those very packages, so it is skipped."""
    from importlib.metadata import version

    from mlflow.utils import requirements_utils

    scans = []
    monkeypatch.setattr(requirements_utils, "_MODULES_TO_PACKAGES", None)  # as in a fresh process
    monkeypatch.setattr(requirements_utils.importlib_metadata, "packages_distributions", lambda: scans.append(1) or {})
    client, experiment_id, _ = store
    with tracking.tracked_run(client, experiment_id, "bn-bs16a1-s1", {"norm": "bn"}) as run_id:
        model_id = tracking.log_model(client, run_id, trained_bn[0])
    assert scans == []
    folder = client.get_logged_model(model_id).artifact_location.removeprefix("file://")
    assert f"torch=={version('torch')}" in (Path(folder) / "requirements.txt").read_text().split()


def test_a_run_without_a_model_is_a_clear_error(store):
    client, experiment_id, _ = store
    with tracking.tracked_run(client, experiment_id, "no-model", {}) as run_id:
        pass
    with pytest.raises(ValueError, match=r"run 'no-model' \(\w+\) in sqlite:.* logged no model \(status FINISHED"):
        tracking.load_model(client.tracking_uri, run_id)


def test_cells_racing_to_create_the_same_dataset_all_log_it(store):
    """Cells started together insert the same dataset row at once; the loser of the race logs again."""
    client, experiment_id, tmp_path = store
    directory = raw_dir(data_config("mnist", tmp_path))
    run_ids = [client.create_run(experiment_id, run_name=f"cell{i}").info.run_id for i in range(6)]
    start = threading.Barrier(len(run_ids))

    def log(run_id):
        start.wait()
        tracking.log_data_inputs(client, run_id, "mnist", directory, MD5, 0, 60_000, 10_000)

    threads = [threading.Thread(target=log, args=(r,)) for r in run_ids]
    errors = []
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        threading.excepthook = threading.__excepthook__
    assert errors == []
    assert all(sorted(d.dataset.name for d in client.get_run(r).inputs.dataset_inputs) == ["mnist-test", "mnist-train"]
               for r in run_ids)

    class Racing:  # the store's answer to the loser, as a server sends it, then success
        def __init__(self, message):
            self.message, self.calls = message, 0

        def log_inputs(self, run_id, datasets):
            self.calls += 1
            if self.calls == 1:
                raise MlflowException(self.message)

    lost = Racing("BAD_REQUEST: (sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, "
                  "datasets.name, datasets.digest")
    tracking.log_data_inputs(lost, "r", "mnist", directory, MD5, 0, 60_000, 10_000)
    assert lost.calls == 2
    other = Racing("RESOURCE_DOES_NOT_EXIST: run r not found")  # any other error is not retried
    with pytest.raises(MlflowException, match="not found"):
        tracking.log_data_inputs(other, "r", "mnist", directory, MD5, 0, 60_000, 10_000)
    assert other.calls == 1


@pytest.mark.slow
def test_inputs_and_model_through_a_tracking_server(server, tmp_path, trained_bn, small_valid):
    uri, _ = server
    model, _ = trained_bn
    client = MlflowClient(uri)
    experiment_id = tracking.prepare_store(uri, "exp", None)
    with tracking.tracked_run(client, experiment_id, "bn-bs16a1-s1", {}) as run_id:
        tracking.log_data_inputs(client, run_id, "mnist", raw_dir(data_config("mnist", tmp_path)), MD5, 0, 60_000,
                                 10_000)
        model_id = tracking.log_model(client, run_id, model)
    assert sorted(d.dataset.name for d in client.get_run(run_id).inputs.dataset_inputs) == ["mnist-test", "mnist-train"]
    assert client.get_logged_model(model_id).artifact_location.startswith("mlflow-artifacts:")
    reloaded = tracking.load_model(uri, run_id)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))
    assert evaluate(reloaded, small_valid) == evaluate(model, small_valid)


def test_what_a_run_logs_is_what_the_metrics_declare(tmp_path):
    """A run's metrics are exactly the declared ones (gaexp/metrics.py): histories per evaluation, the rest once."""
    from gaexp import metrics

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = tracking.prepare_store(client.tracking_uri, "gaexp", str(tmp_path / "artifacts"))
    run_id = client.create_run(experiment).info.run_id
    history = [EvalPoint(2, 1.5, {"valid_acc": 0.25}, 100.0), EvalPoint(4, 1.0, {"valid_acc": 0.5}, 120.0)]
    for point in history:
        tracking.log_eval_point(client, run_id, point)
    tracking.log_summary(client, run_id, history, 3.0, {metrics.ACTIVATION_MB.name: 1.0, metrics.PEAK_RSS_MB.name: 9.0})
    logged = client.get_run(run_id).data.metrics
    declared = {m.name: m for m in metrics.METRICS}
    assert set(logged) <= set(declared)
    for name in logged:
        steps = [m.step for m in client.get_metric_history(run_id, name)]
        assert steps == ([2, 4] if declared[name].per == metrics.EVALUATION else [4]), name
    assert metrics.HISTORIES == ("valid_acc", "valid_loss", "valid_ppl", "expert_load_max", "expert_load_cv", "train_loss")
    assert {"valid_acc", "train_loss"} == {*history[0].valid, "train_loss"}  # what an image run logs of them


def test_a_tracking_uri_with_a_password_reaches_the_server_as_basic_auth(monkeypatch):
    """urllib would take `user:pass@host` for the host's name; the health check sends the user and password
    (percent-decoded) as MLflow's client does, to the host alone, and an error names the URI masked."""
    import base64
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append((self.path, self.headers.get("Host"), self.headers.get("Authorization")))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            pass

    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    with ThreadingHTTPServer(("127.0.0.1", 0), Health) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        port = httpd.server_address[1]
        tracking.check_server(f"http://carol:Car0l%2FPa%40ss%20w%C3%A9@127.0.0.1:{port}/")
        tracking.check_server(f"http://127.0.0.1:{port}")
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "dave")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "fr0m-env")
        tracking.check_server(f"http://127.0.0.1:{port}")
        httpd.shutdown()
    token = base64.b64encode("carol:Car0l/Pa@ss wé".encode()).decode()
    assert seen == [("/health", f"127.0.0.1:{port}", f"Basic {token}"), ("/health", f"127.0.0.1:{port}", None),
                    ("/health", f"127.0.0.1:{port}", f"Basic {base64.b64encode(b'dave:fr0m-env').decode()}")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(ConnectionError) as refused:
        tracking.check_server(f"http://carol:Car0lUrlPassw0rdZ@127.0.0.1:{closed}", timeout=0.5)
    assert str(refused.value).startswith(f"MLflow tracking server http://carol:***@127.0.0.1:{closed} unreachable: ")


def test_logging_a_model_loads_no_lightning_and_leaves_it_importable():
    """mlflow.pytorch imports Lightning (and through it torchmetrics and transformers, 2 s of CPU) for an
    autologging callback gaexp never uses, where Lightning is installed, as the test extra installs it:
    gaexp's flavour leaves it out, and an import of Lightning after still works."""
    probe = ("import sys; from gaexp.tracking.models import pytorch_flavour; f = pytorch_flavour(); "
             "print(f.__name__, sorted({'pytorch_lightning', 'lightning', 'transformers'} & set(sys.modules))); "
             "import pytorch_lightning; print(pytorch_lightning.__name__)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.stdout.splitlines() == ["mlflow.pytorch []", "pytorch_lightning"], done.stderr[-2000:]
