"""Is a training step safe to accumulate? One step taken both ways from the same weights, measured.

`check_accumulation` runs one training step as one batch of b*k samples and as k micro-batches of b (each
micro-batch loss scaled by 1/k, as gaexp's loop does), from the same weights and the same samples, and says
what differs and why:

- the gradients, per parameter tensor and overall (relative difference), against a float-rounding threshold;
- the modules that couple the samples of a batch: each module is called again on its own recorded input,
  micro-batch by micro-batch, and its outputs compared with the full batch's (so a module is named for what it
  does itself, not for what reached it from upstream; a module is tested whole only when none of its
  submodules couples, which also finds couplings written in a parent's `forward`). Each tensor is split along
  the axis that carries the samples, traced by comparing the shapes the module saw in the whole batch's
  forward and in a micro-batch's: a sequence-first layer is split along its second axis, and a module whose
  tensors carry no such axis is listed as untested, never as coupling;
- the buffers that end the step differently (BatchNorm's running statistics: k updates instead of one);
- the loss: its gradient with respect to the model's outputs, the full batch's outputs split in k, both ways
  (a mean over a count that varies between micro-batches, in-batch negatives), and which of the two it is.

Random modules are found by what their own code does, not by what reaches the output: a module whose own
`forward` draws from torch's, Python's or NumPy's random stream (dropout, stochastic depth, `F.dropout` or a
drop-path in a parent's `forward`), whatever its probability and however small its effect, and then a module
whose output differs between two calls on the same input (a generator of its own). Each is checked with its
own training flag off (as in evaluation), and the report names it and how it was found, so the verdict does
not depend on the seed. NaN or Inf in the inputs, a module's output, the loss or a gradient ends the check
(`NonFiniteError`, naming where it first appeared): a non-finite step is never safe. The model is left as it
was: parameters, buffers, `.grad`, training flags and the random streams.

All of that is measured in float32, whatever precision the model will train in, so rounding can never pass for a
coupling. Under a precision (`precision=`: gaexp's bf16, fp16, bf16w, bf16w-acc32, as gaexp/precision.py computes
them), `precision_drift` then takes the same step, with the same modes, on copies: as k micro-batches summed as
that precision sums them and as one batch, each against the same step in float64, and says whether accumulation
is measurably further from float64 than the big batch (`measurably_worse`), and what to change.

Nothing here knows about Hydra, MLflow or gaexp's datasets: the command around it is gaexp/check_cli.py.
"""

from __future__ import annotations

import copy
import inspect
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from gaexp.config import FP32, PrecisionConfig, precision_name
from gaexp.norms import NORMS
from gaexp.precision import DTYPES, Precision, as_precision

STEP_TARGETS = "step_targets"  # a loss taking this (or a third positional) gets the whole step's targets, unscaled
MODES = ("train", "keep")  # every module in training mode, or the training flags as the model came

# What gaexp's own study measured for BatchNorm at micro-batch 1 x 16 accumulation steps (docs/results.md,
# "The remedies": the study's CNN on MNIST, full protocol, mean valid accuracy over 3 seeds, and the paired
# difference to the true batch of 16, bn/bs16a1, with its 95% t-interval and its verdict at ±0.5 points).
# tests/test_check.py holds these figures to that table.
BN_ACCUMULATED = ("bn", 88.70, "-8.94 [-16.05, -1.83]", "worse")
# What each changes is its norm's declaration (gaexp/norms.py: `remedy`, and `in_your_model` for a model of
# one's own, where gaexp's norm= choices do not apply).
BN_REMEDIES = (  # (norm= choice, accuracy %, points against the true batch, verdict), best first
    ("bn_microeval", 98.41, "+0.77 [+0.64, +0.90]", "better"),
    ("in", 98.47, "+0.83 [+0.52, +1.15]", "better"),
    ("brn", 97.55, "-0.10 [-0.74, +0.55]", "inconclusive (4 seeds)"),
    ("gn16", 97.31, "-0.33 [-1.21, +0.56]", "inconclusive (7 seeds)"),
    ("bn_precise", 90.65, "-6.99 [-10.83, -3.16]", "worse"),
)
STUDY_GROUPS = 16  # the GroupNorm remedy's group count as measured (gn16); fewer where 16 does not divide C


class CheckError(ValueError):
    """Input the check cannot use (shapes, sizes, a loss or model that fails): one line naming what was expected."""


class NonFiniteError(ArithmeticError):
    """NaN or Inf in the step (the inputs, a module's output, the loss or a gradient): the check cannot say
    anything about it and the step is not safe. `where` says where it first appeared, in one line."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


@dataclass(frozen=True)
class TensorDiff:
    name: str  # the parameter's name in model.named_parameters()
    rel: float  # |accumulated - big| / |big|
    flagged: bool  # above the threshold (with a floor for gradients that are zero up to rounding)


@dataclass(frozen=True)
class Coupling:
    module: str  # its path in model.named_modules() ("" is the model itself)
    type: str
    rel: float  # the micro-batch outputs against the full batch's, relative


@dataclass(frozen=True)
class BufferDiff:
    name: str
    module: str
    type: str
    rel: float  # relative difference, or 1.0 for an integer buffer that differs
    big: str  # the value after the big batch and after the k micro-batches, for scalars ("" otherwise)
    accumulated: str


@dataclass(frozen=True)
class RandomModule:
    module: str  # its path in model.named_modules() ("" is the model itself)
    type: str
    found: str  # how: "draws from torch's random stream", ..., or "its output varies on the same input"


@dataclass
class Report:
    safe: bool
    micro_batch: int
    num_accum: int
    rtol: float
    threshold: str  # how rtol was chosen, in words
    loss: str  # the loss and how each micro-batch's loss was scaled
    gradient_rel: float  # over all parameters
    tensors: list[TensorDiff]
    modules: list[Coupling]  # the modules that couple samples themselves
    buffers: list[BufferDiff]
    loss_rel: float
    loss_couples: bool
    unexplained: bool  # the gradients differ and no module, buffer or the loss accounts for it
    stochastic: list[RandomModule]  # random modules, checked with their training flag off
    untested: list[str]  # modules whose tensors carry no batch axis
    remedies: list[str]
    seconds: float
    causes: list[str] = field(default_factory=list)
    loss_coupling: str = ""  # "" (per-sample), "count" (a per-micro-batch normalisation) or "samples" (pairs)
    mode: str = "train"  # "train": every module in training mode; "keep": the flags as the model came
    eval_modules: list[str] = field(default_factory=list)  # modules the model came with in eval mode
    precision: "PrecisionDrift | None" = None  # the step under a precision against float64 (None: float32 only)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data; `precision` only where one was measured (float32's is as it always was)."""
        data = asdict(self)
        if data["precision"] is None:
            del data["precision"]
        return data

    def __str__(self) -> str:
        return render(self)


def module_label(name: str, model: nn.Module | None = None) -> str:
    """How a report names a module: its path, or '(the model)' for the root."""
    return name or (f"(the model, {type(model).__name__})" if model is not None else "(the model)")


# --- batches as nested structures: a tensor, or tuples, lists and dicts of them ----------------------------

def _rows(obj: Any, start: int, stop: int, n: int) -> Any:
    """Rows start:stop of every tensor whose first dimension is the batch (n); anything else as it is. (The
    model's inputs and the targets carry the samples first: that is the contract of the check.)"""
    return tree_map(lambda t: t[start:stop] if _batched(t, n) else t, obj)


def _batched(t: Any, n: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == n


def _call(fn: Callable[..., Any], inputs: Any) -> Any:
    """model(x), model(*inputs) for a tuple or list, model(**inputs) for a dict."""
    if isinstance(inputs, dict):
        return fn(**inputs)
    if isinstance(inputs, (tuple, list)):
        return fn(*inputs)
    return fn(inputs)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b|; 0 when both are equal, inf for a difference from exactly zero."""
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else 1.0
    return _ratio(*_norms(a, b))


def _norms(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(|a - b|, |b|), in float32 at least (float64 doubles the cost of a check for no difference at rtol)."""
    if a.dtype != b.dtype or torch.finfo(a.dtype).bits < 32:
        a, b = a.float(), b.float()
    return torch.linalg.vector_norm(a - b).item(), torch.linalg.vector_norm(b).item()


def _ratio(diff: float, ref: float) -> float:
    return diff / ref if ref else (0.0 if diff == 0 else math.inf)


def _nonfinite(obj: Any) -> str:
    """'nan' or 'inf' for the first floating-point tensor in obj that holds one, '' when all are finite."""
    for t in tree_leaves(obj):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
            return "nan" if torch.isnan(t).any() else "inf"
    return ""


def _axis(full: Any, small: Any, n: int, b: int) -> int | None:
    """The axis that carries the samples in a tensor the module saw: the one axis whose size is n in the whole
    batch's forward and b in a micro-batch's, every other axis the same; None when there is no such axis."""
    if not (isinstance(full, torch.Tensor) and isinstance(small, torch.Tensor)) or full.dim() != small.dim():
        return None
    differ = [d for d in range(full.dim()) if full.shape[d] != small.shape[d]]
    return differ[0] if len(differ) == 1 and full.shape[differ[0]] == n and small.shape[differ[0]] == b else None


def _axes(full: Any, small: Any, n: int, b: int) -> list[int | None] | None:
    """Each leaf's sample axis (see _axis), or None when the two structures differ."""
    full_leaves, full_spec = tree_flatten(full)
    small_leaves, small_spec = tree_flatten(small)
    if full_spec != small_spec:
        return None
    return [_axis(f, s, n, b) for f, s in zip(full_leaves, small_leaves)]


# --- the model's state and the random streams, kept and given back ----------------------------------------

class _Kept:
    """The model's buffers, gradients and training flags, as they were, to restore. (A forward and a backward
    change buffers, such as running statistics, never parameters: those are not copied, which keeps a model of
    600M parameters within memory.)"""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
        self.grads = [p.grad for p in model.parameters()]
        self.training = {m: m.training for m in model.modules()}

    def restore_buffers(self) -> None:
        """Copied back in place: load_state_dict would need the state's metadata (MNASNet refuses it without)."""
        with torch.no_grad():
            for k, v in self.model.named_buffers():
                if k in self.buffers:
                    v.copy_(self.buffers[k])

    def restore_all(self) -> None:
        self.restore_buffers()
        for p, g in zip(self.model.parameters(), self.grads):
            p.grad = g
        for m, flag in self.training.items():
            m.training = flag


class _Streams:
    """The random streams a module may draw from: torch's (CPU and each CUDA device), Python's, NumPy's."""

    def __init__(self, devices: list[int]) -> None:
        self.devices = devices

    def state(self) -> tuple:
        cuda = tuple(torch.cuda.get_rng_state(d) for d in self.devices)
        return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()

    def set(self, state: tuple) -> None:
        cpu, cuda, python, numpy = state
        torch.set_rng_state(cpu)
        for d, s in zip(self.devices, cuda):
            torch.cuda.set_rng_state(s, d)
        random.setstate(python)
        np.random.set_state(numpy)

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)

    @staticmethod
    def drawn(before: tuple, after: tuple) -> str:
        """Which stream moved between two states ('' when none)."""
        if not torch.equal(before[0], after[0]) or any(not torch.equal(a, b) for a, b in zip(before[1], after[1])):
            return "torch's random stream"
        if before[2] != after[2]:
            return "Python's random module"
        b, a = before[3], after[3]
        if b[2:] != a[2:] or not np.array_equal(b[1], a[1]):
            return "NumPy's random stream"
        return ""


def _devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


# --- one forward pass, recorded ---------------------------------------------------------------------------

@dataclass
class _Call:
    args: tuple
    kwargs: dict
    output: Any = None


class _Recorder:
    """Hooks on every module for one forward pass: copies of each call's arguments and output (a tensor seen
    twice, as one module's output and the next one's input, is copied once), the order the calls ended in, and
    the modules whose own code drew random numbers (a draw between two hook events belongs to the innermost
    module running then, so a drop-path in a parent's forward is the parent's)."""

    def __init__(self, model: nn.Module, streams: _Streams, draws: bool = True) -> None:
        self.model, self.streams, self.draws = model, streams, draws
        self.calls: dict[str, list[_Call]] = {}
        self.order: list[tuple[str, int]] = []  # (module, call index), in the order the calls ended
        self.drew: dict[str, str] = {}  # module -> the stream its own code drew from
        self._open: dict[str, list[_Call]] = {}
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
            stream = _Streams.drawn(self._last, now)
            if stream:
                self.drew.setdefault(self._stack[-1], stream)
        self._last = now

    def __enter__(self) -> "_Recorder":
        for name, module in self.model.named_modules():
            def before(m: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
                self._tick()
                self._stack.append(name)
                self._open.setdefault(name, []).append(_Call(self._copy(args), self._copy(kwargs)))

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
            value = _nonfinite(call.output)
            if value and not _nonfinite((call.args, call.kwargs)):
                where = f"{name} ({type(modules[name]).__name__})" if name else module_label(name, model)
                return f"{value} first appears in the output of {where}"
        return ""


# --- random modules ----------------------------------------------------------------------------------------

def _trace(model: nn.Module, inputs: Any, streams: _Streams, seed: int) -> _Recorder:
    streams.seed(seed)
    with torch.enable_grad(), _Recorder(model, streams) as rec:
        _call(model, inputs)
    return rec


def _children_first(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return sorted(model.named_modules(), key=lambda item: -item[0].count(".") - bool(item[0]))


def _descendants(name: str, names: Iterable[str]) -> list[str]:
    prefix = f"{name}." if name else ""
    return [other for other in names if other != name and other.startswith(prefix)]


def _varying(model: nn.Module, a: _Recorder, b: _Recorder, rtol: float) -> list[str]:
    """The innermost modules whose output differs between two traces although their input does not."""
    found: list[str] = []
    for name, _ in _children_first(model):
        if name not in a.calls or name not in b.calls or _descendants(name, found):
            continue
        for x, y in zip(a.calls[name], b.calls[name]):
            if not _differs((x.args, x.kwargs), (y.args, y.kwargs), 0.0) and _differs(x.output, y.output, rtol):
                found.append(name)
                break
    return found


def _differs(a: Any, b: Any, rtol: float) -> bool:
    pairs = [(x, y) for x, y in zip(tree_leaves(a), tree_leaves(b)) if isinstance(x, torch.Tensor)]
    return len(tree_leaves(a)) != len(tree_leaves(b)) or any(
        not isinstance(y, torch.Tensor) or x.shape != y.shape or _rel(x, y) > rtol for x, y in pairs)


def _switch_off_random(model: nn.Module, inputs: Any, streams: _Streams, rtol: float, seed: int
                       ) -> tuple[list[RandomModule], _Recorder]:
    """Turn off the own training flag of every module that is random, found on one micro-batch: first those
    whose own code draws from a random stream, then those whose output differs between two calls on the same
    input. (The modules found, the last trace: a deterministic forward of the micro-batch.)"""
    modules, found = dict(model.named_modules()), []
    last = _trace(model, inputs, streams, seed + 1)
    for _ in range(8):  # each round turns off what it finds; a module found twice cannot be made deterministic
        if last.drew:
            new = {name: f"draws from {stream}" for name, stream in last.drew.items()}
        else:
            again = _trace(model, inputs, streams, seed + 2)
            new = {name: "its output varies between two calls on the same input"
                   for name in _varying(model, last, again, rtol)}
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
        last = _trace(model, inputs, streams, seed + 1)
    raise CheckError("the model is still random after 8 rounds of turning off its random modules "
                     f"({', '.join(module_label(r.module) for r in found)}); the check needs a deterministic step")


# --- the step ----------------------------------------------------------------------------------------------

def _forward_fails(e: Exception, inputs: Any, what: str) -> CheckError:
    shapes = [tuple(t.shape) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    return CheckError(f"the model's forward fails on {what} (inputs of shape {', '.join(map(str, shapes))}): "
                      f"{type(e).__name__}: {e}".splitlines()[0])


def _step(model: nn.Module, kept: _Kept, inputs: Any, targets: Any, n: int, chunks: list[tuple[int, int]],
          contract: "LossContract", streams: _Streams, seed: int
          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], _Recorder | None]:
    """One step from the kept weights, in the given row ranges: (each parameter's gradient, each buffer after,
    the recorded forward for the one-batch step). NaN or Inf anywhere raises NonFiniteError."""
    kept.restore_buffers()
    params = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    for _, p in params:
        p.grad = None
    whole = len(chunks) == 1
    scale = 1.0 if contract.step or whole else 1.0 / len(chunks)
    recorder = None
    streams.seed(seed)
    with torch.enable_grad():
        for i, (start, stop) in enumerate(chunks):
            part = _rows(inputs, start, stop, n)
            where = "the whole batch" if whole else f"micro-batch {i + 1} of {len(chunks)} (rows {start}:{stop})"
            try:
                if whole:
                    with _Recorder(model, streams, draws=False) as recorder:
                        outputs = _call(model, part)
                else:
                    outputs = _call(model, part)
            except Exception as e:  # noqa: BLE001 - the user's forward, said in one line
                raise _forward_fails(e, part, f"a batch of {stop - start}") from None
            value = _nonfinite(outputs)
            if value:
                first = recorder.first_nonfinite(model) if recorder else ""
                raise NonFiniteError(f"{first or f'the output contains {value}'} in the forward of {where}")
            loss = contract.value(outputs, _rows(targets, start, stop, n), targets)
            if not torch.isfinite(loss):
                raise NonFiniteError(f"the loss is {loss.item()} on {where}, its outputs finite")
            (loss * scale).backward()
    gradients = {k: (p.grad.detach() if p.grad is not None else torch.zeros_like(p)) for k, p in params}
    for _, p in params:  # the next step starts from none; these tensors are the step's own, not copied
        p.grad = None
    for key, g in gradients.items():
        value = _nonfinite(g)
        if value:
            raise NonFiniteError(f"the gradient of {key} is {value} after the step of "
                                 f"{'the whole batch' if whole else f'{len(chunks)} micro-batches'}, the loss finite")
    return gradients, {k: b.detach().clone() for k, b in model.named_buffers()}, recorder


# --- the modules that couple --------------------------------------------------------------------------------

def _recall(module: nn.Module, call: _Call, axes: list[int | None], chunks: list[tuple[int, int]]) -> list[Any]:
    """The module called again on its recorded arguments, cut along each tensor's sample axis into the given
    ranges, its own buffers given back afterwards."""
    leaves, spec = tree_flatten((call.args, call.kwargs))
    state = {k: v.detach().clone() for k, v in module.named_buffers()}
    outputs = []
    try:
        with torch.no_grad():
            for start, stop in chunks:
                cut = [t.narrow(axis, start, stop - start).clone() if axis is not None else
                       (t.clone() if isinstance(t, torch.Tensor) else t) for t, axis in zip(leaves, axes)]
                args, kwargs = tree_unflatten(cut, spec)
                outputs.append(module(*args, **kwargs))
    finally:
        with torch.no_grad():
            for k, v in module.named_buffers():
                v.copy_(state[k])
    return outputs


def _compare(micro: list[Any], full: Any, axes: list[int | None]) -> float | None:
    """The largest relative difference between the micro-batch outputs, joined along each tensor's sample axis,
    and the full batch's; None when no output tensor carries the samples."""
    worst: float | None = None
    for leaves, axis in zip(zip(*(tree_leaves(m) for m in micro), tree_leaves(full)), axes):
        *parts, whole = leaves
        if axis is None:
            continue
        shapes_fit = all(isinstance(p, torch.Tensor) and p.dim() == whole.dim() for p in parts)
        joined = torch.cat(parts, dim=axis) if shapes_fit else None
        rel = _rel(joined, whole) if joined is not None and joined.shape == whole.shape else math.inf
        worst = rel if worst is None else max(worst, rel)
    return worst


def _couplings(model: nn.Module, full: _Recorder, small: _Recorder, n: int, b: int, chunks: list[tuple[int, int]],
               rtol: float) -> tuple[list[Coupling], list[str]]:
    """The modules whose outputs, called micro-batch by micro-batch on their recorded inputs, differ from the
    full batch's; innermost first, a module tested only when none of its submodules couples. `small` is a
    micro-batch's forward, whose shapes tell each tensor's sample axis."""
    coupled: dict[str, Coupling] = {}
    untested: list[str] = []
    for name, module in _children_first(model):
        if name not in full.calls or _descendants(name, coupled):  # never called, or coupled through a submodule
            continue
        worst: float | None = None
        for i, call in enumerate(full.calls[name]):
            seen = small.calls.get(name, [])
            if i >= len(seen):
                continue
            in_axes = _axes((call.args, call.kwargs), (seen[i].args, seen[i].kwargs), n, b)
            out_axes = _axes(call.output, seen[i].output, n, b)
            if not in_axes or not out_axes or all(a is None for a in in_axes) or all(a is None for a in out_axes):
                continue
            rel = _compare(_recall(module, call, in_axes, chunks), call.output, out_axes)
            if rel is not None:
                worst = rel if worst is None else max(worst, rel)
        if worst is None:
            untested.append(module_label(name, model))
        elif worst > rtol:
            coupled[name] = Coupling(name, type(module).__name__, worst)
    position = {name: i for i, (name, _) in enumerate(model.named_modules())}  # the root's label sorts first
    untested.sort(key=lambda label: position.get(label, -1))
    return sorted(coupled.values(), key=lambda c: position[c.module]), untested


# --- the loss ------------------------------------------------------------------------------------------------

def cross_entropy(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """The default loss: cross-entropy of the logits, summed over the heads when the model returns several
    (GoogLeNet's and Inception's auxiliary logits in training mode)."""
    if isinstance(outputs, torch.Tensor):
        return F.cross_entropy(outputs, targets)
    heads = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not heads:
        raise TypeError(f"the model returned {type(outputs).__name__} with no floating-point tensor")
    return sum(F.cross_entropy(t, targets) for t in heads)


@dataclass(frozen=True)
class LossContract:
    """A loss as the check calls it: loss(outputs, targets), or with the whole step's targets as a third
    positional parameter or a `step_targets` keyword (then not scaled by 1/k)."""
    fn: Callable[..., torch.Tensor]
    name: str
    step: bool  # takes the step's targets
    positional: bool  # ... as its third positional argument (else as step_targets=)

    def value(self, outputs: Any, targets: Any, step_targets: Any) -> torch.Tensor:
        try:
            if not self.step:
                value = self.fn(outputs, targets)
            elif self.positional:
                value = self.fn(outputs, targets, step_targets)
            else:
                value = self.fn(outputs, targets, **{STEP_TARGETS: step_targets})
        except Exception as e:  # noqa: BLE001 - the user's loss, said in one line
            raise CheckError(f"loss {self.name} fails on the model's outputs: {type(e).__name__}: {e}"
                             .splitlines()[0]) from None
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
            raise CheckError(f"loss {self.name} returned {type(value).__name__} "
                             f"{tuple(getattr(value, 'shape', ()))}; expected a scalar floating-point tensor")
        return value.reshape(())


LOSS_FORMS = (f"loss(outputs, targets), loss(outputs, targets, {STEP_TARGETS}) or "
              f"loss(outputs, targets, *, {STEP_TARGETS}) -> scalar tensor")


def loss_contract(loss: Callable[..., torch.Tensor] | None) -> LossContract:
    """The one loss contract of the check and of gaexp-check: two positional parameters (outputs, targets), and
    optionally the step's targets, as a third positional parameter or a keyword-only `step_targets`. Any other
    parameter must have a default. Refused in one line naming the valid forms."""
    fn = loss or cross_entropy
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: called with two arguments
        return LossContract(fn, name, False, False)
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    required = [p for p in positional if p.default is p.empty]
    keyword = signature.parameters.get(STEP_TARGETS)
    takes_two = len(positional) >= 2 or varargs
    if keyword is not None and keyword.kind is keyword.KEYWORD_ONLY and takes_two and len(required) <= 2:
        return LossContract(fn, name, True, False)
    if len(positional) >= 3 and (positional[2].name == STEP_TARGETS or positional[2].default is positional[2].empty) \
            and len(required) <= 3:
        return LossContract(fn, name, True, True)
    others = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty and p.name != STEP_TARGETS]
    if takes_two and len(required) <= 2 and not others:
        return LossContract(fn, name, False, False)
    raise CheckError(f"loss {name}{signature}: expected {LOSS_FORMS}")


def _loss_coupling(contract: LossContract, outputs: Any, axes: list[int | None], targets: Any, n: int,
                   chunks: list[tuple[int, int]], rtol: float) -> tuple[float, str]:
    """The loss's gradient with respect to the full batch's outputs, against the k micro-batch losses' (each
    scaled by 1/k unless the loss takes the step's targets), relative; and the kind of coupling: "count" when
    each micro-batch's gradient is the whole batch's times a factor of its own (a mean over a count that varies
    between micro-batches), "samples" when it is not (samples compared with each other), "" when it agrees."""
    scale = 1.0 if contract.step else 1.0 / len(chunks)
    leaves, spec = tree_flatten(outputs)

    def grads(cut: list[Any], tgt: Any, factor: float) -> list[torch.Tensor | None]:
        """d(loss * factor)/d(each floating-point output leaf); None for the other leaves."""
        cut = [t.detach().clone().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point()
               else t for t in cut]
        wanted = [i for i, t in enumerate(cut) if isinstance(t, torch.Tensor) and t.requires_grad]
        value = contract.value(tree_unflatten(cut, spec), tgt, targets) * factor
        found = torch.autograd.grad(value, [cut[i] for i in wanted], allow_unused=True)
        out: list[torch.Tensor | None] = [None] * len(cut)
        for i, g in zip(wanted, found):
            out[i] = g if g is not None else torch.zeros_like(cut[i])
        return out

    def cut(a: int, z: int) -> list[Any]:
        return [t.narrow(axis, a, z - a) if axis is not None else t for t, axis in zip(leaves, axes)]

    with torch.enable_grad():
        big = grads(list(leaves), targets, 1.0)
        parts = [grads(cut(a, z), _rows(targets, a, z, n), scale) for a, z in chunks]
    worst, per_chunk = 0.0, True
    for i, (whole, axis) in enumerate(zip(big, axes)):
        if whole is None:
            continue
        if axis is None:
            worst = max(worst, _rel(sum(p[i] for p in parts), whole))
            continue
        worst = max(worst, _rel(torch.cat([p[i] for p in parts], dim=axis), whole))
        for (a, z), p in zip(chunks, parts):  # each micro-batch's gradient a multiple of the whole batch's?
            w, g = whole.narrow(axis, a, z - a).double(), p[i].double()
            factor = (g * w).sum() / (w * w).sum() if (w * w).sum() > 0 else torch.tensor(0.0)
            residual = (g - factor * w).norm().item()
            per_chunk = per_chunk and residual <= rtol * max(g.norm().item(), w.norm().item() * scale, 1e-30)
    kind = "" if worst <= rtol else ("count" if per_chunk else "samples")
    return worst, kind


# --- under a precision: the same step against float64 --------------------------------------------------------

WORSE_RATIO = 2.0  # accumulation measurably worse than the big batch: this ratio of their errors (measurably_worse)
BACKOFFS = 40  # a GradScaler's halvings tried from its first scale (2^16 down to 2^-24) before a step is non-finite
LOW_DTYPES = (torch.bfloat16, torch.float16)  # outputs in these are cast to float32 for the loss, as training does


def _as_precision(precision: PrecisionConfig | str) -> PrecisionConfig:
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


class _Held(torch.optim.Optimizer):
    """An optimizer that takes no step: Precision.step rounds, unscales and checks the gradients, then leaves them
    in `.grad` to be read."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


def _cast(obj: Any, dtype: torch.dtype, only: Sequence[torch.dtype] | None = None) -> Any:
    """Every floating-point tensor in obj (of the dtypes `only`, if given) in `dtype`."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                    and (only is None or t.dtype in only) else t, obj)


def _precise_step(model: nn.Module, precision: Precision, inputs: Any, targets: Any, contract: LossContract, n: int,
                  chunks: list[tuple[int, int]]) -> tuple[list[torch.Tensor], bool]:
    """One step as training takes it under `precision` (its forward, its backward of each 1/k-scaled loss, its
    sum, its step with an optimizer that moves nothing): each parameter's gradient, and whether the scaler
    skipped the step. `model` is the precision's own copy."""
    scale = 1.0 if contract.step or len(chunks) == 1 else 1.0 / len(chunks)
    if precision.dtype != torch.float32:
        inputs = _cast(inputs, precision.dtype)
    with torch.enable_grad():
        for start, stop in chunks:
            with precision.forward():
                outputs = _call(model, _rows(inputs, start, stop, n))
            outputs = _cast(outputs, torch.float32, LOW_DTYPES)  # the loss in float32 (training's .float())
            precision.backward(contract.value(outputs, _rows(targets, start, stop, n), targets) * scale)
    skipped = precision.step(_Held(precision.params)) if precision.params else False
    return [q.grad.detach() if q.grad is not None else torch.zeros_like(q) for q in precision.params], skipped


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1).double() for g in grads]) if grads else torch.zeros(0, dtype=torch.float64)


def precision_drift(model: nn.Module, inputs: Any, targets: Any, loss: Callable[..., torch.Tensor] | None = None,
                    *, micro_batch: int, num_accum: int, precision: PrecisionConfig | str) -> PrecisionDrift:
    """One training step of `model` (its training flags as they are; the model itself untouched) under
    `precision` (a PrecisionConfig, or gaexp's name: bf16, fp16, bf16w, bf16w-acc32), taken as `num_accum`
    micro-batches of `micro_batch` and as one batch, each against the same step in float64: a float64 copy of
    the model with the weights the precision holds (bf16w: its bf16 values), the same inputs, the same
    micro-batches, the gradients summed in float64. The loss contract is check_accumulation's.

    fp16's GradScaler starts at its own first scale and backs off as training's first steps do: a step it
    skips (Inf or NaN in a scaled gradient) is taken again at the halved scale, up to BACKOFFS times; a step
    still not finite, or one with no scaler, raises NonFiniteError. `worse`: `measurably_worse`."""
    p = _as_precision(precision)
    contract = loss_contract(loss)
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
        exact[name] = _flat(_precise_step(float64.prepare(copy.deepcopy(reference)), float64,
                                          _cast(inputs, torch.float64), _cast(targets, torch.float64), contract, n,
                                          steps)[0])
        run = Precision(p, device)  # built for the model's device: never GradScaler() alone, which means CUDA
        for _ in range(BACKOFFS):
            grads, was_skipped = _precise_step(run.prepare(copy.deepcopy(model)), run, inputs, targets, contract, n,
                                               steps)
            if not was_skipped:
                break
        value = _nonfinite(grads)
        if value:
            what = "one batch" if len(steps) == 1 else f"{len(steps)} micro-batches"
            raise NonFiniteError(f"the gradient is {value} under precision={p.name} after the step of {what}"
                                 + (f", the loss scale backed off {run.skipped} times to {run.scale:g}"
                                    if run.scale is not None else ""))
        low[name] = _flat(grads)
        if name == "accumulated":
            scale, skipped = run.scale, run.skipped
    accumulated, big = _rel(low["accumulated"], exact["accumulated"]), _rel(low["big"], exact["big"])
    floor = torch.finfo(DTYPES[p.weights]).eps / 2
    worse = measurably_worse(accumulated, big, floor)
    return PrecisionDrift(p.name, precision_words(p), summed_in(p), accumulated, big, _ratio(accumulated, big), floor,
                          worse, _precision_remedy(p) if worse else "", scale, skipped, dtype_name(p.weights))


def _precision_remedy(p: PrecisionConfig) -> str:
    if summed_in(p) != dtype_name(FP32):
        summed = precision_name(p.autocast, p.weights, FP32, p.scaler)
        return (f"sum the micro-batch gradients in a float32 buffer, rounded to {dtype_name(p.weights)} once per "
                f"step: precision={summed} in gaexp (gaexp-check --accumulate-in fp32)")
    return ("the sum is float32 already: each micro-batch's own rounding adds up; fewer, larger micro-batches, or "
            "float32 (precision=fp32)")


# --- the check --------------------------------------------------------------------------------------------------

def _scalar(t: torch.Tensor) -> str:
    return f"{t.item():g}" if t.numel() == 1 else ""


def check_accumulation(model: nn.Module, inputs: Any, targets: Any,
                       loss: Callable[..., torch.Tensor] | None = None, *, micro_batch: int, num_accum: int,
                       rtol: float | None = None, seed: int = 0, modes: str = "train",
                       norm_choices: bool = False, precision: PrecisionConfig | str | None = None) -> Report:
    """One training step of `model` on `inputs`/`targets` (micro_batch * num_accum samples, the batch first in
    every tensor; `inputs` a tensor, or a tuple/list of positional arguments, or a dict of keyword arguments)
    taken as one batch and as `num_accum` micro-batches, compared.

    `loss(outputs, targets)` is cross-entropy by default and is treated as a mean over its micro-batch: each
    micro-batch's loss is scaled by 1/num_accum. A loss that takes the whole step's targets, as a third
    positional parameter (`loss(outputs, targets, step_targets)`) or a keyword-only `step_targets`, is given
    them and is not scaled (it normalizes by the step itself, e.g. by the step's total count of valid tokens).
    `rtol`: the float-rounding threshold, by default the square root of the parameters' machine epsilon (3.5e-4
    in float32). `modes`: "train" puts every module in training mode (the report names those the model came with
    in eval mode), "keep" checks the training flags as they are. `norm_choices`: remedies name gaexp's `norm=`
    choices (for a gaexp model) instead of what to change in one's own model. `precision` (a PrecisionConfig, or
    gaexp's name: bf16, fp16, bf16w, bf16w-acc32): after the check, which stays in float32, the step under that
    precision against float64 (`precision_drift`, with the check's modes), in `report.precision`; None or fp32:
    none. Raises CheckError for input it cannot use and NonFiniteError for NaN or Inf in the step."""
    tic = time.perf_counter()
    if not isinstance(micro_batch, int) or micro_batch < 1:
        raise CheckError(f"micro_batch={micro_batch!r}; valid: an integer >= 1")
    if not isinstance(num_accum, int) or num_accum < 2:
        raise CheckError(f"num_accum={num_accum!r}; valid: an integer >= 2 (one step of 1 micro-batch is the "
                         "big batch itself)")
    if modes not in MODES:
        raise CheckError(f"modes={modes!r}; valid: {', '.join(MODES)}")
    n = micro_batch * num_accum
    for what, obj in (("inputs", inputs), ("targets", targets)):
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
    contract = loss_contract(loss)
    if precision is not None:
        precision = _as_precision(precision)
    chunks = [(i * micro_batch, (i + 1) * micro_batch) for i in range(num_accum)]
    value = _nonfinite(inputs)
    if value:
        raise NonFiniteError(f"the inputs contain {value}")

    eval_modules = [module_label(name, model) for name, m in model.named_modules() if not m.training]
    kept, streams = _Kept(model), _Streams(_devices(model))
    outer = streams.state()
    try:
        if modes == "train":
            model.train()
        try:
            stochastic, small = _switch_off_random(model, _rows(inputs, 0, micro_batch, n), streams, rtol, seed)
        except (CheckError, NonFiniteError):
            raise
        except Exception as e:  # noqa: BLE001 - the user's forward, said in one line
            raise _forward_fails(e, _rows(inputs, 0, micro_batch, n), f"a micro-batch of {micro_batch}") from None
        big_grads, big_buffers, full = _step(model, kept, inputs, targets, n, [(0, n)], contract, streams, seed)
        acc_grads, acc_buffers, _ = _step(model, kept, inputs, targets, n, chunks, contract, streams, seed)
        kept.restore_buffers()
        assert full is not None
        modules, untested = _couplings(model, full, small, n, micro_batch, chunks, rtol)
        root_axes = _axes(full.calls[""][0].output, small.calls[""][0].output, n, micro_batch)
        outputs = full.calls[""][0].output
        if root_axes is None:
            root_axes = [0 if _batched(t, n) else None for t in tree_leaves(outputs)]
        loss_rel, loss_coupling = _loss_coupling(contract, outputs, root_axes, targets, n, chunks, rtol)
        drift = None
        if precision is not None and precision.name != FP32:  # on copies, with the modes the check ran in
            drift = precision_drift(model, inputs, targets, loss, micro_batch=micro_batch, num_accum=num_accum,
                                    precision=precision)
    finally:
        kept.restore_all()
        streams.set(outer)

    norms = {key: _norms(acc_grads[key], big) for key, big in big_grads.items()}  # (|acc - big|, |big|)
    total = math.sqrt(sum(ref ** 2 for _, ref in norms.values()))
    size = sum(g.numel() for g in big_grads.values()) or 1
    tensors = []
    for key, big in big_grads.items():
        diff, ref = norms[key]
        floor = ref + total * math.sqrt(big.numel() / size)
        tensors.append(TensorDiff(key, _ratio(diff, ref), diff > rtol * floor))
    gradient_rel = _ratio(math.sqrt(sum(diff ** 2 for diff, _ in norms.values())), total)

    owners = dict(model.named_modules())
    buffers = []
    for key, big in big_buffers.items():
        acc = acc_buffers[key]
        rel = _rel(acc, big)
        if rel > rtol:
            module = key.rpartition(".")[0]
            buffers.append(BufferDiff(key, module, type(owners[module]).__name__, rel, _scalar(big), _scalar(acc)))

    loss_couples = loss_rel > rtol
    grad_differs = gradient_rel > rtol or any(t.flagged for t in tensors)
    unexplained = grad_differs and not modules and not loss_couples
    causes = _causes(modules, buffers, loss_coupling, unexplained)
    return Report(
        safe=not (grad_differs or modules or buffers or loss_couples), micro_batch=micro_batch,
        num_accum=num_accum, rtol=rtol, threshold=threshold,
        loss=f"{contract.name}, " + (f"given the step's targets ({STEP_TARGETS}), not scaled" if contract.step
                                     else f"each micro-batch's scaled by 1/{num_accum}"),
        gradient_rel=gradient_rel, tensors=tensors, modules=modules, buffers=buffers, loss_rel=loss_rel,
        loss_couples=loss_couples, unexplained=unexplained, stochastic=stochastic, untested=untested,
        remedies=_remedies(modules, buffers, owners, loss_coupling, contract.step, norm_choices),
        seconds=time.perf_counter() - tic, causes=causes, loss_coupling=loss_coupling, mode=modes,
        eval_modules=eval_modules, precision=drift)


def _causes(modules: list[Coupling], buffers: list[BufferDiff], loss_coupling: str, unexplained: bool) -> list[str]:
    causes = []
    for kind in dict.fromkeys(c.type for c in modules):
        of_kind = [c for c in modules if c.type == kind]
        causes.append(f"{len(of_kind)} {kind} module{'s' * (len(of_kind) > 1)} couple the samples of a batch: a "
                      "sample's output depends on the other samples of its batch (relative difference up to "
                      f"{max(c.rel for c in of_kind):.2g} between micro-batches and the whole batch)")
    for kind in dict.fromkeys(b.type for b in buffers):
        owners = {b.module for b in buffers if b.type == kind}
        names = ", ".join(dict.fromkeys(b.name.rpartition(".")[2] for b in buffers if b.type == kind))
        causes.append(f"{len(owners)} {kind} module{'s' * (len(owners) > 1)} end the step with different buffers "
                      f"({names}): updated once per micro-batch, not once per step")
    if loss_coupling == "count":
        causes.append("the loss normalises each micro-batch by a count of its own: each micro-batch's gradient is "
                      "the whole batch's times a factor that differs between micro-batches (a mean over a count "
                      "that varies: valid tokens, masked labels)")
    elif loss_coupling == "samples":
        causes.append("the loss couples the samples of a batch: a sample's gradient depends on the other samples "
                      "of its batch, by more than a factor per micro-batch (samples compared with each other)")
    if unexplained:
        causes.append("the gradients differ while no module's per-sample outputs and not the loss do: state "
                      "carried between micro-batches, or a module whose tensors carry no batch axis (untested)")
    return causes


def groups_for(channels: Sequence[int]) -> int:
    """The group count a GroupNorm remedy suggests for layers of these channel counts: the study's (16, norm=gn16)
    where it divides every one of them, else the largest of 8, 4, 2 that does (1 if none: LayerNorm's)."""
    return next(g for g in (STUDY_GROUPS, 8, 4, 2, 1) if all(c % g == 0 for c in channels))


def _norm_choice(choice: str, channels: Sequence[int]) -> str:
    """A BatchNorm remedy as gaexp's norm= choice: for GroupNorm, a group count that divides every BatchNorm's
    channels (gaexp refuses norm.groups that does not)."""
    if choice == f"gn{STUDY_GROUPS}" and groups_for(channels) != STUDY_GROUPS:
        g = groups_for(channels)
        odd = [c for c in channels if c % STUDY_GROUPS]
        return (f"norm=gn norm.groups={g}: GroupNorm with {g} groups instead (the study measured {STUDY_GROUPS}, "
                f"which does not divide the model's {_listed([str(c) for c in odd], 5)} channels)")
    return f"norm={choice}: {NORMS[choice].remedy}"


def _in_your_model(choice: str, channels: Sequence[int]) -> str:
    """A BatchNorm remedy said as a change to one's own model: for GroupNorm, which group count for which channel
    counts where the study's 16 does not divide them."""
    text = NORMS[choice].in_your_model
    if choice != f"gn{STUDY_GROUPS}":
        return text
    by_groups: dict[int, list[str]] = {}
    for c in channels:
        if c % STUDY_GROUPS:
            by_groups.setdefault(groups_for([c]), []).append(str(c))
    if not by_groups:
        return text
    return text + " (" + "; ".join(f"nn.GroupNorm({g}, C) for C = {_listed(cs, 8)}"
                                   for g, cs in sorted(by_groups.items(), reverse=True)) + \
        f": {STUDY_GROUPS} groups must divide C)"


def _remedies(modules: list[Coupling], buffers: list[BufferDiff], owners: dict[str, nn.Module],
              loss_coupling: str, step: bool, norm_choices: bool) -> list[str]:
    remedies = []
    named = {c.module for c in modules} | {b.module for b in buffers}
    batchnorm = any(isinstance(owners[m], nn.modules.batchnorm._BatchNorm) for m in named)
    if batchnorm:
        choice, accuracy, against, verdict = BN_ACCUMULATED
        measured = ("its CNN on MNIST, micro-batch 1 x 16 steps, valid accuracy, 3 seeds; points against the true "
                    f"batch of 16, 95% interval, verdict at ±0.5 points; accumulated BatchNorm: {accuracy:.2f}%, "
                    f"{against}, {verdict}")
        channels = sorted({m.num_features for m in owners.values() if isinstance(m, nn.modules.batchnorm._BatchNorm)})
        if norm_choices:
            remedies.append(f"for BatchNorm, as gaexp's study measured them ({measured}):")
            remedies += [f"  {_norm_choice(choice, channels)}: {accuracy:.2f}%, {against}, {verdict}"
                         for choice, accuracy, against, verdict in BN_REMEDIES]
        else:
            remedies.append(f"for BatchNorm, what to change in the model, with what gaexp's study measured for each "
                            f"({measured}):")
            remedies += [f"  {_in_your_model(choice, channels)}: {accuracy:.2f}%, {against}, {verdict}"
                         for choice, accuracy, against, verdict in BN_REMEDIES]
    if any(not isinstance(owners[m], nn.modules.batchnorm._BatchNorm) for m in named):
        remedies.append("other coupling modules: compute their statistics per sample (GroupNorm, LayerNorm), or "
                        "once over the whole step before its micro-batches")
    if loss_coupling == "count":
        remedies.append("sum the loss and divide by the step's total count over all its micro-batches, with no 1/k"
                        + ("" if step else f" (a loss taking a third argument or a {STEP_TARGETS}= keyword is "
                                           "given the step's targets)"))
    elif loss_coupling == "samples":
        remedies.append("samples compared with each other (in-batch negatives): no accumulation is exact; compute "
                        "the step's embeddings first, then back-propagate through them in micro-batches "
                        "(gradient caching)")
    return remedies


def _buffer_parts(diffs: list[BufferDiff]) -> str:
    """running_mean rel. 2.4; num_batches_tracked 1 vs 4 (the largest difference of each buffer name)."""
    parts = []
    for name in dict.fromkeys(d.name.rpartition(".")[2] for d in diffs):
        same = [d for d in diffs if d.name.rpartition(".")[2] == name]
        values = {(d.big, d.accumulated) for d in same}
        if all(d.big for d in same) and len(values) == 1:
            parts.append(f"{name} {same[0].big} vs {same[0].accumulated}")
        else:
            parts.append(f"{name} rel. {'up to ' * (len(same) > 1)}{max(d.rel for d in same):.2g}")
    return "; ".join(parts)


def _listed(names: list[str], most: int) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def render(r: Report, worst: int = 5) -> str:
    """The report for people: the verdict, what differs, the remedies."""
    verdict = "SAFE" if r.safe else "UNSAFE"
    if r.safe and r.precision is not None and r.precision.worse:
        verdict = f"SAFE in float32, IMPRECISE in {r.precision.precision}"
    lines = [f"{verdict}: micro-batch {r.micro_batch} x {r.num_accum} accumulation steps "
             f"against one batch of {r.micro_batch * r.num_accum}, from the same weights and samples "
             f"({r.seconds:.1f} s)"]
    if r.mode == "keep":
        lines.append("mode: the model's own training flags" + (
            f" ({len(r.eval_modules)} modules in eval mode: {_listed(r.eval_modules, worst)})" if r.eval_modules
            else " (every module in training mode)"))
    else:
        lines.append("mode: training, every module" + (
            f" (the model came with {len(r.eval_modules)} in eval mode: {_listed(r.eval_modules, worst)}; "
            "--keep-modes, or modes='keep', checks them as they were)" if r.eval_modules else ""))
    lines += [f"loss: {r.loss}",
              f"threshold: relative difference {r.rtol:.2g} ({r.threshold})",
              f"gradient: relative difference {r.gradient_rel:.2g} over all parameters"]
    flagged = sorted((t for t in r.tensors if t.flagged), key=lambda t: -t.rel)
    if flagged:
        lines.append(f"  {len(flagged)} of {len(r.tensors)} parameter tensors differ; the largest:")
        lines += [f"  {t.name:<40} {t.rel:.2g}" for t in flagged[:worst]]
    lines.append(f"modules coupling the samples of a batch: {len(r.modules) or 'none'}")
    lines += [f"  {module_label(c.module):<40} {c.type:<20} {c.rel:.2g}" for c in r.modules]
    by_module: dict[tuple[str, str], list[BufferDiff]] = {}
    for b in r.buffers:
        by_module.setdefault((b.module, b.type), []).append(b)
    lines.append(f"buffers ending the step differently: {len(r.buffers) or 'none'}"
                 + (f", in {len(by_module)} modules" if by_module else ""))
    if len(by_module) <= worst:
        for (module, kind), diffs in by_module.items():
            lines.append(f"  {module_label(module):<40} {kind:<20} {_buffer_parts(diffs)}")
    else:  # one line per kind of module
        for kind in dict.fromkeys(k for _, k in by_module):
            diffs = [d for (_, k), ds in by_module.items() if k == kind for d in ds]
            count = sum(k == kind for _, k in by_module)
            lines.append(f"  {count} {kind} modules{'':<{max(0, 30 - len(kind) - len(str(count)))}} "
                         f"{_buffer_parts(diffs)}")
    kinds = {"": "per-sample", "count": "normalised per micro-batch", "samples": "couples the samples"}
    lines.append(f"loss: {kinds[r.loss_coupling] if r.loss_couples else 'per-sample'} (relative difference of its "
                 f"gradient {r.loss_rel:.2g})")
    if r.stochastic:
        lines.append(f"random modules, checked with their own training flag off (deterministic, as in evaluation): "
                     f"{len(r.stochastic)}")
        for how in dict.fromkeys(m.found for m in r.stochastic):
            found = [m for m in r.stochastic if m.found == how]
            kinds_found = ", ".join(f"{sum(m.type == t for m in found)} {t}" for t in dict.fromkeys(m.type for m in found))
            lines.append(f"  {kinds_found} ({how}): {_listed([module_label(m.module) for m in found], worst)}")
    if r.untested:
        lines.append(f"modules whose tensors carry no batch axis, not tested: {len(r.untested)}: "
                     f"{_listed(r.untested, worst)}")
    if r.causes:
        lines += ["why:", *(f"  {c}" for c in r.causes)]
    if r.remedies:
        lines += ["remedies:", *(f"  {m}" for m in r.remedies)]
    if r.precision is not None:
        lines += precision_lines(r.precision, r.micro_batch, r.num_accum)
    return "\n".join(lines)


def precision_lines(d: PrecisionDrift, micro_batch: int, num_accum: int) -> list[str]:
    """The precision section of a report: the two errors against float64, their ratio, the finding."""
    n = micro_batch * num_accum
    lines = [f"precision {d.precision}: {d.computes}",
             "  relative error against float64 of the same step (the same weights, samples and micro-batches):",
             f"  {f'accumulated, {num_accum} micro-batches of {micro_batch} summed in {d.summed_in}':<56} "
             f"{d.accumulated_rel:.2g}",
             f"  {f'one batch of {n}':<56} {d.big_rel:.2g}"]
    if d.scale is not None:
        lines.append(f"  loss scale {d.scale:g}" + (f", after {d.skipped} skipped steps (Inf or NaN at a larger scale)"
                                                    if d.skipped else ""))
    rule = f"above {WORSE_RATIO:g}x and by more than {d.floor:.2g}, one {d.dtype} rounding"
    lines.append(f"  accumulated against one batch: {d.ratio:.2g}x, " + (
        f"measurably worse ({rule})" if d.worse else f"within the rule (measurably worse: {rule})"))
    if d.worse:
        lines += [f"IMPRECISE: {num_accum} micro-batch gradients summed in {d.summed_in} are {d.ratio:.2g}x as far "
                  f"from float64 as one batch of {n} ({d.accumulated_rel:.2g} against {d.big_rel:.2g})",
                  f"  remedy: {d.remedy}"]
    return lines
