"""A Hydra sweeper over Optuna's ask/tell API: Optuna searches, Hydra's launcher runs the trials.

Every key of `params` (and every command-line override written as a search: choice(...),
interval(a, b), int(interval(a, b)), tag(log, interval(a, b)), range(a, b, step)) is searched;
a plain value is fixed. Keys of `grid` (and command-line comma lists such as `norm=bn,in`) are
swept outside the search: each combination is its own study, `<study_name>[norm=bn,...]`.
Each trial is told its study, storage and number through the `trial_key` node, so the task can
report intermediate values and be pruned (it raises optuna.TrialPruned). A rerun of the same
command continues each study up to `n_trials`; trials a killed sweep left RUNNING become FAIL.
"""

from __future__ import annotations

import itertools
import logging
import math
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.core.plugins import Plugins
from hydra.core.utils import JobStatus
from hydra.errors import HydraException
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from hydra_plugins.gaexp_optuna_sweeper.config import DIRECTIONS, PRUNERS, SAMPLERS, PrunerConf, SamplerConf

log = logging.getLogger(__name__)
FORMS = ("choice(a, b, ...), interval(a, b), int(interval(a, b)), tag(log, interval(a, b)), range(a, b, step) "
         "or a fixed value")
RESULTS = "optimization_results.yaml"  # written into the sweep folder: every study's best trial


class SweeperError(HydraException):
    """Bad sweeper input: one line naming the value and what is valid."""


def open_storage(storage: str) -> optuna.storages.BaseStorage | str:
    """An RDB URL (it has ://) as is; anything else is a journal file, safe for several processes."""
    if "://" in storage:
        return storage
    Path(storage).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(storage))


def parse(key: str, value: str) -> Override:
    try:
        (override,) = OverridesParser.create().parse_overrides([f"{key}={value}"])
    except HydraException as e:
        why = " ".join(line.strip() for line in str(e).splitlines()[1:] if line.strip() and not line.startswith("See "))
        raise SweeperError(f"{key}={value!r} is not a value or a sweep ({why}); valid: {FORMS}") from None
    return override


def distribution(override: Override) -> BaseDistribution | str:
    """The Optuna distribution of a searched override, or the string of a fixed one."""
    if not override.is_sweep_override():
        return override.get_value_element_as_str()
    name, value = override.get_key_element(), override.value()
    where = f"{name}={override.input_line.split('=', 1)[1] if override.input_line else value}"
    if isinstance(value, ChoiceSweep):
        choices = list(override.sweep_iterator())
        if not choices:
            raise SweeperError(f"{where}: an empty choice; valid: choice(a, b, ...) with one value or more")
        return CategoricalDistribution(choices)
    if isinstance(value, RangeSweep):
        values = list(override.sweep_iterator())
        if not values:
            raise SweeperError(f"{where}: an empty range; valid: range(a, b, step) with a < b for step > 0")
        step = value.step or 1
        if any(isinstance(v, float) for v in (value.start, value.stop, step)):
            return FloatDistribution(float(values[0]), float(values[-1]), step=float(step))
        return IntDistribution(int(values[0]), int(values[-1]), step=int(step))
    if isinstance(value, IntervalSweep):
        low, high, tags = value.start, value.end, set(value.tags)
        if tags - {"log"}:
            raise SweeperError(f"{where}: unknown tag(s) {sorted(tags - {'log'})}; valid: tag(log, interval(a, b))")
        if not low < high:
            raise SweeperError(f"{where}: an empty or inverted interval; valid: interval(a, b) with a < b")
        if "log" in tags and low <= 0:
            raise SweeperError(f"{where}: a log scale needs bounds > 0; valid: tag(log, interval(a, b)) with 0 < a < b")
        if isinstance(low, int) and isinstance(high, int):
            return IntDistribution(low, high, log="log" in tags)
        return FloatDistribution(float(low), float(high), log="log" in tags)
    raise SweeperError(f"{where}: not supported; valid: {FORMS}")


def split_arguments(params: Dict[str, str], grid: Dict[str, str], arguments: Sequence[str]
                    ) -> Tuple[Dict[str, BaseDistribution], Dict[str, str], List[List[str]]]:
    """(search space, fixed values, grid axes as lists of key=value): the config's params and grid,
    then the command line, which wins (a plain comma list there is a grid axis)."""
    space: Dict[str, BaseDistribution] = {}
    fixed: Dict[str, str] = {}
    axes: Dict[str, List[str]] = {}
    parsed = [parse(k, v) for k, v in params.items()]
    parsed += [parse(k, v) for k, v in grid.items()]
    for line in arguments:
        key, _, value = line.partition("=")
        parsed.append(parse(key, value))
    grid_keys = set(grid)
    for override in parsed:
        key, value = override.get_key_element(), override.value()
        space.pop(key, None), fixed.pop(key, None)
        if key in grid_keys or (isinstance(value, ChoiceSweep) and value.simple_form):  # a grid axis, in study names
            values = override.sweep_string_iterator() if override.is_sweep_override() else [override.get_value_element_as_str()]
            axes[key] = [f"{key}={v}" for v in values]  # keeps its first place: study names read in grid order
        else:
            axes.pop(key, None)
            found = distribution(override)
            (space if isinstance(found, BaseDistribution) else fixed)[key] = found
    return space, fixed, list(axes.values())


def grid_points(space: Dict[str, BaseDistribution]) -> Dict[str, list]:
    """Every value of each searched key, for the grid sampler: choices, or a range's steps."""
    values = {}
    for key, dist in space.items():
        if isinstance(dist, CategoricalDistribution):
            values[key] = list(dist.choices)
        elif dist.step is not None:
            values[key] = [dist.low + i * dist.step for i in range(int(round((dist.high - dist.low) / dist.step)) + 1)]
        else:
            raise SweeperError(f"{key}: the grid sampler needs discrete values; valid: choice(...) or range(...)")
    return values


def make_sampler(conf: SamplerConf, space: Dict[str, BaseDistribution]) -> optuna.samplers.BaseSampler:
    if conf.name not in SAMPLERS:
        raise SweeperError(f"hydra.sweeper.sampler.name={conf.name!r}; valid: {', '.join(SAMPLERS)}")
    if conf.name == "grid":
        return optuna.samplers.GridSampler(grid_points(space), seed=conf.seed)
    with warnings.catch_warnings():  # QMCSampler is marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler,
                "cmaes": optuna.samplers.CmaEsSampler, "qmc": optuna.samplers.QMCSampler}[conf.name](seed=conf.seed)


def make_pruner(conf: PrunerConf) -> optuna.pruners.BasePruner:
    if conf.name not in PRUNERS:
        raise SweeperError(f"hydra.sweeper.pruner.name={conf.name!r}; valid: {', '.join(PRUNERS)}")
    if conf.name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=conf.n_startup_trials, n_warmup_steps=conf.n_warmup_steps)
    if conf.name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=conf.min_resource, reduction_factor=conf.reduction_factor)
    return optuna.pruners.NopPruner()


def trial_value(ret: Any) -> Tuple[TrialState, Optional[float]]:
    """What a launched trial came back as: COMPLETE with its value, PRUNED, or FAIL (an error, or nan)."""
    if ret.status == JobStatus.COMPLETED:
        try:
            value = float(ret.return_value)
        except (TypeError, ValueError):
            return TrialState.FAIL, None
        return (TrialState.COMPLETE, value) if math.isfinite(value) else (TrialState.FAIL, None)
    if isinstance(ret._return_value, optuna.TrialPruned):
        return TrialState.PRUNED, None
    return TrialState.FAIL, None


class OptunaSweeper(Sweeper):
    def __init__(self, direction: str, study_name: str, storage: Optional[str], n_trials: int, n_jobs: int,
                 sampler: SamplerConf, pruner: PrunerConf, max_failure_rate: float, params: Dict[str, str],
                 grid: Dict[str, str], trial_key: Optional[str]) -> None:
        if direction not in DIRECTIONS:
            raise SweeperError(f"hydra.sweeper.direction={direction!r}; valid: {', '.join(DIRECTIONS)}")
        for key, value, ok in (("n_trials", n_trials, n_trials >= 1), ("n_jobs", n_jobs, n_jobs >= 1),
                               ("max_failure_rate", max_failure_rate, 0.0 <= max_failure_rate <= 1.0)):
            if not ok:
                raise SweeperError(f"hydra.sweeper.{key}={value!r}; valid: "
                                   + ("a number in [0, 1]" if key == "max_failure_rate" else "an integer >= 1"))
        self.direction, self.study_name, self.storage = direction, study_name, storage
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, n_jobs, max_failure_rate
        self.sampler_conf = OmegaConf.structured(SamplerConf(**sampler))
        self.pruner_conf = OmegaConf.structured(PrunerConf(**pruner))
        self.params, self.grid, self.trial_key = dict(params or {}), dict(grid or {}), trial_key
        make_pruner(self.pruner_conf)  # bad names fail here, before any trial runs

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.job_idx = config, 0
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)
        self.storage = self.storage or str(Path(config.hydra.sweep.dir).parent / "optuna.journal")

    def study(self, cell: Sequence[str], space: Dict[str, BaseDistribution]) -> optuna.Study:
        """The cell's study, created or continued; trials left RUNNING by a killed sweep become FAIL."""
        name = self.study_name + (f"[{','.join(cell)}]" if cell else "")
        study = optuna.create_study(study_name=name, storage=open_storage(self.storage), direction=self.direction,
                                    sampler=make_sampler(self.sampler_conf, space), pruner=make_pruner(self.pruner_conf),
                                    load_if_exists=True)
        study.set_user_attr("pruner", OmegaConf.to_container(self.pruner_conf))  # trials prune as the sweeper says
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING)):
            study.tell(trial.number, state=TrialState.FAIL)
            log.warning("%s: trial %d was left RUNNING by an earlier sweep: marked FAIL", name, trial.number)
        return study

    def overrides(self, study: optuna.Study, trial: optuna.Trial, cell: Sequence[str], fixed: Dict[str, str]) -> List[str]:
        """The trial's command line: fixed values, its grid cell, the sampled values, who it is."""
        lines = [f"{k}={v}" for k, v in fixed.items()] + list(cell) + [f"{k}={v!r}" for k, v in trial.params.items()]
        if self.trial_key:
            lines += [f"{self.trial_key}.storage='{self.storage}'", f"{self.trial_key}.study='{study.study_name}'",
                      f"{self.trial_key}.trial={trial.number}"]
        return lines

    def sweep(self, arguments: List[str]) -> None:
        space, fixed, axes = split_arguments(self.params, self.grid, arguments)
        cells = list(itertools.product(*axes))
        log.info("Optuna: %d stud%s of %d trials, searching %s, storage %s", len(cells),
                 "y" if len(cells) == 1 else "ies", self.n_trials, ", ".join(space) or "nothing", self.storage)
        results = {}
        for cell in cells:
            study = self.study(cell, space)
            self.run_study(study, cell, fixed, space)
            results[study.study_name] = summary(study)
            log.info("%s: best %s", study.study_name, results[study.study_name]["best"])
        OmegaConf.save(OmegaConf.create({"storage": self.storage, "direction": self.direction, "studies": results}),
                       Path(self.config.hydra.sweep.dir) / RESULTS)

    def run_study(self, study: optuna.Study, cell: Sequence[str], fixed: Dict[str, str],
                  space: Dict[str, BaseDistribution]) -> None:
        n_trials = self.n_trials
        if self.sampler_conf.name == "grid":  # every point once at most
            n_trials = min(n_trials, math.prod(len(v) for v in grid_points(space).values()))
        ran, failed = 0, 0  # this sweep's trials (a killed sweep's leftovers are FAIL, not counted here)
        while (to_go := n_trials - len(study.trials)) > 0:
            trials = [study.ask(space) for _ in range(min(self.n_jobs, to_go))]
            batch = [self.overrides(study, trial, cell, fixed) for trial in trials]
            returns = self.launcher.launch(batch, initial_job_idx=self.job_idx)
            self.job_idx += len(returns)
            for trial, ret in zip(trials, returns):
                state, value = trial_value(ret)
                ran, failed = ran + 1, failed + (state == TrialState.FAIL)
                try:
                    study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
                except RuntimeError as e:  # the grid sampler stops the study after its last point
                    if "Study.stop" not in str(e):
                        raise
            if failed / ran > self.max_failure_rate:
                raise SweeperError(f"{study.study_name}: {failed} of {ran} trials failed, more than "
                                   f"hydra.sweeper.max_failure_rate={self.max_failure_rate}; see the cells' logs")


def summary(study: optuna.Study) -> Dict[str, Any]:
    """The best trial (none while no trial completed) and the count of trials per state."""
    states = [t.state.name for t in study.trials]
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    best = {"trial": study.best_trial.number, "value": study.best_value, "params": study.best_params} if complete else None
    return {"best": best, "states": {s: states.count(s) for s in sorted(set(states))}}


def open_trial(storage: str, study_name: str, number: int) -> optuna.Trial:
    """Trial `number` of a study, from a task process: to report intermediate values and ask whether to
    prune, with the pruner the sweeper configured (kept in the study's user attributes)."""
    backend = optuna.storages.get_storage(open_storage(storage))
    trial_id = backend.get_trial_id_from_study_id_trial_number(backend.get_study_id_from_name(study_name), number)
    study = optuna.load_study(study_name=study_name, storage=backend)
    study.pruner = make_pruner(OmegaConf.structured(PrunerConf(**study.user_attrs.get("pruner", {}))))
    return optuna.Trial(study, trial_id)
