"""OmegaConf resolvers the configs in conf/ use, and config checks done before any run."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping

from omegaconf import OmegaConf


def usable_cores() -> int:
    """CPUs this process may run on: its affinity mask (what SLURM or taskset grants), not the whole machine."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def register_resolvers() -> None:
    """`${gaexp.abspath:outputs/x}`: an absolute path, so stores and data roots never depend on a job's folder.
    `${gaexp.cores:}`: the CPUs this process may use (conf/launch/ sizes parallel cells with it).
    `${gaexp.mul:a,b}`: a product (the effective batch size b x k)."""
    OmegaConf.register_new_resolver("gaexp.abspath", lambda p: str(Path(p).expanduser().resolve()), replace=True)
    OmegaConf.register_new_resolver("gaexp.cores", usable_cores, replace=True)
    OmegaConf.register_new_resolver("gaexp.mul", lambda *xs: math.prod(xs), replace=True)


def regime_name(batch_size: int, num_accum: int) -> str:
    """bs1a16 for micro-batch 1 with 16 accumulation steps: derived, so overrides cannot mislabel it."""
    return f"bs{batch_size}a{num_accum}"


def norm_options(norm_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The layer options of a norm config: every key but its name."""
    return {k: v for k, v in norm_cfg.items() if k != "name"}


def validate(cfg: Mapping[str, Any]) -> None:
    """Reject bad input before anything runs or is recorded; each message names the value and what is valid."""
    from gaexp.model import CHANNELS
    from gaexp.norms import NORMS, check_groups, check_options

    positive = {"regime.batch_size": cfg["regime"]["batch_size"], "regime.num_accum": cfg["regime"]["num_accum"],
                **{f"train.{k}": cfg["train"][k] for k in ("num_iterations", "eval_period", "loss_window",
                                                           "eval_batch_size")}}
    for key, value in positive.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r}; valid: an integer >= 1")
    lr = cfg["train"]["lr"]
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"train.lr={lr!r}; valid: a finite number > 0")
    name = cfg["norm"]["name"]
    if name not in NORMS:
        raise ValueError(f"norm.name={name!r}; valid: {sorted(NORMS)}")
    check_options(name, norm_options(cfg["norm"]))
    if "groups" in cfg["norm"]:
        check_groups(cfg["norm"]["groups"], CHANNELS)
    if cfg["device"] not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={cfg['device']!r}; valid: auto, cpu, cuda")
