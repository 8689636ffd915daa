"""`AccumulationCheck` for Lightning's `Trainer`: gaexp-check once, on the first real step, before training. Its
micro-batches are the Trainer's own: the first `accumulate_grad_batches` batches of its training DataLoader (its
sampler and collator, the random streams given back), joined. The loss is the module's own `training_step` (its
returned loss, or the dict's "loss"), each micro-batch's scaled by 1/k as Lightning's automatic optimization does;
the check steps a `TrainingStep` around the module (so the report names its modules `pl_module.NAME`), with the
module's `log` and `log_dict` silenced, so nothing of the check reaches the run's metrics.

    from gaexp.check.lightning_callback import AccumulationCheck
    trainer = lightning.Trainer(accumulate_grad_batches=4, callbacks=[AccumulationCheck()])

The verdict is one line on the `gaexp.check` logger (a warning when unsafe); its figures go to every logger of the
Trainer (`log_metrics`: gaexp_check/safe, gradient_rel, loss_rel), and to an MLflowLogger's run the verdict as a
tag and the report as an artifact. `AccumulationCheck(raise_on_unsafe=True)` stops training on an unsafe step
(`AccumulationError`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import MLFlowLogger

from gaexp.check.errors import CheckError, NonFiniteError
from gaexp.check.first_step import VERDICT_TAG, AccumulationError, check_first_step, figures, first_batches, verdict_line
from gaexp.check.loss import MODEL_LOSS
from gaexp.check.report import Report

logger = logging.getLogger("gaexp.check")


class TrainingStep(torch.nn.Module):
    """A LightningModule's training_step as a module's forward: the batch in, {"loss": its loss} out."""

    def __init__(self, pl_module: Any) -> None:
        super().__init__()
        self.pl_module = pl_module

    def forward(self, batch: Any) -> dict[str, Any]:
        outputs = self.pl_module.training_step(batch, 0)
        return {"loss": outputs["loss"] if isinstance(outputs, dict) else outputs}


class AccumulationCheck(Callback):
    """gaexp-check on a Lightning Trainer's first step (see the module's docstring)."""

    def __init__(self, raise_on_unsafe: bool = False) -> None:
        self.raise_on_unsafe = raise_on_unsafe
        self.report: Report | None = None
        self.line = ""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        k = trainer.accumulate_grad_batches
        if not trainer.is_global_zero:
            return
        if k < 2:
            logger.warning("gaexp-check in Lightning's Trainer: accumulate_grad_batches=1, nothing to check")
            return
        loader = trainer.train_dataloader
        if not isinstance(loader, torch.utils.data.DataLoader):
            logger.warning(f"gaexp-check in Lightning's Trainer: the training data is {type(loader).__name__}; the "
                           "check takes one DataLoader")
            return
        silenced = {name: pl_module.__dict__.get(name) for name in ("log", "log_dict")}
        pl_module.log = pl_module.log_dict = lambda *args, **kwargs: None
        try:
            batches = first_batches(loader, k)
            self.report = check_first_step(TrainingStep(pl_module), batches, lambda batch: ((batch,), None),
                                           MODEL_LOSS, device=pl_module.device)
        except (CheckError, NonFiniteError) as e:
            logger.warning(f"gaexp-check in Lightning's Trainer could not check the first step: {e}")
            return
        finally:
            for name, value in silenced.items():
                if value is None:
                    pl_module.__dict__.pop(name, None)
                else:
                    setattr(pl_module, name, value)
        self.line = verdict_line(self.report, "Lightning's Trainer")
        (logger.info if self.report.safe else logger.warning)(self.line)
        for log in trainer.loggers:
            log.log_metrics(figures(self.report), step=trainer.global_step)
            if isinstance(log, MLFlowLogger) and log.run_id is not None:
                log.experiment.set_tag(log.run_id, VERDICT_TAG, "safe" if self.report.safe else "unsafe")
                log.experiment.log_text(log.run_id, self.line + "\n" + str(self.report) + "\n", "gaexp-check.txt")
        if self.raise_on_unsafe and not self.report.safe:
            raise AccumulationError(self.line)
