"""A folder of images as a dataset (`data.kind=folder`): torchvision ImageFolder's layout, decoded once.

The folder holds one subfolder per class (the sorted names give the labels 0, 1, ...), or a `train/` and
a `val/` (or `valid/`, `validation/`, `test/`) folder of them. Every file below a class folder is an
image (hidden files aside); each is converted to the configured channels and resized to the configured
size, and the uint8 arrays are cached under the data root, keyed by the folder's content digest (every
file's path and bytes) and the decoding, so later cells start without decoding and an edited folder
is decoded again, never served stale.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
from tqdm import tqdm

from gaexp.config import DataConfig
from gaexp.data.catalog import Arrays, DataError
from gaexp.data.limits import check_memory, memory_limit

TRAIN = "train"
VALIDATION = ("val", "valid", "validation", "test")  # the evaluation folder's names, the first found
DECODING = "pil-bilinear-1"  # part of the cache key: a change to how images are decoded never reuses a cache


class Folder(NamedTuple):
    train: tuple[torch.Tensor, torch.Tensor]  # uint8 images [N, C, H, W], int64 labels
    test: Optional[tuple[torch.Tensor, torch.Tensor]]
    classes: tuple[str, ...]
    digest: str


def _visible(path: Path) -> bool:
    return not path.name.startswith(".")


def layout(path: Path) -> tuple[Path, Optional[Path]]:
    """(the training folder, the evaluation folder or None)."""
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise DataError(f"data.path={str(path)!r} is not a folder; valid: a folder of class subfolders, or of "
                        f"{TRAIN}/ and {VALIDATION[0]}/ folders of them")
    if (path / TRAIN).is_dir():
        return path / TRAIN, next((path / v for v in VALIDATION if (path / v).is_dir()), None)
    return path, None


def class_files(folder: Path) -> dict[str, list[Path]]:
    """Class name -> its files, sorted; refused in one line without class folders or with an empty one."""
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir() and _visible(d))
    if not classes:
        files = sorted(f.name for f in folder.iterdir() if _visible(f))[:3]
        raise DataError(f"{folder} has no class subfolders (it holds {', '.join(files) or 'nothing'}); valid: "
                        f"one subfolder per class, or {TRAIN}/ and {VALIDATION[0]}/ folders of them")
    found = {}
    for name in classes:
        files = sorted(f for f in (folder / name).rglob("*")
                       if f.is_file() and not any(p.startswith(".") for p in f.relative_to(folder).parts))
        if not files:
            raise DataError(f"class folder {folder / name} is empty; valid: at least one image per class")
        found[name] = files
    return found


def _splits(path: Path) -> tuple[dict[str, list[Path]], Optional[dict[str, list[Path]]]]:
    train_dir, test_dir = layout(path)
    train = class_files(train_dir)
    test = class_files(test_dir) if test_dir is not None else None
    if test is not None and list(test) != list(train):
        raise DataError(f"{test_dir} has classes {list(test)}, {train_dir} has {list(train)}; valid: the same "
                        "class folders in both")
    return train, test


def _channels(channels: Optional[int]) -> int:
    if channels not in (1, 3):
        raise DataError(f"data.channels={channels!r}; valid for an image folder: 1 (grey) or 3 (RGB)")
    return channels


def _open(file: Path):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(file)
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise DataError(f"{file} is not an image ({type(e).__name__}: {e}); valid: image files only below "
                        "the class folders (hidden files are skipped)") from None
    return image


def describe(path: Path, channels: Optional[int], size: Optional[Sequence[int]]) -> tuple[tuple[int, int, int], int]:
    """(channels, height, width) and the class count, from the listing (and the first image, without a size)."""
    train, _ = _splits(path)
    if size is None:
        width, height = _open(next(iter(train.values()))[0]).size
        size = (height, width)
    return (_channels(channels), int(size[0]), int(size[1])), len(train)


def folder_digest(path: Path) -> str:
    """32 hex characters: sha256 over every image's path (relative to the folder) and bytes, in sorted order."""
    path = Path(path).expanduser().resolve()
    train, test = _splits(path)
    h = hashlib.sha256()
    for split in (train, test or {}):
        for files in split.values():
            for file in files:
                h.update(str(file.relative_to(path)).encode() + b"\0")
                h.update(hashlib.sha256(file.read_bytes()).digest())
    return h.hexdigest()[:32]


def _decode(split: dict[str, list[Path]], channels: int, size: Optional[Sequence[int]],
            bar: tqdm) -> tuple[torch.Tensor, torch.Tensor]:
    from PIL import Image

    files = [(label, f) for label, name in enumerate(split) for f in split[name]]
    images: Optional[np.ndarray] = None
    first = None
    for i, (_, file) in enumerate(files):
        image = _open(file).convert("RGB" if channels == 3 else "L")
        if size is not None:
            image = image.resize((int(size[1]), int(size[0])), Image.BILINEAR)
        elif first is None:
            first = (file, image.size)
        elif image.size != first[1]:
            raise DataError(f"images of different sizes: {first[0]} is {first[1][0]}x{first[1][1]}, {file} is "
                            f"{image.size[0]}x{image.size[1]} (width x height); valid: one size, or set "
                            "data.size=[height,width] to resize them all")
        array = np.asarray(image)
        array = array.transpose(2, 0, 1) if array.ndim == 3 else array[None]
        if images is None:
            images = np.empty((len(files), *array.shape), dtype=np.uint8)
        images[i] = array
        bar.update()
    return torch.from_numpy(images), torch.tensor([label for label, _ in files], dtype=torch.long)


def load(path: Path, channels: Optional[int], size: Optional[Sequence[int]], cache: Path,
         progress: Optional[bool] = None, limit: Optional[int] = None, name: str = "imagefolder") -> Folder:
    """The folder's images decoded (from the cache when the folder and the decoding are unchanged), refused
    before decoding if they would take more than `limit` bytes. `progress`: a bar while decoding (None: on a
    terminal)."""
    channels = _channels(channels)
    train, test = _splits(path)
    digest = folder_digest(path)
    key = hashlib.sha256(f"{digest}:{channels}:{list(size) if size else None}:{DECODING}".encode()).hexdigest()[:24]
    cached = cache / f"folder-{key}.pt"
    if cached.is_file():
        kept = torch.load(cached, weights_only=True)
        test_part = (kept["test_images"], kept["test_labels"]) if "test_images" in kept else None
        return Folder((kept["train_images"], kept["train_labels"]), test_part, tuple(kept["classes"]), digest)
    count = sum(map(len, train.values())) + sum(map(len, (test or {}).values()))
    if limit is not None:
        check_memory(name, count, describe(path, channels, size)[0], limit)
    with tqdm(total=count, desc=f"decoding {Path(path).name}", unit="img", disable=None if progress is None
              else not progress, leave=False) as bar:
        parts = {"train": _decode(train, channels, size, bar)}
        if test is not None:
            parts["test"] = _decode(test, channels, size, bar)
    if test is not None and parts["test"][0].shape[1:] != parts["train"][0].shape[1:]:
        raise DataError(f"the images of {layout(path)[1]} are {tuple(parts['test'][0].shape[2:])}, those of "
                        f"{layout(path)[0]} {tuple(parts['train'][0].shape[2:])}; valid: one size, or set "
                        "data.size=[height,width]")
    saved = {"train_images": parts["train"][0], "train_labels": parts["train"][1], "classes": list(train)}
    if test is not None:
        saved.update(test_images=parts["test"][0], test_labels=parts["test"][1])
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{cached.name}.")
    os.close(fd)
    try:
        torch.save(saved, tmp)
        os.replace(tmp, cached)  # whole or not at all: cells started together never read half a cache
    finally:
        Path(tmp).unlink(missing_ok=True)
    return Folder(parts["train"], parts.get("test"), tuple(train), digest)


def cache_dir(data: DataConfig) -> Path:
    return Path(data.root).expanduser().resolve() / "cache"


def read(data: DataConfig, progress: Optional[bool] = None) -> Arrays:
    folder = load(Path(data.path), data.channels, data.size, cache_dir(data), progress,
                              memory_limit(data.max_memory_mb), data.dataset)
    test = folder.test if folder.test is not None else (None, None)
    return Arrays(*folder.train, *test, folder.classes, Path(data.path).expanduser().resolve().as_uri(),
                  folder.digest)
