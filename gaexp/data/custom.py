"""A dataset from the user's loader (`data.kind=custom`): a callable by import path (data.target) called with
data.params, its splits checked against `LOADER_CONTRACT` and converted to uint8 arrays, once per process."""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np
import torch
import torch.utils.data

from gaexp import targets
from gaexp.config import DataConfig
from gaexp.data.catalog import Arrays, DataError


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


def read(data: DataConfig) -> Arrays:
    return _load_custom(data.target, json.dumps(data.params, sort_keys=True, default=str))
