"""Export: the summary as Markdown tables (the comparison, the ranking, memory and speed, precisions) and as CSV files.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from gaexp.analysis.columns import ACTIVATIONS, Collected, PARTS, rows_label
from gaexp.analysis.figures import export_plots
from gaexp.analysis.stats import Precisions, Summary, memory_table, verdict_text
from gaexp.config import ADDED_DEFAULTS, AnalysisConfig
from gaexp.metrics import ACCURACY, Headline
from gaexp.tags import PRECISION, REGIME


def format_precisions(p: Precisions) -> str:
    """The precisions side by side as Markdown, a precision column beside norm and regime."""
    reference, margin = ADDED_DEFAULTS[PARTS[PRECISION]], p.design.margin
    over = p.over or f"evaluations at step > {p.design.window_start}"
    lines = [f"{p.label}: precisions side by side: mean valid accuracy % over {over} and its std across seeds; the paired (same seed) difference to {reference} "
             f"at the same norm and regime, in points with its 95% t-interval, and its verdict at ±{margin:g} points",
             "", f"| norm | regime | precision | mean % | std | seeds | vs {reference} | verdict (±{margin:g}) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in p.table.itertuples():
        std = "n/a" if pd.isna(r.std) else f"{100 * r.std:.2f}"
        if getattr(r, PRECISION) == reference:
            vs, verdict = "reference", ""
        elif pd.isna(r.diff):
            vs, verdict = "–", "–"
        else:
            vs = f"{100 * r.diff:+.2f}" + ("" if pd.isna(r.ci_low) else f" [{100 * r.ci_low:+.2f}, {100 * r.ci_high:+.2f}]")
            verdict = verdict_text(r.verdict, r.seeds_needed)
        lines.append(f"| {r.norm} | {r.regime} | {getattr(r, PRECISION)} | {100 * r.mean:.2f} | {std} | {r.seeds} | "
                     f"{vs} | {verdict} |")
    if p.note:
        lines += ["", p.note]
    return "\n".join(lines) + "\n"


def export_precisions(p: Precisions, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "precisions.md", out / "precisions.csv"]
    written[0].write_text(format_precisions(p))
    p.table.to_csv(written[1], index=False)
    return written


def format_memory(memory: pd.DataFrame) -> str:
    """The memory table as Markdown: what accumulation saves, and what it costs in time."""
    header = [REGIME, *memory.columns]
    lines = ["Memory and speed per regime (means over runs; peaks are maxima)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for regime, row in memory.iterrows():
        cells = [f"{v:.0f}" if k in ("micro_batch", "effective_batch", "runs") else
                 f"{v:.3f}" if k == "activation_vs_bs16a1" else f"{v:.2f}" if k in ACTIVATIONS else f"{v:.0f}"
                 for k, v in row.items()]
        lines.append("| " + " | ".join([regime, *cells]) + " |")
    return "\n".join(lines) + "\n"


def format_table(summary: Summary) -> str:
    """The study's table as Markdown, then the fuller one, the paired differences and what is missing, in the
    headline's unit (accuracy %, or a language model's loss per token in nats)."""
    shown, rows = summary.headline, rows_label(summary.design)

    def pct(x: float) -> str:
        return "–" if pd.isna(x) else shown.show(x)

    def signed(x: float) -> str:
        return shown.show(x, signed=True)

    header = [rows, *summary.table.columns]
    over = summary.window_note or f"evaluations at step > {summary.design.window_start}"
    final = "final-step accuracy" if shown is ACCURACY else f"final-step {shown.metric.name}"
    lines = [f"{summary.label}: mean {shown.phrase} ({shown.symbol}) over {over}, pooled over seeds", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for norm, row in summary.table.iterrows():
        lines.append("| " + " | ".join([norm, *(pct(v) for v in row)]) + " |")
    s = shown.symbol
    lines += ["", f"Per cell: mean and std across seeds of each run's windowed mean, seeds, {final}", "",
              f"| {rows} | regime | " + "".join(f"{k} | " for k in summary.design.per_cell)
              + f"mean {s} | std {s} | seeds | final {s} |", "|---|---|---|---|---|---|" + "---|" * len(summary.design.per_cell)]
    for (norm, regime), c in summary.cells.iterrows():
        tuned = "".join(f"{c[k]:.3g} | " for k in summary.design.per_cell)
        lines.append(f"| {norm} | {regime} | {tuned}{pct(c['mean'])} | {pct(c['std'])} | {int(c.seeds)} | "
                     f"{pct(c.final_acc)} |")
    if not summary.paired.empty:
        design = summary.design
        lines += ["", f"Paired (same seed) difference to {design.reference}, {shown.diff_unit}, 95% t-interval; "
                  f"verdict at a margin of ±{design.margin:g} {shown.unit} (equivalent: TOST inside the margin at 5%; "
                  "worse/better: the interval excludes 0; inconclusive: neither, with the seeds that would settle "
                  "it if the spread held)", "",
                  f"| {rows} | regime | diff | 95% CI | std GA / {design.reference} | pairs | verdict (±{design.margin:g}) |",
                  "|---|---|---|---|---|---|---|"]
        for p in summary.paired.itertuples():
            ci = "n/a" if pd.isna(p.ci_low) else f"[{signed(p.ci_low)}, {signed(p.ci_high)}]"
            sds = "n/a" if pd.isna(p.sd_a) else f"{pct(p.sd_a)} / {pct(p.sd_b)}"
            lines.append(f"| {p.norm} | {p.regime} | {signed(p.diff)} | {ci} | {sds} | {p.pairs} | "
                         f"{verdict_text(p.verdict, p.seeds_needed)} |")
    if not summary.twins.empty:
        margin = summary.design.margin
        lines += ["", "Data-parallel cells against their accumulation twins (b, w*k: the same samples in every step), "
                  f"paired (same seed), {shown.diff_unit}, 95% t-interval; normalization batch (b per replica, w*b "
                  f"synchronized) and optimization batch (w*b*k); verdict at ±{margin:g} {shown.unit}", "",
                  f"| {rows} | regime | twin | norm batch | opt batch | diff | 95% CI | pairs | verdict (±{margin:g}) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for p in summary.twins.itertuples():
            ci = "n/a" if pd.isna(p.ci_low) else f"[{signed(p.ci_low)}, {signed(p.ci_high)}]"
            lines.append(f"| {p.norm} | {p.regime} | {p.twin} | {p.norm_batch} | {p.opt_batch} | {signed(p.diff)} | "
                         f"{ci} | {p.pairs} | {verdict_text(p.verdict, p.seeds_needed)} |")
    if len(summary.ranking) > 1:
        lines += ["", format_ranking(summary.ranking, summary.design, shown)]
    if summary.missing:
        lines += ["", "Missing cells: " + "; ".join(summary.missing)]
    if summary.engines:
        lines += ["", summary.engines]
    return "\n".join(lines) + "\n"


def format_ranking(ranking: pd.DataFrame, design: AnalysisConfig, shown: Headline = ACCURACY) -> str:
    """The ranking on the ranked regime as Markdown: mean, then each paired difference with its interval, in the
    headline's unit (`shown`)."""
    def diff(row: pd.Series, name: str) -> str:
        mean, low, high = row[f"vs {name}"], row[f"vs {name} low"], row[f"vs {name} high"]
        if row[f"vs {name} verdict"] == "baseline":
            return "0 (baseline)"
        if pd.isna(mean):
            return "–"
        return shown.show(mean, True) + ("" if pd.isna(low) else f" [{shown.show(low, True)}, {shown.show(high, True)}]")

    def verdict(row: pd.Series, name: str) -> str:
        found = row[f"vs {name} verdict"]
        return "" if found == "baseline" else verdict_text(found, row[f"vs {name} seeds_needed"])

    names, regime = list(design.baselines), design.ranked_regime
    lines = [f"Ranking on {regime}: mean {shown.phrase} {shown.symbol} and its std across seeds, and the paired (same "
             f"seed) difference in {shown.unit} to each baseline with its 95% t-interval and verdict at a margin of "
             f"±{design.margin:g} {shown.unit}", "",
             f"| rank | {rows_label(design)} | " + regime + f" {shown.symbol} | std | seeds | "
             + " | ".join(f"vs {n} | verdict (±{design.margin:g})" for n in names) + " |",
             "|" + "---|" * (5 + 2 * len(names))]
    for _, row in ranking.iterrows():
        lines.append(f"| {row['rank']} | {row.norm} | {shown.show(row['mean'])} | "
                     + ("n/a" if pd.isna(row.sd) else shown.show(row.sd)) + f" | {row.seeds} | "
                     + " | ".join(f"{diff(row, n)} | {verdict(row, n)}" for n in names) + " |")
    return "\n".join(lines)


def export(collected: Collected, summary: Summary, out: Path) -> list[Path]:
    """Write tables, figures and the tidy data under `out`; return the files written."""
    return export_tables(collected, summary, out) + export_plots(collected, summary, out)


def export_tables(collected: Collected, summary: Summary, out: Path) -> list[Path]:
    """The tables (table.md first) and the tidy data under `out`: what a reader waits for, in well under a
    second; the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "table.md", out / "table.csv", out / "cells.csv", out / "paired.csv", out / "runs.csv",
               out / "ranking.csv"]
    text = format_table(summary)
    if collected.runs is not None and collected.runs[ACTIVATIONS[0]].notna().any():
        memory = memory_table(collected.runs, summary.design)
        text += "\n" + format_memory(memory)
        memory.to_csv(out / "memory.csv")
        written.append(out / "memory.csv")
    if not collected.excluded.empty:
        text += "\nExcluded runs (not FINISHED): " + "; ".join(
            f"{r.run_name} ({r.status})" for r in collected.excluded.itertuples()) + "\n"
    written[0].write_text(text)
    summary.table.to_csv(written[1])
    summary.cells.to_csv(written[2])
    summary.paired.to_csv(written[3], index=False)
    collected.data.to_csv(written[4], index=False)
    summary.ranking.to_csv(written[5], index=False)
    if not summary.twins.empty:  # data-parallel cells against their accumulation twins
        summary.twins.to_csv(out / "twins.csv", index=False)
        written.append(out / "twins.csv")
    return written
