"""Image classification, gaexp's first task: cross-entropy over the classes, a mean over each micro-batch's images
(every micro-batch of a regime counts b of them, so naive accumulation is exact here), evaluated by accuracy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gaexp.data.batches import Split
from gaexp.precision import Precision
from gaexp.task import CLASSIFY, MICRO, Task


class Classify(Task):
    name, normalization = CLASSIFY, MICRO

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), targets)

    def probe(self, shape: tuple[int, ...], num_classes: int, samples: int = 2
              ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        images = torch.zeros(samples, *shape).contiguous(memory_format=torch.channels_last)
        return images, torch.zeros(samples, dtype=torch.long), (samples, num_classes)

    @torch.inference_mode()
    def evaluate(self, model: torch.nn.Module, data: Split, batch_size: int, precision: Precision) -> dict[str, float]:
        """Accuracy on the whole split in eval mode, in large batches, under the training's autocast."""
        was_training = model.training
        model.eval()
        correct = torch.zeros((), dtype=torch.long, device=data.labels.device)
        for start in range(0, len(data.labels), batch_size):
            with precision.forward():
                logits = model(data.inputs(slice(start, start + batch_size)))
            correct += (logits.argmax(dim=1) == data.labels[start:start + batch_size]).sum()
        model.train(was_training)
        return {self.headline.metric.name: correct.item() / len(data.labels)}
