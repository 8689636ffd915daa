"""Plot: the learning curves (one panel per norm, one colour per regime, mean over seeds with its min-max band), as PNG
and PDF; matplotlib without a display.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from gaexp.analysis.columns import Collected, TRAIN_LOSS, VALID_ACC, as_rows, headline, in_order, norm_order
from gaexp.analysis.stats import Summary
from gaexp.config import ADDED_DEFAULTS, AnalysisConfig
from gaexp.tags import DATASET, MODEL, NORM, REGIME, SEED

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def pyplot():
    """matplotlib's pyplot without a display (figures are files), imported when a figure is drawn: about a second
    that a report without figures (analysis.plots=false, --no-plots) does not pay."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(n_panels: int, max_cols: int = 3):
    ncols = min(n_panels, max_cols)
    nrows = -(-n_panels // ncols)
    fig, axes = pyplot().subplots(nrows, ncols, figsize=(4.2 * ncols + 1.4, 3.4 * nrows + 0.4), sharex=True, sharey=True,
                             squeeze=False, constrained_layout=True)
    for ax in axes.flat[n_panels:]:
        ax.remove()
    return fig, axes.flat[:n_panels]


def plot_curves(data: pd.DataFrame, metric: str = VALID_ACC, design: AnalysisConfig | None = None) -> Figure:
    """One panel per norm, one colour per regime: mean over seeds, band from min to max; accuracy in %, as the
    tables give it, against whole optimizer steps."""
    from matplotlib.ticker import MaxNLocator

    design = design or AnalysisConfig()
    data, shown = as_rows(data, design), headline(data)
    accuracy = metric == VALID_ACC and shown.higher_is_better  # the headline's column holds a loss for a language model
    if accuracy:
        data = data.assign(**{VALID_ACC: 100 * data[VALID_ACC]})
    norms = in_order(data.norm, norm_order(design))
    regimes = in_order(data.regime, design.regime_order)
    colors = dict(zip(design.regime_order, ["#7f7f7f", "#d62728", "#ff7f0e", "#1f77b4"]))
    fig, axes = _grid(len(norms))
    stats_ = data.groupby([NORM, REGIME, "step"])[metric].agg(["mean", "min", "max"]).reset_index()
    for ax, norm in zip(axes, norms):
        for regime in regimes:
            s = stats_[(stats_.norm == norm) & (stats_.regime == regime)]
            if s.empty:
                continue
            color = colors.get(regime)
            ax.plot(s.step, s["mean"], marker="o", ms=3, lw=1.6, color=color, label=regime)
            ax.fill_between(s.step, s["min"], s["max"], color=ax.lines[-1].get_color(), alpha=0.18, lw=0)
        ax.set_title(norm, fontsize=12)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: a short run's few never show as 2.5
    if accuracy:  # zoom on the effective-batch-16 curves; bs1a1 may start below
        focus = stats_[stats_.regime.isin(design.table_columns)]
        low = (focus if not focus.empty else stats_)["mean"].min()
        axes[0].set_ylim(max(0.0, min(low, 95) - 2), 100)
        label = "validation accuracy (%)"
    elif metric == VALID_ACC:
        label = f"{shown.phrase} ({shown.symbol})"
    else:
        low, high = stats_["min"].min(), stats_["max"].max()
        if low == high:  # flat curves: give the log axis a range around them before it is made
            axes[0].set_ylim(low / 1.5, high * 1.5)
        axes[0].set_yscale("log")
        label = "train loss (mean of last 100 steps)"
    ncols = axes[0].get_subplotspec().get_gridspec().ncols
    for i, ax in enumerate(axes):
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel(label)
        if i + ncols >= len(axes):  # no panel below this one: label its x axis
            ax.xaxis.set_tick_params(labelbottom=True)
            ax.set_xlabel("optimizer step")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", title=REGIME, frameon=False)
    seeds = data.groupby([NORM, REGIME])[SEED].nunique().max()
    shown = [*in_order(data[DATASET], []), *(m for m in in_order(data[MODEL], []) if m != ADDED_DEFAULTS["model.name"])]
    datasets = ", ".join(shown)
    fig.suptitle(f"{datasets + ': ' if datasets else ''}{label.split(' (')[0]}, mean of {seeds} seed(s), "
                 "band min–max", fontsize=11)
    return fig


def export_plots(collected: Collected, summary: Summary, out: Path) -> list[Path]:
    """The learning curves of valid_acc and train_loss, PNG and PDF (seconds: the report's slow part)."""
    written = []
    for metric, stem in ((VALID_ACC, "curves"), (TRAIN_LOSS, TRAIN_LOSS)):  # files named curves and after the metric
        fig = plot_curves(collected.data, metric, summary.design)
        for suffix in (".png", ".pdf"):
            fig.savefig(out / f"{stem}{suffix}", dpi=150)
            written.append(out / f"{stem}{suffix}")
        pyplot().close(fig)
    return written
