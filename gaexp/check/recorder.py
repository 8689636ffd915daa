"""One forward pass, recorded: each module's calls (its inputs and output), and the draws each module's own code
makes from the random streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from gaexp.check.state import Streams
from gaexp.check.trees import module_label, nonfinite


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

    def _copy(self, obj: Any) -> Any:
        def one(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
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
                self._open.setdefault(name, []).append(Call(self._copy(args), self._copy(kwargs)))

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
