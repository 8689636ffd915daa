"""`hydra/sweeper=gaexp_optuna`: Optuna searches, Hydra's launcher runs the trials (the work is in _impl.py and
the private modules beside it).

Hydra's plugin scan imports this module in every Hydra application of the environment, so it imports
only Hydra: Optuna, and whatever the application imports, load when a sweep starts.
"""

from typing import Any, List, Optional

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from hydra_plugins.gaexp_optuna_sweeper.config import SweeperError


class OptunaSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:
        from hydra_plugins.gaexp_optuna_sweeper import _impl

        try:
            self.sweeper: Optional[_impl.OptunaSweeperImpl] = _impl.OptunaSweeperImpl(**settings)
        except SweeperError as e:  # bad settings: one line, before any trial
            raise SystemExit(f"error: {e}") from None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> None:
        try:
            self.sweeper.sweep(arguments)
        except SweeperError as e:
            raise SystemExit(f"error: {e}") from None
