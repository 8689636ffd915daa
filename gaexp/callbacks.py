"""Hydra's callbacks around a command (conf/config.yaml names them): the store and data made ready before any
job, and when a multirun ends the sweep's report, its Optuna studies in MLflow, and the exit naming failed cells.

They run in the launching process; Hydra also carries them to each job, so the analysis and the study reports
(matplotlib, scipy, Optuna) are imported only where a multirun ends, and torch and MLflow only once the input is
known to be good: a range error (seed=-1) is refused without them.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra_plugins.gaexp_optuna_sweeper.config import RESULTS
from omegaconf import DictConfig, OmegaConf, read_write

from gaexp import faults, liveness, redact
from gaexp.config import CONFIG_DIR, FAILED_MARKER, AnalysisConfig, Config, job_config, typed
from gaexp.machine import torchrun_rank
from gaexp.tags import SAME_AS, is_training_run, report_tags

log = logging.getLogger("gaexp.app")  # the application's log, one name across its modules, as before the split


def is_search(cfg: DictConfig) -> bool:
    """Whether this command's sweeper is gaexp's Optuna sweeper (only a callback's config has `hydra`)."""
    return "gaexp_optuna" in str(OmegaConf.select(cfg, "hydra.sweeper._target_", default=""))


def prepare(cfg: DictConfig) -> str:
    """Check the input (each value of a swept axis too, and gaexp's sweeper's settings), then data and MLflow
    store; returns the experiment id. Writes nothing on bad input."""
    from hydra.utils import instantiate

    from gaexp.config import swept_cells

    cells = swept_cells(cfg)  # Hydra gives a callback the swept keys at their defaults
    validate_cells(cfg, cells, typed_before_torch)[0]  # types and ranges first: refused before torch and MLflow load
    from mlflow.tracking import MlflowClient

    from gaexp import tracking, trial
    from gaexp.data.dataset import fetch, open_dataset, splits, validate_split
    from gaexp.cell import validated  # the model against the data, the memory: torch

    c, *swept = validate_cells(cfg, cells, validated)
    if str(OmegaConf.select(cfg, "hydra.sweeper._target_", default="")).startswith("hydra_plugins.gaexp_"):
        try:  # its settings, checked as Hydra makes it (after this callback)
            instantiate(cfg.hydra.sweeper)
        except Exception as e:  # noqa: BLE001 - Hydra wraps the constructor's one line in its own lines
            raise ValueError(str(e.__cause__ or e).splitlines()[0]) from None
    if is_search(cfg):  # before any trial
        trial.require_objective(c.train.num_iterations, c.analysis)
        trial.check_direction(cfg.hydra.sweeper.direction, c.task.name)
    tracking.check_server(c.mlflow.tracking_uri)
    fetch(c.data)  # files and their MD5s, a download: ready before any job
    train, _ = splits(open_dataset(c.data), c.data.holdout)  # checked whole before anything is made
    for cell in swept or [c]:  # each cell's batch against the samples it is drawn from, whatever the kind (the
        validate_split(cell, len(train), cfg.accumulate)  # command's own config has the swept keys at their defaults)
    experiment_id = tracking.prepare_store(c.mlflow.tracking_uri, c.mlflow.experiment_name, c.mlflow.artifact_location)
    client = MlflowClient(c.mlflow.tracking_uri)
    for run in tracking.mark_stale_runs(client, experiment_id, c.mlflow.stale_after_s):
        log.warning("marked KILLED: %s", run)
    return experiment_id


def typed_before_torch(cfg: DictConfig) -> Config:
    """`typed` on a job's config but for device_type=${gaexp.device_type:auto}, whose resolver asks torch (seconds
    to import) whether it sees a GPU: `validate` resolves and checks that one after."""
    job = copy.deepcopy(job_config(cfg))
    if OmegaConf.is_interpolation(job, "device_type"):
        with read_write(job):
            job.device_type = "cpu"
    return typed(job)


def validate_cells(cfg: DictConfig, cells: list, validate: Callable[[DictConfig], Config]) -> list[Config]:
    """`validate` on the command's first cell, then on each of `cells` (named as the grid sweeper names a bad
    cell); returns the validated configs, the first cell's first."""
    found = [validate(job_config(cfg))]
    for name, cell in cells:
        try:
            found.append(validate(job_config(cell)))
        except Exception as e:  # noqa: BLE001 - every kind of bad input of a cell is named the same way
            raise ValueError(f"cell {' '.join(name)}: {e}") from None
    return found


class PrepareCallback(Callback):
    """Runs in the launching process, once per command, so jobs find a ready store and data.

    Bad input stops the whole command here with one line: Hydra turns a
    callback's exceptions into warnings, but lets SystemExit through.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if torchrun_rank():  # a replica torchrun started beside rank 0, which prepares; it records nothing
            return
        self.on_multirun_start(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        HydraConfig.instance().set_config(config)  # as in a job: ${hydra:...} (conf/launch/) resolves
        redact.mask_logs()  # a storage URL's password never reaches the terminal or the sweep's log
        redact.mask_terminal()
        # a password typed on the command line or in a study file: the files Hydra and the jobs write are the owner's
        redact.private_files(" ".join(sys.argv), OmegaConf.to_yaml(config))
        os.environ[liveness.SWEEP_PROCESS] = liveness.this_process()  # the workers it starts stop when it is gone
        quiet_libraries(is_search(config), Path(config.paths.outputs))
        try:
            prepare(config)
        except Exception as e:  # noqa: BLE001 - every kind of bad input ends the command the same way
            said = faults.storage_fault(e, config.mlflow.tracking_uri, config.paths.outputs) or e  # a full disk too
            raise SystemExit(redact.mask(f"error: {said}")) from None
        for warning in launcher_warnings(config):
            log.warning(warning)


# What libraries print that nobody acts on: INFO lines (MLflow making a new store's tables, alembic's migration
# steps, matplotlib building its font cache), the launchers' lines (joblib's Parallel(...) settings; a search's
# jobs, one line of overrides and storage each per batch), a warning printed after Ctrl-C (the semaphores its
# resource tracker then cleans up). Warnings and errors of the same loggers still show.
QUIET_LOGGERS = ("alembic", "matplotlib.font_manager")
LAUNCHER_LOGGERS = ("hydra._internal.core_plugins.basic_launcher", "hydra_plugins.hydra_joblib_launcher._core",
                    "hydra_plugins.hydra_submitit_launcher.submitit_launcher", "hydra_plugins.hydra_ray_launcher._core",
                    "hydra_plugins.gaexp_grid_sweeper.submitit_launcher",
                    "hydra_plugins.gaexp_grid_sweeper.joblib_launcher")
PARALLEL_LINE, JOB_LINE = r"Joblib\.Parallel\(", r"\t#\d+ : "  # hydra_joblib_launcher's, every launcher's
QUIET_WARNINGS = "ignore:resource_tracker:UserWarning"  # a PYTHONWARNINGS entry, for the processes it starts


class Unprinted(logging.Filter):
    """Drops the records whose message starts with `pattern` (a regular expression)."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def quiet_libraries(search: bool, outputs: Path) -> None:
    """Before anything runs: the lines above (a search's job lines too) unprinted, in this process and the ones
    it starts; matplotlib's folders under `outputs` when its own are not writable (a read-only HOME), where it
    would otherwise rebuild its font cache in a new temporary folder in every process and say so."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    faults.quiet_storage_noise()  # MLflow's store logger: its errors repeat the exception it raises next
    pattern = f"{PARALLEL_LINE}|{JOB_LINE}" if search else PARALLEL_LINE
    for name in LAUNCHER_LOGGERS:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, Unprinted)]:  # a second command in this process
            logger.removeFilter(old)
        logger.addFilter(Unprinted(pattern))
    given = os.environ.get("PYTHONWARNINGS", "")
    if QUIET_WARNINGS not in given.split(","):
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [given, QUIET_WARNINGS]))
    if "MPLCONFIGDIR" not in os.environ and not all(writable(d) for d in matplotlib_dirs()):
        (outputs / ".matplotlib").mkdir(parents=True, exist_ok=True)
        os.environ["MPLCONFIGDIR"] = str(outputs / ".matplotlib")


def matplotlib_dirs() -> list[Path]:
    """The config and cache folders matplotlib uses without MPLCONFIGDIR (XDG's, else under HOME)."""
    home = Path.home()
    return [Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") / "matplotlib",
            Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache") / "matplotlib"]


def writable(folder: Path) -> bool:
    """Whether `folder` is, or can be made, a folder this process writes in (as matplotlib asks), made nowhere."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder.is_dir() and os.access(folder, os.W_OK)


def launcher_warnings(config: DictConfig) -> list[str]:
    """What the launch config leaves unsaid or gets wrong, and that works but hurts: a launcher no launch config
    describes (how many cells it runs at once, so threads=auto gives each cell torch's default: every core),
    and SQLite written by cells on other hosts."""
    warnings = []
    launcher = OmegaConf.select(config, "hydra.runtime.choices.hydra/launcher", default="basic")
    if config.cells_at_once is None and launcher != "basic":  # basic: one cell after another, in this process
        presets = ", ".join(sorted(p.stem for p in (Path(CONFIG_DIR) / "launch").glob("*.yaml")))
        warnings.append(f"hydra/launcher={launcher}: no launch config says how many cells it runs at once, so "
                        f"each cell uses every core (threads=auto); use launch=<{presets}> (conf/launch/), or set "
                        "cells_at_once=N (and hydra.sweeper.max_batch_size=N for a launcher that starts them all)")
    if config.cells_elsewhere and config.mlflow.tracking_uri.startswith("sqlite:"):
        warnings.append(f"cluster jobs writing to {config.mlflow.tracking_uri}: SQLite on a shared file system "
                        "locks and can corrupt; start an MLflow server and set mlflow.tracking_uri=http://HOST:PORT "
                        "(docs/cluster.md)")
    return warnings


class FailuresCallback(Callback):
    """Last thing a multirun does: exit non-zero naming the failed cells, if any.

    Listed first in conf/config.yaml because Hydra runs end-callbacks in reverse order.
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        failures = sorted(Path(config.hydra.sweep.dir).glob(f"*/{FAILED_MARKER}"))
        if failures:
            lines = [redact.mask(f"  {p.parent.name}: {p.read_text().strip()}") for p in failures]
            raise SystemExit(f"error: {len(failures)} cell(s) failed, the others ran:\n" + "\n".join(lines))


class ReportCallback(Callback):
    """When a multirun ends: the analysis report of this sweep (design: the `analysis` node), as files
    and as an MLflow run."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if (Path(config.hydra.sweep.dir) / RESULTS).is_file():
            return  # a tuning sweep: its trials are no grid (StudiesCallback reports it)
        try:
            self.report(config)
        except Exception as e:  # a full disk: one line, not Hydra's warning of MLflow's error with its SQL
            fault = faults.storage_fault(e, config.mlflow.tracking_uri, config.paths.outputs)
            if fault is None:
                raise
            sweep_id = Path(config.hydra.sweep.dir).name
            design: AnalysisConfig = OmegaConf.to_object(config.analysis)
            log.warning("no report for sweep %s: %s; %s, then: %s", sweep_id, fault.cause, fault.todo,
                        report_command(sweep_id, design, config))

    def report(self, config: DictConfig) -> None:
        from mlflow.tracking import MlflowClient

        from gaexp import analysis, progress, tracking  # pandas, scipy, matplotlib: here, where the multirun ends

        sweep_id = Path(config.hydra.sweep.dir).name
        out = Path(config.paths.outputs) / "reports" / sweep_id
        design: AnalysisConfig = OmegaConf.to_object(config.analysis)
        try:
            made = analysis.report_each_part(config.mlflow.tracking_uri, config.mlflow.experiment_name, sweep_id,
                                             design, out)
        except analysis.AnalysisError as e:
            log.warning("no report for sweep %s: %s (rerun: %s)", sweep_id, e, report_command(sweep_id, design, config))
            return
        client = MlflowClient(config.mlflow.tracking_uri)
        experiment_id = tracking.experiment_id(client, config.mlflow.experiment_name)
        for part, label, summary, written in made:
            name = f"report-{sweep_id}" + (f"-{label}" if label else "")
            if isinstance(summary, analysis.AnalysisError):
                log.warning("no report for sweep %s on %s: %s (rerun: %s)", sweep_id, ", ".join(part.values()), summary,
                            report_command(sweep_id, design, config, part))
                continue
            with tracking.tracked_run(client, experiment_id, name, report_tags(sweep_id, part)) as run_id:
                tracking.log_params(client, run_id, {"analysis": dataclasses.asdict(design)})  # margin, window...
                for path in written:
                    client.log_artifact(run_id, str(path))
            log.info("report of sweep %s in %s and MLflow run %s\n%s", sweep_id, written[0].parent, name,
                     analysis.format_precisions(summary) if isinstance(summary, analysis.Precisions)
                     else analysis.format_table(summary))
        cells = [r for r in tracking.runs_in_sweep(client, [experiment_id], sweep_id) if is_training_run(r.data.tags)]
        if shared := sum(SAME_AS in r.data.tags for r in cells):
            log.info("%s", progress.shared_line(shared, len(cells)))


def report_command(sweep_id: str, design: AnalysisConfig, config: DictConfig, part: dict | None = None) -> str:
    """The gaexp-report command that rebuilds this sweep's report as the sweep made it: its store, experiment,
    part and the design keys the command takes where they differ from its default study's."""
    from gaexp import analysis

    words = ["gaexp-report", "--tracking-uri", config.mlflow.tracking_uri, "--experiment", config.mlflow.experiment_name,
             "--sweep", sweep_id, *(w for k, v in (part or {}).items() for w in (f"--{k}", v))]
    default = analysis.load_study("spec")
    words += [w for name in ("window_start", "margin") if getattr(design, name) != getattr(default, name)
              for w in (f"--{name.replace('_', '-')}", f"{getattr(design, name):g}")]
    words += [] if design.plots else ["--no-plots"]
    return " ".join(shlex.quote(str(w)) for w in words)


class StudiesCallback(Callback):
    """When a gaexp_optuna sweep ends: a parent run per study with the best trial and Optuna's plots,
    its trials' runs nested under it."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        results = Path(config.hydra.sweep.dir) / RESULTS
        if not results.is_file():
            return  # not a tuning sweep
        from mlflow.tracking import MlflowClient

        from gaexp import tracking, tuning  # Optuna and its plots: only where a search ends

        client = MlflowClient(config.mlflow.tracking_uri)
        experiment_id = tracking.experiment_id(client, config.mlflow.experiment_name)
        storage = OmegaConf.select(config, "hydra.sweeper.storage")  # the results file has it masked
        for name in tuning.report_studies(client, experiment_id, results, OmegaConf.to_object(config.analysis),
                                          storage, OmegaConf.select(config, "task.name", default="classify")):
            log.info("study %s: parent run study-%s", name, name)
