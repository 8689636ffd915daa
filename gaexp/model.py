"""SimpleModel of the study (docs/study.md): four 3x3 convolutions with a pluggable normalization."""

from __future__ import annotations

import torch
from torch import nn

from gaexp.norms import norm2d

CHANNELS = (32, 64, 128, 256)
NUM_CLASSES = 10


def check_groups(groups: int, channels: tuple[int, ...] = CHANNELS) -> None:
    """GroupNorm needs a group count that divides every layer's channels."""
    if any(c % groups for c in channels):
        valid = [g for g in range(1, min(channels) + 1) if all(c % g == 0 for c in channels)]
        raise ValueError(f"norm.groups={groups!r} does not divide the channels {list(channels)}; valid: {valid}")


class SimpleModel(nn.Module):
    def __init__(self, norm: str, **norm_options: int) -> None:
        super().__init__()
        if "groups" in norm_options:
            check_groups(norm_options["groups"])
        layers: list[nn.Module] = []
        c_in = 1
        for i, c_out in enumerate(CHANNELS):
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1), norm2d(norm, c_out, **norm_options), nn.ReLU(inplace=True)]
            if i < len(CHANNELS) - 1:
                layers.append(nn.MaxPool2d(2))  # 28 -> 14 -> 7 -> 3
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(c_in, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean(dim=(2, 3)))
