"""A run's precision at work (conf/precision/, docs/precision.md): the forward's autocast, the weights' dtype,
where a step's micro-batch gradients are summed, and fp16's GradScaler under accumulation.

The scaler follows PyTorch's rules for accumulation: every micro-batch's loss is scaled, the summed gradients
are unscaled and checked once per optimizer step, and a step with Inf or NaN in any micro-batch's gradient is
skipped whole (parameters and Adam's state untouched) with the scale updated once. It is built for the run's own
device: `torch.amp.GradScaler()` alone means CUDA, and on a machine without CUDA turns itself off in silence.

With bf16 weights, `accumulate_in=param` sums the micro-batch gradients in `.grad` (k bf16 roundings, as
pure-bf16 trainers do); `fp32` sums them in a float32 buffer and rounds to bf16 once per step (Megatron's
`main_grad`, DeepSpeed's `grad_accum_dtype`). float32 (`fp32`) leaves every operation as it was before precision
was a choice: the same calls, bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import ContextManager

import torch
import yaml
from torch import nn

from gaexp.config import CONFIG_DIR, FP32, PrecisionConfig, precision_name
from gaexp.optim import Optimizer

log = logging.getLogger("gaexp.app")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_config(name: str, accumulate_in: str | None = None) -> PrecisionConfig:
    """gaexp's `precision=NAME`, as conf/precision/NAME.yaml declares it (fp32, bf16, fp16, bf16w, bf16w-acc32),
    with its micro-batch gradients summed in `accumulate_in` (param or fp32) when given; refused in one line
    (ValueError)."""
    folder = Path(CONFIG_DIR) / "precision"
    names = sorted(p.stem for p in folder.glob("*.yaml"))
    if name not in names:
        raise ValueError(f"precision={name!r}; valid: {', '.join(names)}")
    keys = yaml.safe_load((folder / f"{name}.yaml").read_text())
    if accumulate_in is not None:
        keys["accumulate_in"] = accumulate_in
    return PrecisionConfig(**keys, name=precision_name(**keys))  # a contradiction: ValueError, in one line


def as_precision(precision: PrecisionConfig | str) -> PrecisionConfig:
    """A precision given by gaexp's name, or a PrecisionConfig (its name derived from its keys where it was left to
    the resolver, as in PrecisionConfig(autocast="bf16"))."""
    if isinstance(precision, str):
        return precision_config(precision)
    if precision.name.startswith("${"):
        keys = {k: getattr(precision, k) for k in ("autocast", "weights", "accumulate_in", "scaler")}
        return PrecisionConfig(**keys, name=precision_name(**keys))
    return precision


def cpu_has_instructions(dtype: torch.dtype) -> bool:
    """Whether this CPU computes `dtype` in hardware (AVX512-BF16 or AMX for bf16; AVX512-FP16 or AMX for fp16):
    without them torch emulates it, several times slower than float32."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    if dtype == torch.bfloat16:
        return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    if dtype == torch.float16:
        return bool(caps.get("avx512_fp16") or caps.get("amx_fp16"))
    return True


def low_dtypes(p: PrecisionConfig) -> list[torch.dtype]:
    """The reduced-precision dtypes a run of `p` computes in."""
    return [DTYPES[name] for name in (p.autocast, p.weights) if name not in ("none", FP32)]


def device_problem(p: PrecisionConfig, device: torch.device) -> str | None:
    """Why `device` cannot train in `p` (one line naming the valid choices), or None. A tiny convolution under
    the precision is run there: what this torch and device can do, not a list of what they should."""
    if device.type == "cuda" and torch.bfloat16 in low_dtypes(p) and not torch.cuda.is_bf16_supported():
        return (f"precision={p.name}: this GPU ({torch.cuda.get_device_name(device)}) has no bf16; valid here: fp32, "
                "fp16")
    try:
        conv = nn.Conv2d(1, 2, 3).to(device, DTYPES[p.weights])
        x = torch.ones(1, 1, 4, 4, device=device, dtype=DTYPES[p.weights])
        with forward_context(p, device):
            conv(x).float().sum().backward()
    except (RuntimeError, NotImplementedError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"precision={p.name}: {device.type} cannot train in it here ({first}); valid here: fp32"
    return None


def slow_note(p: PrecisionConfig, device: torch.device) -> str | None:
    """One line where `p` runs emulated on this CPU (no bf16 or fp16 instructions): it works, slowly."""
    if device.type != "cpu":
        return None
    names = {torch.bfloat16: "bf16 instructions (AVX512-BF16 or AMX-BF16)",
             torch.float16: "fp16 instructions (AVX512-FP16 or AMX-FP16)"}
    missing = [names[d] for d in low_dtypes(p) if not cpu_has_instructions(d)]
    if not missing:
        return None
    return (f"precision={p.name}: this CPU has no {' or '.join(missing)}; torch emulates them, several times slower "
            "than precision=fp32")


_SAID: set[str] = set()  # the slow notes this process printed


def slow_once(p: PrecisionConfig, device: torch.device) -> str | None:
    """`slow_note`, the first time this process meets it (a sweep's worker runs many cells); None after."""
    note = slow_note(p, device)
    if note is None or note in _SAID:
        return None
    _SAID.add(note)
    return note


def forward_context(p: PrecisionConfig, device: torch.device) -> ContextManager:
    """The forward's autocast, or nothing."""
    if p.autocast == "none":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[p.autocast])


class Precision:
    """One run's precision: `prepare` the model, then for each micro-batch `forward()` around its forward and
    `backward(loss)` (the loss already divided by k), and `step(optimizer)` once per optimizer step, which says
    whether the scaler skipped it. `skipped`: steps skipped so far."""

    def __init__(self, p: PrecisionConfig, device: torch.device) -> None:
        self.config, self.device = p, device
        self.dtype = DTYPES[p.weights]
        self.scaler = torch.amp.GradScaler(device.type, enabled=p.scaler)  # the run's device, never the default
        self.params: list[nn.Parameter] = []
        self.sums: dict[nn.Parameter, torch.Tensor] = {}  # accumulate_in=fp32: the step's gradients so far
        self.skipped = 0

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model in the weights' dtype (its buffers too: BatchNorm's statistics in bf16, as a pure-bf16
        trainer has them); its parameters are the ones a float32 buffer sums for."""
        model = model if self.dtype == torch.float32 else model.to(self.dtype)
        self.params = [p for p in model.parameters() if p.requires_grad]
        return model

    def forward(self) -> ContextManager:
        return forward_context(self.config, self.device)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's (1/k-scaled) loss, times the scaler's scale; with a float32 buffer, the
        micro-batch's gradients are added to it and `.grad` cleared."""
        self.scaler.scale(loss).backward()
        if self.config.accumulate_in == "fp32":
            for param, grad in ((q, q.grad) for q in self.params if q.grad is not None):
                if param in self.sums:
                    self.sums[param].add_(grad)
                else:
                    self.sums[param] = grad.float()
                param.grad = None

    def step(self, optimizer: Optimizer) -> bool:
        """The optimizer step: the buffer's sums rounded into `.grad`; under the scaler, the gradients unscaled
        and checked once, the step taken or skipped whole, the scale updated once. True: skipped."""
        for param, total in self.sums.items():
            param.grad = total.to(param.dtype)
        self.sums.clear()
        if not self.scaler.is_enabled():
            optimizer.step()
            return False
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)  # unscale_ (once), then optimizer.step() unless a gradient is not finite
        self.scaler.update()
        skipped = self.scaler.get_scale() < before  # a skip always backs the scale off; a good step never lowers it
        self.skipped += skipped
        return skipped

    @classmethod
    def float32(cls) -> "Precision":
        """precision=fp32: the calls of training before precision was a choice, on any device."""
        return cls(PrecisionConfig(name=FP32), torch.device("cpu"))

    @property
    def scale(self) -> float | None:
        """The loss scale now, under a scaler."""
        return self.scaler.get_scale() if self.scaler.is_enabled() else None
