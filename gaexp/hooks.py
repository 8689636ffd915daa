"""What the training loop tells the rest of gaexp, and the hooks that listen.

`train` calls every hook at three moments: after each optimizer step, before each evaluation
(after the divergence check, before the model is evaluated: where a norm such as PreciseBN
refreshes its statistics) and after it, with the new `EvalPoint`. `close` runs however training
ends. The hooks here are generic (divergence, progress); norms.py and tracking.py add their own.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Mapping
from typing import TYPE_CHECKING

from tqdm import tqdm

if TYPE_CHECKING:  # torch is imported where training runs: the readers of a store (report, status) never need it
    import torch

log = logging.getLogger("gaexp.train")


@dataclass(frozen=True)
class EvalPoint:
    step: int  # optimizer step
    train_loss: float  # mean unscaled loss over the last `loss_window` optimizer steps
    valid: Mapping[str, float]  # the task's metrics on the whole validation split, eval mode, its headline first
    samples_per_sec: float  # training samples per second so far (evaluations excluded)
    loss_scale: float | None = None  # under a GradScaler (precision.scaler): the scale now
    skipped_steps: int | None = None  # and the optimizer steps it skipped so far
    speed: Mapping[str, float] = field(default_factory=dict)  # the task's own (a language model's tokens_per_sec)

    @property
    def value(self) -> float:
        """The headline's value (image classification: valid_acc)."""
        return next(iter(self.valid.values()))

    @property
    def headline(self) -> str:
        return next(iter(self.valid))


class Hook:
    """Does nothing at every moment; subclasses override the ones they need."""

    def after_step(self, step: int, losses: torch.Tensor) -> None:
        """`losses[:step]`: every optimizer step's mean unscaled loss so far, on the device."""

    def before_eval(self, model: torch.nn.Module, step: int) -> None:
        """Just before `model` is evaluated at optimizer step `step`."""

    def after_eval(self, point: EvalPoint) -> None:
        """Just after an evaluation."""

    def close(self) -> None:
        """Training ended, finished or not."""


class DivergedError(FloatingPointError):
    """The training loss became non-finite."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"non-finite training loss ({loss}) at optimizer step {step}")
        self.step = step


class Stopped(Exception):
    """Training stopped on purpose before its last step (an Optuna pruner said so): not a failure."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(f"stopped at optimizer step {step}: {reason}")
        self.step, self.reason = step, reason


class SweepGone(Stopped):
    """The process that launched this cell is gone: the cell stops, its run KILLED, and nobody waits for it."""


class StopWhenSweepGone(Hook):
    """Raise SweepGone at the first step after `watch` (gaexp/liveness.py `SweepWatch`) saw the sweep's process
    go: a killed sweep's workers train nothing more for nobody."""

    def __init__(self, watch) -> None:
        self.watch = watch

    def after_step(self, step: int, losses: torch.Tensor) -> None:
        if self.watch.gone:
            raise SweepGone(step, self.watch.reason)


class DivergenceCheck(Hook):
    """Raise DivergedError naming the first non-finite step loss, checked every `every` steps (each
    one on the CPU, where it costs nothing; a GPU would synchronize) and before every evaluation."""

    def __init__(self, every: int = 1) -> None:
        import torch

        self.every, self.checked, self.losses = every, 0, torch.empty(0)

    def after_step(self, step: int, losses: torch.Tensor) -> None:
        self.losses = losses
        if step % self.every == 0:
            self.check(step)

    def before_eval(self, model: torch.nn.Module, step: int) -> None:
        self.check(step)

    def check(self, step: int) -> None:
        import torch

        bad = (~torch.isfinite(self.losses[self.checked:step])).nonzero()
        if len(bad):
            first = self.checked + int(bad[0])
            raise DivergedError(first + 1, self.losses[first].item())
        self.checked = step


class Progress(Hook):
    """A tqdm bar over the optimizer steps when `show` (default: stderr is a terminal); otherwise
    one log line per evaluation. `compiling_eval`: evaluation runs through torch.compile, so the first
    one compiles its graph (tens of seconds with a cold cache): the bar says so until it ends."""

    COMPILING = "compiling evaluation..."

    def __init__(self, total: int, desc: str = "", show: bool | None = None, compiling_eval: bool = False) -> None:
        self.total, self.desc, self.compiling = total, desc, compiling_eval
        self.show = sys.stderr.isatty() if show is None else show
        self.bar = tqdm(total=total, desc=desc, disable=not self.show, dynamic_ncols=True, leave=False)

    def after_step(self, step: int, losses: torch.Tensor) -> None:
        self.bar.update()

    def before_eval(self, model: torch.nn.Module, step: int) -> None:
        if self.compiling:
            self.bar.set_postfix_str(self.COMPILING)
            if not self.show:
                log.info("%s step %d/%d: %s", self.desc, step, self.total, self.COMPILING)

    def after_eval(self, point: EvalPoint) -> None:
        self.compiling = False  # compiled: the postfix below replaces the word
        unit, rate = next(((name.removesuffix("_per_sec"), value) for name, value in point.speed.items()),
                          ("samples", point.samples_per_sec))  # a language model's tokens/s
        self.bar.set_postfix(loss=f"{point.train_loss:.4f}", **{point.headline: f"{point.value:.4f}"},
                             **{f"{unit}_s": f"{rate:.0f}"})
        if not self.show:
            log.info("%s step %d/%d train_loss %.4f %s %.4f %s/s %.0f", self.desc, point.step,
                     self.total, point.train_loss, point.headline, point.value, unit, rate)

    def close(self) -> None:
        self.bar.close()
