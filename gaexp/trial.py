"""A run as an Optuna trial: its evaluations reported to the study, pruned when the pruner says so, and the
value it returns (the objective).

The gaexp_optuna sweeper (hydra_plugins/gaexp_optuna_sweeper) gives each trial its study, storage
and number in the `optuna` node; the trial reads and writes the study through that storage (the sweeper's
public trial side, `trials`), which several processes (or cluster jobs on a shared file system) can share.
Light: a cell imports it, and Optuna loads only for a trial.
"""

from __future__ import annotations

import logging

import numpy as np

from hydra_plugins.gaexp_optuna_sweeper.trials import open_trial, report

from gaexp.config import AnalysisConfig, Config, OptunaTrialConfig
from gaexp.hooks import EvalPoint, Hook, Stopped
from gaexp.task import CLASSIFY, headline_of

log = logging.getLogger("gaexp.app")  # the application's log


class ReportToTrial(Hook):
    """After each evaluation: report the headline (`valid_acc` for images) at its step (a trial of several repeats: their mean, once
    each has reported the step); stop training if the trial should be pruned."""

    def __init__(self, trial_config: OptunaTrialConfig) -> None:
        self.trial = open_trial(trial_config.storage, trial_config.study, trial_config.trial)
        self.repeat, self.repeats = trial_config.repeat, trial_config.repeats

    def after_eval(self, point: EvalPoint) -> None:
        report(self.trial, self.repeat, self.repeats, point.step, point.value)
        if self.trial.should_prune():
            raise Stopped(point.step, f"pruned by Optuna ({point.headline} {point.value:.4f})")


def objective(points: list[tuple[int, float]], design: AnalysisConfig) -> float:
    """What a run returns to its trial, from its (step, valid_acc) evaluations: by default the report's
    metric, the mean over the evaluations at step > design.window_start; with objective=final, the last."""
    if design.objective == "final":
        return points[-1][1]
    require_objective(points[-1][0], design)  # the last evaluation is at the last step
    return float(np.mean([acc for step, acc in points if step > design.window_start]))


def require_objective(num_iterations: int, design: AnalysisConfig) -> None:
    """Refuse, before any trial trains, a window objective that no evaluation can fall in (the last step is
    always evaluated)."""
    if design.objective == "window" and num_iterations <= design.window_start:
        raise ValueError(f"analysis.window_start={design.window_start}: a trial of train.num_iterations="
                         f"{num_iterations} has no evaluation after it, so analysis.objective=window has no "
                         "value; lower analysis.window_start or set analysis.objective=final")


def check_direction(direction: str, task: str = CLASSIFY) -> None:
    """A trial returns its task's headline (gaexp/task/): the search maximizes an accuracy and minimizes a language
    model's loss. The Optuna sweeper's default direction, as the official plugin's, is minimize, which for an
    accuracy would find the worst learning rate."""
    shown = headline_of(task)
    wanted = "maximize" if shown.higher_is_better else "minimize"
    if direction != wanted:
        what = "a validation accuracy" if shown.higher_is_better else f"a validation loss ({shown.metric.name})"
        raise ValueError(f"hydra.sweeper.direction={direction}: a gaexp trial of task={task} returns {what} "
                         f"(analysis.objective); valid: hydra.sweeper.direction={wanted}")


def describe_objective(design: AnalysisConfig, task: str = CLASSIFY) -> str:
    """The objective in words, as the study's parent run records it."""
    name = headline_of(task).metric.name
    if design.objective == "final":
        return f"final: {name} at the last evaluation"
    return f"window: mean {name} over the evaluations at step > {design.window_start} (the report's metric)"


def returned_value(c: Config, points: list[tuple[int, float]]) -> float:
    """What a job returns to its sweeper, from its (step, valid_acc) evaluations: a trial, its objective
    (analysis.objective); a grid cell, whose value no sweeper reads, its final accuracy."""
    if c.optuna.study is None:
        return points[-1][1]
    value = objective(points, c.analysis)
    log.info("%s: objective %.4f (%s)", c.run_name, value, describe_objective(c.analysis, c.task.name))
    return value
