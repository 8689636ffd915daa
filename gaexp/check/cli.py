"""`gaexp-check`: is this model safe to train with gradient accumulation? The command around gaexp/check/.

    gaexp-check torchvision.models:resnet18 --input-shape 3,224,224     # any callable returning a model
    gaexp-check model=resnet20 norm=bn                                   # a gaexp model and norm (config overrides)
    gaexp-check hf:./my-checkpoint --task causal-lm --num-items-in-batch # a transformers model, its own loss

One training step from the same weights and samples, as one batch of b*k and as k micro-batches of b; the
report names what differs and why. Exit status 0 safe, 1 unsafe, 2 bad input, 3 NaN or Inf in the step, 4
imprecise (under `--precision`, accumulation measurably further from float64 than the big batch; unsafe wins);
`--json` for machines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException
from torch import nn
from torch.utils._pytree import tree_leaves

from gaexp import targets
from gaexp.arguments import positive_ints
from gaexp.data.batches import VIEWS, micro_batch_indices, micro_batches
from gaexp.check import hf
from gaexp.check.accumulation import check_accumulation, where_raised
from gaexp.check.balance import Balanced
from gaexp.check.negatives import CachedStep
from gaexp.check.errors import CheckError, NonFiniteError
from gaexp.check.loss import LOSS_FORMS, MODEL_LOSS, NUM_ITEMS, loss_contract
from gaexp.check.report import Report
from gaexp.config import (ACCUMULATE_IN, CONFIG_DIR, DEVICES, FP32, DataConfig, PrecisionConfig, composition_problem,
                          typed, unknown_choice)
from gaexp.data.catalog import DataError, data_config, image_names
from gaexp.data.dataset import describe, open_dataset
from gaexp.model import ARGUMENTS, check_model, make_model
from gaexp.precision import device_problem, precision_config
from gaexp.targets import TargetError
from gaexp.task import STEP
from gaexp.task.build import make as make_task, problem as task_problem
from gaexp.train import resolve_device

SAFE, UNSAFE, BAD_INPUT, NON_FINITE, IMPRECISE = 0, 1, 2, 3, 4
DEFAULT_MICRO_BATCH, DEFAULT_ACCUM = 2, 4
DEFAULT_SEQ_LEN = 16


@dataclass
class Subject:
    """The model to check and what it takes."""
    model: nn.Module
    name: str  # how the report names it
    input_shape: tuple[int, ...]  # one sample's
    micro_batch: int
    num_accum: int
    data: DataConfig | None = None  # the dataset of --data (None: random inputs)
    precision: PrecisionConfig | None = None  # a gaexp model's precision=, where its overrides name one
    replicas: int = 1  # w data-parallel replicas of micro_batch with num_accum // w steps each (--replicas)
    task: str | None = None  # a transformers task (--task, or hf:PATH's config): its inputs, labels and own loss
    lm: Any = None  # a gaexp language model's task (task=lm, gaexp/task/lm.py): its text, loss and normalization
    contrastive: Any = None  # a gaexp contrastive task (task=contrastive): two views of each image, its negatives


def _shape(text: str) -> tuple[int, ...]:
    return positive_ints(text, "one sample's shape as positive integers, e.g. 3,224,224")


def _keyword(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}; valid: KEY=VALUE, e.g. num_classes=10 or weights=null")
    return key, yaml.safe_load(value)


class UsageError(Exception):
    """What argparse would print as usage and exit on: one line instead."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (gaexp-check --help lists the options)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gaexp-check", description=(
        "Is this model safe to train with gradient accumulation? One training step from the same weights and "
        "samples, taken as one batch of b*k and as k micro-batches of b (each loss scaled by 1/k), compared: the "
        "gradients, which modules couple the samples of a batch, the buffers, the loss (in float32, whatever the "
        "--precision). Exit status 0 safe, 1 unsafe, 2 bad input, 3 NaN or Inf in the step (its first appearance "
        "named), 4 imprecise: under --precision, the accumulated gradient measurably further from float64 than "
        "the big batch's (1 wins over 4)."))
    p.add_argument("target", nargs="+", metavar="TARGET", help=(
        "an import path module:callable that returns a model (torchvision.models:resnet18, mypkg.nets:build), "
        "or gaexp config overrides naming a model and norm (model=resnet20 norm=bn; model=custom "
        "model.target=mypkg.nets:build norm=gn4), whose regime, if given, sets b and k; either may be followed "
        "by the dataset's keys (data.path=DIR data.size=[64,64]); or hf:PATH, a transformers checkpoint folder or "
        "config file, loaded offline by the Auto class of its --task"))
    p.add_argument("--input-shape", type=_shape, default=None, help=(
        "one sample's shape for an import path, e.g. 3,224,224 (default: 3,224,224, or the --data images'); a "
        "gaexp model takes its dataset's (the config's data, or --data)"))
    p.add_argument("--num-classes", type=int, default=None, help=(
        "passed to the callable as num_classes= (default: its own); the targets are drawn from the model's "
        "output classes"))
    p.add_argument("--arg", type=_keyword, action="append", default=[], metavar="KEY=VALUE",
                   help="another keyword argument for the callable, its value read as YAML (repeatable)")
    p.add_argument("--micro-batch", type=int, default=None, help=(
        f"b, the micro-batch (default: {DEFAULT_MICRO_BATCH}, or the gaexp regime's when one is given)"))
    p.add_argument("--accum", type=int, default=None, help=(
        f"k, the accumulation steps (default: {DEFAULT_ACCUM}, or the gaexp regime's when one is given)"))
    p.add_argument("--replicas", type=int, default=None, help=(
        "w, data-parallel replicas of micro-batch b with k steps each, norms per replica: checked as accumulation "
        "at b with w*k steps (default: 1, or the gaexp regime's)"))
    p.add_argument("--loss", default=None, metavar="MODULE:CALLABLE|model", help=(
        "loss(outputs, targets) -> scalar, a mean over its micro-batch (default: cross-entropy, summed over the "
        "heads of a model that returns several; with --task, the model's own); one that takes the whole step's "
        "targets as a third positional parameter or a keyword-only step_targets gets them and is not scaled by 1/k, "
        f"and so does one that takes {NUM_ITEMS} (a Trainer's compute_loss_func(outputs, labels, {NUM_ITEMS})), "
        f"given the step's count of labels that are not -100; '{MODEL_LOSS}': the loss the model's forward "
        "returns (outputs.loss), scaled by 1/k"))
    p.add_argument("--num-items-in-batch", action="store_true", help=(
        f"as transformers' Trainer with a model that takes loss keywords: the step's count of labels that are not "
        f"-100 (from the second token on for a decoder) given to the model's forward as {NUM_ITEMS}, and its loss "
        "not scaled by 1/k (the fix of the 2024 accumulation bug)"))
    p.add_argument("--task", choices=tuple(hf.TASKS), default=None, help=(
        "a transformers model's task, whose inputs are made for it: tokens of the config's vocabulary with their "
        "attention mask and labels (causal-lm, masked-lm: 15%% of tokens masked, sequence-classification), images "
        "(image-classification) or image-text pairs (contrastive, return_loss=True); the loss is the model's own "
        "(default: the task the config's architectures name)"))
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help=(
        "tokens a row for a text task (default: %(default)s)"))
    p.add_argument("--pad", choices=hf.PADDING, default="varied", help=(
        "varied: each row has from a quarter of --seq-len to all of it real tokens, padded after, so micro-batches "
        "hold different counts of tokens (as a collator's padding gives them); none: every row full, as packed "
        "sequences (default: %(default)s)"))
    p.add_argument("--data", default="random", help=(
        f"random (inputs uniform in [0, 1), random classes) or a gaexp dataset: {', '.join(image_names())}, its "
        "first b*k training images in the seed's order, as a cell's model sees them (default: %(default)s)"))
    p.add_argument("--data-root", default=None, help=(
        "where the gaexp datasets are (default: where the study's commands put them, the config's data.root: "
        "outputs/data, or PATHS/data with paths.outputs=PATHS among the overrides)"))
    p.add_argument("--device", default="cpu", help=f"{', '.join(DEVICES)} (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the weights' and the data's seed (default: %(default)s)")
    p.add_argument("--rtol", type=float, default=None, help=(
        "the relative difference taken as float rounding (default: the square root of the parameters' machine "
        "epsilon, 3.5e-4 in float32)"))
    p.add_argument("--keep-modes", action="store_true", help=(
        "check the model with its training flags as they are (default: every module in training mode, as "
        "training runs; the report names the modules the model had in eval mode)"))
    p.add_argument("--precision", type=_precision, default=None, help=(
        f"the precision the model trains in, as gaexp's precision= ({', '.join(precisions())}; default: fp32, or "
        "a gaexp model's precision= among the overrides): the check stays in float32, and the report adds the "
        "step under it against float64, accumulated and as one batch"))
    p.add_argument("--accumulate-in", choices=ACCUMULATE_IN, default=None, help=(
        "where --precision bf16w sums a step's micro-batch gradients: param (in .grad, bf16) or fp32 (a float32 "
        "buffer, rounded to bf16 once per step: gaexp's precision=bf16w-acc32) (default: param)"))
    p.add_argument("--json", action="store_true", help="print the report as JSON (numbers, null where not finite)")
    return p


def _gaexp_precisions() -> dict[str, PrecisionConfig]:
    """gaexp's precision= choices, conf/precision/'s files."""
    return {path.stem: precision_config(path.stem) for path in sorted((Path(CONFIG_DIR) / "precision").glob("*.yaml"))}


def precisions() -> list[str]:
    """--precision's choices: gaexp's precisions whose gradients are summed where the weights are (the others are
    these with --accumulate-in fp32): float32, the autocasts, then the low-precision weights."""
    kept = {n: p for n, p in _gaexp_precisions().items() if p.accumulate_in == "param"}
    return sorted(kept, key=lambda n: (n != FP32, kept[n].weights != FP32, n))


def _precision(text: str) -> str:
    if text in precisions():
        return text
    known = _gaexp_precisions().get(text)
    hint = next((f" ({text} is --precision {base} --accumulate-in {known.accumulate_in})" for base in precisions()
                 if known is not None and _accepts(base, known.accumulate_in)
                 and precision_config(base, known.accumulate_in) == known), "")
    raise argparse.ArgumentTypeError(f"{text!r}; valid: {', '.join(precisions())}{hint}")


def precision_of(args: argparse.Namespace, subject: Subject) -> PrecisionConfig:
    """What the step is measured under: --precision and --accumulate-in, or a gaexp model's precision= (not both)."""
    flags = [f"--{name.replace('_', '-')} {value}" for name, value in (("precision", args.precision),
                                                                    ("accumulate_in", args.accumulate_in)) if value]
    if subject.precision is not None:
        if flags:
            raise CheckError(f"precision={subject.precision.name} among the overrides and {' '.join(flags)}; valid: "
                             "one of them")
        return subject.precision
    name = args.precision or FP32
    try:
        return precision_config(name, args.accumulate_in)
    except ValueError:
        takes = [n for n in precisions() if _accepts(n, args.accumulate_in)]
        raise CheckError(f"--accumulate-in {args.accumulate_in} with --precision {name}; valid: --accumulate-in "
                         f"{args.accumulate_in} with --precision {', '.join(takes)}, param with any ({name}'s "
                         "gradients are float32, summed in float32 already)") from None


def _accepts(name: str, accumulate_in: str) -> bool:
    try:
        precision_config(name, accumulate_in)
        return True
    except ValueError:
        return False


def _sizes(args: argparse.Namespace, regime: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    """(b, k, w): the micro-batch, the accumulation steps of each replica and the replicas, from the flags, else
    the gaexp regime's, else the defaults."""
    b, k, w = regime or (DEFAULT_MICRO_BATCH, DEFAULT_ACCUM, 1)
    w = args.replicas if args.replicas is not None else w
    if w < 1:
        raise CheckError(f"--replicas {w}; valid: a positive integer (1: no data parallelism)")
    return (args.micro_batch if args.micro_batch is not None else b), (args.accum if args.accum is not None else k), w


def from_config(overrides: Sequence[str], args: argparse.Namespace) -> Subject:
    """A gaexp model and norm, built as a cell builds them for its dataset (the model's checks included)."""
    if args.num_classes is not None or args.arg:
        raise CheckError("--num-classes and --arg are for an import path; a gaexp model takes its classes from its "
                         "dataset and its options from the config")
    if args.data != "random" and args.data not in image_names():
        raise CheckError(f"--data {args.data!r}; valid: random, {', '.join(image_names())}")
    problem = unknown_choice(overrides) or composition_problem(overrides)
    text = any(o.split("=")[0].lstrip("+~") == "task" and o.split("=", 1)[1] == "lm" for o in overrides)
    if text and args.data != "random":
        raise CheckError(f"--data {args.data}: task=lm checks on its text data (data=fortunes, or data=textfolder "
                         "data.path=DIR among the overrides)")
    if problem:
        raise CheckError(problem)
    given_regime = any(o.split("=")[0].lstrip("+~").startswith("regime") for o in overrides)
    overrides = [*overrides, *([f"data.root={os.path.abspath(args.data_root)}"] if args.data_root else []),
                 *([f"data={args.data}"] if args.data != "random" else [])]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        regime = compose("config", overrides=list(overrides)).regime if given_regime else None
        b, k, w = _sizes(args, (regime.batch_size, regime.num_accum, regime.replicas) if regime is not None else None)
        cfg = compose("config", overrides=[*overrides, f"regime.batch_size={b}", f"regime.num_accum={w * k}",
                                           "regime.replicas=1",
                                           f"seed={args.seed}", f"device={args.device}"])
    c = typed(cfg)
    if (problem := task_problem(c)) is not None:
        raise CheckError(problem)
    shape, classes = describe(c.data)
    if c.task.name == "lm":  # a language model: the first b*k sequences of its text, its own loss
        check_model(c, shape, classes)
        torch.manual_seed(c.seed)
        balance = f" task.balance={c.task.balance}" if c.task.balance != "none" else ""
        return Subject(make_model(c, shape[0], classes), f"model={c.model.name} task.loss={c.task.loss}{balance}",
                       shape, b, w * k, c.data, None, w, lm=make_task(c.task))
    if c.task.name == "contrastive":  # two views of each image: a micro-batch of b images is 2b rows
        check_model(c, shape, classes)
        torch.manual_seed(c.seed)
        task = make_task(c.task)
        return Subject(make_model(c, shape[0], classes), f"model={c.model.name} norm={c.norm.name} task=contrastive "
                       f"task.negatives={c.task.negatives}", shape, b * task.views, w * k,
                       c.data if args.data != "random" else None, None, w, contrastive=task)
    if args.input_shape not in (None, shape):
        raise CheckError(f"--input-shape {','.join(map(str, args.input_shape))}: a gaexp model takes its dataset's "
                         f"images, {','.join(map(str, shape))} (data={c.data.dataset})")
    check_model(c, shape, classes)
    torch.manual_seed(c.seed)
    name = f"model={c.model.name} norm={c.norm.name}"
    given_precision = any(o.split("=")[0].lstrip("+~").split(".")[0] == "precision" for o in overrides)
    return Subject(make_model(c, shape[0], classes), name, shape, b, w * k, c.data if args.data != "random" else None,
                   c.precision if given_precision else None, w)


def data_of(args: argparse.Namespace, keys: Sequence[str]) -> DataConfig | None:
    """The --data dataset for an import path, its keys given as data.KEY=VALUE after the target."""
    if args.data == "random":
        if keys:
            raise CheckError(f"{' '.join(keys)}: data keys are for --data NAME; valid: --data {', '.join(image_names())}")
        return None
    if args.data not in image_names():
        raise CheckError(f"--data {args.data!r}; valid: random, {', '.join(image_names())}")
    given = {k.removeprefix("data."): v for k, v in (item.split("=", 1) for item in keys)}
    return data_config(args.data, args.data_root or "outputs/data", **{k: yaml.safe_load(v) for k, v in given.items()})


def gaexp_form(target: str, norm: str = "bn") -> str:
    """The command that checks a gaexp model builder (norm_layer=, in_channels=, num_classes=) as gaexp builds it,
    with `norm` (the config's default) in its norm layers."""
    return f"gaexp-check model=custom model.target={shlex.quote(target)} norm={norm}"


def from_import_path(target: str, args: argparse.Namespace, keys: Sequence[str] = ()) -> Subject:
    """The model a callable returns, called with --num-classes and --arg as keywords."""
    keywords = dict(args.arg)
    if args.num_classes is not None:
        keywords["num_classes"] = args.num_classes
    make = targets.load(target, "TARGET", positional=None)
    if not targets.accepts(make, tuple(keywords)) and targets.accepts(make, ARGUMENTS):
        raise CheckError(f"TARGET={target!r}: {targets.signature_of(make)} is a gaexp model builder (it takes "
                         f"{', '.join(f'{a}=' for a in ARGUMENTS)}); check it as gaexp builds it: "
                         f"{gaexp_form(target)}")
    make = targets.load(target, "TARGET", tuple(keywords))
    torch.manual_seed(args.seed)
    try:
        model = make(**keywords)
    except Exception as e:  # noqa: BLE001 - the user's builder, said in one line
        raise CheckError(f"TARGET={target!r}: calling it with {keywords or 'no arguments'} raised "
                         f"{targets.raised(e, target)}") from None
    if not isinstance(model, nn.Module):
        raise CheckError(f"TARGET={target!r} returned {type(model).__name__}; expected a torch.nn.Module")
    b, k, w = _sizes(args)
    if args.task is not None:
        return task_subject(model, target, args, keys, args.task)
    data = data_of(args, keys)
    if data is None:
        return Subject(model, target, args.input_shape or (3, 224, 224), b, w * k, replicas=w)
    shape = describe(data)[0]
    if args.input_shape not in (None, shape):
        raise CheckError(f"--data {args.data} has images of shape {','.join(map(str, shape))}; --input-shape "
                         f"{','.join(map(str, args.input_shape))} (leave it out to use the dataset's)")
    return Subject(model, target, shape, b, w * k, data, replicas=w)


def task_subject(model: nn.Module, name: str, args: argparse.Namespace, keys: Sequence[str], task: str) -> Subject:
    """A transformers model checked on its task's inputs (no --data, --input-shape or --num-classes: the config
    says them)."""
    given = [flag for flag, value in (("--input-shape", args.input_shape), ("--num-classes", args.num_classes),
                                      ("--data", None if args.data == "random" else args.data)) if value is not None]
    if given or keys:
        raise CheckError(f"{' '.join([*given, *keys])} with --task {task}: the task's inputs come from the model's "
                         "config (--seq-len and --pad for text)")
    b, k, w = _sizes(args)
    return Subject(model, name, (), b, w * k, replicas=w, task=task)


def from_hf(target: str, args: argparse.Namespace, keys: Sequence[str]) -> Subject:
    """hf:PATH: a transformers checkpoint folder or config file, with the head of its task."""
    if args.num_classes is not None or args.arg:
        raise CheckError("--num-classes and --arg are for an import path; hf:PATH takes its labels and options from "
                         "its config")
    torch.manual_seed(args.seed)
    model, task = hf.load(target.removeprefix(hf.PREFIX), args.task)
    return task_subject(model, target, args, keys, task)


def load_loss(target: str | None) -> Callable[..., torch.Tensor] | str | None:
    """The loss an import path names, or 'model', held to the check's one loss contract
    (gaexp.check.loss_contract)."""
    if target is None or target == MODEL_LOSS:
        return target
    fn = targets.load(target, "--loss", positional=None)
    try:
        loss_contract(fn)
    except CheckError:
        raise CheckError(f"--loss={target!r}: expected {LOSS_FORMS}") from None
    return fn


def require_sizes(subject: Subject) -> None:
    if subject.micro_batch < 1 or subject.num_accum < 2:
        raise CheckError(f"--micro-batch {subject.micro_batch} --accum {subject.num_accum}; valid: b >= 1, k >= 2")


def lm_loss(task: Any) -> Callable[..., torch.Tensor]:
    """A gaexp language model's loss held to the check's contract: a mean over its micro-batch (token_mean,
    seq_mean: the check scales it by 1/k), or the summed loss over the step's count, given as num_items_in_batch
    (step_token_mean, as the Trainer's compute_loss_func)."""
    if task.normalization == STEP:
        def by_step(outputs: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int) -> torch.Tensor:
            return task.loss(outputs, labels) / num_items_in_batch
        found = by_step
    else:
        def per_micro_batch(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return task.loss(outputs, labels)
        found = per_micro_batch
    found.__qualname__ = f"task.loss={task.choice}"  # as the report names the loss
    return found


def contrastive_loss(task: Any) -> Callable[..., torch.Tensor]:
    """A gaexp contrastive task's loss with negatives=micro, held to the check's contract: each micro-batch's InfoNCE
    over its own views (the check scales it by 1/k)."""
    def per_micro_batch(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return task.loss(outputs, labels)
    per_micro_batch.__qualname__ = f"task.loss=info_nce task.negatives={task.negatives}"  # as the report names it
    return per_micro_batch


def make_data(subject: Subject, args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """b*k inputs of the subject's shape and a class target each, from the model's own output classes (a language
    model: its text's first b*k sequences in the seed's order, and their next tokens)."""
    n = subject.micro_batch * subject.num_accum
    require_sizes(subject)
    generator = torch.Generator().manual_seed(args.seed)
    if subject.contrastive is not None:  # the seed's first n/2 images, two views each, in turn
        subject.model.to(device)
        if subject.data is None:
            return torch.rand((n, *subject.input_shape), generator=generator).to(device), torch.zeros(n, dtype=torch.long)
        split = dataclasses.replace(open_dataset(subject.data).train, augment=VIEWS)
        draw = next(micro_batches(len(split), n // subject.contrastive.views, args.seed, VIEWS))
        inputs, labels = split.batch(draw)
        return inputs.contiguous().to(device), labels.repeat_interleave(subject.contrastive.views).to(device)
    if subject.lm is not None:
        split = open_dataset(subject.data).train
        inputs, labels = split.window(next(micro_batch_indices(len(split), n, args.seed)))
        subject.model.to(device)
        return inputs.to(device), labels.to(device)
    if subject.data is None:
        inputs = torch.rand((n, *subject.input_shape), generator=generator)
    else:
        try:
            split = open_dataset(subject.data).train
        except DataError as e:
            raise DataError(f"--data {args.data}: {e}") from None
        idx = next(micro_batch_indices(len(split), n, args.seed))
        inputs = split.inputs(idx).contiguous()
    subject.model.to(device)
    inputs = inputs.to(device)
    flags = {m: m.training for m in subject.model.modules()}  # the model's own modes, module by module
    subject.model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = subject.model(inputs[:2])
    except Exception as e:  # noqa: BLE001 - the user's forward, said in one line
        raise CheckError(f"the model refuses inputs of shape {tuple(inputs[:2].shape)} (--input-shape): "
                         f"{type(e).__name__}: {e}") from None
    finally:
        for m, flag in flags.items():
            m.training = flag
    if not isinstance(out, torch.Tensor):  # several heads (logits and auxiliary logits): the first
        out = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), out)
    if not isinstance(out, torch.Tensor) or out.dim() < 2:
        raise CheckError(f"the model's output is {type(out).__name__} {tuple(getattr(out, 'shape', ()))}; the "
                         "command needs logits (batch, classes, ...): for other outputs, call "
                         "gaexp.check.check_accumulation with your own targets and loss")
    classes = out.shape[1]
    if args.num_classes is not None and classes != args.num_classes:
        raise CheckError(f"--num-classes {args.num_classes}, but the model gives {classes} outputs per sample")
    if subject.data is None:
        labels = torch.randint(0, classes, (n, *out.shape[2:]), generator=generator)
    else:
        data_classes = describe(subject.data)[1]
        if classes < data_classes:
            raise CheckError(f"--data {args.data} has {data_classes} classes; the model gives {classes} outputs")
        labels = split.labels[idx]
    return inputs, labels.to(device)


def _finite(obj: Any) -> Any:
    """JSON has no inf or nan: they are written as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def run(argv: Sequence[str] | None = None) -> tuple[int, str]:
    """(exit status, what to print)."""
    try:
        args = parser().parse_intermixed_args(argv)
    except UsageError as e:
        return BAD_INPUT, f"gaexp-check: error: {e}"
    try:
        if args.device not in DEVICES:
            raise CheckError(f"--device {args.device!r}; valid: {', '.join(DEVICES)}")
        device = resolve_device(args.device)
        overrides = "=" in args.target[0] and not args.target[0].startswith(hf.PREFIX)
        if not overrides and not all(t.startswith("data.") and "=" in t for t in args.target[1:]):
            raise CheckError(f"TARGET: one import path or hf:PATH (then data.KEY=VALUE keys of --data), or config "
                             f"overrides KEY=VALUE; got {' '.join(args.target)}")
        if overrides and args.task is not None:
            raise CheckError(f"--task {args.task} is for a transformers model (hf:PATH, or an import path returning "
                             "one); a gaexp model trains on its dataset")
        subject = from_config(args.target, args) if overrides else \
            from_hf(args.target[0], args, args.target[1:]) if args.target[0].startswith(hf.PREFIX) else \
            from_import_path(args.target[0], args, args.target[1:])
        loss = load_loss(args.loss if args.loss is not None or subject.task is None else MODEL_LOSS)
        if subject.lm is not None and loss is None:
            loss = lm_loss(subject.lm)
        if subject.contrastive is not None and loss is None:
            loss = contrastive_loss(subject.contrastive)
        precision = precision_of(args, subject)
        problem = device_problem(precision, device) if precision.name != FP32 else None
        if problem:
            raise CheckError(problem)
        count = hf.trainer_count(subject.model) if args.num_items_in_batch else False
        if subject.lm is not None and callable(loss) and loss_contract(loss).items:
            count = True  # the step's count of labels that are not -100
        if subject.task is not None and callable(loss) and loss_contract(loss).items:
            count = hf.trainer_count(subject.model)  # a compute_loss_func: given the step's count as the Trainer counts
        if subject.task is not None:
            n = subject.micro_batch * subject.num_accum
            require_sizes(subject)
            inputs, labels = hf.task_inputs(subject.model, subject.task, n, subject.micro_batch, args.seq_len,
                                            args.pad, args.seed)
            if loss != MODEL_LOSS:  # a compute_loss_func of one's own: the Trainer pops the labels for it
                inputs.pop("labels", None)
            subject.model.to(device)
            inputs = {key: v.to(device) if isinstance(v, torch.Tensor) else v for key, v in inputs.items()}
            labels = labels.to(device) if labels is not None else None
        else:
            inputs, labels = make_data(subject, args, device)
        if subject.lm is not None and subject.lm.balance != "none":  # the model's loss, its balancing term apart
            subject = replace(subject, model=Balanced(subject.model, subject.lm, inputs, labels,
                                                      by_step=subject.lm.normalization == STEP))
            inputs, loss, count = {"tokens": inputs, "labels": labels}, MODEL_LOSS, False
        if subject.contrastive is not None and subject.contrastive.whole_outputs:  # negatives=step: as cached trains
            subject = replace(subject, model=CachedStep(subject.model, subject.contrastive, inputs))
            inputs, labels, loss = {"views": inputs}, None, MODEL_LOSS
        report = check_accumulation(subject.model, inputs, labels, loss, micro_batch=subject.micro_batch,
                                    num_accum=subject.num_accum, rtol=args.rtol, seed=args.seed,
                                    modes="keep" if args.keep_modes else "train", norm_choices=overrides,
                                    precision=precision, num_items_in_batch=count)
        text = render(report, subject, args, device)
    except NonFiniteError as e:
        return NON_FINITE, render_nonfinite(e, subject, args, device)
    except (CheckError, TargetError, DataError, HydraException, OmegaConfBaseException, ValueError) as e:
        return BAD_INPUT, f"gaexp-check: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    except Exception as e:  # noqa: BLE001 - anything else the model or a library raises: one line, exit 2
        return BAD_INPUT, f"gaexp-check: error: {type(e).__name__}{where_raised(e)}: {e}".splitlines()[0]
    return status(report), text


def status(report: Report) -> int:
    """0 safe, 1 unsafe, 4 imprecise (accumulation measurably further from float64 than the big batch, under a
    precision): a structural coupling wins, since the step is then not the big batch's at any precision."""
    if not report.safe:
        return UNSAFE
    return IMPRECISE if report.precision is not None and report.precision.worse else SAFE


VERDICTS = {SAFE: "safe", UNSAFE: "unsafe", NON_FINITE: "non-finite", IMPRECISE: "imprecise"}  # --json's verdict


def _header(subject: Subject, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    n = subject.micro_batch * subject.num_accum
    data = f"random inputs of shape {','.join(map(str, subject.input_shape))}" if args.data == "random" \
        else f"{args.data}'s first {n} training images (seed {args.seed})"
    if subject.task in ("causal-lm", "masked-lm", "sequence-classification", "contrastive"):
        data = (f"{subject.task}: {n} random rows of {args.seq_len} tokens, "
                + ("all real (--pad none)" if args.pad == "none" else "padded after a quarter to all of them (--pad "
                   "varied)") + (" and images" if subject.task == "contrastive" else ""))
    elif subject.task is not None:
        data = f"{subject.task}: {n} random images"
    elif subject.contrastive is not None:
        images = n // subject.contrastive.views
        data = (f"random inputs of shape {','.join(map(str, subject.input_shape))}, {n} rows" if subject.data is None
                else f"{args.data}'s first {images} training images (seed {args.seed}), two views each: {n} rows")
    elif subject.lm is not None:
        data = (f"data={subject.data.dataset}'s first {n} training sequences (seed {args.seed}), up to "
                f"{subject.input_shape[-1] - 1} predicted tokens each")
    return {"target": subject.name, "data": data, "device": str(device), "seed": args.seed}


def render(report: Report, subject: Subject, args: argparse.Namespace, device: torch.device) -> str:
    head = _header(subject, args, device)
    if args.json:
        return json.dumps(_finite({**head, "verdict": VERDICTS[status(report)], "replicas": subject.replicas,
                                   **report.to_dict()}), indent=1, allow_nan=False)
    return f"gaexp-check {subject.name}: {head['data']}, {device}, seed {args.seed}\n{replicas_reading(subject)}{report}"


def replicas_reading(subject: Subject) -> str:
    """For --replicas w > 1, the line saying how the verdict reads for data parallelism (docs/check.md, "For data
    parallelism"); nothing for one replica."""
    w, b = subject.replicas, subject.micro_batch
    if w == 1:
        return ""
    return (f"data parallelism: {w} replicas x micro-batch {b} x {subject.num_accum // w} steps each, norms per "
            f"replica, is accumulation at micro-batch {b} x {subject.num_accum} steps: checked below "
            f"(synchronized norms, nn.SyncBatchNorm, span the replicas' micro-batches and are not)\n")


def render_nonfinite(e: NonFiniteError, subject: Subject, args: argparse.Namespace, device: torch.device) -> str:
    """NaN or Inf in the step: one line saying where it first appeared (and no verdict on accumulation)."""
    head = _header(subject, args, device)
    if args.json:
        return json.dumps({**head, "verdict": VERDICTS[NON_FINITE], "safe": False, "micro_batch": subject.micro_batch,
                           "num_accum": subject.num_accum, "nonfinite": e.where}, indent=1)
    return (f"gaexp-check {subject.name}: {head['data']}, {device}, seed {args.seed}\n"
            f"NON-FINITE: {e.where}; the step is not safe to train, with or without accumulation")


def main(argv: Sequence[str] | None = None) -> None:
    """The console script: the current folder first on the import path, as `python -m gaexp.check` has it,
    so `gaexp-check mynets:build` and `--loss mynets:loss` find a mynets.py beside the user."""
    targets.import_from_cwd()
    status, text = run(argv)
    print(text, file=sys.stderr if status == BAD_INPUT else sys.stdout)
    sys.exit(status)


if __name__ == "__main__":
    main()
