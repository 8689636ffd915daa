"""Rebuild the study's comparison table and learning curves from the MLflow store (docs/study.md).

Stages, each testable alone: `collect` (MLflow -> one tidy DataFrame),
`summarize` (pure pandas -> tables), `plot_curves` (matplotlib -> figures),
`export` (files). The design (table columns, reference, ranked regime,
baselines, window) is a study's `analysis` node (conf/experiment/*.yaml,
schema `AnalysisConfig`). `gaexp-report --help` runs them all.
"""

from __future__ import annotations

import argparse
import itertools
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from mlflow.entities import Run  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from scipy import stats  # noqa: E402

from gaexp import cli, metrics  # noqa: E402
from gaexp.norms import ORDER as DECLARED_ORDER  # noqa: E402
from gaexp.config import ADDED_DEFAULTS, CONFIG_DIR, PROTOCOL_COLUMNS, AnalysisConfig, parse_regime  # noqa: E402
from gaexp.tags import (BATCH_SIZE, DATASET, MODEL, NORM, NUM_ACCUM, OPTUNA_STUDY, PLAN_ROLE, PRECISION, REGIME,  # noqa: E402
                        ROLE, SEED, SINGLE_RUN, SWEEP_ID, filter_equals, filter_present, in_sweep, is_training_run)
from gaexp.tracking import curves_of, newest_run, runs_in_sweep, search_all, sweeps_of  # noqa: E402


def column(key: str) -> str:
    """The table column of a protocol key: its last part, or its node's name for a `name` (model.name: model)."""
    node, _, leaf = key.rpartition(".")
    return node.rpartition(".")[2] if leaf == "name" and node else leaf


PROTOCOL = [column(key) for key in PROTOCOL_COLUMNS]  # runs differing in any of these never mix
VALID_ACC, TRAIN_LOSS = metrics.VALID_ACC.name, metrics.TRAIN_LOSS.name  # the histories' columns
TIDY = ["run_id", SWEEP_ID, NORM, REGIME, BATCH_SIZE, NUM_ACCUM, SEED, *PROTOCOL, "step", VALID_ACC, TRAIN_LOSS]
# DATASET, MODEL, PRECISION (gaexp.tags): the protocol columns of data.dataset, model.name, precision.name
ENGINE = column("accumulate")  # and precision.name; ENGINE may differ between cells (auto's fallback), never within one
PARTS = {DATASET: "data.dataset", MODEL: "model.name", PRECISION: "precision.name"}  # a report never pools two values
# of these: one per value (and runs of several precisions are compared, `compare_precisions`)
LAUNCH_WINDOW = "launch_window_start"  # a run's analysis.window_start as its command had it (its sweep's report's)
RUN_METRICS = list(metrics.RESOURCES)  # what each run cost (batched_*: accumulate=batched)
MEMORY_COLUMNS = [(metrics.ACTIVATION_MB, "mean"), (metrics.SAMPLES_PER_SEC, "mean"), (metrics.WALL_SECONDS, "mean"),
                  (metrics.PEAK_RSS_MB, "max"), (metrics.CUDA_MAX_MEM_MB, "max"), (metrics.BATCHED_ACTIVATION_MB, "mean"),
                  (metrics.BATCHED_PEAK_RSS_MB, "max"), (metrics.BATCHED_CUDA_MAX_MEM_MB, "max")]  # the memory table's
ACTIVATIONS = (metrics.ACTIVATION_MB.name, metrics.BATCHED_ACTIVATION_MB.name)  # its columns in MiB to 2 decimals


class AnalysisError(RuntimeError):
    """A one-line reason the analysis cannot go on (unknown experiment or sweep, mixed protocols...)."""


EXCLUDED = ["run_id", "run_name", "status", *PARTS]


@dataclass
class Collected:
    data: pd.DataFrame  # tidy: one row per (run, evaluation step), columns TIDY
    excluded: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=EXCLUDED))
    sweep: str = "all"
    runs: pd.DataFrame | None = None  # one row per FINISHED run: its cell and RUN_METRICS (nan if not logged)


def norm_order(design: AnalysisConfig) -> Sequence[str]:
    """The rows' and panels' order: the study's `norm_order`, or where it sets none the order gaexp's norms are
    declared in (gaexp/norms.py); norms of one's own follow, sorted."""
    return design.norm_order or DECLARED_ORDER


def _order(values: Sequence[str], preferred: Sequence[str]) -> list[str]:
    present = list(dict.fromkeys(values))
    return [v for v in preferred if v in present] + sorted(v for v in present if v not in preferred)


def _number(value: str) -> float | str:
    try:
        return float(value)
    except ValueError:
        return value


def load_study(study: str) -> AnalysisConfig:
    """The `analysis` node of conf/experiment/<study>.yaml (or of a YAML file at that path), over the schema."""
    path = Path(study) if study.endswith((".yaml", ".yml")) else Path(CONFIG_DIR) / "experiment" / f"{study}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (Path(CONFIG_DIR) / "experiment").glob("*.yaml"))
        raise AnalysisError(f"--study {study!r}: no file {path}; valid: {known} or a path to a .yaml file")
    node = OmegaConf.load(path).get("analysis", {})
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AnalysisConfig), node))


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
                **{name: _number(params.get(key, str(ADDED_DEFAULTS.get(key, "nan"))))
                   for name, key in zip(PROTOCOL, PROTOCOL_COLUMNS)}}
        run_rows.append({**{k: base[k] for k in [*TIDY[:7], *PARTS]},
                         **{m: run.data.metrics.get(m, np.nan) for m in RUN_METRICS},
                         LAUNCH_WINDOW: _number(params.get("analysis.window_start", "nan"))})
        for step, acc, loss in curves(client, run):
            rows.append({**base, "step": step, VALID_ACC: acc, TRAIN_LOSS: loss})
    data = pd.DataFrame(rows, columns=TIDY)
    collected = Collected(data, pd.DataFrame(excluded, columns=EXCLUDED), sweep,
                          pd.DataFrame(run_rows, columns=[*TIDY[:7], *PARTS, *RUN_METRICS, LAUNCH_WINDOW]))
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


def memory_table(runs: pd.DataFrame, design: AnalysisConfig) -> pd.DataFrame:
    """Per regime: micro-batch (per replica), effective batch (w*b*k over the replicas), activation memory per micro-batch, speed, peaks. The activation
    column is what the loop holds whichever engine ran; runs of accumulate=batched add what they held
    (`batched_*` columns: the b*k samples of a step, and their process peaks, never the loop's)."""
    table = runs.groupby(REGIME).agg(micro_batch=(BATCH_SIZE, "first"), num_accum=(NUM_ACCUM, "first"),
                                     runs=("run_id", "count"), **{m.name: (m.name, how) for m, how in MEMORY_COLUMNS})
    replicas = [(parse_regime(str(name)) or (0, 0, 1))[2] for name in table.index]  # w2b8a1: 2; bs16a1: 1
    table.insert(1, "effective_batch", table.micro_batch * table.num_accum * replicas)
    table = table.drop(columns=NUM_ACCUM).reindex(_order(table.index, design.regime_order))
    if design.reference in table.index:
        table.insert(3, f"activation_vs_{design.reference}", table[ACTIVATIONS[0]] / table[ACTIVATIONS[0]][design.reference])
    return table.dropna(axis="columns", how="all")


def check_protocol(data: pd.DataFrame, per_cell: Sequence[str] = ()) -> None:
    """Refuse to average runs of different datasets or protocols together. Keys in `per_cell` (a tuned value
    such as lr) may differ between cells, never within one."""
    for part in PARTS:
        values = sorted(data[part].unique())
        if len(values) > 1:
            raise AnalysisError(f"runs of {len(values)} {part}s ({', '.join(values)}) never pool; "
                                f"choose one with --{part}")
    for key in per_cell:
        if key not in PROTOCOL:
            raise AnalysisError(f"analysis.per_cell: {key!r}; valid: {', '.join(PROTOCOL)}")
    for key in [*per_cell, ENGINE]:
        varying = data.groupby(["norm", "regime"])[key].nunique()
        if (varying > 1).any():
            cell = varying[varying > 1].index[0]
            if key == ENGINE:
                found = data[(data.norm == cell[0]) & (data.regime == cell[1])].groupby(ENGINE).seed.unique()
                raise AnalysisError(
                    f"the cell {'/'.join(cell)} has runs of both engines ("
                    + "; ".join(f"{e}: seed {', '.join(map(str, sorted(s)))}" for e, s in found.items())
                    + "): they agree within seed noise but not bit for bit, and never pool; choose one sweep with "
                      "--sweep, or run its seeds again under one engine (accumulate=loop rerun=true)")
            raise AnalysisError(f"{key} differs within the cell {'/'.join(cell)}; choose one sweep with --sweep")
    protocols = data[[k for k in PROTOCOL if k not in [*per_cell, ENGINE]]].drop_duplicates()
    if len(protocols) > 1:
        found = "; ".join(", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
                          for _, row in protocols.iterrows())
        raise AnalysisError(f"runs of {len(protocols)} different protocols ({found}); "
                            "choose one sweep with --sweep")


ALPHA = 0.05  # every test at 5%: the 95% interval, and TOST's two one-sided tests at 5% each
MAX_SEEDS = 100  # seeds_to_settle looks this far
VERDICTS = ("equivalent", "worse", "better", "inconclusive", "n/a (1 seed)")
PAIRED_COLUMNS = ["diff", "ci_low", "ci_high", "pairs", "sd_a", "sd_b", "p_equivalent", "verdict", "seeds_needed"]


def _settled(diff: float, sd: float, n: int, margin: float) -> bool:
    """Whether n pairs with this mean difference and spread give a verdict other than inconclusive:
    TOST's 90% interval inside +-margin, or the 95% interval clear of 0 (the tests' own criteria)."""
    se = sd / np.sqrt(n)
    return (abs(diff) + stats.t.ppf(1 - ALPHA, n - 1) * se < margin
            or abs(diff) > stats.t.ppf(1 - ALPHA / 2, n - 1) * se)


def seeds_to_settle(diff: float, sd: float, n: int, margin: float) -> int | None:
    """The fewest seeds (more than n) at which the observed mean difference and standard deviation of the
    differences, if they held, would settle an inconclusive comparison; None if not within MAX_SEEDS."""
    return next((m for m in range(n + 1, MAX_SEEDS + 1) if _settled(diff, sd, m, margin)), None)


def paired_verdict(a: pd.Series, b: pd.Series, margin: float) -> dict:
    """Cell a against cell b, paired on their index (the seed): a - b's mean, its 95% t-interval (scipy's
    paired t-test), each cell's std across seeds, and the verdict at +-margin (same units as a and b):
    equivalent when statsmodels' paired TOST puts the difference inside +-margin at 5%; worse or better
    (different) when the interval excludes 0; inconclusive otherwise, with the seeds that would settle it."""
    from statsmodels.stats.weightstats import ttost_paired  # the report's only user: not imported by the app

    pairs = pd.concat([a.rename("a"), b.rename("b")], axis=1).dropna()
    x, y, n = pairs.a.to_numpy(float), pairs.b.to_numpy(float), len(pairs)
    out = dict.fromkeys(PAIRED_COLUMNS, np.nan) | {"pairs": n, "seeds_needed": None}
    if n == 0:
        return out | {"verdict": None}
    d = x - y
    out["diff"] = float(d.mean())
    if n < 2:
        return out | {"verdict": VERDICTS[4]}
    out |= {"sd_a": float(np.std(x, ddof=1)), "sd_b": float(np.std(y, ddof=1))}
    sd = float(np.std(d, ddof=1))
    if sd == 0:  # every seed gives the same difference: the interval is that point, the tests degenerate
        out |= {"ci_low": out["diff"], "ci_high": out["diff"], "p_equivalent": float(abs(out["diff"]) >= margin)}
    else:
        out["ci_low"], out["ci_high"] = (float(v) for v in stats.ttest_rel(x, y).confidence_interval(1 - ALPHA))
        out["p_equivalent"] = float(ttost_paired(x, y, -margin, margin)[0])
    if out["p_equivalent"] < ALPHA:
        verdict = VERDICTS[0]
    elif out["ci_low"] > 0 or out["ci_high"] < 0:
        verdict = VERDICTS[2] if out["diff"] > 0 else VERDICTS[1]
    else:
        verdict = VERDICTS[3]
        out["seeds_needed"] = seeds_to_settle(out["diff"], sd, n, margin)
    return out | {"verdict": verdict}


def verdict_text(verdict: str | None, seeds_needed: float | None) -> str:
    """A verdict as the tables print it: inconclusive says how many seeds would settle it (`seeds_needed`
    None or nan: more than MAX_SEEDS)."""
    if verdict != VERDICTS[3]:
        return verdict or "–"
    if seeds_needed is None or pd.isna(seeds_needed):
        return f"inconclusive (over {MAX_SEEDS} seeds)"
    return f"inconclusive ({int(seeds_needed)} seeds)"


@dataclass
class Summary:
    table: pd.DataFrame  # the study's table: rows norm, columns design.table_columns, pooled mean valid acc
    cells: pd.DataFrame  # per (norm, regime): mean, std over seeds, seeds, final-step accuracy
    paired: pd.DataFrame  # per norm and GA regime: paired (same seed) difference to bs16a1, 95% CI, verdict
    missing: list[str]  # cells with fewer seeds than the fullest cell, or none at all
    design: AnalysisConfig
    ranking: pd.DataFrame  # norms on design.ranked_regime, best first, paired differences to each baseline
    dataset: str = ""  # the one dataset of the runs
    model: str = ""  # and their one model
    window_note: str = ""  # why the table averages other evaluations than design.window_start says, if it does
    engines: str = ""  # which cells ran which engine, where they differ (accumulate=auto fell back for some)
    precision: str = ""  # and their one precision
    twins: pd.DataFrame = field(default_factory=pd.DataFrame)  # per norm and DP regime: against its accumulation twin

    @property
    def label(self) -> str:
        return label_of(self.dataset, self.model, self.precision)


def label_of(dataset: str, model: str, precision: str = "") -> str:
    """What runs trained on, as a table's title says it: mnist, or mnist, resnet20 (another model), or mnist, bf16
    (another precision)."""
    return dataset + "".join(f", {v}" for v, first in ((model, ADDED_DEFAULTS[PARTS[MODEL]]),
                                                       (precision, ADDED_DEFAULTS[PARTS[PRECISION]]))
                             if v not in ("", first))


def rank(per_run: pd.Series, design: AnalysisConfig) -> pd.DataFrame:
    """Every norm run on the ranked regime, best mean first, with its std across seeds and its paired
    (same-seed) difference, 95% t-interval and verdict at design.margin to each baseline cell present.
    `per_run`: windowed mean per (norm, regime, seed)."""
    rows, regime = [], design.ranked_regime
    for norm in _order(per_run.index.get_level_values("norm").unique(), norm_order(design)):
        if (norm, regime) not in per_run.index:
            continue
        acc = per_run[norm, regime]
        row = {"norm": norm, "mean": float(acc.mean()), "sd": float(acc.std(ddof=1)), "seeds": len(acc)}
        for b_norm, b_regime in design.baseline_cells():
            name = f"{b_norm}/{b_regime}"
            base = per_run[b_norm, b_regime] if (b_norm, b_regime) in per_run.index else acc[[]]
            pair = paired_verdict(acc, base, design.margin / 100)
            if (b_norm, b_regime) == (norm, regime):
                pair |= {"verdict": "baseline", "seeds_needed": None}
            row |= {f"vs {name}": pair["diff"], f"vs {name} low": pair["ci_low"], f"vs {name} high": pair["ci_high"],
                    f"vs {name} verdict": pair["verdict"], f"vs {name} seeds_needed": pair["seeds_needed"]}
        rows.append(row)
    ranking = pd.DataFrame(rows)
    if ranking.empty:
        return ranking
    ranking = ranking.sort_values("mean", ascending=False, kind="stable").reset_index(drop=True)
    ranking.insert(0, "rank", range(1, len(ranking) + 1))
    return ranking


def summarize(data: pd.DataFrame, design: AnalysisConfig) -> Summary:
    """The tables, from the tidy data; evaluations at step > design.window_start count."""
    if data.empty:
        raise AnalysisError("no FINISHED runs to summarize")
    check_protocol(data, design.per_cell)
    window, window_note = data[data.step > design.window_start], ""
    if window.empty:  # a short budget: the evaluations there are, said in the table's header
        window = data
        window_note = (f"every evaluation (none after step {design.window_start}, the window's start: the last is at "
                       f"step {data.step.max()}; set --window-start or analysis.window_start to choose)")
    reference = design.reference
    columns = [r for r in design.table_columns if r in set(data.regime)]  # what the sweep ran, never more
    norms = _order(data.norm, norm_order(design))
    regimes = _order(data.regime, design.regime_order)

    pooled = window.groupby(["norm", "regime"]).valid_acc.mean()
    table = pooled.unstack("regime").reindex(index=norms, columns=columns)
    table.columns.name, table.index.name = None, "norm"

    per_run = window.groupby(["norm", "regime", "seed"]).valid_acc.mean()
    final = data[data.step == data.groupby("run_id").step.transform("max")]
    final_acc = final.groupby(["norm", "regime"]).valid_acc.mean()
    cells = per_run.groupby(["norm", "regime"]).agg(mean="mean", std="std", seeds="count")
    cells["final_acc"] = final_acc
    for key in design.per_cell:  # the tuned value of each cell
        cells[key] = data.groupby(["norm", "regime"])[key].first()
    cells = cells.reindex(pd.MultiIndex.from_product([norms, regimes], names=["norm", "regime"])).dropna(how="all")
    cells["seeds"] = cells.seeds.astype(int)

    paired_rows = []
    for norm in norms:
        for regime in (r for r in columns if r != reference):
            if (norm, regime) not in per_run.index or (norm, reference) not in per_run.index:
                continue
            pair = paired_verdict(per_run[norm, regime], per_run[norm, reference], design.margin / 100)
            if pair["pairs"]:
                paired_rows.append({"norm": norm, "regime": regime, **pair})
    paired = pd.DataFrame(paired_rows, columns=["norm", "regime", *PAIRED_COLUMNS])

    most = int(cells.seeds.max())
    seeds = per_run.groupby(["norm", "regime"]).size()
    missing = [f"{n}/{r}: " + (f"{seeds[n, r]} of {most} seeds" if (n, r) in seeds.index else "no run")
               for n in norms for r in regimes if (n, r) not in seeds.index or seeds[n, r] < most]
    return Summary(table, cells, paired, missing, design, rank(per_run, design), data[DATASET].iloc[0],
                   data[MODEL].iloc[0], window_note, engines_note(data, norms, regimes), data[PRECISION].iloc[0],
                   twins(per_run, norms, columns, design.margin / 100))


SYNCHRONIZED = ("bn_sync",)  # norms whose statistics span the replicas: their normalization batch is w*b


def twin_of(regime: str) -> str | None:
    """A data-parallel regime's accumulation twin: w replicas of b with k steps take each step's samples of
    (b, w*k) (gaexp/replicas.py); None for a regime of one replica or a name that does not parse."""
    parsed = parse_regime(regime)
    if parsed is None or parsed[2] == 1:
        return None
    b, k, w = parsed
    return f"bs{b}a{w * k}"


def twins(per_run: pd.Series, norms: Sequence[str], columns: Sequence[str], margin: float) -> pd.DataFrame:
    """Each data-parallel cell of the table against its accumulation twin (`twin_of`), paired on the seed, with
    its normalization batch (b, or w*b where the norm is synchronized) and optimization batch (w*b*k)."""
    rows, per_run = [], per_run.sort_index()
    for norm in norms:
        for regime in columns:
            twin = twin_of(regime)
            if twin is None or (norm, regime) not in per_run.index or (norm, twin) not in per_run.index:
                continue
            b, k, w = parse_regime(regime)
            pair = paired_verdict(per_run[norm, regime], per_run[norm, twin], margin)
            rows.append({"norm": norm, "regime": regime, "twin": twin,
                         "norm_batch": w * b if norm in SYNCHRONIZED else b, "opt_batch": w * b * k, **pair})
    return pd.DataFrame(rows, columns=["norm", "regime", "twin", "norm_batch", "opt_batch", *PAIRED_COLUMNS])


def engines_note(data: pd.DataFrame, norms: Sequence[str], regimes: Sequence[str]) -> str:
    """Which cells ran which engine where a report's cells differ in it ("" where they all ran one): a
    comparison across engines compares within seed noise, not bit for bit (docs/study.md)."""
    by_cell = data.groupby(["norm", "regime"])[ENGINE].first()
    if by_cell.nunique() < 2:
        return ""
    parts = []
    for engine, cells in sorted(by_cell.groupby(by_cell), key=lambda g: -len(g[1])):
        listed = [f"{n}/{r}" for n in norms for r in regimes if (n, r) in cells.index]
        parts.append(f"{engine}: " + (f"{len(listed)} cells" if len(listed) > 8 else ", ".join(listed)))
    return ("Engines differ between cells: " + "; ".join(parts) + ". Their steps are the same up to rounding: a "
            "comparison across engines holds within seed noise, not bit for bit (docs/study.md).")


PRECISION_KEYS = [column(k) for k in PROTOCOL_COLUMNS if k.startswith("precision.")]  # one precision's columns


@dataclass
class Precisions:
    """Runs of several precisions (one dataset and model) set side by side: per norm, regime and precision, the
    mean over seeds of each run's windowed mean, and each precision's paired (same seed) difference to fp32 at
    the same norm and regime with its verdict (the accumulation regimes against their true batch at the same
    precision are each precision's own table)."""

    table: pd.DataFrame  # norm, regime, precision, mean, std, seeds, then PAIRED_COLUMNS against fp32
    design: AnalysisConfig
    label: str  # what the runs trained on (Summary.label)
    note: str = ""  # precisions not compared, and why
    over: str = ""  # the evaluations averaged, where not design.window_start's (a short budget: every one)


def compare_precisions(data: pd.DataFrame, design: AnalysisConfig) -> Precisions:
    """`Precisions` of the runs in `data`. A precision whose runs differ from fp32's in another protocol key (a
    reduced budget, say) is shown but not compared: the note says which key."""
    reference = ADDED_DEFAULTS[PARTS[PRECISION]]
    others = [k for k in PROTOCOL if k not in [*PRECISION_KEYS, *design.per_cell, ENGINE]]
    base = data[data[PRECISION] == reference][others].drop_duplicates()
    window, over = data[data.step > design.window_start], ""
    if window.empty:  # a short budget: every evaluation, as `summarize` takes it
        window, over = data, f"every evaluation (none after step {design.window_start})"
    per_run = window.groupby(["norm", "regime", PRECISION, "seed"]).valid_acc.mean()
    precisions, differs = _order(data[PRECISION], [reference]), {}
    for precision in precisions[1:] if not base.empty else []:
        mine = data[data[PRECISION] == precision][others].drop_duplicates()
        differs[precision] = [k for k in others if set(map(str, mine[k])) != set(map(str, base[k]))]  # nan == nan
    def shown(values: pd.Series) -> str:
        return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in sorted(set(values), key=str))

    notes = [f"{precision} not compared with {reference}: " + ", ".join(
        f"{k} {shown(data[data[PRECISION] == precision][k])} against {shown(base[k])}" for k in keys)
        for precision, keys in differs.items() if keys]
    rows = []
    for norm, regime, precision in itertools.product(_order(data.norm, norm_order(design)),
                                                     _order(data.regime, design.regime_order), precisions):
        if (norm, regime, precision) not in per_run.index:
            continue
        acc = per_run[norm, regime, precision]
        row = {"norm": norm, "regime": regime, PRECISION: precision, "mean": float(acc.mean()),
               "std": float(acc.std(ddof=1)) if len(acc) > 1 else np.nan, "seeds": len(acc)}
        if precision != reference and not differs.get(precision) and (norm, regime, reference) in per_run.index:
            row |= paired_verdict(acc, per_run[norm, regime, reference], design.margin / 100)
        rows.append(row)
    table = pd.DataFrame(rows, columns=["norm", "regime", PRECISION, "mean", "std", "seeds", *PAIRED_COLUMNS])
    return Precisions(table, design, label_of(data[DATASET].iloc[0], data[MODEL].iloc[0]), "; ".join(notes), over)


def format_precisions(p: Precisions) -> str:
    """The precisions side by side as Markdown, a precision column beside norm and regime."""
    reference, margin = ADDED_DEFAULTS[PARTS[PRECISION]], p.design.margin
    over = p.over or f"evaluations at step > {p.design.window_start}"
    lines = [f"{p.label}: precisions side by side: mean valid accuracy % over {over} and its std across seeds; the paired (same seed) difference to {reference} "
             f"at the same norm and regime, in points with its 95% t-interval, and its verdict at ±{margin:g} points",
             "", f"| norm | regime | precision | mean % | std | seeds | vs {reference} | verdict (±{margin:g}) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in p.table.itertuples():
        std = "n/a" if pd.isna(r.std) else f"{100 * r.std:.2f}"
        if getattr(r, PRECISION) == reference:
            vs, verdict = "reference", ""
        elif pd.isna(r.diff):
            vs, verdict = "–", "–"
        else:
            vs = f"{100 * r.diff:+.2f}" + ("" if pd.isna(r.ci_low) else f" [{100 * r.ci_low:+.2f}, {100 * r.ci_high:+.2f}]")
            verdict = verdict_text(r.verdict, r.seeds_needed)
        lines.append(f"| {r.norm} | {r.regime} | {getattr(r, PRECISION)} | {100 * r.mean:.2f} | {std} | {r.seeds} | "
                     f"{vs} | {verdict} |")
    if p.note:
        lines += ["", p.note]
    return "\n".join(lines) + "\n"


def export_precisions(p: Precisions, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "precisions.md", out / "precisions.csv"]
    written[0].write_text(format_precisions(p))
    p.table.to_csv(written[1], index=False)
    return written


def _grid(n_panels: int, max_cols: int = 3):
    ncols = min(n_panels, max_cols)
    nrows = -(-n_panels // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols + 1.4, 3.4 * nrows + 0.4), sharex=True, sharey=True,
                             squeeze=False, constrained_layout=True)
    for ax in axes.flat[n_panels:]:
        ax.remove()
    return fig, axes.flat[:n_panels]


def plot_curves(data: pd.DataFrame, metric: str = VALID_ACC, design: AnalysisConfig | None = None) -> plt.Figure:
    """One panel per norm, one colour per regime: mean over seeds, band from min to max; accuracy in %, as the
    tables give it, against whole optimizer steps."""
    from matplotlib.ticker import MaxNLocator

    design = design or AnalysisConfig()
    if metric == VALID_ACC:
        data = data.assign(**{VALID_ACC: 100 * data[VALID_ACC]})
    norms = _order(data.norm, norm_order(design))
    regimes = _order(data.regime, design.regime_order)
    colors = dict(zip(design.regime_order, ["#7f7f7f", "#d62728", "#ff7f0e", "#1f77b4"]))
    fig, axes = _grid(len(norms))
    stats_ = data.groupby(["norm", "regime", "step"])[metric].agg(["mean", "min", "max"]).reset_index()
    for ax, norm in zip(axes, norms):
        for regime in regimes:
            s = stats_[(stats_.norm == norm) & (stats_.regime == regime)]
            if s.empty:
                continue
            color = colors.get(regime)
            ax.plot(s.step, s["mean"], marker="o", ms=3, lw=1.6, color=color, label=regime)
            ax.fill_between(s.step, s["min"], s["max"], color=ax.lines[-1].get_color(), alpha=0.18, lw=0)
        ax.set_title(norm, fontsize=12)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: a short run's few never show as 2.5
    if metric == VALID_ACC:  # zoom on the effective-batch-16 curves; bs1a1 may start below
        focus = stats_[stats_.regime.isin(design.table_columns)]
        low = (focus if not focus.empty else stats_)["mean"].min()
        axes[0].set_ylim(max(0.0, min(low, 95) - 2), 100)
        label = "validation accuracy (%)"
    else:
        low, high = stats_["min"].min(), stats_["max"].max()
        if low == high:  # flat curves: give the log axis a range around them before it is made
            axes[0].set_ylim(low / 1.5, high * 1.5)
        axes[0].set_yscale("log")
        label = "train loss (mean of last 100 steps)"
    ncols = axes[0].get_subplotspec().get_gridspec().ncols
    for i, ax in enumerate(axes):
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel(label)
        if i + ncols >= len(axes):  # no panel below this one: label its x axis
            ax.xaxis.set_tick_params(labelbottom=True)
            ax.set_xlabel("optimizer step")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", title="regime", frameon=False)
    seeds = data.groupby(["norm", "regime"]).seed.nunique().max()
    shown = [*_order(data[DATASET], []), *(m for m in _order(data[MODEL], []) if m != ADDED_DEFAULTS["model.name"])]
    datasets = ", ".join(shown)
    fig.suptitle(f"{datasets + ': ' if datasets else ''}{label.split(' (')[0]}, mean of {seeds} seed(s), "
                 "band min–max", fontsize=11)
    return fig


def format_memory(memory: pd.DataFrame) -> str:
    """The memory table as Markdown: what accumulation saves, and what it costs in time."""
    header = ["regime", *memory.columns]
    lines = ["Memory and speed per regime (means over runs; peaks are maxima)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for regime, row in memory.iterrows():
        cells = [f"{v:.0f}" if k in ("micro_batch", "effective_batch", "runs") else
                 f"{v:.3f}" if k == "activation_vs_bs16a1" else f"{v:.2f}" if k in ACTIVATIONS else f"{v:.0f}"
                 for k, v in row.items()]
        lines.append("| " + " | ".join([regime, *cells]) + " |")
    return "\n".join(lines) + "\n"


def format_table(summary: Summary) -> str:
    """The study's table as Markdown, then the fuller one, the paired differences and what is missing."""
    def pct(x: float) -> str:
        return "–" if pd.isna(x) else f"{100 * x:.2f}"

    header = ["norm", *summary.table.columns]
    over = summary.window_note or f"evaluations at step > {summary.design.window_start}"
    lines = [f"{summary.label}: mean valid accuracy (%) over {over}, pooled over seeds", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for norm, row in summary.table.iterrows():
        lines.append("| " + " | ".join([norm, *(pct(v) for v in row)]) + " |")
    lines += ["", "Per cell: mean and std across seeds of each run's windowed mean, seeds, final-step accuracy", "",
              "| norm | regime | " + "".join(f"{k} | " for k in summary.design.per_cell)
              + "mean % | std % | seeds | final % |", "|---|---|---|---|---|---|" + "---|" * len(summary.design.per_cell)]
    for (norm, regime), c in summary.cells.iterrows():
        tuned = "".join(f"{c[k]:.3g} | " for k in summary.design.per_cell)
        lines.append(f"| {norm} | {regime} | {tuned}{pct(c['mean'])} | {pct(c['std'])} | {int(c.seeds)} | "
                     f"{pct(c.final_acc)} |")
    if not summary.paired.empty:
        design = summary.design
        lines += ["", f"Paired (same seed) difference to {design.reference}, percentage points, 95% t-interval; "
                  f"verdict at a margin of ±{design.margin:g} points (equivalent: TOST inside the margin at 5%; "
                  "worse/better: the interval excludes 0; inconclusive: neither, with the seeds that would settle "
                  "it if the spread held)", "",
                  f"| norm | regime | diff | 95% CI | std GA / {design.reference} | pairs | verdict (±{design.margin:g}) |",
                  "|---|---|---|---|---|---|---|"]
        for p in summary.paired.itertuples():
            ci = "n/a" if pd.isna(p.ci_low) else f"[{100 * p.ci_low:+.2f}, {100 * p.ci_high:+.2f}]"
            sds = "n/a" if pd.isna(p.sd_a) else f"{100 * p.sd_a:.2f} / {100 * p.sd_b:.2f}"
            lines.append(f"| {p.norm} | {p.regime} | {100 * p.diff:+.2f} | {ci} | {sds} | {p.pairs} | "
                         f"{verdict_text(p.verdict, p.seeds_needed)} |")
    if not summary.twins.empty:
        margin = summary.design.margin
        lines += ["", "Data-parallel cells against their accumulation twins (b, w*k: the same samples in every step), "
                  "paired (same seed), percentage points, 95% t-interval; normalization batch (b per replica, w*b "
                  f"synchronized) and optimization batch (w*b*k); verdict at ±{margin:g} points", "",
                  f"| norm | regime | twin | norm batch | opt batch | diff | 95% CI | pairs | verdict (±{margin:g}) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for p in summary.twins.itertuples():
            ci = "n/a" if pd.isna(p.ci_low) else f"[{100 * p.ci_low:+.2f}, {100 * p.ci_high:+.2f}]"
            lines.append(f"| {p.norm} | {p.regime} | {p.twin} | {p.norm_batch} | {p.opt_batch} | {100 * p.diff:+.2f} | "
                         f"{ci} | {p.pairs} | {verdict_text(p.verdict, p.seeds_needed)} |")
    if len(summary.ranking) > 1:
        lines += ["", format_ranking(summary.ranking, summary.design)]
    if summary.missing:
        lines += ["", "Missing cells: " + "; ".join(summary.missing)]
    if summary.engines:
        lines += ["", summary.engines]
    return "\n".join(lines) + "\n"


def format_ranking(ranking: pd.DataFrame, design: AnalysisConfig) -> str:
    """The ranking on the ranked regime as Markdown: mean, then each paired difference with its interval."""
    def diff(row: pd.Series, name: str) -> str:
        mean, low, high = row[f"vs {name}"], row[f"vs {name} low"], row[f"vs {name} high"]
        if row[f"vs {name} verdict"] == "baseline":
            return "0 (baseline)"
        if pd.isna(mean):
            return "–"
        return f"{100 * mean:+.2f}" + ("" if pd.isna(low) else f" [{100 * low:+.2f}, {100 * high:+.2f}]")

    def verdict(row: pd.Series, name: str) -> str:
        found = row[f"vs {name} verdict"]
        return "" if found == "baseline" else verdict_text(found, row[f"vs {name} seeds_needed"])

    names, regime = list(design.baselines), design.ranked_regime
    lines = [f"Ranking on {regime}: mean valid accuracy % and its std across seeds, and the paired (same seed) "
             f"difference in points to each baseline with its 95% t-interval and verdict at a margin of "
             f"±{design.margin:g} points", "",
             "| rank | norm | " + regime + " % | std | seeds | "
             + " | ".join(f"vs {n} | verdict (±{design.margin:g})" for n in names) + " |",
             "|" + "---|" * (5 + 2 * len(names))]
    for _, row in ranking.iterrows():
        lines.append(f"| {row['rank']} | {row.norm} | {100 * row['mean']:.2f} | "
                     + ("n/a" if pd.isna(row.sd) else f"{100 * row.sd:.2f}") + f" | {row.seeds} | "
                     + " | ".join(f"{diff(row, n)} | {verdict(row, n)}" for n in names) + " |")
    return "\n".join(lines)


def export(collected: Collected, summary: Summary, out: Path) -> list[Path]:
    """Write tables, figures and the tidy data under `out`; return the files written."""
    return export_tables(collected, summary, out) + export_plots(collected, summary, out)


def export_tables(collected: Collected, summary: Summary, out: Path) -> list[Path]:
    """The tables (table.md first) and the tidy data under `out`: what a reader waits for, in well under a
    second; the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "table.md", out / "table.csv", out / "cells.csv", out / "paired.csv", out / "runs.csv",
               out / "ranking.csv"]
    text = format_table(summary)
    if collected.runs is not None and collected.runs[ACTIVATIONS[0]].notna().any():
        memory = memory_table(collected.runs, summary.design)
        text += "\n" + format_memory(memory)
        memory.to_csv(out / "memory.csv")
        written.append(out / "memory.csv")
    if not collected.excluded.empty:
        text += "\nExcluded runs (not FINISHED): " + "; ".join(
            f"{r.run_name} ({r.status})" for r in collected.excluded.itertuples()) + "\n"
    written[0].write_text(text)
    summary.table.to_csv(written[1])
    summary.cells.to_csv(written[2])
    summary.paired.to_csv(written[3], index=False)
    collected.data.to_csv(written[4], index=False)
    summary.ranking.to_csv(written[5], index=False)
    if not summary.twins.empty:  # data-parallel cells against their accumulation twins
        summary.twins.to_csv(out / "twins.csv", index=False)
        written.append(out / "twins.csv")
    return written


def export_plots(collected: Collected, summary: Summary, out: Path) -> list[Path]:
    """The learning curves of valid_acc and train_loss, PNG and PDF (seconds: the report's slow part)."""
    written = []
    for metric, stem in ((VALID_ACC, "curves"), (TRAIN_LOSS, TRAIN_LOSS)):  # files named curves and after the metric
        fig = plot_curves(collected.data, metric, summary.design)
        for suffix in (".png", ".pdf"):
            fig.savefig(out / f"{stem}{suffix}", dpi=150)
            written.append(out / f"{stem}{suffix}")
        plt.close(fig)
    return written


def report(tracking_uri: str, experiment_name: str, sweep: str = "latest", design: AnalysisConfig | None = None,
           out: Path | None = None, outputs_root: Path = Path("outputs"),
           dataset: str | None = None, model: str | None = None,
           plots: bool = True) -> tuple[Summary, Collected, list[Path]]:
    """collect -> summarize -> export; the default folder is outputs/reports/<sweep>."""
    collected = collect(MlflowClient(tracking_uri), experiment_name, sweep, dataset, model)
    summary = summarize(collected.data, design or AnalysisConfig())
    folder = report_folder(collected, out, outputs_root)
    return summary, collected, (export if plots else export_tables)(collected, summary, folder)


def report_folder(collected: Collected, out: Path | None = None, outputs_root: Path = Path("outputs")) -> Path:
    return out if out is not None else outputs_root / "reports" / (collected.sweep or "unnamed")


def report_each_part(tracking_uri: str, experiment_name: str, sweep: str, design: AnalysisConfig,
                     out: Path) -> list[tuple[dict[str, str], str, Summary | Precisions | AnalysisError, list[Path]]]:
    """A sweep's report per dataset, model and precision it ran (a sweep over data=mnist,fashion_mnist has two,
    one over model=simple,resnet20 too): (the part's dataset, model and precision, its name, summary, files). The
    files are in `out` when there is one part, in `out/<name>` each otherwise, the name joining the values that
    vary (fashion_mnist, resnet20, or fashion_mnist-bf16). A part whose report cannot be made gives its
    AnalysisError in place of the summary, and the others are still made. Where a dataset and model ran several
    precisions, their `Precisions` follow, in `out` (or the folder of that dataset and model)."""
    collected = collect(MlflowClient(tracking_uri), experiment_name, sweep)
    values = {part: values_in(collected, part) for part in PARTS}
    made = []
    for combination in itertools.product(*values.values()):
        wanted = dict(zip(values, combination))
        part = select(collected, **wanted)
        if part.data.empty and part.excluded.empty:
            continue  # e.g. resnet20 ran on mnist only
        name = "-".join(v for p, v in wanted.items() if len(values[p]) > 1)
        try:
            summary = summarize(part.data, design)
        except AnalysisError as e:
            made.append((wanted, name, e, []))
            continue
        made.append((wanted, name, summary, export(part, summary, out / name if name else out)))
    for dataset, model in itertools.product(values[DATASET], values[MODEL]):
        both = select(collected, dataset=dataset, model=model) if len(values[PRECISION]) > 1 else None
        if both is None or both.data[PRECISION].nunique() < 2:
            continue
        wanted = {DATASET: dataset, MODEL: model}
        name = "-".join(v for p, v in wanted.items() if len(values[p]) > 1)
        compared = compare_precisions(both.data, design)
        made.append((wanted, f"{name}-precisions" if name else "precisions", compared,
                     export_precisions(compared, out / name if name else out)))
    return made


def window_note(collected: Collected, window_start: int, chosen: bool) -> str:
    """Where the window of this report is not the one the runs' own command had (the end-of-sweep report's, e.g.
    gaexp-tuned's reruns carry their search's): one line saying both, so the two tables' numbers are explained."""
    launched = sorted({int(w) for w in collected.runs[LAUNCH_WINDOW].dropna()}) if collected.runs is not None else []
    if chosen or not launched or launched == [window_start]:
        return ""
    return (f"note: this report averages evaluations at step > {window_start} (the study's analysis.window_start); "
            f"the runs' own command had {', '.join(map(str, launched))}, which their sweep's report used: "
            f"--window-start {launched[0]} gives that table")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gaexp-report", description=(
        "Rebuild the comparison table and learning curves of a gaexp sweep from MLflow."))
    cli.add_store_arguments(parser, sweep="latest", sweep_help="'latest' (the sweep of the newest run), 'all', a "
                                                               "sweep id, or several comma-separated")
    parser.add_argument("--dataset", default=None,
                        help="the runs of this dataset only (data.dataset: mnist, cifar10, your folder's name, ...); needed when the "
                             "sweep ran several (default: all, which must be one)")
    parser.add_argument("--model", default=None,
                        help="the runs of this model only (model.name: simple, resnet20, ...); needed when the "
                             "sweep ran several (default: all, which must be one)")
    parser.add_argument("--precision", default=None,
                        help="the runs of this precision only (precision.name: fp32, bf16, fp16, bf16w, bf16w-acc32); "
                             "default: all, each precision's own table, then the precisions side by side")
    parser.add_argument("--study", default="spec",
                        help="the report's design: the `analysis` node of conf/experiment/STUDY.yaml, or of a "
                             "YAML file given by path (default: %(default)s)")
    parser.add_argument("--window-start", type=int, default=None,
                        help="average evaluations at step > this (default: the study's, 250; 2499 for the tail)")
    parser.add_argument("--margin", type=float, default=None,
                        help="equivalence margin in accuracy points for the verdicts (default: the study's, 0.5)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: outputs/reports/<sweep>)")
    parser.add_argument("--no-plots", dest="plots", action="store_false",
                        help="the tables only, without the learning curves (PNG, PDF: seconds more)")
    args = parser.parse_args(argv)
    cli.require_store(args.tracking_uri)
    try:
        design = load_study(args.study)
        if args.window_start is not None:
            design = dataclasses.replace(design, window_start=args.window_start)
        if args.margin is not None:
            design = dataclasses.replace(design, margin=args.margin)
        with cli.store_errors(args.tracking_uri):
            collected = collect(MlflowClient(args.tracking_uri), args.experiment, args.sweep, args.dataset,
                                args.model, args.precision)
            folder = report_folder(collected, args.out)
            parts = [(p, select(collected, precision=p)) for p in values_in(collected, PRECISION)]
            if len(parts) > 1 and collected.data[DATASET].nunique() == collected.data[MODEL].nunique() == 1:
                made = [(p, part, summarize(part.data, design), folder / p) for p, part in parts]  # each, then all
                compared = compare_precisions(collected.data, design)
            else:
                made, compared = [(None, collected, summarize(collected.data, design), folder)], None
    except (AnalysisError, ValueError) as e:
        sys.exit(f"error: {e}")
    note = window_note(collected, design.window_start, args.window_start is not None)
    if note:
        print(note)
    models = values_in(collected, MODEL)
    shown_model = "" if models == [ADDED_DEFAULTS["model.name"]] else f"model: {', '.join(models)}  "
    print(f"sweep: {collected.sweep}  dataset: {', '.join(datasets_in(collected))}  {shown_model}"
          f"runs: {collected.data.run_id.nunique()} finished, "
          f"{len(collected.excluded)} excluded")
    written = []
    for _, part, summary, out in made:  # each precision's table is titled with it: mnist, bf16
        files = export_tables(part, summary, out)
        print(files[0].read_text(), flush=True)
        written += files  # the tables first: the plots take seconds more
    if compared is not None:
        written += export_precisions(compared, folder)
        print(format_precisions(compared), flush=True)
    if args.plots:
        for _, part, summary, out in made:
            written += export_plots(part, summary, out)
    print("written: " + ", ".join(str(p) for p in written))


if __name__ == "__main__":
    main()
