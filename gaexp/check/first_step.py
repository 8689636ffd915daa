"""The check inside a trainer, on the first real step: its k micro-batches drawn from the trainer's own DataLoader
(its dataset, sampler and collator) without moving the trainer's random streams or iterators, padded to one length
and joined into one batch of b*k, checked once (`check_first_step`), and the verdict in one line (`verdict_line`).
The trainers' callbacks (hf_callback, lightning_callback) say how their trainer computes the loss; this module
knows no trainer.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from gaexp.check.accumulation import check_accumulation
from gaexp.check.errors import CheckError
from gaexp.check.loss import IGNORE_INDEX
from gaexp.check.report import Report

PAD_VALUES = {"labels": IGNORE_INDEX, "attention_mask": 0, "token_type_ids": 0}  # by key; input ids: the pad token
METRICS = ("safe", "gradient_rel", "loss_rel")  # a trainer's loggers get them as gaexp_check/NAME
VERDICT_TAG = "gaexp.check.verdict"  # the MLflow tag of the verdict, safe or unsafe


class AccumulationError(RuntimeError):
    """Raised by a trainer's callback asked to stop on a step that is not safe to accumulate."""


def first_batches(loader: Any, k: int) -> list[Any]:
    """The first k batches the loader gives, drawn from its batch sampler, dataset and collator, with torch's,
    Python's and NumPy's random streams given back: the trainer then draws the same batches itself."""
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        sampler = getattr(loader, "batch_sampler", None)
        dataset, collate = getattr(loader, "dataset", None), getattr(loader, "collate_fn", None)
        batches = []
        if sampler is not None and dataset is not None and collate is not None:
            for indices in sampler:
                batches.append(collate([dataset[i] for i in indices]))
                if len(batches) == k:
                    break
        else:  # an iterable dataset: its own iterator, started afresh
            for batch in loader:
                batches.append(batch)
                if len(batches) == k:
                    break
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(py_state)
        np.random.set_state(np_state)
    if len(batches) < k:
        raise CheckError(f"the training data gives {len(batches)} batches; the first step needs {k}")
    return batches


def rows(batch: Any) -> int:
    sizes = {t.shape[0] for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise CheckError(f"a batch's tensors have {sorted(sizes) or 'no'} rows; the check needs one batch size")
    return sizes.pop()


def join(batches: Sequence[Any], pad_id: int = 0, left: bool = False) -> Any:
    """The batches as one, row after row: tensors of different lengths (a collator pads each batch to its own
    longest row) padded to the longest first, labels with -100, attention masks with 0, input ids with the pad
    token, on the side the tokenizer pads."""
    flat = [tree_flatten(b) for b in batches]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        raise CheckError("the first step's batches differ in structure; the check joins batches of one form")
    keys = [str(getattr(path[-1], "key", "")) for path, _ in
            torch.utils._pytree.tree_flatten_with_path(batches[0])[0]]
    joined = []
    for i, key in enumerate(keys):
        parts = [leaves[i] for leaves, _ in flat]
        if not all(isinstance(p, torch.Tensor) for p in parts):
            joined.append(parts[0])
            continue
        if parts[0].dim() >= 2 and len({p.shape[1] for p in parts}) > 1:
            longest = max(p.shape[1] for p in parts)
            value = PAD_VALUES.get(key, pad_id)
            pads = [(longest - p.shape[1], 0) if left else (0, longest - p.shape[1]) for p in parts]
            parts = [torch.nn.functional.pad(p.movedim(1, -1), pad, value=value).movedim(-1, 1)
                     for p, pad in zip(parts, pads)]
        joined.append(torch.cat(parts) if parts[0].dim() > 0 else parts[0])
    return tree_unflatten(joined, spec)


def check_first_step(model: nn.Module, batches: Sequence[Any], split: Callable[[Any], tuple[Any, Any]],
                     loss: Any, num_items_in_batch: Any = False, pad_id: int = 0, left: bool = False,
                     device: torch.device | None = None) -> Report:
    """The check on the first step's batches, joined: `split(joined)` gives (the model's inputs, the targets);
    micro-batch b is the first batch's rows and k the number of batches (a batch of another size ends the step
    early: the check takes the full ones, at least two)."""
    b = rows(batches[0])
    full = [batch for batch in batches if rows(batch) == b]
    if len(full) < 2:
        raise CheckError(f"the first step has {len(full)} batch of {b} rows; the check needs 2 or more")
    joined = join(full, pad_id, left)
    if device is not None:
        joined = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, joined)
    inputs, targets = split(joined)
    return check_accumulation(model, inputs, targets, loss, micro_batch=b, num_accum=len(full),
                              num_items_in_batch=num_items_in_batch)


def figures(report: Report) -> dict[str, float]:
    """The report's figures as a trainer's loggers take them."""
    return {f"gaexp_check/{name}": float(getattr(report, name)) for name in METRICS}


def verdict_line(report: Report, trainer: str) -> str:
    """The report in one line: the verdict, the first cause and the first remedy."""
    head = (f"gaexp-check in {trainer}: {'SAFE' if report.safe else 'UNSAFE'} to accumulate the first step "
            f"({report.micro_batch} x {report.num_accum} micro-batches against one batch of "
            f"{report.micro_batch * report.num_accum}: gradient relative difference {report.gradient_rel:.2g})")
    if report.safe:
        return head
    cause = report.causes[0] if report.causes else "the gradients differ"
    remedy = report.remedies[0].strip() if report.remedies else ""
    if remedy.endswith(":") and len(report.remedies) > 1:  # a list of options: its subject and the first option
        remedy = f"{remedy.split(',')[0]}: {report.remedies[1].strip()}"
    remedy = f"; remedy: {remedy}" if remedy else ""
    return f"{head}: {cause}{remedy}"
