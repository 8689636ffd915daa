"""The task of a run's `task` config (conf/task/, gaexp/task/)."""

from __future__ import annotations

from gaexp.config import Config, TaskConfig
from gaexp.task import CLASSIFY, CONTRASTIVE, HEADLINES, LM, STEP, Task
from gaexp.task.classify import Classify
from gaexp.task.contrastive import Contrastive
from gaexp.task.lm import LanguageModel

BUILT_FOR = {CLASSIFY: CLASSIFY, LM: LM, CONTRASTIVE: CLASSIFY}  # the `model.task` of a network each task trains


def make(config: TaskConfig) -> Task:
    """The task of a run's `task` config."""
    if config.name == CLASSIFY:
        return Classify()
    if config.name == LM:
        return LanguageModel(config.loss, config.balance, config.balance_coef)
    if config.name == CONTRASTIVE:
        return Contrastive(config.negatives, config.temperature, config.features, config.projection, config.knn_k,
                           config.knn_bank)
    raise ValueError(f"task.name={config.name!r}; valid: {', '.join(HEADLINES)}")


def problem(c: Config) -> str | None:
    """Why a cell's task cannot train on its data or its replicas, in one line, or None: a language model needs
    text (data.kind=text) and classification images; a loss divided by the step's count is refused across
    replicas, where DDP averages the replicas' gradients, each divided by its own count."""
    text = c.data.kind == "text"
    if c.model.task != BUILT_FOR[c.task.name]:
        fits = "task=lm data=fortunes" if c.model.task == LM else "task=classify or contrastive with image data"
        return (f"model={c.model.name} is built for task={c.model.task}, and the run's is task={c.task.name}; valid: "
                f"{fits}, or a model for task={BUILT_FOR[c.task.name]}")
    if c.task.name == LM and not text:
        return (f"task=lm trains on text, and data={c.data.dataset} is images (data.kind={c.data.kind}); valid: "
                "data=fortunes, or data.kind=text with data.path=a folder of text files (docs/data.md)")
    if c.task.name in (CLASSIFY, CONTRASTIVE) and text:
        return (f"data={c.data.dataset} is text (data.kind=text), and task={c.task.name} takes images; valid: "
                f"task=lm model=gpt norm=ln with data={c.data.dataset}")
    if c.task.negatives == "step" and c.regime.replicas > 1:
        return (f"task.negatives=step normalizes each view over the whole step's views, and under regime.replicas="
                f"{c.regime.replicas} each replica holds only its share of them; valid: regime.replicas=1, or "
                "task.negatives=micro")
    if c.task.balance in ("global", "running") and c.regime.replicas > 1:
        return (f"task.balance={c.task.balance} counts the experts' tokens over the step, and under regime.replicas="
                f"{c.regime.replicas} each replica sees its own share of them; valid: regime.replicas=1, or "
                "task.balance=micro")
    if make(c.task).normalization == STEP and c.regime.replicas > 1:
        return (f"task.loss={c.task.loss} divides by the step's token count, and under regime.replicas="
                f"{c.regime.replicas} each replica's gradient would be divided by its own count before DDP averages "
                "them; valid: regime.replicas=1, or task.loss=seq_mean")
    return None
