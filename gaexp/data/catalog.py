"""The datasets gaexp knows (the files of conf/data/), a dataset's `data` config outside Hydra, the one error
of the data wing, and what a reader of any kind returns."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import torch
from omegaconf import OmegaConf

from gaexp.config import CONFIG_DIR, DataConfig


class DataError(RuntimeError):
    """A dataset could not be found, built or verified."""


def names() -> list[str]:
    """The datasets gaexp knows: the files of conf/data/."""
    return sorted(p.stem for p in (Path(CONFIG_DIR) / "data").glob("*.yaml"))


def image_names() -> list[str]:
    """The datasets of images (every kind but text): what gaexp-check's --data takes."""
    return [n for n in names() if OmegaConf.load(Path(CONFIG_DIR) / "data" / f"{n}.yaml").get("kind") != "text"]


def data_config(dataset: str, root: str | Path | None = None, sources: Sequence[str] | None = None,
                **keys: object) -> DataConfig:
    """The `data` config of conf/data/<dataset>.yaml, outside Hydra (the CLI, the benchmark, the tests);
    `root`, `sources` and any other keys given (not None: path=..., size=[32, 32]) replace the file's."""
    if dataset not in names():
        raise DataError(f"dataset {dataset!r}; valid: {', '.join(names())}")
    group_file = OmegaConf.load(Path(CONFIG_DIR) / "data" / f"{dataset}.yaml")
    node = OmegaConf.merge(OmegaConf.structured(DataConfig), group_file,
                           {"root": str(root if root is not None else "outputs/data")})
    if sources is not None:
        node.sources = list(sources)
    node = OmegaConf.merge(node, {k: v for k, v in keys.items() if v is not None})
    node.root = str(Path(node.root).expanduser().resolve())
    return OmegaConf.to_object(node)


class Arrays(NamedTuple):
    """A loader's result: uint8 images [N, C, H, W] and int64 labels of each split."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: Optional[torch.Tensor]
    test_labels: Optional[torch.Tensor]
    classes: tuple[str, ...]
    source: str
    digest: Optional[str] = None  # a folder's, from its files (the others' is taken from these arrays)
