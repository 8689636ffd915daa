"""Contrastive learning (SimCLR's InfoNCE): two augmented views of each image, each view's projection pulled
toward its twin's and pushed from the other views of its batch, its in-batch negatives. Whose views those are is
the question of docs/study.md's contrastive study, the task's `negatives`:

- `micro`: each micro-batch's own 2b views (MICRO: its InfoNCE mean, scaled by 1/k): what naive accumulation
  computes, each view with 2b - 2 negatives instead of the big batch's 2bk - 2;
- `step`: the whole step's 2bk views (OUTPUTS: one InfoNCE over the step's outputs), as the big batch has them.
  The loop computes it holding every micro-batch's graph until the step's one loss (the step's memory); the
  batched engine in one pass; the cached engine (gaexp/cached.py, GradCache) at one micro-batch's memory.

The network (any of the study's, with any norm) is the encoder: its output of `features` is the representation.
A small head (Linear, ReLU, Linear to `projection`) maps it to where the loss is computed, as in SimCLR.
Evaluation: a k-NN classifier on the frozen representation, cosine similarity, the majority of the `knn_k` nearest
of `knn_bank` labeled training images (never augmented), its accuracy on the whole validation split: valid_acc.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from gaexp.data.batches import VIEWS, Split
from gaexp.precision import Precision
from gaexp.task import CONTRASTIVE, MICRO, OUTPUTS, Task

NEGATIVES = {"micro": MICRO, "step": OUTPUTS}


class Embedder(nn.Module):
    """The encoder (`network`, its output the representation) and SimCLR's projection head."""

    def __init__(self, network: nn.Module, features: int, projection: int) -> None:
        super().__init__()
        self.network = network
        self.head = nn.Sequential(nn.Linear(features, features), nn.ReLU(), nn.Linear(features, projection))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.network(x))

    def represent(self, x: torch.Tensor) -> torch.Tensor:
        """The representation the k-NN classifier reads."""
        return self.network(x)


def info_nce(outputs: torch.Tensor, temperature: float) -> torch.Tensor:
    """InfoNCE (SimCLR's NT-Xent) over these views, two per image in turn (rows 2i and 2i + 1 are one image's): the
    mean over the views of the cross-entropy of the twin among the other views, by cosine similarity / temperature
    (float32, or float64 where the outputs are)."""
    z = F.normalize(outputs if outputs.dtype in (torch.float32, torch.float64) else outputs.float(), dim=1)
    n = len(z)
    eye = torch.eye(n, dtype=torch.bool, device=z.device)
    similarity = (z @ z.T / temperature).masked_fill(eye, float("-inf"))  # a view is not its own negative
    twins = torch.arange(n, device=z.device) ^ 1
    return F.cross_entropy(similarity, twins)


class Contrastive(Task):
    name = CONTRASTIVE
    views = 2

    def __init__(self, negatives: str, temperature: float = 0.2, features: int = 128, projection: int = 64,
                 knn_k: int = 20, knn_bank: int = 5000) -> None:
        if negatives not in NEGATIVES:
            raise ValueError(f"task.negatives={negatives!r}; valid for task=contrastive: {', '.join(NEGATIVES)}")
        self.negatives, self.normalization = negatives, NEGATIVES[negatives]
        self.temperature, self.features, self.projection = temperature, features, projection
        self.knn_k, self.knn_bank = knn_k, knn_bank
        self.bank: Split | None = None

    def width(self, num_classes: int) -> int:
        return self.features

    def model(self, network: nn.Module) -> nn.Module:
        return Embedder(network, self.features, self.projection)

    def training_split(self, split: Split) -> Split:
        return replace(split, augment=VIEWS)

    def prepare(self, train_data: Split) -> None:
        self.bank = replace(train_data.take(slice(0, self.knn_bank)), augment="none")

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return info_nce(outputs, self.temperature)

    def chunked_loss(self, outputs: torch.Tensor, targets: torch.Tensor, parts: int) -> torch.Tensor:
        """micro: the mean of each micro-batch's own InfoNCE, each over its 2b views."""
        return torch.stack([self.loss(chunk, None) for chunk in outputs.chunk(parts)]).mean()

    def probe(self, shape: tuple[int, ...], num_classes: int, samples: int = 2
              ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        images = torch.zeros(self.views * samples, *shape).contiguous(memory_format=torch.channels_last)
        return images, torch.zeros(samples, dtype=torch.long), (self.views * samples, self.projection)

    @torch.inference_mode()
    def evaluate(self, model: nn.Module, data: Split, batch_size: int, precision: Precision) -> dict[str, float]:
        """The k-NN classifier's accuracy on the whole split: each image's `knn_k` nearest bank images by the cosine
        of their representations, in eval mode under the training's autocast; the most frequent label among them
        (a tie: the lowest label)."""
        if self.bank is None:
            raise RuntimeError("Contrastive.evaluate before prepare(train_data): the k-NN classifier has no bank")
        embedder = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the module itself
        was_training = embedder.training
        embedder.eval()

        def represent(split: Split) -> torch.Tensor:
            found = []
            for start in range(0, len(split), batch_size):
                with precision.forward():
                    found.append(embedder.represent(split.inputs(slice(start, start + batch_size))).float())
            return F.normalize(torch.cat(found), dim=1)

        bank, queries = represent(self.bank), represent(data)
        classes = int(self.bank.labels.max()) + 1
        k = min(self.knn_k, len(bank))
        correct = torch.zeros((), dtype=torch.long, device=data.labels.device)
        for start in range(0, len(queries), batch_size):
            nearest = (queries[start:start + batch_size] @ bank.T).topk(k, dim=1).indices
            votes = F.one_hot(self.bank.labels[nearest], classes).sum(1)
            correct += (votes.argmax(dim=1) == data.labels[start:start + batch_size]).sum()
        embedder.train(was_training)
        return {self.headline.metric.name: correct.item() / len(data.labels)}
