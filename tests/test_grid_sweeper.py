"""The gaexp grid sweeper (hydra_plugins/gaexp_grid_sweeper): the order of cells and bad settings; and its SLURM
launcher, which waits for every task, with submitit's jobs stood in for.

Its sweeps through the public command (progress lines, the plan run, the order the runs started in) are
in tests/test_app.py, on the shared tiny sweep.
"""

from __future__ import annotations

import math
from itertools import product
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra._internal.callbacks import Callbacks
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.utils import create_config_search_path
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import HydraException
from hydra.types import HydraContext, RunMode
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from submitit.core.utils import UncompletedJobError

from gaexp import liveness, progress, tracking
from gaexp.config import FAILED_MARKER
from gaexp.config import CONFIG_DIR
from gaexp import tags as runtags
from hydra_plugins.gaexp_grid_sweeper.submitit_launcher import SlurmLauncher, wait_for_every
from hydra_plugins.gaexp_grid_sweeper.sweeper import GridSweeper, longest_first


def test_longest_first_sorts_by_cost_and_keeps_the_given_order_among_equals():
    cells = [["norm=bn", "regime=bs1a1"], ["norm=bn", "regime=bs1a16"], ["norm=in", "regime=bs1a1"],
             ["norm=in", "regime=bs1a16"], ["norm=bn", "regime=bs16a1"]]
    costs = [48, 186, 48, 186, 102]
    assert longest_first(cells, costs) == [cells[1], cells[3], cells[4], cells[0], cells[2]]
    assert longest_first([], []) == []


def sweeper_on(compose, *overrides: str) -> GridSweeper:
    """The gaexp grid sweeper as Hydra sets it up for `gaexp -m *overrides`, with the real config loader.
    Imported after composing: Hydra's plugin discovery re-imports the sweeper modules."""
    config = compose(*overrides, hydra=True)
    from hydra_plugins.gaexp_grid_sweeper.sweeper import GridSweeper

    sweeper = GridSweeper(max_batch_size=None)
    sweeper.config = config
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(CONFIG_DIR))
    sweeper.hydra_context = HydraContext(config_loader=loader, callbacks=Callbacks())
    return sweeper


def test_the_study_grid_in_the_order_a_launcher_gets_it(compose):
    """The 60 cells of conf/experiment/spec.yaml, costed by the sweeper's own `cost` (each cell composed as
    Hydra composes it): bs1a16 first, then bs4a4, bs16a1, bs1a1; norms and seeds in the given order."""
    sweeper = sweeper_on(compose, "+experiment=spec")
    cells = [[f"norm={n}", f"regime={r}", f"seed={s}"] for n, r, s in
             product(["bn", "in", "gn4", "gn16", "none"], ["bs1a1", "bs1a16", "bs4a4", "bs16a1"], [1, 2, 3])]
    costs = [sweeper.cost(cell) for cell in cells]
    order = [c[1].split("=")[1] for c in longest_first(cells, costs)]
    assert order == ["bs1a16"] * 15 + ["bs4a4"] * 15 + ["bs16a1"] * 15 + ["bs1a1"] * 15
    assert longest_first(cells, costs)[:3] == [["norm=bn", "regime=bs1a16", "seed=1"],
                                               ["norm=bn", "regime=bs1a16", "seed=2"],
                                               ["norm=bn", "regime=bs1a16", "seed=3"]]


def test_a_cells_cost_follows_its_own_overrides(compose):
    """Budget, evaluation period and the images evaluated (a holdout) all come from the cell's own config."""
    sweeper = sweeper_on(compose, "+experiment=spec")
    base = sweeper.cost(["regime=bs4a4"])
    assert sweeper.cost(["regime=bs4a4", "train.num_iterations=1800"]) == pytest.approx(base / 2, rel=0.01)
    assert sweeper.cost(["regime=bs4a4", "train.eval_period=150"]) > base  # twice the evaluations
    assert sweeper.cost(["regime=bs4a4", "data.holdout=2000"]) < base      # 2,000 images evaluated, not 10,000
    assert sweeper.cost(["regime=bs1a16"]) > base > sweeper.cost(["regime=bs1a1"])
    assert sweeper.cost(["regime=bs1a16"]) < 1.2 * base  # batched: 16 samples in one pass, 16 or 4 draws
    loop = sweeper.cost(["regime=bs4a4", "accumulate=loop"])
    assert sweeper.cost(["regime=bs1a16", "accumulate=loop"]) > 1.3 * loop > 1.3 * base  # the loop: 16 or 4 passes


def test_the_plan_costs_a_cell_under_its_precision(compose):
    """The grid sweeper's cost of a cell (what orders it and sizes the ETA) is its run's: float32's with the engine
    the cell trains with, times the precision's PRECISION_COST."""
    from hydra_plugins.gaexp_grid_sweeper.sweeper import check_cell, cost_of

    sweeper = sweeper_on(compose, "+experiment=precision")
    def cost(*overrides):
        cfg = sweeper.cell_config(list(overrides))
        return cost_of(cfg, check_cell(cfg, overrides)[0])[0]
    batched = cost("norm=gn4", "regime=bs4a4", "precision=fp32")
    loop = cost("norm=gn4", "regime=bs4a4", "precision=fp32", "accumulate=loop")
    assert batched < loop
    for name in ("bf16", "bf16w-acc32"):  # batched under auto
        assert cost("norm=gn4", "regime=bs4a4", f"precision={name}") - progress.CELL_S == pytest.approx(
            progress.PRECISION_COST[name] * (batched - progress.CELL_S))
    assert cost("norm=gn4", "regime=bs4a4", "precision=bf16w") - progress.CELL_S == pytest.approx(
        progress.PRECISION_COST["bf16w"] * (loop - progress.CELL_S))  # the loop's alone


def test_a_cells_graphs_are_what_its_compile_choice_compiles_for_its_norm(compose):
    """The plan counts each graph once (gaexp/progress/): compile=auto compiles evaluation for every norm,
    training too for instance norm, one graph per batch size."""
    from hydra_plugins.gaexp_grid_sweeper.sweeper import check_cell, cost_of

    sweeper = sweeper_on(compose, "+experiment=spec")
    def graphs(*overrides):
        cfg = sweeper.cell_config(list(overrides))
        return cost_of(cfg, check_cell(cfg, overrides)[0])[1]
    assert graphs("norm=in", "regime=bs4a4") == {("eval", "simple", "mnist", "in"),
                                                 ("train", "simple", "mnist", "in", "4", "batched")}
    assert graphs("norm=in", "regime=bs4a4", "accumulate=loop") == {("eval", "simple", "mnist", "in"),
                                                                    ("train", "simple", "mnist", "in", "4", "loop")}
    assert graphs("norm=bn", "regime=bs4a4") == {("eval", "simple", "mnist", "bn")}
    assert graphs("norm=in", "regime=bs4a4", "compile=off") == frozenset()


@pytest.mark.parametrize("settings, message", [
    (dict(order="random"), "hydra.sweeper.order='random'; valid: longest_first, given"),
    (dict(max_batch_size=0), "hydra.sweeper.max_batch_size=0; valid: null or an integer >= 1"),
    (dict(poll_s=0), "hydra.sweeper.poll_s=0; valid: seconds > 0"),
])
def test_bad_settings_are_one_line_naming_the_value_and_the_valid_ones(settings, message):
    with pytest.raises(HydraException) as e:
        GridSweeper(**{"max_batch_size": None, **settings})
    assert str(e.value) == message


# --- the SLURM launcher that waits for every task (submitit_launcher.py); on a real cluster: tests/test_slurm.py ---

class FakeJob:
    """A submitted task as the launcher sees it: submitit calls it done after `polls` checks, with its state;
    it leaves a result (and its file), or raises as submitit does for a task without one."""

    def __init__(self, folder: Path, job_id: str, outcome, polls: int = 0, state: str = "COMPLETED"):
        self.job_id, self.outcome, self.polls, self.state = job_id, outcome, polls, state
        self.paths = SimpleNamespace(result_pickle=folder / f"{job_id}_result.pkl")
        self.waited = False

    def done(self) -> bool:
        self.polls -= 1
        if self.polls < 0 and not isinstance(self.outcome, Exception):
            self.paths.result_pickle.touch()
        return self.polls < 0

    def results(self) -> list:
        self.waited = True
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return [self.outcome]


@pytest.fixture
def sacct(monkeypatch):
    """The cluster's accounting as the launcher reads it (gaexp.liveness.slurm_job_end): {job: how it ended};
    a job not in it has not ended, or the accounting does not say yet."""
    ended: dict = {}
    monkeypatch.setattr(liveness, "slurm_job_end", lambda job: ended.get(job))
    return ended


def test_tasks_are_collected_as_they_end_and_a_suspended_one_is_waited_for(tmp_path, sacct):
    """In the order they end, not the array's; a task submitit calls ended while SUSPENDED, once sacct says so."""
    jobs = [FakeJob(tmp_path, "7_0", "a", polls=3),
            FakeJob(tmp_path, "7_1", UncompletedJobError("cancelled"), state="CANCELLED by 0"),
            FakeJob(tmp_path, "7_2", "c", polls=1),
            FakeJob(tmp_path, "7_3", UncompletedJobError("cancelled while suspended"), state="SUSPENDED")]
    ended = []

    def on_end(i):
        ended.append(i)
        if i == 0:
            sacct["7_3"] = "CANCELLED"  # cancelled while suspended: only sacct says so, submitit stopped asking

    wait_for_every(jobs, on_end, poll_s=0, sacct_every_s=0)
    assert ended == [1, 2, 0, 3]


def test_a_task_without_a_result_is_a_failed_cell_with_its_run_killed_and_the_others_are_collected(tmp_path, sacct):
    """Task 0 cancelled (sacct says so), task 1 out of time (only submitit says so yet), task 2 finishing last."""
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(CONFIG_DIR))
    config = loader.load_configuration("config", [
        "launch=slurm", f"paths.outputs={tmp_path}", f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        f"hydra.sweep.dir={tmp_path}/multirun/s"],
        run_mode=RunMode.MULTIRUN)
    assert config.hydra.launcher._target_ == "hydra_plugins.gaexp_grid_sweeper.submitit_launcher.SlurmLauncher"
    experiment_id = tracking.prepare_store(config.mlflow.tracking_uri, "gaexp", str(tmp_path / "artifacts"))
    client = MlflowClient(config.mlflow.tracking_uri)
    runs = {job: client.create_run(experiment_id, run_name=job, tags={runtags.SLURM_JOB: job}).info.run_id
            for job in ("7_0", "7_1", "7_2")}  # as the tasks left them: RUNNING
    cells = [["norm=gn4", "regime=bs4a4"], ["norm=gn4", "regime=bs1a16"], ["norm=none", "regime=bs16a1"]]
    finished = JobReturn(overrides=cells[2], status=JobStatus.COMPLETED, _return_value=0.97)
    jobs = [FakeJob(tmp_path, "7_0", UncompletedJobError("x"), state="CANCELLED by 0"),
            FakeJob(tmp_path, "7_1", UncompletedJobError("y"), polls=1, state="TIMEOUT"),
            FakeJob(tmp_path, "7_2", finished, polls=2)]
    sacct["7_0"] = "CANCELLED"
    launcher = SlurmLauncher(**OmegaConf.to_container(config.hydra.launcher))
    launcher.setup(hydra_context=HydraContext(config_loader=loader, callbacks=Callbacks()), task_function=None,
                   config=config)
    launcher.submit = lambda job_overrides, initial_job_idx: jobs  # instead of sbatch

    returns = launcher.launch(cells, initial_job_idx=0)
    assert all(job.waited for job in jobs) and returns[2] is finished
    assert all(r.status == JobStatus.COMPLETED and math.isnan(r.return_value) for r in returns[:2])  # as app.main's
    failed = {p.parent.name: p.read_text() for p in (tmp_path / "multirun" / "s").glob(f"*/{FAILED_MARKER}")}
    assert failed == {"norm=gn4,regime=bs4a4": "SLURM job 7_0 ended CANCELLED",
                      "norm=gn4,regime=bs1a16": "SLURM job 7_1 ended TIMEOUT"}
    after = {job: client.get_run(run_id) for job, run_id in runs.items()}
    assert {job: (r.info.status, r.data.tags.get("gaexp.killed_reason")) for job, r in after.items()} == {
        "7_0": ("KILLED", "SLURM job 7_0 ended CANCELLED"), "7_1": ("KILLED", "SLURM job 7_1 ended TIMEOUT"),
        "7_2": ("RUNNING", None)}


def test_the_first_cell_of_one_computation_computes_it_and_the_later_ones_share_it():
    """Cells alike but for their regime, of one micro-batch of b*k whose steps are its one pass (`one`): the first
    in launch order computes, the later ones share; another b*k, other overrides, or a cell not one pass never."""
    from hydra_plugins.gaexp_grid_sweeper.sweeper import shared_cells

    cells = [["norm=gn4", "regime=bs1a16"], ["norm=gn4", "regime=bs16a1"], ["norm=bn", "regime=bs16a1"],
             ["norm=gn4", "regime=bs4a4"], ["norm=gn4", "regime=bs1a1"], ["norm=none", "regime=bs4a4"],
             ["norm=bn", "regime=bs4a4"], ["norm=gn4", "regime=bs4a4", "seed=2"]]
    one = [True, True, False, True, True, True, False, True]
    samples = [16, 16, 16, 16, 1, 16, 16, 16]
    assert shared_cells(cells, one, samples) == [False, True, False, True, False, False, False, False]
