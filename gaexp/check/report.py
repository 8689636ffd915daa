"""The report: what differs (gradient tensors, coupling modules, buffers, random modules), the verdict, the causes and
remedies, and how it reads for people (`render`, `precision_lines`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gaexp.check.numerics import PrecisionDrift, WORSE_RATIO
from gaexp.check.trees import module_label


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


GIVEN = "the loss as given"  # the first of a loss's terms (gaexp.check.terms): what the step back-propagates


@dataclass(frozen=True)
class LossTerm:
    """A term of a loss computed in the model's forward (gaexp.check.terms): the loss as given, or a loss-like
    output (aux_loss), its gradient through the model both ways."""
    name: str  # "the loss as given", or the output's name ("aux_loss")
    rel: float  # its accumulated gradient against the big batch's, over the parameters
    kind: str  # "" agrees, "count" (normalised per micro-batch), "samples" (in-batch negatives), "batch" (over the batch),
    # "modules" (differs, and modules couple above: through the model the two are not told apart)
    via: list[str]  # the outputs carrying the samples that its gradient reaches (logits, text_embeds)
    counts: list[int]  # for "count": each micro-batch's count of valid target items


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
    untested: list[str]  # modules not tested: their tensors carry no batch axis, or they could not be called again
    remedies: list[str]
    seconds: float
    causes: list[str] = field(default_factory=list)
    loss_coupling: str = ""  # "" (per-sample), "count" (a per-micro-batch normalisation) or "samples" (pairs)
    mode: str = "train"  # "train": every module in training mode; "keep": the flags as the model came
    eval_modules: list[str] = field(default_factory=list)  # modules the model came with in eval mode
    precision: "PrecisionDrift | None" = None  # the step under a precision against float64 (None: float32 only)
    untested_why: dict[str, str] = field(default_factory=dict)  # of `untested`, those that could not be called again
    terms: list[LossTerm] = field(default_factory=list)  # a loss computed in the model's forward, term by term

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data; `precision` only where one was measured (float32's is as it always was)."""
        data = asdict(self)
        if data["precision"] is None:
            del data["precision"]
        return data

    def __str__(self) -> str:
        return render(self)


def buffer_parts(diffs: list[BufferDiff]) -> str:
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


def listed_names(names: list[str], most: int) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


TERM_KINDS = {"": "per-sample", "count": "normalised per micro-batch", "samples": "couples the samples",
              "batch": "over the whole micro-batch", "modules": "differs with the modules"}


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
            f" ({len(r.eval_modules)} modules in eval mode: {listed_names(r.eval_modules, worst)})" if r.eval_modules
            else " (every module in training mode)"))
    else:
        lines.append("mode: training, every module" + (
            f" (the model came with {len(r.eval_modules)} in eval mode: {listed_names(r.eval_modules, worst)}; "
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
            lines.append(f"  {module_label(module):<40} {kind:<20} {buffer_parts(diffs)}")
    else:  # one line per kind of module
        for kind in dict.fromkeys(k for _, k in by_module):
            diffs = [d for (_, k), ds in by_module.items() if k == kind for d in ds]
            count = sum(k == kind for _, k in by_module)
            lines.append(f"  {count} {kind} modules{'':<{max(0, 30 - len(kind) - len(str(count)))}} "
                         f"{buffer_parts(diffs)}")
    if r.terms:
        lines.append("loss: computed in the model's forward; each term's gradient through the model, both ways:")
        lines += [f"  {t.name:<40} {TERM_KINDS[t.kind]:<28} {t.rel:.2g}" + (f"  (through {listed_names(t.via, 3)})"
                                                                          if t.via else "") for t in r.terms]
    else:
        lines.append(f"loss: {TERM_KINDS[r.loss_coupling] if r.loss_couples else 'per-sample'} (relative difference "
                     f"of its gradient {r.loss_rel:.2g})")
    if r.stochastic:
        lines.append(f"random modules, checked with their own training flag off (deterministic, as in evaluation): "
                     f"{len(r.stochastic)}")
        for how in dict.fromkeys(m.found for m in r.stochastic):
            found = [m for m in r.stochastic if m.found == how]
            kinds_found = ", ".join(f"{sum(m.type == t for m in found)} {t}" for t in dict.fromkeys(m.type for m in found))
            lines.append(f"  {kinds_found} ({how}): {listed_names([module_label(m.module) for m in found], worst)}")
    no_axis = [m for m in r.untested if m not in r.untested_why]
    if no_axis:
        lines.append(f"modules whose tensors carry no batch axis, not tested: {len(no_axis)}: "
                     f"{listed_names(no_axis, worst)}")
    if r.untested_why:
        lines.append(f"modules that could not be called again on a micro-batch, not tested: {len(r.untested_why)}")
        for reason in dict.fromkeys(r.untested_why.values()):
            named = [m for m, why in r.untested_why.items() if why == reason]
            lines.append(f"  {listed_names(named, worst)}: {reason}")
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
