"""A cell whose process ended without a result (a SLURM task cancelled, a joblib worker killed), counted as a
failed cell as one that raised is (gaexp.app.sweep_cell): FAILED.txt with the reason in its job folder, which the
failure summary lists (gaexp.callbacks.FailuresCallback), and nan as its return value, status COMPLETED."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import List, Sequence

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.types import HydraContext
from omegaconf import DictConfig

log = logging.getLogger(__name__)


def failed_cell(config: DictConfig, hydra_context: HydraContext, overrides: Sequence[str], reason: str) -> JobReturn:
    """The cell's FAILED.txt (in the folder its job would have used, made if the job never started) and nan."""
    from gaexp.config import FAILED_MARKER

    cfg = hydra_context.config_loader.load_sweep_config(config, list(overrides))
    folder = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / FAILED_MARKER).write_text(reason)
    log.error("%s: %s, without a result; counted as a failed cell", " ".join(filter_overrides(overrides)), reason)
    return JobReturn(overrides=list(overrides), working_dir=str(folder), task_name=cfg.hydra.job.name,
                     status=JobStatus.COMPLETED, _return_value=float("nan"))


def fail_runs_of(config: DictConfig, pid: int, reason: str) -> List[str]:
    """The runs the dead process `pid` (a joblib worker, a local task) left RUNNING in the sweep's store, ended
    FAILED with `reason` as their error (gaexp.tracking.fail_runs_of); their names."""
    from mlflow.tracking import MlflowClient

    from gaexp import tracking

    client = MlflowClient(config.mlflow.tracking_uri)
    return tracking.fail_runs_of(client, tracking.experiment_id(client, config.mlflow.experiment_name), pid, reason)
