"""`check_accumulation`: one training step of any model taken as one batch and as k micro-batches, from the same
weights and samples, compared, in steps a reader can follow: the input checked (`_checked`), the step measured both
ways with the model and the random streams given back (`_measured`), the gradients and buffers compared
(`_gradient_diffs`, `_buffer_diffs`), and the `Report` with its causes and remedies.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from gaexp.check.coupling import coupling_modules
from gaexp.check.errors import CheckError, NonFiniteError
from gaexp.check.loss import MODEL_LOSS, LossContract, loss_contract, measure_loss_coupling
from gaexp.check.numerics import PrecisionDrift, precision_config_of, precision_drift
from gaexp.check.randomness import switch_off_random
from gaexp.check.remedies import causes_of, remedies_for
from gaexp.check.report import BufferDiff, Coupling, LossTerm, RandomModule, Report
from gaexp.check.state import Kept, Streams, cuda_devices
from gaexp.check.step import forward_fails, gradient_diffs, take_step
from gaexp.check.terms import measure_terms
from gaexp.check.trees import is_batched, module_label, nonfinite, rel_diff, rows_of, sample_axes
from gaexp.config import FP32, PrecisionConfig


MODES = ("train", "keep")  # every module in training mode, or the training flags as the model came


@dataclass(frozen=True)
class _Input:
    """What the step's arguments checked give: samples a step, the rounding threshold and how it was chosen, the
    loss's contract, the precision to measure after, the micro-batches' rows."""
    n: int
    rtol: float
    threshold: str
    contract: LossContract
    precision: PrecisionConfig | None
    chunks: list[tuple[int, int]]


@dataclass(frozen=True)
class _Measured:
    """The step taken both ways: each way's gradients and buffers, the modules that couple or were not tested, the
    loss's coupling, the random modules switched off, the modules in eval mode, and the drift under a precision."""
    big_grads: dict[str, torch.Tensor]
    acc_grads: dict[str, torch.Tensor]
    big_buffers: dict[str, torch.Tensor]
    acc_buffers: dict[str, torch.Tensor]
    modules: list[Coupling]
    untested: list[str]
    untested_why: dict[str, str]
    loss_rel: float
    loss_coupling: str
    terms: list[LossTerm]
    stochastic: list[RandomModule]
    eval_modules: list[str]
    drift: PrecisionDrift | None


def _checked(model: nn.Module, inputs: Any, targets: Any, loss: Callable[..., torch.Tensor] | str | None,
             micro_batch: int, num_accum: int, rtol: float | None, modes: str, precision: PrecisionConfig | str | None,
             num_items_in_batch: bool | Callable[[Any], int]) -> _Input:
    """The arguments, each refused in one line (CheckError; NonFiniteError for NaN or Inf in the inputs)."""
    if not isinstance(micro_batch, int) or micro_batch < 1:
        raise CheckError(f"micro_batch={micro_batch!r}; valid: an integer >= 1")
    if not isinstance(num_accum, int) or num_accum < 2:
        raise CheckError(f"num_accum={num_accum!r}; valid: an integer >= 2 (one step of 1 micro-batch is the "
                         "big batch itself)")
    if modes not in MODES:
        raise CheckError(f"modes={modes!r}; valid: {', '.join(MODES)}")
    n = micro_batch * num_accum
    contract = loss_contract(loss, num_items_in_batch)
    for what, obj in (("inputs", inputs), ("targets", targets)):
        if what == "targets" and obj is None and contract.in_model and not contract.items:
            continue  # the model's own loss, from labels among its inputs
        sizes = {tuple(t.shape)[:1] for t in tree_leaves(obj) if isinstance(t, torch.Tensor)}
        if (n,) not in sizes:
            raise CheckError(f"{what} have batch sizes {sorted(s[0] if s else 0 for s in sizes) or 'none'}; "
                             f"expected micro_batch * num_accum = {micro_batch} * {num_accum} = {n} "
                             "rows first in a tensor")
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    dtype = floating[0] if floating else torch.get_default_dtype()
    threshold = f"the square root of {str(dtype).removeprefix('torch.')}'s machine epsilon"
    if rtol is None:
        rtol = math.sqrt(torch.finfo(dtype).eps)
    elif not rtol > 0:
        raise CheckError(f"rtol={rtol!r}; valid: a number > 0")
    else:
        threshold = "given"
    if precision is not None:
        precision = precision_config_of(precision)
    chunks = [(i * micro_batch, (i + 1) * micro_batch) for i in range(num_accum)]
    value = nonfinite(inputs)
    if value:
        raise NonFiniteError(f"the inputs contain {value}")
    return _Input(n, rtol, threshold, contract, precision, chunks)


def _measured(model: nn.Module, inputs: Any, targets: Any, micro_batch: int, num_accum: int, seed: int, modes: str,
              given: _Input) -> _Measured:
    """The step as one batch and as k micro-batches from the same weights and random streams, the modules and the
    loss compared, the drift under a precision (on copies); the model and the streams given back however it ends."""
    n, rtol, contract, chunks = given.n, given.rtol, given.contract, given.chunks
    eval_modules = [module_label(name, model) for name, m in model.named_modules() if not m.training]
    kept, streams = Kept(model), Streams(cuda_devices(model))
    outer = streams.state()
    phase = "finding the random modules on a micro-batch"
    try:
        if modes == "train":
            model.train()
        try:
            stochastic, small = switch_off_random(model, contract.inputs_for(rows_of(inputs, 0, micro_batch, n), targets),
                                                  streams, rtol, seed)
        except (CheckError, NonFiniteError):
            raise
        except Exception as e:  # noqa: BLE001 - the user's forward, said in one line
            raise forward_fails(e, rows_of(inputs, 0, micro_batch, n), f"a micro-batch of {micro_batch}") from None
        phase = "the step as one batch"
        big_grads, big_buffers, full = take_step(model, kept, inputs, targets, n, [(0, n)], contract, streams, seed)
        phase = f"the step as {num_accum} micro-batches"
        acc_grads, acc_buffers, _ = take_step(model, kept, inputs, targets, n, chunks, contract, streams, seed)
        kept.restore_buffers()
        assert full is not None
        phase = "calling each module again on its micro-batches"
        modules, untested, untested_why = coupling_modules(model, full, small, n, micro_batch, chunks, rtol)
        phase = "the loss on the outputs split in micro-batches"
        root_axes = sample_axes(full.calls[""][0].output, small.calls[""][0].output, n, micro_batch)
        outputs = full.calls[""][0].output
        if root_axes is None:
            root_axes = [0 if is_batched(t, n) else None for t in tree_leaves(outputs)]
        loss_rel, loss_coupling, in_model = measure_loss_coupling(contract, outputs, root_axes, targets, n, chunks,
                                                                  rtol)
        terms: list[LossTerm] = []
        if in_model or contract.in_model:  # the loss reads outputs with no batch axis: measured through the model
            phase = "the loss's terms through the model"
            terms = measure_terms(model, inputs, targets, contract, n, chunks, root_axes, streams, seed, rtol)
            kept.restore_buffers()
            if modules:  # through the model, a term's difference holds the modules' coupling: not told apart
                terms = [replace(t, kind="modules", counts=[]) if t.kind else t for t in terms]
            loss_rel = terms[0].rel if terms and not modules else 0.0
            loss_coupling = next((t.kind for t in terms if t.kind not in ("", "modules")), "")
        drift = None
        if given.precision is not None and given.precision.name != FP32:  # on copies, with the check's modes
            phase = f"the step under precision {given.precision.name}"
            drift = precision_drift(model, inputs, targets, contract, micro_batch=micro_batch, num_accum=num_accum,
                                    precision=given.precision)
    except (CheckError, NonFiniteError):
        raise
    except Exception as e:  # noqa: BLE001 - whatever the model does to the check's machinery: one line, no traceback
        raise CheckError(f"the check failed in {phase}: {type(e).__name__}{where_raised(e)}: {e}"
                         .splitlines()[0][:400]) from None
    finally:
        kept.restore_all()
        streams.set(outer)
    return _Measured(big_grads, acc_grads, big_buffers, acc_buffers, modules, untested, untested_why, loss_rel,
                     loss_coupling, terms, stochastic, eval_modules, drift)


def where_raised(e: BaseException) -> str:
    """ in Module.function (file, line N): the innermost frame of the traceback, with the module it ran in."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return ""
    frame = tb.tb_frame
    owner = frame.f_locals.get("self")
    name = f"{type(owner).__name__}.{frame.f_code.co_name}" if isinstance(owner, nn.Module) else frame.f_code.co_name
    return f" in {name} ({os.path.basename(frame.f_code.co_filename)}, line {tb.tb_lineno})"


def scalar_text(t: torch.Tensor) -> str:
    return f"{t.item():g}" if t.numel() == 1 else ""


def _buffer_diffs(big_buffers: dict[str, torch.Tensor], acc_buffers: dict[str, torch.Tensor],
                  owners: dict[str, nn.Module], rtol: float) -> list[BufferDiff]:
    """The buffers that end the step differently after k micro-batches than after the big batch."""
    buffers = []
    for key, big in big_buffers.items():
        acc = acc_buffers[key]
        rel = rel_diff(acc, big)
        if rel > rtol:
            module = key.rpartition(".")[0]
            buffers.append(BufferDiff(key, module, type(owners[module]).__name__, rel, scalar_text(big),
                                      scalar_text(acc)))
    return buffers


def check_accumulation(model: nn.Module, inputs: Any, targets: Any = None,
                       loss: Callable[..., torch.Tensor] | str | None = None, *, micro_batch: int, num_accum: int,
                       rtol: float | None = None, seed: int = 0, modes: str = "train",
                       norm_choices: bool = False, precision: PrecisionConfig | str | None = None,
                       num_items_in_batch: bool | Callable[[Any], int] = False) -> Report:
    """One training step of `model` on `inputs`/`targets` (micro_batch * num_accum samples, the batch first in
    every tensor; `inputs` a tensor, or a tuple/list of positional arguments, or a dict of keyword arguments)
    taken as one batch and as `num_accum` micro-batches, compared.

    `loss(outputs, targets)` is cross-entropy by default and is treated as a mean over its micro-batch: each
    micro-batch's loss is scaled by 1/num_accum. A loss that takes the whole step's targets, as a third
    positional parameter (`loss(outputs, targets, step_targets)`) or a keyword-only `step_targets`, is given
    them and is not scaled (it normalizes by the step itself, e.g. by the step's total count of valid tokens); so is
    one that takes `num_items_in_batch` (transformers' Trainer's `compute_loss_func(outputs, labels,
    num_items_in_batch)`), given the step's count of target items that are not -100. `loss="model"`: the loss the
    model's forward returns (`outputs.loss`, from labels among its inputs; `targets` may then be None), scaled by
    1/num_accum as the Trainer does without `num_items_in_batch`; with `num_items_in_batch=True` (the count of
    items not -100 in the step's targets) or a function of the step's targets giving the count, the model's forward
    is given that count as `num_items_in_batch=` and the loss is not scaled, as the Trainer does when the model
    takes loss keywords. A loss computed in the forward is measured term by term through the model
    (`report.terms`: the loss as given and each loss-like output, aux_loss, with the kind of each coupling).
    `rtol`: the float-rounding threshold, by default the square root of the parameters' machine epsilon (3.5e-4
    in float32). `modes`: "train" puts every module in training mode (the report names those the model came with
    in eval mode), "keep" checks the training flags as they are. `norm_choices`: remedies name gaexp's `norm=`
    choices (for a gaexp model) instead of what to change in one's own model. `precision` (a PrecisionConfig, or
    gaexp's name: bf16, fp16, bf16w, bf16w-acc32): after the check, which stays in float32, the step under that
    precision against float64 (`precision_drift`, with the check's modes), in `report.precision`; None or fp32:
    none. Raises CheckError for input it cannot use and NonFiniteError for NaN or Inf in the step."""
    tic = time.perf_counter()
    if targets is None and loss == MODEL_LOSS and isinstance(inputs, Mapping):
        targets = inputs.get("labels")  # the model's own loss: its labels are the targets
    given = _checked(model, inputs, targets, loss, micro_batch, num_accum, rtol, modes, precision, num_items_in_batch)
    m = _measured(model, inputs, targets, micro_batch, num_accum, seed, modes, given)
    rtol, contract = given.rtol, given.contract
    tensors, gradient_rel = gradient_diffs(m.big_grads, m.acc_grads, rtol)
    owners = dict(model.named_modules())
    buffers = _buffer_diffs(m.big_buffers, m.acc_buffers, owners, rtol)
    loss_couples = m.loss_rel > rtol or any(t.kind not in ("", "modules") for t in m.terms)  # a term: its share
    grad_differs = gradient_rel > rtol or any(t.flagged for t in tensors)
    unexplained = grad_differs and not m.modules and not loss_couples
    return Report(
        safe=not (grad_differs or m.modules or buffers or loss_couples), micro_batch=micro_batch,
        num_accum=num_accum, rtol=rtol, threshold=given.threshold,
        loss=contract.described(num_accum),
        gradient_rel=gradient_rel, tensors=tensors, modules=m.modules, buffers=buffers, loss_rel=m.loss_rel,
        loss_couples=loss_couples, unexplained=unexplained, stochastic=m.stochastic, untested=m.untested,
        untested_why=m.untested_why,
        remedies=remedies_for(m.modules, buffers, owners, m.loss_coupling, contract, norm_choices, m.terms,
                              transformers_model(model)),
        seconds=time.perf_counter() - tic, causes=causes_of(m.modules, buffers, m.loss_coupling, unexplained, m.terms,
                                                            contract),
        loss_coupling=m.loss_coupling, mode=modes, eval_modules=m.eval_modules, precision=m.drift, terms=m.terms)


def transformers_model(model: nn.Module) -> bool:
    """A transformers model (its remedies are said in transformers' terms): by its class's module, nothing imported."""
    return type(model).__module__.startswith("transformers.")
