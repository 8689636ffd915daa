"""The modules that couple the samples of a batch: each module called again on its own recorded input, micro-batch by
micro-batch, along the axis that carries the samples, its outputs compared with the whole batch's; a module is tested
whole only when none of its submodules couples. A module that cannot be called again (an argument that cannot be
copied, or a call that raises) is listed untested with the reason: the check still gives its verdict.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from gaexp.check.randomness import children_first, descendants
from gaexp.check.recorder import Call, Recorder, Untestable, fresh
from gaexp.check.report import Coupling
from gaexp.check.trees import module_label, rel_diff, sample_axes


def recall(module: nn.Module, call: Call, axes: list[int | None], chunks: list[tuple[int, int]]) -> list[Any]:
    """The module called again on its recorded arguments, cut along each tensor's sample axis into the given
    ranges (any other mutable argument, a KV cache, copied anew for each call), its own buffers given back
    afterwards. Raises Untestable, with the reason, for a call that cannot be made or that raises."""
    leaves, spec = tree_flatten((call.args, call.kwargs))
    state = {k: v.detach().clone() for k, v in module.named_buffers()}
    outputs = []
    try:
        with torch.no_grad():
            for start, stop in chunks:
                cut = [t.narrow(axis, start, stop - start).clone() if axis is not None else
                       (t.clone() if isinstance(t, torch.Tensor) else fresh(t)) for t, axis in zip(leaves, axes)]
                args, kwargs = tree_unflatten(cut, spec)
                try:
                    outputs.append(module(*args, **kwargs))
                except Exception as e:  # noqa: BLE001 - the user's module, reported untested with the reason
                    raise Untestable(f"called again on rows {start}:{stop}, it raised {type(e).__name__}: {e}"
                                     .splitlines()[0][:200]) from None
    finally:
        with torch.no_grad():
            for k, v in module.named_buffers():
                v.copy_(state[k])
    return outputs


def compare_micro(micro: list[Any], full: Any, axes: list[int | None]) -> float | None:
    """The largest relative difference between the micro-batch outputs, joined along each tensor's sample axis,
    and the full batch's; None when no output tensor carries the samples."""
    worst: float | None = None
    for leaves, axis in zip(zip(*(tree_leaves(m) for m in micro), tree_leaves(full)), axes):
        *parts, whole = leaves
        if axis is None:
            continue
        shapes_fit = all(isinstance(p, torch.Tensor) and p.dim() == whole.dim() for p in parts)
        joined = torch.cat(parts, dim=axis) if shapes_fit else None
        rel = rel_diff(joined, whole) if joined is not None and joined.shape == whole.shape else math.inf
        worst = rel if worst is None else max(worst, rel)
    return worst


def coupling_modules(model: nn.Module, full: Recorder, small: Recorder, n: int, b: int, chunks: list[tuple[int, int]],
               rtol: float) -> tuple[list[Coupling], list[str], dict[str, str]]:
    """The modules whose outputs, called micro-batch by micro-batch on their recorded inputs, differ from the
    full batch's; innermost first, a module tested only when none of its submodules couples. `small` is a
    micro-batch's forward, whose shapes tell each tensor's sample axis. Also the modules not tested, and for those
    that could not be called again, why."""
    coupled: dict[str, Coupling] = {}
    untested: list[str] = []
    why: dict[str, str] = {}
    for name, module in children_first(model):
        if name not in full.calls or descendants(name, coupled):  # never called, or coupled through a submodule
            continue
        worst: float | None = None
        for i, call in enumerate(full.calls[name]):
            seen = small.calls.get(name, [])
            if i >= len(seen):
                continue
            in_axes = sample_axes((call.args, call.kwargs), (seen[i].args, seen[i].kwargs), n, b)
            out_axes = sample_axes(call.output, seen[i].output, n, b)
            if not in_axes or not out_axes or all(a is None for a in in_axes) or all(a is None for a in out_axes):
                continue
            try:
                rel = compare_micro(recall(module, call, in_axes, chunks), call.output, out_axes)
            except Untestable as e:
                why[module_label(name, model)] = str(e)
                worst = None
                break
            if rel is not None:
                worst = rel if worst is None else max(worst, rel)
        if worst is None:
            untested.append(module_label(name, model))
        elif worst > rtol:
            coupled[name] = Coupling(name, type(module).__name__, worst)
    position = {name: i for i, (name, _) in enumerate(model.named_modules())}  # the root's label sorts first
    untested.sort(key=lambda label: position.get(label, -1))
    return sorted(coupled.values(), key=lambda c: position[c.module]), untested, why
