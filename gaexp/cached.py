"""The cached engine (`accumulate=cached`): GradCache's step (Gao et al. 2021), a loss over the whole step's
outputs computed exactly at one micro-batch's activation memory.

1. Each of the step's k micro-batches forward without a graph: the step's outputs, held (b*k rows of the output's
   width: a contrastive task's projections, small beside the activations).
2. The step's loss on those outputs (the task's `step_loss`: a contrastive task's InfoNCE over all of them, for
   negatives=step) and its gradient with respect to each output.
3. Each micro-batch forward again, now with its graph, and backward with its slice of that gradient (as the
   surrogate sum(outputs * gradient), whose gradient with respect to the outputs is that slice exactly): the
   weights' gradients add up to the step's loss's, one micro-batch's graph held at a time.

Both passes of a micro-batch see the same inputs, weights and random numbers (the RNG state is restored before the
second), so the same outputs. A layer that couples the samples of a batch (BatchNorm) normalizes by each
micro-batch's own statistics in both passes: the loop's chunked statistics, the same in the first pass and the
second, never the whole step's. Its running statistics are put back after the first pass, so that they are updated
by the second alone, once per micro-batch in order, as the loop updates them. The cached step is therefore the
loop's step for the same loss (the loop holding every micro-batch's graph until the step's one backward), proven
in float64 by tests/test_cached.py; it is the big batch's step only where no layer couples the samples.

With k = 1 the step is one micro-batch: one forward and backward, as the loop computes it.

A task whose loss reads the model beyond its outputs (an MoE's balancing loss reads its router) is refused, as
are replicas: gaexp/engine.py.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from gaexp.data.batches import Draw, Split
from gaexp.precision import Precision
from gaexp.task import Task
from gaexp.task.classify import Classify


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The random state a forward draws from (dropout): the CPU's, and the CUDA device's where it runs there."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def accumulate_cached(model: nn.Module, data: Split, batches: Iterator[Draw], num_accum: int,
                      precision: Precision | None = None, task: Task | None = None) -> torch.Tensor:
    """The step of `task`'s loss over the next `num_accum` micro-batches' outputs in GradCache's two passes (see the
    module's docstring), under `precision` (its autocast on both forwards and the loss; its scale and sum on each
    micro-batch's backward); returns the step's loss as a device tensor (no host synchronization)."""
    precision, task = precision or Precision.float32(), task or Classify()
    steps = [data.batch(next(batches)) for _ in range(num_accum)]
    if num_accum == 1:  # the step is one micro-batch: nothing to cache, one forward and backward (the loop's)
        (inputs, targets), = steps
        with precision.forward():
            loss = task.step_loss(model(inputs), targets, 1)
        precision.backward(loss)
        return loss.detach()
    device = data.labels.device
    buffers = [b.clone() for b in model.buffers()]  # running statistics, as they were before the step
    states, outputs = [], []
    with torch.no_grad():
        for inputs, _ in steps:
            states.append(rng_state(device))
            with precision.forward():
                outputs.append(model(inputs))
        for buffer, before in zip(model.buffers(), buffers):  # the second pass alone updates them
            buffer.copy_(before)
    cache = torch.cat(outputs).requires_grad_()
    with precision.forward():
        loss = task.step_loss(cache, torch.cat([targets for _, targets in steps]), num_accum)
    (gradient,) = torch.autograd.grad(loss, cache)
    for (inputs, _), state, slice_ in zip(steps, states, gradient.split([len(o) for o in outputs])):
        set_rng_state(state, device)
        with precision.forward():
            again = model(inputs)
        precision.backward((again * slice_).sum())
    return loss.detach()
