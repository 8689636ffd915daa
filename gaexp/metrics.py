"""What a run logs, declared once: each metric's name, when it is logged and what it means. Training's
`EvalPoint` (gaexp/hooks.py) carries the histories' values under these names; tracking logs them, the report
reads them, and compare tells results from measurements of the machine by them.
"""

from __future__ import annotations

from dataclasses import dataclass

EVALUATION, RESULT, RESOURCE = "evaluation", "result", "resource"


@dataclass(frozen=True)
class Metric:
    name: str
    per: str  # EVALUATION: a history, one value per evaluation, step = optimizer step; RESULT, RESOURCE: once a run,
    # at its last step (RESOURCE: what it cost)
    meaning: str
    measured: bool = False  # a measurement of the machine (time, memory): it varies run to run and is no result
    only: str = ""  # SCALER: logged by those runs alone


SCALER = "scaler"  # logged by runs with a GradScaler only (precision.scaler)
VALID_ACC = Metric("valid_acc", EVALUATION, "accuracy on the whole validation split, in eval mode")
VALID_LOSS = Metric("valid_loss", EVALUATION, "language model: mean loss per predicted token over the whole "
                                              "validation split, in nats")
VALID_PPL = Metric("valid_ppl", EVALUATION, "language model: perplexity, exp(valid_loss)")
EXPERT_LOAD_MAX = Metric("expert_load_max", EVALUATION, "mixture of experts: the busiest expert's share of the "
                                                        "validation tokens' routings times the experts (1: even), "
                                                        "the mean over the MoE layers")
EXPERT_LOAD_CV = Metric("expert_load_cv", EVALUATION, "mixture of experts: the spread of the experts' shares "
                                                      "(std / mean), the mean over the MoE layers")
TRAIN_LOSS = Metric("train_loss", EVALUATION, "mean unscaled training loss over the last train.loss_window steps")
FINAL_VALID_ACC = Metric("final_valid_acc", RESULT, "valid_acc at the last evaluation")
BEST_VALID_ACC = Metric("best_valid_acc", RESULT, "the highest valid_acc of the run")
FINAL_VALID_LOSS = Metric("final_valid_loss", RESULT, "language model: valid_loss at the last evaluation")
BEST_VALID_LOSS = Metric("best_valid_loss", RESULT, "language model: the lowest valid_loss of the run")
# In the report's order (its memory and speed table).
ACTIVATION_MB = Metric("activation_mb", RESOURCE, "MiB autograd saves for one micro-batch: what the loop holds")
PEAK_RSS_MB = Metric("peak_rss_mb", RESOURCE, "the process's peak resident memory while training, MiB", True)
CUDA_MAX_MEM_MB = Metric("cuda_max_mem_mb", RESOURCE, "peak CUDA memory allocated while training, MiB", True)
SAMPLES_PER_SEC = Metric("samples_per_sec", RESOURCE, "training samples per second, evaluations excluded", True)
TOKENS_PER_SEC = Metric("tokens_per_sec", RESOURCE, "language model: predicted tokens trained per second, evaluations "
                                                    "excluded", True)
WALL_SECONDS = Metric("wall_seconds", RESOURCE, "seconds from the first step to the last evaluation", True)
BATCHED_ACTIVATION_MB = Metric("batched_activation_mb", RESOURCE, "MiB autograd saves for the b*k samples of a step: "
                                                                  "what accumulate=batched holds, and the loop of a "
                                                                  "loss over the step's outputs")
BATCHED_PEAK_RSS_MB = Metric("batched_peak_rss_mb", RESOURCE, "accumulate=batched: peak_rss_mb", True)
BATCHED_CUDA_MAX_MEM_MB = Metric("batched_cuda_max_mem_mb", RESOURCE, "accumulate=batched: cuda_max_mem_mb", True)
LOSS_SCALE = Metric("loss_scale", EVALUATION, "the GradScaler's loss scale at each evaluation", only=SCALER)
SKIPPED_STEPS = Metric("skipped_steps", RESULT, "optimizer steps the GradScaler skipped whole (a gradient not finite)",
                       only=SCALER)
# A search's own runs (gaexp/tuning.py), not a cell's: a study's parent run, stepped by its trial count (and
# `best.<param>` for each numeric param of the best trial), and a trial's run when it has repeats (and `value.<repeat>`).
STUDY, TRIAL = "study", "trial"
BEST_VALUE = Metric("best_value", STUDY, "the best trial's value of the objective")
BEST_TRIAL = Metric("best_trial", STUDY, "the best trial's number")
TRIAL_VALUE = Metric("value", TRIAL, "the trial's value: the mean of its repeats' values")
SEARCH_METRICS = (BEST_VALUE, BEST_TRIAL, TRIAL_VALUE)

METRICS = (VALID_ACC, VALID_LOSS, VALID_PPL, EXPERT_LOAD_MAX, EXPERT_LOAD_CV, TRAIN_LOSS, FINAL_VALID_ACC, BEST_VALID_ACC, FINAL_VALID_LOSS,
           BEST_VALID_LOSS, ACTIVATION_MB, PEAK_RSS_MB, CUDA_MAX_MEM_MB,
           SAMPLES_PER_SEC, TOKENS_PER_SEC, WALL_SECONDS, BATCHED_ACTIVATION_MB, BATCHED_PEAK_RSS_MB, BATCHED_CUDA_MAX_MEM_MB,
           LOSS_SCALE, SKIPPED_STEPS)
HISTORIES = tuple(m.name for m in METRICS if m.per == EVALUATION and not m.only)  # valid_acc, ..., train_loss
SCALER_HISTORIES = tuple(m.name for m in METRICS if m.per == EVALUATION and m.only == SCALER)  # loss_scale
RESOURCES = tuple(m.name for m in METRICS if m.per == RESOURCE)
MEASURED = frozenset(m.name for m in METRICS if m.measured)


@dataclass(frozen=True)
class Headline:
    """A task's one result that ranks its runs (gaexp/task/): the metric, its direction, and how the report shows
    it (a value times `scale`, in `unit`; the equivalence margin is in that unit)."""

    metric: Metric
    higher_is_better: bool
    scale: float  # shown as value * scale
    unit: str  # of a difference and of the margin: "points" (of accuracy %), "nats"
    digits: int  # decimals shown
    symbol: str  # of a shown value: "%", "nats"
    phrase: str  # what the value is, in the tables' titles

    @property
    def diff_unit(self) -> str:
        """A difference's unit in words: percentage points, nats."""
        return "percentage points" if self.unit == "points" else self.unit

    def show(self, value: float, signed: bool = False) -> str:
        """`value` as the tables print it: scaled, to `digits` decimals (signed: with its sign)."""
        return f"{self.scale * value:{'+' if signed else ''}.{self.digits}f}"


ACCURACY = Headline(VALID_ACC, True, 100.0, "points", 2, "%", "valid accuracy")
TOKEN_LOSS = Headline(VALID_LOSS, False, 1.0, "nats", 3, "nats", "validation loss per token")
HEADLINES = (ACCURACY, TOKEN_LOSS)


def headline_named(name: str) -> Headline:
    """The headline whose metric is `name` (valid_acc, valid_loss)."""
    found = next((h for h in HEADLINES if h.metric.name == name), None)
    if found is None:
        raise ValueError(f"headline metric {name!r}; valid: {', '.join(h.metric.name for h in HEADLINES)}")
    return found
