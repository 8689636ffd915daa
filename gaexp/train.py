"""The training core: SPEC.md's protocol with exact gradient accumulation.

Nothing here knows about Hydra or MLflow: `train` reports each evaluation
through a callback and returns the history.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from tqdm import tqdm

from gaexp.data import Split, micro_batch_indices, to_input
from gaexp.norms import PreciseBatchNorm2d, precise_statistics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalPoint:
    step: int  # optimizer step
    train_loss: float  # mean unscaled loss over the last `loss_window` optimizer steps
    valid_acc: float  # accuracy on the whole validation split, eval mode
    samples_per_sec: float  # training samples per second so far (evaluations excluded)


class DivergedError(FloatingPointError):
    """The training loss became non-finite."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"non-finite training loss ({loss}) at optimizer step {step}")
        self.step = step


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; asking for CUDA without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch.cuda.is_available() is False; valid here: auto, cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}; valid: auto, cpu, cuda")
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


def population_batches(data: Split, batch_size: int, samples: int, seed: int) -> Iterator[torch.Tensor]:
    """`samples` training images drawn without replacement (own generator), in batches of `batch_size`."""
    order = torch.randperm(len(data.labels), generator=torch.Generator().manual_seed(seed))[:samples]
    order = order.to(data.labels.device)
    for start in range(0, len(order), batch_size):
        yield to_input(data.images[order[start:start + batch_size]])


def train(model: torch.nn.Module, train_data: Split, valid_data: Split, *, batch_size: int,
          num_accum: int, num_iterations: int, eval_period: int, lr: float, seed: int,
          loss_window: int = 100, eval_batch_size: int = 256,
          on_eval: Callable[[EvalPoint], None] = lambda point: None,
          progress: bool | None = None, desc: str = "", check_every: int = 1) -> list[EvalPoint]:
    """Adam on `num_iterations` optimizer steps of `num_accum` micro-batches of `batch_size`.

    Evaluates every `eval_period` steps and at the last step. `progress=None`
    shows a bar only when stderr is a terminal; otherwise one log line per
    evaluation. Every `check_every` steps (each one on the CPU, where the
    check costs nothing) the step losses are checked: the first non-finite
    one raises DivergedError naming its step. PreciseBN layers get their
    population statistics recomputed before each evaluation.
    """
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    batches = micro_batch_indices(len(train_data.labels), batch_size, seed, train_data.labels.device)
    step_losses = torch.zeros(num_iterations, device=train_data.labels.device)
    show_bar = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=num_iterations, desc=desc, disable=not show_bar, dynamic_ncols=True, leave=False)
    precise = [m for m in model.modules() if isinstance(m, PreciseBatchNorm2d)]
    history: list[EvalPoint] = []
    train_seconds, tic, checked = 0.0, time.perf_counter(), 0
    model.train()
    for step in range(1, num_iterations + 1):
        step_losses[step - 1] = accumulate(model, train_data, batches, num_accum)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bar.update()
        evaluating = step % eval_period == 0 or step == num_iterations
        if evaluating or step % check_every == 0:
            bad = (~torch.isfinite(step_losses[checked:step])).nonzero()
            if len(bad):
                bar.close()
                raise DivergedError(checked + int(bad[0]) + 1, step_losses[checked + int(bad[0])].item())
            checked = step
        if evaluating:
            train_loss = step_losses[max(0, step - loss_window):step].mean().item()
            train_seconds += time.perf_counter() - tic
            samples_per_sec = step * batch_size * num_accum / train_seconds
            if precise:
                precise_statistics(model, population_batches(train_data, precise[0].stats_batch_size,
                                                             precise[0].stats_samples, seed=seed * 100_003 + step))
            point = EvalPoint(step, train_loss, evaluate(model, valid_data, eval_batch_size), samples_per_sec)
            history.append(point)
            on_eval(point)
            bar.set_postfix(loss=f"{train_loss:.4f}", valid_acc=f"{point.valid_acc:.4f}",
                            samples_s=f"{samples_per_sec:.0f}")
            if not show_bar:
                log.info("%s step %d/%d train_loss %.4f valid_acc %.4f samples/s %.0f", desc, step,
                         num_iterations, train_loss, point.valid_acc, samples_per_sec)
            tic = time.perf_counter()
    bar.close()
    return history
