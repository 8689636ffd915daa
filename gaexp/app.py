"""The Hydra application: one grid cell per job, tracked as one MLflow run."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.experimental.callback import Callback
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from gaexp import analysis, tracking
from gaexp.config import regime_name
from gaexp.data import NUM_TRAIN, ensure_mnist, load_split, to_input
from gaexp.memory import activation_bytes, peak_rss_bytes, reset_peak_rss
from gaexp.model import SimpleModel
from gaexp.train import resolve_device, train

log = logging.getLogger(__name__)
CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "conf")  # the repository's conf/ (editable install)


def prepare(cfg: DictConfig) -> str:
    """Data and MLflow store, once, before any job runs; returns the experiment id."""
    ensure_mnist(cfg.data.root, cfg.data.sources)
    return tracking.prepare_store(cfg.mlflow.tracking_uri, cfg.mlflow.experiment_name,
                                  cfg.mlflow.artifact_location)


class PrepareCallback(Callback):
    """Runs in the launching process, so parallel jobs find a ready store and data."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        prepare(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        prepare(config)


class ReportCallback(Callback):
    """When a multirun ends: the analysis report of this sweep, as files and as an MLflow run."""

    def __init__(self, window_start: int = 250) -> None:
        self.window_start = window_start

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_id = Path(config.hydra.sweep.dir).name
        out = Path(config.paths.outputs) / "reports" / sweep_id
        try:
            summary, collected, written = analysis.report(
                config.mlflow.tracking_uri, config.mlflow.experiment_name, sweep_id, self.window_start, out)
        except analysis.AnalysisError as e:
            log.warning("no report for sweep %s: %s (rerun: python -m gaexp.analysis --sweep %s)", sweep_id, e, sweep_id)
            return
        client = MlflowClient(config.mlflow.tracking_uri)
        experiment_id = client.get_experiment_by_name(config.mlflow.experiment_name).experiment_id
        tags = {"gaexp.role": analysis.REPORT_ROLE, "sweep_id": sweep_id}
        with tracking.tracked_run(client, experiment_id, f"report-{sweep_id}", tags) as run_id:
            for path in written:
                client.log_artifact(run_id, str(path))
        log.info("report of sweep %s in %s and MLflow run report-%s\n%s", sweep_id, out, sweep_id,
                 analysis.format_table(summary))


def threads_for(setting: int | str, n_jobs: int | None, cores: int | None = None) -> int:
    """torch threads per run: `auto` makes jobs x threads = cores (0 keeps torch's default)."""
    if setting != "auto":
        if not isinstance(setting, int) or setting < 0:
            raise ValueError(f"threads={setting!r}; valid: auto or an integer >= 0")
        return setting
    if not n_jobs:
        return 0  # one cell at a time: torch's default uses every core
    cores = cores or os.cpu_count() or 1
    jobs = n_jobs if n_jobs > 0 else max(1, cores + 1 + n_jobs)  # joblib: -1 = all cores, -2 = all but one
    return max(1, cores // jobs)


def run_cell(cfg: DictConfig, sweep_id: str, hydra_dir: Path | None = None, n_jobs: int | None = None) -> float:
    """Train one cell of the grid and track it; returns the final valid accuracy."""
    device = resolve_device(cfg.device)
    threads = threads_for(cfg.threads, n_jobs)
    if threads:
        torch.set_num_threads(threads)
    b, k, seed = cfg.regime.batch_size, cfg.regime.num_accum, cfg.seed
    regime = regime_name(b, k)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    experiment_id = prepare(cfg)
    train_data = load_split(cfg.data.root, train=True, device=device)
    valid_data = load_split(cfg.data.root, train=False, device=device)
    assert len(train_data.labels) == NUM_TRAIN

    tags = {"norm": cfg.norm.name, "regime": regime, "seed": seed, "batch_size": b,
            "num_accum": k, "sweep_id": sweep_id, "device": device.type, "threads": torch.get_num_threads()}
    name = f"{cfg.norm.name}-{regime}-s{seed}"
    with tracking.tracked_run(client, experiment_id, name, tags) as run_id:
        resolved = OmegaConf.to_container(cfg, resolve=True)
        tracking.log_params(client, run_id, resolved)
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
            client.log_artifact(run_id, str(Path(tmp) / "config.yaml"))
        if hydra_dir is not None and hydra_dir.is_dir():
            client.log_artifacts(run_id, str(hydra_dir), "hydra")

        torch.manual_seed(seed)  # model initialization; the data order has its own generator
        model = SimpleModel(cfg.norm.name).to(device, memory_format=torch.channels_last)
        act_bytes = activation_bytes(model, to_input(train_data.images[:b]), train_data.labels[:b])
        reset_peak_rss()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        tic = time.perf_counter()
        history = train(
            torch.compile(model) if cfg.compile else model, train_data, valid_data, batch_size=b, num_accum=k, seed=seed,
            num_iterations=cfg.train.num_iterations, eval_period=cfg.train.eval_period,
            lr=cfg.train.lr, loss_window=cfg.train.loss_window,
            eval_batch_size=cfg.train.eval_batch_size,
            on_eval=lambda point: tracking.log_eval_point(client, run_id, point),
            progress=cfg.progress, desc=name,
        )
        memory = {"activation_mb": act_bytes / 2**20, "peak_rss_mb": peak_rss_bytes() / 2**20}
        if device.type == "cuda":
            memory["cuda_max_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        tracking.log_summary(client, run_id, history, time.perf_counter() - tic, memory)
    log.info("%s: final valid_acc %.4f (run %s)", name, history[-1].valid_acc, run_id)
    return history[-1].valid_acc


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    sweep_dir = hc.sweep.dir if hc.mode == RunMode.MULTIRUN else hc.run.dir
    n_jobs = hc.launcher.get("n_jobs") if hc.mode == RunMode.MULTIRUN else None
    return run_cell(cfg, sweep_id=Path(sweep_dir).name, hydra_dir=Path(hc.runtime.output_dir) / hc.output_subdir,
                    n_jobs=n_jobs)


if __name__ == "__main__":
    main()
