"""Beyond one machine: the launch presets (conf/launch/) against a real `mlflow server` over HTTP.

The server is a real process on 127.0.0.1 with its SQLite backend and artifact root in tmp_path.
submitit_local and Ray really run the cells; SLURM cannot run here, so its preset is checked up
to the sbatch script submitit writes, with an `sbatch` on PATH that records the script and refuses.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from gaexp.app import CONFIG_DIR, cells_at_once, launcher_warnings
from gaexp.config import usable_cores

TINY = ["seed=1", "train.num_iterations=4", "train.eval_period=2", "data.sources=[local]", "device=cpu",
        "hydra.callbacks.report.window_start=0"]


def gaexp_multirun(out: Path, data_root: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gaexp", "-m", *TINY, f"paths.outputs={out}", f"data.root={data_root}", *overrides]
    return subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def server(tmp_path_factory, free_port):
    """A real MLflow tracking server; stopped (its whole process group) however the tests end."""
    root = tmp_path_factory.mktemp("server")
    uri = f"http://127.0.0.1:{free_port()}"
    log = (root / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", uri.rsplit(":", 1)[1],
                             "--workers", "2", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
                             "--artifacts-destination", str(root / "artifacts")],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield uri, root
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def training_runs(client: MlflowClient, experiment: str) -> dict:
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return {run.info.run_name: run for run in runs if "norm" in run.data.tags}


@pytest.fixture(scope="module")
def local_sweeps(server, tmp_path_factory, data_root):
    """Two submitit_local sweeps, 2 cells at a time: 2 cells, then 4 cells resubmitted over them."""
    uri, _ = server
    out = tmp_path_factory.mktemp("local")
    common = ["launch=local", "hydra.sweeper.max_batch_size=2", f"mlflow.tracking_uri={uri}", "norm=gn4,none"]
    first = gaexp_multirun(out, data_root, *common, "regime=bs4a4")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    client = MlflowClient(uri)
    before = {name: run.info.run_id for name, run in training_runs(client, "gaexp").items()}
    tic = time.perf_counter()
    second = gaexp_multirun(out, data_root, "regime=bs4a4,bs16a1", *common)  # regime outer: the 2 new cells share a batch
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    print(f"submitit_local, 4 cells (2 skipped): {time.perf_counter() - tic:.1f} s")
    sweep_ids = sorted(p.name for p in (out / "multirun").iterdir())
    return out, client, before, training_runs(client, "gaexp"), sweep_ids


def test_every_run_arrives_in_the_server_once(local_sweeps):
    _, _, before, runs, sweep_ids = local_sweeps
    assert sorted(before) == ["gn4-bs4a4-s1", "none-bs4a4-s1"]
    assert sorted(runs) == ["gn4-bs16a1-s1", "gn4-bs4a4-s1", "none-bs16a1-s1", "none-bs4a4-s1"]
    assert all(run.info.status == "FINISHED" for run in runs.values())
    # the resubmitted sweep skipped the finished cells: same runs, now also counted in the second sweep
    assert all(runs[name].info.run_id == run_id for name, run_id in before.items())
    assert all(runs[name].data.tags["gaexp.sweeps"] == ",".join(sweep_ids) for name in before)
    assert all(run.data.tags["threads"] == str(max(1, usable_cores() // 2)) for run in runs.values())


def test_two_cells_ran_at_once(local_sweeps):
    _, _, _, runs, _ = local_sweeps
    spans = sorted((run.info.start_time, run.info.end_time) for run in runs.values())
    overlaps = sum(a_end > b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert overlaps >= 2  # each batch of 2 cells overlapped in time


def test_histories_and_artifacts_arrive_over_http(local_sweeps, tmp_path):
    _, client, _, runs, _ = local_sweeps
    for name, run in runs.items():
        run_id = run.info.run_id
        assert [(m.step, 0 <= m.value <= 1) for m in client.get_metric_history(run_id, "valid_acc")] == [(2, True), (4, True)]
        assert [m.step for m in client.get_metric_history(run_id, "train_loss")] == [2, 4]
        assert {a.path for a in client.list_artifacts(run_id)} == {"config.yaml", "hydra"}
        assert {a.path for a in client.list_artifacts(run_id, "hydra")} == {"hydra/config.yaml", "hydra/hydra.yaml",
                                                                            "hydra/overrides.yaml"}
        config = yaml.safe_load(Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path / name))).read_text())
        assert (config["norm"]["name"], config["regime"]["batch_size"]) == (run.data.tags["norm"], int(run.data.tags["batch_size"]))
        assert run.data.metrics["final_valid_acc"] == client.get_metric_history(run_id, "valid_acc")[-1].value


def test_report_run_lands_in_the_server(local_sweeps):
    _, client, _, _, sweep_ids = local_sweeps
    experiment_id = client.get_experiment_by_name("gaexp").experiment_id
    (report,) = client.search_runs([experiment_id], f"tags.`gaexp.role` = 'report' and tags.sweep_id = '{sweep_ids[-1]}'")
    assert {"table.md", "table.csv", "runs.csv"} <= {a.path for a in client.list_artifacts(report.info.run_id)}


def test_analysis_cli_reads_the_server(local_sweeps, server):
    out, client, _, runs, sweep_ids = local_sweeps
    uri, _ = server
    proc = subprocess.run([sys.executable, "-m", "gaexp.analysis", "--tracking-uri", uri, "--sweep", sweep_ids[-1],
                           "--window-start", "0", "--out", str(out / "report")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with (out / "report" / "runs.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {row["run_id"] for row in rows} == {run.info.run_id for run in runs.values()}
    for run in runs.values():  # window 0: every evaluation of every run, read back over HTTP
        history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "valid_acc")]
        assert [(int(r["step"]), float(r["valid_acc"])) for r in rows if r["run_id"] == run.info.run_id] == history


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None,
                    reason="hydra-ray-launcher not installed (pip install -e '.[ray]')")
def test_ray_launcher_runs_cells_into_the_server(server, tmp_path, data_root):
    uri, _ = server
    proc = gaexp_multirun(tmp_path, data_root, "launch=ray", "hydra.launcher.ray.init.num_cpus=2",
                          f"mlflow.tracking_uri={uri}", "mlflow.experiment_name=ray", "norm=gn4,none", "regime=bs4a4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(uri)
    runs = training_runs(client, "ray")
    assert sorted(runs) == ["gn4-bs4a4-s1", "none-bs4a4-s1"]
    assert all(run.info.status == "FINISHED" and run.data.tags["threads"] == "1" for run in runs.values())
    assert all([m.step for m in client.get_metric_history(run.info.run_id, "valid_acc")] == [2, 4] for run in runs.values())


def test_slurm_preset_reaches_sbatch_with_the_cluster_knobs(tmp_path, data_root):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\ncp "$1" {tmp_path}/submitted.sh\n'
                                    'echo "sbatch: error: no cluster here" >&2\nexit 1\n')
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit looks for it before submitting
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = gaexp_multirun(tmp_path, data_root, "launch=slurm", "hydra.launcher.partition=gpu",
                          "hydra.launcher.array_parallelism=3", "norm=gn4,none", "regime=bs4a4,bs16a1", env=env)
    assert proc.returncode != 0 and "no cluster here" in proc.stdout + proc.stderr
    assert "SQLite on a shared file system" in proc.stdout  # the store is local: warned before submitting
    script = (tmp_path / "submitted.sh").read_text()
    for line in ["#SBATCH --partition=gpu", "#SBATCH --cpus-per-task=2", "#SBATCH --array=0-3%3",
                 "#SBATCH --time=60", "#SBATCH --mem=4GB", "#SBATCH --job-name=gaexp"]:
        assert line in script
    assert not training_runs(MlflowClient(f"sqlite:///{tmp_path}/mlflow.db"), "gaexp")  # nothing ran, nothing recorded


def hydra_config(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    return cfg


@pytest.mark.parametrize("overrides, expected", [
    ([], None),                                               # basic launcher: one cell at a time
    (["launch=joblib", "hydra.launcher.n_jobs=3"], 3),
    (["launch=local"], usable_cores()),                      # the preset bounds submitit_local at the core count
    (["launch=local", "hydra.sweeper.max_batch_size=2"], 2),
    (["hydra/launcher=submitit_local"], -1),                  # unbounded: one thread per cell
    (["launch=slurm"], 1),                                    # each task has its own CPUs
    (["launch=ray"], usable_cores()),
])
def test_cells_at_once_per_launcher(overrides, expected):
    if "launch=ray" in overrides and importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None:
        pytest.skip("hydra-ray-launcher not installed")
    cfg = hydra_config(*overrides)
    assert cells_at_once(cfg.hydra.launcher, cfg.hydra.sweeper) == expected


def test_launcher_warnings_name_the_fix():
    unbounded = launcher_warnings(hydra_config("hydra/launcher=submitit_local"))
    assert unbounded == ["submitit_local starts every cell at once; bound it with launch=local "
                         "or hydra.sweeper.max_batch_size=N"]
    assert launcher_warnings(hydra_config("launch=local")) == []
    (shared_sqlite,) = launcher_warnings(hydra_config("launch=slurm"))
    assert "mlflow.tracking_uri=http://HOST:PORT" in shared_sqlite
    assert launcher_warnings(hydra_config("launch=slurm", "mlflow.tracking_uri=http://mlflow.lab:5000")) == []


def test_unknown_launch_preset_lists_the_choices(tmp_path, data_root):
    proc = gaexp_multirun(tmp_path, data_root, "launch=kubernetes")
    assert proc.returncode == 1
    assert "Could not find 'launch/kubernetes'" in proc.stderr
    assert all(choice in proc.stderr for choice in ["joblib", "local", "ray", "slurm"])
    assert not (tmp_path / "mlflow.db").exists()
