"""A cell of w = 2 replicas through the public command (gaexp/cell.py `team`, gaexp/replicas.py): under joblib its
train loss is its accumulation twin's, step for step; one MLflow run, rank 0's; the faults a cell meets: a replica
killed mid-training fails the cell in one line naming its rank, leaves no process and a FAILED run, and the next
sweep resumes it; a replica that raises is named with its error; rank 0's own failure stops the others; a port
in use is taken from another; more replicas than cores warns with the numbers."""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from gaexp import replicas

DYING = '''
import os, signal
from pathlib import Path

import torch.distributed as dist

from gaexp.model import SimpleModel


class Net(SimpleModel):
    """The study's CNN; under GAEXP_TEST_FAIL=RANK:HOW:N the replica of that rank dies (kill: SIGKILL) or raises at
    its N-th training forward. Each replica writes its pid to pids/RANK."""

    forwards = 0

    def forward(self, x):
        if self.training and dist.is_initialized():
            rank = dist.get_rank()
            Path("pids").mkdir(exist_ok=True)
            Path("pids", str(rank)).write_text(str(os.getpid()))
            Net.forwards += 1
            fail = os.environ.get("GAEXP_TEST_FAIL", "")
            if fail and int(fail.split(":")[0]) == rank and Net.forwards == int(fail.split(":")[2]):
                if fail.split(":")[1] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise ValueError(f"rank {rank} gave up at forward {Net.forwards}")
        return super().forward(x)
'''


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


@pytest.fixture
def dying(tmp_path: Path) -> Path:
    (tmp_path / "dying.py").write_text(DYING)
    return tmp_path


def cell(gaexp_command, out: Path, fail: str | None, *more: str):
    env = {**os.environ, **({"GAEXP_TEST_FAIL": fail} if fail else {})}
    env.pop("GAEXP_TEST_FAIL", None) if fail is None else None
    return gaexp_command(out, "model=custom", "model.target=dying:Net", "regime=w2b4a1", "train.num_iterations=6",
                         *more, env=env)


@pytest.mark.slow
def test_a_killed_replica_fails_the_cell_naming_it_and_the_next_sweep_resumes(gaexp_command, training_runs, dying):
    done = cell(gaexp_command, dying, "1:kill:3")
    assert done.returncode != 0
    assert "replica 1 of 2 died (signal SIGKILL)" in done.stderr, done.stderr[-3000:]
    pids = {int(p.name): int(p.read_text()) for p in (dying / "pids").iterdir()}
    assert set(pids) == {0, 1} and not any(alive(pid) for pid in pids.values())  # none left behind
    client, runs = training_runs(f"sqlite:///{dying}/mlflow.db")
    (run,) = runs.values()
    assert run.info.status == "FAILED" and "replica 1 of 2 died" in run.data.tags["error"]
    again = cell(gaexp_command, dying, None)
    assert again.returncode == 0, again.stderr[-3000:]
    statuses = sorted((r.info.status, r.data.tags["replicas"], r.info.run_name)
                      for r in client.search_runs([run.info.experiment_id]) if "replicas" in r.data.tags)
    assert statuses == [("FAILED", "2", "custom-bn-w2b4a1-s1"), ("FINISHED", "2", "custom-bn-w2b4a1-s1")]


@pytest.mark.slow
def test_rank_0_failing_stops_the_other_replicas(gaexp_command, dying):
    done = cell(gaexp_command, dying, "0:raise:3")
    assert done.returncode != 0 and "ValueError: rank 0 gave up at forward 3" in done.stderr, done.stderr[-3000:]
    pid = int((dying / "pids" / "1").read_text())
    assert not alive(pid)  # blocked in an all-reduce for rank 0, it was stopped, not left waiting 30 minutes


def _raises(index: int) -> None:
    raise ValueError(f"replica index {index} cannot set up")


def _sleeps(index: int, pid_file: str) -> None:
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(600)


def test_a_replica_that_raises_is_named_with_its_error():
    with replicas.Team(_raises, (), 2) as team, pytest.raises(replicas.ReplicaError) as error:
        team.finish()
    assert str(error.value) == "replica 1 of 2 failed: ValueError: replica index 0 cannot set up"


def test_leaving_a_team_stops_its_replicas(tmp_path):
    pid_file = tmp_path / "pid"
    with replicas.Team(_sleeps, (str(pid_file),), 2):
        deadline = time.monotonic() + 120
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not alive(int(pid_file.read_text()))


def test_a_port_in_use_is_taken_from_another(monkeypatch):
    with socket.socket() as busy:
        busy.bind((replicas.HOST, 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv(replicas.PORT_ENV, str(port))
        store, note = replicas.open_store(2)
    assert note == f"{replicas.PORT_ENV}={port} is in use; the replicas meet on port {store.port} instead"
    assert store.port != port


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_under_joblib_a_dp_cell_trains_as_its_accumulation_twin(gaexp_command, gaexp_argv, training_runs, tmp_path):
    """One core (taskset) and the port asked for in use: both said in one line each in the cell's log, and it runs; its train
    loss, averaged over the replicas, is its twin's (b, w*k) at every evaluation: the same samples, the same step."""
    import subprocess

    with socket.socket() as busy:
        busy.bind((replicas.HOST, 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**os.environ, replicas.PORT_ENV: str(port)}
        argv = ["taskset", "-c", "0", *gaexp_argv(tmp_path, "launch=joblib", "norm=bn", "regime=w2b4a2,bs4a4")]
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (log,) = tmp_path.glob("multirun/*/*regime=w2b4a2*/gaexp.log")  # a sweep's cell says its lines in its log
    assert "regime.replicas=2 on 1 core: the replicas share them" in log.read_text()
    assert f"{replicas.PORT_ENV}={port} is in use; the replicas meet on port" in log.read_text()
    client, runs = training_runs(f"sqlite:///{tmp_path}/mlflow.db")
    dp, twin = runs["bn-w2b4a2-s1"], runs["bn-bs4a4-s1"]
    assert (dp.data.tags["replicas"], twin.data.tags["replicas"]) == ("2", "1")
    losses = [[m.value for m in client.get_metric_history(r.info.run_id, "train_loss")] for r in (dp, twin)]
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-5)


# --- replicas a launcher started: torchrun's processes (launch=slurm's tasks: tests/test_slurm.py) -------------

def torchrun(gaexp_argv, out: Path, *overrides: str, env: dict | None = None):
    """`torchrun --standalone --nproc-per-node 2 -m gaexp ...` at the tiny budget, one cell (no -m), in `out`."""
    import subprocess
    import sys

    argv = gaexp_argv(out, *overrides)
    assert argv[1:5] == ["-m", "gaexp", "-m", argv[4]] and argv[3] == "-m"  # [python, -m, gaexp, -m, overrides...]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "gaexp",
               *argv[4:]]
    return subprocess.run(command, cwd=out, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
def test_under_torchrun_each_process_is_a_replica_of_one_cell_whose_run_rank_0_writes(gaexp_argv, gaexp_command,
                                                                                     training_runs, tmp_path):
    """The cell torchrun's two processes train is the one a cell of w = 2 starting its own replicas trains: the same
    train loss at every evaluation, one MLflow run each; run again, torchrun's processes skip it together."""
    done = torchrun(gaexp_argv, tmp_path, "norm=bn", "regime=w2b4a2")
    assert done.returncode == 0, done.stderr[-3000:]
    client, runs = training_runs(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = runs.values()
    assert (run.info.run_name, run.info.status, run.data.tags["replicas"]) == ("bn-w2b4a2-s1", "FINISHED", "2")
    again = torchrun(gaexp_argv, tmp_path, "norm=bn", "regime=w2b4a2")
    assert again.returncode == 0 and "skipped, already FINISHED" in again.stdout + again.stderr, again.stderr[-3000:]
    own = gaexp_command(tmp_path, "norm=bn", "regime=w2b4a2", "rerun=true")
    assert own.returncode == 0, own.stderr[-3000:]
    runs = client.search_runs([run.info.experiment_id], "tags.regime = 'w2b4a2'")
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}  # torchrun's again added none
    losses = [[m.value for m in client.get_metric_history(r.info.run_id, "train_loss")] for r in runs]
    assert len(losses[0]) == 2 and losses[0] == losses[1]


@pytest.mark.slow
def test_under_torchrun_a_replicas_error_is_named_in_the_cells_run(gaexp_argv, training_runs, dying):
    env = {**os.environ, "GAEXP_TEST_FAIL": "1:raise:3"}
    done = torchrun(gaexp_argv, dying, "model=custom", "model.target=dying:Net", "regime=w2b4a1",
                    "train.num_iterations=6", env=env)
    assert done.returncode != 0
    _, runs = training_runs(f"sqlite:///{dying}/mlflow.db")
    (run,) = runs.values()
    assert run.info.status == "FAILED", done.stderr[-3000:]
    assert run.data.tags["error"].endswith("replica 1 of 2 failed: ValueError: rank 1 gave up at forward 3")


@pytest.mark.slow
def test_torchrun_refuses_a_sweep_and_another_replica_count_in_one_line_per_process(gaexp_argv, tmp_path):
    """Each process refuses in one line, and none with a traceback of gaexp's; torchrun stops the others when the
    first exits, so a process still composing its config then (a loaded machine: seen in CI of 2026-12-05) never
    says it: one line or two, never another."""
    def one_line_each(done, line: str) -> None:
        assert done.returncode != 0 and 1 <= done.stderr.count(line) <= 2, done.stderr[-3000:]
        assert f'File "{Path(__file__).resolve().parents[1] / "gaexp"}/' not in done.stderr, done.stderr[-3000:]

    one_line_each(torchrun(gaexp_argv, tmp_path, "regime=bs4a4"),
                  "error: regime.replicas=1 on the 2 processes torchrun started (--nproc-per-node times --nnodes): each "
                  "process is a replica; valid: a regime of 2 replicas (w2bBaK), or 1 process\n")
    one_line_each(torchrun(gaexp_argv, tmp_path, "-m", "regime=w2b4a2"),
                  "error: gaexp -m under torchrun: each of its processes would run the whole sweep; valid: one cell per "
                  "torchrun")
    assert not (tmp_path / "mlflow.db").exists()  # nothing recorded


def test_the_launchers_environment_says_which_replica_a_process_is():
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", replicas.STORE_FILE_ENV: "/shared/x"}
    assert replicas.launched(slurm) == replicas.Launched(1, 2, 1, 1, "SLURM", "/shared/x")
    assert replicas.launched({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}) is None  # a SLURM job not launch=slurm's DP cell
    run = {"TORCHELASTIC_RUN_ID": "r", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert replicas.launched(run) == replicas.Launched(3, 4, 1, 2, "torchrun")
    assert replicas.launched({}) is None
