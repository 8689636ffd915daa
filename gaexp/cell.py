"""One cell of the grid, in one pass down the layers: its config checked, its data and model built, trained and
tracked as one MLflow run (or skipped, already FINISHED). gaexp/app.py runs it as a Hydra job; the sweepers
check every cell with `validated` before any runs.

It imports neither the analysis nor Optuna: a trial's reporting is gaexp/trial.py, which loads Optuna only
for a trial.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch
from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from gaexp import engine, liveness, metrics, norms, precision, redact, replicas, tracking, trial
from gaexp.engine import holds_step
from gaexp.batched import coupled_layers
from gaexp.data.batches import Draw, Split
from gaexp.config import Config, DataConfig, RegimeConfig, require, typed
from gaexp.data.dataset import Dataset, Meta, describe, open_dataset, splits
from gaexp.data.idx import raw_dir
from gaexp.hooks import DivergedError, DivergenceCheck, Progress, Stopped, StopWhenSweepGone, SweepGone
from gaexp.machine import usable_cores
from gaexp.memory import activation_bytes, available_bytes, peak_rss_bytes, reset_peak_rss, sample_bytes
from gaexp.model import check_model, make_model
from gaexp.tags import ACCUMULATE_FALLBACK, CELL_START, DIVERGED_STEP, SINGLE_RUN, cell_tags, trial_tags
from gaexp.task import Task
from gaexp.task.build import make as make_task, problem as task_problem
from gaexp.train import StepPlan, compile_phases, resolve_device, train

log = logging.getLogger("gaexp.app")  # the application's log, one name across its modules, as before the split


def training_size(data: DataConfig) -> int | None:
    """The training images left after data.holdout where the config declares their count (an idx dataset's
    num_train, checked against its files when they are read); None: known once the data is read (`prepare`
    checks `validate_split` there)."""
    return data.num_train - data.holdout if data.kind == "idx" and data.num_train is not None else None


def validate_split(c: Config, size: int, setting: str | None = None) -> None:
    """A micro-batch is at most the training split of `size` images (the data order draws each from the rest of
    one permutation of it and the next: a larger one would silently hold fewer), and so are the b*k samples
    accumulate=batched computes at once. `setting`: what the command asked, where `c` has auto's choice made
    before the split's size was known (auto takes the loop for a step beyond the split: `engine.within_split`)."""
    b, k = c.regime.batch_size, c.regime.num_accum
    items = "sequences" if c.data.kind == "text" else "images"
    split = f"the {size:,} training {items} of data={c.data.dataset}" + (
        f" left after data.holdout={c.data.holdout:,}" if c.data.holdout else "")
    require("regime.batch_size", b, b <= size, f"an integer in [1, {size}]: a micro-batch is at most {split}")
    if (setting or c.accumulate) == engine.BATCHED:
        require("regime.batch_size*regime.num_accum", b * k, b * k <= size,
                f"at most {size}: accumulate=batched computes a step's {b} x {k} samples at once, at most {split} "
                "(accumulate=loop draws them a micro-batch at a time)")


def data_bytes(data: DataConfig, shape: tuple[int, int, int]) -> int:
    """Bytes of both splits in memory (uint8 images, int64 labels), as far as known before they are read: an idx
    dataset's from its files, its training images alone while the files are not there yet; 0 for the others
    (reading them checks them against data.max_memory_mb)."""
    if data.kind != "idx" or data.num_train is None:
        return 0
    files = [raw_dir(data) / name for name in data.files or {}]
    if not files or not all(f.is_file() for f in files):
        return data.num_train * (math.prod(shape) + 8)
    return sum(f.stat().st_size * (1 if "images" in f.name else 8) for f in files)


def size_text(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def check_memory(c: Config, model: torch.nn.Module, shape: tuple[int, int, int], device: torch.device,
                 accumulate: str | None = None) -> None:
    """A step's memory, estimated, within what this machine has (`available_bytes`): the activations of the
    samples held at once (one micro-batch; accumulate=batched: a step's b*k) at `sample_bytes` each, the data,
    the model with its gradients and Adam's two moments, and the record of each step's loss. Refused in one line
    naming the largest part and how far to lower it. Not checked where cells run on other hosts (their memory
    is not this one's) or where neither the model's measure nor the machine's memory is known. `accumulate`:
    the engine to check (default: the config's)."""
    if c.cells_elsewhere:
        return
    found = available_bytes(device)
    if found is None:
        return
    available, where = found
    try:
        job = make_task(c.task)
        per_sample = sample_bytes(model, *job.probe(shape, 0)[:2], job.loss) * job.views
    except Exception:  # noqa: BLE001 - a model that cannot run two blank images fails its run, saying why
        return
    b, k = c.regime.batch_size, c.regime.num_accum
    chosen = accumulate or c.accumulate
    batched = holds_step(chosen, job, k)
    held, steps = (b * k if batched else b), c.train.num_iterations
    data = data_bytes(c.data, shape)
    weights = 4 * sum(p.numel() * p.element_size() for p in model.parameters())  # + gradients, Adam's moments
    # each part: (what it is, its bytes, bytes per unit of the key that sets it, that key, what is valid: {} the
    # most units that fit)
    lighter = "cached" if job.whole_outputs else "loop"  # the engine that holds one micro-batch
    parts = [(f"{held:,} samples x {size_text(per_sample)} of activations", held * per_sample, per_sample,
              f"regime.batch_size={b} regime.num_accum={k} accumulate={chosen}" if batched else f"regime.batch_size={b}",
              f"regime.batch_size x regime.num_accum <= {{}} (or accumulate={lighter}, which holds regime.batch_size "
              "samples)" if batched else "regime.batch_size <= {}"),
             (f"{size_text(4 * steps)} recording {steps:,} steps' losses", 4 * steps, 4,
              f"train.num_iterations={steps}", "train.num_iterations <= {}"),
             (f"{size_text(data)} of data", data, 0, f"data={c.data.dataset}", None),
             (f"{size_text(weights)} of model, gradients and Adam", weights, 0, f"model={c.model.name}", None)]
    need = sum(part[1] for part in parts)
    if need <= available:
        return
    _, worst, unit, name, fix = max(parts, key=lambda part: part[1])
    room = available - (need - worst)
    valid = fix.format(f"{int(room // unit):,}") if unit and room >= unit else "less of each of these"
    raise ValueError(f"{name}: a run needs about {size_text(need)} on {device.type} ({'; '.join(p[0] for p in parts)}),"
                     f" more than the {size_text(available)} {where}; valid: {valid}")


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
    check_memory(c, model, shape, device)
    return c, choice


def memory_problem(c: Config, model: torch.nn.Module, shape: tuple[int, int, int], device: torch.device,
                   accumulate: str) -> str | None:
    """`check_memory`'s one line for this engine, or None when a step fits."""
    try:
        check_memory(c, model, shape, device, accumulate)
    except ValueError as e:
        return str(e)
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


def build(c: Config, dataset: Dataset, device: torch.device) -> tuple[torch.nn.Module, Split, Split]:
    """The data on `device` (validation: the test set, or images held out of training), and the model for its
    shape and classes, initialized from the seed; both in the weights' dtype (precision.weights)."""
    train_data, valid_data = splits(dataset, c.data.holdout, device)
    train_data = make_task(c.task).training_split(train_data)  # a contrastive task's: two views of each image
    torch.manual_seed(c.seed)  # model initialization; the data order has its own generator
    model = make_model(c, dataset.meta.shape[0], dataset.meta.num_classes)
    dtype = precision.DTYPES[c.precision.weights]
    if dtype != torch.float32:  # initialized in float32 as any run, then rounded: the same draws for every precision
        model, train_data, valid_data = (model.to(dtype), dataclasses.replace(train_data, dtype=dtype),
                                         dataclasses.replace(valid_data, dtype=dtype))
    return model.to(device, memory_format=torch.channels_last), train_data, valid_data


def measure_memory(model: torch.nn.Module, data: Split, regime: RegimeConfig, engine: str,
                   device: torch.device, job: Task) -> dict[str, float]:
    """MiB autograd saves for one micro-batch (`activation_mb`: what the loop and the cached engine hold, whichever
    engine runs: the study's memory column) and, for an engine that holds the b*k samples of a step (batched; the
    loop of a loss over the step's outputs), for those (`batched_activation_mb`); then the process peaks start from
    here."""
    b, n = regime.batch_size, regime.batch_size * regime.num_accum
    first = (data.batch(Draw(torch.arange(size, device=data.labels.device))) for size in (b, n))
    memory = {metrics.ACTIVATION_MB.name: activation_bytes(model, *next(first), job.loss) / 2**20}
    if holds_step(engine, job, regime.num_accum):
        memory[metrics.BATCHED_ACTIVATION_MB.name] = activation_bytes(model, *next(first), job.loss) / 2**20
    reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return memory


def train_and_track(c: Config, resolved: dict, key: str, choice: engine.Choice, model: torch.nn.Module,
                    train_data: Split,
                    valid_data: Split, meta: Meta, device: torch.device, memory: dict[str, float],
                    client: MlflowClient,
                    experiment_id: str, sweep_id: str, hydra_dir: Path | None, bar: bool | None = None,
                    in_sweep: bool = True, cell_start: float | None = None,
                    started: replicas.Replicas | None = None) -> float:
    """Train inside an MLflow run that holds the config, every evaluation and the summary; return the
    value `returned_value` gives. `bar`: a tqdm bar
    over the steps; None: on a terminal; False: a log line per evaluation). A trial
    reports each evaluation to its study; when pruned, its run ends KILLED and `Stopped` is raised (the
    app tells the sweeper). `started`: rank 0 of the replicas a launcher started (`run_cell`)."""
    compiled = compile_phases(c.compile, c.norm.name, device)
    if c.regime.replicas > 1:  # under DDP a replica's training runs eager (`replicas.problem` refuses compile=all)
        compiled -= {"train"}
    tags = cell_tags(dataset=c.data.dataset, model=c.model.name, norm=c.norm.name, regime=c.regime.name, seed=c.seed,
                     batch_size=c.regime.batch_size, num_accum=c.regime.num_accum, replicas=c.regime.replicas,
                     accumulate=c.accumulate, precision=c.precision.name, setting=choice.setting, sweep_id=sweep_id,
                     protocol_key=key, device=device.type, threads=torch.get_num_threads(),
                     compiled=",".join(sorted(compiled, reverse=True)) or "off",  # what compile=auto chose
                     **({} if in_sweep else {SINGLE_RUN: "true"}),
                     **({CELL_START: f"{cell_start:.3f}"} if cell_start is not None else {}),
                     **({ACCUMULATE_FALLBACK: choice.reason} if choice.fell_back else {}),
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


@contextlib.contextmanager
def team(c: Config, device: torch.device,
         started: replicas.Replicas | None = None) -> Iterator[replicas.Replicas | None]:
    """For a cell of w > 1 replicas (gaexp/replicas.py): ranks 1..w-1 started (`replica_main`), set up and met,
    this process rank 0 of the process group; on the way out each of them ended, and none left running whatever
    happened. A replica that failed or died is the cell's error, naming its rank. None for one replica.
    `started`: the process group of replicas a launcher started, told to train (`follow`)."""
    w = c.regime.replicas
    if started is not None:
        started.tell(replicas.TRAIN)
        try:
            yield started
        except Exception:
            if (failure := started.named_failure()) is not None:  # rank 0's error a symptom of that replica's
                raise failure from None
            raise
        return
    if w == 1:
        yield None
        return
    store, note = replicas.open_store(w)
    if note is not None:
        log.warning("%s", note)
    with replicas.Team(replica_main, (c, store.port, torch.get_num_threads()), w) as others:
        group = None
        try:
            others.wait_ready(store)
            group = replicas.join(0, w, store, device)
            yield group
            others.finish()
        except BaseException as e:
            if not isinstance(e, replicas.ReplicaError):
                others.check(wait_s=5.0)  # rank 0's error may be a replica's death seen from here: that one's
            raise
        finally:
            if group is not None:
                group.close()


def replica_main(index: int, c: Config, port: int, threads: int) -> None:
    """Rank index + 1 of a cell (`team`), in a process of its own: its data and model built as rank 0's, then
    trained in the process group; it records nothing."""
    import torch.distributed as dist

    rank, w = index + 1, c.regime.replicas
    torch.set_num_threads(threads)
    device = replicas.replica_device(resolve_device(c.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if c.deterministic:
            deterministic_cuda()
    model, train_data, _ = build(c, open_dataset(c.data, progress=False), device)
    store = dist.TCPStore(replicas.HOST, port, w, False, timeout=datetime.timedelta(seconds=replicas.SETUP_TIMEOUT_S))
    store.set(replicas.READY.format(rank), "1")
    group = replicas.join(rank, w, store, device)
    try:
        train(model, train_data, None, c.train, step_plan(c, device, group), make_task(c.task))
    finally:
        group.close()


def follow(c: Config, choice: engine.Choice, group: replicas.Replicas) -> float:
    """Rank 1..w-1 of the replicas a launcher started (torchrun, launch=slurm's tasks): trains beside rank 0 when
    it says so (`team`), its data and model built as rank 0's, and records nothing; rank 0's run is the cell's.
    Its own error is left for rank 0 to name; nan to its launcher either way (submitit reads task 0's result)."""
    if group.hear() != replicas.TRAIN:  # the cell was finished, or rank 0 failed before training
        return float("nan")
    try:
        if group.device.type == "cuda":
            torch.cuda.set_device(group.device)
        model, train_data, _ = build(c, open_dataset(c.data, progress=False), group.device)
        c = dataclasses.replace(c, accumulate=engine.within_split(choice, c.regime.batch_size, c.regime.num_accum,
                                                                  len(train_data), make_task(c.task),
                                                                  c.regime.replicas).engine)  # rank 0's engine
        train(model, train_data, None, c.train, step_plan(c, group.device, group), make_task(c.task))
    except Exception as e:  # noqa: BLE001 - rank 0 names it in the cell's run; a task that raised would stop a sweep
        log.exception("replica %d of %d failed", group.rank, group.world)
        group.failed(e)
    return float("nan")


def step_plan(c: Config, device: torch.device, group: replicas.Replicas | None,
              compiled: frozenset[str] = frozenset()) -> StepPlan:
    """How the cell's steps are computed (gaexp/train.py): its regime, seed, engine and precision, as one of
    `group`'s replicas, with `compiled`'s phases."""
    return StepPlan(c.regime, c.seed, c.accumulate, precision.Precision(c.precision, device), group, compiled)


def finished_value(c: Config, client: MlflowClient, done: Run) -> float:
    """`returned_value` of a cell FINISHED before: its task's headline (valid_acc; a language model's valid_loss)
    at its last evaluation, logged as a result (no history to read), or for a trial its objective over the
    headline's history."""
    headline = make_task(c.task).headline.metric.name
    if c.optuna.study is None:
        return done.data.metrics[f"final_{headline}"]
    history = client.get_metric_history(done.info.run_id, headline)
    return returned_value(c, sorted((m.step, m.value) for m in history))


def returned_value(c: Config, points: list[tuple[int, float]]) -> float:
    """What a job returns to its sweeper, from its (step, valid_acc) evaluations: a trial, its objective
    (analysis.objective); a grid cell, whose value no sweeper reads, its final accuracy."""
    if c.optuna.study is None:
        return points[-1][1]
    value = trial.objective(points, c.analysis)
    log.info("%s: objective %.4f (%s)", c.run_name, value, trial.describe_objective(c.analysis, c.task.name))
    return value


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
    memory = measure_memory(model, train_data, c.regime, c.accumulate, device, make_task(c.task))
    bar = False if in_sweep and c.progress is None else c.progress  # in a sweep, the sweeper shows progress
    return train_and_track(c, resolved, key, choice, model, train_data, valid_data, dataset.meta, device, memory,
                           client, experiment_id, sweep_id, hydra_dir, bar, in_sweep, started_at, group)
