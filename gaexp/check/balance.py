"""A gaexp mixture of experts checked with its balancing loss (`task.balance`, gaexp/task/lm.py): the model wrapped
so that its forward returns what the task adds up for one micro-batch of the step, the loss (`loss`) and the
balancing term apart (`aux_loss`), as a transformers MoE returns its own. The check then measures each term through
the model, one batch against k micro-batches (gaexp/check/terms.py), and names the balancing term's coupling.

Which rows of the step a call gets says which micro-batch it is: the balancing term of rows a:a+m of the step's n
is the loop's micro-batch a/m of n/m (`micro`: its own fractions; `global`: the step's, counted by a pass over the
step's micro-batches of m, as the loop's `begin_step`; `running`: those of the micro-batches before it and its own).
The whole step, or rows not of the step, are one batch of one. The step's pass runs on a copy of the model without
the check's hooks, so the check records only the forward it asked for.
"""

from __future__ import annotations

import torch
from torch import nn

from gaexp.check.recorder import detached_copy


def rows_at(step: torch.Tensor, rows: torch.Tensor) -> int | None:
    """Where `rows` sit in `step` as consecutive rows (the first such place), or None."""
    m = len(rows)
    if m > len(step) or rows.shape[1:] != step.shape[1:]:
        return None
    for a in range(len(step) - m + 1):
        if torch.equal(step[a:a + m], rows):
            return a
    return None


def unhooked(model: nn.Module) -> nn.Module:
    """A copy of `model` whose modules run no hooks: what a pass outside the check's records runs on."""
    twin = detached_copy(model)  # its routers hold the last forward's routing, inside an autograd graph
    for module in twin.modules():
        for hooks in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks):
            hooks.clear()
    return twin


class Balanced(nn.Module):
    """`model` under `task` (a LanguageModel with a balance), on the step of `tokens` and `targets`:
    `forward(tokens, labels)` returns {"loss", "logits", "aux_loss"}: what the loop adds up for that micro-batch of
    k, times k (the check scales each micro-batch's loss by 1/k), the loss over the step's count where the task
    normalizes by it (`by_step`: step_token_mean)."""

    def __init__(self, model: nn.Module, task, tokens: torch.Tensor, targets: torch.Tensor, by_step: bool) -> None:
        super().__init__()
        self.model, self.task, self.by_step = model, task, by_step  # by_step: the task's loss over the step's count
        self.register_buffer("step_tokens", tokens, persistent=False)
        self.register_buffer("step_targets", targets, persistent=False)
        task.attach(model)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        task, n, m = self.task, len(self.step_tokens), len(tokens)
        a = rows_at(self.step_tokens, tokens)
        k = 1 if a is None or m == n or n % m else n // m  # this call's micro-batch of k
        before = (0, 0)
        if k > 1 and task.balance in ("global", "running"):
            twin = unhooked(self.model)
            task.attach(twin)
            parts = [(self.step_tokens[i:i + m], self.step_targets[i:i + m]) for i in range(0, n, m)]
            with torch.no_grad():
                if task.balance == "global":
                    task.begin_step(twin, parts)
                for x, y in parts[:a // m] if task.balance == "running" else ():
                    twin(x)
                    chosen, count = task.counts(y)
                    before = (before[0] + chosen, before[1] + count)
        task.attach(self.model)
        logits = self.model(tokens)
        if task.balance == "global" and k == 1:  # one batch of one: its own fractions, as the big batch counts them
            chosen, count = task.counts(labels)
            task.step_fractions, task.step_tokens = list(chosen / count), count
        share, _ = task.balance_term(labels, before, k)  # the loop's, for micro-batch a/m of k
        loss = task.loss(logits, labels)
        if self.by_step:  # the loop's sum over the step's count, with its share of the balance
            loss = (loss / task.count(self.step_targets if k > 1 else labels) + share) * k
        else:  # the loop's micro-batch mean over k, with its share of the balance
            loss = loss + share * k
        return {"loss": loss, "logits": logits, "aux_loss": share * k}  # the check scales each by 1/k
