"""Why a step is not safe to accumulate, in words (`causes_of`), and what to change (`remedies_for`): gaexp's
`norm=` choices for a gaexp model, or the change to one's own model, each with what gaexp's study measured
(gaexp/check/evidence.py); a loss's normalisation; in-batch negatives.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from gaexp.check.evidence import BN_ACCUMULATED, BN_REMEDIES, STUDY_GROUPS
from gaexp.check.loss import STEP_TARGETS
from gaexp.check.report import BufferDiff, Coupling, listed_names
from gaexp.norms import NORMS


def causes_of(modules: list[Coupling], buffers: list[BufferDiff], loss_coupling: str, unexplained: bool) -> list[str]:
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


def remedies_for(modules: list[Coupling], buffers: list[BufferDiff], owners: dict[str, nn.Module],
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
    if loss_coupling == "count":
        remedies.append("sum the loss and divide by the step's total count over all its micro-batches, with no 1/k"
                        + ("" if step else f" (a loss taking a third argument or a {STEP_TARGETS}= keyword is "
                                           "given the step's targets)"))
    elif loss_coupling == "samples":
        remedies.append("samples compared with each other (in-batch negatives): no accumulation is exact; compute "
                        "the step's embeddings first, then back-propagate through them in micro-batches "
                        "(gradient caching)")
    return remedies
