"""The gaexp_optuna sweeper's units: the param forms, the sampler and pruner groups, bad input, study identity,
liveness, repeats, the trial side and the tally; its real studies are tests/test_sweeper_studies.py."""

from __future__ import annotations

import dataclasses
import inspect
import io
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from gaexp import callbacks, cell
from gaexp.config import job_config
from hydra_plugins.gaexp_optuna_sweeper import _heartbeat as heartbeat
from hydra_plugins.gaexp_optuna_sweeper import _impl as sweeper
from hydra_plugins.gaexp_optuna_sweeper import _protocol as protocol
from hydra_plugins.gaexp_optuna_sweeper.config import HEARTBEAT, PROTOCOL, PRUNERS, SAMPLERS
from hydra_plugins.gaexp_optuna_sweeper import trials
from hydra_plugins.gaexp_optuna_sweeper._space import make_sampler, split_arguments
from hydra_plugins.gaexp_optuna_sweeper.trials import make_pruner, open_storage


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
    assert axes == [["norm=bn", "norm=gn4"], ["regime=bs1a16"]]  # a grid key stays an axis wherever it is given
    assert space == {"train.eval_period": CategoricalDistribution([10, 20])}


def test_a_comma_list_on_the_command_line_is_a_choice_as_in_the_official_plugin():
    """hydra-optuna-sweeper reads `x=1,2,3` as choice(1, 2, 3); gaexp read it as a grid axis of separate
    studies. Grid axes are now only the keys of hydra.sweeper.grid."""
    space, fixed, axes = split_arguments({}, {}, ["norm=bn,in", "train.eval_period=10,20"])
    assert space == {"norm": CategoricalDistribution(["bn", "in"]), "train.eval_period": CategoricalDistribution([10, 20])}
    assert fixed == {} and axes == []


BAD = {
    "unknown syntax": ({"train.lr": "intervl(1, 2)"}, r"train.lr='intervl\(1, 2\)' is not a value or a sweep .*valid: "
                                                     r"choice\(a, b, ...\) or a,b,..., interval\(a, b\)"),
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


def settings(**change):
    """The sweeper's settings as Hydra gives them (its node, sampler and pruner from their default groups)."""
    node = {"sampler": OmegaConf.structured(SAMPLERS["tpe"]), "pruner": OmegaConf.structured(PRUNERS["median"]),
            "direction": "maximize", "study_name": "s", "storage": None, "n_trials": 4, "n_jobs": 2,
            "max_batch_size": None, "max_failure_rate": 0.0, "params": {}, "grid": {}, "repeats": {},
            "trial_key": "optuna", "heartbeat_interval": 60.0, "grace_period": None, "failed_trial_callback": None}
    return {**node, **change}


@pytest.mark.parametrize("change, message", [
    ({"direction": "maximise"}, r"hydra.sweeper.direction='maximise'; valid: maximize, minimize"),
    ({"pruner": OmegaConf.create({"_target_": "optuna.pruners.MedianPruner", "n_startup_trials": -1})},
     r"hydra.sweeper.pruner \(optuna.pruners.MedianPruner\): Number of startup trials cannot be negative, but got "
     r"n_startup_trials=-1.; valid: its class's options"),
    ({"pruner": OmegaConf.create({"_target_": "optuna.samplers.TPESampler"})},
     r"hydra.sweeper.pruner._target_='optuna.samplers.TPESampler' is no optuna.pruners._base.BasePruner"),
    ({"pruner": OmegaConf.structured(PRUNERS["percentile"])},
     r"hydra.sweeper.pruner \(optuna.pruners.PercentilePruner\): Missing mandatory value: percentile"),
    ({"n_trials": 0}, r"hydra.sweeper.n_trials=0; valid: an integer >= 1"),
    ({"max_batch_size": 0}, r"hydra.sweeper.max_batch_size=0; valid: null or an integer >= 1"),
    ({"max_failure_rate": 1.5}, r"hydra.sweeper.max_failure_rate=1.5; valid: a number in \[0, 1\]"),
    ({"heartbeat_interval": 0}, r"hydra.sweeper.heartbeat_interval=0; valid: seconds > 0"),
    ({"grace_period": 5.0}, r"hydra.sweeper.grace_period=5.0; valid: null \(2 x heartbeat_interval\) or seconds >= "),
    ({"repeats": {"seed": []}}, r"hydra.sweeper.repeats.seed=\[\]; valid: a list of one value or more"),
    ({"params": {"train.lr": "interval(0.1, 0.01)"}}, r"train.lr=interval\(0.1, 0.01\): an empty or inverted interval"),
])
def test_bad_settings_fail_before_any_trial(change, message):
    with pytest.raises(sweeper.SweeperError, match=message):
        sweeper.OptunaSweeperImpl(**settings(**change))


@pytest.mark.parametrize("group, name", [*(("sampler", n) for n in SAMPLERS), *(("pruner", n) for n in PRUNERS)])
def test_each_sampler_and_pruner_node_has_every_constructor_option_at_optunas_default(group, name):
    """The official plugin's way, `_target_` and the class's options; none missing, none invented, each at
    the default Optuna gives it (a required one is MISSING: set it)."""
    node = (SAMPLERS if group == "sampler" else PRUNERS)[name]
    fields = {f.name: f for f in dataclasses.fields(node) if f.name != "_target_"}
    target = node._target_ if isinstance(node._target_, str) else fields.pop("_target_").default
    signature = inspect.signature(get_class(node()._target_)).parameters
    assert list(fields) == list(signature)
    filled = {("grid", "search_space"), ("patient", "wrapped_pruner")}  # null: the sweeper's points; no wrapped pruner
    for key, parameter in signature.items():
        default = fields[key].default if fields[key].default is not dataclasses.MISSING else fields[key].default_factory()
        required = parameter.default is inspect.Parameter.empty
        expected = None if (name, key) in filled else "???" if required else parameter.default
        assert default == expected, (name, key)
    assert target


def test_every_sampler_and_pruner_is_made_from_its_group_with_options_set_on_the_command_line(compose):
    space = {"x": CategoricalDistribution([1, 2, 3])}
    wrong = OmegaConf.merge(OmegaConf.structured(SAMPLERS["tpe"]), {"_target_": "optuna.pruners.NopPruner"})
    with pytest.raises(sweeper.SweeperError, match=r"hydra.sweeper.sampler \(optuna.pruners.NopPruner\): NopPruner\(\) "
                                                   r"takes no arguments; valid: its class's options at their types"):
        make_sampler(wrong, space)
    with pytest.raises(sweeper.SweeperError, match=r"hydra.sweeper.sampler._target_='optuna.pruners.NopPruner' is no "
                                                   r"optuna.samplers._base.BaseSampler; valid: hydra/sweeper/sampler="):
        make_sampler(OmegaConf.create({"_target_": "optuna.pruners.NopPruner"}), space)
    for name in SAMPLERS:
        cfg = compose("hydra/sweeper=gaexp_optuna", f"hydra/sweeper/sampler={name}", "hydra.sweeper.sampler.seed=7",
                      hydra=True)
        made = make_sampler(cfg.hydra.sweeper.sampler, space)
        assert type(made).__name__ == cfg.hydra.sweeper.sampler._target_.rsplit(".", 1)[1]
    cfg = compose("hydra/sweeper=gaexp_optuna", "hydra.sweeper.sampler.n_startup_trials=8",
                  "hydra.sweeper.sampler.multivariate=true", "hydra.sweeper.sampler.seed=3", hydra=True)
    tpe = make_sampler(cfg.hydra.sweeper.sampler, space)
    assert (tpe._n_startup_trials, tpe._multivariate) == (8, True)
    assert [make_sampler(cfg.hydra.sweeper.sampler, space)._rng.rng.random() for _ in range(2)] == \
        [tpe._rng.rng.random()] * 2  # seeded: each study's sampler draws the same
    grid = make_sampler(compose("hydra/sweeper=gaexp_optuna", "hydra/sweeper/sampler=grid", hydra=True).hydra.sweeper.sampler,
                        space)
    assert grid._search_space == {"x": [1, 2, 3]}  # the grid sampler's points: the searched choices
    with pytest.raises(sweeper.SweeperError, match=r"x: the grid sampler needs discrete values"):
        make_sampler(OmegaConf.structured(SAMPLERS["grid"]), {"x": FloatDistribution(0.0, 1.0)})
    for name in PRUNERS:
        overrides = {"percentile": ["hydra.sweeper.pruner.percentile=25"], "patient": ["hydra.sweeper.pruner.patience=2"],
                     "threshold": ["hydra.sweeper.pruner.lower=0.5"]}
        cfg = compose("hydra/sweeper=gaexp_optuna", f"hydra/sweeper/pruner={name}", *overrides.get(name, []), hydra=True)
        assert type(make_pruner(cfg.hydra.sweeper.pruner)).__name__ == cfg.hydra.sweeper.pruner._target_.rsplit(".", 1)[1]
    cfg = compose("hydra/sweeper=gaexp_optuna", "hydra.sweeper.pruner.n_warmup_steps=300", hydra=True)
    assert make_pruner(cfg.hydra.sweeper.pruner)._n_warmup_steps == 300


def test_the_official_plugins_defaults(compose):
    """As hydra-optuna-sweeper: minimize, TPE, 20 trials, 2 at a time, no study name (a new study each
    command), and a storage of this sweep's own (the official one is in memory)."""
    sweeper_cfg = compose("hydra/sweeper=gaexp_optuna", hydra=True).hydra.sweeper
    assert (sweeper_cfg.direction, sweeper_cfg.n_trials, sweeper_cfg.n_jobs, sweeper_cfg.study_name,
            sweeper_cfg.storage) == ("minimize", 20, 2, None, None)
    assert sweeper_cfg.sampler._target_ == "optuna.samplers.TPESampler"


def test_a_gaexp_search_refuses_to_minimize_the_accuracy(compose, tmp_path):
    """The official default direction finds the worst learning rate of a gaexp trial: refused in one line."""
    cfg = compose("hydra/sweeper=gaexp_optuna", "train.num_iterations=20", "analysis.window_start=0",
                  outputs=tmp_path, hydra=True)
    with pytest.raises(ValueError, match=r"hydra.sweeper.direction=minimize: a gaexp trial of task=classify returns a "
                                         r"validation accuracy .*; valid: hydra.sweeper.direction=maximize"):
        callbacks.prepare(cfg)
    assert not (tmp_path / "mlflow.db").exists()  # refused before anything is written


def test_the_launch_presets_compose_with_the_optuna_sweeper(compose):
    """launch=local sets hydra.sweeper.max_batch_size, which the Optuna sweeper did not have."""
    for preset in ("local", "joblib", "ray", "slurm"):
        cfg = compose("hydra/sweeper=gaexp_optuna", f"launch={preset}", hydra=True)
        assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper")


class FakeLauncher:
    def __init__(self):
        self.launches = []

    def launch(self, batch, initial_job_idx):
        self.launches.append((initial_job_idx, list(batch)))
        return [None] * len(batch)


def test_max_batch_size_bounds_the_jobs_of_each_launch():
    impl = sweeper.OptunaSweeperImpl(**settings(max_batch_size=3))
    impl.launcher, impl.job_idx = FakeLauncher(), 0
    assert len(impl.launch([[f"x={i}"] for i in range(7)])) == 7
    assert [(idx, len(batch)) for idx, batch in impl.launcher.launches] == [(0, 3), (3, 3), (6, 1)]


def sweeper_for(config, **change):
    """An OptunaSweeperImpl set up as Hydra does, without a launcher, on an in-memory-like journal."""
    impl = sweeper.OptunaSweeperImpl(**settings(**change))
    impl.config = config
    impl.tells = sweeper.has_node(config, impl.trial_key)
    impl.storage, impl.sweep_dir = "STORAGE", Path("multirun/2026-12-02_10-00-00")
    return impl


class InterruptedLauncher:
    def launch(self, batch, initial_job_idx):
        raise KeyboardInterrupt


def test_an_interrupted_launch_fails_its_trials_at_once_and_goes_on_raising(tmp_path):
    """Ctrl-C during a launch: this sweep's trials end FAIL now, not RUNNING until a grace period passes."""
    impl = sweeper_for(OmegaConf.create({"optuna": {"study": None}}), n_jobs=2)
    impl.backend = open_storage(str(tmp_path / "j.journal"))
    impl.launcher, impl.job_idx = InterruptedLauncher(), 0
    study = optuna.create_study(study_name="s", storage=impl.backend)
    with pytest.raises(KeyboardInterrupt):
        impl.run_study(study, [], {}, {"x": FloatDistribution(0.0, 1.0)}, [[]])
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.FAIL]


# --- progress: this sweep's trials by state, the best so far, an ETA ----------------------------------------

def study_with_trials(tmp_path, sweep_id="2026-12-02_10-00-00"):
    """A study as a sweep leaves it midway: 2 complete (0.90, 0.95), 1 pruned at step 10, 1 failed, 1
    running, all marked as `sweep_id`'s, and a complete trial of another sweep better than all (0.99)."""
    storage = open_storage(str(tmp_path / "j.journal"))
    study = optuna.create_study(study_name="t", storage=storage, direction="maximize")
    def trial(state, value=None, sweep=sweep_id, step=None):
        t = study.ask({"x": FloatDistribution(0.0, 1.0)})
        t.set_user_attr(sweeper.tally.SWEEP, sweep)
        if step is not None:
            t.report(0.1, step)
        if state is not None:
            study.tell(t, value, state=state)
    trial(TrialState.COMPLETE, 0.90)
    trial(TrialState.COMPLETE, 0.95)
    trial(TrialState.PRUNED, step=10)
    trial(TrialState.FAIL)
    trial(TrialState.COMPLETE, 0.99, sweep="another")
    trial(None)  # running
    plan = {"studies": ["t"], "trials": [8], "n_jobs": 2, "direction": "maximize", "started": time.time() - 60}
    study.set_user_attr(sweeper.tally.PLAN + sweep_id, plan)
    return storage, study, plan


def test_a_sweeps_tally_counts_its_own_trials_by_state_with_its_best(tmp_path):
    storage, _, _ = study_with_trials(tmp_path)
    t = sweeper.tally.sweep_tally(storage, "t", "2026-12-02_10-00-00")
    assert t.counts == {"complete": 2, "pruned": 1, "failed": 1, "running": 1, "waiting": 3}
    assert t.studies[0].best == (1, 0.95)  # not the other sweep's 0.99
    line = sweeper.tally.summary_line(t)
    assert line.startswith("4/8 trials: 2 complete, 1 pruned, 1 failed, 1 running, 3 waiting; best 0.9500 (trial 1); "
                           "elapsed 1m0")
    assert sweeper.tally.sweep_tally(storage, "t", "no-such-sweep") is None  # it recorded no plan


def test_the_eta_is_the_running_batchs_rest_and_a_mean_trial_per_batch_to_come():
    one = sweeper.tally.StudyTally("a", 10, {"complete": 3, "pruned": 1, "failed": 0, "running": 2, "waiting": 4},
                                      (2, 0.9), [30.0, 30.0, 50.0, 10.0])
    t = sweeper.tally.tally([one], n_jobs=2, started=0, now=130, running_since=120)
    assert t.eta_s == pytest.approx((30 - 10) + 2 * 30)  # mean 30 s: 20 s left of this batch, 2 batches of 2
    assert sweeper.tally.tally([dataclasses.replace(one, durations=[])], 2, 0, 130, 120).eta_s is None


def test_progress_prints_a_line_per_ended_trial_with_the_totals_once_each(tmp_path):
    storage, study, plan = study_with_trials(tmp_path)
    out = io.StringIO()
    live = sweeper.tally.Live(storage, plan, "2026-12-02_10-00-00", every=60, bar=False, out=out)
    live.poll()
    live.poll()  # nothing ended since: nothing printed again
    lines = out.getvalue().splitlines()
    assert [l.split(" | ")[0].rsplit(" (", 1)[0] for l in lines] == [
        "trial 0 COMPLETE, value 0.9000", "trial 1 COMPLETE, value 0.9500", "trial 2 PRUNED at step 10", "trial 3 FAILED"]
    assert all(l.split(" | ")[1].startswith("4/8 trials: 2 complete, 1 pruned, 1 failed, 1 running") for l in lines)


def test_default_study_names_and_storages_never_collide(tmp_path):
    """With no study_name and storage (the official plugin's defaults), each command is a new study in its own
    sweep folder's journal; the old defaults (the job name, one journal beside all sweep folders) continued
    the last command's study."""
    first = sweeper.storage_and_name(None, None, tmp_path / "multirun" / "a")
    second = sweeper.storage_and_name(None, None, tmp_path / "multirun" / "b")
    assert first[0] == str(tmp_path / "multirun" / "a" / "optuna.journal") and first[0] != second[0]
    assert first[1].startswith("no-name-") and second[1].startswith("no-name-") and first[1] != second[1]
    assert sweeper.storage_and_name("s.journal", "t", tmp_path) == ("s.journal", "t")  # given: kept


def test_trials_are_told_who_they_are_only_in_an_app_that_has_the_trial_node():
    """trial_key=optuna added `optuna.storage=...` to every job, which fails in an app without that node."""
    study = optuna.create_study()
    trial = study.ask({"x": FloatDistribution(0.0, 1.0)})
    other_app = sweeper_for(OmegaConf.create({"db": {"user": "a"}}))
    assert other_app.overrides(study, trial, ["db=b"], {"y": "1"}, 0, [[]]) == ["y=1", "db=b", f"x={trial.params['x']!r}"]
    gaexp_app = sweeper_for(OmegaConf.create({"optuna": {"study": None}}))
    lines = gaexp_app.overrides(study, trial, [], {}, 1, [["seed=1"], ["seed=2"]])
    assert lines == [f"x={trial.params['x']!r}", "seed=2", "optuna.storage='STORAGE'",
                     f"optuna.study='{study.study_name}'", "optuna.trial=0", "optuna.repeat=1", "optuna.repeats=2"]


def test_a_trials_value_is_the_mean_of_its_repeats_and_one_failure_or_prune_decides():
    def ret(value=None, status="COMPLETED", pruned=False):
        from hydra.core.utils import JobReturn, JobStatus
        r = JobReturn()
        r.status = JobStatus[status]
        r._return_value = optuna.TrialPruned() if pruned else value
        return r
    assert sweeper.trial_outcome([ret(0.5), ret(0.7)])[:2] == (TrialState.COMPLETE, pytest.approx(0.6))
    assert sweeper.trial_outcome([ret(0.5), ret(float("nan"))])[0] == TrialState.FAIL
    assert sweeper.trial_outcome([ret(0.5), ret(status="FAILED", pruned=True)])[0] == TrialState.PRUNED
    assert sweeper.trial_outcome([ret(status="FAILED", pruned=True), ret(float("nan"))])[0] == TrialState.FAIL
    assert sweeper.repeat_lines({"seed": [1, 2], "regime": ["bs1a16"]}) == [["seed=1", "regime=bs1a16"],
                                                                            ["seed=2", "regime=bs1a16"]]
    assert sweeper.repeat_lines({}) == [[]]


def test_repeats_report_their_mean_to_the_pruner_once_each_has_reported_the_step(tmp_path):
    """Two repeats in two processes, each reporting its own evaluations: the trial's value at a step is
    their mean, reported when the second of them reports it; pruning reads that mean."""
    storage = str(tmp_path / "j.journal")
    study = optuna.create_study(study_name="s", storage=open_storage(storage), direction="maximize")
    study.set_user_attr(sweeper.PRUNER, {"_target_": "optuna.pruners.ThresholdPruner", "lower": 0.5})
    trial = study.ask()
    first, second = (trials.open_trial(storage, "s", trial.number) for _ in range(2))
    trials.report(first, 0, 2, 10, 0.2)
    assert study.trials[0].intermediate_values == {} and not first.should_prune()  # one repeat of two: no value yet
    trials.report(second, 1, 2, 10, 0.6)
    assert study.trials[0].intermediate_values == {10: pytest.approx(0.4)}
    assert second.should_prune()  # the mean 0.4 < 0.5 (its own 0.6 would go on): it stops
    trials.report(first, 0, 2, 20, 0.9)
    assert study.trials[0].intermediate_values == {10: pytest.approx(0.4)}  # step 20: repeat 1 stopped before it
    assert first.should_prune()  # at its next evaluation the other repeat stops too, on the mean at step 10
    trials.report(second, 1, 2, 20, 0.3)
    assert study.trials[0].intermediate_values == {10: pytest.approx(0.4), 20: pytest.approx(0.6)}


def test_a_study_records_its_protocol_and_refuses_another_naming_the_keys():
    study = optuna.create_study()
    mnist = {"data.dataset": "mnist", "train.num_iterations": "1200", "data.holdout": "10000"}
    protocol.check_protocol(study, "S", mnist)
    assert study.user_attrs[PROTOCOL] == mnist
    study.ask()
    protocol.check_protocol(study, "S", dict(mnist))  # the same protocol continues
    fashion = mnist | {"data.dataset": "fashion_mnist", "model.name": "resnet20"}
    with pytest.raises(sweeper.SweeperError, match=(
            r"study '.*' in S was created for another protocol \(data.dataset: mnist in the study, fashion_mnist "
            r"here; model.name: \(none\) in the study, resnet20 here\); to continue it, give its values; to ask "
            r"this question, start a new study: hydra.sweeper.study_name=<a new name> \(or another "
            r"hydra.sweeper.storage\)")):
        protocol.check_protocol(study, "S", fashion)
    old = optuna.create_study()
    old.ask()  # made before studies recorded a protocol
    with pytest.raises(sweeper.SweeperError, match=r"has 1 trials and no recorded protocol"):
        protocol.check_protocol(old, "S", mnist)


@pytest.mark.parametrize("kind", ["journal", "rdb"])
def test_only_a_stopped_sweeps_trials_are_failed_and_handed_to_the_callback(tmp_path, kind):
    """Opening a study failed every RUNNING trial, a live sweep's too. Now a trial is failed only when its
    sweep stopped beating for grace_period; the callback (e.g. Optuna's retry) gets each one."""
    url = str(tmp_path / "j.journal") if kind == "journal" else f"sqlite:///{tmp_path}/o.db"
    called = []

    def callback(study, trial):
        called.append(trial.number)

    grace = 4  # seconds; the live sweep beats every second, so only a stall of 4 s could fail its trial
    backend = open_storage(url, heartbeat_interval=1, grace_period=grace, failed_trial_callback=callback)
    study = optuna.create_study(study_name="s", storage=backend)
    live, dead = study.ask(), study.ask()
    with heartbeat.Heartbeat(backend, 1) as heart:
        heart.add(live._trial_id)
        heartbeat.beat(backend, dead._trial_id)  # one beat, then its sweep died
        if kind == "journal":  # the beat is a time the sweeper wrote: make it an old one
            backend.set_trial_system_attr(dead._trial_id, HEARTBEAT, time.time() - 10 * grace)
        else:  # Optuna's heartbeat table holds the database's clock: wait it out
            time.sleep(grace + 1.5)
        assert heartbeat.fail_stale_trials(study, grace, callback) == [dead.number]
        assert [t.state for t in study.trials] == [TrialState.RUNNING, TrialState.FAIL] and called == [dead.number]
        study.tell(live, 1.0)  # the live sweep's tell works
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.FAIL]


def test_hydras_plugin_scan_imports_neither_torch_mlflow_optuna_nor_gaexp():
    """Discovering the sweepers imported gaexp (torch, MLflow) and Optuna in every Hydra application of the
    environment (4 s); and gaexp's schema landed in their ConfigStore."""
    code = ("import sys\nfrom hydra.core.plugins import Plugins\nfrom hydra.plugins.sweeper import Sweeper\n"
            "from hydra.core.config_store import ConfigStore\n"
            "names = sorted(p.__name__ for p in Plugins.instance().discover(Sweeper))\n"
            "print(names, sorted(m for m in ('torch', 'mlflow', 'optuna', 'gaexp') if m in sys.modules),\n"
            "      'gaexp_schema.yaml' in ConfigStore.instance().repo, 'gaexp_optuna.yaml' in ConfigStore.instance().repo['hydra']['sweeper'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/").stdout
    assert out.split() == "['BasicSweeper', 'GridSweeper', 'OptunaSweeper'] [] False True".split()


def test_the_search_file_names_its_sweeper_and_a_trials_rerun_composes_with_the_grid_sweeper(compose):
    """`gaexp -m +experiment=tune_lr` failed on its first Optuna key: conf/config.yaml's gaexp_grid won over the
    study file's choice (Hydra issue 3229). The grid sweeper is now named from a group file, and the search's
    settings live in conf/hydra/sweeper/tune_lr.yaml, so gaexp-tuned's rerun of a trial's overrides
    (`+experiment=tune_lr ... hydra/sweeper=gaexp_grid`) composes too."""
    cfg = compose("+experiment=tune_lr", "accumulate=batched", hydra=True)
    assert cfg.hydra.sweeper._target_ == "hydra_plugins.gaexp_optuna_sweeper.sweeper.OptunaSweeper"
    assert (cfg.hydra.sweeper.study_name, cfg.hydra.sweeper.grid.norm, cfg.hydra.sweeper.direction) == (
        "tune_lr", "bn,in,gn4", "maximize")
    assert OmegaConf.to_container(cfg.hydra.sweeper.repeats) == {"seed": [1, 2]}
    assert (cfg.hydra.sweeper.sampler.n_startup_trials, cfg.hydra.sweeper.n_trials) == (8, 16)
    assert cell.validated(job_config(cfg)).accumulate == "batched"
    assert compose(hydra=True).hydra.sweeper._target_.endswith("GridSweeper")
    rerun = compose("+experiment=tune_lr", "norm=bn", "train.lr=0.002", "seed=3", "data.holdout=0",
                    "hydra/sweeper=gaexp_grid", hydra=True)
    assert rerun.hydra.sweeper._target_.endswith("GridSweeper") and (rerun.train.num_iterations, rerun.data.holdout) == (
        1200, 0)


# --- the surprises of a hydra-optuna-sweeper user, each through the public command ---------------------
