"""Beyond one machine: the launch presets (conf/launch/) against a real `mlflow server` over HTTP.

The server is a real process on 127.0.0.1 with its SQLite backend and artifact root in tmp_path.
submitit_local and Ray really run the cells. SLURM runs for real in test_slurm.py; here, where no
cluster is needed, the preset's knobs are checked up to the sbatch script submitit writes, with an
`sbatch` on PATH that records the script and refuses.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gaexp.callbacks import launcher_warnings
from gaexp.machine import threads_for
from gaexp.config import typed
from gaexp.machine import usable_cores

# The cells evaluate 1,000 held-out training images instead of the 10,000 test images (a tenth of the cost of
# each evaluation): what is checked here (launching, resuming, recording) does not depend on which images.
HOLDOUT = "data.holdout=1000"


@pytest.fixture(scope="module")
def local_sweeps(server, tmp_path_factory, gaexp_command, training_runs):
    """Two submitit_local sweeps, 2 cells at a time: 2 cells, then 4 cells resubmitted over them."""
    uri, _ = server
    out = tmp_path_factory.mktemp("local")
    common = ["seed=1", "launch=local", "hydra.sweeper.max_batch_size=2", f"mlflow.tracking_uri={uri}", "norm=gn4,none",
              HOLDOUT]
    first = gaexp_command(out, *common, "regime=bs4a4")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    client, runs = training_runs(uri)
    before = {name: run.info.run_id for name, run in runs.items()}
    second = gaexp_command(out, "regime=bs4a4,bs16a1", *common)  # regime outer: the 2 new cells share a batch
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    sweep_ids = sorted(p.name for p in (out / "multirun").iterdir())
    return out, client, before, training_runs(uri)[1], sweep_ids, second.stdout + second.stderr


@pytest.mark.slow
def test_every_run_arrives_in_the_server_once(local_sweeps):
    _, _, before, runs, sweep_ids, _ = local_sweeps
    assert sorted(before) == ["gn4-bs4a4-s1", "none-bs4a4-s1"]
    assert sorted(runs) == ["gn4-bs16a1-s1", "gn4-bs4a4-s1", "none-bs16a1-s1", "none-bs4a4-s1"]
    assert all(run.info.status == "FINISHED" for run in runs.values())
    # the resubmitted sweep skipped the finished cells: same runs, now also counted in the second sweep
    assert all(runs[name].info.run_id == run_id for name, run_id in before.items())
    assert all(runs[name].data.tags["gaexp.sweeps"] == ",".join(sweep_ids) for name in before)
    assert all(run.data.tags["threads"] == str(max(1, usable_cores() // 2)) for run in runs.values())


@pytest.mark.slow
def test_cells_were_submitted_two_at_a_time(local_sweeps):
    """submitit starts a batch's processes together and waits for them all: 4 cells, 2 batches of 2
    (read from what the launcher logged, not from clocks, so machine load cannot change it)."""
    output = local_sweeps[-1]
    batches = output.split("Submitit 'local' sweep output dir")[1:]
    assert [re.findall(r"\t#(\d+) : ", batch) for batch in batches] == [["0", "1"], ["2", "3"]]


@pytest.mark.slow
def test_histories_and_artifacts_arrive_over_http(local_sweeps, tmp_path):
    _, client, _, runs, _, _ = local_sweeps
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


@pytest.mark.slow
def test_report_run_lands_in_the_server(local_sweeps):
    _, client, _, _, sweep_ids, _ = local_sweeps
    experiment_id = client.get_experiment_by_name("gaexp").experiment_id
    (report,) = client.search_runs([experiment_id], f"tags.`gaexp.role` = 'report' and tags.sweep_id = '{sweep_ids[-1]}'")
    assert {"table.md", "table.csv", "runs.csv"} <= {a.path for a in client.list_artifacts(report.info.run_id)}


@pytest.mark.slow
def test_analysis_cli_reads_the_server(local_sweeps, server):
    out, client, _, runs, sweep_ids, _ = local_sweeps
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


@pytest.mark.slow
def test_status_reads_both_sweeps_from_the_server(local_sweeps, server):
    """gaexp-status from another process, over HTTP: the resume skipped the first sweep's 2 cells."""
    _, _, _, _, sweep_ids, _ = local_sweeps
    uri, _ = server
    proc = subprocess.run([sys.executable, "-m", "gaexp.progress", "--tracking-uri", uri, "--sweep", "all"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    blocks = {b.splitlines()[0]: b.splitlines()[1].strip() for b in proc.stdout.strip().split("\n\n")}
    assert blocks[f"sweep {sweep_ids[0]} (FINISHED)"].startswith("2/2 cells: 2 finished, 0 running; 100% of the work")
    assert blocks[f"sweep {sweep_ids[1]} (FINISHED)"].startswith(
        "4/4 cells: 2 finished, 2 skipped, 0 running; 100% of the work")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None,
                    reason="hydra-ray-launcher not installed (pip install -e '.[ray]')")
def test_ray_launcher_runs_cells_into_the_server(server, tmp_path, gaexp_command, training_runs):
    uri, _ = server
    proc = gaexp_command(tmp_path, "launch=ray", "hydra.launcher.ray.init.num_cpus=2", f"mlflow.tracking_uri={uri}",
                         "mlflow.experiment_name=ray", "norm=gn4,none", "regime=bs4a4", HOLDOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client, runs = training_runs(uri, "ray")
    assert sorted(runs) == ["gn4-bs4a4-s1", "none-bs4a4-s1"]
    assert all(run.info.status == "FINISHED" and run.data.tags["threads"] == "1" for run in runs.values())
    assert all([m.step for m in client.get_metric_history(run.info.run_id, "valid_acc")] == [2, 4] for run in runs.values())


@pytest.mark.slow
def test_slurm_preset_reaches_sbatch_with_the_cluster_knobs(tmp_path, gaexp_command, training_runs):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\ncp "$1" {tmp_path}/submitted.sh\n'
                                    'echo "sbatch: error: no cluster here" >&2\nexit 1\n')
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit looks for it before submitting
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = gaexp_command(tmp_path, "launch=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.array_parallelism=3",
                         "hydra.launcher.account=mylab", "hydra.launcher.qos=short", "+experiment=spec",
                         "norm=gn4,none", "regime=bs4a4,bs16a1", "seed=1", env=env)
    assert proc.returncode != 0 and "no cluster here" in proc.stdout + proc.stderr
    assert "SQLite on a shared file system" in proc.stdout  # the store is local: warned before submitting
    script = (tmp_path / "submitted.sh").read_text()
    for line in ["#SBATCH --partition=gpu", "#SBATCH --cpus-per-task=2", "#SBATCH --array=0-3%3",
                 "#SBATCH --time=60", "#SBATCH --mem=4GB", "#SBATCH --job-name=gaexp-spec", "#SBATCH --account=mylab",
                 "#SBATCH --qos=short"]:
        assert line in script
    assert not training_runs(f"sqlite:///{tmp_path}/mlflow.db")[1]  # nothing ran, nothing recorded


def cells_and_threads(compose, *overrides: str) -> tuple:
    """What a job under these overrides uses: the launch config's cells_at_once, and threads=auto for it."""
    compose(*overrides, hydra=True)  # the current HydraConfig: ${hydra:...} resolves as in a job
    c = typed(compose(*overrides))
    return c.cells_at_once, threads_for("auto", c.cells_at_once)


CORES = (1, 2, 8, 16, 64)
# (the launch config's cells_at_once, torch threads per cell) on machines of 1, 2, 8, 16 and 64 usable cores:
# written out, not computed, so that a change of the rule shows here. threads x cells never exceeds the cores
# (but for a cell's minimum of one thread), and no cell gets 0 threads (torch's default: every core) but one
# alone. A launcher no launch config describes is warned about (below).
PER_LAUNCHER = {
    "one cell at a time": ([], [(None, 0)] * 5),
    "joblib preset, 3 jobs": (["launch=joblib", "hydra.launcher.n_jobs=3"],
                              [(3, 1), (3, 1), (3, 2), (3, 5), (3, 21)]),
    "joblib preset, one job per core": (["launch=joblib"], [(1, 1), (2, 1), (8, 1), (16, 1), (64, 1)]),
    "local preset": (["launch=local"], [(1, 1), (2, 1), (8, 1), (16, 1), (64, 1)]),
    "local preset, 2 at once": (["launch=local", "hydra.sweeper.max_batch_size=2"],
                                [(2, 1), (2, 1), (2, 4), (2, 8), (2, 32)]),
    "slurm preset": (["launch=slurm"], [(1, 1), (1, 2), (1, 8), (1, 16), (1, 64)]),
    "ray preset, 2 CPUs a cell": (["launch=ray", "hydra.launcher.ray.remote.num_cpus=2"],
                                  [(1, 1), (1, 2), (4, 2), (8, 2), (32, 2)]),
}


@pytest.mark.parametrize("cores", CORES)
@pytest.mark.parametrize("launcher", list(PER_LAUNCHER))
def test_cells_at_once_per_launcher(compose, machine, launcher, cores):
    overrides, expected = PER_LAUNCHER[launcher]
    if "ray" in launcher and importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None:
        pytest.skip("hydra-ray-launcher not installed")
    machine(cores)
    assert cells_and_threads(compose, *overrides) == expected[CORES.index(cores)]


@pytest.mark.parametrize("launcher", ["joblib preset, one job per core", "local preset", "ray preset, 2 CPUs a cell"])
def test_a_container_quota_bounds_the_presets(compose, machine, launcher):
    """A container limited to 2 CPUs on a 64-core host: the presets plan for 2, not 64."""
    overrides, expected = PER_LAUNCHER[launcher]
    if "ray" in launcher and importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None:
        pytest.skip("hydra-ray-launcher not installed")
    machine(64, quota=2)
    assert cells_and_threads(compose, *overrides) == expected[CORES.index(2)]


def test_launcher_warnings_name_the_fix(compose):
    (undescribed,) = launcher_warnings(compose("hydra/launcher=submitit_local", hydra=True))
    assert undescribed == ("hydra/launcher=submitit_local: no launch config says how many cells it runs at once, so "
                           "each cell uses every core (threads=auto); use launch=<joblib, local, ray, slurm> "
                           "(conf/launch/), or set cells_at_once=N (and hydra.sweeper.max_batch_size=N for a launcher "
                           "that starts them all)")
    assert launcher_warnings(compose("hydra/launcher=joblib", "cells_at_once=4", hydra=True)) == []
    assert launcher_warnings(compose("launch=local", hydra=True)) == launcher_warnings(compose(hydra=True)) == []
    (shared_sqlite,) = launcher_warnings(compose("launch=slurm", hydra=True))
    assert "mlflow.tracking_uri=http://HOST:PORT" in shared_sqlite
    assert launcher_warnings(compose("launch=slurm", "mlflow.tracking_uri=http://mlflow.lab:5000", hydra=True)) == []
    if importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is not None:
        assert launcher_warnings(compose("launch=ray", hydra=True)) == []  # a local Ray: the cells share this host
        (joined,) = launcher_warnings(compose("launch=ray", "hydra.launcher.ray.init.address=ray://head:10001",
                                              hydra=True))
        assert joined == shared_sqlite


# A launcher of one's own is one launch config (and, here, the class it names, in a hydra_plugins/ folder of its own
# as Hydra requires of a launcher): submitit's local launcher, wrapped to leave a mark of each batch it launches.
# The app is not told of it.
LAUNCH_FILE = """
# @package _global_
# two cells at a time, each in its own process, through hydra_plugins/my_launchers.py
defaults:
  - override /hydra/launcher: submitit_local

cells_at_once: 2

hydra:
  sweeper:
    max_batch_size: 2
  launcher:
    _target_: hydra_plugins.my_launchers.MarkingLocalLauncher
    timeout_min: 10
"""
LAUNCHER_MODULE = """
from pathlib import Path

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher


class MarkingLocalLauncher(LocalLauncher):
    def launch(self, job_overrides, initial_job_idx):
        mark = Path(self.config.hydra.sweep.dir) / "marks"
        mark.mkdir(parents=True, exist_ok=True)
        (mark / str(initial_job_idx)).write_text(str(len(job_overrides)))
        return super().launch(job_overrides, initial_job_idx)
"""


def launcher_of_ones_own(tmp_path: Path) -> str:
    (tmp_path / "mine" / "launch").mkdir(parents=True)
    (tmp_path / "mine" / "launch" / "twice.yaml").write_text(LAUNCH_FILE)
    (tmp_path / "hydra_plugins").mkdir()  # a namespace package, beside gaexp's own plugins
    (tmp_path / "hydra_plugins" / "my_launchers.py").write_text(LAUNCHER_MODULE)
    return f"hydra.searchpath=[file://{tmp_path / 'mine'}]"


def test_a_launcher_of_ones_own_is_one_launch_config(compose, machine, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    searchpath = launcher_of_ones_own(tmp_path)
    machine(8)
    assert cells_and_threads(compose, searchpath, "launch=twice") == (2, 4)
    assert launcher_warnings(compose(searchpath, "launch=twice", hydra=True)) == []


@pytest.mark.slow
def test_a_sweep_runs_through_a_launcher_of_ones_own(tmp_path, gaexp_command, training_runs):
    searchpath = launcher_of_ones_own(tmp_path)
    proc = gaexp_command(tmp_path, searchpath, "launch=twice", "norm=gn4,none", "regime=bs4a4", HOLDOUT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path),
                                                                                        os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no launch config says" not in proc.stderr
    (sweep,) = (tmp_path / "multirun").iterdir()
    assert {p.name: p.read_text() for p in (sweep / "marks").iterdir()} == {"0": "2"}  # one batch of both cells
    _, runs = training_runs(f"sqlite:///{tmp_path}/mlflow.db")
    assert sorted(runs) == ["gn4-bs4a4-s1", "none-bs4a4-s1"] and all(r.info.status == "FINISHED" for r in runs.values())
    assert {r.data.tags["threads"] for r in runs.values()} == {str(threads_for("auto", 2))}


@pytest.mark.slow
def test_unknown_launch_preset_lists_the_choices(tmp_path, gaexp_command):
    proc = gaexp_command(tmp_path, "launch=kubernetes")
    assert proc.returncode == 1  # one line (Hydra's own message was 13)
    assert proc.stderr.strip().splitlines() == ["error: launch=kubernetes: no such launch; valid: joblib, local, ray, slurm"]
    assert not (tmp_path / "mlflow.db").exists()


def test_a_slurm_task_uses_at_most_the_cpus_it_was_given(machine):
    """Clusters that do not bind CPUs (task/none) still say how many a task has: SLURM_CPUS_PER_TASK."""
    machine(16, slurm_cpus=1)
    assert usable_cores() == 1 and threads_for("auto", 1) == 1
    machine(16, slurm_cpus=24)  # never more than the CPU mask
    assert usable_cores() == 16 and threads_for("auto", 1) == 16
    machine(16, slurm_cpus=None)
    assert usable_cores() == 16
