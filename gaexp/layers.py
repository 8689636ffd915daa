"""The layers of gaexp's own norms (BatchNorm remedies) and the hook PreciseBN needs; gaexp/norms.py declares
what each norm is (its constructor, options, coupling, hooks, place in reports) and builds them from here."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from gaexp.data.batches import Split
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


class CrossReplicaBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm whose training statistics span every replica's micro-batch (norm=bn_sync): what
    `nn.SyncBatchNorm` computes, on any backend (it refuses CPU tensors). Each replica's per-channel count, mean and
    centred sum of squares are summed over `process_group` by torch.distributed's functional all-reduce, whose
    backward all-reduces the gradient, so every replica's share of the statistics' gradient reaches every replica
    (`torch.distributed.nn.functional.all_reduce`, the same arithmetic, warns on every replica that it is
    deprecated). Its running statistics are updated with the global mean and unbiased variance: the same on every
    replica. Outside a process group of two or more (one replica, evaluation) it is `nn.BatchNorm2d`, the same
    calls."""

    process_group = None  # set by gaexp/replicas.py (`Replicas.wrap`): None, the default group

    def __getstate__(self) -> dict:
        """Pickled (the run's logged model) without its process group, which lives only as long as the cell."""
        state = super().__getstate__()
        return {k: v for k, v in state.items() if k != "process_group"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if not (self.training and dist.is_available() and dist.is_initialized()
                and dist.get_world_size(self.process_group) > 1):
            return super().forward(x)
        from torch.distributed._functional_collectives import all_reduce

        compute = torch.float64 if x.dtype == torch.float64 else torch.float32  # as BatchNorm under autocast
        xs = x.to(compute)
        count = xs.numel() // xs.size(1)
        local_mean = xs.mean(dim=(0, 2, 3))
        centred = (xs - local_mean.view(1, -1, 1, 1)).square().sum(dim=(0, 2, 3))
        n = torch.full_like(local_mean[:1], count)
        total = all_reduce(torch.cat([n, n * local_mean, centred + n * local_mean.square()]), "sum",
                           dist.group.WORLD if self.process_group is None else self.process_group)
        c = self.num_features
        size = total[0]
        mean = total[1:1 + c] / size
        var = (total[1 + c:] / size - mean.square()).clamp_min(0)  # biased: what normalizes, as BatchNorm's
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum)
                unbiased = var * size / (size - 1).clamp_min(1)
                self.running_mean.mul_(1 - factor).add_(mean.detach().to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach().to(self.running_var.dtype), alpha=factor)
        y = (xs - mean.view(1, -1, 1, 1)) * torch.rsqrt(var + self.eps).view(1, -1, 1, 1)
        if self.affine:
            y = y * self.weight.to(compute).view(1, -1, 1, 1) + self.bias.to(compute).view(1, -1, 1, 1)
        dtype = x.dtype if self.weight is None or x.dtype == torch.float64 else self.weight.dtype
        return y.to(dtype)


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


def precise_hooks(model: nn.Module, data: Split, seed: int) -> list[Hook]:
    """bn_precise's training hook: the population statistics of the model's PreciseBatchNorm2d layers before
    every evaluation."""
    precise = [m for m in model.modules() if isinstance(m, PreciseBatchNorm2d)]
    return [PreciseStatistics(precise[0], data, seed)] if precise else []


def kmom_batchnorm(channels: int, num_accum: int, momentum: float) -> nn.BatchNorm2d:
    """bn_kmom: BatchNorm2d whose k micro-batch updates decay the running statistics as one update of
    `momentum` per optimizer step does."""
    return nn.BatchNorm2d(channels, momentum=kmom(momentum, num_accum))
