"""The one registry mapping a `norm` config name to a layer constructor (pycls's norm2d)."""

from __future__ import annotations

from typing import Callable

from torch import nn

# SPEC.md's defaults, unchanged: they are what the original study ran.
NORMS: dict[str, Callable[..., nn.Module]] = {
    "bn": lambda channels: nn.BatchNorm2d(channels),
    "in": lambda channels: nn.InstanceNorm2d(channels),
    "gn4": lambda channels: nn.GroupNorm(4, channels),
    "gn16": lambda channels: nn.GroupNorm(16, channels),
    "gn": lambda channels, groups: nn.GroupNorm(groups, channels),  # any group count: norm=gn norm.groups=8
    "none": lambda channels: nn.Identity(),
}
GROUPS = {"gn4": 4, "gn16": 16}  # fixed group counts of the named GroupNorm choices


def norm2d(name: str, channels: int, **options: int) -> nn.Module:
    """The normalization layer `name` for `channels` channels (options such as `groups` for gn)."""
    try:
        make = NORMS[name]
    except KeyError:
        raise ValueError(f"unknown norm {name!r}; valid: {sorted(NORMS)}") from None
    return make(channels, **options)


def check_groups(groups: int, channels: tuple[int, ...]) -> None:
    """GroupNorm needs a group count that divides every layer's channels."""
    bad = [c for c in channels if not isinstance(groups, int) or groups < 1 or c % groups]
    if bad:
        valid = [g for g in range(1, min(channels) + 1) if all(c % g == 0 for c in channels)]
        raise ValueError(f"norm.groups={groups!r} does not divide the channels {list(channels)}; valid: {valid}")
