"""The norms: each declared once (pycls's norm2d, timm's create_norm_layer), read by everything that needs it.

A `Norm` says how to build the layer for a channel count, the schema of its options (gaexp/config/schema.py, which
conf/norm/<name>.yaml extends), whether it couples the samples of a batch in training (the batched engine then
computes it one micro-batch at a time, gaexp/batched.py), the training hooks it needs (PreciseBN refreshes its
statistics before every evaluation), whether its training pays for torch.compile on the CPU, and what it
changes when it stands in for BatchNorm (gaexp-check's remedies). `NORMS` lists them in the order of the
report's rows and panels. The first five are the study's layers with PyTorch's defaults (docs/study.md); the
rest are BatchNorm remedies and batch-free alternatives that slot into the same grid.

A norm of one's own is one Python file: a layer class (or any callable taking the channel count, then its
`params` by keyword), with `couples_samples = True` when its output for a sample depends on the other samples
of its batch, and optionally `training_hooks(model, data, seed)`; it runs as
`norm=custom norm.name=NAME norm.target=module:Class` (docs/development.md).

This module imports no torch: the layers are imported when a norm is built, so the readers of a store (the
report orders its rows from here) stay light.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from gaexp import targets
from gaexp.config import (BatchRenormConfig, CustomNormConfig, GroupNormConfig, KMomentumBNConfig, MicroEvalBNConfig,
                          NormConfig, PreciseBNConfig)

COUPLES = "couples_samples"  # the attribute a layer (class or instance) declares its coupling with


def _lazy(path: str, *args: Any, **fixed: Any) -> Callable[..., Any]:
    """(channels, **options) -> `module:attr`(*args, channels, **fixed, **options), imported at the first build."""
    module, _, attr = path.partition(":")

    def build(channels: int, **options: Any) -> Any:
        return getattr(importlib.import_module(module), attr)(*args, channels, **fixed, **options)
    build.__qualname__ = attr
    return build


@dataclass(frozen=True)
class Norm:
    """What gaexp knows of a norm, in one place."""

    build: Callable[..., Any]  # (channels, **options) -> the layer (an nn.Module)
    couples: Optional[bool]  # its training output for a sample depends on the batch's other samples (batch
    # statistics, running buffers): accumulate=batched computes it per micro-batch; None: the layer says
    # (`couples_samples`) or, for torch's own layers, its type does (gaexp/batched.py)
    options: type = NormConfig  # the schema of its options (gaexp/config/schema.py)
    hooks: Optional[Callable[..., list]] = None  # (model, train data, seed) -> the training hooks it needs
    compiled_training: bool = False  # compile=auto compiles its training too (its eager kernel is slow)
    remedy: str = ""  # as a BatchNorm remedy: what it changes (gaexp-check)
    in_your_model: str = ""  # the same, said as what to change in a model of one's own

    def hooks_for(self, model: Any, data: Any, seed: int) -> list:
        """The training hooks this norm's layers in `model` need (none for most)."""
        return self.hooks(model, data, seed) if self.hooks is not None else []


def _precise_hooks(model: Any, data: Any, seed: int) -> list:
    from gaexp.layers import precise_hooks
    return precise_hooks(model, data, seed)


# The study's defaults, unchanged: they are what the original study ran. In the report's order.
NORMS: dict[str, Norm] = {
    "bn": Norm(_lazy("torch.nn:BatchNorm2d"), couples=True),
    # InstanceNorm's eager kernel leaves channels_last and is 1.5x slower than no norm at micro-batch 16;
    # compiled, it runs as fast as no norm. Compiled training loses for the others (docs/results.md).
    "in": Norm(_lazy("torch.nn:InstanceNorm2d"), couples=False, compiled_training=True,
               remedy="InstanceNorm instead", in_your_model="nn.InstanceNorm2d(C, affine=True) in place of each "
                                                            "BatchNorm2d"),
    "gn4": Norm(_lazy("torch.nn:GroupNorm", 4), couples=False),
    "gn16": Norm(_lazy("torch.nn:GroupNorm", 16), couples=False, remedy="GroupNorm with 16 groups instead",
                 in_your_model="nn.GroupNorm(16, C) in place of each BatchNorm2d"),
    "none": Norm(_lazy("torch.nn:Identity"), couples=False),  # Identity ignores the channel count
    # BatchNorm remedies and batch-free alternatives (docs/study.md, "Normalizations")
    "ln": Norm(_lazy("torch.nn:GroupNorm", 1), couples=False),
    "in_affine": Norm(_lazy("torch.nn:InstanceNorm2d", affine=True), couples=False, compiled_training=True),
    "bn_precise": Norm(_lazy("gaexp.layers:PreciseBatchNorm2d"), couples=True, options=PreciseBNConfig,
                       hooks=_precise_hooks, remedy="exact population statistics before each evaluation",
                       in_your_model="precise BatchNorm: recompute the population statistics over many batches "
                                     "before each evaluation"),
    "bn_microeval": Norm(_lazy("gaexp.layers:MicroBatchEvalBatchNorm2d"), couples=True, options=MicroEvalBNConfig,
                         remedy="evaluate with each micro-batch's own statistics, as it trained",
                         in_your_model="evaluate in micro-batches of b, each normalised by its own statistics as "
                                       "in training (BatchNorm with track_running_stats=False)"),
    "brn": Norm(_lazy("gaexp.layers:BatchRenorm2d"), couples=True, options=BatchRenormConfig,
                remedy="Batch Renorm: training corrected towards the running statistics",
                in_your_model="Batch Renorm in place of BatchNorm (training corrected towards the running "
                              "statistics)"),
    # data parallelism's synchronized BatchNorm: statistics over every replica's micro-batch (regime.replicas);
    # one replica: BatchNorm, the same calls. No remedy for accumulation, whose micro-batches are one at a time.
    "bn_sync": Norm(_lazy("gaexp.layers:CrossReplicaBatchNorm2d"), couples=True),
    "bn_kmom": Norm(_lazy("gaexp.layers:kmom_batchnorm"), couples=True, options=KMomentumBNConfig),
    "gn": Norm(lambda channels, groups: _lazy("torch.nn:GroupNorm", groups)(channels), couples=False,
               options=GroupNormConfig),  # any group count: norm=gn norm.groups=8
}
ORDER = tuple(NORMS)  # the report's rows and panels (analysis.norm_order, when a study does not set it)


def compiled_training(name: str) -> bool:
    """Whether compile=auto compiles the training of norm `name` (False for a norm of one's own)."""
    return name in NORMS and NORMS[name].compiled_training


def declared(norm: NormConfig) -> Norm:
    """The declaration of a cell's norm: the registry's, or that of a norm of one's own (`norm.target`: its
    layer's `couples_samples` and `training_hooks`, if it has them)."""
    if isinstance(norm, CustomNormConfig):
        make = targets.load(norm.target, "norm.target", positional=1)
        return Norm(make, couples=getattr(make, COUPLES, None), options=CustomNormConfig,
                    hooks=getattr(make, "training_hooks", None))
    return registered(norm.name)


def registered(name: str) -> Norm:
    """The registry's norm `name`, or one line naming the valid ones."""
    try:
        return NORMS[name]
    except KeyError:
        raise ValueError(f"norm.name={name!r}; valid: {sorted(NORMS)}") from None


def built(norm: Norm, channels: int, **options: Any) -> Any:
    """The norm's layer for `channels` channels, carrying what the norm declares of its coupling (the batched
    engine reads it there)."""
    module = norm.build(channels, **options)
    if norm.couples is not None:
        setattr(module, COUPLES, norm.couples)
    return module


def require_channels(options: dict, channels: Iterable[int], model: str) -> None:
    """The norm's options against the channels of the model's norm layers: GroupNorm's groups must divide
    every one of them."""
    channels = sorted(set(channels))
    groups = options.get("groups")
    if groups is not None and channels and any(c % groups for c in channels):
        valid = [g for g in range(1, min(channels) + 1) if all(c % g == 0 for c in channels)]
        raise ValueError(f"norm.groups={groups!r} does not divide the channels {channels} of model={model}; "
                         f"valid: {valid}")


def require_layer(norm: NormConfig, channels: Iterable[int]) -> None:
    """A norm file's callable (`norm.target`) must build a module for each channel count the model asks for."""
    if not isinstance(norm, CustomNormConfig):
        return
    import torch
    make = norm_layer(norm)
    for c in sorted(set(channels)):
        try:
            with torch.random.fork_rng(devices=[]):
                module = make(c)
        except Exception as e:  # noqa: BLE001 - whatever the user's layer raises, in one line
            raise targets.TargetError(f"norm.target={norm.target!r}: building it for {c} channels with "
                                      f"{norm.params} fails: {type(e).__name__}: {e}") from None
        if not isinstance(module, torch.nn.Module):
            raise targets.TargetError(f"norm.target={norm.target!r}: returned {type(module).__name__} for {c} "
                                      "channels; expected a torch.nn.Module")


def norm_layer(norm: str | NormConfig, **options: Any) -> Callable[[int], Any]:
    """What a model builder takes as `norm_layer` (timm's create_norm_layer, pycls's norm2d): channels -> the norm's
    layer. `norm`: a registered name with its `options` (norm_layer("gn", groups=4)), or a cell's norm config (its
    own options; a norm file's callable with its `params`)."""
    if isinstance(norm, str):
        return functools.partial(built, registered(norm), **options)
    return functools.partial(built, declared(norm), **norm.options(), **options)
