"""Accumulation in one batched pass (`accumulate=batched`): an optimizer step's k micro-batches of b computed
as one forward and one backward over their b*k samples, with the same arithmetic as the loop.

Within a step every micro-batch sees the same weights, so their passes are independent except where a layer
couples the samples of a batch: BatchNorm and its remedies (statistics over the batch, running buffers updated
once per call). Those layers take the b*k samples in k chunks of b, in the loop's order, so each normalizes
by its micro-batch's statistics and updates its buffers k times in sequence, as in the loop (Batch Renorm's r
and d read the running statistics before each chunk). Every other layer is per sample and runs on the whole
batch. The loss is the mean over b*k samples: the loop's sum of k micro-batch means, each scaled by 1/k. What
differs is float rounding only (reductions summed in another order), proven per norm and regime by
tests/test_batched.py.

Which layers couple their samples, each layer says: a norm's layer carries its declaration
(`couples_samples`, gaexp/norms.py: the registry's norms, and a norm of one's own that declares it on its
class). Torch's own layers, declaring nothing, are known by their exact type. A leaf layer that neither
declares itself nor is one of those (an undeclared layer of one's own, dropout, a subclass with its own
forward) is refused in one line, never run approximately. Modules with children and no parameters of their
own (the models' blocks) are read as compositions of their layers.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from gaexp.data.batches import Draw, Split
from gaexp.model import ZeroPadShortcut
from gaexp.norms import COUPLES
from gaexp.precision import Precision
from gaexp.task import Task
from gaexp.task.classify import Classify

# Layers that compute each sample from that sample alone, in training as in evaluation.
PER_SAMPLE: tuple[type[nn.Module], ...] = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.Identity, nn.Flatten, nn.GroupNorm, nn.LayerNorm,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.ELU, nn.Tanh, nn.Sigmoid, nn.Hardswish, nn.Mish,
    nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d,
    nn.Embedding, nn.RMSNorm, ZeroPadShortcut)
# Torch's layers that couple a batch's samples in training, chunked by b; InstanceNorm only when it tracks running
# statistics (their update averages over the batch), per sample otherwise.
COUPLED: tuple[type[nn.Module], ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
INSTANCE: tuple[type[nn.Module], ...] = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


class UnchunkableError(ValueError):
    """A model with a layer `accumulate=batched` cannot compute exactly as the loop does."""


def coupled_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every layer that couples the samples of a batch in training; refuses a model with a
    layer gaexp does not know (see the module's docstring)."""
    coupled = []
    for name, m in model.named_modules():
        own_state = any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False))
        if next(m.children(), None) is not None and not own_state:
            continue  # a container: its layers are checked one by one
        declared = getattr(m, COUPLES, None)  # the layer's own word (a norm's declaration), before its type
        if declared is not None:
            if declared:
                coupled.append((name, m))
            continue
        kind = type(m)
        if kind in PER_SAMPLE or (kind in INSTANCE and not m.track_running_stats):
            continue
        if kind in COUPLED or kind in INSTANCE:
            coupled.append((name, m))
            continue
        known = sorted({t.__name__ for t in (*PER_SAMPLE, *COUPLED, *INSTANCE)})
        raise UnchunkableError(
            f"accumulate=batched: layer {name or 'the model'!r} is a {kind.__module__}.{kind.__qualname__}, not a "
            f"layer gaexp knows to be per sample or to chunk exactly (known: {', '.join(known)}, and a layer "
            f"declaring {COUPLES} = True or False); run accumulate=loop")
    return coupled


def chunked(layer: nn.Module, b: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's training forward over chunks of b samples, one call per chunk, in order. (Computing the
    chunks' statistics in one call, as channel groups of one ATen batch norm, was slower on the CPU and
    rounded 5x coarser: docs/results.md.)"""
    forward = layer.forward

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([forward(chunk) for chunk in x.split(b)])
    return run


class Chunking:
    """While entered (a training step's forward), the model's coupling layers take their input in chunks of b
    (`chunked`); outside, the model is untouched (evaluation and PreciseBN's statistics passes see whole
    batches)."""

    def __init__(self, model: nn.Module, b: int) -> None:
        self.forwards = [(layer, chunked(layer, b)) for _, layer in coupled_layers(model)]

    def __enter__(self) -> None:
        for layer, forward in self.forwards:
            layer.forward = forward

    def __exit__(self, *exc: object) -> None:
        for layer, _ in self.forwards:
            del layer.forward


def accumulate_batched(model: nn.Module, data: Split, batches: Iterator[Draw], num_accum: int,
                       precision: Precision | None = None, task: Task | None = None, *,
                       chunking: Chunking) -> torch.Tensor:
    """The loop's step (gaexp/train.py `accumulate`) in one pass: the next `num_accum` micro-batches' samples,
    in order, one forward (coupling layers chunked) and one backward of the step's loss as `task` normalizes it
    (gaexp/task/ `step_loss`: the mean of the k micro-batches' means, the sum over the step's count, or a loss of
    the whole step's outputs; a coupling layer's chunk is a micro-batch's rows, `Chunking`'s b), under
    `precision` (its autocast and loss scale; the sum over the step's samples is the backward's own, so bf16
    weights with accumulate_in=param are the loop's alone: gaexp/engine.py); returns that loss as a device tensor
    (no host synchronization)."""
    precision = precision or Precision.float32()
    task = task or Classify()
    inputs, targets = data.batch(Draw.cat([next(batches) for _ in range(num_accum)]))
    with chunking, precision.forward():
        loss = task.step_loss(model(inputs), targets, num_accum)
        extra = task.chunked_extra(targets, num_accum)  # an MoE's balancing loss over the k micro-batches
    precision.backward(loss if extra is None else loss + extra)
    return loss.detach()
