"""Why a step is not safe to accumulate, in words (`causes_of`), and what to change (`remedies_for`): gaexp's
`norm=` choices for a gaexp model, or the change to one's own model, each with what gaexp's study measured
(gaexp/check/evidence.py); a loss's normalisation; in-batch negatives; an auxiliary loss over the batch (a
router's load balancing). A loss computed in the model's forward is said term by term, and for a transformers model
in transformers' terms (`num_items_in_batch`, `output_router_logits`, the Trainer).
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from gaexp.check.evidence import (BN_ACCUMULATED, BN_REMEDIES, CONTRASTIVE_NEGATIVES, LM_BALANCE, LM_TOKEN_MEAN,
                                  STUDY_GROUPS)
from gaexp.check.loss import NUM_ITEMS, STEP_TARGETS, LossContract
from gaexp.check.report import GIVEN, BufferDiff, Coupling, LossTerm, listed_names
from gaexp.norms import NORMS


def term_cause(t: LossTerm, contract: LossContract, terms: Sequence[LossTerm]) -> str:
    """Why one term of a loss computed in the model's forward is not the big batch's."""
    through = f" through {listed_names(t.via, 3)}" if t.via else ""
    others = [o.name for o in terms if o.kind == "batch" and o.name != GIVEN]
    name = contract.name if t.name == GIVEN and contract.in_model else t.name
    if t.name == GIVEN and t.kind == "batch" and others:
        return (f"{name} agrees{through} and differs by its term{'s' * (len(others) > 1)} "
                f"{', '.join(others)}, below")
    if t.kind == "count":
        counts = f" ({', '.join(map(str, t.counts))} valid items in the {len(t.counts)} micro-batches)" if t.counts \
            else ""
        if t.name == GIVEN and contract.items == "forward":
            return (f"the model's forward takes {NUM_ITEMS} and ignores it: {name} is still a mean over each "
                    f"micro-batch's own count of valid items{counts}, and, taken whole with no 1/k as the Trainer "
                    "takes it, each micro-batch counts in full")
        return (f"{name} is a mean over each micro-batch's own count of valid items{counts}: each micro-batch's "
                f"gradient{through} is the whole batch's times a factor of its own, so short sequences and "
                "sparsely labelled micro-batches weigh more than in the big batch")
    if t.kind == "samples":
        return (f"{name} couples the samples of a batch{through}: a sample's gradient depends on the other samples "
                "of its micro-batch (in-batch negatives: a contrastive loss normalises each sample's similarities "
                "over the others, b - 1 of them instead of b*k - 1)")
    scaled = ("; and with the loss taken whole, not scaled by 1/k, it counts in full once per micro-batch, k times"
              if contract.step and t.name != GIVEN else "")
    return (f"{name} is computed over the whole micro-batch and reaches the weights through no per-sample output: "
            "an auxiliary loss from the batch's statistics (a router's load balancing, from each micro-batch's "
            f"token fractions per expert, balances each micro-batch instead of the step){scaled}")


def causes_of(modules: list[Coupling], buffers: list[BufferDiff], loss_coupling: str, unexplained: bool,
              terms: Sequence[LossTerm] = (), contract: LossContract | None = None) -> list[str]:
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
    if terms and contract is not None:
        causes += [term_cause(t, contract, terms) for t in terms if t.kind not in ("", "modules")]
    elif loss_coupling == "count":
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


def gaexp_norm_choice(choice: str, channels: Sequence[int]) -> str:
    """A BatchNorm remedy as gaexp's norm= choice: for GroupNorm, a group count that divides every BatchNorm's
    channels (gaexp refuses norm.groups that does not)."""
    if choice == f"gn{STUDY_GROUPS}" and groups_for(channels) != STUDY_GROUPS:
        g = groups_for(channels)
        odd = [c for c in channels if c % STUDY_GROUPS]
        return (f"norm=gn norm.groups={g}: GroupNorm with {g} groups instead (the study measured {STUDY_GROUPS}, "
                f"which does not divide the model's {listed_names([str(c) for c in odd], 5)} channels)")
    return f"norm={choice}: {NORMS[choice].remedy}"


def in_your_model_text(choice: str, channels: Sequence[int]) -> str:
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
    return text + " (" + "; ".join(f"nn.GroupNorm({g}, C) for C = {listed_names(cs, 8)}"
                                   for g, cs in sorted(by_groups.items(), reverse=True)) + \
        f": {STUDY_GROUPS} groups must divide C)"


COUNT_REMEDY_HF = (f"give the model the step's count of valid tokens, {NUM_ITEMS}, summed over all k micro-batches, and "
                   "take its loss whole, with no 1/k: transformers' Trainer does this itself when the model's forward "
                   f"takes **kwargs (model_accepts_loss_kwargs) or with a compute_loss_func(outputs, labels, "
                   f"{NUM_ITEMS}); in a loop of your own, model(**batch, {NUM_ITEMS}=N) (gaexp-check "
                   "--num-items-in-batch checks it)")
SAMPLES_REMEDY = ("in-batch negatives: no accumulation is exact; cache the gradient (GradCache): the step's embeddings "
                  "first without a graph, the loss and its gradient with respect to them over the whole step, then "
                  "each micro-batch again, back-propagating its slice (sentence-transformers' "
                  "CachedMultipleNegativesRankingLoss, CachedGISTEmbedLoss); or use a per-sample loss")
BATCH_REMEDY = ("balance over the step, not the micro-batch: count the tokens each expert received over the step's k "
                "micro-batches, then one balancing loss (global-batch balancing: Qwen's arXiv 2501.11873, "
                "Megatron-LM's global auxiliary loss); or use a per-sample loss")
BATCH_REMEDY_HF = (BATCH_REMEDY + "; in transformers, output_router_logits=True returns each micro-batch's "
                   "router_logits to count from, and router_aux_loss_coef=0 leaves the balancing out")


def token_mean_measured() -> str:
    """gaexp's choice for a language model's loss, with what its study measured of the token mean."""
    choice, regime, loss, against, verdict = LM_TOKEN_MEAN
    return (f"  task.loss=step_token_mean: the step's token count (gaexp's language-model study: task.loss={choice} at "
            f"{regime}, loss per token {loss:.3f} nats, {against} nats against the true batch of 16, {verdict} at "
            "±0.02; step_token_mean: the true batch's, exactly)")


def balance_measured() -> str:
    """gaexp's choice for an MoE's balancing loss, with what its study measured of the others."""
    measured = "; ".join(f"task.balance={choice} at {regime}, loss per token {loss:.3f} nats, {against} nats against "
                         f"the true batch of 16, {verdict} at ±0.02" for choice, regime, loss, against, verdict
                         in LM_BALANCE)
    return ("  task.balance=global: the step's fractions per expert, counted by a pass over the step's routing before "
            f"its first backward (gaexp's MoE study: {measured}; global: the true batch's, exactly)")


def negatives_measured() -> str:
    """gaexp's choice for a contrastive loss's negatives, with what its contrastive study measured of each."""
    measured = "; ".join(f"{row} at {regime}, k-NN accuracy {accuracy:.2f}%, {against} points against the true "
                         f"batch of 64, {verdict} at ±1" for row, regime, accuracy, against, verdict
                         in CONTRASTIVE_NEGATIVES)
    return ("  task.negatives=step accumulate=cached: the step's negatives, exact at one micro-batch's activations "
            f"(GradCache's two passes; gaexp's contrastive study, the CNN on MNIST: {measured})")


def term_remedies(terms: Sequence[LossTerm], hf: bool, contract: LossContract, gaexp: bool = False) -> list[str]:
    """One remedy per kind of coupling among a loss's terms, in transformers' terms for a transformers model, with
    gaexp's config choice for a gaexp model (`gaexp`)."""
    kinds = dict.fromkeys(t.kind for t in terms if t.kind not in ("", "modules"))
    ignored = contract.items == "forward" and any(t.name == GIVEN and t.kind == "count" for t in terms)
    remedies = []
    if "count" in kinds and ignored:
        remedies.append(f"normalise by the step yourself: give the Trainer a compute_loss_func(outputs, labels, "
                        f"{NUM_ITEMS}) that sums the token losses and divides by {NUM_ITEMS}, or set "
                        "model.accepts_loss_kwargs = False so that the Trainer at least divides by k (a mean per "
                        "micro-batch, still inexact with padding)")
    elif "count" in kinds:
        remedies.append(COUNT_REMEDY_HF if hf else "sum the loss and divide by the step's total count over all its "
                        f"micro-batches, with no 1/k ({NUM_ITEMS} given to a loss that takes it, as the Trainer does)")
        remedies += [token_mean_measured()] if gaexp else []
    if "samples" in kinds:
        remedies.append(SAMPLES_REMEDY)
        remedies += [negatives_measured()] if gaexp else []
    if "batch" in kinds:
        remedies.append(BATCH_REMEDY_HF if hf else BATCH_REMEDY)
        remedies += [balance_measured()] if gaexp else []
    return remedies


def remedies_for(modules: list[Coupling], buffers: list[BufferDiff], owners: dict[str, nn.Module],
              loss_coupling: str, contract: LossContract, norm_choices: bool, terms: Sequence[LossTerm] = (),
              hf: bool = False) -> list[str]:
    step = contract.step
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
            remedies += [f"  {gaexp_norm_choice(choice, channels)}: {accuracy:.2f}%, {against}, {verdict}"
                         for choice, accuracy, against, verdict in BN_REMEDIES]
        else:
            remedies.append(f"for BatchNorm, what to change in the model, with what gaexp's study measured for each "
                            f"({measured}):")
            remedies += [f"  {in_your_model_text(choice, channels)}: {accuracy:.2f}%, {against}, {verdict}"
                         for choice, accuracy, against, verdict in BN_REMEDIES]
    if any(not isinstance(owners[m], nn.modules.batchnorm._BatchNorm) for m in named):
        remedies.append("other coupling modules: compute their statistics per sample (GroupNorm, LayerNorm), or "
                        "once over the whole step before its micro-batches")
    if terms:
        remedies += term_remedies(terms, hf, contract, norm_choices)
    elif loss_coupling == "count":
        remedies.append("sum the loss and divide by the step's total count over all its micro-batches, with no 1/k"
                        + ("" if step else f" (a loss taking a third argument or a {STEP_TARGETS}= keyword is "
                                           "given the step's targets)"))
        if norm_choices:  # a gaexp model: its config's choice, and what the study measured of the bug
            remedies.append(token_mean_measured())
    elif loss_coupling == "samples":
        remedies.append("samples compared with each other (in-batch negatives): no accumulation is exact; compute "
                        "the step's embeddings first, then back-propagate through them in micro-batches "
                        "(gradient caching)")
        if norm_choices:  # a gaexp model: its config's choice, and what the study measured of each
            remedies.append(negatives_measured())
    return remedies
