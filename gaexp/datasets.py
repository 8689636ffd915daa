"""A dataset as an interface: a `data` config (conf/data/<name>.yaml, schema `DataConfig`) names how its
two splits are got, and everything downstream reads their shape and class count from here.

Four kinds (`data.kind`), each one function from the config to uint8 images [N, C, H, W] and labels:
`idx` (the MNIST family: four verified IDX files, built by gaexp/data.py from their sources),
`torchvision` (a torchvision.datasets class gaexp knows, `TORCHVISION`: its own download and MD5 check),
`folder` (an image folder, decoded once and cached: gaexp/imagefolder.py) and `custom` (a loader by
import path, `LOADER_CONTRACT`). Adding a dataset of a known kind is one conf/data/ file.

`fetch` makes a dataset's files ready (the launching process, once per command); `describe` gives its
shape and class count cheaply (every config check); `open_dataset` loads it (every cell).
"""

from __future__ import annotations

import functools
import hashlib
import json
import argparse
import logging
import sys
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence
from urllib.parse import urlparse

import numpy as np
import yaml
import torch
import torch.utils.data

from gaexp import imagefolder, targets
from gaexp.batches import Split, holdout_split
from gaexp.config import DataConfig, require
from gaexp.data import DataError, data_config, datasets, check_memory, check_num_train, ensure_data, memory_limit, raw_dir, torchvision_class


@dataclass(frozen=True)
class Meta:
    """What a dataset is, as a run records it."""

    name: str
    shape: tuple[int, int, int]  # channels, height, width
    num_classes: int
    digest: Optional[str]  # the content digest (None: an idx dataset, identified by its files' MD5s)
    source: str  # where it was read, a URI
    classes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Dataset:
    train: Split
    test: Optional[Split]  # None: a folder or loader without one (data.holdout evaluates)
    meta: Meta


class Arrays(NamedTuple):
    """A loader's result: uint8 images [N, C, H, W] and int64 labels of each split."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: Optional[torch.Tensor]
    test_labels: Optional[torch.Tensor]
    classes: tuple[str, ...]
    source: str
    digest: Optional[str] = None  # a folder's, from its files (the others' is taken from these arrays)


# --- torchvision's classes: how to ask for a split, where its arrays are --------------------------------

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


def _read_torchvision(data: DataConfig, download: bool = False) -> Arrays:
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


def _fetch_torchvision(data: DataConfig) -> None:
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
    url = urlparse(spec.url(cls))
    try:  # torchvision's urlopen has no timeout: fail fast when offline
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=5).close()
    except OSError as e:
        raise DataError(f"{looked}; torchvision downloads them from {url.geturl()}, unreachable here ({e}): "
                        "run once where it is reachable and copy the folder, or put the files there") from None
    folder.mkdir(parents=True, exist_ok=True)
    for train in (True, False):
        cls(str(folder), download=True, **spec.split(train))


# --- the other kinds ------------------------------------------------------------------------------------

def _read_idx(data: DataConfig) -> Arrays:
    cls = torchvision_class(data)
    root = str(Path(data.root).expanduser().resolve())
    try:
        train, test = cls(root, train=True, download=False), cls(root, train=False, download=False)
    except RuntimeError:  # torchvision's "Dataset not found. You can use download=True": gaexp fetches instead
        raise DataError(f"data={data.dataset}: not found under {data.root}; fetch it with "
                        f"`python -m gaexp.data --dataset {data.dataset} --root {data.root}`") from None
    return Arrays(train.data.unsqueeze(1), train.targets, test.data.unsqueeze(1), test.targets,
                  tuple(cls.classes), raw_dir(data).as_uri())


LOADER_CONTRACT = ("a callable taking data.params by keyword and returning (train, test): each a torch Dataset "
                   "of (image, label) pairs (a PIL image, or a [C, H, W] tensor: uint8, or float in [0, 1] as "
                   "ToTensor gives) or a pair (images, labels) of tensors or arrays (uint8 [N, C, H, W] or "
                   "[N, H, W]; integer labels [N]); test may be None, with data.holdout=N")


def _as_uint8(image: Any, where: str) -> torch.Tensor:
    """One image of a loader as uint8 [C, H, W]."""
    if not isinstance(image, (torch.Tensor, np.ndarray)):  # a PIL image
        array = np.asarray(image)
        image = torch.from_numpy(array.copy()).permute(2, 0, 1) if array.ndim == 3 else torch.from_numpy(array.copy())[None]
    image = torch.as_tensor(image)
    if image.dtype.is_floating_point:
        scaled = image * 255
        if image.min() < 0 or image.max() > 1 or not torch.equal(scaled.round(), scaled):
            raise DataError(f"{where}: float pixels must be k/255 in [0, 1] (as ToTensor gives); got "
                            f"values in [{image.min():g}, {image.max():g}]")
        image = scaled.round().to(torch.uint8)
    if image.dtype != torch.uint8:
        raise DataError(f"{where}: pixels of dtype {image.dtype}; valid: uint8, or float in [0, 1]")
    return image if image.dim() == 3 else image[None]


def _split_arrays(split: Any, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(split, (tuple, list)) and len(split) == 2 and not isinstance(split[0], (tuple, list)):
        images, labels = (torch.as_tensor(np.asarray(a)) if not isinstance(a, torch.Tensor) else a for a in split)
        images = images[:, None] if images.dim() == 3 else images
    elif isinstance(split, torch.utils.data.Dataset) and hasattr(split, "__len__"):
        items = [split[i] for i in range(len(split))]
        images = torch.stack([_as_uint8(x, f"{where}[{i}]") for i, (x, _) in enumerate(items)]) if items else torch.empty(0)
        labels = torch.as_tensor([int(y) for _, y in items])
    else:
        raise DataError(f"{where} is {type(split).__name__}; expected {LOADER_CONTRACT}")
    if images.dim() != 4 or images.shape[1] not in (1, 3) or images.dtype != torch.uint8 or not len(images):
        raise DataError(f"{where}: images of shape {tuple(images.shape)} and dtype {images.dtype}; valid: uint8 "
                        "[N, C, H, W] with C 1 or 3, N >= 1")
    if labels.shape != (len(images),) or labels.dtype.is_floating_point:
        raise DataError(f"{where}: labels of shape {tuple(labels.shape)} and dtype {labels.dtype} for "
                        f"{len(images)} images; valid: integers [N]")
    return images.contiguous(), labels.long()


@functools.lru_cache(maxsize=4)
def _load_custom(target: str, params_json: str) -> Arrays:
    """The loader's splits, once per process (the config checks of a sweep's cells each ask)."""
    params = json.loads(params_json)
    make = targets.load(target, "data.target", tuple(params))
    try:
        result = make(**params)
    except Exception as e:  # noqa: BLE001 - the user's loader, said in one line
        raise DataError(f"data.target={target!r}: calling it with {params or 'no arguments'} raised "
                        f"{type(e).__name__}: {e}") from None
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise DataError(f"data.target={target!r} returned {type(result).__name__}; expected {LOADER_CONTRACT}")
    train = _split_arrays(result[0], f"data.target={target!r}: its train split")
    test = _split_arrays(result[1], f"data.target={target!r}: its test split") if result[1] is not None else (None, None)
    classes = getattr(result[0], "classes", None)
    return Arrays(*train, *test, tuple(classes) if classes else (), f"python:{target}")


def _read_custom(data: DataConfig) -> Arrays:
    return _load_custom(data.target, json.dumps(data.params, sort_keys=True, default=str))


def _read_folder(data: DataConfig, progress: Optional[bool] = None) -> Arrays:
    folder = imagefolder.load(Path(data.path), data.channels, data.size, cache_dir(data), progress,
                              memory_limit(data.max_memory_mb), data.dataset)
    test = folder.test if folder.test is not None else (None, None)
    return Arrays(*folder.train, *test, folder.classes, Path(data.path).expanduser().resolve().as_uri(),
                  folder.digest)


def cache_dir(data: DataConfig) -> Path:
    return Path(data.root).expanduser().resolve() / "cache"


# --- the interface -------------------------------------------------------------------------------------

def fetch(data: DataConfig) -> None:
    """Make the dataset's files ready, once per command, before any cell: idx files built from their sources and
    verified, a torchvision class's download (a folder is decoded into its cache by its first `open_dataset`).
    Errors are one line."""
    if data.kind == "idx":
        ensure_data(data)
        check_num_train(data)
    elif data.kind == "torchvision":
        _fetch_torchvision(data)


def describe(data: DataConfig) -> tuple[tuple[int, int, int], int]:
    """(channels, height, width) and class count, cheaply: as the file declares them (idx, torchvision), from the
    folder's listing, or from the loader's splits."""
    if data.kind in ("idx", "torchvision"):
        if data.shape is None or data.num_classes is None:
            raise DataError(f"data={data.dataset}: data.kind={data.kind} declares data.shape and data.num_classes "
                            "in its file (conf/data/)")
        return tuple(data.shape), data.num_classes
    if data.kind == "folder":
        shape, classes = imagefolder.describe(Path(data.path), data.channels, data.size)
        return shape, _class_count(data, classes)
    arrays = _read_custom(data)
    return tuple(arrays.train_images.shape[1:]), _class_count(data, _labels_range(arrays))


def _labels_range(arrays: Arrays) -> int:
    return len(arrays.classes) or int(max(a.max() for a in (arrays.train_labels, arrays.test_labels)
                                          if a is not None)) + 1


def _class_count(data: DataConfig, found: int) -> int:
    if data.num_classes is not None and data.kind != "custom":
        require("data.num_classes", data.num_classes, data.num_classes == found,
                f"{found} (the classes of data={data.dataset})")
    return data.num_classes or found


def content_digest(*tensors: Optional[torch.Tensor]) -> str:
    """32 hex characters: sha256 of each tensor's shape, dtype and bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        h.update(memoryview(t.contiguous().numpy()).cast("B"))
    return h.hexdigest()[:32]


def open_dataset(data: DataConfig, progress: Optional[bool] = None) -> Dataset:
    """The dataset's two splits on the CPU, checked: its shape and classes as declared, labels in range, test
    like train, within the memory limit, the digest as given (data.digest); the test split is None for a
    folder or loader without one."""
    read = {"idx": _read_idx, "torchvision": _read_torchvision, "custom": _read_custom,
            "folder": functools.partial(_read_folder, progress=progress)}[data.kind]
    arrays = read(data)
    shape = tuple(arrays.train_images.shape[1:])
    where = f"data={data.dataset}"
    if arrays.test_images is not None and tuple(arrays.test_images.shape[1:]) != shape:
        raise DataError(f"{where}: test images of shape {tuple(arrays.test_images.shape[1:])}, train images of "
                        f"{shape}; valid: one shape")
    if data.shape is not None:
        require("data.shape", list(data.shape), list(data.shape) == list(shape), f"{list(shape)} (the images of {where})")
    count = len(arrays.train_images) + (len(arrays.test_images) if arrays.test_images is not None else 0)
    check_memory(data.dataset, count, shape, memory_limit(data.max_memory_mb))
    num_classes = data.num_classes or _labels_range(arrays)
    for split, labels in (("train", arrays.train_labels), ("test", arrays.test_labels)):
        if labels is not None and len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
            raise DataError(f"{where}: {split} labels in [{int(labels.min())}, {int(labels.max())}]; valid: "
                            f"0 .. {num_classes - 1} ({num_classes} classes"
                            + (", data.num_classes)" if data.num_classes else ")"))
    if data.holdout >= len(arrays.train_labels):
        require("data.holdout", data.holdout, False, f"an integer in [0, {len(arrays.train_labels)})")
    digest = None if data.kind == "idx" else arrays.digest or content_digest(
        arrays.train_images, arrays.train_labels, arrays.test_images, arrays.test_labels)
    if data.digest is not None and data.digest != digest:
        raise DataError(f"data.digest={data.digest!r}; the data of {where} has digest {digest!r} (the data changed, "
                        "or another was given: leave data.digest null to take it)")
    mean, std = (None, None) if data.mean is None else (_per_channel(data.mean, shape[0], "mean"),
                                                        _per_channel(data.std, shape[0], "std"))
    train = Split(arrays.train_images, arrays.train_labels, mean, std, data.augment)
    test = None if arrays.test_images is None else Split(arrays.test_images, arrays.test_labels, mean, std)
    return Dataset(train, test, Meta(data.dataset, shape, num_classes, digest, arrays.source, arrays.classes))


def _per_channel(values: Sequence[float], channels: int, name: str) -> tuple[float, ...]:
    require(f"data.{name}", list(values), len(values) in (1, channels),
            f"1 or {channels} numbers (the images have {channels} channel{'s' * (channels > 1)})")
    return tuple(values) * (channels // len(values))


def splits(dataset: Dataset, holdout: int, device: torch.device | str = "cpu") -> tuple[Split, Split]:
    """(trained on, evaluated) on `device`: the test split, or `holdout` images held out of training."""
    if dataset.test is None and not holdout:
        raise DataError(f"data={dataset.meta.name} has no test split; valid: data.holdout=N, N of its "
                        f"{len(dataset.train):,} training images held out to evaluate")
    train = replace(dataset.train, images=dataset.train.images.to(device), labels=dataset.train.labels.to(device))
    if holdout:
        return holdout_split(train, holdout)
    test = dataset.test
    return train, replace(test, images=test.images.to(device), labels=test.labels.to(device))


def main(argv: Sequence[str] | None = None) -> None:
    """python -m gaexp.data: fetch a dataset (files, download, or a folder's cache) and print what it holds."""
    parser = argparse.ArgumentParser(prog="python -m gaexp.data",
                                     description="Find, build or download a dataset under a data root, and check it.")
    parser.add_argument("--dataset", default="mnist", help=f"one of {', '.join(datasets())} (default: %(default)s)")
    parser.add_argument("--root", default="outputs/data", help="data root (default: %(default)s)")
    parser.add_argument("--sources", default=None,
                        help="comma-separated, tried in order (default: the dataset's, conf/data/DATASET.yaml)")
    parser.add_argument("keys", nargs="*", metavar="data.KEY=VALUE",
                        help="the dataset's other keys, e.g. data.path=/data/pets data.size=[64,64]")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        keys = {}
        for item in args.keys:
            name, sep, value = item.partition("=")
            if not sep or not name.startswith("data."):
                raise DataError(f"{item!r}; valid: data.KEY=VALUE, e.g. data.path=/data/pets")
            keys[name.removeprefix("data.")] = yaml.safe_load(value)
        data = data_config(args.dataset, args.root, args.sources.split(",") if args.sources else None, **keys)
        fetch(data)
        d = open_dataset(data, progress=True)
    except (DataError, ValueError) as e:
        sys.exit(f"error: {e}")
    test = f" + {len(d.test):,} test" if d.test is not None else ""
    print(f"{d.meta.name}: {len(d.train):,} training{test} images of {'x'.join(map(str, d.meta.shape))}, "
          f"{d.meta.num_classes} classes, from {d.meta.source}" + (f", digest {d.meta.digest}" if d.meta.digest else ""))
