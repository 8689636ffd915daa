"""The Hydra application: one grid cell per job, tracked as one MLflow run."""

from __future__ import annotations

import logging
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
from gaexp.config import norm_options, regime_name, usable_cores, validate
from gaexp.data import NUM_TRAIN, ensure_mnist, load_split, to_input
from gaexp.memory import activation_bytes, peak_rss_bytes, reset_peak_rss
from gaexp.model import SimpleModel
from gaexp.train import DivergedError, resolve_device, train

log = logging.getLogger(__name__)
CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "conf")  # the repository's conf/ (editable install)


def prepare(cfg: DictConfig) -> str:
    """Check the input, then data and MLflow store; returns the experiment id. Writes nothing on bad input."""
    validate(cfg)
    resolve_device(cfg.device)
    tracking.check_tracking_uri(cfg.mlflow.tracking_uri)
    ensure_mnist(cfg.data.root, cfg.data.sources)
    return tracking.prepare_store(cfg.mlflow.tracking_uri, cfg.mlflow.experiment_name,
                                  cfg.mlflow.artifact_location)


def prepare_sweep(cfg: DictConfig) -> None:
    """Once per command, before any job: the store, and runs left RUNNING by killed processes marked KILLED."""
    experiment_id = prepare(cfg)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    for run in tracking.mark_stale_runs(client, experiment_id, cfg.mlflow.stale_after_s):
        log.warning("marked KILLED: %s", run)


class PrepareCallback(Callback):
    """Runs in the launching process, so parallel jobs find a ready store and data.

    Bad input stops the whole command here with one line: Hydra turns a
    callback's exceptions into warnings, but lets SystemExit through.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.on_multirun_start(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            prepare_sweep(config)
        except Exception as e:  # noqa: BLE001 - every kind of bad input ends the command the same way
            raise SystemExit(f"error: {e}") from None
        for warning in launcher_warnings(config):
            log.warning(warning)


def launcher_warnings(config: DictConfig) -> list[str]:
    """Launcher settings that work but hurt: unbounded local jobs, SQLite shared by cluster nodes."""
    target = config.hydra.launcher.get("_target_", "")
    warnings = []
    if target.endswith("submitit_launcher.LocalLauncher") and not config.hydra.sweeper.get("max_batch_size"):
        warnings.append("submitit_local starts every cell at once; bound it with launch=local "
                        "or hydra.sweeper.max_batch_size=N")
    if target.endswith("submitit_launcher.SlurmLauncher") and config.mlflow.tracking_uri.startswith("sqlite:"):
        warnings.append(f"cluster jobs writing to {config.mlflow.tracking_uri}: SQLite on a shared file system "
                        "locks and can corrupt; start an MLflow server and set mlflow.tracking_uri=http://HOST:PORT "
                        "(README, 'Beyond one machine')")
    return warnings


FAILED_MARKER = "FAILED.txt"  # written into a job's folder when its cell fails inside a multirun


class FailuresCallback(Callback):
    """Last thing a multirun does: exit non-zero naming the failed cells, if any.

    Listed first in conf/config.yaml because Hydra runs end-callbacks in reverse order.
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        failures = sorted(Path(config.hydra.sweep.dir).glob(f"*/{FAILED_MARKER}"))
        if failures:
            lines = [f"  {p.parent.name}: {p.read_text().strip()}" for p in failures]
            raise SystemExit(f"error: {len(failures)} cell(s) failed, the others ran:\n" + "\n".join(lines))


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


def cells_at_once(launcher: DictConfig, sweeper: DictConfig) -> int | None:
    """How many cells share this process's CPUs under the launcher in use (None: one at a time).

    joblib: n_jobs. submitit_local: the sweeper's batch size (unbounded: as many as
    cores). SLURM: 1, each task has its own CPUs. Ray: cores / CPUs per cell.
    """
    target = launcher.get("_target_", "")
    if "n_jobs" in launcher:
        return launcher.n_jobs
    if target.endswith("SlurmLauncher"):
        return 1
    if target.endswith("LocalLauncher"):
        return sweeper.get("max_batch_size") or -1
    if target.endswith("RayLauncher"):
        return max(1, usable_cores() // launcher.ray.remote.get("num_cpus", 1))
    return None


def threads_for(setting: int | str, n_jobs: int | None, cores: int | None = None) -> int:
    """torch threads per run: `auto` makes jobs x threads = cores (0 keeps torch's default)."""
    if setting != "auto":
        if not isinstance(setting, int) or setting < 0:
            raise ValueError(f"threads={setting!r}; valid: auto or an integer >= 0")
        return setting
    if not n_jobs:
        return 0  # one cell at a time: torch's default uses every core
    cores = cores or usable_cores()
    jobs = n_jobs if n_jobs > 0 else max(1, cores + 1 + n_jobs)  # joblib: -1 = all cores, -2 = all but one
    return max(1, cores // jobs)


def run_cell(cfg: DictConfig, sweep_id: str, hydra_dir: Path | None = None, n_jobs: int | None = None) -> float:
    """Train one cell of the grid and track it; returns the final valid accuracy.

    A cell already FINISHED with the same protocol key is skipped (its accuracy
    is returned) unless `rerun=true`.
    """
    experiment_id = prepare(cfg)
    device = resolve_device(cfg.device)
    threads = threads_for(cfg.threads, n_jobs)
    if threads:
        torch.set_num_threads(threads)
    b, k, seed = cfg.regime.batch_size, cfg.regime.num_accum, cfg.seed
    regime = regime_name(b, k)
    name = f"{cfg.norm.name}-{regime}-s{seed}"
    client = MlflowClient(cfg.mlflow.tracking_uri)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    key = tracking.protocol_key(resolved)
    done = None if cfg.rerun else tracking.find_finished(client, experiment_id, key)
    if done is not None:
        tracking.add_to_sweep(client, done, sweep_id)  # so this sweep's report includes it
        log.info("%s: skipped, already FINISHED as run %s (rerun=true to run it again)", name, done.info.run_id)
        return done.data.metrics["final_valid_acc"]
    train_data = load_split(cfg.data.root, train=True, device=device)
    valid_data = load_split(cfg.data.root, train=False, device=device)
    assert len(train_data.labels) == NUM_TRAIN

    tags = {"norm": cfg.norm.name, "regime": regime, "seed": seed, "batch_size": b, "num_accum": k,
            "sweep_id": sweep_id, tracking.SWEEPS: sweep_id, "protocol_key": key,
            "device": device.type, "threads": torch.get_num_threads()}
    with tracking.tracked_run(client, experiment_id, name, tags) as run_id:
        tracking.log_params(client, run_id, resolved)
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
            client.log_artifact(run_id, str(Path(tmp) / "config.yaml"))
        if hydra_dir is not None and hydra_dir.is_dir():
            client.log_artifacts(run_id, str(hydra_dir), "hydra")

        torch.manual_seed(seed)  # model initialization; the data order has its own generator
        model = SimpleModel(cfg.norm.name, **norm_options(cfg.norm)).to(device, memory_format=torch.channels_last)
        act_bytes = activation_bytes(model, to_input(train_data.images[:b]), train_data.labels[:b])
        reset_peak_rss()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        tic = time.perf_counter()
        try:
            history = train(
                torch.compile(model) if cfg.compile else model, train_data, valid_data, batch_size=b,
                num_accum=k, seed=seed, num_iterations=cfg.train.num_iterations,
                eval_period=cfg.train.eval_period, lr=cfg.train.lr, loss_window=cfg.train.loss_window,
                eval_batch_size=cfg.train.eval_batch_size,
                on_eval=lambda point: tracking.log_eval_point(client, run_id, point),
                progress=cfg.progress, desc=name, check_every=1 if device.type == "cpu" else 50,
            )
        except DivergedError as e:
            client.set_tag(run_id, "diverged_step", str(e.step))
            raise
        memory = {"activation_mb": act_bytes / 2**20, "peak_rss_mb": peak_rss_bytes() / 2**20}
        if device.type == "cuda":
            memory["cuda_max_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        tracking.log_summary(client, run_id, history, time.perf_counter() - tic, memory)
    log.info("%s: final valid_acc %.4f (run %s)", name, history[-1].valid_acc, run_id)
    return history[-1].valid_acc


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    output_dir = Path(hc.runtime.output_dir)
    if hc.mode != RunMode.MULTIRUN:
        return run_cell(cfg, sweep_id=Path(hc.run.dir).name, hydra_dir=output_dir / hc.output_subdir)
    try:
        return run_cell(cfg, sweep_id=Path(hc.sweep.dir).name, hydra_dir=output_dir / hc.output_subdir,
                        n_jobs=cells_at_once(hc.launcher, hc.sweeper))
    except Exception as e:  # noqa: BLE001 - one failed cell must not stop the others; FailuresCallback reports it
        log.exception("cell %s failed", hc.job.override_dirname)
        (output_dir / FAILED_MARKER).write_text(f"{type(e).__name__}: {e}")
        return float("nan")


if __name__ == "__main__":
    main()
