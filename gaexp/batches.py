"""The data in memory: a split as uint8 tensors, the fixed hold-out, the model's input, and the stream of
micro-batch indices (one generator per seed, whatever the regime). The files themselves: gaexp/data.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from gaexp.config import DataConfig
from gaexp.data import torchvision_class

IN_CHANNELS, NUM_CLASSES = 1, 10  # every dataset gaexp reads: grey 28x28 images of 10 classes


@dataclass(frozen=True)
class Split:
    images: torch.Tensor  # uint8 [N, 28, 28]
    labels: torch.Tensor  # int64 [N]


def load_split(data: DataConfig, train: bool, device: torch.device | str = "cpu") -> Split:
    """Read a verified split with the dataset's torchvision class and hold it as one uint8 tensor on `device`."""
    ds = torchvision_class(data)(str(Path(data.root).expanduser().resolve()), train=train, download=False)
    return Split(ds.data.to(device), ds.targets.to(device))


HOLDOUT_SEED = 0  # the one fixed permutation that picks held-out images, whatever the run's seed


def holdout_indices(num: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices trained on, `size` held-out indices): the held-out ones are the first `size` of a fixed
    permutation (generator seed HOLDOUT_SEED, whatever the run's seed); both sorted."""
    order = torch.randperm(num, generator=torch.Generator().manual_seed(HOLDOUT_SEED))
    return order[size:].sort().values, order[:size].sort().values


def holdout_split(data: Split, size: int) -> tuple[Split, Split]:
    """(the images trained on, `size` held-out images never trained on), in their original order."""
    kept, held = (i.to(data.labels.device) for i in holdout_indices(len(data.labels), size))
    return Split(data.images[kept], data.labels[kept]), Split(data.images[held], data.labels[held])


def to_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 28, 28] -> float [B, 1, 28, 28] in [0, 1], exactly as ToTensor, channels_last."""
    return images.unsqueeze(1).float().div_(255).contiguous(memory_format=torch.channels_last)


def micro_batch_indices(num_samples: int, batch_size: int, seed: int,
                        device: torch.device | str = "cpu") -> Iterator[torch.Tensor]:
    """Endless consecutive micro-batches of a stream of per-epoch permutations.

    The stream depends on `seed` alone (its own generator), so for a given seed
    optimizer step t sees the same samples whether they come as 1x16, 4x4 or
    16x1. A micro-batch that crosses an epoch boundary takes the rest of one
    permutation and the start of the next (identical to DataLoader(shuffle=True)
    whenever batch_size divides num_samples, as for every regime of the study).
    """
    generator = torch.Generator().manual_seed(seed)
    stream = torch.empty(0, dtype=torch.long, device=device)
    while True:
        if stream.numel() < batch_size:
            stream = torch.cat([stream, torch.randperm(num_samples, generator=generator).to(device)])
        yield stream[:batch_size]
        stream = stream[batch_size:]
