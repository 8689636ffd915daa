"""The sweeper's settings, registered as `hydra/sweeper=gaexp_optuna`, with its sampler and pruner as config
groups (`hydra/sweeper/sampler=tpe`, `hydra/sweeper/pruner=median`), as the official plugin has them.

Each sampler and pruner node is its Optuna class's `_target_` and every constructor argument of it, at the
class's own default (tests/test_sweeper.py compares them with Optuna's signatures), so any of them can be set:
`hydra.sweeper.sampler.n_startup_trials=8`. Arguments that take an object (TPE's `gamma`, CMA-ES's
`independent_sampler`, ...) take a node with its own `_target_`. Nothing here imports Optuna: Hydra's plugin
scan imports this module in every Hydra application.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from hydra_plugins.gaexp_optuna_sweeper._errors import SweeperError  # noqa: F401 - the sweeper's, shared from here

DIRECTIONS = ("maximize", "minimize")
RESULTS = "optimization_results.yaml"  # written into the sweep folder: every study's best trial and counts
PROTOCOL = "gaexp.protocol"  # a study's user attribute: the config it was created for
PRUNER = "gaexp.pruner"  # a study's user attribute: the sweeper's pruner node, which its trials' jobs prune with
HEARTBEAT = "gaexp.heartbeat"  # a trial's system attribute: its sweep's last beat, time.time() (journal storages)
REPEATS = "gaexp.repeats"  # a trial's user attribute: each repeat's overrides and value
CURVE = "gaexp.reports."  # + the repeat's index: a trial's user attribute, that repeat's reports {step: value}

STORAGES = ("an RDB URL dialect[+driver]://[user[:password]@]host[:port]/database whose driver is installed here "
            "(sqlite:////ABSOLUTE/PATH.db, postgresql://..., mysql+pymysql://...), or a journal file's path")


def _journal_problem(path: Path) -> Optional[str]:
    try:
        folder = path.parent  # the nearest folder there is: open_storage makes the ones below it
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        return ("a folder, not a journal file" if path.is_dir() else
                f"{folder} is a file, not a folder" if not folder.is_dir() else
                f"this user cannot write in {folder}" if not os.access(folder, os.W_OK | os.X_OK) else None)
    except OSError as e:
        return f"its folder cannot be read ({e})"


def storage_problem(storage: Optional[str]) -> Optional[str]:
    """What is wrong with `hydra.sweeper.storage` in the forms trials.open_storage takes, as one line (unmasked:
    the caller masks it), found without connecting or writing; None: fine, or null (the sweep's own journal).
    An RDB URL (it has ://) must parse as SQLAlchemy's (an integer port), name a dialect and driver installed
    here and a database file or server (SQLite in memory would be another empty database in each trial's
    process); a journal file's folder must be one this process can make or write in."""
    if storage is None:
        return None
    if "://" not in storage:
        why = _journal_problem(Path(storage))
    else:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError, NoSuchModuleError

        try:
            url = make_url(storage)
            why = None
        except (ArgumentError, ValueError) as e:
            url, why = None, ("its port is not an integer" if "int()" in str(e) else
                              f"SQLAlchemy cannot read it ({e})")
        if url is not None:
            try:
                url.get_dialect().import_dbapi()
            except NoSuchModuleError:
                why = f"SQLAlchemy has no dialect+driver {url.drivername!r}"
            except ImportError as e:
                why = f"its driver for {url.drivername} is not installed here ({e})"
            else:
                if url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"):
                    why = "SQLite in memory: each trial's process would see its own empty database"
    return None if why is None else f"hydra.sweeper.storage={storage!r}: {why}; valid: {STORAGES}"


@dataclass
class TPESamplerConf:
    _target_: str = "optuna.samplers.TPESampler"
    consider_prior: Optional[bool] = None
    prior_weight: Optional[float] = None
    consider_magic_clip: Optional[bool] = None
    consider_endpoints: Optional[bool] = None
    n_startup_trials: int = 10  # random trials before TPE models the results
    n_ei_candidates: int = 24
    gamma: Any = None
    weights: Any = None
    seed: Optional[int] = None  # the same seed, the same suggestions
    multivariate: Optional[bool] = None
    group: bool = False
    warn_independent_sampling: Optional[bool] = None
    constant_liar: bool = True  # trials of a batch are suggested apart from each other
    constraints_func: Any = None


@dataclass
class RandomSamplerConf:
    _target_: str = "optuna.samplers.RandomSampler"
    seed: Optional[int] = None


@dataclass
class CmaEsSamplerConf:
    _target_: str = "optuna.samplers.CmaEsSampler"
    x0: Optional[Dict[str, Any]] = None
    sigma0: Optional[float] = None
    n_startup_trials: int = 1
    independent_sampler: Any = None
    warn_independent_sampling: bool = True
    seed: Optional[int] = None
    consider_pruned_trials: bool = False
    restart_strategy: Optional[str] = None
    popsize: Optional[int] = None
    inc_popsize: int = -1
    use_separable_cma: bool = False
    with_margin: bool = False
    lr_adapt: bool = False
    source_trials: Any = None


@dataclass
class QMCSamplerConf:
    _target_: str = "optuna.samplers.QMCSampler"
    qmc_type: str = "sobol"
    scramble: bool = False
    seed: Optional[int] = None
    independent_sampler: Any = None
    warn_asynchronous_seeding: bool = True
    warn_independent_sampling: bool = True


@dataclass
class GPSamplerConf:
    _target_: str = "optuna.samplers.GPSampler"
    seed: Optional[int] = None
    independent_sampler: Any = None
    n_startup_trials: int = 10
    deterministic_objective: bool = False
    constraints_func: Any = None
    warn_independent_sampling: bool = True


@dataclass
class NSGAIISamplerConf:
    _target_: str = "optuna.samplers.NSGAIISampler"
    population_size: int = 50
    mutation: Any = None
    mutation_prob: Optional[float] = None
    crossover: Any = None
    crossover_prob: float = 0.9
    swapping_prob: float = 0.5
    seed: Optional[int] = None
    constraints_func: Any = None
    elite_population_selection_strategy: Any = None
    child_generation_strategy: Any = None
    after_trial_strategy: Any = None


@dataclass
class GridSamplerConf:
    _target_: str = "optuna.samplers.GridSampler"
    search_space: Optional[Dict[str, Any]] = None  # null: every value of each searched choice(...) or range(...)
    seed: Optional[int] = None


@dataclass
class BruteForceSamplerConf:
    _target_: str = "optuna.samplers.BruteForceSampler"
    seed: Optional[int] = None
    avoid_premature_stop: bool = False


@dataclass
class MedianPrunerConf:
    _target_: str = "optuna.pruners.MedianPruner"
    n_startup_trials: int = 5  # no pruning until this many trials of the study have finished
    n_warmup_steps: int = 0  # no pruning before this step of a trial
    interval_steps: int = 1
    n_min_trials: int = 1


@dataclass
class PercentilePrunerConf:
    _target_: str = "optuna.pruners.PercentilePruner"
    percentile: float = MISSING
    n_startup_trials: int = 5
    n_warmup_steps: int = 0
    interval_steps: int = 1
    n_min_trials: int = 1


@dataclass
class HyperbandPrunerConf:
    _target_: str = "optuna.pruners.HyperbandPruner"
    min_resource: int = 1
    max_resource: Any = "auto"
    reduction_factor: int = 3
    bootstrap_count: int = 0


@dataclass
class SuccessiveHalvingPrunerConf:
    _target_: str = "optuna.pruners.SuccessiveHalvingPruner"
    min_resource: Any = "auto"
    reduction_factor: int = 4
    min_early_stopping_rate: int = 0
    bootstrap_count: int = 0


@dataclass
class ThresholdPrunerConf:
    _target_: str = "optuna.pruners.ThresholdPruner"
    lower: Optional[float] = None
    upper: Optional[float] = None
    n_warmup_steps: int = 0
    interval_steps: int = 1


@dataclass
class PatientPrunerConf:
    _target_: str = "optuna.pruners.PatientPruner"
    wrapped_pruner: Any = None  # a node with its own _target_, or null
    patience: int = MISSING
    min_delta: float = 0.0


@dataclass
class WilcoxonPrunerConf:
    _target_: str = "optuna.pruners.WilcoxonPruner"
    p_threshold: float = 0.1
    n_startup_steps: int = 2


@dataclass
class NopPrunerConf:
    _target_: str = "optuna.pruners.NopPruner"


SAMPLERS = {"tpe": TPESamplerConf, "random": RandomSamplerConf, "cmaes": CmaEsSamplerConf, "qmc": QMCSamplerConf,
            "gp": GPSamplerConf, "nsgaii": NSGAIISamplerConf, "grid": GridSamplerConf,
            "bruteforce": BruteForceSamplerConf}
PRUNERS = {"median": MedianPrunerConf, "percentile": PercentilePrunerConf, "hyperband": HyperbandPrunerConf,
           "successive_halving": SuccessiveHalvingPrunerConf, "threshold": ThresholdPrunerConf,
           "patient": PatientPrunerConf, "wilcoxon": WilcoxonPrunerConf, "nop": NopPrunerConf}


@dataclass
class GaexpOptunaSweeperConf:
    defaults: List[Any] = field(default_factory=lambda: [{"sampler": "tpe"}, {"pruner": "median"}])
    _target_: str = "hydra_plugins.gaexp_optuna_sweeper.sweeper.OptunaSweeper"
    _recursive_: bool = False  # the sweeper makes the sampler (one per study) and pruner from their nodes
    sampler: Any = MISSING  # hydra/sweeper/sampler=tpe|random|cmaes|qmc|gp|nsgaii|grid|bruteforce
    pruner: Any = MISSING  # hydra/sweeper/pruner=median|percentile|hyperband|successive_halving|threshold|patient|wilcoxon|nop
    direction: str = "minimize"  # of the task function's return value (gaexp's trials: maximize)
    study_name: Optional[str] = None  # null: a new name per study (Optuna's); a grid cell's: <study_name>[key=value,...]
    storage: Optional[str] = None  # an RDB URL, or a journal file path; null: <sweep folder>/optuna.journal
    n_trials: int = 20  # trials this command runs, per study
    n_jobs: int = 2  # trials per batch handed to the launcher
    max_batch_size: Optional[int] = None  # jobs per launch at most (a batch of n_jobs trials x repeats); null: all
    max_failure_rate: float = 0.0  # stop when more than this fraction of this command's trials of a study failed
    params: Dict[str, str] = field(default_factory=dict)  # searched keys: choice, interval, range, tag(log, ...)
    grid: Dict[str, str] = field(default_factory=dict)  # keys swept outside the search: one study per combination
    repeats: Dict[str, List[Any]] = field(default_factory=dict)  # each trial runs every combination, e.g. {seed: [1, 2]}
    trial_key: Optional[str] = "optuna"  # config node each trial gets {storage, study, trial, ...} in, if the app has it
    heartbeat_interval: float = 60.0  # seconds between the beats this sweep records for its running trials
    grace_period: Optional[float] = None  # a RUNNING trial without a beat for this long is failed; null: 2 x interval
    failed_trial_callback: Any = None  # called with (study, trial) for each trial failed so, e.g. a node
    # _target_: optuna.storages.RetryFailedTrialCallback (its trial is asked again)
    progress: Optional[bool] = None  # null: a bar over the trials on a terminal, else a line per ended trial; false: none
    poll_s: float = 10.0  # seconds between the reads of the storage that progress makes


def register() -> None:
    store = ConfigStore.instance()
    store.store(group="hydra/sweeper", name="gaexp_optuna", node=GaexpOptunaSweeperConf, provider="gaexp")
    for name, node in SAMPLERS.items():
        store.store(group="hydra/sweeper/sampler", name=name, node=node, provider="gaexp")
    for name, node in PRUNERS.items():
        store.store(group="hydra/sweeper/pruner", name=name, node=node, provider="gaexp")


register()
