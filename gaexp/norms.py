"""The one registry mapping a `norm` config name to a layer constructor (pycls's norm2d)."""

from __future__ import annotations

from typing import Callable

from torch import nn

# SPEC.md's defaults, unchanged: they are what the original study ran.
NORMS: dict[str, Callable[[int], nn.Module]] = {
    "bn": lambda channels: nn.BatchNorm2d(channels),
    "in": lambda channels: nn.InstanceNorm2d(channels),
    "gn4": lambda channels: nn.GroupNorm(4, channels),
    "gn16": lambda channels: nn.GroupNorm(16, channels),
    "none": lambda channels: nn.Identity(),
}


def norm2d(name: str, channels: int) -> nn.Module:
    """The normalization layer `name` for `channels` channels."""
    try:
        make = NORMS[name]
    except KeyError:
        raise ValueError(f"unknown norm {name!r}; valid: {sorted(NORMS)}") from None
    return make(channels)
