"""The training core: the study's protocol with exact gradient accumulation (docs/study.md).

Nothing here knows about Hydra or MLflow: `train` tells its hooks (gaexp/hooks.py) what happens
and returns the history.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from gaexp.batched import Chunking, accumulate_batched
from gaexp.cached import accumulate_cached
from gaexp.config import COMPILE_CHOICES, ENGINES, Config, RegimeConfig, TrainConfig
from gaexp.data.batches import Draw, Split, counted, micro_batches
from gaexp.hooks import EvalPoint, Hook
from gaexp.machine import device_type
from gaexp.norms import compiled_training
from gaexp.optim import adam
from gaexp.precision import Precision
from gaexp.replicas import Replicas, replica_draws, summing_locally
from gaexp.task import MICRO, Task
from gaexp.task.classify import Classify

CLASSIFY = Classify()  # the default task: image classification, as every run before tasks

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; asking for CUDA without one is an error (the name is checked by the schema)."""
    if name == "auto":
        return torch.device(device_type(name))
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch.cuda.is_available() is False; valid here: auto, cpu")
    return torch.device(name)


class _NoCudaHome(logging.Filter):
    """Drops torch's `No CUDA runtime is found, using CUDA_HOME=...`, which every compiled cell on a CPU
    machine with a CUDA toolkit printed: true and of no use to a CPU run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


def quiet_cuda_home() -> None:
    """Install `_NoCudaHome` on torch's extension logger once (before Inductor first imports it)."""
    cpp_log = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, _NoCudaHome) for f in cpp_log.filters):
        cpp_log.addFilter(_NoCudaHome())


def compiler_missing(device: torch.device) -> str | None:
    """Why Inductor cannot compile here (it needs a C++ compiler for the CPU), or None."""
    if device.type != "cpu":
        return None
    if not torch.cuda.is_available():
        quiet_cuda_home()
    from torch._inductor.cpp_builder import get_cpp_compiler
    try:
        get_cpp_compiler()
    except Exception as e:  # what Inductor itself would raise at the first compiled call
        return f"no C++ compiler for torch.compile on the CPU ({type(e).__name__}: {e})"
    return None


def compile_phases(choice: str, norm: str, device: torch.device) -> frozenset[str]:
    """The phases ("train", "eval") that run through torch.compile for `compile=choice`.

    auto: evaluation for every norm, training too for the norms whose eager layers are slow in
    channels_last (their declaration, gaexp/norms.py); eager when no compiler is installed.
    Training compiled or not follows the same arithmetic up to rounding; evaluation's predictions
    differ only on near ties (tests/test_train.py)."""
    phases = planned_phases(choice, norm)
    missing = compiler_missing(device) if phases else None
    if missing and choice == "auto":
        log.warning("%s: running eager, slower (compile=off silences this)", missing)
        return frozenset()
    if missing:
        raise ValueError(f"compile={choice!r} but {missing}; valid here: off, auto")
    return phases


def planned_phases(choice: str, norm: str) -> frozenset[str]:
    """Pure: `compile_phases` where a compiler is installed (what a sweep's plan counts on)."""
    phases = {"off": frozenset(), "eval": frozenset({"eval"}), "all": frozenset({"train", "eval"}),
              "auto": frozenset({"train", "eval"} if compiled_training(norm) else {"eval"})}
    if choice not in phases:
        raise ValueError(f"compile={choice!r}; valid: {', '.join(COMPILE_CHOICES)}")
    return phases[choice]


def accumulate(model: torch.nn.Module, data: Split, batches: Iterator[Draw], num_accum: int,
               precision: Precision | None = None, task: Task = CLASSIFY) -> torch.Tensor:
    """Forward and backward `num_accum` micro-batches under `precision` (default fp32: its autocast, its loss scale,
    its sum in `.grad` or a float32 buffer; the loss in float32), each loss normalized as `task` declares
    (gaexp/task/): a micro-batch's mean scaled by 1/k, or a sum divided by the step's count of items, counted over
    the step's k micro-batches before the first backward, plus any term of its own (`extra`: an MoE's balancing
    loss, with a pass over the step first where it needs one, `begin_step`).

    Gradients add up; returns the step's loss (the mean of the micro-batches' means, or the step's sum over its
    count) as a device tensor (no host synchronization).
    """
    precision = precision or Precision.float32()
    draws = [next(batches) for _ in range(num_accum)]
    if task.whole_outputs:
        return held_step(model, data, draws, precision, task)
    whole = [data.batch(d) for d in draws] if task.whole_step else None  # made once, where the task reads the step
    count = None if task.normalization == MICRO else sum(task.count(targets) for _, targets in whole)
    if task.step_pass:
        with torch.no_grad(), precision.forward():
            task.begin_step(model, whole)  # what the loss needs of the whole step before a backward
    total = torch.zeros((), device=data.labels.device)
    for j, draw in enumerate(draws):
        with summing_locally(model, last=j == num_accum - 1):  # under DDP: one all-reduce per step
            inputs, targets = whole[j] if whole is not None else data.batch(draw)
            with precision.forward():
                loss = task.loss(model(inputs), targets)
                extra = task.extra(targets, j, num_accum)  # an MoE's balancing term, normalized by the task
            share = loss / num_accum if count is None else loss / count
            precision.backward(share if extra is None else share + extra)
        total += loss.detach()
    return total / num_accum if count is None else total / count


def held_step(model: torch.nn.Module, data: Split, draws: Sequence[Draw], precision: Precision, task: Task
              ) -> torch.Tensor:
    """The loop's step of a loss over the whole step's outputs (OUTPUTS: a contrastive task's negatives=step): each
    micro-batch forward in turn, every graph held, then the step's one loss and one backward (the step's memory;
    accumulate=cached computes the same at one micro-batch's, gaexp/cached.py)."""
    outputs, targets = [], []
    for draw in draws:
        inputs, target = data.batch(draw)
        with precision.forward():
            outputs.append(model(inputs))
        targets.append(target)
    with precision.forward():
        loss = task.loss(torch.cat(outputs), torch.cat(targets))
    precision.backward(loss)
    return loss.detach()


def step_function(engine: str, model: torch.nn.Module, batch_size: int, views: int = 1) -> Callable[..., torch.Tensor]:
    """What computes an optimizer step's gradient for `accumulate=engine`, called as `accumulate` is:
    loop, `accumulate` (under DDP, `no_sync` until the step's last micro-batch); batched, `accumulate_batched` with
    the model's coupling layers chunked by a micro-batch's rows, `batch_size` times the task's `views`
    (gaexp/batched.py; a model it cannot chunk exactly is refused): one backward, so under DDP one all-reduce, as it
    is; cached, `accumulate_cached` (gaexp/cached.py): a loss over the step's outputs at one micro-batch's memory."""
    if engine == "loop":
        return accumulate
    if engine == "batched":
        return functools.partial(accumulate_batched, chunking=Chunking(model, batch_size * views))
    if engine == "cached":
        return accumulate_cached
    raise ValueError(f"accumulate={engine!r}; valid: {', '.join(ENGINES)}")


def evaluate(model: torch.nn.Module, data: Split, batch_size: int = 256, precision: Precision | None = None,
             task: Task = CLASSIFY) -> dict[str, float]:
    """`task`'s metrics of `model` on the whole split in eval mode, in batches of `batch_size`, under the training's
    autocast (image classification: {"valid_acc": accuracy})."""
    return task.evaluate(model, data, batch_size, precision or Precision.float32())


@dataclass(frozen=True)
class StepPlan:
    """How each optimizer step is computed: `regime.num_accum` micro-batches of `regime.batch_size` in the data
    order of `seed` (and its augmentation), by `engine` (`step_function`), under `precision` (default fp32,
    gaexp/precision.py: the model and data already in its weights' dtype), as one of `replicas` (gaexp/replicas.py;
    None: alone), with the phases in `compiled` ("train", "eval") through torch.compile."""

    regime: RegimeConfig
    seed: int
    engine: str = "loop"
    precision: Precision | None = None
    replicas: Replicas | None = None
    compiled: frozenset[str] = frozenset()


def train(model: torch.nn.Module, train_data: Split, valid_data: Split | None, cfg: TrainConfig, plan: StepPlan,
          task: Task = CLASSIFY, hooks: Sequence[Hook] = ()) -> list[EvalPoint]:
    """Adam on `cfg.num_iterations` optimizer steps computed as `plan` says, the loss `task`'s (gaexp/task/);
    evaluates every `cfg.eval_period` steps and at the last step. Compiled phases run one static graph per shape
    (Inductor caches them on disk). A step a scaler skips is counted, not retried. Under `plan.replicas` the model
    is under DDP, its micro-batches its share of each step's, the train loss the replicas' mean, and only rank 0
    evaluates (`valid_data` None elsewhere)."""
    regime, compiled = plan.regime, plan.compiled
    if compiled:  # a worker process runs many cells: start each with no graphs in memory, or Dynamo's
        torch._dynamo.reset()  # recompile limit would silently turn later cells eager (Inductor's disk cache stays)
    forward = torch.compile(model, dynamic=False) if "train" in compiled else model
    eval_forward = torch.compile(model, dynamic=False) if "eval" in compiled else model
    optimizer = adam(model.parameters(), cfg.lr)  # torch's Adam, without its compiler on the CPU (gaexp/optim.py)
    precision = plan.precision or Precision.float32()
    precision.prepare(model)
    task.attach(model)
    task.prepare(train_data)
    gradient = step_function(plan.engine, model, regime.batch_size, task.views)
    batches = micro_batches(len(train_data), regime.batch_size, plan.seed, train_data.augment, train_data.labels.device)
    items = [0]  # every replica's items drawn so far, where the task has a speed of its own (a language model's tokens)
    batches = counted(batches, train_data, items) if task.speed is not None else batches
    if plan.replicas is not None:
        forward, batches = plan.replicas.wrap(forward), replica_draws(batches, plan.replicas.rank, plan.replicas.world,
                                                                      regime.num_accum)
    losses = torch.zeros(cfg.num_iterations, device=train_data.labels.device)  # each step's loss
    history: list[EvalPoint] = []
    train_seconds, tic = 0.0, time.perf_counter()
    model.train()
    try:
        for step in range(1, cfg.num_iterations + 1):
            losses[step - 1] = gradient(forward, train_data, batches, regime.num_accum, precision, task)
            precision.step(optimizer)  # under a scaler, skipped whole where a gradient is not finite
            optimizer.zero_grad()
            for hook in hooks:
                hook.after_step(step, losses)
            if step % cfg.eval_period and step < cfg.num_iterations:
                continue
            train_seconds += time.perf_counter() - tic  # evaluations are left out of the training rate
            window = losses[max(0, step - cfg.loss_window):step]
            train_loss = (window if plan.replicas is None else plan.replicas.mean(window)).mean().item()
            if valid_data is not None:
                for hook in hooks:
                    hook.before_eval(model, step)
                samples_per_sec = step * regime.samples / train_seconds
                speed = {task.speed.name: float(items[0]) / train_seconds} if task.speed is not None else {}
                history.append(EvalPoint(step, train_loss, evaluate(eval_forward, valid_data, cfg.eval_batch_size,
                                                                    precision, task), samples_per_sec, precision.scale,
                                         precision.skipped if precision.scaler.is_enabled() else None, speed))
                for hook in hooks:
                    hook.after_eval(history[-1])
            tic = time.perf_counter()
    finally:
        for hook in hooks:
            hook.close()
    return history


def deterministic_cuda() -> None:
    """CUDA as repeatable as PyTorch makes it: deterministic kernels where they exist (an op without one
    warns, naming itself, in the cell's log), the cuBLAS workspace they need, no cuDNN autotuning. The
    workspace setting is read when cuBLAS starts, so it is set before the first CUDA matmul of the process
    (a value the user set is kept)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def step_plan(c: Config, device: torch.device, group: Replicas | None,
              compiled: frozenset[str] = frozenset()) -> StepPlan:
    """How the cell's steps are computed (gaexp/train.py): its regime, seed, engine and precision, as one of
    `group`'s replicas, with `compiled`'s phases."""
    return StepPlan(c.regime, c.seed, c.accumulate, Precision(c.precision, device), group, compiled)
