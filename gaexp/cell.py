"""One cell of the grid: validate, build, train, record, as one MLflow run (or skipped, already FINISHED).
gaexp/app.py runs it as a Hydra job; the sweepers check every cell with `validated` before any runs. Each concept
validates its own part where it lives (the task, the model, the device, the precision, the replicas, the engine,
the data's split in gaexp/data/dataset.py, the run's memory in gaexp/memory.py); the cell calls them in order.
A cell of w > 1 replicas trains beside the processes of gaexp/team.py.

It imports neither the analysis nor Optuna: a trial's reporting is gaexp/trial.py, which loads Optuna only
for a trial.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from pathlib import Path

import torch
from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from gaexp import engine, liveness, metrics, norms, precision, redact, replicas, tracking, trial
from gaexp.batched import coupled_layers
from gaexp.data.batches import Split
from gaexp.config import Config, require, typed
from gaexp.data.dataset import Meta, describe, open_dataset, training_size, validate_split
from gaexp.data.idx import raw_dir
from gaexp.trial import returned_value
from gaexp.hooks import DivergedError, DivergenceCheck, Progress, Stopped, StopWhenSweepGone, SweepGone
from gaexp.machine import cpu_kind, threads_for, usable_cores
from gaexp.memory import check_run_memory, measure_memory, memory_problem, peak_rss_bytes
from gaexp.model import build, check_model
from gaexp.tags import (ACCUMULATE_FALLBACK, ARITHMETIC_KEY, CELL_START, CPU, DIVERGED_STEP, SAME_AS, SINGLE_RUN, cell_tags,
                        trial_tags)
from gaexp.task.build import make as make_task, problem as task_problem
from gaexp.team import follow, team
from gaexp.train import compile_phases, deterministic_cuda, resolve_device, step_plan, train

log = logging.getLogger("gaexp.app")  # the application's log, one name across its modules, as before the split


def validated(cfg: DictConfig) -> Config:
    """`validate`'s config: the engine resolved."""
    return validate(cfg)[0]


def validate(cfg: DictConfig) -> tuple[Config, engine.Choice]:
    """Everything a cell's config can get wrong, checked without writing anything: types, required keys and
    ranges (gaexp/config/schema.py), the model against the data's shape and classes and the norm's options against
    the model (e.g. norm.groups against its channels), a compile that cannot run, a model accumulate=batched
    cannot chunk, for a search an objective without a value, a batch larger than the training split (where the
    config declares it) and a run larger than this machine's memory. Returns the config with `accumulate` the
    engine the run uses (accumulate=auto resolved, gaexp/engine.py) and that choice."""
    c = typed(cfg)
    if (problem := task_problem(c)) is not None:
        raise ValueError(problem)
    shape, num_classes = describe(c.data)
    model = check_model(c, shape, num_classes)
    make_task(c.task).attach(model)  # what its loss reads of the model is there (an MoE's router for task.balance)
    device = resolve_device(c.device)
    require("device_type", c.device_type, c.device_type == device.type,
            f"{device.type}, what device={c.device} is here (leave device_type to the run)")
    problem = (precision.device_problem(c.precision, device)
               or replicas.problem(c.regime.replicas, c.precision, c.compile, device))
    if problem is not None:
        raise ValueError(problem)
    compile_phases(c.compile, c.norm.name, device)
    if c.accumulate == engine.BATCHED:  # a layer it cannot chunk exactly is refused here, not run approximately
        coupled_layers(model)
    if c.optuna.study is not None:  # a trial: what it will return must exist
        trial.require_objective(c.train.num_iterations, c.analysis)
    size = training_size(c.data)
    choice = engine.choose(c.accumulate, model, c.regime.batch_size, c.regime.num_accum, size,
                           lambda e: memory_problem(c, model, shape, device, e), c.precision, make_task(c.task),
                           c.regime.replicas)
    c = dataclasses.replace(c, accumulate=choice.engine)
    if size is not None:
        validate_split(c, size)
    check_run_memory(c, model, shape, device)
    return c, choice


def may_share(c: Config) -> bool:
    """Whether a cell may record the steps another run computed (gaexp/engine.py `arithmetic_key`) instead of
    computing them: share=true, rerun=false, and no Optuna trial (a trial reports its own evaluations)."""
    return c.share and not c.rerun and c.optuna.study is None


# --- one cell, in named steps -----------------------------------------------------------------------

def skip_if_finished(client: MlflowClient, experiment_id: str, keys: list[str], c: Config,
                     sweep_id: str) -> Run | None:
    """The FINISHED run of one of these protocols (`engine.keys`: the engine's, then under auto the other's),
    now also counted in this sweep; None: the cell must run."""
    if c.rerun:
        return None
    for key in keys:  # the same cell still training in another process here (a killed sweep's worker): its end
        tracking.wait_for_live_runs(client, experiment_id, key, c.mlflow.stale_after_s)
    done = next((run for key in keys if (run := tracking.find_finished(client, experiment_id, key)) is not None), None)
    if done is not None:
        tracking.add_to_sweep(client, done, sweep_id)  # so this sweep's report includes it
        log.info("%s: skipped, already FINISHED as run %s (rerun=true to run it again)", c.run_name, done.info.run_id)
    return done


def train_and_track(c: Config, resolved: dict, key: str, choice: engine.Choice, model: torch.nn.Module,
                    train_data: Split,
                    valid_data: Split, meta: Meta, device: torch.device, memory: dict[str, float],
                    client: MlflowClient,
                    experiment_id: str, sweep_id: str, hydra_dir: Path | None, bar: bool | None = None,
                    in_sweep: bool = True, cell_start: float | None = None,
                    started: replicas.Replicas | None = None, arithmetic: str | None = None,
                    source: Run | None = None) -> float:
    """Train inside an MLflow run that holds the config, every evaluation and the summary; return the
    value `returned_value` gives. `bar`: a tqdm bar
    over the steps; None: on a terminal; False: a log line per evaluation). A trial
    reports each evaluation to its study; when pruned, its run ends KILLED and `Stopped` is raised (the
    app tells the sweeper). `started`: rank 0 of the replicas a launcher started (`run_cell`). `arithmetic`: the key
    of the steps its engine computes where other cells compute the same (gaexp/engine.py), tagged; `source`: the
    FINISHED run that computed them, whose histories and results the run records instead of training (SAME_AS)."""
    compiled = compile_phases(c.compile, c.norm.name, device)
    if c.regime.replicas > 1:  # under DDP a replica's training runs eager (`replicas.problem` refuses compile=all)
        compiled -= {"train"}
    tags = cell_tags(dataset=c.data.dataset, model=c.model.name, norm=c.norm.name, regime=c.regime.name, seed=c.seed,
                     batch_size=c.regime.batch_size, num_accum=c.regime.num_accum, replicas=c.regime.replicas,
                     accumulate=c.accumulate, precision=c.precision.name, setting=choice.setting, sweep_id=sweep_id,
                     protocol_key=key, device=device.type, threads=torch.get_num_threads(), **{CPU: cpu_kind()},
                     compiled=",".join(sorted(compiled, reverse=True)) or "off",  # what compile=auto chose
                     **({} if in_sweep else {SINGLE_RUN: "true"}),
                     **({CELL_START: f"{cell_start:.3f}"} if cell_start is not None else {}),
                     **({ACCUMULATE_FALLBACK: choice.reason} if choice.fell_back else {}),
                     **({ARITHMETIC_KEY: arithmetic} if arithmetic is not None else {}),
                     **({SAME_AS: source.info.run_id} if source is not None else {}),
                     **trial_tags(c.optuna.study, c.optuna.trial, c.optuna.repeat, c.optuna.repeats))
    reporting = [trial.ReportToTrial(c.optuna)] if c.optuna.study is not None else []
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
            if source is not None:
                tracking.log_shared(client, run_id, source, memory)
                log.info("%s: the same steps as run %s (%s), recorded from it, not computed again (share=false computes "
                         "them)", c.run_name, source.info.run_name, source.info.run_id)
                points = [(step, value) for step, value, _ in tracking.curves_of(source)]
                return returned_value(c, points)
            hooks = [DivergenceCheck(every=1 if device.type == "cpu" else 50),
                     *norms.declared(c.norm).hooks_for(model, train_data, c.seed), tracking.MlflowLogger(client, run_id), *reporting,
                     Progress(c.train.num_iterations, c.run_name, bar, compiling_eval="eval" in compiled),
                     *([StopWhenSweepGone(watch)] if (watch := liveness.sweep_watch()) is not None else [])]
            tic = time.perf_counter()
            try:
                with team(c, device, started) as group:
                    history = train(model, train_data, valid_data, c.train,
                                    step_plan(c, device, group, compiled), make_task(c.task), hooks)
            except DivergedError as e:
                client.set_tag(run_id, DIVERGED_STEP, str(e.step))
                raise
            if watch is not None and watch.gone:  # trained to its end for nobody: a rerun may be training it
                raise SweepGone(c.train.num_iterations, watch.reason)
            batched = c.accumulate == engine.BATCHED  # a batched run's peaks are not the loop's
            rss, cuda = ((metrics.BATCHED_PEAK_RSS_MB, metrics.BATCHED_CUDA_MAX_MEM_MB) if batched else
                         (metrics.PEAK_RSS_MB, metrics.CUDA_MAX_MEM_MB))
            memory = {**memory, rss.name: peak_rss_bytes() / 2**20}
            if device.type == "cuda":
                memory[cuda.name] = torch.cuda.max_memory_allocated(device) / 2**20
            tracking.log_summary(client, run_id, history, time.perf_counter() - tic, memory)
            tracking.log_model(client, run_id, model, step=history[-1].step)  # the eager module: reloadable
    except Stopped as e:  # its run ended KILLED; the app tells the sweeper (optuna.TrialPruned)
        log.info("%s: %s", c.run_name, e)
        raise
    log.info("%s: final %s %.4f (run %s)", c.run_name, history[-1].headline, history[-1].value, run_id)
    return returned_value(c, [(p.step, p.value) for p in history])


def finished_value(c: Config, client: MlflowClient, done: Run) -> float:
    """`returned_value` of a cell FINISHED before: its task's headline (valid_acc; a language model's valid_loss)
    at its last evaluation, logged as a result (no history to read), or for a trial its objective over the
    headline's history."""
    headline = make_task(c.task).headline.metric.name
    if c.optuna.study is None:
        return done.data.metrics[f"final_{headline}"]
    history = client.get_metric_history(done.info.run_id, headline)
    return returned_value(c, sorted((m.step, m.value) for m in history))


def run_cell(cfg: DictConfig, sweep_id: str, hydra_dir: Path | None = None, in_sweep: bool = False) -> float:
    """Train one cell of the grid and track it; returns `returned_value`. The store and data
    are ready (`prepare`, which PrepareCallback runs once per command). A cell already FINISHED with
    the same protocol key is skipped (its accuracy is returned) unless `rerun=true`."""
    started_at = time.time()  # the run records it: its setup's share of the time (gaexp.breakdown)
    c, choice = validate(cfg)  # again where the cell runs: a cluster node may see another device than the launcher
    device = resolve_device(c.device)
    if device.type == "cuda" and c.deterministic:
        deterministic_cuda()
    threads = threads_for(c.threads, c.cells_at_once)  # the launch config says how many cells share the cores
    started = replicas.launched()  # one of the processes torchrun or launch=slurm started (checked: w of them)
    if c.regime.replicas > 1:  # the cell's threads shared among its replicas (a launcher's: those on this node)
        threads = replicas.threads_each(threads, c.regime.replicas if started is None else started.local_world)
        if started is None and (line := replicas.oversubscribed(c.regime.replicas, usable_cores())) is not None:
            log.warning("%s", line)
    if threads:
        torch.set_num_threads(threads)
    if started is None:
        return lead(cfg, c, choice, device, sweep_id, hydra_dir, in_sweep, started_at)
    group = replicas.join_launched(started, device)
    try:
        if not group.leader:
            return follow(c, choice, group)
        try:
            return lead(cfg, c, choice, group.device, sweep_id, hydra_dir, in_sweep, started_at, group)
        finally:
            if not group.store.check([replicas.DECISION]):  # skipped as finished, or failed before training
                group.tell(replicas.SKIP)
    finally:
        group.close()


def lead(cfg: DictConfig, c: Config, choice: engine.Choice, device: torch.device, sweep_id: str,
         hydra_dir: Path | None, in_sweep: bool, started_at: float,
         group: replicas.Replicas | None = None) -> float:
    """`run_cell` in the process that records the cell: one process, or rank 0 of a launcher's replicas."""
    client = MlflowClient(c.mlflow.tracking_uri)
    experiment_id = tracking.experiment_id(client, c.mlflow.experiment_name)
    dataset = open_dataset(c.data, progress=False if in_sweep else c.progress)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["data"]["digest"] = dataset.meta.digest  # what it is, not only where: a changed folder is another protocol
    done = skip_if_finished(client, experiment_id, engine.keys(resolved, choice, tracking.protocol_key), c, sweep_id)
    if done is not None:
        return finished_value(c, client, done)
    model, train_data, valid_data = build(c, dataset, device)
    choice = engine.within_split(choice, c.regime.batch_size, c.regime.num_accum, len(train_data), make_task(c.task),
                                 c.regime.replicas)
    c = dataclasses.replace(c, accumulate=choice.engine)
    if (line := engine.notice(choice, c.run_name)) is not None:
        log.warning("%s", line)
    if (line := precision.slow_once(c.precision, device)) is not None:
        log.warning("%s", line)
    resolved["accumulate"] = choice.engine  # the engine used: logged, and in the protocol key
    key = tracking.protocol_key(resolved)
    arithmetic = (engine.arithmetic_key(resolved, choice, make_task(c.task), tracking.protocol_key)
                  if c.optuna.study is None else None)  # a trial reports its own evaluations to its study
    memory = measure_memory(model, train_data, c.regime, c.accumulate, device, make_task(c.task))
    source = (tracking.shared_source(client, experiment_id, arithmetic, c.mlflow.stale_after_s)
              if arithmetic is not None and may_share(c) else None)
    bar = False if in_sweep and c.progress is None else c.progress  # in a sweep, the sweeper shows progress
    return train_and_track(c, resolved, key, choice, model, train_data, valid_data, dataset.meta, device, memory,
                           client, experiment_id, sweep_id, hydra_dir, bar, in_sweep, started_at, group,
                           arithmetic, source)
