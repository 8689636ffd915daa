"""One training step from the kept weights, as one batch or as k micro-batches (each loss scaled by 1/k): its
gradients, its buffers, and the whole batch's recorded forward.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from gaexp.check.errors import CheckError, NonFiniteError
from gaexp.check.loss import LossContract
from gaexp.check.recorder import Recorder
from gaexp.check.report import TensorDiff
from gaexp.check.state import Kept, Streams
from gaexp.check.trees import call_with, diff_norms, nonfinite, rows_of, safe_ratio


def forward_fails(e: Exception, inputs: Any, what: str) -> CheckError:
    shapes = [tuple(t.shape) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    return CheckError(f"the model's forward fails on {what} (inputs of shape {', '.join(map(str, shapes))}): "
                      f"{type(e).__name__}: {e}".splitlines()[0])


def take_step(model: nn.Module, kept: Kept, inputs: Any, targets: Any, n: int, chunks: list[tuple[int, int]],
          contract: "LossContract", streams: Streams, seed: int
          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Recorder | None]:
    """One step from the kept weights, in the given row ranges: (each parameter's gradient, each buffer after,
    the recorded forward for the one-batch step). NaN or Inf anywhere raises NonFiniteError."""
    kept.restore_buffers()
    params = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    for _, p in params:
        p.grad = None
    whole = len(chunks) == 1
    scale = contract.scale(len(chunks))
    recorder = None
    streams.seed(seed)
    with torch.enable_grad():
        for i, (start, stop) in enumerate(chunks):
            part = contract.inputs_for(rows_of(inputs, start, stop, n), targets)
            where = "the whole batch" if whole else f"micro-batch {i + 1} of {len(chunks)} (rows {start}:{stop})"
            try:
                if whole:
                    with Recorder(model, streams, draws=False) as recorder:
                        outputs = call_with(model, part)
                else:
                    outputs = call_with(model, part)
            except Exception as e:  # noqa: BLE001 - the user's forward, said in one line
                raise forward_fails(e, part, f"a batch of {stop - start}") from None
            value = nonfinite(outputs)
            if value:
                first = recorder.first_nonfinite(model) if recorder else ""
                raise NonFiniteError(f"{first or f'the output contains {value}'} in the forward of {where}")
            loss = contract.value(outputs, rows_of(targets, start, stop, n), targets)
            if not torch.isfinite(loss):
                raise NonFiniteError(f"the loss is {loss.item()} on {where}, its outputs finite")
            (loss * scale).backward()
    gradients = {k: (p.grad.detach() if p.grad is not None else torch.zeros_like(p)) for k, p in params}
    for _, p in params:  # the next step starts from none; these tensors are the step's own, not copied
        p.grad = None
    for key, g in gradients.items():
        value = nonfinite(g)
        if value:
            raise NonFiniteError(f"the gradient of {key} is {value} after the step of "
                                 f"{'the whole batch' if whole else f'{len(chunks)} micro-batches'}, the loss finite")
    return gradients, {k: b.detach().clone() for k, b in model.named_buffers()}, recorder


def gradient_diffs(big_grads: dict[str, torch.Tensor], acc_grads: dict[str, torch.Tensor],
                    rtol: float) -> tuple[list[TensorDiff], float]:
    """Each parameter's accumulated gradient against the big batch's (flagged above rtol, with a floor for a gradient
    that is zero up to rounding: its share of the whole gradient's norm), and the relative difference overall."""
    norms = {key: diff_norms(acc_grads[key], big) for key, big in big_grads.items()}  # (|acc - big|, |big|)
    total = math.sqrt(sum(ref ** 2 for _, ref in norms.values()))
    size = sum(g.numel() for g in big_grads.values()) or 1
    tensors = []
    for key, big in big_grads.items():
        diff, ref = norms[key]
        floor = ref + total * math.sqrt(big.numel() / size)
        tensors.append(TensorDiff(key, safe_ratio(diff, ref), diff > rtol * floor))
    return tensors, safe_ratio(math.sqrt(sum(diff ** 2 for diff, _ in norms.values())), total)
