"""The sweeper's settings, registered as `hydra/sweeper=gaexp_optuna` (the official plugin's names)."""

from dataclasses import dataclass, field
from typing import Dict, Optional

from hydra.core.config_store import ConfigStore

SAMPLERS = ("tpe", "random", "cmaes", "grid", "qmc")
PRUNERS = ("median", "hyperband", "none")
DIRECTIONS = ("maximize", "minimize")


@dataclass
class SamplerConf:
    name: str = "tpe"  # tpe, random, cmaes, grid, qmc
    seed: Optional[int] = None  # the sampler's own seed: the same seed, the same suggestions


@dataclass
class PrunerConf:
    name: str = "median"  # median, hyperband, none
    n_startup_trials: int = 3  # median: no pruning until this many trials of the study have finished
    n_warmup_steps: int = 0  # median: no pruning before this step of a trial
    min_resource: int = 1  # hyperband: steps of the smallest bracket
    reduction_factor: int = 3  # hyperband


@dataclass
class GaexpOptunaSweeperConf:
    _target_: str = "hydra_plugins.gaexp_optuna_sweeper.sweeper.OptunaSweeper"
    direction: str = "maximize"  # of the task function's return value
    study_name: str = "${hydra.job.name}"  # each grid cell's study: <study_name>[key=value,...]
    storage: Optional[str] = None  # an RDB URL, or a journal file path; null: <sweep.dir>/../optuna.journal
    n_trials: int = 20  # per study, in total across reruns of the same command
    n_jobs: int = 2  # trials per batch handed to the launcher
    sampler: SamplerConf = field(default_factory=SamplerConf)
    pruner: PrunerConf = field(default_factory=PrunerConf)
    max_failure_rate: float = 0.0  # stop when more than this fraction of a study's trials failed
    params: Dict[str, str] = field(default_factory=dict)  # searched keys: choice, interval, range, tag(log, ...)
    grid: Dict[str, str] = field(default_factory=dict)  # keys swept outside the search: one study per combination
    trial_key: Optional[str] = "optuna"  # config node each trial gets {storage, study, trial} in (null: none)


ConfigStore.instance().store(group="hydra/sweeper", name="gaexp_optuna", node=GaexpOptunaSweeperConf,
                             provider="gaexp")
