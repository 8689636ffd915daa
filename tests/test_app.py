"""The application end to end: the real command as a subprocess, then MLflow client assertions."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import optuna
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from gaexp import analysis, app, callbacks, cell, liveness, progress
from gaexp.data import batches, idx
from gaexp import tags as runtags
from gaexp import train as train_module
from gaexp.model import make_model
from gaexp.app import hydra_sweep_problem
from gaexp.callbacks import prepare, report_command
from gaexp.cell import run_cell
from gaexp.machine import threads_for
from gaexp.config import composition_problem
from gaexp.config import AnalysisConfig
from hydra_plugins.gaexp_optuna_sweeper._space import split_arguments
from hydra_plugins.gaexp_optuna_sweeper.trials import open_storage
from tests.conftest import TINY
from tests.test_batched import USER_NORM, USER_NORM_FILE


def prepared(cfg):
    """What PrepareCallback does once per command, then the config for run_cell."""
    prepare(cfg)
    return cfg


def test_run_cell_returns_the_final_accuracy_it_logged(tmp_path, compose):
    cfg = prepared(compose(*TINY, "norm=gn16", "regime=bs4a4", "train.num_iterations=3", outputs=tmp_path))
    accuracy = run_cell(cfg, sweep_id="test")
    client = MlflowClient(cfg.mlflow.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gaexp").experiment_id])
    assert run.info.run_name == "gn16-bs4a4-s1" and run.info.status == "FINISHED"
    assert run.data.metrics["final_valid_acc"] == accuracy
    assert run.data.tags["gaexp.cpu"].endswith(f" ({torch.backends.cpu.get_cpu_capability()})")  # what repeats it
    assert [m.step for m in client.get_metric_history(run.info.run_id, "valid_acc")] == [2, 3]
    assert run.data.params["regime.batch_size"] == "4" and run.data.params["train.num_iterations"] == "3"
    assert run.data.params["mlflow.tracking_uri"] == f"sqlite:///{tmp_path}/mlflow.db"
    assert run.data.metrics["peak_rss_mb"] > 0  # the bound is checked in the sweep's own process below
    assert run.data.metrics["activation_mb"] == pytest.approx(1.9116, rel=1e-3)  # GroupNorm(16), 4 images: ~0.48 MiB each


@pytest.mark.parametrize("objective", ["window", "final"])
def test_a_trial_returns_the_reports_windowed_mean_or_the_final_accuracy(tmp_path, compose, objective):
    """One metric from search to report: a trial returns the mean of its evaluations at step >
    analysis.window_start (here 2 and 4 of 2, 4, 6), or with objective=final the last one; so does the
    same trial's cell when it is skipped as already FINISHED."""
    storage = str(tmp_path / "optuna.journal")
    study = optuna.create_study(study_name="s", storage=open_storage(storage), direction="maximize")
    study.ask()
    cfg = prepared(compose(*TINY, "norm=gn4", "regime=bs4a4", "train.num_iterations=6", "analysis.window_start=1",
                           f"analysis.objective={objective}", f"optuna.storage={storage}", "optuna.study=s",
                           "optuna.trial=0", outputs=tmp_path))
    value = run_cell(cfg, sweep_id="test")
    client = MlflowClient(cfg.mlflow.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gaexp").experiment_id])
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "valid_acc")}
    assert sorted(history) == [2, 4, 6] and len(set(history.values())) == 3  # three different accuracies
    expected = (history[2] + history[4] + history[6]) / 3 if objective == "window" else history[6]
    assert value == pytest.approx(expected, abs=1e-12)
    assert run_cell(cfg, sweep_id="again") == value  # skipped: the same value, from the run's history


def test_a_search_refuses_a_window_its_trials_never_reach(tmp_path, compose):
    cfg = compose(*TINY, "hydra/sweeper=gaexp_optuna", "hydra.sweeper.direction=maximize", "train.num_iterations=250",
                  "analysis.window_start=250",
                  outputs=tmp_path, hydra=True)  # the last evaluation at step 250 is not after 250
    with pytest.raises(ValueError, match=r"analysis.window_start=250: a trial of train.num_iterations=250 has no "
                                         r"evaluation after it, so analysis.objective=window has no value; lower "
                                         r"analysis.window_start or set analysis.objective=final"):
        prepare(cfg)
    assert not (tmp_path / "mlflow.db").exists()  # refused before the store is made
    prepare(compose(*TINY, "hydra/sweeper=gaexp_optuna", "hydra.sweeper.direction=maximize", "train.num_iterations=200",
                    "analysis.window_start=250",
                    "analysis.objective=final", outputs=tmp_path, hydra=True))  # the final evaluation always exists
    prepare(compose(*TINY, "train.num_iterations=200", "analysis.window_start=250", outputs=tmp_path,
                    hydra=True))  # a grid: its report says what it lacks; no trial returns a window


def fake_dataset_overrides(root: Path, dataset: str, torchvision: str, num_train: int = 64,
                           num_test: int = 32, numbered: bool = False) -> list[str]:
    """A made-up dataset of four IDX files in the real shapes under `root`, and the overrides that select it
    with these files' MD5s patched in: offline, and fast. `numbered`: training image i has every pixel i,
    test image j every pixel 255 - j (so a tensor of images says which ones it holds)."""
    raw = root / torchvision / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    shapes = [(num_train, 28, 28), (num_train,), (num_test, 28, 28), (num_test,)]
    overrides = [f"data={dataset}", f"data.root={root}", "data.sources=[local]", f"data.num_train={num_train}"]
    for name, shape in zip(idx.IDX_NAMES, shapes):
        array = rng.integers(0, 10 if len(shape) == 1 else 256, shape)
        if numbered and len(shape) == 3:
            ids = np.arange(shape[0]) if name.startswith("train") else 255 - np.arange(shape[0])
            array = np.broadcast_to(ids[:, None, None], shape)
        content = idx._idx_bytes(array.astype(np.uint8))
        (raw / name).write_bytes(content)
        overrides.append(f"data.files.{name}={hashlib.md5(content).hexdigest()}")
    return overrides


def test_a_fashion_mnist_cell_is_its_own_run_tagged_with_its_data(tmp_path, compose):
    fashion = fake_dataset_overrides(tmp_path / "fashion", "fashion_mnist", "FashionMNIST")
    cell = [*TINY, "norm=bn", "regime=bs4a4", "train.num_iterations=3", "data.holdout=0"]
    run_cell(prepared(compose(*cell, outputs=tmp_path)), sweep_id="s1")  # the same cell on MNIST first
    cfg = prepared(compose(*cell, *fashion, outputs=tmp_path))
    accuracy = run_cell(cfg, sweep_id="s1")  # not skipped: the MNIST run is another protocol
    assert run_cell(cfg, sweep_id="s2") == accuracy  # skipped: its own FINISHED run

    client = MlflowClient(cfg.mlflow.tracking_uri)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("gaexp").experiment_id])}
    assert sorted(runs) == ["bn-bs4a4-s1", "fashion_mnist-bn-bs4a4-s1"]
    run, mnist = runs["fashion_mnist-bn-bs4a4-s1"], runs["bn-bs4a4-s1"]
    assert (run.data.tags["dataset"], mnist.data.tags["dataset"]) == ("fashion_mnist", "mnist")
    assert run.data.tags["protocol_key"] != mnist.data.tags["protocol_key"]
    assert run.data.params["data.dataset"] == "fashion_mnist" and run.data.params["data.torchvision"] == "FashionMNIST"
    inputs = {d.dataset.name: json.loads(d.dataset.profile)["num_samples"] for d in run.inputs.dataset_inputs}
    assert inputs == {"fashion_mnist-train": 64, "fashion_mnist-test": 32}
    history = client.get_metric_history(run.info.run_id, "valid_acc")
    assert [m.step for m in history] == [2, 3] and history[-1].value == accuracy
    assert (accuracy * 32) == round(accuracy * 32)  # evaluated on its 32 test images, not MNIST's 10,000


NORM_FILE = """
# InstanceNorm that keeps running statistics and evaluates with them: a norm in one file, no code of its own
defaults:
  - /schema/norm/custom@_here_
  - _self_
name: in_running
target: torch.nn:InstanceNorm2d
params: {affine: true, track_running_stats: true}
"""

MODEL_FILE = """
from torch import nn


def build(norm_layer, in_channels, num_classes):
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3, stride=2), norm_layer(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, num_classes))
"""


def test_a_norm_and_a_model_each_added_in_one_file_of_ones_own_folder_run_a_cell(tmp_path, compose, monkeypatch):
    (tmp_path / "mine" / "norm").mkdir(parents=True)
    (tmp_path / "mine" / "norm" / "in_running.yaml").write_text(NORM_FILE)
    (tmp_path / "tiny_nets.py").write_text(MODEL_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = prepared(compose(*TINY, f"hydra.searchpath=[file://{tmp_path / 'mine'}]", "norm=in_running", "model=custom",
                           "model.target=tiny_nets:build", "model.name=tiny", "regime=bs4a4", "train.num_iterations=3",
                           outputs=tmp_path / "out"))
    accuracy = run_cell(cfg, sweep_id="s1")
    client = MlflowClient(cfg.mlflow.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gaexp").experiment_id])
    assert run.info.run_name == "tiny-in_running-bs4a4-s1" and run.data.metrics["final_valid_acc"] == accuracy
    assert (run.data.tags["model"], run.data.tags["norm"]) == ("tiny", "in_running")
    assert run.data.params["norm.target"] == "torch.nn:InstanceNorm2d" and run.data.params["model.target"] == "tiny_nets:build"
    norm = make_model(cell.typed(cfg), 1, 10)[1]
    assert type(norm) is torch.nn.InstanceNorm2d and norm.affine and norm.track_running_stats
    bad = compose(*TINY, f"hydra.searchpath=[file://{tmp_path / 'mine'}]", "norm=in_running", "+norm.params.nope=1",
                  outputs=tmp_path / "out")
    with pytest.raises(ValueError, match=r"^norm.target='torch.nn:InstanceNorm2d': building it for 32 channels with "
                                         r"\{.*'nope': 1\} fails: TypeError: "):
        cell.validated(bad)


def test_a_batched_cell_is_its_own_run_and_records_the_loops_memory_beside_its_own(tmp_path, compose, monkeypatch):
    """gn4 couples no samples: batched bs1a16 is one pass over the 16 samples of bs16a1, the same run to the
    last bit."""
    engines = []
    step_function = train_module.step_function
    monkeypatch.setattr(train_module, "step_function", lambda engine, *a: engines.append(engine) or step_function(engine, *a))
    for regime in ("bs1a16", "bs16a1"):
        run_cell(prepared(compose(*TINY, "norm=gn4", f"regime={regime}", "train.num_iterations=3", outputs=tmp_path)),
                 sweep_id="s1")
    batched = prepared(compose(*TINY, "norm=gn4", "regime=bs1a16", "train.num_iterations=3", "accumulate=batched",
                               outputs=tmp_path))
    accuracy = run_cell(batched, sweep_id="s2")  # never skipped as the loop's FINISHED run: another protocol
    client = MlflowClient(batched.mlflow.tracking_uri)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("gaexp").experiment_id])}
    assert sorted(runs) == ["batched-gn4-bs1a16-s1", "gn4-bs16a1-s1", "gn4-bs1a16-s1"]
    run, loop_run, true_batch = runs["batched-gn4-bs1a16-s1"], runs["gn4-bs1a16-s1"], runs["gn4-bs16a1-s1"]
    assert (run.data.tags["accumulate"], loop_run.data.tags["accumulate"]) == ("batched", "loop")
    assert run.data.params["accumulate"] == "batched" and run.data.metrics["final_valid_acc"] == accuracy
    losses = {name: [m.value for m in client.get_metric_history(r.info.run_id, "train_loss")]
              for name, r in (("batched", run), ("loop", loop_run), ("true", true_batch))}
    assert losses["batched"] == losses["true"] and engines == ["loop", "loop", "batched"]
    memory = {k: v for k, v in run.data.metrics.items() if k.endswith("_mb")}
    assert set(memory) == {"activation_mb", "batched_activation_mb", "batched_peak_rss_mb"}  # no loop peak
    assert {k for k in loop_run.data.metrics if k.endswith("_mb")} == {"activation_mb", "peak_rss_mb"}
    assert memory["activation_mb"] == loop_run.data.metrics["activation_mb"]  # what the loop holds, one micro-batch
    assert memory["batched_activation_mb"] == true_batch.data.metrics["activation_mb"]  # the 16 samples of a step


def test_a_coupled_norm_of_ones_own_in_one_file_trains_under_both_engines_and_shows_in_the_report(tmp_path, compose,
                                                                                                  monkeypatch):
    """Only mine_bn.py (a BatchNorm variant declaring couples_samples): loop and batched cells, then the report."""
    (tmp_path / "mine_bn.py").write_text(USER_NORM_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    mine = ["norm=custom", f"norm.target={USER_NORM}", "norm.name=mean_bn", "train.num_iterations=3"]
    for overrides in (["norm=bn", "regime=bs16a1"], [*mine, "regime=bs16a1"], [*mine, "regime=bs4a4"]):
        run_cell(prepared(compose(*TINY, "train.num_iterations=3", *overrides, outputs=tmp_path)), sweep_id="s1")
    batched = prepared(compose(*TINY, *mine, "regime=bs4a4", "accumulate=batched", outputs=tmp_path))
    run_cell(batched, sweep_id="s2")
    client = MlflowClient(batched.mlflow.tracking_uri)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("gaexp").experiment_id])}
    loss = {name: client.get_metric_history(runs[name].info.run_id, "train_loss")[0].value
            for name in ("mean_bn-bs4a4-s1", "batched-mean_bn-bs4a4-s1")}
    assert runs["batched-mean_bn-bs4a4-s1"].data.tags["accumulate"] == "batched"
    assert loss["batched-mean_bn-bs4a4-s1"] == pytest.approx(loss["mean_bn-bs4a4-s1"], rel=1e-5)  # rounding only
    summary, _, _ = analysis.report(batched.mlflow.tracking_uri, "gaexp", sweep="s1",
                                    design=AnalysisConfig(window_start=0, table_columns=["bs16a1", "bs4a4"]),
                                    out=tmp_path / "report", plots=False)
    assert list(summary.table.index) == ["bn", "mean_bn"]  # the declared norms first, then one's own (test_analysis)
    assert summary.cells.loc[("mean_bn", "bs4a4"), "seeds"] == 1 and 0 < summary.table.loc["mean_bn", "bs4a4"] < 100


MEAN_NORM_FILE = """
from torch import nn


class MeanNorm(nn.Module):
    def __init__(self, channels, **options):
        super().__init__()

    def forward(self, x):
        return x - x.mean(dim=(0, 2, 3), keepdim=True)
"""


def test_a_layer_batched_cannot_chunk_is_refused_in_one_line_before_anything_runs(tmp_path, compose, monkeypatch):
    (tmp_path / "mine_norms.py").write_text(MEAN_NORM_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    mean_norm = ["norm=in_running", "norm.target=mine_norms:MeanNorm"]
    (tmp_path / "mine" / "norm").mkdir(parents=True)
    (tmp_path / "mine" / "norm" / "in_running.yaml").write_text(NORM_FILE)
    searchpath = f"hydra.searchpath=[file://{tmp_path / 'mine'}]"
    cell.validated(compose(*TINY, searchpath, *mean_norm, outputs=tmp_path / "out"))  # the loop runs any layer
    with pytest.raises(ValueError, match=r"^accumulate=batched: layer 'features.1' is a mine_norms.MeanNorm, not a "
                                         r"layer gaexp knows .*; run accumulate=loop$"):
        prepare(compose(*TINY, searchpath, *mean_norm, "accumulate=batched", outputs=tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # nothing written
    cell.validated(compose(*TINY, searchpath, "norm=in_running", "accumulate=batched", outputs=tmp_path / "out"))


def test_a_holdout_cell_trains_on_the_kept_images_and_evaluates_the_held_out_ones(tmp_path, compose, monkeypatch):
    """The wiring from data.holdout to the loop: what `train` receives, and what the run records. Images are
    numbered (tests: 255 - j), so each split says which images it holds."""
    overrides = [*TINY, "norm=gn4", "regime=bs4a4", "train.num_iterations=3", "data.holdout=16",
            *fake_dataset_overrides(tmp_path / "numbered", "mnist", "MNIST", numbered=True)]
    seen = {}

    def spy(model, train_data, valid_data, *args, **kwargs):
        seen["train"], seen["valid"] = train_data.images[:, 0, 0, 0].tolist(), valid_data.images[:, 0, 0, 0].tolist()
        return real_train(model, train_data, valid_data, *args, **kwargs)

    real_train = cell.train
    monkeypatch.setattr(cell, "train", spy)
    cfg = prepared(compose(*overrides, outputs=tmp_path))
    accuracy = run_cell(cfg, sweep_id="s")
    kept, held = (i.tolist() for i in batches.holdout_indices(64, 16))
    assert seen["valid"] == held and seen["train"] == kept  # never the test images (numbered 224 and up)
    assert not set(seen["valid"]) & set(seen["train"]) and len(seen["valid"]) == 16

    client = MlflowClient(cfg.mlflow.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gaexp").experiment_id])
    inputs = {d.dataset.name: json.loads(d.dataset.profile)["num_samples"] for d in run.inputs.dataset_inputs}
    assert inputs == {"mnist-train-minus16": 48, "mnist-holdout16": 16}
    assert run.data.params["data.holdout"] == "16" and accuracy * 16 == round(accuracy * 16)  # out of 16 images


@pytest.mark.slow
def test_compile_auto_compiles_instance_norm_training_and_it_trains_like_the_eager_one(tmp_path, compose,
                                                                                         training_runs):
    overrides = [*TINY, "norm=in", "regime=bs4a4", "train.num_iterations=3", "train.eval_period=3"]
    eager = run_cell(prepared(compose(*overrides, outputs=tmp_path / "eager")), sweep_id="eager")
    compiled = run_cell(prepared(compose(*overrides, "compile=auto", outputs=tmp_path / "compiled")),
                        sweep_id="compiled")
    assert compiled == pytest.approx(eager, abs=2e-3)
    _, runs = training_runs(f"sqlite:///{tmp_path}/compiled/mlflow.db")
    [run] = runs.values()
    assert run.data.tags["compiled"] == "train,eval" and run.data.params["compile"] == "auto"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, gaexp_command, training_runs):
    out = tmp_path_factory.mktemp("sweep")
    proc = gaexp_command(out, "norm=bn,gn4", "regime=bs1a16,bs16a1", "seed=1", "analysis.plots=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out / "console.txt").write_text(proc.stdout)  # what the launching terminal showed
    client, runs = training_runs(f"sqlite:///{out}/mlflow.db")
    return out, client, runs


@pytest.mark.slow
def test_sweep_records_one_finished_run_per_cell(sweep):
    _, _, runs = sweep
    assert sorted(runs) == ["bn-bs16a1-s1", "bn-bs1a16-s1", "gn4-bs16a1-s1", "gn4-bs1a16-s1"]
    assert all(run.info.status == "FINISHED" for run in runs.values())
    tags = runs["bn-bs1a16-s1"].data.tags
    assert (tags["norm"], tags["regime"], tags["seed"], tags["batch_size"], tags["num_accum"]) == ("bn", "bs1a16", "1", "1", "16")
    assert len({run.data.tags["sweep_id"] for run in runs.values()}) == 1


@pytest.mark.slow
def test_sweep_runs_the_longest_cells_first_and_records_its_plan(sweep):
    out, client, runs = sweep
    started = sorted(runs, key=lambda name: runs[name].info.start_time)
    assert started == ["bn-bs1a16-s1", "gn4-bs1a16-s1", "bn-bs16a1-s1", "gn4-bs16a1-s1"]  # given: bn-bs16a1 second
    sweep_id = runs["bn-bs1a16-s1"].data.tags["sweep_id"]
    (plan,) = client.search_runs([runs["bn-bs1a16-s1"].info.experiment_id], "attributes.run_name = 'sweep-%s'" % sweep_id)
    assert plan.info.status == "FINISHED"
    assert (plan.data.tags["gaexp.cells"], plan.data.tags["gaexp.order"]) == ("4", "longest_first")
    costs = [progress.expected_seconds(b, k, 4, 2, 500) for b, k in [(1, 16), (1, 16), (16, 1), (16, 1)]]
    assert float(plan.data.tags["gaexp.expected_s"]) == pytest.approx(sum(costs), abs=0.5)  # compile=off: no graphs
    assert plan.data.tags[runtags.COSTS] == " ".join(f"{c:.1f}:0" for c in costs)  # each cell's, in launch order


@pytest.mark.slow
def test_sweep_terminal_shows_a_line_per_cell_and_the_report_while_cell_logs_keep_their_evaluations(sweep):
    out, _, runs = sweep
    console = (out / "console.txt").read_text().splitlines()
    ended = [line for line in console if " FINISHED (" in line]
    assert sorted(line.split()[0] for line in ended) == sorted(runs)
    assert ended[-1].split(" | ")[1].startswith("4/4 cells: 4 finished, 0 running; 100% of the work; elapsed ")
    assert not [line for line in console if " step 2/4 " in line]  # evaluations stay in the cells' logs
    assert any(line.startswith("| bn | ") for line in console)  # the report, after cells ran in this process
    logs = sorted(out.glob("multirun/*/*/gaexp.log"))
    assert len(logs) == 4 and all(" step 2/4 " in log.read_text() for log in logs)


@pytest.mark.slow
def test_sweep_histories_and_summaries(sweep):
    _, client, runs = sweep
    for run in runs.values():
        history = client.get_metric_history(run.info.run_id, "valid_acc")
        assert [m.step for m in history] == [2, 4]
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [2, 4]
        assert run.data.metrics["final_valid_acc"] == history[-1].value
        assert {"best_valid_acc", "wall_seconds", "samples_per_sec", "peak_rss_mb"} <= set(run.data.metrics)
        assert run.data.metrics["peak_rss_mb"] < 1536  # a cell under 1.5 GiB
    ratio = runs["bn-bs1a16-s1"].data.metrics["activation_mb"] / runs["bn-bs16a1-s1"].data.metrics["activation_mb"]
    assert abs(ratio - 1 / 16) < 0.005  # what accumulation saves


@pytest.mark.slow
def test_accumulation_matches_the_true_batch_end_to_end(sweep):
    """GroupNorm: 1x16 and 16x1 follow the same trajectory; BatchNorm does not."""
    _, _, runs = sweep
    for metric in ("final_valid_acc", "train_loss"):
        assert runs["gn4-bs1a16-s1"].data.metrics[metric] == pytest.approx(runs["gn4-bs16a1-s1"].data.metrics[metric], abs=2e-4)
    assert runs["bn-bs1a16-s1"].data.metrics["train_loss"] != pytest.approx(runs["bn-bs16a1-s1"].data.metrics["train_loss"], abs=1e-3)


@pytest.mark.slow
def test_sweep_artifacts_and_folders(sweep):
    out, client, runs = sweep
    run_id = runs["gn4-bs16a1-s1"].info.run_id
    top = {a.path for a in client.list_artifacts(run_id)}
    assert top == {"config.yaml", "hydra"}
    assert {a.path for a in client.list_artifacts(run_id, "hydra")} == {"hydra/config.yaml", "hydra/hydra.yaml", "hydra/overrides.yaml"}
    config = Path(client.download_artifacts(run_id, "config.yaml", str(out))).read_text()
    assert "name: gn4" in config and "num_iterations: 4" in config
    (sweep_dir,) = (out / "multirun").iterdir()
    cells = sorted(p.name for p in sweep_dir.iterdir() if p.is_dir())
    # runtime keys stay out of the folder names, but the two that decide what an Optuna trial returns
    assert cells[0] == ("accumulate=loop,analysis.window_start=0,data.holdout=500,device=cpu,norm=bn,regime=bs16a1,"
                        "seed=1,train.eval_period=2,train.num_iterations=4")
    assert len(cells) == 4 and (sweep_dir / cells[0] / "gaexp.log").is_file()  # job name, not __main__
    assert runs["gn4-bs16a1-s1"].data.tags["sweep_id"] == sweep_dir.name
    assert (out / "mlartifacts").is_dir()


@pytest.mark.slow
def test_sweep_end_writes_the_report_and_logs_it_to_mlflow(sweep):
    out, client, runs = sweep
    sweep_id = runs["bn-bs1a16-s1"].data.tags["sweep_id"]
    table = (out / "reports" / sweep_id / "table.md").read_text()
    assert "| bn | " in table and "| gn4 | " in table and (out / "reports" / sweep_id / "curves.png").is_file()
    (report,) = client.search_runs([runs["bn-bs1a16-s1"].info.experiment_id], "tags.`gaexp.role` = 'report'")
    assert report.info.run_name == f"report-{sweep_id}" and report.data.tags["sweep_id"] == sweep_id
    assert (report.data.params["analysis.margin"], report.data.params["analysis.window_start"]) == ("0.5", "0")
    assert "| verdict (±0.5) |" in table  # the study design the verdicts were made at, in the table and the run
    assert {"table.md", "curves.png", "curves.pdf", "runs.csv"} <= {a.path for a in client.list_artifacts(report.info.run_id)}


@pytest.mark.slow
def test_the_study_file_runs_the_same_cells_as_the_written_out_grid(sweep, tmp_path, gaexp_command, training_runs):
    """`+experiment=spec` (what make sweep runs), its grid narrowed on the command line, against the
    fixture's written-out grid: the same cells, folders, protocol keys, histories and table."""
    out, client, runs = sweep
    proc = gaexp_command(tmp_path, "+experiment=spec", "norm=bn,gn4", "regime=bs1a16,bs16a1", "seed=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    study_client, study_runs = training_runs(f"sqlite:///{tmp_path}/mlflow.db")
    assert sorted(study_runs) == sorted(runs)
    for name, run in runs.items():
        twin = study_runs[name]
        assert twin.data.tags["protocol_key"] == run.data.tags["protocol_key"]
        for metric in ("valid_acc", "train_loss"):
            assert ([(m.step, m.value) for m in study_client.get_metric_history(twin.info.run_id, metric)]
                    == [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, metric)])
    folders = [sorted(p.name for p in next((root / "multirun").iterdir()).iterdir() if p.is_dir()) for root in (out, tmp_path)]
    assert folders[0] == folders[1]

    def table(root):  # the accuracy tables; the memory and speed table after them differs run to run
        text = next((root / "reports").iterdir()).joinpath("table.md").read_text()
        return text.split("Memory and speed")[0]
    assert table(out) == table(tmp_path)


@pytest.mark.slow
def test_report_cli_on_the_real_sweep(sweep, tmp_path):
    out, client, runs = sweep
    cli = [sys.executable, "-m", "gaexp.analysis", "--tracking-uri", f"sqlite:///{out}/mlflow.db"]
    proc = subprocess.run([*cli, "--window-start", "0", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "runs: 4 finished, 0 excluded" in proc.stdout
    gn4 = next(line for line in proc.stdout.splitlines() if line.startswith("| gn4 | "))
    history = [m.value for m in client.get_metric_history(runs["gn4-bs16a1-s1"].info.run_id, "valid_acc")]
    assert gn4.count("|") == 4 and gn4.split("|")[2].strip() == f"{100 * sum(history) / len(history):.2f}"
    assert "bs4a4" not in proc.stdout.split("Memory and speed")[0]  # two regimes the sweep ran, not the study's third
    assert (tmp_path / "table.csv").is_file()
    bad = subprocess.run([*cli, "--sweep", "nope"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("error: no sweep 'nope'")
    assert len(bad.stderr.strip().splitlines()) == 1


def test_threads_auto_fills_the_cores_across_parallel_jobs():
    assert threads_for("auto", None, cores=8) == 0  # cells one by one: torch's default
    assert threads_for("auto", 2, cores=8) == 4
    assert threads_for("auto", -1, cores=8) == 1  # joblib's default: one job per core
    assert threads_for("auto", -2, cores=8) == 1 and threads_for("auto", 16, cores=8) == 1
    assert threads_for(3, 2, cores=8) == 3


def test_deterministic_cuda_turns_on_deterministic_kernels_and_keeps_a_users_workspace(monkeypatch):
    """What a CUDA cell sets before it builds anything (run_cell, device cuda, deterministic=true); the
    settings are process-wide, so they are put back after."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark)
    try:
        torch.backends.cudnn.benchmark = True
        train_module.deterministic_cuda()
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and torch.backends.cudnn.benchmark is False
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the smaller workspace cuBLAS also accepts
        train_module.deterministic_cuda()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = before[2]


MYNETS = """
import torch

def build(norm_layer, in_channels, num_classes):
    return torch.nn.Sequential(torch.nn.Conv2d(in_channels, 8, 3), norm_layer(8), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, num_classes))
"""


def test_the_gaexp_console_script_imports_a_model_from_the_folder_it_runs_in(tmp_path, data_root, training_runs):
    """The README's line `gaexp model=custom model.target=mynets:build ...` with mynets.py in the current folder,
    as the console script (not `python -m gaexp`), its cell in a joblib worker."""
    (tmp_path / "mynets.py").write_text(MYNETS)
    script = Path(sys.executable).parent / "gaexp"
    done = subprocess.run([str(script), "-m", *TINY, "train.num_iterations=2", "model=custom",
                           "model.target=mynets:build", "model.name=mynet", "norm=gn4", "regime=bs4a4",
                           "launch=joblib", "hydra.launcher.n_jobs=1", f"paths.outputs={tmp_path / 'out'}",
                           f"data.root={data_root}", "data.sources=[local]"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-2000:]
    _, runs = training_runs(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    assert list(runs) == ["mynet-gn4-bs4a4-s1"] and runs["mynet-gn4-bs4a4-s1"].info.status == "FINISHED"


def test_the_report_command_a_sweep_prints_runs_as_printed(tmp_path, compose, capsys, monkeypatch):
    """The `rerun:` hint of a sweep whose report failed: its store, experiment, part and design, runnable."""
    cfg = prepared(compose(*TINY, "norm=gn4", "regime=bs4a4", "train.num_iterations=2", outputs=tmp_path / "store"))
    run_cell(cfg, sweep_id="s1")
    design = OmegaConf.to_object(cfg.analysis)  # TINY: analysis.window_start=0
    command = report_command("s1", design, cfg, {"dataset": "mnist"})
    assert command == (f"gaexp-report --tracking-uri {cfg.mlflow.tracking_uri} --experiment gaexp --sweep s1 "
                       "--dataset mnist --window-start 0")
    assert report_command("s1", dataclasses.replace(design, plots=False), cfg) == (  # analysis.plots=false: as made
        f"gaexp-report --tracking-uri {cfg.mlflow.tracking_uri} --experiment gaexp --sweep s1 --window-start 0 --no-plots")
    monkeypatch.chdir(tmp_path)
    analysis.main(shlex.split(command)[1:])
    out = capsys.readouterr().out
    assert "over evaluations at step > 0" in out and "| gn4 | bs4a4 |" in out


def imported(importtime: str) -> set[str]:
    """The top-level packages a command imported, from what `python -X importtime` wrote to its stderr."""
    return {line.split("|")[2].strip().split(".")[0] for line in importtime.splitlines()
            if line.startswith("import time:") and line.count("|") == 2} - {"package"}  # "package": its header


@pytest.mark.parametrize("argv, rc, said", [
    (["--cfg", "job"], 0, "regime:\n"),
    (["norm=bogus"], 1, "error: norm=bogus: no such norm; valid: "),
    (["regime.batch_size=abc"], 1, "error: Error merging override regime.batch_size=abc: "),
    (["-m", "norm=bn,gn4", "seed=2,-1"], 1, "error: cell seed=-1: seed=-1; valid: an integer in [0, 2**63 - 1]"),
])
def test_printing_a_config_or_refusing_bad_input_loads_neither_torch_nor_mlflow(argv, rc, said, tmp_path, data_root):
    """Seconds each: what a cell needs (torch, MLflow, pandas) loads when one runs, not to print or refuse input;
    the range check of a swept value too, device=auto left unresolved until the input is known to be good."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "gaexp", *argv, f"paths.outputs={tmp_path}",
                           f"data.root={data_root}"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == rc, done.stderr[-2000:]
    assert said in (done.stdout if rc == 0 else done.stderr)
    loaded = imported(done.stderr)
    assert {"hydra", "gaexp", "omegaconf"} <= loaded  # the parse reads the modules it imported
    assert not loaded & {"torch", "mlflow", "pandas", "optuna"}, sorted(loaded & {"torch", "mlflow", "pandas", "optuna"})
    assert not (tmp_path / "mlflow.db").exists()


def test_a_hydra_key_swept_unquoted_is_told_the_quoting_that_runs(tmp_path, compose):
    """`hydra.sweeper.grid.norm=bn,gn4` unquoted: Hydra sweeps none of its own keys and said only that. The line
    gives the override as docs/tuning.md writes it, `+` and quotes included; split as a shell splits it, it
    composes to the grid the Optuna sweeper reads as one study per norm."""
    search = ["hydra/sweeper=gaexp_optuna", "hydra.sweeper.direction=maximize"]
    done = subprocess.run([sys.executable, "-m", "gaexp", "-m", *search, "hydra.sweeper.grid.norm=bn,gn4",
                           f"paths.outputs={tmp_path}"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr[-2000:]
    assert done.stderr.startswith("error: hydra.sweeper.grid.norm=bn,gn4: Hydra sweeps none of its own settings; ")
    printed = re.search(r"quoted: (.*) \(docs/tuning.md\)$", done.stderr.strip()).group(1)
    assert printed == "\"+hydra.sweeper.grid.norm='bn,gn4'\""  # as docs/tuning.md has it
    [override] = shlex.split(printed)
    assert hydra_sweep_problem([*search, override]) is None and composition_problem([*search, override]) is None
    grid = compose(*search, override, hydra=True).hydra.sweeper.grid
    assert split_arguments({}, dict(grid), [])[2] == [["norm=bn", "norm=gn4"]]  # two studies
    # where the key is there already (the tune_lr study file's grid), no +; a setting that is no list: no quoting
    assert hydra_sweep_problem(["+experiment=tune_lr", "hydra.sweeper.grid.norm=bn,gn4"]).endswith(
        "quoted: \"hydra.sweeper.grid.norm='bn,gn4'\" (docs/tuning.md)")
    assert hydra_sweep_problem(["launch=joblib", "hydra.launcher.n_jobs=1,2"]) == (
        "hydra.launcher.n_jobs=1,2: Hydra sweeps none of its own settings; run one command per value")


def test_ctrl_c_outside_a_grid_sweeps_launches_is_one_line_and_status_130(tmp_path, monkeypatch):
    """A single run, a search, a sweep still planning: `interrupted`, no traceback, the status a shell gives."""
    err = io.StringIO()
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # put back after: cli masks the terminal's streams
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "path", list(sys.path))

    def ctrl_c() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(app, "main", ctrl_c)
    for check in ("unknown_choice", "hydra_sweep_problem", "composition_problem"):  # the input's own tests: others
        monkeypatch.setattr(app, check, lambda overrides: None)  # (in a long session Hydra's global state may vary)
    with pytest.raises(SystemExit) as stop:
        app.cli([*TINY, f"paths.outputs={tmp_path}"])
    assert (stop.value.code, err.getvalue()) == (130, "interrupted\n")


@pytest.mark.parametrize("sent,status", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_and_sighup_end_a_command_as_ctrl_c_does_with_their_own_status(tmp_path, monkeypatch, sent, status):
    """What SLURM sends at a job's time limit, and `timeout` and `systemctl stop` (SIGTERM), or a closed terminal
    (SIGHUP): the same line as Ctrl-C, the status a shell reports (128 + the signal), the handlers put back. The
    worker below never sends the interrupt back: the command ends after the grace (1 s here; the workers that do
    answer: test_sigterm_to_a_sweeps_process_alone_ends_it_as_ctrl_c_its_workers_and_runs_too)."""
    monkeypatch.setattr(liveness, "GRACE_S", 1)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "path", list(sys.path))
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, lambda *a: "
                              "exit(7)); print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    assert child.stdout.readline() == b"ready\n"

    def signalled() -> None:
        assert child.pid in liveness.descendants(os.getpid())
        os.kill(os.getpid(), sent)
        time.sleep(60)

    monkeypatch.setattr(app, "main", signalled)
    for check in ("unknown_choice", "hydra_sweep_problem", "composition_problem"):
        monkeypatch.setattr(app, check, lambda overrides: None)
    before = signal.getsignal(sent)
    with pytest.raises(SystemExit) as stop:
        app.cli([*TINY, f"paths.outputs={tmp_path}"])
    assert (stop.value.code, err.getvalue()) == (status, "interrupted\n")
    assert child.wait(timeout=30) == 7  # the worker below was told as Ctrl-C tells it (SIGINT)
    assert signal.getsignal(sent) is before


def interrupt_when(proc: subprocess.Popen, reached, timeout: float = 300) -> None:
    """Ctrl-C as a terminal sends it (SIGINT to `proc`'s process group, started with start_new_session=True) once
    `reached()`: the group frozen (SIGSTOP) while it is asked again, as conftest.kill_when does."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if reached():
            os.killpg(proc.pid, signal.SIGSTOP)
            if reached():
                os.killpg(proc.pid, signal.SIGINT)  # delivered as the group resumes
                os.killpg(proc.pid, signal.SIGCONT)
                return
            os.killpg(proc.pid, signal.SIGCONT)
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    raise AssertionError("the command ended, or ran on, before the state to interrupt it in was reached")


def cell_runs(uri: str) -> list[tuple[str, str, str]]:
    """(name, status, run id) of every training run in the store, oldest first."""
    client = MlflowClient(uri)
    runs = [r for r in client.search_runs([client.get_experiment_by_name("gaexp").experiment_id])
            if runtags.is_training_run(r.data.tags)]
    return [(r.info.run_name, r.info.status, r.info.run_id) for r in sorted(runs, key=lambda r: r.info.start_time)]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, gaexp_argv):
    """The brief's sweep at a small budget (40 steps: seconds of training, which the 0.2 s poll catches running),
    2 cells one at a time, interrupted (Ctrl-C) once the first FINISHED and the second is RUNNING, then the same
    command again. HOME is a file, as a read-only HOME is to
    matplotlib. Returns the command, its store and, for each of the two commands, (exit status, stdout, stderr)."""
    out = tmp_path_factory.mktemp("interrupted")
    (out / "home").write_text("")
    env = {**os.environ, "HOME": str(out / "home")}
    argv = gaexp_argv(out, "norm=bn,gn4", "regime=bs4a4", "train.num_iterations=40", "train.eval_period=40",
                      "data.holdout=1000", "launch=joblib", "hydra.launcher.n_jobs=1", "hydra.sweeper.order=given",
                      "analysis.plots=true")  # the report's figures: matplotlib with HOME a file
    uri = f"sqlite:///{out}/mlflow.db"

    def second_cell_running() -> bool:
        if not list(out.glob("multirun/*/multirun.yaml")):  # the store is made: the sweeper planned
            return False
        try:
            return [status for _, status, _ in cell_runs(uri)] == ["FINISHED", "RUNNING"]
        except Exception:  # noqa: BLE001 - the store locked by the frozen command: asked again
            return False

    with open(out / "stdout.txt", "w") as stdout, open(out / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(argv, cwd=out, stdout=stdout, stderr=stderr, text=True, env=env,
                                start_new_session=True)
        interrupt_when(proc, second_cell_running)
        proc.wait(timeout=300)
    first = (proc.returncode, (out / "stdout.txt").read_text(), (out / "stderr.txt").read_text())
    runs = cell_runs(uri)
    again = subprocess.run(argv, cwd=out, capture_output=True, text=True, timeout=600, env=env)
    return argv, uri, runs, first, (again.returncode, again.stdout, again.stderr)


@pytest.mark.slow
def test_ctrl_c_in_a_sweep_says_in_one_line_how_many_cells_finished_and_the_same_command_resumes(interrupted):
    argv, uri, runs, (status, _, stderr), (again, again_out, _) = interrupted
    assert status == 130, stderr[-3000:]  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped
    assert stderr.splitlines() == [  # not Hydra's and joblib's traceback of the KeyboardInterrupt
        "interrupted: 1 of 2 cells finished; rerun the same command to resume, finished cells are skipped: "
        f"gaexp {shlex.join(argv[3:])}"]
    assert [(name, status) for name, status, _ in runs][0] == ("bn-bs4a4-s1", "FINISHED")
    assert again == 0, again_out[-3000:]
    after = cell_runs(uri)
    assert [r for r in after if r[1] == "FINISHED"] == [runs[0], (after[-1][0], "FINISHED", after[-1][2])]
    assert after[-1][0] == "gn4-bs4a4-s1"  # bn's run skipped (the same run), gn4's trained again, to the end


@pytest.mark.slow
def test_sigterm_to_a_sweeps_process_alone_ends_it_as_ctrl_c_its_workers_and_runs_too(tmp_path, gaexp_argv):
    """SIGTERM to the sweep's own process only (as `kill PID`, `timeout` and a scheduler send it; Ctrl-C reaches
    the whole group), two joblib workers training: the same one line, status 143, every run FINISHED or KILLED
    (none left RUNNING) and no worker left behind."""
    argv = gaexp_argv(tmp_path, "norm=bn,gn4,gn16", "regime=bs4a4", "train.num_iterations=60",
                      "train.eval_period=60", "data.holdout=1000", "launch=joblib", "hydra.launcher.n_jobs=2",
                      "hydra.sweeper.order=given")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    workers: list[int] = []

    def one_finished_one_running() -> bool:
        """...and the running one started less than half the finished one's time ago (this machine's own pace):
        far from its end when told, so it cannot finish on its own meanwhile."""
        try:
            runs = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("gaexp").experiment_id],
                                                 "tags.norm != ''") if list(tmp_path.glob("multirun/*/multirun.yaml")) \
                else []
        except Exception:  # noqa: BLE001 - the store locked by the frozen command: asked again
            return False
        took = [(r.info.end_time - r.info.start_time) / 1000 for r in runs if r.info.status == "FINISHED"]
        return bool(took) and any(r.info.status == "RUNNING" and time.time() - r.info.start_time / 1000 < took[0] / 2
                                  for r in runs)

    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                                start_new_session=True)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and not workers:
            if one_finished_one_running():
                os.killpg(proc.pid, signal.SIGSTOP)
                if one_finished_one_running():
                    workers = liveness.descendants(proc.pid)
                    os.kill(proc.pid, signal.SIGTERM)  # delivered as the group resumes
                os.killpg(proc.pid, signal.SIGCONT)
            time.sleep(0.2)
        assert workers, "the sweep ended, or ran on, before a cell finished while another ran"
        assert proc.wait(timeout=300) == 143
    lines = (tmp_path / "stderr.txt").read_text().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        r"interrupted: [12] of 3 cells finished; rerun the same command to resume, finished cells are skipped: "
        + re.escape(f"gaexp {shlex.join(argv[3:])}"), lines[0]), lines[-20:]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (any(liveness.process_alive(pid) for pid in workers)
                                           or "RUNNING" in [status for _, status, _ in cell_runs(uri)]):
        time.sleep(0.5)
    statuses = [status for _, status, _ in cell_runs(uri)]
    assert "KILLED" in statuses and set(statuses) <= {"FINISHED", "KILLED"}, statuses
    assert not any(liveness.process_alive(pid) for pid in workers)


@pytest.mark.slow
def test_a_sweep_prints_none_of_the_libraries_lines_nobody_acts_on(interrupted):
    """MLflow making the new store's tables, joblib's Parallel(...) settings, matplotlib building its font
    cache in a temporary folder (HOME unwritable to it) at the report: not printed; the sweep's own lines are."""
    _, _, _, (_, stdout, stderr), (again, again_out, again_err) = interrupted
    printed = stdout + stderr + again_out + again_err
    for line in ("database tables", "alembic", "Parallel(", "fontManager", "Matplotlib created a temporary"):
        assert line not in printed
    assert "Launching jobs, sweep output dir : " in stdout and re.search(r"\t#1 : .* norm=gn4 regime=bs4a4 ", stdout)
    assert "report of sweep " in again_out and again_err == "", again_err[-3000:]


def test_joblibs_settings_and_a_searchs_job_lines_are_not_printed_and_the_rest_is(tmp_path, monkeypatch, caplog):
    """The launcher's lines as quiet_libraries leaves them: joblib's Parallel(...) repr never, each job's
    overrides (and a search's storage) not in a search, where every batch printed them; its warnings always."""
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)  # restored after, with what quiet_libraries sets
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path))
    monkeypatch.setattr(logging, "raiseExceptions", logging.raiseExceptions)  # quiet_storage_noise sets it
    launcher = logging.getLogger("hydra_plugins.hydra_joblib_launcher._core")
    store = logging.getLogger("mlflow.store.db.utils")
    level = store.level
    lines = ["Joblib.Parallel(n_jobs=2,backend=loky) is launching 2 jobs", "Launching jobs, sweep output dir : /x",
             "\t#0 : train.lr=0.01 optuna.storage='/x/optuna.journal' optuna.study='s' optuna.trial=0"]
    printed = {}
    try:
        for search in (False, True):
            callbacks.quiet_libraries(search, tmp_path)
            caplog.clear()
            with caplog.at_level(logging.INFO):
                for line in lines:
                    launcher.info(line)
                launcher.warning("a launcher's warning")
                store.info("Creating initial MLflow database tables...")
                store.error("SQLAlchemy database error. The following exception is caught.")  # raised next anyway
            printed[search] = [r.getMessage() for r in caplog.records]
    finally:
        for f in [f for f in launcher.filters if isinstance(f, callbacks.Unprinted)]:
            launcher.removeFilter(f)
        store.setLevel(level)
    assert printed[False] == [*lines[1:], "a launcher's warning"]
    assert printed[True] == [lines[1], "a launcher's warning"]
    assert os.environ["PYTHONWARNINGS"] == callbacks.QUIET_WARNINGS  # once, for a second command too


@pytest.mark.parametrize("home_is_a_file", [True, False])
def test_matplotlib_gets_a_folder_under_outputs_only_where_its_own_are_not_writable(home_is_a_file, tmp_path,
                                                                                     monkeypatch):
    home = tmp_path / "home"
    home.write_text("") if home_is_a_file else home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "MPLCONFIGDIR", "PYTHONWARNINGS"):
        monkeypatch.delenv(name, raising=False)  # restored after, with what quiet_libraries sets
    try:
        callbacks.quiet_libraries(False, tmp_path / "out")
    finally:
        launcher = logging.getLogger("hydra_plugins.hydra_joblib_launcher._core")
        for f in [f for f in launcher.filters if isinstance(f, callbacks.Unprinted)]:
            launcher.removeFilter(f)
    if home_is_a_file:
        assert os.environ["MPLCONFIGDIR"] == str(tmp_path / "out" / ".matplotlib")
        assert (tmp_path / "out" / ".matplotlib").is_dir()
    else:
        assert "MPLCONFIGDIR" not in os.environ and not (home / ".config").exists()  # nothing made in HOME

