"""A gaexp contrastive model checked as the cached engine trains it (`task=contrastive task.negatives=step`,
gaexp/cached.py): the model wrapped so that its forward returns, for each micro-batch of the step, what GradCache
back-propagates through it, so the check measures what `accumulate=cached` computes against the big batch.

Which rows of the step a call gets says which micro-batch it is (`balance.rows_at`). For micro-batch j of k (rows
a:a+m of the step's n), the step's outputs are computed first without a graph, one micro-batch of m rows at a time
(the cached engine's first pass, on a hook-free copy of the model, so the check records only the forward it asked
for and its BatchNorm buffers stay as they were), then the task's loss over all of them and its gradient with
respect to them. The call's loss is its outputs dotted with its slice of that gradient, times k (the check scales
each micro-batch by 1/k), valued at the step's loss: its gradient is the cached engine's for that micro-batch. The
whole step, or rows not of the step, are one batch of one: the task's loss over them.
"""

from __future__ import annotations

import torch
from torch import nn

from gaexp.check.balance import rows_at, unhooked


class CachedStep(nn.Module):
    """`model` under `task` (a Contrastive with negatives=step) on the step of `views` (two rows per image):
    `forward(views)` returns {"loss", "embeddings"}."""

    def __init__(self, model: nn.Module, task, views: torch.Tensor) -> None:
        super().__init__()
        self.model, self.task = model, task
        self.register_buffer("step_views", views, persistent=False)

    def forward(self, views: torch.Tensor) -> dict[str, torch.Tensor]:
        n, m = len(self.step_views), len(views)
        a = rows_at(self.step_views, views)
        k = 1 if a is None or m == n or n % m else n // m  # this call's micro-batch of k
        outputs = self.model(views)
        if k == 1:
            return {"loss": self.task.loss(outputs, None), "embeddings": outputs}
        twin = unhooked(self.model)
        with torch.no_grad():
            cache = torch.cat([twin(self.step_views[i:i + m]) for i in range(0, n, m)])
        with torch.enable_grad():  # also where the check calls the model again without a graph
            cache.requires_grad_()
            loss = self.task.loss(cache, None)
            (gradient,) = torch.autograd.grad(loss, cache)
        share = (outputs * gradient[a:a + m]).sum()
        return {"loss": (share - share.detach()) * k + loss.detach(), "embeddings": outputs}
