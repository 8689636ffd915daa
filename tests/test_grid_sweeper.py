"""The gaexp grid sweeper (hydra_plugins/gaexp_grid_sweeper): the order of cells and bad settings.

Its sweeps through the public command (progress lines, the plan run, the order the runs started in) are
in tests/test_app.py, on the shared tiny sweep.
"""

from __future__ import annotations

from itertools import product

import pytest
from hydra._internal.callbacks import Callbacks
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.utils import create_config_search_path
from hydra.errors import HydraException
from hydra.types import HydraContext

from gaexp.config import CONFIG_DIR
from hydra_plugins.gaexp_grid_sweeper.sweeper import GridSweeper, longest_first


def test_longest_first_sorts_by_cost_and_keeps_the_given_order_among_equals():
    cells = [["norm=bn", "regime=bs1a1"], ["norm=bn", "regime=bs1a16"], ["norm=in", "regime=bs1a1"],
             ["norm=in", "regime=bs1a16"], ["norm=bn", "regime=bs16a1"]]
    costs = [48, 186, 48, 186, 102]
    assert longest_first(cells, costs) == [cells[1], cells[3], cells[4], cells[0], cells[2]]
    assert longest_first([], []) == []


def sweeper_on(compose, *overrides: str) -> GridSweeper:
    """The gaexp grid sweeper as Hydra sets it up for `gaexp -m *overrides`, with the real config loader.
    Imported after composing: Hydra's plugin discovery re-imports the sweeper modules."""
    config = compose(*overrides, hydra=True)
    from hydra_plugins.gaexp_grid_sweeper.sweeper import GridSweeper

    sweeper = GridSweeper(max_batch_size=None)
    sweeper.config = config
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(CONFIG_DIR))
    sweeper.hydra_context = HydraContext(config_loader=loader, callbacks=Callbacks())
    return sweeper


def test_the_study_grid_in_the_order_a_launcher_gets_it(compose):
    """The 60 cells of conf/experiment/spec.yaml, costed by the sweeper's own `cost` (each cell composed as
    Hydra composes it): bs1a16 first, then bs4a4, bs16a1, bs1a1; norms and seeds in the given order."""
    sweeper = sweeper_on(compose, "+experiment=spec")
    cells = [[f"norm={n}", f"regime={r}", f"seed={s}"] for n, r, s in
             product(["bn", "in", "gn4", "gn16", "none"], ["bs1a1", "bs1a16", "bs4a4", "bs16a1"], [1, 2, 3])]
    costs = [sweeper.cost(cell) for cell in cells]
    order = [c[1].split("=")[1] for c in longest_first(cells, costs)]
    assert order == ["bs1a16"] * 15 + ["bs4a4"] * 15 + ["bs16a1"] * 15 + ["bs1a1"] * 15
    assert longest_first(cells, costs)[:3] == [["norm=bn", "regime=bs1a16", "seed=1"],
                                               ["norm=bn", "regime=bs1a16", "seed=2"],
                                               ["norm=bn", "regime=bs1a16", "seed=3"]]


def test_a_cells_cost_follows_its_own_overrides(compose):
    """Budget, evaluation period and the images evaluated (a holdout) all come from the cell's own config."""
    sweeper = sweeper_on(compose, "+experiment=spec")
    base = sweeper.cost(["regime=bs4a4"])
    assert sweeper.cost(["regime=bs4a4", "train.num_iterations=1800"]) == pytest.approx(base / 2, rel=0.01)
    assert sweeper.cost(["regime=bs4a4", "train.eval_period=150"]) > base  # twice the evaluations
    assert sweeper.cost(["regime=bs4a4", "data.holdout=2000"]) < base      # 2,000 images evaluated, not 10,000
    assert sweeper.cost(["regime=bs1a16"]) > base > sweeper.cost(["regime=bs1a1"])


@pytest.mark.parametrize("settings, message", [
    (dict(order="random"), "hydra.sweeper.order='random'; valid: longest_first, given"),
    (dict(max_batch_size=0), "hydra.sweeper.max_batch_size=0; valid: null or an integer >= 1"),
    (dict(poll_s=0), "hydra.sweeper.poll_s=0; valid: seconds > 0"),
])
def test_bad_settings_are_one_line_naming_the_value_and_the_valid_ones(settings, message):
    with pytest.raises(HydraException) as e:
        GridSweeper(**{"max_batch_size": None, **settings})
    assert str(e.value) == message
