"""A dataset as an interface: a `data` config (conf/data/<name>.yaml, schema `DataConfig`) names how its
two splits are got, and everything downstream reads their shape and class count from here.

Four kinds (`data.kind`), each one function from the config to uint8 images [N, C, H, W] and labels:
`idx` (the MNIST family: four verified IDX files, built by gaexp/data/idx.py from their sources),
`torchvision` (a torchvision.datasets class gaexp knows, `TORCHVISION`: its own download and MD5 check),
`folder` (an image folder, decoded once and cached: gaexp/data/folder.py) and `custom` (a loader by
import path, `LOADER_CONTRACT`). Adding a dataset of a known kind is one conf/data/ file.

`fetch` makes a dataset's files ready (the launching process, once per command); `describe` gives its
shape and class count cheaply (every config check); `open_dataset` loads it (every cell).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

import torch

from gaexp.config import BATCHED, Config, DataConfig, require
import gaexp.data.custom as custom
import gaexp.data.folder as folder
import gaexp.data.idx as idx
import gaexp.data.text as text
import gaexp.data.torchvision_sets as torchvision_sets
from gaexp.data.batches import Split, holdout_split
from gaexp.data.catalog import Arrays, DataError
from gaexp.data.limits import check_memory, memory_limit


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


def fetch(data: DataConfig) -> None:
    """Make the dataset's files ready, once per command, before any cell: idx files built from their sources and
    verified, a torchvision class's download (a folder is decoded into its cache by its first `open_dataset`).
    Errors are one line."""
    if data.kind == "idx":
        idx.ensure_data(data)
        idx.check_num_train(data)
    elif data.kind == "torchvision":
        torchvision_sets.fetch(data)


def describe(data: DataConfig) -> tuple[tuple[int, int, int], int]:
    """(channels, height, width) and class count, cheaply: as the file declares them (idx, torchvision), from the
    folder's listing, or from the loader's splits."""
    if data.kind in ("idx", "torchvision"):
        if data.shape is None or data.num_classes is None:
            raise DataError(f"data={data.dataset}: data.kind={data.kind} declares data.shape and data.num_classes "
                            "in its file (conf/data/)")
        return tuple(data.shape), data.num_classes
    if data.kind == "text":
        return (1, 1, data.context + 1), text.VOCAB
    if data.kind == "folder":
        shape, classes = folder.describe(Path(data.path), data.channels, data.size)
        return shape, _class_count(data, classes)
    arrays = custom.read(data)
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
    read = {"idx": idx.read, "torchvision": torchvision_sets.read, "custom": custom.read,
            "folder": functools.partial(folder.read, progress=progress), "text": text.read}[data.kind]
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
    num_classes = text.VOCAB if data.kind == "text" else data.num_classes or _labels_range(arrays)
    for split, labels in (("train", arrays.train_labels), ("test", arrays.test_labels)):
        if data.kind == "text":  # a text split's labels are its sequences' lengths (gaexp/data/text.py)
            break
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
    kind = text.TextSplit if data.kind == "text" else Split
    train = kind(arrays.train_images, arrays.train_labels, mean, std, data.augment)
    test = None if arrays.test_images is None else kind(arrays.test_images, arrays.test_labels, mean, std)
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


def training_size(data: DataConfig) -> int | None:
    """The training images left after data.holdout where the config declares their count (an idx dataset's
    num_train, checked against its files when they are read); None: known once the data is read (`prepare`
    checks `validate_split` there)."""
    return data.num_train - data.holdout if data.kind == "idx" and data.num_train is not None else None


def validate_split(c: Config, size: int, setting: str | None = None) -> None:
    """A micro-batch is at most the training split of `size` images (the data order draws each from the rest of
    one permutation of it and the next: a larger one would silently hold fewer), and so are the b*k samples
    accumulate=batched computes at once. `setting`: what the command asked, where `c` has auto's choice made
    before the split's size was known (auto takes the loop for a step beyond the split: `engine.within_split`)."""
    b, k = c.regime.batch_size, c.regime.num_accum
    items = "sequences" if c.data.kind == "text" else "images"
    split = f"the {size:,} training {items} of data={c.data.dataset}" + (
        f" left after data.holdout={c.data.holdout:,}" if c.data.holdout else "")
    require("regime.batch_size", b, b <= size, f"an integer in [1, {size}]: a micro-batch is at most {split}")
    if (setting or c.accumulate) == BATCHED:
        require("regime.batch_size*regime.num_accum", b * k, b * k <= size,
                f"at most {size}: accumulate=batched computes a step's {b} x {k} samples at once, at most {split} "
                "(accumulate=loop draws them a micro-batch at a time)")


def data_bytes(data: DataConfig, shape: tuple[int, int, int]) -> int:
    """Bytes of both splits in memory (uint8 images, int64 labels), as far as known before they are read: an idx
    dataset's from its files, its training images alone while the files are not there yet; 0 for the others
    (reading them checks them against data.max_memory_mb)."""
    if data.kind != "idx" or data.num_train is None:
        return 0
    files = [idx.raw_dir(data) / name for name in data.files or {}]
    if not files or not all(f.is_file() for f in files):
        return data.num_train * (math.prod(shape) + 8)
    return sum(f.stat().st_size * (1 if "images" in f.name else 8) for f in files)
