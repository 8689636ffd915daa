"""One forward pass, recorded: each module's calls (its inputs and output), and the draws each module's own code
makes from the random streams. An argument that is neither a tensor nor an immutable value (a KV cache, a
generator: state the module may change) is kept as a copy taken when the module was called (`Stateful`), and
copied again for each later call, so calling a module again never sees what its first call did to it.
"""

from __future__ import annotations

import copy
import enum
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from gaexp.check.state import Streams
from gaexp.check.trees import module_label, nonfinite


IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, slice, range, type(Ellipsis), enum.Enum, type,
             torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format, types.FunctionType,
             types.BuiltinFunctionType, types.MethodType)


class Untestable(Exception):
    """A module's recorded call that cannot be made again: the reason, for the report."""


@dataclass(frozen=True)
class Stateful:
    """A non-tensor argument as it was when the module was called: a deep copy (`fresh` copies it again for each
    later call), or why none could be made."""
    type: str
    copy: Any = None
    problem: str = ""

    @staticmethod
    def of(obj: Any) -> Any:
        """The argument to keep: an immutable value as it is, anything else as a Stateful copy."""
        if isinstance(obj, IMMUTABLE):
            return obj
        try:
            return Stateful(type(obj).__name__, detached_copy(obj))
        except Exception as e:  # noqa: BLE001 - any object the user's model passes: the reason, said later
            return Stateful(type(obj).__name__, problem=f"{type(e).__name__}: {e}".splitlines()[0][:160])

    def fresh(self) -> Any:
        if self.problem:
            raise Untestable(f"its argument of type {self.type} cannot be copied ({self.problem})")
        try:
            return detached_copy(self.copy)
        except Exception as e:  # noqa: BLE001 - as above
            raise Untestable(f"its argument of type {self.type} cannot be copied ({type(e).__name__}: {e})"
                             .splitlines()[0]) from None


def tensors_in(obj: Any, found: dict[int, torch.Tensor], seen: set[int], depth: int = 0) -> None:
    """The tensors an object holds, through its containers, attributes and slots (at most 12 levels down)."""
    if id(obj) in seen or depth > 12 or isinstance(obj, IMMUTABLE):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found[id(obj)] = obj
        return
    children: list[Any] = []
    if isinstance(obj, dict):
        children += [*obj.keys(), *obj.values()]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children += list(obj)
    children += list(getattr(obj, "__dict__", {}).values())
    children += [getattr(obj, s) for c in type(obj).__mro__ for s in getattr(c, "__slots__", ()) if hasattr(obj, s)]
    for child in children:
        tensors_in(child, found, seen, depth + 1)


def detached_copy(obj: Any) -> Any:
    """A deep copy whose tensors are detached clones (deepcopy alone refuses a tensor inside an autograd graph, as a
    KV cache's keys are in training)."""
    found: dict[int, torch.Tensor] = {}
    tensors_in(obj, found, set())
    memo: dict[int, Any] = {key: t.detach().clone() for key, t in found.items()}
    return copy.deepcopy(obj, memo)


def fresh(obj: Any) -> Any:
    """A recorded argument for another call: a Stateful one copied anew, anything else as it is."""
    return obj.fresh() if isinstance(obj, Stateful) else obj


@dataclass
class Call:
    args: tuple
    kwargs: dict
    output: Any = None


class Recorder:
    """Hooks on every module for one forward pass: copies of each call's arguments and output (a tensor seen
    twice, as one module's output and the next one's input, is copied once), the order the calls ended in, and
    the modules whose own code drew random numbers (a draw between two hook events belongs to the innermost
    module running then, so a drop-path in a parent's forward is the parent's)."""

    def __init__(self, model: nn.Module, streams: Streams, draws: bool = True) -> None:
        self.model, self.streams, self.draws = model, streams, draws
        self.calls: dict[str, list[Call]] = {}
        self.order: list[tuple[str, int]] = []  # (module, call index), in the order the calls ended
        self.drew: dict[str, str] = {}  # module -> the stream its own code drew from
        self._open: dict[str, list[Call]] = {}
        self._stack: list[str] = []
        self._memo: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._handles: list[Any] = []
        self._last: tuple | None = None

    def _copy(self, obj: Any, arguments: bool = False) -> Any:
        """Tensors detached and cloned (once per tensor and version); for arguments, any other mutable leaf kept as
        a Stateful copy (an output's, such as the cache a model returns, is kept as it is: the loss may read it)."""
        def one(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return Stateful.of(t) if arguments else t
            seen = self._memo.get(id(t))
            if seen is not None and seen[0] is t and seen[1] == t._version:
                return seen[2]
            copy = t.detach().clone()
            self._memo[id(t)] = (t, t._version, copy)
            return copy
        return tree_map(one, obj)

    def _tick(self) -> None:
        if not self.draws:
            return
        now = self.streams.state()
        if self._stack and self._last is not None:
            stream = Streams.drawn(self._last, now)
            if stream:
                self.drew.setdefault(self._stack[-1], stream)
        self._last = now

    def __enter__(self) -> "Recorder":
        for name, module in self.model.named_modules():
            def before(m: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
                self._tick()
                self._stack.append(name)
                self._open.setdefault(name, []).append(Call(self._copy(args, True), self._copy(kwargs, True)))

            def after(m: nn.Module, args: tuple, kwargs: dict, output: Any, name: str = name) -> None:
                self._tick()
                self._stack.pop()
                call = self._open[name].pop()
                call.output = self._copy(output)
                self.order.append((name, len(self.calls.setdefault(name, []))))
                self.calls[name].append(call)

            self._handles += [module.register_forward_pre_hook(before, with_kwargs=True),
                              module.register_forward_hook(after, with_kwargs=True)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._memo.clear()  # the originals are the step's own activations: not kept past its forward

    def first_nonfinite(self, model: nn.Module) -> str:
        """Where NaN or Inf first appears: the first call (in the order calls ended) whose inputs are finite and
        whose output is not; '' when every output is finite."""
        modules = dict(model.named_modules())
        for name, i in self.order:
            call = self.calls[name][i]
            value = nonfinite(call.output)
            if value and not nonfinite((call.args, call.kwargs)):
                where = f"{name} ({type(modules[name]).__name__})" if name else module_label(name, model)
                return f"{value} first appears in the output of {where}"
        return ""
