"""Which engine computes a run's optimizer steps: `accumulate=auto` resolved, once per run, to the one it uses.

auto takes the batched engine (gaexp/batched.py: the step's b*k samples in one pass) where it computes the
loop's step: every layer that couples the samples of a batch is one it chunks exactly, the b*k samples are
within the training split, and a step's memory with b*k samples held at once fits this machine. Otherwise, for a
loss over the whole step's outputs (a task's OUTPUTS: a contrastive task's negatives=step) over k > 1
micro-batches, the cached engine (gaexp/cached.py), which holds one micro-batch's activations where the loop would
hold the step's; otherwise the loop (gaexp/train.py `accumulate`). Either fallback says why in one line. `loop`,
`batched` and `cached` are taken as given (each still refuses what it cannot compute exactly: a model batched
cannot chunk; for cached, a loss that reads the model beyond its outputs, and replicas).

A run records the engine it used (its `accumulate` param and tag), and that engine is part of its protocol key:
the engines agree within seed noise but not bit for bit, so their runs never pool silently. Under auto a
cell FINISHED by any engine counts as done (`keys`): a loop store from before auto resumes with no rerun. The
engines compute one objective: whose negatives a contrastive loss counts is the task's key (task.negatives), not
an engine's, so two engines' runs of a cell never differ in what they optimize.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torch import nn

from gaexp.batched import UnchunkableError, coupled_layers
from gaexp.config import AUTO_ENGINE, BATCHED, CACHED, ENGINES, LOOP, PrecisionConfig
from gaexp.task import Task

@dataclass(frozen=True)
class Choice:
    engine: str  # loop or batched: what computes the run's steps
    setting: str  # what the config asked: loop, batched or auto
    reason: str = ""  # auto's fallback to the loop or the cached engine: why not batched (one line)
    per_sample: bool = False  # auto took batched and no layer of the model couples a batch's samples

    @property
    def fell_back(self) -> bool:
        return self.setting == AUTO_ENGINE and self.engine != BATCHED


def loop_only(precision: PrecisionConfig, num_accum: int) -> str | None:
    """Why only the loop computes what `precision` asks, or None: bf16 weights whose micro-batch gradients are
    summed in bf16 (accumulate_in=param) over k > 1 micro-batches. The batched engine's one backward sums a
    step's samples inside its kernels, never in k bf16 roundings."""
    if precision.weights != "fp32" and precision.accumulate_in == "param" and num_accum > 1:
        return (f"precision={precision.name} sums {num_accum} micro-batch gradients in {precision.weights}, one "
                "backward at a time; the batched engine's one backward sums them inside its kernels")
    return None


def cached_problem(task: Task | None, replicas: int) -> str | None:
    """Why the cached engine cannot compute this step exactly, or None: a loss that reads the model beyond its
    outputs (an MoE's balancing term reads the router's forward, which the loss on cached outputs never sees), or
    replicas (each would cache only its own share of the step's outputs)."""
    if task is not None and task.reads_model:
        return ("its loss reads the model beyond its outputs (task.balance: the router's forward), and the cached "
                "engine computes the loss from the step's outputs alone")
    if replicas > 1:
        return (f"regime.replicas={replicas}: each replica would cache only its own share of the step's outputs")
    return None


def choose(setting: str, model: nn.Module, batch_size: int, num_accum: int, split: int | None,
           memory_problem: Callable[[str], str | None], precision: PrecisionConfig | None = None,
           task: Task | None = None, replicas: int = 1) -> Choice:
    """The engine for `setting` (loop, batched, cached, auto); `split`: the training images the batches are drawn
    from (None: not known yet, `within_split` checks it once read); `memory_problem(engine)`: None when a step of
    that engine fits this machine, else the one-line reason; `precision`: what only the loop computes
    (`loop_only`) is refused for batched and falls back under auto; `task`: a loss over the whole step's outputs
    falls back to the cached engine, and one that reads the model is refused by it. For loop and batched, their
    own checks refuse what they cannot run (gaexp/cell.py)."""
    only = loop_only(precision, num_accum) if precision is not None else None
    if setting == BATCHED and only:
        raise ValueError(f"accumulate=batched: {only}; valid: accumulate=loop or auto, or "
                         "precision.accumulate_in=fp32 (summed in float32, as the batched engine computes)")
    cached = cached_problem(task, replicas)
    if setting == CACHED and cached:
        raise ValueError(f"accumulate=cached: {cached}; valid: accumulate=loop, batched or auto")
    if setting != AUTO_ENGINE:
        return Choice(setting, setting)
    fallback = CACHED if task is not None and task.whole_outputs and num_accum > 1 and cached is None else LOOP
    if only:
        return Choice(LOOP, setting, only)
    try:
        coupled = coupled_layers(model)
    except UnchunkableError as e:
        return Choice(fallback, setting,
                      str(e).removeprefix("accumulate=batched: ").removesuffix("; run accumulate=loop"))
    n = batch_size * num_accum
    if split is not None and n > split:
        return Choice(fallback, setting, f"a step's {batch_size} x {num_accum} samples are more than the {split:,} "
                                         "training images")
    problem = memory_problem(BATCHED)
    if problem is not None:
        return Choice(fallback, setting, f"a step's {n:,} samples at once do not fit: {problem}")
    return Choice(BATCHED, setting, per_sample=not coupled)


def within_split(choice: Choice, batch_size: int, num_accum: int, split: int, task: Task | None = None,
                 replicas: int = 1) -> Choice:
    """`choice` once the training split's size is known: auto's batched engine falls back (to the cached engine
    or the loop, as `choose` would) where the b*k samples of a step are more than the split holds."""
    if choice.setting == AUTO_ENGINE and choice.engine == BATCHED and batch_size * num_accum > split:
        return choose(AUTO_ENGINE, nn.Identity(), batch_size, num_accum, split, lambda e: None, task=task,
                      replicas=replicas)
    return choice


def notice(choice: Choice, run_name: str) -> str | None:
    """The one line a run prints when auto fell back to the loop or the cached engine."""
    if not choice.fell_back:
        return None
    engine = "the loop" if choice.engine == LOOP else "the cached engine"
    return f"{run_name}: accumulate=auto trains with {engine}: {choice.reason}"


def keys(resolved: Mapping[str, Any], choice: Choice, protocol_key: Callable[[Mapping[str, Any]], str]) -> list[str]:
    """The protocol keys of the runs that count as this cell done: the chosen engine's first; under auto, the
    other engine's too (a cell FINISHED by either is not run again)."""
    engines = [choice.engine, *(e for e in ENGINES if e != choice.engine)] if choice.setting == AUTO_ENGINE \
        else [choice.engine]
    return [protocol_key({**resolved, "accumulate": engine}) for engine in engines]


def one_pass(choice: Choice, task: Task, replicas: int) -> bool:
    """Whether the cell's steps are those of its one micro-batch of b*k, whatever its b and k: auto took the batched
    engine (one pass over a step's b*k samples), no layer of the model couples the samples (none is chunked by b),
    the task's loss is the same however the step is split (`Task.split_free`), and one replica computes the step."""
    return (choice.setting == AUTO_ENGINE and choice.engine == BATCHED and choice.per_sample and task.split_free
            and replicas == 1)


def arithmetic_key(resolved: Mapping[str, Any], choice: Choice, task: Task,
                   protocol_key: Callable[[Mapping[str, Any]], str]) -> str | None:
    """The key of the steps this cell's engine will compute, or None where only this cell computes them. Cells of
    one key train the same model on the same samples in the same order with the same arithmetic, bit for bit
    (`one_pass`: bs1a16 and bs4a4 are bs16a1): the cell's protocol (`protocol_key`: model, norm, data, seed,
    precision, optimizer, steps, ...) with the regime as one micro-batch of b*k and the engine batched, beside the
    compile setting, which changes the kernels."""
    regime = resolved["regime"]
    if not one_pass(choice, task, regime.get("replicas", 1)):
        return None
    step = regime["batch_size"] * regime["num_accum"]
    as_one = {**resolved, "regime": {**regime, "batch_size": step, "num_accum": 1}, "accumulate": BATCHED}
    compiled = resolved.get("compile")  # a runtime key, outside the protocol key: its kernels are not eager's
    return hashlib.sha256(f"{protocol_key(as_one)}:{compiled}".encode()).hexdigest()[:16]
