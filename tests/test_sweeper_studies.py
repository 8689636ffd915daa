"""The gaexp_optuna sweeper in real studies through the public command, each trial a real gaexp run: pruning,
kills and resumes, failures, study identity, two sweeps on one storage, repeats, bad settings. Its unit tests are
tests/test_sweeper.py."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.trial import TrialState

from gaexp import progress, tuning
from hydra_plugins.gaexp_optuna_sweeper import _impl as sweeper
from hydra_plugins.gaexp_optuna_sweeper.trials import open_storage
from tests.conftest import kill_when


# --- real studies through the public command (each trial a real gaexp run) ------------------------------

STUDY = ["hydra/sweeper=gaexp_optuna", "hydra.sweeper.direction=maximize", "norm=gn4", "regime=bs16a1",
         "train.num_iterations=20", "train.eval_period=5", "hydra.sweeper.study_name=t"]
MEDIAN_AFTER_ONE = "hydra.sweeper.pruner.n_startup_trials=1"  # the default pruner, pruning from the second trial
# Trials that finish evaluate 1,000 held-out training images (as a tuning study should: docs/study.md) instead of
# the 10,000 test images, a tenth of the cost of each of their 4 evaluations. Not in the killed study, whose
# trial 1 must stay RUNNING long enough to be seen on a fast machine.
HOLDOUT = 1000


def study_args(tmp_path, *more):
    """STUDY in one journal under tmp_path, which every sweep of a test shares."""
    return [*STUDY, f"hydra.sweeper.storage={tmp_path / 'optuna.journal'}", *more]


def study_of(tmp_path, name):
    """The study, from the journal of study_args (norm and regime are fixed values here, not grid axes, so
    the study name is study_name alone)."""
    return optuna.load_study(study_name=name, storage=open_storage(str(tmp_path / "optuna.journal")))


@pytest.mark.slow
def test_a_tiny_study_through_joblib_with_its_runs_in_mlflow(tmp_path, gaexp_command, training_runs, capsys):
    proc = gaexp_command(tmp_path, *study_args(tmp_path, MEDIAN_AFTER_ONE), "launch=joblib", "hydra.launcher.n_jobs=2", "hydra.sweeper.n_trials=4",
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
    # the terminal (not a tty here): a line per ended trial with the totals; gaexp-status reads the same
    ended = [line for line in proc.stdout.splitlines() if line.startswith("trial ")]
    assert sorted(line.split()[1] for line in ended) == ["0", "1", "2", "3"]
    totals = ended[-1].split(" | ")[1]
    assert totals.startswith("4/4 trials: ") and f"best {study.best_value:.4f} (trial {study.best_trial.number})" in totals
    sweep_id = runs["gn4-bs16a1-s1-t0"].data.tags["sweep_id"]
    progress.main(["--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--sweep", sweep_id])
    status = capsys.readouterr().out.splitlines()
    assert status[:2] == [f"sweep {sweep_id} (Optuna search)", "  " + totals]
    ((name, outcome, overrides),) = tuning.tuned_commands(client, "gaexp", "t", "1,2", ["launch=joblib"])
    assert (name, outcome["trial"], outcome["value"]) == ("t", study.best_trial.number, study.best_value)
    assert f"train.lr={study.best_params['train.lr']!r}" in overrides  # the best value, exactly
    assert {"norm=gn4", "regime=bs16a1", "train.num_iterations=20", "data.holdout=0", "seed=1,2",
            "hydra/sweeper=gaexp_grid", "launch=joblib"} <= set(overrides)
    assert not [line for line in overrides if line.startswith(("optuna.", f"data.holdout={HOLDOUT}"))]


@pytest.mark.slow
def test_a_trial_that_cannot_learn_is_pruned(tmp_path, gaexp_command, training_runs):
    """Grid over two learning rates, the good one first (seed 1): the one that cannot move is pruned at the
    first evaluation, below the finished trial there."""
    proc = gaexp_command(tmp_path, *study_args(tmp_path, MEDIAN_AFTER_ONE), f"data.holdout={HOLDOUT}", "train.lr=choice(0.003, 1e-12)",
                         "hydra/sweeper/sampler=grid",
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
def test_a_killed_study_resumes_with_its_dead_trial_failed_and_runs_n_trials_more(tmp_path, gaexp_argv, gaexp_command):
    settings = [*study_args(tmp_path), "hydra.sweeper.heartbeat_interval=1", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1", "hydra/sweeper/pruner=nop",
                "hydra.sweeper.sampler.seed=5", "train.lr=tag(log, interval(1e-4, 1e-2))"]
    proc = subprocess.Popen(gaexp_argv(tmp_path, *settings), cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    def trial_0_done_and_trial_1_running() -> bool:
        try:
            return [t.state for t in study_of(tmp_path, "t").trials][:2] == [TrialState.COMPLETE, TrialState.RUNNING]
        except KeyError:  # no journal or no study yet
            return False

    kill_when(proc, trial_0_done_and_trial_1_running)
    time.sleep(2.5)  # its last beat is older than the grace period, 2 x heartbeat_interval
    again = gaexp_command(tmp_path, *settings, "hydra.sweeper.n_trials=1")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "t: trial 1 was left RUNNING by a sweep that stopped: marked FAIL" in again.stdout + again.stderr
    assert "t: 2 trial(s) before, this command ran 1 (COMPLETE 1)" in again.stdout + again.stderr
    states = [t.state for t in study_of(tmp_path, "t").trials]
    assert states == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]  # n_trials more, none RUNNING


@pytest.mark.slow
def test_a_failed_trial_is_fail_in_optuna_and_failed_in_mlflow_and_the_study_goes_on(tmp_path, gaexp_command,
                                                                                      training_runs):
    """lr 1e30 diverges at step 2: FAIL and FAILED, the cell named at the end; one failure in two trials is within
    max_failure_rate 0.5, so the study runs its other trial."""
    proc = gaexp_command(tmp_path, *study_args(tmp_path, MEDIAN_AFTER_ONE), f"data.holdout={HOLDOUT}", "train.lr=choice(0.003, 1e30)",
                         "hydra/sweeper/sampler=grid",
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
    proc = gaexp_command(tmp_path, *study_args(tmp_path, MEDIAN_AFTER_ONE), "train.lr=choice(1e30, 1e31)", "hydra/sweeper/sampler=grid",
                         "hydra.sweeper.sampler.seed=1", "hydra.sweeper.n_jobs=1", "hydra.sweeper.n_trials=2",
                         "hydra.sweeper.max_failure_rate=0.5")
    assert proc.returncode == 1
    assert "t: 1 of 1 trials failed, more than hydra.sweeper.max_failure_rate=0.5" in proc.stdout + proc.stderr
    assert [t.state for t in study_of(tmp_path, "t").trials] == [TrialState.FAIL]
    _, runs = training_runs(f"sqlite:///{tmp_path}/mlflow.db")
    assert [(name, run.info.status) for name, run in runs.items()] == [("gn4-bs16a1-s1-t0", "FAILED")]


def one_line_error(proc) -> str:
    """The command failed with one line on stderr after Hydra's own logging, and no traceback."""
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and proc.stderr.rstrip().endswith(errors[0]), proc.stderr[-3000:]
    return errors[0]


@pytest.mark.slow
def test_a_study_refuses_to_answer_another_protocols_question_and_says_what_it_ran(tmp_path, gaexp_command):
    """`study_name` and storage shared, another holdout and budget: the command ran zero trials, reported the
    first protocol's best, and ended in a FileNotFoundError. Now: refused in one line naming the keys; the
    same protocol continues, saying how many trials there were and how many it ran."""
    first = gaexp_command(tmp_path, *study_args(tmp_path), "hydra.sweeper.n_trials=1", f"data.holdout={HOLDOUT}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "t: 0 trial(s) before, this command ran 1 (COMPLETE 1)" in first.stdout + first.stderr
    other = gaexp_command(tmp_path, *study_args(tmp_path), "hydra.sweeper.n_trials=1", "data.holdout=2000",
                          "train.num_iterations=24")
    assert one_line_error(other) == (
        f"error: study 't' in {tmp_path / 'optuna.journal'} was created for another protocol (data.holdout: 1000 in "
        "the study, 2000 here; train.num_iterations: 20 in the study, 24 here); to continue it, give its values; to "
        "ask this question, start a new study: hydra.sweeper.study_name=<a new name> (or another hydra.sweeper.storage)")
    assert len(study_of(tmp_path, "t").trials) == 1
    again = gaexp_command(tmp_path, *study_args(tmp_path), "hydra.sweeper.n_trials=1", f"data.holdout={HOLDOUT}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "t: 1 trial(s) before, this command ran 1 (COMPLETE 1)" in again.stdout + again.stderr
    assert [t.state for t in study_of(tmp_path, "t").trials] == [TrialState.COMPLETE] * 2
    (results,) = sorted((tmp_path / "multirun").glob(f"*/{sweeper.RESULTS}"))[-1:]
    assert OmegaConf.to_container(OmegaConf.load(results).studies.t)["ran"] == {"COMPLETE": 1}


def store_unlocked(store) -> bool:
    """Whether no process holds any lock on the SQLite file `store`: an exclusive transaction begins at once."""
    db = sqlite3.connect(store, timeout=0, isolation_level=None)
    try:
        db.execute("BEGIN EXCLUSIVE")
        db.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:  # database is locked
        return False
    finally:
        db.close()


def freeze_holding_no_lock(proc, lock, store, tries=200):
    """SIGSTOP proc at a moment it holds neither the journal's lock nor any lock on the MLflow store. Frozen inside
    the journal's (its heartbeat writes every few seconds), the other sweep would break it after Optuna's 30 s grace,
    and proc's release would raise when thawed; frozen inside a store transaction, the other sweep's run would wait
    past SQLite's 20 s and its trial fail: faults of the freeze, not of two sweeps sharing a storage."""
    for _ in range(tries):
        os.killpg(proc.pid, signal.SIGSTOP)
        if not os.path.lexists(lock) and store_unlocked(store):
            return
        os.killpg(proc.pid, signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError(f"{lock} or {store} locked at each of {tries} tries")


@pytest.mark.slow
def test_two_sweeps_on_one_storage_at_once_leave_each_others_trials_alone(tmp_path, gaexp_argv, gaexp_command):
    """Sweep A holds trial 0 RUNNING (frozen, so however fast the machine, B opens the study meanwhile); sweep
    B opens the same study and runs its own trial. B marked A's trial FAIL and A's tell raised; now both end
    COMPLETE: a live sweep's trial is failed only after grace_period without its beat (120 s by default)."""
    settings = study_args(tmp_path, "hydra.sweeper.n_trials=1", "hydra.sweeper.n_jobs=1", f"data.holdout={HOLDOUT}")
    a = subprocess.Popen(gaexp_argv(tmp_path, *settings), cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while a.poll() is None and time.monotonic() < deadline:
            try:
                if [t.state for t in study_of(tmp_path, "t").trials] == [TrialState.RUNNING]:
                    break
            except KeyError:  # no journal or no study yet
                pass
            time.sleep(0.2)
        freeze_holding_no_lock(a, tmp_path / "optuna.journal.lock", tmp_path / "mlflow.db")
        b = gaexp_command(tmp_path, *settings)
        assert b.returncode == 0, b.stderr[-3000:]
        assert "t: 1 trial(s) before, this command ran 1 (COMPLETE 1)" in b.stdout + b.stderr
        assert [t.state for t in study_of(tmp_path, "t").trials] == [TrialState.RUNNING, TrialState.COMPLETE]
    finally:
        os.killpg(a.pid, signal.SIGCONT)
    out, err = a.communicate(timeout=300)
    assert a.returncode == 0, err[-3000:]
    assert [t.state for t in study_of(tmp_path, "t").trials] == [TrialState.COMPLETE, TrialState.COMPLETE]


@pytest.mark.slow
def test_a_trial_of_two_seeds_is_their_mean_and_each_seed_a_child_run_of_the_trial(tmp_path, gaexp_command,
                                                                                    training_runs):
    proc = gaexp_command(tmp_path, *study_args(tmp_path), "+hydra.sweeper.repeats.seed=[1,2]", "hydra.sweeper.n_trials=2",
                         "hydra.sweeper.n_jobs=2", "hydra.sweeper.sampler.seed=3", f"data.holdout={HOLDOUT}",
                         "hydra/sweeper/pruner=nop", "train.lr=tag(log, interval(1e-4, 1e-2))", "launch=joblib",
                         "hydra.launcher.n_jobs=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    study = study_of(tmp_path, "t")
    client, runs = training_runs(f"sqlite:///{tmp_path}/mlflow.db")
    assert sorted(runs) == sorted(f"gn4-bs16a1-s{seed}-t{n}" for seed in (1, 2) for n in range(2))
    (parent,) = client.search_runs([client.get_experiment_by_name("gaexp").experiment_id], "tags.`gaexp.role` = 'study'")
    trial_runs = {r.data.tags["optuna.trial"]: r for r in client.search_runs(
        [parent.info.experiment_id], "tags.`gaexp.role` = 'trial'")}
    for trial in study.trials:
        assert trial.state == TrialState.COMPLETE
        histories = [{m.step: m.value for m in client.get_metric_history(runs[f"gn4-bs16a1-s{seed}-t{trial.number}"]
                                                                          .info.run_id, "valid_acc")} for seed in (1, 2)]
        assert histories[0] != histories[1]  # two seeds, two runs
        assert trial.intermediate_values == {step: pytest.approx((histories[0][step] + histories[1][step]) / 2, abs=1e-12)
                                             for step in (5, 10, 15, 20)}  # the pruner saw the seeds' mean
        values = [sum(h.values()) / len(h) for h in histories]  # each seed's objective (window_start 0)
        assert trial.value == pytest.approx(sum(values) / 2, abs=1e-12)
        assert trial.user_attrs[sweeper.REPEATS] == {"seed=1": pytest.approx(values[0]), "seed=2": pytest.approx(values[1])}
        run = trial_runs[str(trial.number)]
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id and run.info.status == "FINISHED"
        assert run.data.metrics["value"] == pytest.approx(trial.value) and float(run.data.params["train.lr"]) == \
            trial.params["train.lr"]
        for seed in (1, 2):
            child = runs[f"gn4-bs16a1-s{seed}-t{trial.number}"]
            assert child.data.tags["mlflow.parentRunId"] == run.info.run_id
            assert child.data.tags["optuna.repeat"] == str(seed - 1)


@pytest.mark.slow
@pytest.mark.parametrize("setting, message", [  # one of each kind through the command; all of them: test_sweeper.py
    ("train.lr=interval(0.1, 0.01)", "error: train.lr=interval(0.1, 0.01): an empty or inverted interval; valid: "
                                     "interval(a, b) with a < b"),
])
def test_bad_sweeper_settings_end_the_command_in_one_line(tmp_path, gaexp_command, setting, message):
    """They ended with the right message after 19 lines of traceback."""
    assert one_line_error(gaexp_command(tmp_path, *study_args(tmp_path), setting)) == message
    assert not (tmp_path / "optuna.journal").exists()
