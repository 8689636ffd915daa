from __future__ import annotations

import itertools

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from gaexp.app import CONFIG_DIR
from gaexp.config import norm_options, regime_name
from gaexp.model import SimpleModel
from gaexp.norms import NORMS
from gaexp.train import train

NORM_CHOICES = ["bn", "in", "gn4", "gn16", "none", "gn", "ln", "in_affine", "bn_precise", "bn_microeval", "brn", "bn_kmom"]
REGIMES = {"bs1a1": (1, 1), "bs1a16": (1, 16), "bs4a4": (4, 4), "bs16a1": (16, 1)}


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_defaults_are_the_spec_protocol(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose_cfg()
    assert (cfg.norm.name, cfg.regime.batch_size, cfg.regime.num_accum, cfg.seed) == ("bn", 16, 1, 1)
    assert (cfg.train.num_iterations, cfg.train.eval_period, cfg.train.lr, cfg.train.loss_window) == (3600, 300, 1e-3, 100)
    assert (cfg.device, cfg.threads, cfg.compile) == ("auto", "auto", False)
    # every path is absolute and under outputs/ of the launch folder
    assert cfg.data.root == str(tmp_path / "outputs" / "data")
    assert cfg.mlflow.tracking_uri == f"sqlite:///{tmp_path}/outputs/mlflow.db"
    assert cfg.mlflow.artifact_location == str(tmp_path / "outputs" / "mlartifacts")


def test_config_groups_match_the_registry():
    assert sorted(NORM_CHOICES) == sorted(NORMS)


@pytest.mark.parametrize("norm,regime", list(itertools.product(NORM_CHOICES, REGIMES)))
def test_every_cell_composes_and_trains(norm, regime, train_split, small_valid):
    cfg = compose_cfg(f"norm={norm}", f"regime={regime}", "seed=2", "train.num_iterations=2", "train.eval_period=1")
    assert (cfg.regime.batch_size, cfg.regime.num_accum) == REGIMES[regime]
    assert regime_name(cfg.regime.batch_size, cfg.regime.num_accum) == regime
    torch.manual_seed(cfg.seed)
    history = train(SimpleModel(cfg.norm.name, **norm_options(cfg.norm)).to(memory_format=torch.channels_last), train_split, small_valid,
                    batch_size=cfg.regime.batch_size, num_accum=cfg.regime.num_accum,
                    num_iterations=cfg.train.num_iterations, eval_period=cfg.train.eval_period,
                    lr=cfg.train.lr, seed=cfg.seed, progress=False)
    assert [p.step for p in history] == [1, 2]
    assert all(0.0 <= p.valid_acc <= 1.0 and p.train_loss > 0 for p in history)


def test_plain_overrides_of_batch_and_accumulation():
    cfg = compose_cfg("regime.batch_size=2", "regime.num_accum=8")
    assert regime_name(cfg.regime.batch_size, cfg.regime.num_accum) == "bs2a8"


def test_unknown_norm_is_rejected_with_the_choices():
    with pytest.raises(ConfigCompositionException) as info:
        compose_cfg("norm=batchnorm")
    message = str(info.value)
    assert "batchnorm" in message and all(name in message for name in NORM_CHOICES)
