"""Rebuild the study's comparison table and learning curves from the MLflow store (docs/study.md).

Stages, each testable alone, a module each: `collection` (`collect`: MLflow -> one tidy DataFrame), `stats`
(`summarize`: pure pandas -> tables, the verdicts), `figures` (`plot_curves`: matplotlib -> figures), `tables`
(`export`: files), over `columns` (the frame's columns, the design, the one error); `reporting` runs them for a sweep
(`report`), and is `gaexp-report` (`main`). The design (table columns, reference, ranked regime, baselines, window) is
a study's `analysis` node (conf/experiment/*.yaml, schema `AnalysisConfig`). `gaexp.analysis` names each module's
public names.
"""

from gaexp.analysis.columns import (column, PROTOCOL, VALID_ACC, TRAIN_LOSS, TIDY, ENGINE, PARTS, LAUNCH_WINDOW,
                                    RUN_METRICS, MEMORY_COLUMNS, ACTIVATIONS, AnalysisError, EXCLUDED, Collected,
                                    norm_order, in_order, number_or_nan, load_study)
from gaexp.analysis.collection import (training_runs, is_grid_run, latest_sweep, store_filter, collect, grid_runs,
                                    curves, values_in, datasets_in, select)
from gaexp.analysis.stats import (check_protocol, ALPHA, MAX_SEEDS, VERDICTS, PAIRED_COLUMNS, seeds_to_settle,
                                  paired_verdict, verdict_text, Summary, label_of, rank, summarize, SYNCHRONIZED,
                                  twin_of, twins, engines_note, PRECISION_KEYS, Precisions, compare_precisions,
                                  memory_table)
from gaexp.analysis.figures import plot_curves, export_plots
from gaexp.analysis.tables import (format_precisions, export_precisions, format_memory, format_table, format_ranking,
                                   export, export_tables)
from gaexp.analysis.reporting import report, report_folder, report_each_part, window_note, main

__all__ = ["column", "PROTOCOL", "VALID_ACC", "TRAIN_LOSS", "TIDY", "ENGINE", "PARTS", "LAUNCH_WINDOW",
           "RUN_METRICS", "MEMORY_COLUMNS", "ACTIVATIONS", "AnalysisError", "EXCLUDED", "Collected", "norm_order",
           "in_order", "number_or_nan", "load_study", "training_runs", "is_grid_run", "latest_sweep", "store_filter",
           "collect", "grid_runs", "curves", "values_in", "datasets_in", "select", "check_protocol", "ALPHA",
           "MAX_SEEDS", "VERDICTS", "PAIRED_COLUMNS", "seeds_to_settle", "paired_verdict", "verdict_text", "Summary",
           "label_of", "rank", "summarize", "SYNCHRONIZED", "twin_of", "twins", "engines_note", "PRECISION_KEYS",
           "Precisions", "compare_precisions", "memory_table", "plot_curves", "export_plots", "format_precisions",
           "export_precisions", "format_memory", "format_table", "format_ranking", "export", "export_tables",
           "report", "report_folder", "report_each_part", "window_note", "main"]
