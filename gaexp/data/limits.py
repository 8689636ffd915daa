"""What holding a dataset in memory may take: gaexp holds a dataset's uint8 images whole, so one too large is
refused before any run."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from gaexp.data.catalog import DataError


def memory_limit(max_memory_mb: int | None) -> int:
    """Bytes a dataset's decoded images may take: `max_memory_mb` (data.max_memory_mb), or half of this
    machine's memory."""
    if max_memory_mb is not None:
        return max_memory_mb * 2**20
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def check_memory(name: str, count: int, shape: Sequence[int], limit: int) -> None:
    """Refuse, before any run, a dataset whose uint8 images would not fit: gaexp holds a dataset in memory."""
    need = count * int(np.prod(shape))
    if need > limit:
        raise DataError(f"data={name}: its {count:,} images of {'x'.join(map(str, shape))} take {need / 2**20:,.0f} "
                        f"MB in memory, over the limit of {limit / 2**20:,.0f} MB (data.max_memory_mb; null: half of "
                        "this machine's); gaexp holds a dataset in memory: use fewer images or a smaller data.size")
