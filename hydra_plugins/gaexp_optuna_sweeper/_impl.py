"""gaexp's Optuna sweeper at work: Optuna's ask/tell API, Hydra's launcher running the trials.

Every key of `params` and every command-line override written as a search (choice(...), interval(a, b),
int(interval(a, b)), tag(log, interval(a, b)), range(a, b, step), or a comma list `a,b`, a choice as in
hydra-optuna-sweeper) is searched; a plain value is fixed (_space.py). Keys of `grid`
(`hydra.sweeper.grid.norm=bn,in`) are swept outside the search: each combination is its own study,
`<study_name>[norm=bn,...]`.

A study records the protocol it was created for: continuing it with another is refused (_protocol.py). Each
trial may run several jobs (`repeats`, e.g. one per seed) and is worth their mean; the jobs report their
evaluations to the trial (through the `trial_key` node), which reports the mean of the repeats at each step to
its pruner. While its trials run, the sweep records a heartbeat for each; a RUNNING trial whose beats stopped
for `grace_period` (its sweep died) is failed by the next sweep that opens the study, a live sweep's never
(_heartbeat.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import re
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import optuna
from hydra.core.plugins import Plugins
from hydra.core.utils import JobStatus
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import BaseDistribution
from optuna.trial import TrialState

from hydra_plugins.gaexp_optuna_sweeper import tally
from hydra_plugins.gaexp_optuna_sweeper._heartbeat import Heartbeat, fail_stale_trials
from hydra_plugins.gaexp_optuna_sweeper._protocol import check_protocol, protocol
from hydra_plugins.gaexp_optuna_sweeper._space import grid_points, make_sampler, split_arguments
from hydra_plugins.gaexp_optuna_sweeper.config import (DIRECTIONS, PRUNER, REPEATS, RESULTS, SweeperError,
                                                       storage_problem)
from hydra_plugins.gaexp_optuna_sweeper.trials import make, make_pruner, open_storage

log = logging.getLogger(__name__)


def trial_value(ret: Any) -> Tuple[TrialState, Optional[float]]:
    """What a launched job came back as: COMPLETE with its value, PRUNED, or FAIL (an error, or nan)."""
    if ret.status == JobStatus.COMPLETED:
        try:
            value = float(ret.return_value)
        except (TypeError, ValueError):
            return TrialState.FAIL, None
        return (TrialState.COMPLETE, value) if math.isfinite(value) else (TrialState.FAIL, None)
    if isinstance(ret._return_value, optuna.TrialPruned):
        return TrialState.PRUNED, None
    return TrialState.FAIL, None


def trial_outcome(returns: Sequence[Any]) -> Tuple[TrialState, Optional[float], List[Optional[float]]]:
    """A trial from its repeats' jobs: FAIL if one failed, else PRUNED if one was pruned, else COMPLETE
    with the mean of their values; and each repeat's value."""
    outcomes = [trial_value(r) for r in returns]
    values = [value for _, value in outcomes]
    states = {state for state, _ in outcomes}
    for state in (TrialState.FAIL, TrialState.PRUNED):
        if state in states:
            return state, None, values
    return TrialState.COMPLETE, sum(values) / len(values), values


def repeat_lines(repeats: Dict[str, Sequence[Any]]) -> List[List[str]]:
    """Each repeat of a trial as its overrides: the product of the repeated keys' values ([[]]: none)."""
    for key, values in repeats.items():
        if not isinstance(values, Sequence) or isinstance(values, str) or not values:
            raise SweeperError(f"hydra.sweeper.repeats.{key}={values!r}; valid: a list of one value or more, "
                               f"e.g. {{{key}: [1, 2]}}")
    return [[f"{k}={v}" for k, v in zip(repeats, combo)] for combo in itertools.product(*repeats.values())]



def storage_and_name(storage: Optional[str], study_name: Optional[str], sweep_dir: Path) -> Tuple[str, str]:
    """The defaults never collide: no storage, this sweep's own journal; no name, a new one (Optuna's
    unnamed study)."""
    return storage or str(sweep_dir / "optuna.journal"), study_name or f"no-name-{uuid.uuid4()}"


def quoted(value: str) -> str:
    """`value` as a quoted Hydra override value that parses back to exactly `value`, whatever it holds (quotes,
    backslashes, `${`, `,`, spaces): a study name or a storage handed to a job on its command line."""
    escaped = re.sub(r"\\+(?='|\$\{|$)", lambda m: m.group(0) * 2, value)  # backslashes before what is escaped
    return "'" + escaped.replace("'", "\\'").replace("${", "\\${") + "'"


def has_node(config: DictConfig, key: Optional[str]) -> bool:
    """Whether the app's config has the trial node `key` (the official plugin's apps have none: a job told
    `optuna.study=...` there would fail to compose)."""
    return bool(key) and OmegaConf.select(config, key, default=None) is not None


class OptunaSweeperImpl:
    def __init__(self, sampler: Any, pruner: Any, direction: str, study_name: Optional[str], storage: Optional[str],
                 n_trials: int, n_jobs: int, max_batch_size: Optional[int], max_failure_rate: float,
                 params: Optional[Dict[str, str]], grid: Optional[Dict[str, str]], repeats: Optional[Dict[str, Any]],
                 trial_key: Optional[str], heartbeat_interval: float, grace_period: Optional[float],
                 failed_trial_callback: Any, progress: Optional[bool] = None, poll_s: float = 10.0) -> None:
        if direction not in DIRECTIONS:
            raise SweeperError(f"hydra.sweeper.direction={direction!r}; valid: {', '.join(DIRECTIONS)}")
        for key, value, ok, valid in (
                ("n_trials", n_trials, n_trials >= 1, "an integer >= 1"),
                ("n_jobs", n_jobs, n_jobs >= 1, "an integer >= 1"),
                ("max_batch_size", max_batch_size, max_batch_size is None or max_batch_size >= 1, "null or an integer >= 1"),
                ("max_failure_rate", max_failure_rate, 0.0 <= max_failure_rate <= 1.0, "a number in [0, 1]"),
                ("heartbeat_interval", heartbeat_interval, heartbeat_interval > 0, "seconds > 0"),
                ("poll_s", poll_s, poll_s > 0, "seconds > 0"),
                ("grace_period", grace_period, grace_period is None or grace_period >= heartbeat_interval,
                 f"null (2 x heartbeat_interval) or seconds >= heartbeat_interval ({heartbeat_interval})")):
            if not ok:
                raise SweeperError(f"hydra.sweeper.{key}={value!r}; valid: {valid}")
        if study_name is not None and "'" in study_name:  # gaexp/tuning.py finds the study's runs by `= '<name>'`
            raise SweeperError(f"hydra.sweeper.study_name={study_name!r}: MLflow's run search, which finds a study's "
                               "runs for its report, cannot match a ' in it; valid: a name without '")
        problem = storage_problem(storage)  # its form, before anything connects to it or writes it
        if problem:
            from gaexp.redact import mask  # the app's mask: the URL's password never printed

            raise SweeperError(mask(problem))
        self.sampler_node, self.pruner_node = sampler, pruner
        self.direction, self.study_name, self.storage = direction, study_name, storage
        self.storage_interpolation: Optional[str] = None  # `${oc.env:VAR}`, where the config gives the storage so
        self.n_trials, self.n_jobs, self.max_batch_size = n_trials, n_jobs, max_batch_size
        self.max_failure_rate, self.trial_key = max_failure_rate, trial_key
        self.params, self.grid = dict(params or {}), dict(grid or {})
        self.repeats = OmegaConf.to_container(repeats) if isinstance(repeats, DictConfig) else dict(repeats or {})
        self.heartbeat_interval, self.show, self.poll_s = heartbeat_interval, progress, poll_s
        self.grace_period = 2 * heartbeat_interval if grace_period is None else grace_period
        self.callback = None if failed_trial_callback is None else make(
            failed_trial_callback, "hydra.sweeper.failed_trial_callback", object)
        self.pruner = make_pruner(pruner)  # bad options fail here, before any trial
        repeat_lines(self.repeats)
        split_arguments(self.params, self.grid, [])

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.job_idx = config, hydra_context, 0
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)
        self.sweep_dir = Path(config.hydra.sweep.dir)
        self.storage, self.study_name = storage_and_name(self.storage, self.study_name, self.sweep_dir)
        self.tells = has_node(config, self.trial_key)
        # what a job is told: the storage as the config gives it, so `${oc.env:VAR}` stays that in every job's files
        given = config.hydra.sweeper._get_node("storage")
        raw = given._value() if given is not None and given._is_interpolation() else None
        self.storage_interpolation = raw if isinstance(raw, str) and raw.startswith("${oc.env:") else None

    def sweep(self, arguments: List[str]) -> None:
        space, fixed, axes = split_arguments(self.params, self.grid, arguments)
        repeats = repeat_lines(self.repeats)
        both = set(space) & set(self.repeats) | set(fixed) & set(self.repeats)
        if both:
            raise SweeperError(f"{', '.join(sorted(both))}: both repeated (hydra.sweeper.repeats) and searched or "
                               "fixed; valid: a key in one of them")
        cells = list(itertools.product(*axes))
        samplers = [make_sampler(self.sampler_node, space) for _ in cells]  # every study's, before any trial
        if self.trial_key and not self.tells:
            log.warning("hydra.sweeper.trial_key=%s: the app's config has no such node, so its jobs are not told "
                        "their trial (no pruning)", self.trial_key)
        log.info("Optuna: %d stud%s, %d trials each in this command%s, searching %s, storage %s", len(cells),
                 "y" if len(cells) == 1 else "ies", self.n_trials,
                 f" of {len(repeats)} jobs ({', '.join(self.repeats)})" if len(repeats) > 1 else "",
                 ", ".join(space) or "nothing", self.storage)
        self.sweep_dir.mkdir(parents=True, exist_ok=True)  # the input is good: the storage may be made
        self.backend = open_storage(self.storage, self.heartbeat_interval, self.grace_period, self.callback)
        dropped = [*space, *self.repeats, *([self.trial_key] if self.trial_key else [])]
        studies = [self.study(cell, fixed, dropped, sampler) for cell, sampler in zip(cells, samplers)]
        plan = {"studies": [s.study_name for s in studies], "trials": [self.to_run(s, space, self.n_trials) for s in studies],
                "n_jobs": self.n_jobs, "direction": self.direction, "started": time.time()}
        for study in studies:  # where progress (and gaexp-status) reads what this command runs
            study.set_user_attr(tally.PLAN + self.sweep_dir.name, plan)
        results = {}
        with tally.Live(self.backend, plan, self.sweep_dir.name, self.poll_s, self.show) if self.show is not False \
                else contextlib.nullcontext():
            try:
                for cell, study, to_go in zip(cells, studies, plan["trials"]):
                    before = len(study.trials)
                    ran = self.run_study(study, cell, fixed, space, repeats, to_go)
                    results[study.study_name] = summary(study, before, ran)
                    log.info("%s: %d trial(s) before, this command ran %d (%s); best %s", study.study_name, before,
                             len(ran), ", ".join(f"{k} {v}" for k, v in results[study.study_name]["ran"].items())
                             or "none", results[study.study_name]["best"])
            finally:  # its end, for the last poll and gaexp-status
                plan["ended"] = time.time()
                for study in studies:
                    study.set_user_attr(tally.PLAN + self.sweep_dir.name, plan)
        from gaexp.redact import mask  # the app's mask, loaded where a search ends

        OmegaConf.save(OmegaConf.create({"storage": mask(self.storage), "direction": self.direction,
                                         "studies": results}), self.sweep_dir / RESULTS)  # the storage's password masked

    def study(self, cell: Sequence[str], fixed: Dict[str, str], dropped: Sequence[str],
              sampler: optuna.samplers.BaseSampler) -> optuna.Study:
        """The cell's study, created or continued if its protocol is this command's; a killed sweep's
        trials failed."""
        name = self.study_name + (f"[{','.join(cell)}]" if cell else "")
        config = self.hydra_context.config_loader.load_sweep_config(
            master_config=self.config, sweep_overrides=[*(f"{k}={v}" for k, v in fixed.items()), *cell])
        wanted = protocol(config, dropped) | {"hydra.sweeper.direction": self.direction,
                                              "hydra.sweeper.repeats": str(self.repeats)}
        study = optuna.create_study(study_name=name, storage=self.backend, direction=self.direction,
                                    sampler=sampler, pruner=self.pruner, load_if_exists=True)
        check_protocol(study, self.storage, wanted)
        study.set_user_attr(PRUNER, OmegaConf.to_container(self.pruner_node, resolve=True))  # trials prune so
        for number in fail_stale_trials(study, self.grace_period, self.callback):
            log.warning("%s: trial %d was left RUNNING by a sweep that stopped: marked FAIL", name, number)
        return study

    def overrides(self, study: optuna.Study, trial: optuna.Trial, cell: Sequence[str], fixed: Dict[str, str],
                  repeat: int, repeats: Sequence[Sequence[str]]) -> List[str]:
        """A job's command line: fixed values, its grid cell, the sampled values, its repeat, who it is."""
        lines = [f"{k}={v}" for k, v in fixed.items()] + list(cell) + [f"{k}={v!r}" for k, v in trial.params.items()]
        lines += repeats[repeat]
        if self.tells:
            lines += [f"{self.trial_key}.storage={self.storage_interpolation or quoted(self.storage)}", f"{self.trial_key}.study={quoted(study.study_name)}",
                      f"{self.trial_key}.trial={trial.number}"]
            if len(repeats) > 1:
                lines += [f"{self.trial_key}.repeat={repeat}", f"{self.trial_key}.repeats={len(repeats)}"]
        return lines

    def launch(self, batch: List[List[str]]) -> List[Any]:
        size = self.max_batch_size or len(batch)
        returns = []
        for i in range(0, len(batch), size):
            returns += self.launcher.launch(batch[i:i + size], initial_job_idx=self.job_idx)
            self.job_idx += len(batch[i:i + size])
        return returns

    @staticmethod
    def to_run(study: optuna.Study, space: Dict[str, BaseDistribution], n_trials: int) -> int:
        """The trials this command runs of the study: n_trials, or the grid's points not yet tried."""
        if isinstance(study.sampler, optuna.samplers.GridSampler):  # every point once at most
            return max(0, min(n_trials, math.prod(len(v) for v in grid_points(space).values()) - len(study.trials)))
        return n_trials

    def run_study(self, study: optuna.Study, cell: Sequence[str], fixed: Dict[str, str],
                  space: Dict[str, BaseDistribution], repeats: List[List[str]],
                  to_go: Optional[int] = None) -> List[TrialState]:
        """`to_go` trials of the study (None: `to_run`'s), `n_jobs` at a time, each marked as this sweep's;
        returns their states."""
        to_go = self.to_run(study, space, self.n_trials) if to_go is None else to_go
        ran: List[TrialState] = []
        with Heartbeat(self.backend, self.heartbeat_interval) as heart:
            while to_go > 0:
                trials = [study.ask(space) for _ in range(min(self.n_jobs, to_go))]
                for trial in trials:
                    trial.set_user_attr(tally.SWEEP, self.sweep_dir.name)
                    heart.add(trial._trial_id)
                try:
                    returns = self.launch([self.overrides(study, trial, cell, fixed, i, repeats)
                                           for trial in trials for i in range(len(repeats))])
                except BaseException:  # interrupted: this sweep's trials end now, not after a grace period
                    for trial in trials:
                        heart.remove(trial._trial_id)
                        study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
                    raise
                for j, trial in enumerate(trials):
                    heart.remove(trial._trial_id)
                    state, value, values = trial_outcome(returns[j * len(repeats):(j + 1) * len(repeats)])
                    if len(repeats) > 1:
                        trial.set_user_attr(REPEATS, {" ".join(r): v for r, v in zip(repeats, values)})
                    try:
                        study.tell(trial, value, state=state, skip_if_finished=True)
                    except RuntimeError as e:  # the grid sampler stops the study after its last point
                        if "Study.stop" not in str(e):
                            raise
                    ran.append(state)
                to_go -= len(trials)
                failed = ran.count(TrialState.FAIL)
                if failed / len(ran) > self.max_failure_rate:
                    raise SweeperError(f"{study.study_name}: {failed} of {len(ran)} trials failed, more than "
                                       f"hydra.sweeper.max_failure_rate={self.max_failure_rate}; see the cells' logs")
        return ran


def summary(study: optuna.Study, before: int, ran: Sequence[TrialState]) -> Dict[str, Any]:
    """The best trial (none while no trial completed), the count of trials per state, in all and run by
    this command, and how many there were before it."""
    states = [t.state.name for t in study.trials]
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    best = {"trial": study.best_trial.number, "value": study.best_value, "params": study.best_params} if complete else None
    mine = [s.name for s in ran]
    return {"best": best, "states": {s: states.count(s) for s in sorted(set(states))}, "before": before,
            "ran": {s: mine.count(s) for s in sorted(set(mine))}}
