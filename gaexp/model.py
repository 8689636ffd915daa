"""The networks a cell can train (conf/model/), and how a model is loaded from its import path and checked.

A model is any callable `build(norm_layer, in_channels, num_classes) -> nn.Module`, where `norm_layer(channels)`
returns the normalization layer the cell studies (gaexp/norms.py); conf/model/<name>.yaml names it with
`target: module:callable`. The study's CNN (`simple`) and a CIFAR-style ResNet-20 (`resnet20`) are the two
gaexp ships; a user's own model is `model=custom model.target=mypkg.nets:build` (docs/configuration.md, "Your own model").
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gaexp import norms, precision, targets
from gaexp.task.build import make as make_task
from gaexp.config import Config
from gaexp.data.batches import Split
from gaexp.data.dataset import Dataset, splits
from gaexp.targets import TargetError

NormLayer = Callable[[int], nn.Module]
ARGUMENTS = ("norm_layer", "in_channels", "num_classes")  # what gaexp passes every model builder, by keyword


class SimpleModel(nn.Module):
    """The study's CNN (docs/study.md): four 3x3 convolutions of 32, 64, 128 and 256 channels, each followed
    by the norm and a ReLU, max-pooling between them (28 -> 14 -> 7 -> 3), global average pooling, a linear
    classifier."""

    CHANNELS = (32, 64, 128, 256)

    def __init__(self, norm_layer: NormLayer, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = in_channels
        for i, c_out in enumerate(self.CHANNELS):
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1), norm_layer(c_out), nn.ReLU(inplace=True)]
            if i < len(self.CHANNELS) - 1:
                layers.append(nn.MaxPool2d(2))
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean(dim=(2, 3)))


class ZeroPadShortcut(nn.Module):
    """He et al.'s parameter-free shortcut (option A) where a stage halves the size and doubles the channels:
    every other pixel, the new channels zero."""

    def __init__(self, extra_channels: int) -> None:
        super().__init__()
        self.extra = extra_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = self.extra // 2
        return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, half, self.extra - half))


class ResNet20(nn.Module):
    """ResNet-20 for small images (He et al. 2016, section 4.2): a 3x3 convolution of 16 channels, three
    stages of three torchvision BasicBlocks (16, 32, 64 channels; the second and third halve the size,
    28 -> 14 -> 7, so no stage reaches 1x1), global average pooling, a linear classifier. A norm follows
    every convolution: 19 norm layers, the shortcuts being the paper's parameter-free option A."""

    STAGES = (16, 32, 64)
    BLOCKS = 3

    def __init__(self, norm_layer: NormLayer, in_channels: int = 1, num_classes: int = 10) -> None:
        # Imported here: torchvision's import takes its models, ops and torch._dynamo, which a cell of another
        # model never needs (gaexp/data/idx.py names MNIST's classes without it for the same reason).
        from torchvision.models.resnet import BasicBlock

        super().__init__()
        width = self.STAGES[0]
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False), norm_layer(width),
                                  nn.ReLU(inplace=True))
        blocks: list[nn.Module] = []
        for i, planes in enumerate(self.STAGES):
            for j in range(self.BLOCKS):
                stride = 2 if i > 0 and j == 0 else 1
                shortcut = ZeroPadShortcut(planes - width) if stride == 2 else None
                blocks.append(BasicBlock(width, planes, stride, shortcut, norm_layer=norm_layer))
                width = planes
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(width, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean(dim=(2, 3)))


# --- loading a model by its import path, and checking it ----------------------------------------------

def load(target: str) -> Callable[..., nn.Module]:
    """The model builder at `target` (module:callable), refused in one line if it is not there or does not
    take gaexp's keyword arguments (`ARGUMENTS`)."""
    return targets.load(target, "model.target", ARGUMENTS)


def call_builder(make: Callable[..., nn.Module], target: str, placeholders: bool = False,
                 **arguments: object) -> nn.Module:
    """`make(**arguments)`, whatever the user's builder raises refused in one line naming model.target and the
    file and line it arose at (`targets.raised`); `placeholders`: the norm layers are norm_channels' stand-ins."""
    try:
        return make(**arguments)
    except Exception as e:  # noqa: BLE001 - the user's builder, said in one line
        how = " with placeholder norm layers (nn.Identity, counting their channels)" if placeholders else ""
        raise TargetError(f"model.target={target!r}: building the model{how} raised {targets.raised(e, target)}") \
            from None


def norm_channels(make: Callable[..., nn.Module], in_channels: int, num_classes: int, target: str = "") -> list[int]:
    """The channel count of every norm layer the model asks for, from a build with placeholder layers
    (the global RNG is left as it was); `target`: the import path `make` came from, for its error."""
    channels: list[int] = []

    def record(c: int) -> nn.Module:
        channels.append(c)
        return nn.Identity()

    with torch.random.fork_rng(devices=[]):
        call_builder(make, target or getattr(make, "__qualname__", repr(make)), placeholders=True,
                     norm_layer=record, in_channels=in_channels, num_classes=num_classes)
    return channels


def check_output(model: nn.Module, target: str, probe: tuple[torch.Tensor, torch.Tensor, tuple[int, ...]],
                 data: str = "the data") -> None:
    """A batch of blank samples of the data's shape (a task's `probe`: its inputs, and the output shape it expects,
    for images (2, num_classes) logits) must give that output (evaluation mode, no gradient)."""
    inputs, _, expected = probe
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = model(inputs)
    except Exception as e:  # noqa: BLE001 - whatever the user's forward raises, said in one line
        raise TargetError(f"model.target={target!r}: its forward fails on a batch of shape "
                         f"{tuple(inputs.shape)} ({data}): {type(e).__name__}: {e}") from None
    finally:
        model.train(was_training)
    got = tuple(getattr(out, "shape", ()))
    if got != expected:
        what = "logits" if len(expected) == 2 else "next-token logits"
        what_in = "images" if len(expected) == 2 else "samples"
        raise TargetError(f"model.target={target!r}: a batch of {len(inputs)} {what_in} gave output of shape "
                         f"{got or type(out)}; expected {expected} {what} ({data} has {expected[-1]} classes)")


# --- the model of a cell's config ---------------------------------------------------------------------

def check_model(c: Config, shape: tuple[int, int, int], num_classes: int) -> torch.nn.Module:
    """The model loads from its import path with gaexp's arguments, the norm's options fit its channels
    (norm.groups), and a batch of the data's `shape` gives one logit per class; returns the model so checked
    (for further checks), the global RNG left as it was."""
    make = load(c.model.target)
    channels = norm_channels(make, shape[0], make_task(c.task).width(num_classes), c.model.target)
    norms.require_channels(c.norm.options(), channels, c.model.name)
    norms.require_layer(c.norm, channels)
    with torch.random.fork_rng(devices=[]):
        model = make_model(c, shape[0], num_classes, make)
    check_output(model, c.model.target, make_task(c.task).probe(shape, num_classes), f"data={c.data.dataset}")
    return model


def make_model(c: Config, in_channels: int, num_classes: int,
               make: Callable[..., torch.nn.Module] | None = None) -> torch.nn.Module:
    """The cell's model for images of `in_channels` and `num_classes` classes (the dataset's), initialized from
    the global RNG (`build` seeds it); `make`: the builder, if already loaded from model.target. The task makes
    the module trained of the network (a contrastive task: the network, its output the representation, and a
    projection head)."""
    task = make_task(c.task)
    return task.model(call_builder(make or load(c.model.target), c.model.target, norm_layer=norms.norm_layer(c.norm),
                                   in_channels=in_channels, num_classes=task.width(num_classes)))


def build(c: Config, dataset: Dataset, device: torch.device) -> tuple[torch.nn.Module, Split, Split]:
    """The data on `device` (validation: the test set, or images held out of training), and the model for its
    shape and classes, initialized from the seed; both in the weights' dtype (precision.weights)."""
    train_data, valid_data = splits(dataset, c.data.holdout, device)
    train_data = make_task(c.task).training_split(train_data)  # a contrastive task's: two views of each image
    torch.manual_seed(c.seed)  # model initialization; the data order has its own generator
    model = make_model(c, dataset.meta.shape[0], dataset.meta.num_classes)
    dtype = precision.DTYPES[c.precision.weights]
    if dtype != torch.float32:  # initialized in float32 as any run, then rounded: the same draws for every precision
        model, train_data, valid_data = (model.to(dtype), dataclasses.replace(train_data, dtype=dtype),
                                         dataclasses.replace(valid_data, dtype=dtype))
    return model.to(device, memory_format=torch.channels_last), train_data, valid_data
