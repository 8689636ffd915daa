"""Batches as nested structures (a tensor, or tuples, lists and dicts of them): rows taken from every tensor, the
axis that carries the samples traced by shape, differences and norms, NaN found; and how a report names a module.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map


def module_label(name: str, model: nn.Module | None = None) -> str:
    """How a report names a module: its path, or '(the model)' for the root."""
    return name or (f"(the model, {type(model).__name__})" if model is not None else "(the model)")


def rows_of(obj: Any, start: int, stop: int, n: int) -> Any:
    """Rows start:stop of every tensor whose first dimension is the batch (n); anything else as it is. (The
    model's inputs and the targets carry the samples first: that is the contract of the check.)"""
    return tree_map(lambda t: t[start:stop] if is_batched(t, n) else t, obj)


def is_batched(t: Any, n: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == n


def call_with(fn: Callable[..., Any], inputs: Any) -> Any:
    """model(x), model(*inputs) for a tuple or list, model(**inputs) for a dict."""
    if isinstance(inputs, dict):
        return fn(**inputs)
    if isinstance(inputs, (tuple, list)):
        return fn(*inputs)
    return fn(inputs)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b|; 0 when both are equal, inf for a difference from exactly zero."""
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else 1.0
    return safe_ratio(*diff_norms(a, b))


def diff_norms(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(|a - b|, |b|), in float32 at least (float64 doubles the cost of a check for no difference at rtol)."""
    if a.dtype != b.dtype or torch.finfo(a.dtype).bits < 32:
        a, b = a.float(), b.float()
    return torch.linalg.vector_norm(a - b).item(), torch.linalg.vector_norm(b).item()


def safe_ratio(diff: float, ref: float) -> float:
    return diff / ref if ref else (0.0 if diff == 0 else math.inf)


def nonfinite(obj: Any) -> str:
    """'nan' or 'inf' for the first floating-point tensor in obj that holds one, '' when all are finite."""
    for t in tree_leaves(obj):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
            return "nan" if torch.isnan(t).any() else "inf"
    return ""


def sample_axis(full: Any, small: Any, n: int, b: int) -> int | None:
    """The axis that carries the samples in a tensor the module saw: the one axis whose size is n in the whole
    batch's forward and b in a micro-batch's, every other axis the same; None when there is no such axis."""
    if not (isinstance(full, torch.Tensor) and isinstance(small, torch.Tensor)) or full.dim() != small.dim():
        return None
    differ = [d for d in range(full.dim()) if full.shape[d] != small.shape[d]]
    return differ[0] if len(differ) == 1 and full.shape[differ[0]] == n and small.shape[differ[0]] == b else None


def sample_axes(full: Any, small: Any, n: int, b: int) -> list[int | None] | None:
    """Each leaf's sample axis (see sample_axis), or None when the two structures differ."""
    full_leaves, full_spec = tree_flatten(full)
    small_leaves, small_spec = tree_flatten(small)
    if full_spec != small_spec:
        return None
    return [sample_axis(f, s, n, b) for f, s in zip(full_leaves, small_leaves)]
