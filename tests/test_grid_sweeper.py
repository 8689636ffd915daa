"""The gaexp grid sweeper (hydra_plugins/gaexp_grid_sweeper): the order of cells and bad settings.

Its sweeps through the public command (progress lines, the plan run, the order the runs started in) are
in tests/test_app.py, on the shared tiny sweep.
"""

from __future__ import annotations

from itertools import product

import pytest
from hydra.errors import HydraException

from gaexp import progress
from hydra_plugins.gaexp_grid_sweeper.sweeper import GridSweeper, longest_first


def test_longest_first_sorts_by_cost_and_keeps_the_given_order_among_equals():
    cells = [["norm=bn", "regime=bs1a1"], ["norm=bn", "regime=bs1a16"], ["norm=in", "regime=bs1a1"],
             ["norm=in", "regime=bs1a16"], ["norm=bn", "regime=bs16a1"]]
    costs = [48, 186, 48, 186, 102]
    assert longest_first(cells, costs) == [cells[1], cells[3], cells[4], cells[0], cells[2]]
    assert longest_first([], []) == []


def test_the_study_grid_in_the_order_a_launcher_gets_it(compose):
    """The 60 cells of conf/experiment/spec.yaml, composed and costed as the sweeper does: bs1a16 first."""
    cells = [[f"norm={n}", f"regime={r}", f"seed={s}"] for n, r, s in
             product(["bn", "in", "gn4", "gn16", "none"], ["bs1a1", "bs1a16", "bs4a4", "bs16a1"], [1, 2, 3])]
    costs = []
    for cell in cells:
        cfg = compose("+experiment=spec", *cell)
        costs.append(progress.expected_seconds(cfg.regime.batch_size, cfg.regime.num_accum, cfg.train.num_iterations,
                                               cfg.train.eval_period))
    order = [c[1].split("=")[1] for c in longest_first(cells, costs)]
    assert order == ["bs1a16"] * 15 + ["bs4a4"] * 15 + ["bs16a1"] * 15 + ["bs1a1"] * 15
    assert longest_first(cells, costs)[:3] == [["norm=bn", "regime=bs1a16", "seed=1"],
                                               ["norm=bn", "regime=bs1a16", "seed=2"],
                                               ["norm=bn", "regime=bs1a16", "seed=3"]]


@pytest.mark.parametrize("settings, message", [
    (dict(order="random"), "hydra.sweeper.order='random'; valid: longest_first, given"),
    (dict(max_batch_size=0), "hydra.sweeper.max_batch_size=0; valid: null or an integer >= 1"),
    (dict(poll_s=0), "hydra.sweeper.poll_s=0; valid: seconds > 0"),
])
def test_bad_settings_are_one_line_naming_the_value_and_the_valid_ones(settings, message):
    with pytest.raises(HydraException) as e:
        GridSweeper(**{"max_batch_size": None, **settings})
    assert str(e.value) == message
