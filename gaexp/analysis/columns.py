"""The report's data: the tidy frame's columns (one row per run and evaluation; a protocol column per result-changing
key), a collected sweep (`Collected`), the study's design read from its file, and the one error of the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import pandas as pd
from omegaconf import OmegaConf

from gaexp import metrics
from gaexp.config import AnalysisConfig, CONFIG_DIR, PROTOCOL_COLUMNS
from gaexp.norms import ORDER as DECLARED_ORDER
from gaexp.task import headline_of
from gaexp.tags import BATCH_SIZE, DATASET, MODEL, NORM, NUM_ACCUM, PRECISION, REGIME, SEED, SWEEP_ID


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
SHARED = "shared"  # the run records the steps another run computed (tag gaexp.same_as): its results, none of its times


RUN_METRICS = list(metrics.RESOURCES)  # what each run cost (batched_*: accumulate=batched)


MEMORY_COLUMNS = [(metrics.ACTIVATION_MB, "mean"), (metrics.SAMPLES_PER_SEC, "mean"), (metrics.TOKENS_PER_SEC, "mean"),
                  (metrics.WALL_SECONDS, "mean"),
                  (metrics.PEAK_RSS_MB, "max"), (metrics.CUDA_MAX_MEM_MB, "max"), (metrics.BATCHED_ACTIVATION_MB, "mean"),
                  (metrics.BATCHED_PEAK_RSS_MB, "max"), (metrics.BATCHED_CUDA_MAX_MEM_MB, "max")]  # the memory table's


ACTIVATIONS = (metrics.ACTIVATION_MB.name, metrics.BATCHED_ACTIVATION_MB.name)  # its columns in MiB to 2 decimals


TASK = column("task.name")  # the protocol column of the runs' task (gaexp/task/): its headline is the report's metric


def row_keys(design: AnalysisConfig) -> list[str]:
    """The keys whose values make the report's rows (`analysis.rows`: one, or two joined by +)."""
    return design.rows.split("+")


def as_rows(data: pd.DataFrame, design: AnalysisConfig) -> pd.DataFrame:
    """`data` with its NORM column holding the report's rows: the norm, or the values of `analysis.rows`
    (task.loss: the language-model study's loss normalizations; norm+task.negatives: the contrastive study's
    bn-step, bn-micro, ...)."""
    if design.rows == NORM:
        return data
    values = [data[column(key)].astype(str) for key in row_keys(design)]
    return data.assign(**{NORM: values[0] if len(values) == 1 else values[0] + "-" + values[1]})


def rows_label(design: AnalysisConfig) -> str:
    """The rows' column header: norm, loss, or norm-negatives."""
    return "-".join(column(key) for key in row_keys(design))


def headline(data: pd.DataFrame) -> metrics.Headline:
    """The headline of the runs' one task (image classification's accuracy; a language model's loss per token):
    the metric the report's tables show, with its direction, scale and unit."""
    tasks = sorted(set(data[TASK].astype(str))) if TASK in data and len(data) else []
    if len(tasks) > 1:
        raise AnalysisError(f"runs of {len(tasks)} tasks ({', '.join(tasks)}) never pool; choose one sweep with --sweep")
    return headline_of(tasks[0]) if tasks else metrics.ACCURACY


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


def in_order(values: Sequence[str], preferred: Sequence[str]) -> list[str]:
    present = list(dict.fromkeys(values))
    return [v for v in preferred if v in present] + sorted(v for v in present if v not in preferred)


def number_or_nan(value: str) -> float | str:
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
