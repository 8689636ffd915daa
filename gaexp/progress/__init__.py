"""A sweep's progress, read from the tracking store: cells by state, the work left, an ETA.

Every launcher's cells write their runs to the same store, so the launching terminal (`Live`, which the
gaexp sweeper runs around its launches) and any other shell (`gaexp-status`) see the same thing. The sweeper
records its plan as a run `sweep-<id>` (tags `gaexp.cells`, `gaexp.expected_s`, `gaexp.cells_at_once`).

Cells differ by 5x in work, so progress counts work, not cells: each cell's expected seconds on one core
(`expected_seconds`, a model of the grid measured in docs/results.md: training, evaluation and a cell's
fixed cost), plus a compilation for each graph the sweep compiles first (`graph_keys`: Inductor's
disk cache makes later cells' graphs cheap). The cells that finished correct both, each at its own scale
(`fit_rates`), so a sweep of 20-step cells, which is mostly compilation, gets the right ETA as a 3,600-step
one does.

The wing, bottom up: cost (a cell's expected seconds and graphs), account (the plan, the fit and the ETA, pure),
sweep (read from the store), live (the launching terminal), status (`gaexp-status`). `gaexp.progress` names each
module's public names.
"""

from gaexp.progress.cost import (MICRO_S, BATCH_EXPONENT, STEP_S, EVAL_IMAGE_S, DRAW_S, CELL_S, GAP_S, GRAPH_S,
                                 TRAIN_GRAPH, PRECISION_COST, expected_seconds, precision_cost, replica_work,
                                 graph_keys, graph_units, run_seconds, run_graphs)
from gaexp.progress.account import (MAX_COSTS, DONE, Cell, Plan, Snapshot, SPEED_PRIOR, NOISE, NOISE_FLOOR_S,
                                    FRESH_S, Rates, fit_rates, finish, snapshot, summary_line, shared_line, costs_tag,
                                    plan_costs)
from gaexp.progress.sweep import sweep_runs, plan_of, cell_of, cells_of, firsts, read
from gaexp.progress.live import running_lines, Live
from gaexp.progress.status import (sweeps_to_show, SWEEP_CHOICES, newest_sweep, search_lines, RESUME, sweep_stopped,
                                   status_text, main, show)

__all__ = ["MICRO_S", "BATCH_EXPONENT", "STEP_S", "EVAL_IMAGE_S", "DRAW_S", "CELL_S", "GAP_S", "GRAPH_S",
           "TRAIN_GRAPH", "PRECISION_COST", "expected_seconds", "precision_cost", "replica_work", "graph_keys",
           "graph_units", "run_seconds", "run_graphs", "MAX_COSTS", "DONE", "Cell", "Plan", "Snapshot",
           "SPEED_PRIOR", "NOISE", "NOISE_FLOOR_S", "FRESH_S", "Rates", "fit_rates", "finish", "snapshot",
           "summary_line", "shared_line", "costs_tag", "plan_costs", "sweep_runs", "plan_of", "cell_of", "cells_of", "firsts",
           "read", "running_lines", "Live", "sweeps_to_show", "SWEEP_CHOICES", "newest_sweep", "search_lines",
           "RESUME", "sweep_stopped", "status_text", "main", "show"]
