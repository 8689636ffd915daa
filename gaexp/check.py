"""Is a training step safe to accumulate? One step taken both ways from the same weights, measured.

`check_accumulation` runs one training step as one batch of b*k samples and as k micro-batches of b (each
micro-batch loss scaled by 1/k, as gaexp's loop does), from the same weights and the same samples, and says
what differs and why:

- the gradients, per parameter tensor and overall (relative difference), against a float-rounding threshold;
- the modules that couple the samples of a batch: each module is called again on its own recorded input,
  micro-batch by micro-batch, and its outputs compared with the full batch's (so a module is named for what it
  does itself, not for what reached it from upstream; a module is tested whole only when none of its
  submodules couples, which also finds couplings written in a parent's `forward`);
- the buffers that end the step differently (BatchNorm's running statistics: k updates instead of one);
- the loss: its gradient with respect to the model's outputs, the full batch's outputs split in k, both ways
  (a mean over a count that varies between micro-batches, in-batch negatives).

Stochastic modules (dropout, stochastic depth, `F.dropout` in a forward) are found by calling them twice on the
same input with different seeds, and checked with their training flag off (as in evaluation); the report names
them. The model is left as it was: parameters, buffers, `.grad` and training flags.

Nothing here knows about Hydra, MLflow or gaexp's datasets: the command around it is gaexp/check_cli.py.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

STEP_TARGETS = "step_targets"  # a loss taking this keyword gets the whole step's targets and is not scaled by 1/k

# What gaexp's own study measured for BatchNorm at micro-batch 1 x 16 accumulation steps (docs/results.md,
# "The remedies": the study's CNN on MNIST, full protocol, mean valid accuracy over 3 seeds, and the paired
# difference to the true batch of 16, bn/bs16a1, with its 95% t-interval and its verdict at ±0.5 points).
# tests/test_check.py holds these figures to that table.
BN_ACCUMULATED = ("bn", 88.70, "-8.94 [-16.05, -1.83]", "worse")
BN_REMEDIES = (  # (norm= choice, what it changes, accuracy %, points against the true batch, verdict)
    ("bn_microeval", "evaluate with each micro-batch's own statistics, as it trained", 98.41, "+0.77 [+0.64, +0.90]",
     "better"),
    ("in", "InstanceNorm instead", 98.47, "+0.83 [+0.52, +1.15]", "better"),
    ("brn", "Batch Renorm: training corrected towards the running statistics", 97.55, "-0.10 [-0.74, +0.55]",
     "inconclusive (4 seeds)"),
    ("gn16", "GroupNorm with 16 groups instead", 97.31, "-0.33 [-1.21, +0.56]", "inconclusive (7 seeds)"),
    ("bn_precise", "exact population statistics before each evaluation", 90.65, "-6.99 [-10.83, -3.16]", "worse"),
)


class CheckError(ValueError):
    """Input the check cannot use (shapes, sizes, a loss or model that fails): one line naming what was expected."""


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
    stochastic: list[str]  # modules checked with their training flag off
    untested: list[str]  # modules whose input or output has no leading batch dimension
    remedies: list[str]
    seconds: float
    causes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return render(self)


# --- batches as nested structures: a tensor, or tuples, lists and dicts of them ----------------------------

def _rows(obj: Any, start: int, stop: int, n: int) -> Any:
    """Rows start:stop of every tensor whose first dimension is the batch (n); anything else as it is."""
    return tree_map(lambda t: t[start:stop] if _batched(t, n) else t, obj)


def _batched(t: Any, n: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == n


def _detached(obj: Any) -> Any:
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, obj)


def _call(fn: Callable[..., Any], inputs: Any) -> Any:
    """model(x), model(*inputs) for a tuple or list, model(**inputs) for a dict."""
    if isinstance(inputs, dict):
        return fn(**inputs)
    if isinstance(inputs, (tuple, list)):
        return fn(*inputs)
    return fn(inputs)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| in float64; 0 when both are equal, inf for a difference from exactly zero."""
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else 1.0
    diff = (a.double() - b.double()).norm().item()
    ref = b.double().norm().item()
    return diff / ref if ref else (0.0 if diff == 0 else math.inf)


def _compare(micro: list[Any], full: Any, n: int) -> float | None:
    """The largest relative difference between the micro-batch outputs, concatenated, and the full batch's,
    over the tensors with a batch dimension; None when there is none."""
    worst: float | None = None
    for leaves in zip(*(tree_leaves(m) for m in micro), tree_leaves(full)):
        *parts, whole = leaves
        if not _batched(whole, n):
            continue
        joined = torch.cat(parts)
        rel = _rel(joined, whole) if joined.shape == whole.shape else math.inf
        worst = rel if worst is None else max(worst, rel)
    return worst


# --- the model's state, kept and given back ---------------------------------------------------------------

class _Kept:
    """The model's parameters, buffers, gradients and training flags, as they were, to restore."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.grads = [p.grad for p in model.parameters()]
        self.training = {m: m.training for m in model.modules()}

    def restore_state(self) -> None:
        self.model.load_state_dict(self.state)

    def restore_all(self) -> None:
        self.restore_state()
        for p, g in zip(self.model.parameters(), self.grads):
            p.grad = g
        for m, flag in self.training.items():
            m.training = flag


@dataclass
class _Call:
    args: tuple
    kwargs: dict
    output: Any = None


def _record(model: nn.Module, inputs: Any, seed: int) -> dict[str, list[_Call]]:
    """Every module's calls in one forward pass without gradient: copies of its arguments and its output."""
    calls: dict[str, list[_Call]] = {}
    open_calls: dict[str, list[_Call]] = {}
    handles = []
    for name, module in model.named_modules():
        def before(m: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            open_calls.setdefault(name, []).append(_Call(_detached(args), _detached(kwargs)))

        def after(m: nn.Module, args: tuple, kwargs: dict, output: Any, name: str = name) -> None:
            call = open_calls[name].pop()
            call.output = _detached(output)
            calls.setdefault(name, []).append(call)

        handles += [module.register_forward_pre_hook(before, with_kwargs=True),
                    module.register_forward_hook(after, with_kwargs=True)]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=_devices(model)):
            torch.manual_seed(seed)
            _call(model, inputs)
    finally:
        for h in handles:
            h.remove()
    return calls


def _devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def _recall(module: nn.Module, call: _Call, n: int, chunks: list[tuple[int, int]] | None, seed: int,
            devices: list[int]) -> list[Any]:
    """The module called again on its recorded arguments (whole, or in the given row ranges), its own state
    given back afterwards."""
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    outputs = []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            for start, stop in chunks or [(0, n)]:
                rows = (call.args, call.kwargs) if chunks is None else _rows((call.args, call.kwargs), start, stop, n)
                args, kwargs = _detached(rows)
                outputs.append(module(*args, **kwargs))
    finally:
        module.load_state_dict(state)
    return outputs


def _has_batch(call: _Call, n: int) -> bool:
    return any(_batched(t, n) for t in tree_leaves((call.args, call.kwargs))) and \
        any(_batched(t, n) for t in tree_leaves(call.output))


def _children_first(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return sorted(model.named_modules(), key=lambda item: -item[0].count(".") - bool(item[0]))


def _descendants(name: str, names: Iterable[str]) -> list[str]:
    prefix = f"{name}." if name else ""
    return [other for other in names if other != name and other.startswith(prefix)]


# --- the measurements ------------------------------------------------------------------------------------

def _forward(model: nn.Module, inputs: Any, seed: int) -> Any:
    """The model's output without gradient, the random stream seeded with `seed` (the global one kept)."""
    with torch.no_grad(), torch.random.fork_rng(devices=_devices(model)):
        torch.manual_seed(seed)
        return _detached(_call(model, inputs))


def _differs(a: Any, b: Any, rtol: float) -> bool:
    pairs = [(x, y) for x, y in zip(tree_leaves(a), tree_leaves(b)) if isinstance(x, torch.Tensor)]
    return any(x.shape != y.shape or _rel(x, y) > rtol for x, y in pairs)


def _switch_off_stochastic(model: nn.Module, inputs: Any, rtol: float, seed: int) -> list[str]:
    """Find the modules whose output depends on the random stream (the same input, two seeds) and turn their
    own training flag off, innermost first, until the model's output does not; their names."""
    devices, found = _devices(model), []
    for _ in range(8):  # each round turns off the innermost random modules left
        if not _differs(_forward(model, inputs, seed + 1), _forward(model, inputs, seed), rtol):
            return found
        calls = _record(model, inputs, seed)
        random_modules: list[str] = []
        for name, module in _children_first(model):
            if not module.training or name not in calls or _descendants(name, random_modules):
                continue  # off already, never called, or random through a submodule (found first)
            call = calls[name][0]
            if _differs(_recall(module, call, 0, None, seed + 1, devices)[0], call.output, rtol):
                random_modules.append(name)
        if not random_modules:
            break
        for name in random_modules:
            model.get_submodule(name).training = False
        found += random_modules
    raise CheckError("the model's output still depends on the random seed with its random modules "
                     f"({', '.join(found) or 'none found'}) switched off; the check needs a deterministic step")


def _couplings(model: nn.Module, inputs: Any, n: int, chunks: list[tuple[int, int]], rtol: float,
               seed: int) -> tuple[list[Coupling], list[str]]:
    """The modules whose outputs, called micro-batch by micro-batch on their recorded inputs, differ from the
    full batch's; innermost first, a module tested only when none of its submodules couples."""
    devices, calls = _devices(model), _record(model, inputs, seed)
    coupled: dict[str, Coupling] = {}
    untested: list[str] = []
    for name, module in _children_first(model):
        if name not in calls:  # never called in the forward pass
            continue
        if _descendants(name, coupled):
            continue
        worst: float | None = None
        for call in calls[name]:
            if not _has_batch(call, n):
                continue
            rel = _compare(_recall(module, call, n, chunks, seed, devices), call.output, n)
            if rel is not None:
                worst = rel if worst is None else max(worst, rel)
        if worst is None:
            untested.append(name or type(model).__name__)
        elif worst > rtol:
            coupled[name] = Coupling(name, type(module).__name__, worst)
    ordered = [name for name, _ in model.named_modules()]
    return sorted(coupled.values(), key=lambda c: ordered.index(c.module)), untested


def _loss_fn(loss: Callable[..., torch.Tensor] | None) -> tuple[Callable[..., torch.Tensor], bool, str]:
    """(the loss, whether it takes the step's targets, its name)."""
    fn = loss or F.cross_entropy
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: called with two arguments
        return fn, False, name
    step = STEP_TARGETS in parameters
    positional = [p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.name != STEP_TARGETS]
    takes_two = len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters.values())
    required = [p for p in positional if p.default is p.empty]
    if not takes_two or len(required) > 2:
        raise CheckError(f"loss {name}{inspect.signature(fn)}: expected loss(outputs, targets) -> scalar tensor"
                         f" (optionally with a {STEP_TARGETS}= keyword)")
    return fn, step, name


def _loss_value(fn: Callable[..., torch.Tensor], name: str, outputs: Any, targets: Any, step: bool,
                all_targets: Any) -> torch.Tensor:
    try:
        value = fn(outputs, targets, **({STEP_TARGETS: all_targets} if step else {}))
    except Exception as e:  # noqa: BLE001 - the user's loss, said in one line
        raise CheckError(f"loss {name} fails on the model's outputs: {type(e).__name__}: {e}") from None
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        raise CheckError(f"loss {name} returned {type(value).__name__} "
                         f"{tuple(getattr(value, 'shape', ()))}; expected a scalar floating-point tensor")
    return value.reshape(())


def _loss_coupling(fn: Callable[..., torch.Tensor], name: str, outputs: Any, targets: Any, n: int,
                   chunks: list[tuple[int, int]], step: bool) -> float:
    """The loss's gradient with respect to the full batch's outputs, against the k micro-batch losses' (each
    scaled by 1/k unless the loss takes the step's targets), relative."""
    scale = 1.0 if step else 1.0 / len(chunks)

    def grads(out: Any, tgt: Any, factor: float) -> list[torch.Tensor]:
        out = tree_map(lambda t: t.detach().clone().requires_grad_(True)
                       if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)
        leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        value = _loss_value(fn, name, out, tgt, step, targets) * factor
        return [g if g is not None else torch.zeros_like(t)
                for g, t in zip(torch.autograd.grad(value, leaves, allow_unused=True), leaves)]

    with torch.enable_grad():
        big = grads(outputs, targets, 1.0)
        parts = [grads(_rows(outputs, a, b, n), _rows(targets, a, b, n), scale) for a, b in chunks]
    worst = 0.0
    for i, whole in enumerate(big):
        joined = torch.cat([p[i] for p in parts]) if _batched(whole, n) else sum(p[i] for p in parts)
        worst = max(worst, _rel(joined, whole))
    return worst


def _step(model: nn.Module, kept: _Kept, inputs: Any, targets: Any, n: int, chunks: list[tuple[int, int]],
          fn: Callable[..., torch.Tensor], name: str, step: bool, seed: int
          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One step from the kept weights, in the given row ranges: (each parameter's gradient, each buffer after)."""
    kept.restore_state()
    params = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    for _, p in params:
        p.grad = None
    scale = 1.0 if step or len(chunks) == 1 else 1.0 / len(chunks)
    with torch.enable_grad(), torch.random.fork_rng(devices=_devices(model)):
        torch.manual_seed(seed)
        for start, stop in chunks:
            try:
                outputs = _call(model, _rows(inputs, start, stop, n))
            except Exception as e:  # noqa: BLE001 - the user's forward, said in one line
                shapes = [tuple(t.shape) for t in tree_leaves(_rows(inputs, start, stop, n))
                          if isinstance(t, torch.Tensor)]
                raise CheckError(f"the model's forward fails on a batch of {stop - start} (inputs of shape "
                                 f"{', '.join(map(str, shapes))}): {type(e).__name__}: {e}") from None
            (_loss_value(fn, name, outputs, _rows(targets, start, stop, n), step, targets) * scale).backward()
    gradients = {k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for k, p in params}
    return gradients, {k: b.detach().clone() for k, b in model.named_buffers()}


def _scalar(t: torch.Tensor) -> str:
    return f"{t.item():g}" if t.numel() == 1 else ""


def check_accumulation(model: nn.Module, inputs: Any, targets: Any,
                       loss: Callable[..., torch.Tensor] | None = None, *, micro_batch: int, num_accum: int,
                       rtol: float | None = None, seed: int = 0) -> Report:
    """One training step of `model` on `inputs`/`targets` (micro_batch * num_accum samples, the batch first in
    every tensor; `inputs` a tensor, or a tuple/list of positional arguments, or a dict of keyword arguments)
    taken as one batch and as `num_accum` micro-batches, compared. `loss(outputs, targets)` is cross-entropy by
    default and is treated as a mean over its micro-batch: each micro-batch's loss is scaled by 1/num_accum. A
    loss that takes a `step_targets` keyword is given the whole step's targets and is not scaled (it normalizes
    by the step itself, e.g. by the step's total count of valid tokens). `rtol`: the float-rounding threshold,
    by default the square root of the parameters' machine epsilon (3.5e-4 in float32)."""
    tic = time.perf_counter()
    if not isinstance(micro_batch, int) or micro_batch < 1:
        raise CheckError(f"micro_batch={micro_batch!r}; valid: an integer >= 1")
    if not isinstance(num_accum, int) or num_accum < 2:
        raise CheckError(f"num_accum={num_accum!r}; valid: an integer >= 2 (one step of 1 micro-batch is the "
                         "big batch itself)")
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
    fn, step, name = _loss_fn(loss)
    chunks = [(i * micro_batch, (i + 1) * micro_batch) for i in range(num_accum)]

    kept = _Kept(model)
    try:
        model.train()
        try:
            _forward(model, inputs, seed)
        except Exception as e:  # noqa: BLE001 - the user's forward, said in one line
            shapes = [tuple(t.shape) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
            raise CheckError(f"the model's forward fails in training mode on inputs of shape "
                             f"{', '.join(map(str, shapes))}: {type(e).__name__}: {e}") from None
        stochastic = _switch_off_stochastic(model, inputs, rtol, seed)
        big_grads, big_buffers = _step(model, kept, inputs, targets, n, [(0, n)], fn, name, step, seed)
        acc_grads, acc_buffers = _step(model, kept, inputs, targets, n, chunks, fn, name, step, seed)
        kept.restore_state()
        modules, untested = _couplings(model, inputs, n, chunks, rtol, seed)
        outputs = _forward(model, inputs, seed)
        kept.restore_state()
        loss_rel = _loss_coupling(fn, name, outputs, targets, n, chunks, step)
    finally:
        kept.restore_all()

    total = math.sqrt(sum(g.double().norm().item() ** 2 for g in big_grads.values()))
    size = sum(g.numel() for g in big_grads.values()) or 1
    tensors = []
    for key, big in big_grads.items():
        diff = (acc_grads[key].double() - big.double()).norm().item()
        floor = big.double().norm().item() + total * math.sqrt(big.numel() / size)
        tensors.append(TensorDiff(key, _rel(acc_grads[key], big), diff > rtol * floor))
    overall = math.sqrt(sum((acc_grads[k].double() - g.double()).norm().item() ** 2 for k, g in big_grads.items()))
    gradient_rel = overall / total if total else (0.0 if overall == 0 else math.inf)

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
    causes = _causes(modules, buffers, loss_couples, unexplained)
    return Report(
        safe=not (grad_differs or modules or buffers or loss_couples), micro_batch=micro_batch,
        num_accum=num_accum, rtol=rtol, threshold=threshold,
        loss=f"{name}, " + (f"given the step's targets ({STEP_TARGETS}=), not scaled" if step
                            else f"each micro-batch's scaled by 1/{num_accum}"),
        gradient_rel=gradient_rel, tensors=tensors, modules=modules, buffers=buffers, loss_rel=loss_rel,
        loss_couples=loss_couples, unexplained=unexplained, stochastic=stochastic, untested=untested,
        remedies=_remedies(modules, buffers, owners, loss_couples, step), seconds=time.perf_counter() - tic,
        causes=causes)


def _causes(modules: list[Coupling], buffers: list[BufferDiff], loss_couples: bool, unexplained: bool) -> list[str]:
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
    if loss_couples:
        causes.append("the loss couples the samples of a batch: for the same outputs, its gradient differs between "
                      "the whole batch and the micro-batches")
    if unexplained:
        causes.append("the gradients differ while no module's per-sample outputs and not the loss do: state "
                      "carried between micro-batches, or a module without a leading batch dimension (untested)")
    return causes


def _remedies(modules: list[Coupling], buffers: list[BufferDiff], owners: dict[str, nn.Module],
              loss_couples: bool, step: bool) -> list[str]:
    remedies = []
    named = {c.module for c in modules} | {b.module for b in buffers}
    batchnorm = any(isinstance(owners[m], nn.modules.batchnorm._BatchNorm) for m in named)
    if batchnorm:
        choice, accuracy, against, verdict = BN_ACCUMULATED
        remedies.append("for BatchNorm, as gaexp's study measured them (its CNN on MNIST, micro-batch 1 x 16 "
                        "steps, valid accuracy, 3 seeds; points against the true batch of 16, 95% interval, "
                        f"verdict at ±0.5 points; accumulated {choice}: {accuracy:.2f}%, {against}, {verdict}):")
        remedies += [f"  norm={choice}: {what}: {accuracy:.2f}%, {against}, {verdict}"
                     for choice, what, accuracy, against, verdict in BN_REMEDIES]
    if any(not isinstance(owners[m], nn.modules.batchnorm._BatchNorm) for m in named):
        remedies.append("other coupling modules: compute their statistics per sample (GroupNorm, LayerNorm), or "
                        "once over the whole step before its micro-batches")
    if loss_couples:
        remedies.append("a mean over a count that varies between micro-batches (valid tokens, masked labels): "
                        "sum the loss and divide by the step's total count over all its micro-batches, with no 1/k"
                        + ("" if step else f" (a loss taking a {STEP_TARGETS}= keyword is given the step's targets)"))
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


def render(r: Report, worst: int = 5) -> str:
    """The report for people: the verdict, what differs, the remedies."""
    lines = [f"{'SAFE' if r.safe else 'UNSAFE'}: micro-batch {r.micro_batch} x {r.num_accum} accumulation steps "
             f"against one batch of {r.micro_batch * r.num_accum}, from the same weights and samples "
             f"({r.seconds:.1f} s)",
             f"loss: {r.loss}",
             f"threshold: relative difference {r.rtol:.2g} ({r.threshold})",
             f"gradient: relative difference {r.gradient_rel:.2g} over all parameters"]
    flagged = sorted((t for t in r.tensors if t.flagged), key=lambda t: -t.rel)
    if flagged:
        lines.append(f"  {len(flagged)} of {len(r.tensors)} parameter tensors differ; the largest:")
        lines += [f"  {t.name:<40} {t.rel:.2g}" for t in flagged[:worst]]
    lines.append(f"modules coupling the samples of a batch: {len(r.modules) or 'none'}")
    lines += [f"  {c.module or '(the model)':<40} {c.type:<20} {c.rel:.2g}" for c in r.modules]
    by_module: dict[tuple[str, str], list[BufferDiff]] = {}
    for b in r.buffers:
        by_module.setdefault((b.module, b.type), []).append(b)
    lines.append(f"buffers ending the step differently: {len(r.buffers) or 'none'}"
                 + (f", in {len(by_module)} modules" if by_module else ""))
    if len(by_module) <= worst:
        for (module, kind), diffs in by_module.items():
            lines.append(f"  {module:<40} {kind:<20} {_buffer_parts(diffs)}")
    else:  # one line per kind of module
        for kind in dict.fromkeys(k for _, k in by_module):
            diffs = [d for (_, k), ds in by_module.items() if k == kind for d in ds]
            count = sum(k == kind for _, k in by_module)
            lines.append(f"  {count} {kind} modules{'':<{max(0, 30 - len(kind) - len(str(count)))}} "
                         f"{_buffer_parts(diffs)}")
    lines.append(f"loss: {'couples the samples' if r.loss_couples else 'per-sample'} (relative difference of its "
                 f"gradient {r.loss_rel:.2g})")
    if r.stochastic:
        lines.append(f"random modules, checked with their training flag off: {', '.join(r.stochastic)}")
    if r.untested:
        lines.append(f"modules without a leading batch dimension, not tested: {', '.join(r.untested)}")
    if r.causes:
        lines += ["why:", *(f"  {c}" for c in r.causes)]
    if r.remedies:
        lines += ["remedies:", *(f"  {m}" for m in r.remedies)]
    return "\n".join(lines)
