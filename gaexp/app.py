"""The Hydra application: one grid cell per job, tracked as one MLflow run; callbacks around a sweep."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import shlex
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

import optuna
from hydra_plugins.gaexp_optuna_sweeper.sweeper import RESULTS

from gaexp import analysis, datasets, norms, redact, targets, tracking, tuning
from gaexp.batched import coupled_layers
from gaexp.batches import Split
from gaexp.config import (CONFIG_DIR, AnalysisConfig, Config, RegimeConfig, composition_problem, hydra_overrides,
                          require, typed, unknown_choice)
from gaexp.data import raw_dir
from gaexp.machine import usable_cores
from gaexp.hooks import DivergedError, DivergenceCheck, Progress, Stopped
from gaexp.memory import activation_bytes, peak_rss_bytes, reset_peak_rss
from gaexp.model import check_model, make_model
from gaexp.train import compile_phases, resolve_device, train

log = logging.getLogger(__name__)


def job_config(cfg: DictConfig) -> DictConfig:
    """The config a job sees: a callback's config without its `hydra` node (as Hydra's run_job does)."""
    if "hydra" not in cfg:
        return cfg
    job = copy.deepcopy(cfg)
    with read_write(job), open_dict(job):
        del job["hydra"]
    return job


def check(cfg: DictConfig) -> Config:
    """Everything a cell's config can get wrong, checked without writing anything: types, required keys and
    ranges (gaexp/config.py), the model against the data's shape and classes and the norm's options against
    the model (e.g. norm.groups against its channels), a compile that cannot run, a model accumulate=batched
    cannot chunk, and for a search an objective without a value."""
    c = typed(cfg)
    model = check_model(c, *datasets.describe(c.data))
    device = resolve_device(c.device)
    require("device_type", c.device_type, c.device_type == device.type,
            f"{device.type}, what device={c.device} is here (leave device_type to the run)")
    compile_phases(c.compile, c.norm.name, device)
    if c.accumulate == "batched":  # a layer it cannot chunk exactly is refused here, not run approximately
        coupled_layers(model)
    if c.optuna.study is not None:  # a trial: what it will return must exist
        tuning.check_objective(c.train.num_iterations, c.analysis)
    return c


def is_search(cfg: DictConfig) -> bool:
    """Whether this command's sweeper is gaexp's Optuna sweeper (only a callback's config has `hydra`)."""
    return "gaexp_optuna" in str(OmegaConf.select(cfg, "hydra.sweeper._target_", default=""))


def prepare(cfg: DictConfig) -> str:
    """Check the input, then data and MLflow store; returns the experiment id. Writes nothing on bad input."""
    c = check(job_config(cfg))
    if is_search(cfg):  # before any trial
        tuning.check_objective(c.train.num_iterations, c.analysis)
        tuning.check_direction(cfg.hydra.sweeper.direction)
    tracking.check_server(c.mlflow.tracking_uri)
    datasets.fetch(c.data)  # files and their MD5s, a download: ready before any job
    datasets.splits(datasets.open_dataset(c.data), c.data.holdout)  # checked whole before anything is recorded
    experiment_id = tracking.prepare_store(c.mlflow.tracking_uri, c.mlflow.experiment_name, c.mlflow.artifact_location)
    client = MlflowClient(c.mlflow.tracking_uri)
    for run in tracking.mark_stale_runs(client, experiment_id, c.mlflow.stale_after_s):
        log.warning("marked KILLED: %s", run)
    return experiment_id


class PrepareCallback(Callback):
    """Runs in the launching process, once per command, so jobs find a ready store and data.

    Bad input stops the whole command here with one line: Hydra turns a
    callback's exceptions into warnings, but lets SystemExit through.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.on_multirun_start(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        HydraConfig.instance().set_config(config)  # as in a job: ${hydra:...} (conf/launch/) resolves
        redact.mask_logs()  # a storage URL's password never reaches the terminal or the sweep's log
        try:
            prepare(config)
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
                        "(docs/cluster.md)")
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
    """When a multirun ends: the analysis report of this sweep (design: the `analysis` node), as files
    and as an MLflow run."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if (Path(config.hydra.sweep.dir) / RESULTS).is_file():
            return  # a tuning sweep: its trials are no grid (StudiesCallback reports it)
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
            tags = {"gaexp.role": analysis.REPORT_ROLE, "sweep_id": sweep_id, **part}
            with tracking.tracked_run(client, experiment_id, name, tags) as run_id:
                tracking.log_params(client, run_id, {"analysis": dataclasses.asdict(design)})  # margin, window...
                for path in written:
                    client.log_artifact(run_id, str(path))
            log.info("report of sweep %s in %s and MLflow run %s\n%s", sweep_id, written[0].parent, name,
                     analysis.format_table(summary))


def report_command(sweep_id: str, design: AnalysisConfig, config: DictConfig, part: dict | None = None) -> str:
    """The gaexp-report command that rebuilds this sweep's report as the sweep made it: its store, experiment,
    part and the design keys the command takes where they differ from its default study's."""
    words = ["gaexp-report", "--tracking-uri", config.mlflow.tracking_uri, "--experiment", config.mlflow.experiment_name,
             "--sweep", sweep_id, *(w for k, v in (part or {}).items() for w in (f"--{k}", v))]
    default = analysis.load_study("spec")
    words += [w for name in ("window_start", "margin") if getattr(design, name) != getattr(default, name)
              for w in (f"--{name.replace('_', '-')}", f"{getattr(design, name):g}")]
    return " ".join(shlex.quote(str(w)) for w in words)


class StudiesCallback(Callback):
    """When a gaexp_optuna sweep ends: a parent run per study with the best trial and Optuna's plots,
    its trials' runs nested under it."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        results = Path(config.hydra.sweep.dir) / RESULTS
        if not results.is_file():
            return  # not a tuning sweep
        client = MlflowClient(config.mlflow.tracking_uri)
        experiment_id = tracking.experiment_id(client, config.mlflow.experiment_name)
        for name in tuning.report_studies(client, experiment_id, results, OmegaConf.to_object(config.analysis)):
            log.info("study %s: parent run study-%s", name, name)


def guess_cells_at_once(launcher: DictConfig, sweeper: DictConfig) -> int | None:
    """Cells sharing this machine's CPUs when no conf/launch/ preset says (`cells_at_once`): the
    plugins' own configs (hydra/launcher=...). None: one at a time."""
    target = launcher.get("_target_", "")
    if "n_jobs" in launcher:  # joblib
        return launcher.n_jobs
    if target.endswith("SlurmLauncher"):
        return 1
    if target.endswith("LocalLauncher"):
        return sweeper.get("max_batch_size") or -1
    if target.endswith("RayLauncher"):
        return max(1, usable_cores() // launcher.ray.remote.get("num_cpus", 1))
    return None


def threads_for(setting: int | str, cells: int | None, cores: int | None = None) -> int:
    """torch threads per run: `auto` makes cells x threads = cores (0 keeps torch's default)."""
    if setting != "auto":
        return int(setting)
    if not cells:
        return 0  # one cell at a time: torch's default uses every core
    cores = cores or usable_cores()
    jobs = cells if cells > 0 else max(1, cores + 1 + cells)  # joblib: -1 = all cores, -2 = all but one
    return max(1, cores // jobs)


def deterministic_cuda() -> None:
    """CUDA as repeatable as PyTorch makes it: deterministic kernels where they exist (an op without one
    warns, naming itself, in the cell's log), the cuBLAS workspace they need, no cuDNN autotuning. The
    workspace setting is read when cuBLAS starts, so it is set before the first CUDA matmul of the process
    (a value the user set is kept)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


# --- one cell, in named steps -----------------------------------------------------------------------

def skip_if_finished(client: MlflowClient, experiment_id: str, key: str, c: Config, sweep_id: str) -> Run | None:
    """The FINISHED run of the same protocol, now also counted in this sweep; None: the cell must run."""
    done = None if c.rerun else tracking.find_finished(client, experiment_id, key)
    if done is not None:
        tracking.add_to_sweep(client, done, sweep_id)  # so this sweep's report includes it
        log.info("%s: skipped, already FINISHED as run %s (rerun=true to run it again)", c.run_name, done.info.run_id)
    return done


def build(c: Config, dataset: datasets.Dataset, device: torch.device) -> tuple[torch.nn.Module, Split, Split]:
    """The data on `device` (validation: the test set, or images held out of training), and the model for its
    shape and classes, initialized from the seed."""
    train_data, valid_data = datasets.splits(dataset, c.data.holdout, device)
    torch.manual_seed(c.seed)  # model initialization; the data order has its own generator
    model = make_model(c, dataset.meta.shape[0], dataset.meta.num_classes)
    return model.to(device, memory_format=torch.channels_last), train_data, valid_data


def measure_memory(model: torch.nn.Module, data: Split, regime: RegimeConfig, engine: str,
                   device: torch.device) -> dict[str, float]:
    """MiB autograd saves for one micro-batch (`activation_mb`: what the loop holds, whichever engine runs:
    the study's memory column) and, for accumulate=batched, for the b*k samples of a step
    (`batched_activation_mb`); then the process peaks start from here."""
    b, n = regime.batch_size, regime.batch_size * regime.num_accum
    memory = {"activation_mb": activation_bytes(model, data.inputs(slice(0, b)), data.labels[:b]) / 2**20}
    if engine == "batched":
        memory["batched_activation_mb"] = activation_bytes(model, data.inputs(slice(0, n)), data.labels[:n]) / 2**20
    reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return memory


def train_and_track(c: Config, resolved: dict, key: str, model: torch.nn.Module, train_data: Split,
                    valid_data: Split, meta: datasets.Meta, device: torch.device, memory: dict[str, float],
                    client: MlflowClient,
                    experiment_id: str, sweep_id: str, hydra_dir: Path | None, bar: bool | None = None) -> float:
    """Train inside an MLflow run that holds the config, every evaluation and the summary; return the
    value `returned_value` gives. `bar`: a tqdm bar
    over the steps; None: on a terminal; False: a log line per evaluation). A trial
    reports each evaluation to its study; when pruned, its run ends KILLED and optuna.TrialPruned
    tells the sweeper."""
    compiled = compile_phases(c.compile, c.norm.name, device)
    tags = {"dataset": c.data.dataset, "model": c.model.name, "norm": c.norm.name, "regime": c.regime.name, "seed": c.seed,
            "batch_size": c.regime.batch_size, "num_accum": c.regime.num_accum, "accumulate": c.accumulate,
            "sweep_id": sweep_id,
            tracking.SWEEPS: sweep_id, "protocol_key": key,
            "device": device.type, "threads": torch.get_num_threads(),
            "compiled": ",".join(sorted(compiled, reverse=True)) or "off",  # what compile=auto chose
            **tuning.trial_tags(c.optuna)}
    trial = [tuning.ReportToTrial(c.optuna)] if c.optuna.study is not None else []
    try:
        with tracking.tracked_run(client, experiment_id, c.run_name, tags) as run_id:
            tracking.log_params(client, run_id, resolved)
            if meta.digest is None:  # an idx dataset: its verified files
                tracking.log_data_inputs(client, run_id, c.data.dataset, raw_dir(c.data), c.data.files,
                                         c.data.holdout, len(train_data), len(valid_data))
            else:
                tracking.log_content_inputs(client, run_id, dataclasses.asdict(meta), resolved["data"],
                                            len(train_data), len(valid_data))
            with tempfile.TemporaryDirectory() as tmp:
                (Path(tmp) / "config.yaml").write_text(redact.mask(OmegaConf.to_yaml(resolved)))
                client.log_artifact(run_id, str(Path(tmp) / "config.yaml"))
            if hydra_dir is not None and hydra_dir.is_dir():
                tracking.log_masked_artifacts(client, run_id, hydra_dir, "hydra")
            hooks = [DivergenceCheck(every=1 if device.type == "cpu" else 50),
                     *norms.declared(c.norm).hooks_for(model, train_data, c.seed), tracking.MlflowLogger(client, run_id), *trial,
                     Progress(c.train.num_iterations, c.run_name, bar)]
            tic = time.perf_counter()
            try:
                history = train(model, train_data, valid_data, c.train, c.regime, c.seed, hooks, compiled,
                                c.accumulate)
            except DivergedError as e:
                client.set_tag(run_id, "diverged_step", str(e.step))
                raise
            peak = "batched_" if c.accumulate == "batched" else ""  # a batched run's peaks are not the loop's
            memory = {**memory, f"{peak}peak_rss_mb": peak_rss_bytes() / 2**20}
            if device.type == "cuda":
                memory[f"{peak}cuda_max_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
            tracking.log_summary(client, run_id, history, time.perf_counter() - tic, memory)
            tracking.log_model(client, run_id, model, step=history[-1].step)  # the eager module: reloadable
    except Stopped as e:
        log.info("%s: %s", c.run_name, e)
        raise optuna.TrialPruned(str(e)) from None
    log.info("%s: final valid_acc %.4f (run %s)", c.run_name, history[-1].valid_acc, run_id)
    return returned_value(c, [(p.step, p.valid_acc) for p in history])


def returned_value(c: Config, points: list[tuple[int, float]]) -> float:
    """What a job returns to its sweeper, from its (step, valid_acc) evaluations: a trial, its objective
    (analysis.objective); a grid cell, whose value no sweeper reads, its final accuracy."""
    if c.optuna.study is None:
        return points[-1][1]
    value = tuning.objective(points, c.analysis)
    log.info("%s: objective %.4f (%s)", c.run_name, value, tuning.describe_objective(c.analysis))
    return value


def run_cell(cfg: DictConfig, sweep_id: str, hydra_dir: Path | None = None, guessed_cells: int | None = None,
             in_sweep: bool = False) -> float:
    """Train one cell of the grid and track it; returns `returned_value`. The store and data
    are ready (`prepare`, which PrepareCallback runs once per command). A cell already FINISHED with
    the same protocol key is skipped (its accuracy is returned) unless `rerun=true`."""
    c = check(cfg)  # again where the cell runs: a cluster node may see another device than the launching host
    device = resolve_device(c.device)
    if device.type == "cuda" and c.deterministic:
        deterministic_cuda()
    threads = threads_for(c.threads, c.cells_at_once if c.cells_at_once is not None else guessed_cells)
    if threads:
        torch.set_num_threads(threads)
    client = MlflowClient(c.mlflow.tracking_uri)
    experiment_id = tracking.experiment_id(client, c.mlflow.experiment_name)
    dataset = datasets.open_dataset(c.data, progress=False if in_sweep else c.progress)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["data"]["digest"] = dataset.meta.digest  # what it is, not only where: a changed folder is another protocol
    key = tracking.protocol_key(resolved)
    done = skip_if_finished(client, experiment_id, key, c, sweep_id)
    if done is not None:
        if c.optuna.study is None:  # a grid cell: its final accuracy, logged; no history to read
            return done.data.metrics["final_valid_acc"]
        history = client.get_metric_history(done.info.run_id, "valid_acc")
        return returned_value(c, sorted((m.step, m.value) for m in history))
    model, train_data, valid_data = build(c, dataset, device)
    memory = measure_memory(model, train_data, c.regime, c.accumulate, device)
    bar = False if in_sweep and c.progress is None else c.progress  # in a sweep, the sweeper shows progress
    return train_and_track(c, resolved, key, model, train_data, valid_data, dataset.meta, device, memory, client,
                           experiment_id, sweep_id, hydra_dir, bar)


@contextmanager
def quiet_console(quiet: bool, level: int = logging.WARNING) -> Iterator[None]:
    """While a cell runs in a sweep: only warnings and errors on the console handlers Hydra gave the job (its
    log file keeps everything). Restored after, for launchers that run cells in the launching process."""
    handlers = [h for h in logging.getLogger().handlers if type(h) is logging.StreamHandler] if quiet else []
    levels = [h.level for h in handlers]  # type(...) is: a FileHandler subclasses StreamHandler
    for handler in handlers:
        handler.setLevel(level)
    try:
        yield
    finally:
        for handler, before in zip(handlers, levels):
            handler.setLevel(before)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float:
    redact.mask_logs()  # the job's console and log file
    hc = HydraConfig.get()
    output_dir = Path(hc.runtime.output_dir)
    if hc.mode != RunMode.MULTIRUN:
        return run_cell(cfg, sweep_id=Path(hc.run.dir).name, hydra_dir=output_dir / hc.output_subdir)
    try:  # the launching terminal shows the sweep's progress; the cell's lines go to its gaexp.log
        with quiet_console(not hc.verbose):
            return run_cell(cfg, sweep_id=Path(hc.sweep.dir).name, hydra_dir=output_dir / hc.output_subdir,
                            guessed_cells=guess_cells_at_once(hc.launcher, hc.sweeper), in_sweep=True)
    except optuna.TrialPruned:
        raise  # not a failure: the sweeper records the trial PRUNED
    except Exception as e:  # noqa: BLE001 - one failed cell must not stop the others; FailuresCallback reports it
        log.exception("cell %s failed", hc.job.override_dirname)
        (output_dir / FAILED_MARKER).write_text(f"{type(e).__name__}: {e}")
        return float("nan")


def cli(argv: Sequence[str] | None = None) -> None:
    """The `gaexp` command (`python -m gaexp` too): the current folder first on the import path as `python -m`
    has it, so a model.target, norm.target or data.target beside the user imports; an unknown group choice,
    an unknown key or a value of the wrong type refused in one line before Hydra's own longer message (the
    first cell composed once more); then `main`."""
    targets.import_from_cwd()
    overrides = hydra_overrides(sys.argv[1:] if argv is None else argv)
    searched = any(o.lstrip("+").startswith("hydra.searchpath") for o in overrides)  # files this cannot see
    problem = None if searched else unknown_choice(overrides) or composition_problem(overrides)
    if problem:
        raise SystemExit(f"error: {problem}")
    main()


if __name__ == "__main__":
    main()
