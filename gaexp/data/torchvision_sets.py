"""Datasets read by a torchvision.datasets class gaexp knows (`data.kind=torchvision`: CIFAR-10/100, SVHN): how to
ask its class for a split, where its arrays are, its own download and MD5 check; and the one probe of a download's
host, which the IDX files' torchvision source uses too (torchvision's urlopen has no timeout)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Callable, NamedTuple
from urllib.parse import urlparse

import numpy as np
import torch

from gaexp.config import DataConfig
from gaexp.data.catalog import Arrays, DataError


def unreachable(url: str) -> OSError | None:
    """None when the URL's host accepts a connection within 5 s; else the error that says why not."""
    parsed = urlparse(url)
    try:
        socket.create_connection((parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)),
                                 timeout=5).close()
    except OSError as e:
        return e
    return None


class TorchvisionSpec(NamedTuple):
    split: Callable[[bool], dict]  # train? -> the class's keyword arguments
    channels_last: bool  # its `.data` is [N, H, W, C] (else [N, C, H, W])
    labels: str  # the attribute holding the labels
    files: Callable[[type], list[str]]  # the files it looks for, relative to its root
    url: Callable[[type], str]  # what it downloads first


def _cifar_files(cls: type) -> list[str]:
    return [f"{cls.base_folder}/{name}" for name, _ in [*cls.train_list, *cls.test_list, [cls.meta["filename"], 0]]]

_CIFAR = TorchvisionSpec(lambda train: {"train": train}, True, "targets", _cifar_files, lambda cls: cls.url)
TORCHVISION = {
    "CIFAR10": _CIFAR,
    "CIFAR100": _CIFAR,
    "SVHN": TorchvisionSpec(lambda train: {"split": "train" if train else "test"}, False, "labels",
                            lambda cls: [cls.split_list[s][1] for s in ("train", "test")],
                            lambda cls: cls.split_list["train"][0]),
}


def torchvision_spec(data: DataConfig) -> tuple[type, TorchvisionSpec]:
    import torchvision.datasets

    if data.torchvision not in TORCHVISION:
        raise DataError(f"data.torchvision={data.torchvision!r}; valid for data.kind=torchvision: "
                        f"{', '.join(sorted(TORCHVISION))} (the MNIST family is data.kind=idx)")
    return getattr(torchvision.datasets, data.torchvision), TORCHVISION[data.torchvision]


def torchvision_folder(data: DataConfig) -> Path:
    return Path(data.root).expanduser().resolve() / data.torchvision


def read(data: DataConfig, download: bool = False) -> Arrays:
    cls, spec = torchvision_spec(data)
    folder = torchvision_folder(data)
    parts = []
    for train in (True, False):
        try:
            ds = cls(str(folder), download=download, **spec.split(train))
        except RuntimeError:  # torchvision's "Dataset not found or corrupted. You can use download=True"
            raise DataError(f"data={data.dataset}: no {data.torchvision} files in {folder} (or not the ones its MD5s "
                            f"say); fetch them with `python -m gaexp.data --dataset {data.dataset} --root {data.root}`"
                            ) from None
        images = torch.from_numpy(np.ascontiguousarray(ds.data))
        images = images.permute(0, 3, 1, 2).contiguous() if spec.channels_last else images
        parts += [images, torch.as_tensor(np.asarray(getattr(ds, spec.labels)), dtype=torch.long)]
    classes = tuple(getattr(ds, "classes", None) or (str(i) for i in range(int(parts[1].max()) + 1)))
    return Arrays(*parts, classes, folder.as_uri())


def fetch(data: DataConfig) -> None:
    cls, spec = torchvision_spec(data)
    folder = torchvision_folder(data)
    try:
        cls(str(folder), download=False, **spec.split(True))
        cls(str(folder), download=False, **spec.split(False))
        return
    except RuntimeError:  # torchvision: "Dataset not found or corrupted"
        pass
    looked = f"data={data.dataset}: no {data.torchvision} files in {folder} (looked for {', '.join(spec.files(cls))})"
    if "torchvision" not in data.sources:
        raise DataError(f"{looked}; put them there, or add the download: data.sources=[local,torchvision]")
    problem = unreachable(spec.url(cls))
    if problem is not None:
        raise DataError(f"{looked}; torchvision downloads them from {spec.url(cls)}, unreachable here ({problem}): "
                        "run once where it is reachable and copy the folder, or put the files there")
    folder.mkdir(parents=True, exist_ok=True)
    for train in (True, False):
        cls(str(folder), download=True, **spec.split(train))
