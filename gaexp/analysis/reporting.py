"""The report of a sweep, each part (dataset, model, precision) apart, into files; `gaexp-report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path
from typing import Sequence

from mlflow.tracking import MlflowClient

from gaexp import arguments
from gaexp.analysis.collection import collect, datasets_in, select, values_in
from gaexp.analysis.columns import AnalysisError, Collected, LAUNCH_WINDOW, PARTS, SHARED, load_study
from gaexp.analysis.figures import export_plots
from gaexp.analysis.stats import Precisions, Summary, compare_precisions, summarize
from gaexp.analysis.tables import export, export_precisions, export_tables, format_precisions
from gaexp.config import ADDED_DEFAULTS, AnalysisConfig
from gaexp.progress import shared_line
from gaexp.tags import DATASET, MODEL, PRECISION


def report(tracking_uri: str, experiment_name: str, sweep: str = "latest", design: AnalysisConfig | None = None,
           out: Path | None = None, outputs_root: Path = Path("outputs"),
           dataset: str | None = None, model: str | None = None,
           plots: bool = True) -> tuple[Summary, Collected, list[Path]]:
    """collect -> summarize -> export; the default folder is outputs/reports/<sweep>."""
    collected = collect(MlflowClient(tracking_uri), experiment_name, sweep, dataset, model)
    summary = summarize(collected.data, design or AnalysisConfig())
    folder = report_folder(collected, out, outputs_root)
    return summary, collected, (export if plots else export_tables)(collected, summary, folder)


def shared_note(collected: Collected) -> str | None:
    """The report's one line on its runs that record another run's steps (gaexp.same_as), or None without any."""
    runs = collected.runs
    shared = 0 if runs is None or SHARED not in runs else int(runs[SHARED].sum())
    return shared_line(shared, len(runs)) if shared else None


def report_folder(collected: Collected, out: Path | None = None, outputs_root: Path = Path("outputs")) -> Path:
    return out if out is not None else outputs_root / "reports" / (collected.sweep or "unnamed")


def report_each_part(tracking_uri: str, experiment_name: str, sweep: str, design: AnalysisConfig,
                     out: Path) -> list[tuple[dict[str, str], str, Summary | Precisions | AnalysisError, list[Path]]]:
    """A sweep's report per dataset, model and precision it ran (a sweep over data=mnist,fashion_mnist has two,
    one over model=simple,resnet20 too): (the part's dataset, model and precision, its name, summary, files). The
    files are in `out` when there is one part, in `out/<name>` each otherwise, the name joining the values that
    vary (fashion_mnist, resnet20, or fashion_mnist-bf16). A part whose report cannot be made gives its
    AnalysisError in place of the summary, and the others are still made. Where a dataset and model ran several
    precisions, their `Precisions` follow, in `out` (or the folder of that dataset and model). The learning curves
    only where `design.plots`."""
    collected = collect(MlflowClient(tracking_uri), experiment_name, sweep)
    values = {part: values_in(collected, part) for part in PARTS}
    made = []
    for combination in itertools.product(*values.values()):
        wanted = dict(zip(values, combination))
        part = select(collected, **wanted)
        if part.data.empty and part.excluded.empty:
            continue  # e.g. resnet20 ran on mnist only
        name = "-".join(v for p, v in wanted.items() if len(values[p]) > 1)
        try:
            summary = summarize(part.data, design)
        except AnalysisError as e:
            made.append((wanted, name, e, []))
            continue
        made.append((wanted, name, summary, (export if design.plots else export_tables)(part, summary,
                                                                                     out / name if name else out)))
    for dataset, model in itertools.product(values[DATASET], values[MODEL]):
        both = select(collected, dataset=dataset, model=model) if len(values[PRECISION]) > 1 else None
        if both is None or both.data[PRECISION].nunique() < 2:
            continue
        wanted = {DATASET: dataset, MODEL: model}
        name = "-".join(v for p, v in wanted.items() if len(values[p]) > 1)
        compared = compare_precisions(both.data, design)
        made.append((wanted, f"{name}-precisions" if name else "precisions", compared,
                     export_precisions(compared, out / name if name else out)))
    return made


def window_note(collected: Collected, window_start: int, chosen: bool) -> str:
    """Where the window of this report is not the one the runs' own command had (the end-of-sweep report's, e.g.
    gaexp-tuned's reruns carry their search's): one line saying both, so the two tables' numbers are explained."""
    launched = sorted({int(w) for w in collected.runs[LAUNCH_WINDOW].dropna()}) if collected.runs is not None else []
    if chosen or not launched or launched == [window_start]:
        return ""
    return (f"note: this report averages evaluations at step > {window_start} (the study's analysis.window_start); "
            f"the runs' own command had {', '.join(map(str, launched))}, which their sweep's report used: "
            f"--window-start {launched[0]} gives that table")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gaexp-report", description=(
        "Rebuild the comparison table and learning curves of a gaexp sweep from MLflow."))
    arguments.add_store_arguments(parser, sweep="latest", sweep_help="'latest' (the sweep of the newest run), 'all', a "
                                                               "sweep id, or several comma-separated")
    parser.add_argument("--dataset", default=None,
                        help="the runs of this dataset only (data.dataset: mnist, cifar10, your folder's name, ...); needed when the "
                             "sweep ran several (default: all, which must be one)")
    parser.add_argument("--model", default=None,
                        help="the runs of this model only (model.name: simple, resnet20, ...); needed when the "
                             "sweep ran several (default: all, which must be one)")
    parser.add_argument("--precision", default=None,
                        help="the runs of this precision only (precision.name: fp32, bf16, fp16, bf16w, bf16w-acc32); "
                             "default: all, each precision's own table, then the precisions side by side")
    parser.add_argument("--study", default="spec",
                        help="the report's design: the `analysis` node of conf/experiment/STUDY.yaml, or of a "
                             "YAML file given by path (default: %(default)s)")
    parser.add_argument("--window-start", type=int, default=None,
                        help="average evaluations at step > this (default: the study's, 250; 2499 for the tail)")
    parser.add_argument("--margin", type=float, default=None,
                        help="equivalence margin in accuracy points for the verdicts (default: the study's, 0.5)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: outputs/reports/<sweep>)")
    parser.add_argument("--no-plots", dest="plots", action="store_false",
                        help="the tables only, without the learning curves (PNG, PDF: seconds more)")
    args = parser.parse_args(argv)
    arguments.require_store(args.tracking_uri)
    try:
        design = load_study(args.study)
        if args.window_start is not None:
            design = dataclasses.replace(design, window_start=args.window_start)
        if args.margin is not None:
            design = dataclasses.replace(design, margin=args.margin)
        with arguments.store_errors(args.tracking_uri):
            collected = collect(MlflowClient(args.tracking_uri), args.experiment, args.sweep, args.dataset,
                                args.model, args.precision)
            folder = report_folder(collected, args.out)
            parts = [(p, select(collected, precision=p)) for p in values_in(collected, PRECISION)]
            if len(parts) > 1 and collected.data[DATASET].nunique() == collected.data[MODEL].nunique() == 1:
                made = [(p, part, summarize(part.data, design), folder / p) for p, part in parts]  # each, then all
                compared = compare_precisions(collected.data, design)
            else:
                made, compared = [(None, collected, summarize(collected.data, design), folder)], None
    except (AnalysisError, ValueError) as e:
        sys.exit(f"error: {e}")
    note = window_note(collected, design.window_start, args.window_start is not None)
    if note:
        print(note)
    models = values_in(collected, MODEL)
    shown_model = "" if models == [ADDED_DEFAULTS["model.name"]] else f"model: {', '.join(models)}  "
    print(f"sweep: {collected.sweep}  dataset: {', '.join(datasets_in(collected))}  {shown_model}"
          f"runs: {collected.data.run_id.nunique()} finished, "
          f"{len(collected.excluded)} excluded")
    if (shared := shared_note(collected)) is not None:
        print(shared)
    written = []
    for _, part, summary, out in made:  # each precision's table is titled with it: mnist, bf16
        files = export_tables(part, summary, out)
        print(files[0].read_text(), flush=True)
        written += files  # the tables first: the plots take seconds more
    if compared is not None:
        written += export_precisions(compared, folder)
        print(format_precisions(compared), flush=True)
    if args.plots:
        for _, part, summary, out in made:
            written += export_plots(part, summary, out)
    print("written: " + ", ".join(str(p) for p in written))


if __name__ == "__main__":
    main()
