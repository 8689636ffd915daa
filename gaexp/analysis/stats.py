"""Summarize: pure pandas and scipy -> tables. Means over seeds in the window, paired t-intervals against the
reference regime, equivalence by TOST at the study's margin (statsmodels), the verdicts and the seeds that would settle
them, the ranking, each data-parallel regime against its twin, precisions against float32, memory and speed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd

from gaexp.analysis.columns import (ACTIVATIONS, AnalysisError, ENGINE, MEMORY_COLUMNS, PARTS, PROTOCOL, VALID_ACC,
                                    as_rows, column, headline, in_order, norm_order, row_keys)
from gaexp.metrics import ACCURACY, Headline
from gaexp.config import ADDED_DEFAULTS, AnalysisConfig, PROTOCOL_COLUMNS, parse_regime
from gaexp.tags import BATCH_SIZE, DATASET, MODEL, NORM, NUM_ACCUM, PRECISION, REGIME, SEED


def check_protocol(data: pd.DataFrame, per_cell: Sequence[str] = ()) -> None:
    """Refuse to average runs of different datasets or protocols together. Keys in `per_cell` (a tuned value
    such as lr) may differ between cells, never within one."""
    for part in PARTS:
        values = sorted(data[part].unique())
        if len(values) > 1:
            raise AnalysisError(f"runs of {len(values)} {part}s ({', '.join(values)}) never pool; "
                                f"choose one with --{part}")
    for key in per_cell:
        if key not in PROTOCOL:
            raise AnalysisError(f"analysis.per_cell: {key!r}; valid: {', '.join(PROTOCOL)}")
    for key in [*per_cell, ENGINE]:
        varying = data.groupby([NORM, REGIME])[key].nunique()
        if (varying > 1).any():
            cell = varying[varying > 1].index[0]
            if key == ENGINE:
                found = data[(data.norm == cell[0]) & (data.regime == cell[1])].groupby(ENGINE).seed.unique()
                raise AnalysisError(
                    f"the cell {'/'.join(cell)} has runs of both engines ("
                    + "; ".join(f"{e}: seed {', '.join(map(str, sorted(s)))}" for e, s in found.items())
                    + "): they agree within seed noise but not bit for bit, and never pool; choose one sweep with "
                      "--sweep, or run its seeds again under one engine (accumulate=loop rerun=true)")
            raise AnalysisError(f"{key} differs within the cell {'/'.join(cell)}; choose one sweep with --sweep")
    protocols = data[[k for k in PROTOCOL if k not in [*per_cell, ENGINE]]].drop_duplicates()
    if len(protocols) > 1:
        found = "; ".join(", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
                          for _, row in protocols.iterrows())
        raise AnalysisError(f"runs of {len(protocols)} different protocols ({found}); "
                            "choose one sweep with --sweep")


ALPHA = 0.05  # every test at 5%: the 95% interval, and TOST's two one-sided tests at 5% each


MAX_SEEDS = 100  # seeds_to_settle looks this far


VERDICTS = ("equivalent", "worse", "better", "inconclusive", "n/a (1 seed)")


PAIRED_COLUMNS = ["diff", "ci_low", "ci_high", "pairs", "sd_a", "sd_b", "p_equivalent", "verdict", "seeds_needed"]


def _settled(diff: float, sd: float, n: int, margin: float) -> bool:
    """Whether n pairs with this mean difference and spread give a verdict other than inconclusive:
    TOST's 90% interval inside +-margin, or the 95% interval clear of 0 (the tests' own criteria)."""
    from scipy import stats  # imported where an interval is computed: about 0.8 s a process, which a report of
    # one seed (the tests' sweeps, a first try) and the sweep's own process need not

    se = sd / np.sqrt(n)
    return (abs(diff) + stats.t.ppf(1 - ALPHA, n - 1) * se < margin
            or abs(diff) > stats.t.ppf(1 - ALPHA / 2, n - 1) * se)


def seeds_to_settle(diff: float, sd: float, n: int, margin: float) -> int | None:
    """The fewest seeds (more than n) at which the observed mean difference and standard deviation of the
    differences, if they held, would settle an inconclusive comparison; None if not within MAX_SEEDS."""
    return next((m for m in range(n + 1, MAX_SEEDS + 1) if _settled(diff, sd, m, margin)), None)


def paired_verdict(a: pd.Series, b: pd.Series, margin: float, higher_is_better: bool = True) -> dict:
    """Cell a against cell b, paired on their index (the seed): a - b's mean, its 95% t-interval (scipy's
    paired t-test), each cell's std across seeds, and the verdict at +-margin (same units as a and b):
    equivalent when statsmodels' paired TOST puts the difference inside +-margin at 5%; worse or better
    (different) when the interval excludes 0, better being a higher value unless `higher_is_better` is False (a
    loss); inconclusive otherwise, with the seeds that would settle it."""
    pairs = pd.concat([a.rename("a"), b.rename("b")], axis=1).dropna()
    x, y, n = pairs.a.to_numpy(float), pairs.b.to_numpy(float), len(pairs)
    out = dict.fromkeys(PAIRED_COLUMNS, np.nan) | {"pairs": n, "seeds_needed": None}
    if n == 0:
        return out | {"verdict": None}
    d = x - y
    out["diff"] = float(d.mean())
    if n < 2:
        return out | {"verdict": VERDICTS[4]}
    from scipy import stats  # here, where an interval is computed (see _settled)
    from statsmodels.stats.weightstats import ttost_paired  # the report's only user: not imported by the app

    out |= {"sd_a": float(np.std(x, ddof=1)), "sd_b": float(np.std(y, ddof=1))}
    sd = float(np.std(d, ddof=1))
    if sd == 0:  # every seed gives the same difference: the interval is that point, the tests degenerate
        out |= {"ci_low": out["diff"], "ci_high": out["diff"], "p_equivalent": float(abs(out["diff"]) >= margin)}
    else:
        out["ci_low"], out["ci_high"] = (float(v) for v in stats.ttest_rel(x, y).confidence_interval(1 - ALPHA))
        out["p_equivalent"] = float(ttost_paired(x, y, -margin, margin)[0])
    if out["p_equivalent"] < ALPHA:
        verdict = VERDICTS[0]
    elif out["ci_low"] > 0 or out["ci_high"] < 0:
        verdict = VERDICTS[2] if (out["diff"] > 0) == higher_is_better else VERDICTS[1]
    else:
        verdict = VERDICTS[3]
        out["seeds_needed"] = seeds_to_settle(out["diff"], sd, n, margin)
    return out | {"verdict": verdict}


def verdict_text(verdict: str | None, seeds_needed: float | None) -> str:
    """A verdict as the tables print it: inconclusive says how many seeds would settle it (`seeds_needed`
    None or nan: more than MAX_SEEDS)."""
    if verdict != VERDICTS[3]:
        return verdict or "–"
    if seeds_needed is None or pd.isna(seeds_needed):
        return f"inconclusive (over {MAX_SEEDS} seeds)"
    return f"inconclusive ({int(seeds_needed)} seeds)"


@dataclass
class Summary:
    table: pd.DataFrame  # the study's table: rows norm, columns design.table_columns, pooled mean valid acc
    cells: pd.DataFrame  # per (norm, regime): mean, std over seeds, seeds, final-step accuracy
    paired: pd.DataFrame  # per norm and GA regime: paired (same seed) difference to bs16a1, 95% CI, verdict
    missing: list[str]  # cells with fewer seeds than the fullest cell, or none at all
    design: AnalysisConfig
    ranking: pd.DataFrame  # norms on design.ranked_regime, best first, paired differences to each baseline
    dataset: str = ""  # the one dataset of the runs
    model: str = ""  # and their one model
    window_note: str = ""  # why the table averages other evaluations than design.window_start says, if it does
    engines: str = ""  # which cells ran which engine, where they differ (accumulate=auto fell back for some)
    precision: str = ""  # and their one precision
    twins: pd.DataFrame = field(default_factory=pd.DataFrame)  # per norm and DP regime: against its accumulation twin
    headline: Headline = ACCURACY  # the runs' task's metric (gaexp/task/): what the tables show, in its unit

    @property
    def label(self) -> str:
        return label_of(self.dataset, self.model, self.precision)


def label_of(dataset: str, model: str, precision: str = "") -> str:
    """What runs trained on, as a table's title says it: mnist, or mnist, resnet20 (another model), or mnist, bf16
    (another precision)."""
    return dataset + "".join(f", {v}" for v, first in ((model, ADDED_DEFAULTS[PARTS[MODEL]]),
                                                       (precision, ADDED_DEFAULTS[PARTS[PRECISION]]))
                             if v not in ("", first))


def rank(per_run: pd.Series, design: AnalysisConfig, shown: Headline = ACCURACY) -> pd.DataFrame:
    """Every norm (row) run on the ranked regime, best mean first (`shown`: the headline, its direction), with its
    std across seeds and its paired (same-seed) difference, 95% t-interval and verdict at design.margin to each
    baseline cell present. `per_run`: windowed mean per (norm, regime, seed)."""
    rows, regime = [], design.ranked_regime
    for norm in in_order(per_run.index.get_level_values(NORM).unique(), norm_order(design)):
        if (norm, regime) not in per_run.index:
            continue
        acc = per_run[norm, regime]
        row = {NORM: norm, "mean": float(acc.mean()), "sd": float(acc.std(ddof=1)), "seeds": len(acc)}
        for b_norm, b_regime in design.baseline_cells():
            name = f"{b_norm}/{b_regime}"
            base = per_run[b_norm, b_regime] if (b_norm, b_regime) in per_run.index else acc[[]]
            pair = paired_verdict(acc, base, design.margin / shown.scale, shown.higher_is_better)
            if (b_norm, b_regime) == (norm, regime):
                pair |= {"verdict": "baseline", "seeds_needed": None}
            row |= {f"vs {name}": pair["diff"], f"vs {name} low": pair["ci_low"], f"vs {name} high": pair["ci_high"],
                    f"vs {name} verdict": pair["verdict"], f"vs {name} seeds_needed": pair["seeds_needed"]}
        rows.append(row)
    ranking = pd.DataFrame(rows)
    if ranking.empty:
        return ranking
    ranking = ranking.sort_values("mean", ascending=not shown.higher_is_better, kind="stable").reset_index(drop=True)
    ranking.insert(0, "rank", range(1, len(ranking) + 1))
    return ranking


def summarize(data: pd.DataFrame, design: AnalysisConfig) -> Summary:
    """The tables, from the tidy data; evaluations at step > design.window_start count."""
    if data.empty:
        raise AnalysisError("no FINISHED runs to summarize")
    data, shown = as_rows(data, design), headline(data)
    check_protocol(data, [*design.per_cell, *(column(key) for key in row_keys(design) if key != NORM)])
    margin = design.margin / shown.scale
    window, window_note = data[data.step > design.window_start], ""
    if window.empty:  # a short budget: the evaluations there are, said in the table's header
        window = data
        window_note = (f"every evaluation (none after step {design.window_start}, the window's start: the last is at "
                       f"step {data.step.max()}; set --window-start or analysis.window_start to choose)")
    reference = design.reference
    columns = [r for r in design.table_columns if r in set(data.regime)]  # what the sweep ran, never more
    norms = in_order(data.norm, norm_order(design))
    regimes = in_order(data.regime, design.regime_order)

    pooled = window.groupby([NORM, REGIME])[VALID_ACC].mean()
    table = pooled.unstack(REGIME).reindex(index=norms, columns=columns)
    table.columns.name, table.index.name = None, NORM

    per_run = window.groupby([NORM, REGIME, SEED])[VALID_ACC].mean()
    final = data[data.step == data.groupby("run_id").step.transform("max")]
    final_acc = final.groupby([NORM, REGIME])[VALID_ACC].mean()
    cells = per_run.groupby([NORM, REGIME]).agg(mean="mean", std="std", seeds="count")
    cells["final_acc"] = final_acc
    for key in design.per_cell:  # the tuned value of each cell
        cells[key] = data.groupby([NORM, REGIME])[key].first()
    cells = cells.reindex(pd.MultiIndex.from_product([norms, regimes], names=[NORM, REGIME])).dropna(how="all")
    cells["seeds"] = cells.seeds.astype(int)

    paired_rows = []
    for norm in norms:
        for regime in (r for r in columns if r != reference):
            if (norm, regime) not in per_run.index or (norm, reference) not in per_run.index:
                continue
            pair = paired_verdict(per_run[norm, regime], per_run[norm, reference], margin, shown.higher_is_better)
            if pair["pairs"]:
                paired_rows.append({NORM: norm, REGIME: regime, **pair})
    paired = pd.DataFrame(paired_rows, columns=[NORM, REGIME, *PAIRED_COLUMNS])

    most = int(cells.seeds.max())
    seeds = per_run.groupby([NORM, REGIME]).size()
    missing = [f"{n}/{r}: " + (f"{seeds[n, r]} of {most} seeds" if (n, r) in seeds.index else "no run")
               for n in norms for r in regimes if (n, r) not in seeds.index or seeds[n, r] < most]
    return Summary(table, cells, paired, missing, design, rank(per_run, design, shown), data[DATASET].iloc[0],
                   data[MODEL].iloc[0], window_note, engines_note(data, norms, regimes), data[PRECISION].iloc[0],
                   twins(per_run, norms, columns, margin, shown.higher_is_better), shown)


SYNCHRONIZED = ("bn_sync",)  # norms whose statistics span the replicas: their normalization batch is w*b


def twin_of(regime: str) -> str | None:
    """A data-parallel regime's accumulation twin: w replicas of b with k steps take each step's samples of
    (b, w*k) (gaexp/replicas.py); None for a regime of one replica or a name that does not parse."""
    parsed = parse_regime(regime)
    if parsed is None or parsed[2] == 1:
        return None
    b, k, w = parsed
    return f"bs{b}a{w * k}"


def twins(per_run: pd.Series, norms: Sequence[str], columns: Sequence[str], margin: float,
          higher_is_better: bool = True) -> pd.DataFrame:
    """Each data-parallel cell of the table against its accumulation twin (`twin_of`), paired on the seed, with
    its normalization batch (b, or w*b where the norm is synchronized) and optimization batch (w*b*k)."""
    rows, per_run = [], per_run.sort_index()
    for norm in norms:
        for regime in columns:
            twin = twin_of(regime)
            if twin is None or (norm, regime) not in per_run.index or (norm, twin) not in per_run.index:
                continue
            b, k, w = parse_regime(regime)
            pair = paired_verdict(per_run[norm, regime], per_run[norm, twin], margin, higher_is_better)
            rows.append({NORM: norm, REGIME: regime, "twin": twin,
                         "norm_batch": w * b if norm in SYNCHRONIZED else b, "opt_batch": w * b * k, **pair})
    return pd.DataFrame(rows, columns=[NORM, REGIME, "twin", "norm_batch", "opt_batch", *PAIRED_COLUMNS])


def engines_note(data: pd.DataFrame, norms: Sequence[str], regimes: Sequence[str]) -> str:
    """Which cells ran which engine where a report's cells differ in it ("" where they all ran one): a
    comparison across engines compares within seed noise, not bit for bit (docs/study.md)."""
    by_cell = data.groupby([NORM, REGIME])[ENGINE].first()
    if by_cell.nunique() < 2:
        return ""
    parts = []
    for engine, cells in sorted(by_cell.groupby(by_cell), key=lambda g: -len(g[1])):
        listed = [f"{n}/{r}" for n in norms for r in regimes if (n, r) in cells.index]
        parts.append(f"{engine}: " + (f"{len(listed)} cells" if len(listed) > 8 else ", ".join(listed)))
    return ("Engines differ between cells: " + "; ".join(parts) + ". Their steps are the same up to rounding: a "
            "comparison across engines holds within seed noise, not bit for bit (docs/study.md).")


PRECISION_KEYS = [column(k) for k in PROTOCOL_COLUMNS if k.startswith("precision.")]  # one precision's columns


@dataclass
class Precisions:
    """Runs of several precisions (one dataset and model) set side by side: per norm, regime and precision, the
    mean over seeds of each run's windowed mean, and each precision's paired (same seed) difference to fp32 at
    the same norm and regime with its verdict (the accumulation regimes against their true batch at the same
    precision are each precision's own table)."""

    table: pd.DataFrame  # norm, regime, precision, mean, std, seeds, then PAIRED_COLUMNS against fp32
    design: AnalysisConfig
    label: str  # what the runs trained on (Summary.label)
    note: str = ""  # precisions not compared, and why
    over: str = ""  # the evaluations averaged, where not design.window_start's (a short budget: every one)


def compare_precisions(data: pd.DataFrame, design: AnalysisConfig) -> Precisions:
    """`Precisions` of the runs in `data`. A precision whose runs differ from fp32's in another protocol key (a
    reduced budget, say) is shown but not compared: the note says which key."""
    reference = ADDED_DEFAULTS[PARTS[PRECISION]]
    others = [k for k in PROTOCOL if k not in [*PRECISION_KEYS, *design.per_cell, ENGINE]]
    base = data[data[PRECISION] == reference][others].drop_duplicates()
    window, over = data[data.step > design.window_start], ""
    if window.empty:  # a short budget: every evaluation, as `summarize` takes it
        window, over = data, f"every evaluation (none after step {design.window_start})"
    per_run = window.groupby([NORM, REGIME, PRECISION, SEED])[VALID_ACC].mean()
    precisions, differs = in_order(data[PRECISION], [reference]), {}
    for precision in precisions[1:] if not base.empty else []:
        mine = data[data[PRECISION] == precision][others].drop_duplicates()
        differs[precision] = [k for k in others if set(map(str, mine[k])) != set(map(str, base[k]))]  # nan == nan
    def shown(values: pd.Series) -> str:
        return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in sorted(set(values), key=str))

    notes = [f"{precision} not compared with {reference}: " + ", ".join(
        f"{k} {shown(data[data[PRECISION] == precision][k])} against {shown(base[k])}" for k in keys)
        for precision, keys in differs.items() if keys]
    rows = []
    for norm, regime, precision in itertools.product(in_order(data.norm, norm_order(design)),
                                                     in_order(data.regime, design.regime_order), precisions):
        if (norm, regime, precision) not in per_run.index:
            continue
        acc = per_run[norm, regime, precision]
        row = {NORM: norm, REGIME: regime, PRECISION: precision, "mean": float(acc.mean()),
               "std": float(acc.std(ddof=1)) if len(acc) > 1 else np.nan, "seeds": len(acc)}
        if precision != reference and not differs.get(precision) and (norm, regime, reference) in per_run.index:
            row |= paired_verdict(acc, per_run[norm, regime, reference], design.margin / 100)
        rows.append(row)
    table = pd.DataFrame(rows, columns=[NORM, REGIME, PRECISION, "mean", "std", "seeds", *PAIRED_COLUMNS])
    return Precisions(table, design, label_of(data[DATASET].iloc[0], data[MODEL].iloc[0]), "; ".join(notes), over)


def memory_table(runs: pd.DataFrame, design: AnalysisConfig) -> pd.DataFrame:
    """Per regime: micro-batch (per replica), effective batch (w*b*k over the replicas), activation memory per micro-batch, speed, peaks. The activation
    column is what the loop holds whichever engine ran; runs of accumulate=batched add what they held
    (`batched_*` columns: the b*k samples of a step, and their process peaks, never the loop's)."""
    table = runs.groupby(REGIME).agg(micro_batch=(BATCH_SIZE, "first"), num_accum=(NUM_ACCUM, "first"),
                                     runs=("run_id", "count"), **{m.name: (m.name, how) for m, how in MEMORY_COLUMNS})
    replicas = [(parse_regime(str(name)) or (0, 0, 1))[2] for name in table.index]  # w2b8a1: 2; bs16a1: 1
    table.insert(1, "effective_batch", table.micro_batch * table.num_accum * replicas)
    table = table.drop(columns=NUM_ACCUM).reindex(in_order(table.index, design.regime_order))
    if design.reference in table.index:
        table.insert(3, f"activation_vs_{design.reference}", table[ACTIVATIONS[0]] / table[ACTIVATIONS[0]][design.reference])
    return table.dropna(axis="columns", how="all")
