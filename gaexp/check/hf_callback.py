"""`AccumulationCheck` for transformers' `Trainer` (and so TRL's trainers, which are Trainers): gaexp-check once, on
the first real step, before training. Its micro-batches are the Trainer's own: the first
`gradient_accumulation_steps` batches of its DataLoader (its sampler and collator, the random streams given
back), padded to one length and joined. The loss is taken as the Trainer takes it: the model's own, given the
step's `num_items_in_batch` and not scaled where the Trainer does so (a model whose forward takes loss keywords,
or a `compute_loss_func`), else each micro-batch's scaled by 1/k.

    from gaexp.check.hf_callback import AccumulationCheck
    trainer = Trainer(model, args, train_dataset=..., data_collator=..., callbacks=[AccumulationCheck()])

The verdict is one line on the `gaexp.check` logger (a warning when unsafe), the report is written to
`output_dir/gaexp-check.txt` and `.json`, its figures join the Trainer's log history (`trainer.state.log_history`,
saved in trainer_state.json), and, where the Trainer logs to MLflow (report_to="mlflow": the run its
MLflowCallback opened), the figures as metrics, the verdict as a tag and the report as an artifact.
`AccumulationCheck(raise_on_unsafe=True)` stops training on an unsafe step (`AccumulationError`).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from typing import Any, Callable

from transformers import TrainerCallback

from gaexp.check.errors import CheckError, NonFiniteError
from gaexp.check.first_step import VERDICT_TAG, AccumulationError, check_first_step, figures, first_batches, verdict_line
from gaexp.check.hf import trainer_count
from gaexp.check.loss import MODEL_LOSS
from gaexp.check.report import Report

logger = logging.getLogger("gaexp.check")


def accepts_loss_kwargs(model: Any) -> bool:
    """transformers' Trainer's rule: the model's `accepts_loss_kwargs`, else a forward taking **kwargs."""
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())


class AccumulationCheck(TrainerCallback):
    """gaexp-check on the Trainer's first step (see the module's docstring). `compute_loss_func`: the one given to
    the Trainer, if any (it is then called as the Trainer calls it, with the labels and num_items_in_batch)."""

    def __init__(self, raise_on_unsafe: bool = False,
                 compute_loss_func: Callable[..., Any] | None = None) -> None:
        self.raise_on_unsafe = raise_on_unsafe
        self.compute_loss_func = compute_loss_func
        self.report: Report | None = None
        self.line = ""

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, train_dataloader: Any = None,
                       processing_class: Any = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or model is None or train_dataloader is None:
            return
        k = args.gradient_accumulation_steps
        if k < 2:
            logger.warning("gaexp-check in transformers' Trainer: gradient_accumulation_steps=1, nothing to check")
            return
        pad_id = getattr(processing_class, "pad_token_id", None) or getattr(model.config, "pad_token_id", 0) or 0
        left = getattr(processing_class, "padding_side", "right") == "left"
        custom = self.compute_loss_func is not None
        takes_kwargs = accepts_loss_kwargs(model)

        def split(batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
            if custom:  # the Trainer pops the labels for a compute_loss_func
                inputs = {key: v for key, v in batch.items() if key != "labels"}
                return inputs, batch.get("labels")
            return batch, batch.get("labels")

        loss = self.compute_loss_func if custom else MODEL_LOSS
        try:
            batches = first_batches(train_dataloader, k)
            labelled = isinstance(batches[0], dict) and "labels" in batches[0]  # the Trainer counts only labels
            items = trainer_count(model) if (custom or takes_kwargs) and labelled else False
            was = model.training
            try:
                self.report = check_first_step(model, batches, split, loss, items, pad_id, left,
                                               device=next(model.parameters()).device)
            finally:
                model.train(was)
        except (CheckError, NonFiniteError) as e:
            logger.warning(f"gaexp-check in transformers' Trainer could not check the first step: {e}")
            return
        self.line = verdict_line(self.report, "transformers' Trainer")
        (logger.info if self.report.safe else logger.warning)(self.line)
        self._record(args, state)
        if self.raise_on_unsafe and not self.report.safe:
            raise AccumulationError(self.line)

    def _record(self, args: Any, state: Any) -> None:
        """The report to output_dir, the log history and, where the Trainer logs to MLflow, its run."""
        assert self.report is not None
        text, data = str(self.report), self.report.to_dict()
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "gaexp-check.txt"), "w") as f:
            f.write(self.line + "\n" + text + "\n")
        with open(os.path.join(args.output_dir, "gaexp-check.json"), "w") as f:
            json.dump(data, f, default=str, indent=1)
        state.log_history.append({**figures(self.report), "step": state.global_step})
        if "mlflow" in (args.report_to or []):
            import mlflow

            if mlflow.active_run() is not None:
                mlflow.log_metrics(figures(self.report), step=state.global_step)
                mlflow.set_tag(VERDICT_TAG, "safe" if self.report.safe else "unsafe")
                mlflow.log_text(self.line + "\n" + text + "\n", "gaexp-check.txt")
