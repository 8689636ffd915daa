"""Under a precision: the same step on copies, as k micro-batches summed as that precision sums them and as one
batch, each against the same step in float64 (`precision_drift`), and the rule that says accumulation is
measurably further from float64 than the big batch (`measurably_worse`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from gaexp.check.errors import CheckError, NonFiniteError
from gaexp.check.loss import LossContract, loss_contract
from gaexp.check.trees import call_with, nonfinite, rel_diff, rows_of, safe_ratio
from gaexp.config import FP32, PrecisionConfig, precision_name
from gaexp.precision import DTYPES, Precision, as_precision


WORSE_RATIO = 2.0  # accumulation measurably worse than the big batch: this ratio of their errors (measurably_worse)


BACKOFFS = 40  # a GradScaler's halvings tried from its first scale (2^16 down to 2^-24) before a step is non-finite


LOW_DTYPES = (torch.bfloat16, torch.float16)  # outputs in these are cast to float32 for the loss, as training does


def precision_config_of(precision: PrecisionConfig | str) -> PrecisionConfig:
    """`as_precision`, an unknown name or a contradiction refused as input the check cannot use."""
    try:
        return as_precision(precision)
    except ValueError as e:
        raise CheckError(str(e)) from None


def dtype_name(key: str) -> str:
    """float32, bfloat16, float16: torch's name for a precision key's dtype (fp32, bf16, fp16)."""
    return str(DTYPES[key]).removeprefix("torch.")


def summed_in(p: PrecisionConfig) -> str:
    """The dtype a step's micro-batch gradients are summed in: the weights' (.grad), or float32 (a buffer)."""
    return dtype_name(FP32 if p.accumulate_in == FP32 else p.weights)


def precision_words(p: PrecisionConfig) -> str:
    """What a precision computes, in words, from its keys."""
    words = [f"the forward under torch.autocast({dtype_name(p.autocast)})"] if p.autocast != "none" else []
    if p.weights == FP32:
        words.append("float32 weights")
    else:
        low = dtype_name(p.weights)
        words.append(f"{low} weights (the inputs cast to {low}, the loss in float32)")
    words.append(f"micro-batch gradients summed in {summed_in(p)}" + (
        f", rounded to {dtype_name(p.weights)} once per step" if summed_in(p) != dtype_name(p.weights) else ""))
    if p.scaler:
        words.append("a GradScaler on the model's device")
    return "; ".join(words)


def measurably_worse(accumulated: float, big: float, floor: float) -> bool:
    """Whether the accumulated gradient is measurably further from float64 than the big batch's: more than
    WORSE_RATIO times its error, and by more than `floor`, one rounding of the gradient to its own dtype.

    Why these two: at one precision, the same step computed two ways differs by rounding alone. Micro-batch
    gradients summed in float32 round as often as the big batch does, and their error is the big batch's give or
    take (docs/check.md, "Under a precision": 1x on the study's CNN, 0.94x with its BatchNorms); a float32 buffer
    rounded once to bf16 adds one rounding, at most about sqrt(2)x where that rounding is as large as the big
    batch's whole error (1.1x on a linear classifier at 256 micro-batches). Beyond twice the big batch's error,
    what summing in bf16 adds, a rounding of the running sum at each of k additions, outweighs the precision's own
    rounding of the step (8.1x on that classifier). The floor keeps a ratio of two errors near nothing from
    counting: a difference smaller than storing the gradient in its dtype costs any step."""
    return accumulated > WORSE_RATIO * big and accumulated - big > floor


@dataclass(frozen=True)
class PrecisionDrift:
    """One training step under a precision against the same step in float64 (a float64 copy of the model with
    the weights the precision holds, the same inputs and micro-batches): the accumulated gradient's relative
    error and the big batch's, over all parameters."""
    precision: str  # gaexp's name (precision=): bf16, fp16, bf16w, bf16w-acc32, ...
    computes: str  # in words
    summed_in: str  # the dtype the micro-batch gradients are summed in
    accumulated_rel: float  # k micro-batches of b, summed as the precision sums them, against float64's
    big_rel: float  # one batch of b*k at the precision against float64's
    ratio: float  # accumulated_rel / big_rel
    floor: float  # one rounding of the gradient to its dtype (half its machine epsilon)
    worse: bool  # measurably_worse: accumulation does not stand in for the big batch at this precision
    remedy: str  # what to change when worse ("" otherwise)
    scale: float | None = None  # the GradScaler's loss scale the accumulated step ran at
    skipped: int = 0  # steps the scaler skipped (Inf or NaN) before that scale
    dtype: str = "float32"  # the gradients' (the weights'), whose one rounding is the floor


class Held(torch.optim.Optimizer):
    """An optimizer that takes no step: Precision.step rounds, unscales and checks the gradients, then leaves them
    in `.grad` to be read."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


def cast_floats(obj: Any, dtype: torch.dtype, only: Sequence[torch.dtype] | None = None) -> Any:
    """Every floating-point tensor in obj (of the dtypes `only`, if given) in `dtype`."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                    and (only is None or t.dtype in only) else t, obj)


def precise_step(model: nn.Module, precision: Precision, inputs: Any, targets: Any, contract: LossContract, n: int,
                  chunks: list[tuple[int, int]]) -> tuple[list[torch.Tensor], bool]:
    """One step as training takes it under `precision` (its forward, its backward of each 1/k-scaled loss, its
    sum, its step with an optimizer that moves nothing): each parameter's gradient, and whether the scaler
    skipped the step. `model` is the precision's own copy."""
    scale = contract.scale(len(chunks))
    if precision.dtype != torch.float32:
        inputs = cast_floats(inputs, precision.dtype)
    with torch.enable_grad():
        for start, stop in chunks:
            with precision.forward():
                outputs = call_with(model, contract.inputs_for(rows_of(inputs, start, stop, n), targets))
            outputs = cast_floats(outputs, torch.float32, LOW_DTYPES)  # the loss in float32 (training's .float())
            precision.backward(contract.value(outputs, rows_of(targets, start, stop, n), targets) * scale)
    skipped = precision.step(Held(precision.params)) if precision.params else False
    return [q.grad.detach() if q.grad is not None else torch.zeros_like(q) for q in precision.params], skipped


def flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1).double() for g in grads]) if grads else torch.zeros(0, dtype=torch.float64)


def precision_drift(model: nn.Module, inputs: Any, targets: Any,
                    loss: Callable[..., torch.Tensor] | LossContract | str | None = None, *, micro_batch: int,
                    num_accum: int, precision: PrecisionConfig | str) -> PrecisionDrift:
    """One training step of `model` (its training flags as they are; the model itself untouched) under
    `precision` (a PrecisionConfig, or gaexp's name: bf16, fp16, bf16w, bf16w-acc32), taken as `num_accum`
    micro-batches of `micro_batch` and as one batch, each against the same step in float64: a float64 copy of
    the model with the weights the precision holds (bf16w: its bf16 values), the same inputs, the same
    micro-batches, the gradients summed in float64. The loss contract is check_accumulation's.

    fp16's GradScaler starts at its own first scale and backs off as training's first steps do: a step it
    skips (Inf or NaN in a scaled gradient) is taken again at the halved scale, up to BACKOFFS times; a step
    still not finite, or one with no scaler, raises NonFiniteError. `worse`: `measurably_worse`."""
    p = precision_config_of(precision)
    contract = loss if isinstance(loss, LossContract) else loss_contract(loss)
    n = micro_batch * num_accum
    chunks = [(i * micro_batch, (i + 1) * micro_batch) for i in range(num_accum)]
    device = next((q.device for q in model.parameters()), torch.device("cpu"))
    reference = Precision(p, device).prepare(copy.deepcopy(model)).double()
    exact, low = {}, {}
    scale, skipped = None, 0
    for name, steps in (("accumulated", chunks), ("big", [(0, n)])):
        if name == "big" and num_accum == 1:  # one micro-batch is the big batch
            exact[name], low[name] = exact["accumulated"], low["accumulated"]
            continue
        float64 = Precision.float32()  # float32's calls (no autocast, no scaler, summed in .grad) on float64
        exact[name] = flat(precise_step(float64.prepare(copy.deepcopy(reference)), float64,
                                          cast_floats(inputs, torch.float64), cast_floats(targets, torch.float64), contract, n,
                                          steps)[0])
        run = Precision(p, device)  # built for the model's device: never GradScaler() alone, which means CUDA
        for _ in range(BACKOFFS):
            grads, was_skipped = precise_step(run.prepare(copy.deepcopy(model)), run, inputs, targets, contract, n,
                                               steps)
            if not was_skipped:
                break
        value = nonfinite(grads)
        if value:
            what = "one batch" if len(steps) == 1 else f"{len(steps)} micro-batches"
            raise NonFiniteError(f"the gradient is {value} under precision={p.name} after the step of {what}"
                                 + (f", the loss scale backed off {run.skipped} times to {run.scale:g}"
                                    if run.scale is not None else ""))
        low[name] = flat(grads)
        if name == "accumulated":
            scale, skipped = run.scale, run.skipped
    accumulated, big = rel_diff(low["accumulated"], exact["accumulated"]), rel_diff(low["big"], exact["big"])
    floor = torch.finfo(DTYPES[p.weights]).eps / 2
    worse = measurably_worse(accumulated, big, floor)
    return PrecisionDrift(p.name, precision_words(p), summed_in(p), accumulated, big, safe_ratio(accumulated, big), floor,
                          worse, precision_remedy(p) if worse else "", scale, skipped, dtype_name(p.weights))


def precision_remedy(p: PrecisionConfig) -> str:
    if summed_in(p) != dtype_name(FP32):
        summed = precision_name(p.autocast, p.weights, FP32, p.scaler)
        return (f"sum the micro-batch gradients in a float32 buffer, rounded to {dtype_name(p.weights)} once per "
                f"step: precision={summed} in gaexp (gaexp-check --accumulate-in fp32)")
    return ("the sum is float32 already: each micro-batch's own rounding adds up; fewer, larger micro-batches, or "
            "float32 (precision=fp32)")
