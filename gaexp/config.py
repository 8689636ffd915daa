"""OmegaConf resolvers the configs in conf/ use, and config checks done before any run."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf


def register_resolvers() -> None:
    """`${gaexp.abspath:outputs/x}`: an absolute path, so stores and data roots never depend on a job's folder."""
    OmegaConf.register_new_resolver("gaexp.abspath", lambda p: str(Path(p).expanduser().resolve()), replace=True)


def regime_name(batch_size: int, num_accum: int) -> str:
    """bs1a16 for micro-batch 1 with 16 accumulation steps: derived, so overrides cannot mislabel it."""
    return f"bs{batch_size}a{num_accum}"
