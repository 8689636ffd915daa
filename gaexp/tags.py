"""The tags gaexp writes on MLflow runs, declared once, as MLflow keeps its own in mlflow/utils/mlflow_tags.py:
each tag's name, the roles of the runs that are not cells, and the builders of a cell's, a plan's and a report's
tags. The cell, the grid sweeper, the replicas and storegen write through it; the report, progress, the
breakdown, the ETA replay, tuning and compare read through it. `filter_equals` writes a search filter on a tag.
tests/test_tags.py fails on a tag or a metric spelled as a literal outside this module and gaexp/metrics.py.
Metrics are declared in gaexp/metrics.py; params are the config's own keys (gaexp/config/schema.py).
"""

from __future__ import annotations

# What a cell is: the report groups and pairs runs by these (a run recorded before a tag lacks it:
# config.ADDED_DEFAULTS says what it implicitly had).
DATASET, MODEL, NORM, REGIME, SEED = "dataset", "model", "norm", "regime", "seed"
BATCH_SIZE, NUM_ACCUM, REPLICAS = "batch_size", "num_accum", "replicas"  # the regime's b, k and w
ACCUMULATE = "accumulate"  # the engine the run used (accumulate=auto resolved: loop or batched)
ACCUMULATE_SETTING = "accumulate_setting"  # what was asked (auto, loop, batched)
ACCUMULATE_FALLBACK = "accumulate_fallback"  # why auto fell back to the loop (present only then)
PRECISION = "precision"  # precision.name
PROTOCOL_KEY = "protocol_key"  # the digest of the config's result-changing keys: a FINISHED run with it is skipped
# The digest of the steps its engine computed (gaexp/engine.py arithmetic_key), on a run whose steps another cell
# computes too (accumulate=auto, batched, no coupled layer: bs1a16 and bs4a4 are bs16a1's pass)
ARITHMETIC_KEY = "gaexp.arithmetic_key"
SAME_AS = "gaexp.same_as"  # the run whose computation a shared run records (its histories and results, none of its times)
# How it ran: the machine's side, never a result.
DEVICE, THREADS = "device", "threads"  # the device type, torch's intra-op threads
CPU = "gaexp.cpu"  # the CPU's model and the instruction set torch's kernels use on it (machine.cpu_kind): bit for bit
# on the same kind and threads
COMPILED = "compiled"  # the phases compile=auto compiled ("train,eval") or "off"
SWEEP_ID = "sweep_id"  # the sweep that ran it (a single run's own timestamp id)
SWEEPS = "gaexp.sweeps"  # comma-separated: the sweep that ran a run, then every sweep that resumed over it
SINGLE_RUN = "gaexp.single_run"  # "true": a run of `gaexp` without -m (the report's latest sweep passes it by)
HOST = "gaexp.host"  # host:pid of the process that runs it
HEARTBEAT = "gaexp.heartbeat"  # epoch seconds of that process's last beat
PROCESS_START = "gaexp.process_start"  # with the pid in HOST: the one process that ran the run (liveness)
CELL_START = "gaexp.cell_start"  # epoch seconds its cell began (run_cell): its checks, data and model before the run
SLURM_JOB = "slurm_job_id"  # the SLURM job a run ran in (array tasks: JOB_TASK, what scancel and sacct take)
CURVES = "gaexp.curves"  # how many parts `gaexp.curves.<i>` hold the run's evaluations as JSON (tracking.curves_tags)
# How it ended, when not FINISHED.
ERROR, ERROR_TRACEBACK = "error", "error.traceback"  # the exception, one line; its traceback (masked, cut)
DIVERGED_STEP = "diverged_step"  # the step whose loss was not finite
STOPPED_STEP, STOPPED_REASON = "gaexp.stopped_step", "gaexp.stopped_reason"  # a pruned trial, a sweep gone
KILLED_REASON = "gaexp.killed_reason"  # why a stale run was marked KILLED (its process or job is gone)
# An Optuna trial's run, and its study's parent run.
OPTUNA_STUDY, OPTUNA_TRIAL, OPTUNA_REPEAT = "optuna.study", "optuna.trial", "optuna.repeat"
OPTUNA_STATE, OPTUNA_STATES = "optuna.state", "optuna.states"  # a trial's state; a study's count by state
OPTUNA_STORAGE = "optuna.storage"  # the study's storage, its password masked
OBJECTIVE = "objective"  # the value a study's trials returned, in words
BEST = "best."  # prefix: the best trial's params on its study's parent run
PARENT_RUN = "mlflow.parentRunId"  # MLflow's own: nests a trial's runs under their study's
# The runs that are no cell: `ROLE` says which.
ROLE = "gaexp.role"
PLAN_ROLE = "sweep"  # the run `sweep-<id>` that records a grid sweep's plan (gaexp.progress)
REPORT_ROLE = "report"  # the run `report-<id>` that holds a sweep's report
STUDY_ROLE = "study"  # an Optuna study's parent run
TRIAL_ROLE = "trial"  # a trial's run when the trial has repeats (their runs its children)
ROLES = (PLAN_ROLE, REPORT_ROLE, STUDY_ROLE, TRIAL_ROLE)
# A plan run's (the grid sweeper's, before its first cell).
CELLS, EXPECTED_S, CELLS_AT_ONCE, GRAPHS = "gaexp.cells", "gaexp.expected_s", "gaexp.cells_at_once", "gaexp.graphs"
COSTS = "gaexp.costs"  # "expected:graphs" of each cell in launch order (left out past progress.MAX_COSTS)
ORDER = "gaexp.order"  # the sweeper's order: longest_first or given
# An experiment's (not a run's): MLflow 3's UI opens an experiment of this kind on its runs table, not on the GenAI
# overview (traces).
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def filter_equals(tag: str, value: object) -> str:
    """A search filter clause: the tag has this value (backquoted: names with dots)."""
    return f"tags.`{tag}` = '{value}'"


def filter_present(tag: str) -> str:
    """A search filter clause: the run has this tag."""
    return f"tags.`{tag}` != ''"


def is_training_run(tags: dict[str, str]) -> bool:
    """The tags of a run that trained a cell or a trial: not a plan, report, study or trial-parent run."""
    return NORM in tags and tags.get(ROLE) != REPORT_ROLE


def cell_tags(*, dataset: str, model: str, norm: str, regime: str, seed: int, batch_size: int, num_accum: int,
              replicas: int, accumulate: str, precision: str, setting: str, sweep_id: str, protocol_key: str,
              device: str, threads: int, compiled: str, **more: object) -> dict[str, str]:
    """A cell's run's tags, as strings: what it is, the sweep that ran it (also its first of SWEEPS) and how it ran;
    `more`: tags some runs have (SINGLE_RUN, CELL_START, ACCUMULATE_FALLBACK, a trial's)."""
    tags = {DATASET: dataset, MODEL: model, NORM: norm, REGIME: regime, SEED: seed, BATCH_SIZE: batch_size,
            NUM_ACCUM: num_accum, REPLICAS: replicas, ACCUMULATE: accumulate, PRECISION: precision,
            ACCUMULATE_SETTING: setting, SWEEP_ID: sweep_id, SWEEPS: sweep_id, PROTOCOL_KEY: protocol_key,
            DEVICE: device, THREADS: threads, COMPILED: compiled, **more}
    return {name: str(value) for name, value in tags.items()}


def plan_tags(*, sweep_id: str, cells: int, expected_s: float, cells_at_once: int | None, graphs: float,
              costs: str | None, order: str) -> dict[str, str]:
    """A grid sweep's plan run's tags: its cells, their expected seconds and graphs, how many run at once."""
    return {ROLE: PLAN_ROLE, SWEEP_ID: sweep_id, CELLS: str(cells), EXPECTED_S: f"{expected_s:.3f}",
            CELLS_AT_ONCE: "" if cells_at_once is None else str(cells_at_once), GRAPHS: str(graphs),
            COSTS: costs or "", ORDER: order}


def report_tags(sweep_id: str, part: dict[str, str]) -> dict[str, str]:
    """A report run's tags: its sweep and the part of it the report covers (dataset, model, precision)."""
    return {ROLE: REPORT_ROLE, SWEEP_ID: sweep_id, **part}


def trial_tags(study: str | None, trial: int | None, repeat: int, repeats: int) -> dict[str, str]:
    """A trial's run's tags (none for a run that is no trial): its study and number, its repeat when it has several."""
    if study is None:
        return {}
    return {OPTUNA_STUDY: study, OPTUNA_TRIAL: str(trial), **({OPTUNA_REPEAT: str(repeat)} if repeats > 1 else {})}


def in_sweep(tags: dict[str, str]) -> str:
    """The id of the sweep that ran a run ("" for one recorded without)."""
    return tags.get(SWEEP_ID, "")
