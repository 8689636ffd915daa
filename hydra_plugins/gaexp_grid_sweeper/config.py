"""The grid sweeper's settings, registered as `hydra/sweeper=gaexp_grid` (the basic sweeper's, and two more)."""

from dataclasses import dataclass
from typing import Dict, Optional

from hydra.core.config_store import ConfigStore

ORDERS = ("longest_first", "given")


@dataclass
class GaexpGridSweeperConf:
    _target_: str = "hydra_plugins.gaexp_grid_sweeper.sweeper.GridSweeper"
    max_batch_size: Optional[int] = None  # cells per launch (null: all at once, for the launcher to pace)
    params: Optional[Dict[str, str]] = None  # swept keys, as on the command line: {norm: "bn,in"}
    order: str = "longest_first"  # longest_first: by expected work (gaexp/progress/); given: the product's order
    progress: Optional[bool] = None  # null: a bar on a terminal, a line per ended cell otherwise; false: neither
    poll_s: float = 10.0  # how often the progress reads the tracking store (a read costs ~60 ms of CPU on SQLite)


ConfigStore.instance().store(group="hydra/sweeper", name="gaexp_grid", node=GaexpGridSweeperConf, provider="gaexp")
