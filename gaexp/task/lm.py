"""Language modeling: predict each next token; the loss per predicted token, normalized one of three ways
(`task.loss`), which is the question of docs/study.md's language-model study:

- `token_mean`: each micro-batch's mean over its own tokens (MICRO). Under accumulation a micro-batch with few
  tokens weighs as much as one with many, so a token of a short micro-batch counts more than in the big batch:
  the accumulation bug of transformers' Trainer before `num_items_in_batch` (2024).
- `step_token_mean`: the sum over the tokens divided by the whole step's token count (STEP): the big batch's
  token mean exactly, at any (b, k): the fix.
- `seq_mean`: each sequence's mean over its tokens, averaged over the sequences (MICRO): every micro-batch counts
  b sequences, so accumulation is exact, but a token of a short sequence weighs more than one of a long sequence.

Targets are the next tokens, with `IGNORE` where there is none (padding).
Evaluation: `valid_loss`, the mean loss per predicted token over the whole split (nats), and its perplexity.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gaexp.data.batches import Split
from gaexp.metrics import VALID_PPL
from gaexp.precision import Precision
from gaexp.task import LM, MICRO, STEP, Task

IGNORE = -100  # a target position with no token to predict (F.cross_entropy's ignore_index)
LOSSES = {"token_mean": MICRO, "step_token_mean": STEP, "seq_mean": MICRO}


def token_losses(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each position's loss [B, T] (0 where the target is IGNORE), in float32 or wider (float64 stays)."""
    wide = outputs if outputs.dtype in (torch.float32, torch.float64) else outputs.float()
    return F.cross_entropy(wide.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")


class LanguageModel(Task):
    name = LM

    def __init__(self, loss: str) -> None:
        if loss not in LOSSES:
            raise ValueError(f"task.loss={loss!r}; valid for task=lm: {', '.join(LOSSES)}")
        self.choice, self.normalization = loss, LOSSES[loss]

    def per_sequence(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, predicted tokens) of each sequence, [B] each."""
        return token_losses(outputs, targets).sum(1), (targets != IGNORE).sum(1)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        sums, counts = self.per_sequence(outputs, targets)
        if self.choice == "seq_mean":
            return (sums / counts).mean()
        if self.choice == "step_token_mean":
            return sums.sum()
        return sums.sum() / counts.sum()

    def chunked_loss(self, outputs: torch.Tensor, targets: torch.Tensor, parts: int) -> torch.Tensor:
        if self.choice != "token_mean":  # seq_mean: every micro-batch has b sequences, the mean over all is exact
            return self.loss(outputs, targets)
        sums, counts = (t.view(parts, -1).sum(1) for t in self.per_sequence(outputs, targets))
        return (sums / counts).mean()  # each micro-batch's own token mean, averaged as the loop does

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return (targets != IGNORE).sum()

    def probe(self, shape: tuple[int, ...], num_classes: int, samples: int = 2
              ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """`shape`: a text split's (1, 1, context + 1) (gaexp/data/text.py)."""
        tokens = torch.zeros(samples, shape[-1] - 1, dtype=torch.long)
        return tokens, tokens.clone(), (samples, shape[-1] - 1, num_classes)

    @torch.inference_mode()
    def evaluate(self, model: torch.nn.Module, data: Split, batch_size: int, precision: Precision) -> dict[str, float]:
        """The mean loss per predicted token over the whole split (every token weighs the same, whatever the
        training's normalization), in nats, and its perplexity."""
        was_training = model.training
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=data.labels.device)
        tokens = torch.zeros((), dtype=torch.long, device=data.labels.device)
        for start in range(0, len(data), batch_size):
            inputs, targets = data.window(slice(start, start + batch_size))
            with precision.forward():
                outputs = model(inputs)
            sums, counts = self.per_sequence(outputs, targets)
            total += sums.double().sum()
            tokens += counts.sum()
        model.train(was_training)
        loss = total.item() / tokens.item()
        return {self.headline.metric.name: loss, VALID_PPL.name: math.exp(min(loss, 700.0))}
