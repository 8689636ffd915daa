"""gaexp on a real SLURM cluster (tests/slurm_cluster.py: one node, with accounting), through the public
command: `launch=slurm` submits one job array through submitit, the cells log to a real MLflow server,
and Hydra's callbacks (store preparation, progress, report) run in the submitting process."""

from __future__ import annotations

import subprocess
import time
from datetime import datetime
from types import SimpleNamespace

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

SLURM = ["launch=slurm", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=10"]
# The cells evaluate 1,000 held-out training images instead of the 10,000 test images (a tenth of the cost of
# each evaluation): what is checked here (the array, its tasks, what they record) does not depend on which images.
HOLDOUT = "data.holdout=1000"
# Not in the cancelled task's test, whose cell must stay RUNNING long enough to be cancelled on a fast machine.


def sacct(slurm, job: str, fields: str = "JobID,JobName,State,Start,End", steps: bool = False) -> list[dict]:
    """The cluster's accounting of a job (an array: one row per task; `steps`: and one per job step too)."""
    proc = slurm.run("sacct", "-n", *([] if steps else ["-X"]), "-P", "-j", job, "-o", fields)
    assert proc.returncode == 0, proc.stderr
    return [dict(zip(fields.split(","), line.split("|"))) for line in proc.stdout.splitlines()]


@pytest.fixture(scope="module")
def grid(slurm, server, tmp_path_factory, gaexp_argv, training_runs):
    """A 2 x 2 grid submitted as one array, one task at a time (the node has room for two)."""
    uri, _ = server
    out = tmp_path_factory.mktemp("slurm-grid")
    argv = gaexp_argv(out, *SLURM, "hydra.launcher.array_parallelism=1", f"mlflow.tracking_uri={uri}",
                      "norm=gn4,none", "regime=bs4a4,bs16a1", "seed=1", HOLDOUT, "analysis.plots=true")
    tic = time.monotonic()
    proc = subprocess.Popen(argv, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    client, runs = training_runs(uri)
    return SimpleNamespace(out=out, pid=proc.pid, output=stdout + stderr, client=client, runs=runs, uri=uri,
                           seconds=time.monotonic() - tic)


def test_the_grid_is_one_array_whose_tasks_log_finished_runs(grid, slurm):
    assert sorted(grid.runs) == ["gn4-bs16a1-s1", "gn4-bs4a4-s1", "none-bs16a1-s1", "none-bs4a4-s1"]
    assert all(run.info.status == "FINISHED" for run in grid.runs.values())
    jobs = {name: run.data.tags["slurm_job_id"] for name, run in grid.runs.items()}
    array = {job.split("_")[0] for job in jobs.values()}
    assert len(array) == 1 and sorted(job.split("_")[1] for job in jobs.values()) == ["0", "1", "2", "3"]
    tasks = sacct(slurm, array.pop())
    assert sorted(t["JobID"] for t in tasks) == sorted(jobs.values())
    assert {(t["JobName"], t["State"]) for t in tasks} == {("gaexp-grid", "COMPLETED")}
    assert all(run.data.tags["threads"] == "1" for run in grid.runs.values())  # its cpus_per_task
    (script,) = grid.out.glob("multirun/*/.submitit/*/*_submission.sh")
    text = script.read_text()
    assert all(line in text for line in ["#SBATCH --array=0-3%1", "#SBATCH --cpus-per-task=1",
                                         "#SBATCH --job-name=gaexp-grid", "#SBATCH --mem=1GB", "#SBATCH --time=10"])


def test_the_array_ran_at_most_array_parallelism_tasks_at_once(grid, slurm):
    """The node has 2 CPUs and each task asks for 1, so only array_parallelism=1 kept them apart."""
    array = next(iter(grid.runs.values())).data.tags["slurm_job_id"].split("_")[0]
    spans = sorted((datetime.fromisoformat(t["Start"]), datetime.fromisoformat(t["End"])) for t in sacct(slurm, array))
    assert len(spans) == 4 and all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))
    runs = sorted((r.info.start_time, r.info.end_time) for r in grid.runs.values())
    assert all(later[0] >= earlier[1] for earlier, later in zip(runs, runs[1:]))
    # what each task was given, from accounting: slurmctld's log once had "sched: Allocate" lines for only 3 of
    # the 4 tasks in a clean-clone CI run (every task FINISHED; probably one started by another scheduler path)
    tasks = sacct(slurm, array, "JobID,AllocCPUS,Partition")
    assert len(tasks) == 4 and all((t["AllocCPUS"], t["Partition"]) == ("1", "debug") for t in tasks), tasks


def test_callbacks_ran_in_the_submitting_process(grid):
    experiment_id = grid.client.get_experiment_by_name("gaexp").experiment_id
    (plan,) = grid.client.search_runs([experiment_id], "tags.`gaexp.role` = 'sweep'")
    (report,) = grid.client.search_runs([experiment_id], "tags.`gaexp.role` = 'report'")
    for run in (plan, report):  # made by the gaexp command itself, not in a job
        assert run.data.tags["gaexp.host"].endswith(f":{grid.pid}") and "slurm_job_id" not in run.data.tags
    assert not any(r.data.tags["gaexp.host"].endswith(f":{grid.pid}") for r in grid.runs.values())
    assert "4/4 cells: 4 finished" in grid.output and "| gn4 |" in grid.output  # progress lines, then the report
    assert {"table.md", "curves.png"} <= {a.path for a in grid.client.list_artifacts(report.info.run_id)}


def test_a_failing_cell_fails_alone(slurm, server, tmp_path, gaexp_command, training_runs):
    uri, _ = server
    proc = gaexp_command(tmp_path, *SLURM, f"mlflow.tracking_uri={uri}", "mlflow.experiment_name=slurm-failure",
                         "norm=gn4", "regime=bs16a1", "train.lr=1e-3,1e30", HOLDOUT)
    assert proc.returncode == 1 and "error: 1 cell(s) failed, the others ran" in proc.stderr, proc.stderr[-3000:]
    client, _ = training_runs(uri, "slurm-failure")
    runs = client.search_runs([client.get_experiment_by_name("slurm-failure").experiment_id], "tags.norm = 'gn4'")
    by_lr = {run.data.params["train.lr"]: run for run in runs}  # two runs named gn4-bs16a1-s1
    assert by_lr["0.001"].info.status == "FINISHED"
    assert by_lr["1e+30"].info.status == "FAILED" and by_lr["1e+30"].data.tags["diverged_step"] == "2"
    jobs = [run.data.tags["slurm_job_id"] for run in by_lr.values()]
    assert {t["State"] for job in jobs for t in sacct(slurm, job)} == {"COMPLETED"}  # the task caught it


def test_a_cancelled_task_fails_its_cell_alone_and_the_same_command_redoes_only_it(slurm, server, tmp_path, gaexp_argv,
                                                                                  training_runs):
    """The command waits for the array's other task, writes the report, exits 1 naming the cancelled cell, and
    has marked its run KILLED; run again, it trains that cell only."""
    uri, _ = server
    overrides = [*SLURM, f"mlflow.tracking_uri={uri}", "mlflow.experiment_name=slurm-cancel", "norm=gn4",
                 "regime=bs16a1,bs4a4", "train.num_iterations=200", "train.eval_period=200"]  # seconds of
    # training: the victim must still be running when the test, having seen it RUNNING, suspends it (at 150 steps
    # a fast machine finished it between the test's look and its scancel; suspended first, it cannot)
    first = subprocess.Popen(gaexp_argv(tmp_path, *overrides), cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while True:  # the shorter cell (bs16a1, task 1 of 2: the longer starts first) is training: cancel its task
        _, runs = training_runs(uri, "slurm-cancel")
        victim = runs.get("gn4-bs16a1-s1")
        if victim is not None and victim.info.status == "RUNNING":
            break
        assert time.monotonic() < deadline and first.poll() is None, "the cell never started"
        time.sleep(0.5)
    job = victim.data.tags["slurm_job_id"]
    other = f"{job.split('_')[0]}_{1 - int(job.split('_')[1])}"
    # The victim is held (SIGSTOP) and seen still RUNNING before it is cancelled: it cannot end in between. The
    # other task is held until the command has dealt with the cancelled one, so that it surely ends after the
    # command knew of the cancel: only a command that waits for every task sees it finish.
    assert slurm.run("scontrol", "suspend", job).returncode == 0
    assert training_runs(uri, "slurm-cancel")[1]["gn4-bs16a1-s1"].info.status == "RUNNING", "it ended before its hold"
    assert slurm.run("scontrol", "suspend", other).returncode == 0
    assert slurm.run("scancel", job).returncode == 0
    reason = f"SLURM job {job} ended CANCELLED"
    while training_runs(uri, "slurm-cancel")[1]["gn4-bs16a1-s1"].info.status == "RUNNING":
        assert time.monotonic() < deadline + 300 and first.poll() is None, "the cancelled run was never marked"
        time.sleep(0.5)
    killed = training_runs(uri, "slurm-cancel")[1]["gn4-bs16a1-s1"]
    assert killed.info.status == "KILLED" and killed.data.tags["gaexp.killed_reason"] == reason  # at once
    assert slurm.run("scontrol", "resume", other).returncode == 0
    stdout, stderr = first.communicate(timeout=600)
    _, runs = training_runs(uri, "slurm-cancel")  # as the command left them
    assert runs["gn4-bs4a4-s1"].info.status == "FINISHED", stderr[-3000:]  # the command waited for the other task
    assert runs["gn4-bs16a1-s1"].info.status == "KILLED"
    markers = list(tmp_path.glob("multirun/*/*/FAILED.txt"))
    assert [("regime=bs16a1" in m.parent.name, m.read_text()) for m in markers] == [(True, reason)], markers
    assert first.returncode == 1, stdout[-3000:] + stderr[-3000:]
    assert f"error: 1 cell(s) failed, the others ran:\n  {markers[0].parent.name}: {reason}\n" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr
    tasks = {t["JobID"]: t["State"] for t in sacct(slurm, job.split("_")[0])}
    assert tasks[job].startswith("CANCELLED") and tasks[other] == "COMPLETED"
    sweep = markers[0].parent.parent.name
    client, _ = training_runs(uri, "slurm-cancel")
    experiment_id = client.get_experiment_by_name("slurm-cancel").experiment_id
    (report,) = client.search_runs([experiment_id], f"tags.`gaexp.role` = 'report' and tags.sweep_id = '{sweep}'")
    assert report.info.status == "FINISHED" and (tmp_path / "reports" / sweep / "table.md").is_file()
    assert "| gn4 |" in stdout + stderr  # the report's table, printed before the summary

    again = subprocess.run(gaexp_argv(tmp_path, *overrides), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    cells = client.search_runs([experiment_id], "tags.norm = 'gn4'")
    assert sorted((r.info.run_name, r.info.status) for r in cells) == [
        ("gn4-bs16a1-s1", "FINISHED"), ("gn4-bs16a1-s1", "KILLED"), ("gn4-bs4a4-s1", "FINISHED")]
    assert "1 skipped" in again.stdout + again.stderr  # the other cell, not trained again


def test_a_dp_cell_is_one_job_of_w_tasks_that_meet_through_slurm_and_train_as_its_twin(slurm, server, tmp_path,
                                                                                      gaexp_command, training_runs):
    """w2b4a2 beside its accumulation twin bs4a4, each its own array: the DP cell's job asks for 2 tasks of one
    CPU each (the cell's 2 shared), SLURM_PROCID is each task's rank, and only rank 0 records; its train loss,
    averaged over the replicas, is its twin's at every evaluation (the same samples, the same step; one torch
    thread in every process, as a thread count changes the sums' order: 3e-4 apart at 2 threads)."""
    uri, _ = server
    two_cpus = [o for o in SLURM if not o.startswith("hydra.launcher.cpus_per_task=")] + ["hydra.launcher.cpus_per_task=2"]
    proc = gaexp_command(tmp_path, *two_cpus, f"mlflow.tracking_uri={uri}", "mlflow.experiment_name=slurm-dp",
                         "norm=bn", "regime=w2b4a2,bs4a4", "threads=1", HOLDOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client, runs = training_runs(uri, "slurm-dp")
    dp, twin = runs["bn-w2b4a2-s1"], runs["bn-bs4a4-s1"]
    assert (dp.info.status, twin.info.status) == ("FINISHED", "FINISHED") and len(runs) == 2
    assert (dp.data.tags["replicas"], dp.data.tags["threads"], twin.data.tags["threads"]) == ("2", "1", "1")
    losses = [[m.value for m in client.get_metric_history(r.info.run_id, "train_loss")] for r in (dp, twin)]
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    job = dp.data.tags["slurm_job_id"]
    assert job.split("_")[0] != twin.data.tags["slurm_job_id"].split("_")[0]  # an array per replica count
    steps = {t["JobID"]: t for t in sacct(slurm, job.split("_")[0], "JobID,State,NTasks,AllocCPUS", steps=True)}
    (step,) = [t for jid, t in steps.items() if jid.endswith(".0")]  # submitit's srun: the cell's two tasks
    assert (step["NTasks"], step["AllocCPUS"], step["State"]) == ("2", "2", "COMPLETED"), steps
    scripts = {p.read_text().count("#SBATCH --ntasks-per-node=2"): p.read_text()
               for p in tmp_path.glob("multirun/*/.submitit/*/*_submission.sh")}
    assert sorted(scripts) == [0, 1] and "#SBATCH --cpus-per-task=1" in scripts[1]
    assert "#SBATCH --cpus-per-task=2" in scripts[0] and "GAEXP_REPLICAS_STORE" not in scripts[0]
