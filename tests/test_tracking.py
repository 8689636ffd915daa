from __future__ import annotations

import socket
import subprocess
import time

import pytest
from mlflow.tracking import MlflowClient

from gaexp import tracking
from gaexp.hooks import EvalPoint


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
    history = [EvalPoint(300, 0.5, 0.9, 100.0), EvalPoint(600, 0.25, 0.95, 120.0), EvalPoint(900, 0.2, 0.94, 130.0)]
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
    client, experiment_id, _ = store
    now = float(int(time.time()))  # whole seconds, as heartbeats are stored: the ages below are exact
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: no process has this pid now
    with tracking.tracked_run(client, experiment_id, "alive", {}) as alive:
        dead = client.create_run(experiment_id, run_name="dead", tags={tracking.HOST: f"{socket.gethostname()}:{gone.pid}",
                                                                        tracking.HEARTBEAT: f"{now:.0f}"})
        silent = client.create_run(experiment_id, run_name="silent", tags={tracking.HOST: "elsewhere:1",
                                                                            tracking.HEARTBEAT: f"{now - 7200:.0f}"})
        recent = client.create_run(experiment_id, run_name="recent", tags={tracking.HOST: "elsewhere:2",
                                                                            tracking.HEARTBEAT: f"{now - 3599:.0f}"})
        marked = tracking.mark_stale_runs(client, experiment_id, stale_after_s=3600, now=now)
        assert sorted(marked) == [f"dead (process {gone.pid} on {socket.gethostname()} is gone)",
                                  "silent (no heartbeat for 7200 s)"]
        assert client.get_run(alive).info.status == "RUNNING"  # this very process: alive
        assert client.get_run(recent.info.run_id).info.status == "RUNNING"  # heard from 3599 s ago: not yet stale
    assert client.get_run(dead.info.run_id).info.status == "KILLED"
    assert client.get_run(silent.info.run_id).data.tags["gaexp.killed_reason"] == "no heartbeat for 7200 s"


def test_a_resumed_sweep_claims_the_runs_it_skipped(store):
    client, experiment_id, _ = store
    with tracking.tracked_run(client, experiment_id, "r", {"sweep_id": "s1", tracking.SWEEPS: "s1"}) as run_id:
        pass
    tracking.add_to_sweep(client, client.get_run(run_id), "s2")
    tracking.add_to_sweep(client, client.get_run(run_id), "s2")
    run = client.get_run(run_id)
    assert tracking.sweeps_of(run) == ["s1", "s2"] and run.data.tags["sweep_id"] == "s1"
