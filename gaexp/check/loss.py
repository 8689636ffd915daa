"""The loss: the one contract a loss is held to (`loss(outputs, targets)`, or with the step's targets as a third
positional or a `step_targets=` keyword, unscaled), cross-entropy by default, and whether the loss couples the
samples of a batch (its gradient with respect to the outputs, the whole batch's outputs split in k, both ways).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from gaexp.check.errors import CheckError
from gaexp.check.trees import rel_diff, rows_of


STEP_TARGETS = "step_targets"  # a loss taking this (or a third positional) gets the whole step's targets, unscaled


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


def measure_loss_coupling(contract: LossContract, outputs: Any, axes: list[int | None], targets: Any, n: int,
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
        parts = [grads(cut(a, z), rows_of(targets, a, z, n), scale) for a, z in chunks]
    worst, per_chunk = 0.0, True
    for i, (whole, axis) in enumerate(zip(big, axes)):
        if whole is None:
            continue
        if axis is None:
            worst = max(worst, rel_diff(sum(p[i] for p in parts), whole))
            continue
        worst = max(worst, rel_diff(torch.cat([p[i] for p in parts], dim=axis), whole))
        for (a, z), p in zip(chunks, parts):  # each micro-batch's gradient a multiple of the whole batch's?
            w, g = whole.narrow(axis, a, z - a).double(), p[i].double()
            factor = (g * w).sum() / (w * w).sum() if (w * w).sum() > 0 else torch.tensor(0.0)
            residual = (g - factor * w).norm().item()
            per_chunk = per_chunk and residual <= rtol * max(g.norm().item(), w.norm().item() * scale, 1e-30)
    kind = "" if worst <= rtol else ("count" if per_chunk else "samples")
    return worst, kind
