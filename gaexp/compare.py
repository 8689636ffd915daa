"""Two stores, run by run: did a change that should not touch the arithmetic leave every result as it was?

`python -m gaexp.compare STORE_A STORE_B` pairs the training runs by name and compares their
`valid_acc` and `train_loss` histories, every metric but time and memory, and every tag but
those naming the sweep, host, process and heartbeat, and the curves tags that repeat the histories (a tag added since, such as `model`, matches a run without it
when it has the value that run implicitly had). It prints each difference and exits 1 if any.
Params are listed apart: a change may add config keys without changing a result.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from mlflow.tracking import MlflowClient

from gaexp.analysis import PARTS, training_runs
from gaexp import arguments, metrics
from gaexp.config import ADDED_DEFAULTS
from gaexp.tags import (ACCUMULATE, ACCUMULATE_SETTING, ARITHMETIC_KEY, CELL_START, CPU, CURVES, HEARTBEAT, HOST,
                        PROCESS_START, REPLICAS, SAME_AS, SINGLE_RUN, SWEEP_ID, SWEEPS)

MEASURED = metrics.MEASURED  # vary run to run
PLACE_TAGS = {SWEEP_ID, SWEEPS, HOST, PROCESS_START, HEARTBEAT,  # where and when,
              CPU, CELL_START, ACCUMULATE_SETTING, SINGLE_RUN,  # the CPU, how it was asked (the engine used: tag accumulate),
              ARITHMETIC_KEY, SAME_AS}  # and whether another run computed its steps (its results are those): not what
ADDED_TAGS = {**{tag: ADDED_DEFAULTS[key] for tag, key in PARTS.items()},  # tags runs recorded before them lack:
              ACCUMULATE: ADDED_DEFAULTS["accumulate"], REPLICAS: ADDED_DEFAULTS["regime.replicas"]}  # this value


def same_tag(name: str, left: str | None, right: str | None) -> bool:
    """Equal, or one run predates the tag and the other has the value that run implicitly had (model: simple)."""
    if left == right:
        return True
    added = ADDED_TAGS.get(name)
    return added is not None and {left, right} == {None, str(added)}


def differences(client_a: MlflowClient, client_b: MlflowClient, experiment: str = "gaexp") -> tuple[list[str], list[str]]:
    """(result differences, param differences) between the training runs of the two stores."""
    runs_a, runs_b = training_runs(client_a, experiment), training_runs(client_b, experiment)
    found = []
    if sorted(runs_a) != sorted(runs_b):
        found.append(f"run names differ: only in A {sorted(set(runs_a) - set(runs_b))}, "
                     f"only in B {sorted(set(runs_b) - set(runs_a))}")
    params = []
    for name in sorted(set(runs_a) & set(runs_b)):
        a, b = runs_a[name], runs_b[name]
        for metric in (*metrics.HISTORIES, *metrics.SCALER_HISTORIES):
            history = [[(m.step, m.value) for m in c.get_metric_history(r.info.run_id, metric)]
                       for c, r in ((client_a, a), (client_b, b))]
            if history[0] != history[1]:
                found.append(f"{name}: {metric} history {history[0]} != {history[1]}")
        for kind, keep in (("metric", lambda r: {k: v for k, v in r.data.metrics.items() if k not in MEASURED}),
                           ("tag", lambda r: {k: v for k, v in r.data.tags.items()
                                              if k not in PLACE_TAGS and not k.startswith(("mlflow.", CURVES))})):
            left, right = keep(a), keep(b)
            found += [f"{name}: {kind} {k}: {left.get(k)!r} != {right.get(k)!r}"
                      for k in sorted(set(left) | set(right))
                      if (left.get(k) != right.get(k) if kind == "metric" else not same_tag(k, left.get(k), right.get(k)))]
        params += [f"{name}: param {k}: {a.data.params.get(k)!r} -> {b.data.params.get(k)!r}"
                   for k in sorted(set(a.data.params) | set(b.data.params)) if a.data.params.get(k) != b.data.params.get(k)]
    return found, params


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gaexp.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("store_a", help="tracking URI, e.g. sqlite:////abs/before/mlflow.db")
    parser.add_argument("store_b", help="tracking URI of the runs after the change")
    parser.add_argument("--experiment", default="gaexp", help="experiment name in both (default: %(default)s)")
    args = parser.parse_args(argv)
    for uri in (args.store_a, args.store_b):
        arguments.require_store(uri)
    found, params = differences(MlflowClient(args.store_a), MlflowClient(args.store_b), args.experiment)
    runs = len(training_runs(MlflowClient(args.store_a), args.experiment))
    print("\n".join([*found, *params]) or "no differences")
    print(f"{runs} runs compared: {len(found)} result differences, {len(params)} param differences")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
