"""The study's grid as its study file declares it (conf/experiment/spec.yaml: norms, regimes, seeds) at the
schema's full protocol (train.num_iterations, train.eval_period), evaluated on MNIST's test split. The tools that
cost, generate or check the study (bench, storegen, gpucheck, progress's cost model) read it here rather than
writing the grid again: a study edited in its file is the study they cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from omegaconf import OmegaConf

from gaexp.config import CONFIG_DIR, TrainConfig, parse_regime

TEST_IMAGES = 10_000  # MNIST's test split: what a run evaluates on unless data.holdout=N holds out N images


@dataclass(frozen=True)
class Study:
    name: str
    norms: tuple[str, ...]
    regimes: tuple[str, ...]
    seeds: tuple[int, ...]
    steps: int  # optimizer steps of a cell
    eval_period: int  # an evaluation every this many steps
    valid_images: int = TEST_IMAGES

    @property
    def evaluations(self) -> int:
        return self.steps // self.eval_period

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """Each regime's (micro-batch, accumulation steps), in the file's order."""
        return {name: parse_regime(name)[:2] for name in self.regimes}

    @property
    def cells(self) -> int:
        return len(self.norms) * len(self.regimes) * len(self.seeds)


@lru_cache(maxsize=None)
def study(name: str = "spec", conf: str = CONFIG_DIR) -> Study:
    """The study conf/experiment/NAME.yaml sweeps (its sweeper's params), at its budget or the schema's."""
    node = OmegaConf.load(Path(conf) / "experiment" / f"{name}.yaml")
    params = node.hydra.sweeper.params
    train = node.get("train", {})

    def words(key: str) -> tuple[str, ...]:
        return tuple(str(params[key]).split(","))

    return Study(name, words("norm"), words("regime"), tuple(int(s) for s in words("seed")),
                 int(train.get("num_iterations", TrainConfig.num_iterations)),
                 int(train.get("eval_period", TrainConfig.eval_period)))
