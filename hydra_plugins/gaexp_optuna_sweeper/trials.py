"""The trial side of gaexp's Optuna sweeper, what a job (gaexp) calls: open the study storage, open its trial,
report an evaluation to it (the mean of its repeats), build the pruner the sweeper configured.

Public and light: Hydra's plugin scan imports it in every Hydra application, so Optuna and Hydra's
instantiate load only when a function here is called.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from omegaconf import DictConfig, OmegaConf

from hydra_plugins.gaexp_optuna_sweeper.config import CURVE, PRUNER, SweeperError

if TYPE_CHECKING:
    import optuna


def open_storage(storage: str, heartbeat_interval: Optional[float] = None, grace_period: Optional[float] = None,
                 failed_trial_callback: Any = None) -> optuna.storages.BaseStorage:
    """An RDB URL (it has ://) as Optuna's RDBStorage, with its heartbeat when an interval is given;
    anything else is a journal file, safe for several processes."""
    import optuna

    if "://" in storage:
        beat = {} if heartbeat_interval is None else dict(
            heartbeat_interval=max(1, math.ceil(heartbeat_interval)),
            grace_period=None if grace_period is None else max(1, math.ceil(grace_period)),
            failed_trial_callback=failed_trial_callback)
        return optuna.storages.RDBStorage(storage, **beat)
    Path(storage).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(storage))


def make(node: Any, where: str, kind: type, **filled: Any) -> Any:
    """A sampler or pruner from its config node (`_target_` and options), or one line naming what is wrong."""
    from hydra.utils import instantiate

    target = OmegaConf.select(node, "_target_") if isinstance(node, DictConfig) else None
    try:
        made = instantiate(node, **filled)
    except Exception as e:  # noqa: BLE001 - Hydra wraps the constructor's error; its cause is what to show
        cause = e.__cause__ or e
        why = " ".join(str(cause).split()) or type(cause).__name__
        raise SweeperError(f"{where} ({target}): {why}; valid: its class's options at their types "
                           f"(docs/tuning.md)") from None
    if not isinstance(made, kind):
        raise SweeperError(f"{where}._target_={target!r} is no {kind.__module__}.{kind.__name__}; valid: "
                           f"hydra/{where.replace('hydra.', '').replace('.', '/')}=<a name of its group>")
    return made


def make_pruner(node: Any) -> optuna.pruners.BasePruner:
    import optuna

    return make(node, "hydra.sweeper.pruner", optuna.pruners.BasePruner)


def open_trial(storage: str, study_name: str, number: int) -> optuna.Trial:
    """Trial `number` of a study, from a job's process: to report intermediate values and ask whether to
    prune, with the pruner the sweeper configured (kept in the study's user attributes)."""
    import optuna

    backend = optuna.storages.get_storage(open_storage(storage))
    trial_id = backend.get_trial_id_from_study_id_trial_number(backend.get_study_id_from_name(study_name), number)
    study = optuna.load_study(study_name=study_name, storage=backend)
    study.pruner = make_pruner(OmegaConf.create(study.user_attrs.get(PRUNER, {"_target_": "optuna.pruners.NopPruner"})))
    return optuna.Trial(study, trial_id)


def report(trial: optuna.Trial, repeat: int, repeats: int, step: int, value: float) -> None:
    """A job's evaluation at `step`, told to its trial. With several repeats the trial's value at a step is
    their mean, reported once all of them have reported the step: each repeat records its own reports, then
    reads the others' (the last to record a step sees them all)."""
    if repeats == 1:
        trial.report(value, step)
        return
    storage, key = trial.study._storage, f"{CURVE}{repeat}"
    mine = dict(storage.get_trial(trial._trial_id).user_attrs.get(key, {}))
    storage.set_trial_user_attr(trial._trial_id, key, mine | {str(step): value})
    frozen = storage.get_trial(trial._trial_id)
    curves = [frozen.user_attrs.get(f"{CURVE}{r}", {}) for r in range(repeats)]
    means = {int(done): sum(c[done] for c in curves) / repeats for done in set.intersection(*(set(c) for c in curves))}
    for done in sorted(set(means) - set(frozen.intermediate_values)):
        storage.set_trial_intermediate_value(trial._trial_id, done, means[done])
    trial._cached_frozen_trial.intermediate_values.update(means)  # what should_prune reads
