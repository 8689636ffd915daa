"""The task of a run's `task` config (conf/task/, gaexp/task/)."""

from __future__ import annotations

from gaexp.config import TaskConfig
from gaexp.task import CLASSIFY, HEADLINES, LM, Task
from gaexp.task.classify import Classify
from gaexp.task.lm import LanguageModel


def make(config: TaskConfig) -> Task:
    """The task of a run's `task` config."""
    if config.name == CLASSIFY:
        return Classify()
    if config.name == LM:
        return LanguageModel(config.loss)
    raise ValueError(f"task.name={config.name!r}; valid: {', '.join(HEADLINES)}")
