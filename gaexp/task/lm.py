"""Language modeling: predict each next token; the loss per predicted token, normalized one of three ways
(`task.loss`), which is the question of docs/study.md's language-model study:

- `token_mean`: each micro-batch's mean over its own tokens (MICRO). Under accumulation a micro-batch with few
  tokens weighs as much as one with many, so a token of a short micro-batch counts more than in the big batch:
  the accumulation bug of transformers' Trainer before `num_items_in_batch` (2024).
- `step_token_mean`: the sum over the tokens divided by the whole step's token count (STEP): the big batch's
  token mean exactly, at any (b, k): the fix.
- `seq_mean`: each sequence's mean over its tokens, averaged over the sequences (MICRO): every micro-batch counts
  b sequences, so accumulation is exact, but a token of a short sequence weighs more than one of a long sequence.

A mixture of experts (model=gpt_moe) adds a load-balancing loss, coef * N * sum_i f_i * P_i per MoE layer
(averaged over the layers): f_i the fraction of the tokens' routings that chose expert i (no gradient), P_i the
mean router probability of expert i, both over the predicted tokens. `task.balance` says over which tokens f_i is
counted under accumulation:
- `micro`: each micro-batch's own f and P, their losses averaged (1/k): what per-micro-batch balancing computes;
- `global`: the step's f (counted by a pass over the step's routing before the first backward, in the loop; the
  batched engine's one pass has it) times each micro-batch's share of the step's P: the big batch's loss exactly,
  since P is linear in the tokens and f carries no gradient;
- `running`: f counted over the step's micro-batches so far (Megatron's running average), with each micro-batch's P.

Targets are the next tokens, with `IGNORE` where there is none (padding).
Evaluation: `valid_loss`, the mean loss per predicted token over the whole split (nats), and its perplexity; with
experts, their load: the busiest expert's share times the experts, and the shares' spread.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gaexp.data.batches import Split
from gaexp.metrics import EXPERT_LOAD_CV, EXPERT_LOAD_MAX, TOKENS_PER_SEC, VALID_PPL
from gaexp.precision import Precision
from gaexp.task import LM, MICRO, STEP, Task

IGNORE = -100  # a target position with no token to predict (F.cross_entropy's ignore_index)
LOSSES = {"token_mean": MICRO, "step_token_mean": STEP, "seq_mean": MICRO}
BALANCES = ("none", "micro", "global", "running")


def token_losses(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each position's loss [B, T] (0 where the target is IGNORE), in float32 or wider (float64 stays)."""
    wide = outputs if outputs.dtype in (torch.float32, torch.float64) else outputs.float()
    return F.cross_entropy(wide.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")


class LanguageModel(Task):
    name = LM
    speed = TOKENS_PER_SEC  # the predicted tokens of the steps' sequences (TextSplit.items)

    def __init__(self, loss: str, balance: str = "none", coef: float = 0.01) -> None:
        if loss not in LOSSES:
            raise ValueError(f"task.loss={loss!r}; valid for task=lm: {', '.join(LOSSES)}")
        if balance not in BALANCES:
            raise ValueError(f"task.balance={balance!r}; valid: {', '.join(BALANCES)}")
        self.choice, self.normalization = loss, LOSSES[loss]
        self.balance, self.coef = balance, coef
        self.step_pass = balance == "global"  # the step's routing counted before its first backward
        self.reads_model = balance != "none"  # its balancing term reads the router's forward
        self.routers: list[torch.nn.Module] = []
        self.step_fractions: list[torch.Tensor] = []  # global: each layer's f over the step (`begin_step`)
        self.step_tokens = torch.zeros(())
        self.before: tuple = (0, 0)  # running: the step's routing counts (`counts`) and tokens so far

    def attach(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if hasattr(m, "routing") and hasattr(m, "top_k")]
        if self.balance != "none" and not self.routers:
            raise ValueError(f"task.balance={self.balance} balances a mixture of experts' router, and the model has "
                             "none; valid: model=gpt_moe, or task.balance=none")

    def routing(self, targets: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each MoE layer's last forward over these targets' sequences: (summed router probabilities, summed 0/1
        choices), [B, experts] each, over the predicted tokens only."""
        mask = (targets != IGNORE).unsqueeze(-1)
        found = []
        for layer in self.routers:
            probs, chosen = layer.routing
            found.append(((probs * mask).sum(1), (chosen * mask).sum(1) / layer.top_k))
        return found

    def begin_step(self, forward: torch.nn.Module, batches) -> None:
        counts, tokens = 0, 0  # one forward of the step's micro-batches, without a graph
        for inputs, targets in batches:
            forward(inputs)
            found, n = self.counts(targets)
            counts, tokens = counts + found, tokens + n
        self.step_fractions, self.step_tokens = list(counts / tokens), tokens

    def counts(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last forward's routings over these targets' predicted tokens: each MoE layer's count per expert
        [layers, experts], and the tokens."""
        return torch.stack([c.sum(0) for _, c in self.routing(targets)]), self.count(targets)

    def balance_term(self, targets: torch.Tensor, before: tuple = (0, 0), parts: int = 1) -> tuple[torch.Tensor, tuple]:
        """The balancing term of the micro-batch whose targets these are, from its last forward, normalized as the
        loop's micro-batch of `parts`: `micro`, its own fractions; `global`, the step's (`begin_step`); `running`,
        the counts (`counts`) of the step's micro-batches `before` it plus its own; and those counts with its own."""
        found, n = [(p.sum(0), c.sum(0)) for p, c in self.routing(targets)], self.count(targets)
        chosen_so_far, tokens_so_far = before[0] + torch.stack([c for _, c in found]), before[1] + n
        terms = []
        for layer, (probs, chosen) in enumerate(found):  # [experts] each, summed over the micro-batch's tokens
            experts = probs.shape[-1]
            if self.balance == "global":  # the step's fractions times this micro-batch's share of the step's P
                terms.append(experts * (self.step_fractions[layer] * probs).sum() / self.step_tokens)
                continue
            fractions = chosen / n if self.balance == "micro" else chosen_so_far[layer] / tokens_so_far
            terms.append(experts * (fractions * probs / n).sum() / parts)
        return self.coef * torch.stack(terms).mean(), (chosen_so_far, tokens_so_far)

    def extra(self, targets: torch.Tensor, part: int, parts: int) -> torch.Tensor | None:
        if self.balance == "none":
            return None
        if part == 0:
            self.before = (0, 0)
        term, self.before = self.balance_term(targets, self.before, parts)
        return term

    def chunked_extra(self, targets: torch.Tensor, parts: int) -> torch.Tensor | None:
        if self.balance == "none":
            return None
        found = self.routing(targets)
        tokens = (targets != IGNORE).sum(1).view(parts, -1).sum(1)  # each micro-batch's
        layers = []
        for i, (p, c) in enumerate(found):
            probs, chosen = (t.view(parts, -1, t.shape[-1]).sum(1) for t in (p, c))  # [parts, experts]
            experts = probs.shape[-1]
            if self.balance == "micro":
                term = experts * (chosen / tokens[:, None] * probs / tokens[:, None]).sum() / parts
            elif self.balance == "global":
                term = experts * (chosen.sum(0) / tokens.sum() * probs.sum(0)).sum() / tokens.sum()
            else:  # running: the fractions over micro-batches 1..j, with micro-batch j's probabilities
                seen = chosen.cumsum(0) / tokens.cumsum(0)[:, None]
                term = experts * (seen * probs / tokens[:, None]).sum() / parts
            layers.append(term)
        return self.coef * torch.stack(layers).mean()

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

    @property
    def split_free(self) -> bool:
        """token_mean alone divides by each micro-batch's own count; every other loss is the step's whatever its
        split (seq_mean: every micro-batch holds b sequences)."""
        return not self.reads_model and self.choice != "token_mean"

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
        shares = None  # with experts: each layer's routings per expert over the split
        for start in range(0, len(data), batch_size):
            inputs, targets = data.window(slice(start, start + batch_size))
            with precision.forward():
                outputs = model(inputs)
            sums, counts = self.per_sequence(outputs, targets)
            total += sums.double().sum()
            tokens += counts.sum()
            if self.routers:
                load = [c.sum(0) for _, c in self.routing(targets)]
                shares = load if shares is None else [a + b for a, b in zip(shares, load)]
        model.train(was_training)
        loss = total.item() / tokens.item()
        found = {self.headline.metric.name: loss, VALID_PPL.name: math.exp(min(loss, 700.0))}
        if self.routers:  # each layer's experts' shares of the routings: the busiest times the experts, the spread
            fractions = [s / s.sum() for s in shares]
            found[EXPERT_LOAD_MAX.name] = sum(len(f) * f.max().item() for f in fractions) / len(fractions)
            found[EXPERT_LOAD_CV.name] = sum((f.std(correction=0) / f.mean()).item() for f in fractions) / len(fractions)
        return found
