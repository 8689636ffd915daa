"""The loss: the one contract a loss is held to (`loss(outputs, targets)`, or with the step's targets as a third
positional or a `step_targets=` keyword, unscaled; or with the step's count of items, `num_items_in_batch=`, as
transformers' Trainer calls a `compute_loss_func`, unscaled), cross-entropy by default or the model's own
(`loss="model"`: the loss its forward returns, given `num_items_in_batch=` there if asked, as the Trainer does), and
whether the loss couples the samples of a batch (its gradient with respect to the outputs, the whole batch's outputs
split in k, both ways).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from gaexp.check.errors import CheckError
from gaexp.check.trees import rel_diff, rows_of


STEP_TARGETS = "step_targets"  # a loss taking this (or a third positional) gets the whole step's targets, unscaled
NUM_ITEMS = "num_items_in_batch"  # a loss taking this gets the step's count of valid target items, unscaled (HF)
MODEL_LOSS = "model"  # loss="model": the loss the model's forward computes (outputs["loss"], or a scalar first output)
IGNORE_INDEX = -100  # a target item that does not count (transformers' and torch's cross-entropy's ignore_index)


def count_items(step_targets: Any) -> int:
    """The step's count of items, as transformers' Trainer counts `num_items_in_batch`: the integer target entries
    that are not IGNORE_INDEX, over the step's k micro-batches."""
    ints = [t for t in tree_leaves(step_targets) if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    if not ints:
        raise CheckError(f"{NUM_ITEMS} counts the targets' items that are not {IGNORE_INDEX}, and the targets hold no "
                         "integer tensor (give the labels as targets)")
    return int(sum(int(t.ne(IGNORE_INDEX).sum()) for t in ints))


def model_loss(outputs: Any, targets: Any) -> torch.Tensor:
    """The model's own loss: outputs["loss"] (a transformers ModelOutput or a dict), else a scalar first output, as
    transformers' Trainer takes it."""
    if isinstance(outputs, Mapping):
        if outputs.get("loss") is None:
            raise TypeError(f"the model returned no loss (its outputs: {', '.join(map(str, outputs.keys()))}): give "
                            "it the labels among its inputs")
        return outputs["loss"]
    first = outputs[0] if isinstance(outputs, (tuple, list)) and outputs else outputs
    if isinstance(first, torch.Tensor) and first.numel() == 1:
        return first
    raise TypeError(f"the model returned {type(outputs).__name__}, with no loss first")


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
    positional parameter or a `step_targets` keyword, or with the step's count of items as `num_items_in_batch`
    (each of the last two not scaled by 1/k). `items`: where the step's count goes, "" nowhere, "loss" to the
    loss's num_items_in_batch, "forward" to the model's forward (the model's own loss, as the Trainer gives it)."""
    fn: Callable[..., torch.Tensor]
    name: str
    step: bool  # takes the step's targets or count: not scaled by 1/k
    positional: bool  # ... as its third positional argument (else as a keyword)
    in_model: bool = False  # the loss the model's forward computes
    items: str = ""
    count: Callable[[Any], int] = count_items  # the step's count of items, from the step's targets

    def scale(self, chunks: int) -> float:
        """What each micro-batch's loss is multiplied by: 1/k for a mean over its micro-batch, 1 for one that
        normalizes by the step (its targets or its count) or for the whole batch."""
        return 1.0 if self.step or chunks == 1 else 1.0 / chunks

    def inputs_for(self, inputs: Any, step_targets: Any) -> Any:
        """A micro-batch's inputs to the model, with the step's count as num_items_in_batch= where the model's own
        loss takes it."""
        if self.items != "forward":
            return inputs
        if not isinstance(inputs, Mapping):
            raise CheckError(f"{NUM_ITEMS} goes to the model's forward as a keyword: give the inputs as a dict of "
                             "keyword arguments")
        return {**inputs, NUM_ITEMS: self.count(step_targets)}

    def described(self, k: int) -> str:
        """How the report names the loss and its scaling."""
        if self.items:
            where = "the model's forward" if self.items == "forward" else "the loss"
            return (f"{self.name}, given the step's count of items ({NUM_ITEMS}) in {where}, not scaled, as "
                    "transformers' Trainer does")
        if self.step:
            return f"{self.name}, given the step's targets ({STEP_TARGETS}), not scaled"
        return f"{self.name}, each micro-batch's scaled by 1/{k}"

    def value(self, outputs: Any, targets: Any, step_targets: Any) -> torch.Tensor:
        try:
            if self.items == "loss":
                value = self.fn(outputs, targets, **{NUM_ITEMS: self.count(step_targets)})
            elif not self.step or self.items == "forward":
                value = self.fn(outputs, targets)
            elif self.positional:
                value = self.fn(outputs, targets, step_targets)
            else:
                value = self.fn(outputs, targets, **{STEP_TARGETS: step_targets})
        except CheckError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's loss, said in one line
            raise CheckError(f"loss {self.name} fails on the model's outputs: {type(e).__name__}: {e}"
                             .splitlines()[0]) from None
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
            raise CheckError(f"loss {self.name} returned {type(value).__name__} "
                             f"{tuple(getattr(value, 'shape', ()))}; expected a scalar floating-point tensor")
        return value.reshape(())


LOSS_FORMS = (f"loss(outputs, targets), loss(outputs, targets, {STEP_TARGETS}), "
              f"loss(outputs, targets, *, {STEP_TARGETS}) or loss(outputs, targets, {NUM_ITEMS}) -> scalar tensor, "
              f"or '{MODEL_LOSS}' (the model's own)")


def loss_contract(loss: Callable[..., torch.Tensor] | str | None,
                  num_items_in_batch: bool | Callable[[Any], int] = False) -> LossContract:
    """The one loss contract of the check and of gaexp-check: two positional parameters (outputs, targets), and
    optionally the step's targets, as a third positional parameter or a keyword-only `step_targets`, or the step's
    count of items as `num_items_in_batch` (a third positional or a keyword); or "model", the model's own loss.
    Any other parameter must have a default. `num_items_in_batch`: True (count_items) or a function of the step's
    targets: the step's count given to the model's own loss (in its forward) or to a loss that takes it. Refused in
    one line naming the valid forms."""
    count = num_items_in_batch if callable(num_items_in_batch) else count_items
    if isinstance(loss, str):
        if loss != MODEL_LOSS:
            raise CheckError(f"loss={loss!r}; expected {LOSS_FORMS}")
        return LossContract(model_loss, "the model's own loss (outputs.loss)", bool(num_items_in_batch), False,
                            True, "forward" if num_items_in_batch else "", count)
    fn = loss or cross_entropy
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    contract = _contract_of(fn, name)
    if contract.items:
        return LossContract(fn, name, True, contract.positional, items="loss", count=count)
    if num_items_in_batch:
        raise CheckError(f"{NUM_ITEMS} given, and loss {name} takes no {NUM_ITEMS} parameter: give "
                         f"loss='{MODEL_LOSS}' (the count goes to the model's forward) or a loss that takes it")
    return contract


def _contract_of(fn: Callable[..., torch.Tensor], name: str) -> LossContract:
    """A loss function's form, from its signature."""
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
    items = signature.parameters.get(NUM_ITEMS)
    if items is not None and takes_two and items.kind is not items.POSITIONAL_ONLY and len(required) <= 3:
        return LossContract(fn, name, True, False, items="loss")
    if keyword is not None and keyword.kind is keyword.KEYWORD_ONLY and takes_two and len(required) <= 2:
        return LossContract(fn, name, True, False)
    if len(positional) >= 3 and (positional[2].name == STEP_TARGETS or positional[2].default is positional[2].empty) \
            and len(required) <= 3:
        return LossContract(fn, name, True, True)
    others = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty
              and p.name not in (STEP_TARGETS, NUM_ITEMS)]
    if takes_two and len(required) <= 2 and not others:
        return LossContract(fn, name, False, False)
    raise CheckError(f"loss {name}{signature}: expected {LOSS_FORMS}")


def measure_loss_coupling(contract: LossContract, outputs: Any, axes: list[int | None], targets: Any, n: int,
                          chunks: list[tuple[int, int]], rtol: float) -> tuple[float, str, bool]:
    """The loss's gradient with respect to the full batch's outputs, against the k micro-batch losses' (each
    scaled by 1/k unless the loss normalizes by the step), relative; the kind of coupling (`split_kind`); and
    whether the loss reads an output that carries no batch axis (a loss computed in the model's forward, an
    auxiliary term): then splitting the outputs says nothing, and the terms are measured through the model
    (gaexp.check.terms) instead, never this split."""
    scale = contract.scale(len(chunks))
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
        if any(axis is None and g is not None and bool(g.ne(0).any()) for g, axis in zip(big, axes)):
            return 0.0, "", True
        parts = [grads(cut(a, z), rows_of(targets, a, z, n), scale) for a, z in chunks]
    worst, kind = split_kind(big, parts, axes, chunks, scale, rtol)
    return worst, kind, False


def split_kind(big: list[torch.Tensor | None], parts: list[list[torch.Tensor | None]], axes: list[int | None],
               chunks: list[tuple[int, int]], scale: float, rtol: float) -> tuple[float, str]:
    """Gradients with respect to outputs that carry the samples (`axes`), the whole batch's against each
    micro-batch's: the largest relative difference, and the kind of coupling: "count" when each micro-batch's
    gradient is the whole batch's times a factor of its own (a mean over a count that varies between
    micro-batches), "samples" when it is not (samples compared with each other), "" when they agree."""
    worst, per_chunk = 0.0, True
    for i, (whole, axis) in enumerate(zip(big, axes)):
        if whole is None or axis is None or any(p[i] is None for p in parts):
            continue
        worst = max(worst, rel_diff(torch.cat([p[i] for p in parts], dim=axis), whole))
        for (a, z), p in zip(chunks, parts):  # each micro-batch's gradient a multiple of the whole batch's?
            w, g = whole.narrow(axis, a, z - a).double(), p[i].double()
            factor = (g * w).sum() / (w * w).sum() if (w * w).sum() > 0 else torch.tensor(0.0)
            residual = (g - factor * w).norm().item()
            per_chunk = per_chunk and residual <= rtol * max(g.norm().item(), w.norm().item() * scale, 1e-30)
    kind = "" if worst <= rtol else ("count" if per_chunk else "samples")
    return worst, kind
