"""The training core: the study's protocol with exact gradient accumulation (docs/study.md).

Nothing here knows about Hydra or MLflow: `train` tells its hooks (gaexp/hooks.py) what happens
and returns the history.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from gaexp.config import RegimeConfig, TrainConfig
from gaexp.data import Split, micro_batch_indices, to_input
from gaexp.hooks import EvalPoint, Hook


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; asking for CUDA without one is an error (the name is checked by the schema)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch.cuda.is_available() is False; valid here: auto, cpu")
    return torch.device(name)


def accumulate(model: torch.nn.Module, data: Split, batches: Iterator[torch.Tensor],
               num_accum: int) -> torch.Tensor:
    """Forward and backward `num_accum` micro-batches, each loss scaled by 1/k.

    Gradients add up in `.grad`; returns the step's mean unscaled loss as a
    device tensor (no host synchronization).
    """
    total = torch.zeros((), device=data.labels.device)
    for _ in range(num_accum):
        idx = next(batches)
        loss = F.cross_entropy(model(to_input(data.images[idx])), data.labels[idx])
        (loss / num_accum).backward()
        total += loss.detach()
    return total / num_accum


@torch.inference_mode()
def evaluate(model: torch.nn.Module, data: Split, batch_size: int = 256) -> float:
    """Accuracy on the whole split in eval mode, in large batches."""
    was_training = model.training
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=data.labels.device)
    for start in range(0, len(data.labels), batch_size):
        logits = model(to_input(data.images[start:start + batch_size]))
        correct += (logits.argmax(dim=1) == data.labels[start:start + batch_size]).sum()
    model.train(was_training)
    return correct.item() / len(data.labels)


def train(model: torch.nn.Module, train_data: Split, valid_data: Split, cfg: TrainConfig, regime: RegimeConfig,
          seed: int, hooks: Sequence[Hook] = ()) -> list[EvalPoint]:
    """Adam on `cfg.num_iterations` optimizer steps of `regime.num_accum` micro-batches of `regime.batch_size`,
    in the data order of `seed`; evaluates every `cfg.eval_period` steps and at the last step."""
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    batches = micro_batch_indices(len(train_data.labels), regime.batch_size, seed, train_data.labels.device)
    losses = torch.zeros(cfg.num_iterations, device=train_data.labels.device)  # each step's mean unscaled loss
    history: list[EvalPoint] = []
    train_seconds, tic = 0.0, time.perf_counter()
    model.train()
    try:
        for step in range(1, cfg.num_iterations + 1):
            losses[step - 1] = accumulate(model, train_data, batches, regime.num_accum)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for hook in hooks:
                hook.after_step(step, losses)
            if step % cfg.eval_period and step < cfg.num_iterations:
                continue
            train_seconds += time.perf_counter() - tic  # evaluations are left out of the training rate
            for hook in hooks:
                hook.before_eval(model, step)
            train_loss = losses[max(0, step - cfg.loss_window):step].mean().item()
            samples_per_sec = step * regime.batch_size * regime.num_accum / train_seconds
            history.append(EvalPoint(step, train_loss, evaluate(model, valid_data, cfg.eval_batch_size),
                                     samples_per_sec))
            for hook in hooks:
                hook.after_eval(history[-1])
            tic = time.perf_counter()
    finally:
        for hook in hooks:
            hook.close()
    return history
