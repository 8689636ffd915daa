"""A loss computed in the model's forward (transformers' `outputs.loss`: a token mean, a router's auxiliary loss, a
contrastive loss), term by term: the loss as given and each loss-like term the outputs expose (`aux_loss`, ...),
each differentiated through the model both ways, one batch and k micro-batches, and the kind of each coupling.

Splitting the model's outputs cannot tell here: a scalar loss carries no batch axis. So each term's gradient with
respect to the parameters is taken both ways (that is the step), and with respect to the outputs that carry the
samples (the logits, the embeddings) it reaches, which tells the kind, as for a loss of one's own
(`gaexp.check.loss.split_kind`): "count" (normalised per micro-batch, a mean over a count of its own), "samples"
(in-batch negatives), and "batch" where the difference reaches the weights through no per-sample output (an
auxiliary loss over the micro-batch's statistics: a router's load balancing).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey, tree_flatten_with_path

from gaexp.check.errors import CheckError, NonFiniteError
from gaexp.check.loss import LossContract, count_items, split_kind
from gaexp.check.report import GIVEN, LossTerm
from gaexp.check.state import Streams
from gaexp.check.step import forward_fails, gradient_diffs
from gaexp.check.trees import call_with, rows_of



def leaf_name(path: tuple) -> str:
    """An output's name from its path in the outputs: logits, aux_loss, router_logits[0], [1]."""
    parts = []
    for key in path:
        if isinstance(key, MappingKey):
            parts.append(f".{key.key}")
        elif isinstance(key, GetAttrKey):
            parts.append(f".{key.name}")
        elif isinstance(key, SequenceKey):
            parts.append(f"[{key.idx}]")
        else:
            parts.append(str(key))
    return "".join(parts).lstrip(".") or "(the output)"


def loss_like(names: list[str], leaves: list[Any], axes: list[int | None]) -> list[int]:
    """The outputs that are terms of a loss: scalar floating-point outputs with no batch axis named like a loss."""
    return [i for i, (name, t, axis) in enumerate(zip(names, leaves, axes))
            if axis is None and isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() == 1
            and "loss" in name.rpartition(".")[2].lower()]


def item_counts(targets: Any, n: int, chunks: list[tuple[int, int]]) -> list[int]:
    """Each micro-batch's count of valid target items (count_items of its rows); [] for targets with no integer
    tensor."""
    try:
        return [count_items(rows_of(targets, a, z, n)) for a, z in chunks]
    except CheckError:
        return []


def measure_terms(model: nn.Module, inputs: Any, targets: Any, contract: LossContract, n: int,
                  chunks: list[tuple[int, int]], axes: list[int | None], streams: Streams, seed: int,
                  rtol: float) -> list[LossTerm]:
    """The loss as given (first) and each loss-like output, differentiated through the model as one batch and as
    k micro-batches (each scaled as the contract scales the loss): the relative difference over the parameters,
    the outputs carrying the samples that the term's gradient reaches, and the kind of its coupling. `axes`: each
    output leaf's sample axis (None: none)."""
    named = [(key, p) for key, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    scale = contract.scale(len(chunks))
    names: list[str] = []  # each output leaf's name, from the first pass
    exposed: list[int] = []  # the loss-like outputs, from the first pass (the whole batch's)

    def one_way(rows: list[tuple[int, int]], factor: float) -> tuple[list[list[torch.Tensor] | None], list[list[Any]]]:
        """Per term: the parameters' gradient summed over the rows' passes (None: the term has no gradient), and
        per pass the gradients with respect to the outputs that carry the samples."""
        sums: list[list[torch.Tensor] | None] = []
        per_pass: list[list[Any]] = []
        streams.seed(seed)
        for a, z in rows:
            part = contract.inputs_for(rows_of(inputs, a, z, n), targets)
            try:
                outputs = call_with(model, part)
            except Exception as e:  # noqa: BLE001 - the user's forward, said in one line
                raise forward_fails(e, part, f"a batch of {z - a}") from None
            flat = tree_flatten_with_path(outputs)[0]
            leaves = [t for _, t in flat]
            if len(leaves) != len(axes):
                raise CheckError(f"the model's outputs have {len(leaves)} parts on rows {a}:{z} and {len(axes)} on "
                                 "the whole batch; the check needs the same structure for any batch size")
            given = contract.value(outputs, rows_of(targets, a, z, n), targets)
            if not names:  # the loss-like outputs, but the one that is the loss as given
                names.extend(leaf_name(path) for path, _ in flat)
                exposed.extend(i for i in loss_like(names, leaves, axes)
                               if leaves[i].untyped_storage().data_ptr() != given.untyped_storage().data_ptr())
            terms = [given, *(leaves[i] for i in exposed)]
            batched = [i for i, (t, axis) in enumerate(zip(leaves, axes)) if axis is not None
                       and isinstance(t, torch.Tensor) and t.requires_grad]
            grads_here = []
            for t, term in enumerate(terms):
                if len(sums) <= t:
                    sums.append(None)
                if not term.requires_grad:
                    grads_here.append([None] * len(leaves))
                    continue
                if not torch.isfinite(term):
                    raise NonFiniteError(f"{label_of(t)} is {term.item()} on rows {a}:{z}")
                found = torch.autograd.grad(term * factor, [*params, *(leaves[i] for i in batched)],
                                            retain_graph=True, allow_unused=True)
                g_params = [g if g is not None else torch.zeros_like(p) for g, p in zip(found, params)]
                sums[t] = g_params if sums[t] is None else [s + g for s, g in zip(sums[t], g_params)]
                by_leaf: list[Any] = [None] * len(leaves)
                for i, g in zip(batched, found[len(params):]):
                    by_leaf[i] = g
                grads_here.append(by_leaf)
            per_pass.append(grads_here)
            del outputs, terms, leaves, flat, given
        return sums, per_pass

    def label_of(t: int) -> str:
        return GIVEN if t == 0 else f"the model's {names[exposed[t - 1]]}"

    with torch.enable_grad():
        big_sums, big_pass = one_way([(0, n)], 1.0)
        acc_sums, acc_passes = one_way(chunks, scale)
    counts = item_counts(targets, n, chunks)
    results = []
    for t, label in enumerate([GIVEN, *(names[i] for i in exposed)]):
        big, acc = big_sums[t], acc_sums[t]
        if big is None or acc is None:
            continue
        tensors, rel = gradient_diffs({key: g for (key, _), g in zip(named, big)},
                                      {key: g for (key, _), g in zip(named, acc)}, rtol)
        differs = rel > rtol or any(d.flagged for d in tensors)
        whole = big_pass[0][t]
        parts = [p[t] for p in acc_passes]
        via = [names[i] for i, g in enumerate(whole) if g is not None and bool(g.ne(0).any())]
        kind = ""
        if differs:
            worst, split = split_kind(whole, parts, axes, chunks, scale, rtol)
            kind = split if via and worst > rtol else "batch"
        results.append(LossTerm(label, rel, kind, via, counts if kind == "count" else []))
    return results
