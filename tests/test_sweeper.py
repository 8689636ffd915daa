"""The gaexp_optuna sweeper: the param forms, bad input, and real studies through the public command."""

from __future__ import annotations

import subprocess

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from gaexp import app, tuning
from hydra_plugins.gaexp_optuna_sweeper import sweeper
from hydra_plugins.gaexp_optuna_sweeper.config import PrunerConf, SamplerConf
from hydra_plugins.gaexp_optuna_sweeper.sweeper import make_pruner, make_sampler, open_storage, split_arguments
from tests.conftest import kill_when

# Hydra's plugin scan executes the module again (in the same module object), so its classes are read
# from the module at each use, never bound at import: `sweeper.SweeperError`.


@pytest.mark.parametrize("form, expected", [
    ("choice(0.1, 0.2)", CategoricalDistribution([0.1, 0.2])),
    ("choice(bn, in)", CategoricalDistribution(["bn", "in"])),
    ("interval(0.1, 0.5)", FloatDistribution(0.1, 0.5)),
    ("int(interval(1, 8))", IntDistribution(1, 8)),
    ("tag(log, interval(1e-4, 1e-2))", FloatDistribution(1e-4, 1e-2, log=True)),
    ("tag(log, int(interval(1, 64)))", IntDistribution(1, 64, log=True)),
    ("range(1, 10, 3)", IntDistribution(1, 7, step=3)),
    ("range(0.5, 2.0, 0.5)", FloatDistribution(0.5, 1.5, step=0.5)),
])
def test_every_param_form_maps_to_its_distribution(form, expected):
    space, fixed, axes = split_arguments({"train.lr": form}, {}, [])
    assert space == {"train.lr": expected} and fixed == {} and axes == []


def test_fixed_values_and_grid_axes():
    space, fixed, axes = split_arguments({"train.lr": "0.01"}, {"norm": "bn,in", "regime": "bs1a16"},
                                         ["seed=2", "train.num_iterations=40", "norm=bn,gn4", "train.eval_period=choice(10,20)"])
    assert fixed == {"train.lr": "0.01", "seed": "2", "train.num_iterations": "40"}
    assert axes == [["norm=bn", "norm=gn4"], ["regime=bs1a16"]]  # the command line wins; a one-value grid key stays an axis
    assert space == {"train.eval_period": CategoricalDistribution([10, 20])}


BAD = {
    "unknown syntax": ({"train.lr": "intervl(1, 2)"}, r"train.lr='intervl\(1, 2\)' is not a value or a sweep .*valid: "
                                                     r"choice\(a, b, ...\), interval\(a, b\)"),
    "inverted interval": ({"train.lr": "interval(0.1, 0.01)"}, r"train.lr=interval\(0.1, 0.01\): an empty or inverted "
                                                              r"interval; valid: interval\(a, b\) with a < b"),
    "empty interval": ({"train.lr": "interval(0.1, 0.1)"}, r"an empty or inverted interval"),
    "log from zero": ({"train.lr": "tag(log, interval(0, 1))"}, r"a log scale needs bounds > 0; valid: "
                                                               r"tag\(log, interval\(a, b\)\) with 0 < a < b"),
    "unknown tag": ({"train.lr": "tag(exp, interval(1, 2))"}, r"unknown tag\(s\) \['exp'\]; valid: tag\(log"),
    "empty range": ({"seed": "range(5, 1)"}, r"seed=range\(5, 1\): an empty range; valid: range\(a, b, step\)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_param_forms_are_one_clear_error(case):
    params, message = BAD[case]
    with pytest.raises(sweeper.SweeperError, match=message):
        split_arguments(params, {}, [])


SETTINGS = dict(direction="maximize", study_name="s", storage=None, n_trials=4, n_jobs=2, sampler={"name": "tpe"},
                pruner={"name": "median"}, max_failure_rate=0.0, params={}, grid={}, trial_key="optuna")


@pytest.mark.parametrize("change, message", [
    ({"direction": "maximise"}, r"hydra.sweeper.direction='maximise'; valid: maximize, minimize"),
    ({"pruner": {"name": "asha"}}, r"hydra.sweeper.pruner.name='asha'; valid: median, hyperband, none"),
    ({"n_trials": 0}, r"hydra.sweeper.n_trials=0; valid: an integer >= 1"),
    ({"max_failure_rate": 1.5}, r"hydra.sweeper.max_failure_rate=1.5; valid: a number in \[0, 1\]"),
])
def test_bad_settings_fail_before_any_trial(change, message):
    with pytest.raises(sweeper.SweeperError, match=message):
        sweeper.OptunaSweeper(**{**SETTINGS, **change})


def test_samplers_and_pruners_by_name():
    space = {"x": CategoricalDistribution([1, 2, 3])}
    assert {name: type(make_sampler(SamplerConf(name, seed=1), space)).__name__
            for name in ("tpe", "random", "cmaes", "grid", "qmc")} == {
        "tpe": "TPESampler", "random": "RandomSampler", "cmaes": "CmaEsSampler", "grid": "GridSampler",
        "qmc": "QMCSampler"}
    with pytest.raises(sweeper.SweeperError, match=r"hydra.sweeper.sampler.name='bayes'; valid: tpe, random, cmaes, grid, qmc"):
        make_sampler(SamplerConf("bayes"), space)
    with pytest.raises(sweeper.SweeperError, match=r"x: the grid sampler needs discrete values"):
        make_sampler(SamplerConf("grid"), {"x": FloatDistribution(0.0, 1.0)})
    assert isinstance(make_pruner(PrunerConf("hyperband")), optuna.pruners.HyperbandPruner)
    assert isinstance(make_pruner(PrunerConf("none")), optuna.pruners.NopPruner)


# --- real studies through the public command (each trial a real gaexp run) ------------------------------

STUDY = ["hydra/sweeper=gaexp_optuna", "norm=gn4", "regime=bs16a1", "train.num_iterations=20", "train.eval_period=5",
         "hydra.sweeper.study_name=t", "hydra.sweeper.pruner.n_startup_trials=1"]
# Trials that finish evaluate 1,000 held-out training images (as a tuning study should: docs/study.md) instead of
# the 10,000 test images, a tenth of the cost of each of their 4 evaluations. Not in the killed study, whose
# trial 1 must stay RUNNING long enough to be seen on a fast machine.
HOLDOUT = 1000


def study_of(tmp_path, name):
    """The study, from the default journal next to the sweep folders (norm and regime are fixed values
    here, not grid axes, so the study name is study_name alone)."""
    return optuna.load_study(study_name=name, storage=open_storage(str(tmp_path / "multirun" / "optuna.journal")))


@pytest.mark.slow
def test_a_tiny_study_through_joblib_with_its_runs_in_mlflow(tmp_path, gaexp_command, training_runs):
    proc = gaexp_command(tmp_path, *STUDY, "launch=joblib", "hydra.launcher.n_jobs=2", "hydra.sweeper.n_trials=4",
                         "hydra.sweeper.n_jobs=2", "hydra.sweeper.sampler.seed=3", f"data.holdout={HOLDOUT}",
                         "train.lr=tag(log, interval(1e-4, 1e-2))")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    study = study_of(tmp_path, "t")
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(study.trials) == 4 and {t.state for t in study.trials} <= {TrialState.COMPLETE, TrialState.PRUNED}
    assert study.best_value == max(t.value for t in done) and 1e-4 <= study.best_params["train.lr"] <= 1e-2
    client, runs = training_runs(f"sqlite:///{tmp_path}/mlflow.db")
    assert sorted(runs) == [f"gn4-bs16a1-s1-t{n}" for n in range(4)]
    (parent,) = client.search_runs([client.get_experiment_by_name("gaexp").experiment_id], "tags.`gaexp.role` = 'study'")
    assert parent.data.tags["optuna.study"] == study.study_name and parent.info.status == "FINISHED"
    assert parent.data.metrics["best_value"] == study.best_value
    assert parent.data.tags["objective"] == ("window: mean valid_acc over the evaluations at step > 0 "
                                             "(the report's metric)")
    assert parent.data.metrics["best.train.lr"] == study.best_params["train.lr"]
    assert {"optimization_history.png", "slice.png"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    for trial in study.trials:
        run = runs[f"gn4-bs16a1-s1-t{trial.number}"]
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.tags["optuna.state"] == trial.state.name and run.data.params["data.holdout"] == str(HOLDOUT)
        assert float(run.data.params["train.lr"]) == trial.params["train.lr"]  # the sampled value, exactly
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "valid_acc")}
        assert history == trial.intermediate_values  # every evaluation reported to the study
        if trial.state == TrialState.COMPLETE:  # its value: the report's metric, the mean at step > window_start (0)
            assert trial.value == pytest.approx(sum(history.values()) / len(history), abs=1e-12)
        assert run.info.status == ("FINISHED" if trial.state == TrialState.COMPLETE else "KILLED")
    ((name, outcome, overrides),) = tuning.tuned_commands(client, "gaexp", "t", "1,2", ["launch=joblib"])
    assert (name, outcome["trial"], outcome["value"]) == ("t", study.best_trial.number, study.best_value)
    assert f"train.lr={study.best_params['train.lr']!r}" in overrides  # the best value, exactly
    assert {"norm=gn4", "regime.batch_size=16", "regime.num_accum=1", "train.num_iterations=20", "data.holdout=0",
            "seed=1,2", "launch=joblib"} <= set(overrides)


@pytest.mark.slow
def test_a_trial_that_cannot_learn_is_pruned(tmp_path, gaexp_command, training_runs):
    """Grid over two learning rates, the good one first (seed 1): the one that cannot move is pruned at the
    first evaluation, below the finished trial there."""
    proc = gaexp_command(tmp_path, *STUDY, f"data.holdout={HOLDOUT}", "train.lr=choice(0.003, 1e-12)",
                         "hydra.sweeper.sampler.name=grid",
                         "hydra.sweeper.sampler.seed=1", "hydra.sweeper.n_trials=5", "hydra.sweeper.n_jobs=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    good, bad = study_of(tmp_path, "t").trials  # the grid has 2 points: 2 trials, not 5
    assert (good.params["train.lr"], good.state, bad.params["train.lr"], bad.state) == (
        0.003, TrialState.COMPLETE, 1e-12, TrialState.PRUNED)
    assert list(bad.intermediate_values) == [5] and bad.intermediate_values[5] < good.intermediate_values[5]
    _, runs = training_runs(f"sqlite:///{tmp_path}/mlflow.db")
    pruned = runs["gn4-bs16a1-s1-t1"]
    assert pruned.info.status == "KILLED" and pruned.data.tags["gaexp.stopped_step"] == "5"
    assert "pruned by Optuna" in pruned.data.tags["gaexp.stopped_reason"] and "error" not in pruned.data.tags
    assert not list((tmp_path / "multirun").glob("*/*/FAILED.txt"))  # pruned is no failure


@pytest.mark.slow
def test_a_killed_study_resumes_to_n_trials_with_none_left_running(tmp_path, gaexp_argv, gaexp_command):
    settings = [*STUDY, "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1", "hydra.sweeper.pruner.name=none",
                "hydra.sweeper.sampler.seed=5", "train.lr=tag(log, interval(1e-4, 1e-2))"]
    proc = subprocess.Popen(gaexp_argv(tmp_path, *settings), cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    def trial_0_done_and_trial_1_running() -> bool:
        try:
            return [t.state for t in study_of(tmp_path, "t").trials][:2] == [TrialState.COMPLETE, TrialState.RUNNING]
        except KeyError:  # no journal or no study yet
            return False

    kill_when(proc, trial_0_done_and_trial_1_running)
    again = gaexp_command(tmp_path, *settings)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "trial 1 was left RUNNING by an earlier sweep: marked FAIL" in again.stdout + again.stderr
    states = [t.state for t in study_of(tmp_path, "t").trials]
    assert states == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]  # 3 in total, none RUNNING


@pytest.mark.slow
def test_a_failed_trial_is_fail_in_optuna_and_failed_in_mlflow_and_the_study_goes_on(tmp_path, gaexp_command,
                                                                                      training_runs):
    """lr 1e30 diverges at step 2: FAIL and FAILED, the cell named at the end; one failure in two trials is within
    max_failure_rate 0.5, so the study runs its other trial."""
    proc = gaexp_command(tmp_path, *STUDY, f"data.holdout={HOLDOUT}", "train.lr=choice(0.003, 1e30)",
                         "hydra.sweeper.sampler.name=grid",
                         "hydra.sweeper.sampler.seed=1", "hydra.sweeper.n_jobs=1", "hydra.sweeper.max_failure_rate=0.5")
    assert proc.returncode == 1 and "1 cell(s) failed, the others ran" in proc.stdout + proc.stderr
    trials = study_of(tmp_path, "t").trials
    assert [(t.params["train.lr"], t.state) for t in trials] == [(0.003, TrialState.COMPLETE), (1e30, TrialState.FAIL)]
    _, runs = training_runs(f"sqlite:///{tmp_path}/mlflow.db")
    failed = runs["gn4-bs16a1-s1-t1"]
    assert failed.info.status == "FAILED" and failed.data.tags["diverged_step"] == "2"
    assert failed.data.tags["optuna.state"] == "FAIL" and runs["gn4-bs16a1-s1-t0"].info.status == "FINISHED"


@pytest.mark.slow
def test_too_many_failed_trials_stop_the_study(tmp_path, gaexp_command, training_runs):
    """Both learning rates diverge; with max_failure_rate 0.5 the first failure (1 of 1) is already too many:
    the study stops there, its second trial never asked for, and the command fails saying why."""
    proc = gaexp_command(tmp_path, *STUDY, "train.lr=choice(1e30, 1e31)", "hydra.sweeper.sampler.name=grid",
                         "hydra.sweeper.sampler.seed=1", "hydra.sweeper.n_jobs=1", "hydra.sweeper.n_trials=2",
                         "hydra.sweeper.max_failure_rate=0.5")
    assert proc.returncode == 1
    assert "t: 1 of 1 trials failed, more than hydra.sweeper.max_failure_rate=0.5" in proc.stdout + proc.stderr
    assert [t.state for t in study_of(tmp_path, "t").trials] == [TrialState.FAIL]
    _, runs = training_runs(f"sqlite:///{tmp_path}/mlflow.db")
    assert [(name, run.info.status) for name, run in runs.items()] == [("gn4-bs16a1-s1-t0", "FAILED")]


def test_the_documented_search_command_composes_with_gaexps_optuna_sweeper_and_either_engine(compose):
    """docs/usage.md's search: the sweeper named on the command line (Hydra lets conf/config.yaml's gaexp_grid
    win over the study file's own choice), and accumulate=batched passes through to every trial."""
    cfg = compose("hydra/sweeper=gaexp_optuna", "+experiment=tune_lr", "accumulate=batched", hydra=True)
    assert cfg.hydra.sweeper._target_ == "hydra_plugins.gaexp_optuna_sweeper.sweeper.OptunaSweeper"
    assert (cfg.hydra.sweeper.study_name, cfg.hydra.sweeper.grid.norm) == ("tune_lr", "bn,in,gn4")
    assert app.check(app.job_config(cfg)).accumulate == "batched"
