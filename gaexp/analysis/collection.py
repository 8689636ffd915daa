"""Collect: MLflow -> one tidy DataFrame. The grid runs of a sweep (or of all), their curves (from the curves tags,
or the histories of runs logged before them), one dataset, model and precision at a time (`select`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from gaexp import metrics
from gaexp.analysis.columns import (AnalysisError, Collected, EXCLUDED, LAUNCH_WINDOW, PARTS, PROTOCOL, RUN_METRICS, SHARED,
                                    TIDY, TRAIN_LOSS, VALID_ACC, number_or_nan)
from gaexp.config import ADDED_DEFAULTS, PROTOCOL_COLUMNS
from gaexp.tags import (BATCH_SIZE, DATASET, MODEL, NORM, NUM_ACCUM, OPTUNA_STUDY, PLAN_ROLE, PRECISION, REGIME,
                        ROLE, SAME_AS, SEED, SINGLE_RUN, SWEEP_ID, filter_equals, filter_present, in_sweep, is_training_run)
from gaexp.tracking import curves_of, newest_run, runs_in_sweep, search_all, sweeps_of


def training_runs(client: MlflowClient, experiment_name: str) -> dict[str, Run]:
    """The training runs of an experiment by run name, whatever their status (none if there is no such
    experiment)."""
    experiment = client.get_experiment_by_name(experiment_name)
    runs = search_all(client, [experiment.experiment_id]) if experiment else []
    return {r.info.run_name: r for r in runs if is_training_run(r.data.tags)}


def is_grid_run(run: Run) -> bool:
    return is_training_run(run.data.tags) and OPTUNA_STUDY not in run.data.tags  # trials of a search are not grid cells


def latest_sweep(client: MlflowClient, experiment_ids: list[str]) -> str | None:
    """The sweep of the newest grid run of a multirun (a single run's only where no multirun ran), or a sweep
    started after that run that only resumed over runs (it ran none: its plan run is newer); None: no grid run."""
    newest = (newest_run(client, experiment_ids, "", lambda r: is_grid_run(r) and SINGLE_RUN not in r.data.tags)
              or newest_run(client, experiment_ids, "", is_grid_run))  # unfiltered: a tag filter joins every tag
    if newest is None:
        return None
    sweep = in_sweep(newest.data.tags)
    later = search_all(client, experiment_ids, f"{filter_equals(ROLE, PLAN_ROLE)} and "
                                               f"attributes.start_time > {newest.info.start_time}")
    for resume in sorted({in_sweep(p.data.tags) for p in later}, reverse=True):
        if resume > sweep and any(is_grid_run(r) for r in runs_in_sweep(client, experiment_ids, resume)):
            return resume
    return sweep


def store_filter(dataset: str | None, model: str | None, precision: str | None = None) -> str:
    """The search filter of a dataset, a model and a precision (None: any). A value that runs logged before its
    tag implicitly have (ADDED_DEFAULTS) cannot be searched for: those runs lack the tag; `select` keeps them."""
    wanted = {DATASET: dataset, MODEL: model, PRECISION: precision}
    return " and ".join(f"tags.{part} = '{value}'" for part, value in wanted.items()
                        if value is not None and value != str(ADDED_DEFAULTS[PARTS[part]]))


def collect(client: MlflowClient, experiment_name: str, sweep: str = "latest", dataset: str | None = None,
            model: str | None = None, precision: str | None = None) -> Collected:
    """Runs and their metric histories; `sweep` is 'latest', 'all', a sweep id or several, comma-separated;
    `dataset`, `model` and `precision` keep those runs only (`select`).

    The store finds the runs (by sweep, dataset and model: search filters, every page) and each run
    carries its curves (tracking.curves_of), so the cost follows the runs asked for, not the store; a run
    logged before gaexp wrote its curves has its histories read, two calls for it.
    FINISHED runs are the data; FAILED, KILLED and still RUNNING ones are listed
    in `excluded`, never averaged in.
    """
    try:
        experiment = client.get_experiment_by_name(experiment_name)
    except MlflowException as e:
        raise AnalysisError(f"cannot read the MLflow store {client.tracking_uri}: {e.message}") from None
    if experiment is None:
        names = [e.name for e in client.search_experiments()]
        raise AnalysisError(f"no experiment {experiment_name!r} in {client.tracking_uri}; there: {names}")
    ids = [experiment.experiment_id]
    if sweep == "latest":
        sweep = latest_sweep(client, ids) or "latest"
    runs = grid_runs(client, ids, sweep, store_filter(dataset, model, precision))
    if not runs and store_filter(dataset, model, precision):  # none of those: select says what there is
        runs = grid_runs(client, ids, sweep)
    if not runs and sweep in ("latest", "all"):
        raise AnalysisError(f"experiment {experiment_name!r} has no gaexp runs")
    unknown = [s for s in sweep.split(",") if not any(s in sweeps_of(r) for r in runs)] if sweep != "all" else []
    if unknown:
        there = sorted({s for r in search_all(client, ids, filter_present(NORM)) if is_grid_run(r) for s in sweeps_of(r)})
        if not there:
            raise AnalysisError(f"experiment {experiment_name!r} has no gaexp runs")
        raise AnalysisError(f"no sweep {','.join(sorted(unknown))!r} in experiment {experiment_name!r}; there: {there}")

    rows, excluded, run_rows = [], [], []
    for run in runs:
        if run.info.status != "FINISHED":
            excluded.append((run.info.run_id, run.info.run_name, run.info.status,
                             *(run.data.tags.get(name, ADDED_DEFAULTS[key]) for name, key in PARTS.items())))
            continue
        tags, params = run.data.tags, run.data.params
        base = {"run_id": run.info.run_id, SWEEP_ID: in_sweep(tags), NORM: tags[NORM], REGIME: tags[REGIME],
                BATCH_SIZE: int(tags[BATCH_SIZE]), NUM_ACCUM: int(tags[NUM_ACCUM]), SEED: int(tags[SEED]),
                **{name: number_or_nan(params.get(key, str(ADDED_DEFAULTS.get(key, "nan"))))
                   for name, key in zip(PROTOCOL, PROTOCOL_COLUMNS)}}
        run_rows.append({**{k: base[k] for k in [*TIDY[:7], *PARTS]},
                         **{m: run.data.metrics.get(m, np.nan) for m in RUN_METRICS},
                         LAUNCH_WINDOW: number_or_nan(params.get("analysis.window_start", "nan")), SHARED: SAME_AS in tags})
        for step, acc, loss in curves(client, run):
            rows.append({**base, "step": step, VALID_ACC: acc, TRAIN_LOSS: loss})
    data = pd.DataFrame(rows, columns=TIDY)
    collected = Collected(data, pd.DataFrame(excluded, columns=EXCLUDED), sweep,
                          pd.DataFrame(run_rows, columns=[*TIDY[:7], *PARTS, *RUN_METRICS, LAUNCH_WINDOW, SHARED]))
    return select(collected, dataset=dataset, model=model, precision=precision)


def grid_runs(client: MlflowClient, experiment_ids: list[str], sweep: str, filter_string: str = "") -> list[Run]:
    """The grid runs of `sweep` ('all', or sweep ids, comma-separated) that `filter_string` matches."""
    if sweep == "all":
        return [r for r in search_all(client, experiment_ids, filter_string) if is_grid_run(r)]
    found = {r.info.run_id: r for s in sweep.split(",") for r in runs_in_sweep(client, experiment_ids, s, filter_string)}
    return sorted((r for r in found.values() if is_grid_run(r)), key=lambda r: (-r.info.start_time, r.info.run_id))


def curves(client: MlflowClient, run: Run) -> list[tuple[int, float, float]]:
    """(step, valid_acc, train_loss) of each evaluation, by step: from the run's curves tags, or for a run
    logged before them, from its histories (train_loss nan where an evaluation logged none)."""
    found = curves_of(run)
    if found is not None:
        points = {step: (acc, loss) for step, acc, loss in found}
    else:
        histories = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
                     for key in metrics.HISTORIES}
        points = {step: (acc, histories[TRAIN_LOSS].get(step, np.nan)) for step, acc in histories[VALID_ACC].items()}
    return [(step, *points[step]) for step in sorted(points)]


def values_in(collected: Collected, part: str) -> list[str]:
    """The values of a part (dataset, model) among the collected runs, finished or not, sorted."""
    return sorted({*collected.data[part], *collected.excluded[part]})


def datasets_in(collected: Collected) -> list[str]:
    return values_in(collected, DATASET)


def select(collected: Collected, **wanted: str | None) -> Collected:
    """The runs of one dataset, model or precision (`dataset=`, `model=`, `precision=`; None: all): a report
    never pools two."""
    for part, value in wanted.items():
        if value is None:
            continue
        there = values_in(collected, part)
        if value not in there:
            raise AnalysisError(f"--{part} {value!r}: no such runs in sweep {collected.sweep!r}; there: {there}")
        runs = None if collected.runs is None else collected.runs[collected.runs[part] == value]
        collected = Collected(collected.data[collected.data[part] == value],
                              collected.excluded[collected.excluded[part] == value], collected.sweep, runs)
    return collected
