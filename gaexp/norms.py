"""The one registry mapping a `norm` config name to a layer constructor (pycls's norm2d).

The first five are the study's layers with PyTorch's defaults (docs/study.md). The rest are
BatchNorm remedies and batch-free alternatives that slot into the same grid; each differs from
BatchNorm only in where its statistics come from. A norm that must act during training registers
a hook here (`hooks_for`): PreciseBN refreshes its statistics before every evaluation. The options
of each layer, their defaults and ranges, are declared in gaexp/config.py.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from gaexp import targets
from gaexp.config import CustomNormConfig, NormConfig
from gaexp.batches import Split
from gaexp.hooks import Hook


def kmom(momentum: float, num_accum: int) -> float:
    """Per-micro-batch momentum m' with (1 - m')^k = 1 - m: k micro-batch updates decay the running
    statistics as much as one update per optimizer step does."""
    return 1.0 - (1.0 - momentum) ** (1.0 / num_accum)


class PreciseBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm whose running statistics are replaced, before each evaluation, by the exact population
    statistics of training images passed in batches of `stats_batch_size` (see `precise_statistics`)."""

    def __init__(self, channels: int, stats_batch_size: int, stats_samples: int) -> None:
        super().__init__(channels)
        self.stats_batch_size, self.stats_samples = stats_batch_size, stats_samples


class MicroBatchEvalBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm that also evaluates with batch statistics: each consecutive group of `micro_batch`
    images is normalized by its own mean and variance, as in training (EvalNorm-style). The running
    buffers are never read or written at evaluation."""

    def __init__(self, channels: int, micro_batch: int) -> None:
        super().__init__(channels)
        self.micro_batch = micro_batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return super().forward(x)
        whole = x.shape[0] - x.shape[0] % self.micro_batch
        groups = [g for g in (x[:whole], x[whole:]) if len(g)]  # the whole micro-batches, then any remainder
        out = []
        for g in groups:  # all micro-batches in one call: (n/b, b, C, H, W), statistics over (b, H, W)
            v = g.reshape(-1, min(self.micro_batch, len(g)), *g.shape[1:])
            mean = v.mean(dim=(1, 3, 4), keepdim=True)
            var = v.var(dim=(1, 3, 4), unbiased=False, keepdim=True)
            y = ((v - mean) * torch.rsqrt(var + self.eps)).reshape(g.shape)
            out.append(y * self.weight[:, None, None] + self.bias[:, None, None])
        return out[0] if len(out) == 1 else torch.cat(out)


class BatchRenorm2d(nn.BatchNorm2d):
    """Batch Renormalization (Ioffe 2017): batch statistics corrected towards the running ones,
    x_hat = (x - mu_B) / sigma_B * r + d with r = sigma_B / sigma, d = (mu_B - mu) / sigma, both
    clipped (r in [1/r_max, r_max], |d| <= d_max) and without gradient. For the first `warmup_steps`
    optimizer steps r_max = 1 and d_max = 0 (plain BatchNorm), then they grow linearly to their
    maxima over `ramp_steps`. Optimizer steps are counted as training micro-batches / num_accum."""

    def __init__(self, channels: int, num_accum: int, r_max: float, d_max: float, warmup_steps: int,
                 ramp_steps: int) -> None:
        super().__init__(channels)
        self.num_accum, self.r_max, self.d_max = num_accum, r_max, d_max
        self.warmup_steps, self.ramp_steps = warmup_steps, ramp_steps

    def limits(self) -> tuple[float, float]:
        """(r_max, d_max) at the current optimizer step."""
        step = int(self.num_batches_tracked) // self.num_accum
        if self.ramp_steps == 0:
            t = float(step >= self.warmup_steps)
        else:
            t = min(1.0, max(0.0, (step - self.warmup_steps) / self.ramp_steps))
        return 1.0 + t * (self.r_max - 1.0), t * self.d_max

    def corrections(self, mean: torch.Tensor, std: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(r, d) of a batch with statistics `mean` and `std`, from the running statistics as they are now."""
        r_max, d_max = self.limits()
        running_std = torch.sqrt(self.running_var + self.eps)
        r = (std.detach() / running_std).clamp(1.0 / r_max, r_max)
        d = ((mean.detach() - self.running_mean) / running_std).clamp(-d_max, d_max)
        return r, d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        mean = x.mean(dim=(0, 2, 3))
        var = x.var(dim=(0, 2, 3), unbiased=False)
        std = torch.sqrt(var + self.eps)
        r, d = self.corrections(mean, std)
        x_hat = (x - mean[:, None, None]) / std[:, None, None] * r[:, None, None] + d[:, None, None]
        with torch.no_grad():  # the running statistics BatchNorm2d keeps (unbiased variance)
            n = x.numel() / x.shape[1]
            self.running_mean.lerp_(mean.detach(), self.momentum)
            self.running_var.lerp_(var.detach() * n / max(1.0, n - 1), self.momentum)
            self.num_batches_tracked.add_(1)
        return x_hat * self.weight[:, None, None] + self.bias[:, None, None]


@torch.no_grad()
def precise_statistics(model: nn.Module, batches: Iterable[torch.Tensor]) -> None:
    """PreciseBN: set every PreciseBatchNorm2d's running mean and variance to the exact mean and
    (biased) variance of all the values its input took while `batches` went through the model in
    training mode, i.e. normalized by their own batch statistics upstream. Sums are kept in float64;
    the variance is E[x^2] - E[x]^2 over everything seen, not a mean of per-batch variances."""
    layers = [m for m in model.modules() if isinstance(m, PreciseBatchNorm2d)]
    sums = {m: [0.0, 0.0, 0] for m in layers}

    def record(layer: nn.Module, inputs: tuple[torch.Tensor]) -> None:
        x = inputs[0].double()
        total = sums[layer]
        total[0] = total[0] + x.sum(dim=(0, 2, 3))
        total[1] = total[1] + (x * x).sum(dim=(0, 2, 3))
        total[2] += x.numel() // x.shape[1]

    hooks = [m.register_forward_pre_hook(record) for m in layers]
    counters = {m: m.num_batches_tracked.clone() for m in layers}  # the statistics themselves are replaced below
    was_training = model.training
    model.train()
    try:
        for x in batches:
            model(x)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    for m in layers:
        s1, s2, n = sums[m]
        if not n:
            raise ValueError("precise_statistics saw no batch")
        mean = s1 / n
        m.running_mean.copy_(mean)
        m.running_var.copy_((s2 / n - mean * mean).clamp_min(0))
        m.num_batches_tracked.copy_(counters[m])


def population_batches(data: Split, batch_size: int, samples: int, seed: int) -> Iterator[torch.Tensor]:
    """`samples` training images drawn without replacement (own generator), in batches of `batch_size`."""
    order = torch.randperm(len(data.labels), generator=torch.Generator().manual_seed(seed))[:samples]
    order = order.to(data.labels.device)
    for start in range(0, len(order), batch_size):
        yield data.inputs(order[start:start + batch_size])


class PreciseStatistics(Hook):
    """Before every evaluation, PreciseBN's population statistics from fresh training images (a new
    draw per evaluation, seeded by the run's seed and the step)."""

    def __init__(self, layer: PreciseBatchNorm2d, data: Split, seed: int) -> None:
        self.batch_size, self.samples = layer.stats_batch_size, layer.stats_samples
        self.data, self.seed = data, seed

    def before_eval(self, model: nn.Module, step: int) -> None:
        batches = population_batches(self.data, self.batch_size, self.samples, seed=self.seed * 100_003 + step)
        precise_statistics(model, batches)


def hooks_for(model: nn.Module, data: Split, seed: int) -> list[Hook]:
    """The training hooks the model's norm layers need (none for most)."""
    precise = [m for m in model.modules() if isinstance(m, PreciseBatchNorm2d)]
    return [PreciseStatistics(precise[0], data, seed)] if precise else []


# The study's defaults, unchanged: they are what the original study ran.
NORMS: dict[str, Callable[..., nn.Module]] = {
    "bn": lambda channels: nn.BatchNorm2d(channels),
    "in": lambda channels: nn.InstanceNorm2d(channels),
    "gn4": lambda channels: nn.GroupNorm(4, channels),
    "gn16": lambda channels: nn.GroupNorm(16, channels),
    "gn": lambda channels, groups: nn.GroupNorm(groups, channels),  # any group count: norm=gn norm.groups=8
    "none": lambda channels: nn.Identity(),
    # BatchNorm remedies and batch-free alternatives (docs/study.md, "Normalizations")
    "ln": lambda channels: nn.GroupNorm(1, channels),
    "in_affine": lambda channels: nn.InstanceNorm2d(channels, affine=True),
    "bn_precise": PreciseBatchNorm2d,
    "bn_microeval": MicroBatchEvalBatchNorm2d,
    "brn": BatchRenorm2d,
    "bn_kmom": lambda channels, num_accum, momentum: nn.BatchNorm2d(channels, momentum=kmom(momentum, num_accum)),
}


# Norms whose training pays for torch.compile on the CPU (`compile=auto`): InstanceNorm's eager kernel leaves
# channels_last and is 1.5x slower than no norm at micro-batch 16; compiled, it runs as fast as no norm.
# Compiled training loses for the others (docs/results.md, "Levers measured").
COMPILED_TRAINING = frozenset({"in", "in_affine"})


def check_channels(options: dict, channels: Iterable[int], model: str) -> None:
    """The norm's options against the channels of the model's norm layers: GroupNorm's groups must divide
    every one of them."""
    channels = sorted(set(channels))
    groups = options.get("groups")
    if groups is not None and channels and any(c % groups for c in channels):
        valid = [g for g in range(1, min(channels) + 1) if all(c % g == 0 for c in channels)]
        raise ValueError(f"norm.groups={groups!r} does not divide the channels {channels} of model={model}; "
                         f"valid: {valid}")


def check_layer(norm: NormConfig, channels: Iterable[int]) -> None:
    """A norm file's callable (`norm.target`) must build a module for each channel count the model asks for."""
    if not isinstance(norm, CustomNormConfig):
        return
    make = layer_of(norm)
    for c in sorted(set(channels)):
        try:
            with torch.random.fork_rng(devices=[]):
                built = make(c)
        except Exception as e:  # noqa: BLE001 - whatever the user's layer raises, in one line
            raise targets.TargetError(f"norm.target={norm.target!r}: building it for {c} channels with "
                                      f"{norm.params} fails: {type(e).__name__}: {e}") from None
        if not isinstance(built, nn.Module):
            raise targets.TargetError(f"norm.target={norm.target!r}: returned {type(built).__name__} for {c} "
                                      "channels; expected a torch.nn.Module")


def norm2d(name: str, channels: int, **options: int) -> nn.Module:
    """The normalization layer `name` for `channels` channels (options such as `groups` for gn)."""
    try:
        make = NORMS[name]
    except KeyError:
        raise ValueError(f"norm.name={name!r}; valid: {sorted(NORMS)}") from None
    return make(channels, **options)


def layer(name: str, **options: Any) -> Callable[[int], nn.Module]:
    """What a model builder takes as `norm_layer`: channels -> the norm `name` with its options."""
    return functools.partial(norm2d, name, **options)


def layer_of(norm: NormConfig) -> Callable[[int], nn.Module]:
    """The `norm_layer` of a cell's norm config: the registry's layer, or a norm file's own callable
    (`target`, with its `params`)."""
    if isinstance(norm, CustomNormConfig):
        return functools.partial(targets.load(norm.target, "norm.target", positional=1), **norm.params)
    return layer(norm.name, **norm.options())
