"""Random modules, found by what their own code does: a module whose own `forward` draws from torch's, Python's or
NumPy's random stream, then a module whose output differs between two calls on the same input; each is switched
to its training flag off for the check.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from gaexp.check.errors import CheckError
from gaexp.check.recorder import Recorder
from gaexp.check.report import RandomModule
from gaexp.check.state import Streams
from gaexp.check.trees import call_with, module_label, rel_diff


def trace_calls(model: nn.Module, inputs: Any, streams: Streams, seed: int) -> Recorder:
    streams.seed(seed)
    with torch.enable_grad(), Recorder(model, streams) as rec:
        call_with(model, inputs)
    return rec


def children_first(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return sorted(model.named_modules(), key=lambda item: -item[0].count(".") - bool(item[0]))


def descendants(name: str, names: Iterable[str]) -> list[str]:
    prefix = f"{name}." if name else ""
    return [other for other in names if other != name and other.startswith(prefix)]


def varying_modules(model: nn.Module, a: Recorder, b: Recorder, rtol: float) -> list[str]:
    """The innermost modules whose output differs between two traces although their input does not."""
    found: list[str] = []
    for name, _ in children_first(model):
        if name not in a.calls or name not in b.calls or descendants(name, found):
            continue
        for x, y in zip(a.calls[name], b.calls[name]):
            if not outputs_differ((x.args, x.kwargs), (y.args, y.kwargs), 0.0) and outputs_differ(x.output, y.output, rtol):
                found.append(name)
                break
    return found


def outputs_differ(a: Any, b: Any, rtol: float) -> bool:
    pairs = [(x, y) for x, y in zip(tree_leaves(a), tree_leaves(b)) if isinstance(x, torch.Tensor)]
    return len(tree_leaves(a)) != len(tree_leaves(b)) or any(
        not isinstance(y, torch.Tensor) or x.shape != y.shape or rel_diff(x, y) > rtol for x, y in pairs)


def switch_off_random(model: nn.Module, inputs: Any, streams: Streams, rtol: float, seed: int
                       ) -> tuple[list[RandomModule], Recorder]:
    """Turn off the own training flag of every module that is random, found on one micro-batch: first those
    whose own code draws from a random stream, then those whose output differs between two calls on the same
    input. (The modules found, the last trace: a deterministic forward of the micro-batch.)"""
    modules, found = dict(model.named_modules()), []
    last = trace_calls(model, inputs, streams, seed + 1)
    for _ in range(8):  # each round turns off what it finds; a module found twice cannot be made deterministic
        if last.drew:
            new = {name: f"draws from {stream}" for name, stream in last.drew.items()}
        else:
            again = trace_calls(model, inputs, streams, seed + 2)
            new = {name: "its output varies between two calls on the same input"
                   for name in varying_modules(model, last, again, rtol)}
            last = again
            if not new:
                return found, last
        stuck = [name for name in new if not modules[name].training]
        if stuck:
            raise CheckError(f"{', '.join(module_label(s, model) for s in stuck)} is random even with its training "
                             "flag off (as in evaluation); the check needs a deterministic step")
        for name, how in new.items():
            modules[name].training = False
            found.append(RandomModule(name, type(modules[name]).__name__, how))
        last = trace_calls(model, inputs, streams, seed + 1)
    raise CheckError("the model is still random after 8 rounds of turning off its random modules "
                     f"({', '.join(module_label(r.module) for r in found)}); the check needs a deterministic step")
