"""The reads of a team's store, timed as it grows: the benchmark behind docs/results.md's store table.

`python -m gaexp.tools.storebench --dir /tmp/storebench --sizes 60,600,6000` generates a store of each size
(gaexp.tools.storegen: sweeps of the study's 60 cells, extended in place) and times, on the SQLite file and
through a local MLflow server reading it: collecting one sweep (the first: the same 60 runs at every
size), collecting all, gaexp-status, the whole gaexp-report of that sweep (tables and plots), and the
resume check of its 60 cells (a cell's FINISHED run of the same protocol, as a resumed sweep looks for
it). Each figure is the best of `--repeat` in one process; the ratios to the smallest store are what
the goals are stated in.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

from mlflow.tracking import MlflowClient

from gaexp import analysis, progress, tracking
from gaexp.tools import server, storegen
from gaexp.tags import PROTOCOL_KEY

MEASURES = ["collect one sweep", "collect all", "gaexp-status", "gaexp-report (one sweep)", "resume check (60 cells)"]


def best_of(repeat: int, work: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        tic = time.perf_counter()
        work()
        times.append(time.perf_counter() - tic)
    return min(times)


def quietly(main: Callable[[list[str]], None], argv: list[str]) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        main(argv)


def measure(uri: str, repeat: int, skip_all_above: int | None = None, runs: int = 0) -> dict[str, float | None]:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("gaexp").experiment_id
    sweep = storegen.sweep_id(0)
    keys = [r.data.tags[PROTOCOL_KEY] for r in tracking.runs_in_sweep(client, [experiment], sweep)
            if PROTOCOL_KEY in r.data.tags]
    with tempfile.TemporaryDirectory() as out:
        times = {
            MEASURES[0]: best_of(repeat, lambda: analysis.collect(client, "gaexp", sweep)),
            MEASURES[1]: (None if skip_all_above is not None and runs > skip_all_above
                          else best_of(1 if runs > 6000 else repeat, lambda: analysis.collect(client, "gaexp", "all"))),
            MEASURES[2]: best_of(repeat, lambda: quietly(progress.main, ["--tracking-uri", uri])),
            MEASURES[3]: best_of(repeat, lambda: quietly(analysis.main, ["--tracking-uri", uri, "--sweep", sweep,
                                                                        "--out", out])),
            MEASURES[4]: best_of(repeat, lambda: [tracking.find_finished(client, experiment, k) for k in keys]),
        }
    assert len(keys) == len(storegen.cells()), keys
    return times


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(db: Path, log: Path) -> Iterator[str]:
    """`mlflow server` on the SQLite file, on the loopback; its process group stopped after."""
    uri = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    argv = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", uri.rsplit(":", 1)[1],
            "--workers", "1", "--backend-store-uri", f"sqlite:///{db}", "--artifacts-destination", str(db.parent / "art")]
    with server.running(argv, uri, log, env=env):
        yield uri


def table(rows: list[tuple[str, int, dict[str, float | None]]]) -> str:
    sizes = sorted({n for _, n, _ in rows})
    lines = ["| store | measure | " + " | ".join(f"{n:,} runs" for n in sizes) + " | largest / smallest |",
             "|---|---|" + "---|" * (len(sizes) + 1)]
    for store in dict.fromkeys(s for s, _, _ in rows):
        for m in MEASURES:
            cells = {n: t[m] for s, n, t in rows if s == store}
            shown = [f"{cells[n]:.2f} s" if cells.get(n) is not None else "-" for n in sizes]
            first, last = cells.get(sizes[0]), cells.get(sizes[-1])
            ratio = f"{last / first:.1f}x" if first and last else "-"
            lines.append(f"| {store} | {m} | " + " | ".join(shown) + f" | {ratio} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gaexp.tools.storebench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="folder of the generated store (extended in place)")
    parser.add_argument("--sizes", default="60,600,6000,60000,100000", help="training runs, comma-separated, "
                        "increasing (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measure; the best counts (default: 3)")
    parser.add_argument("--server", choices=["yes", "no"], default="yes",
                        help="also time through a local MLflow server (default: %(default)s)")
    parser.add_argument("--server-all-up-to", type=int, default=6000,
                        help="collect all through the server only up to this many runs (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        sys.exit(f"error: --sizes {args.sizes!r}; valid: increasing integers >= 60, comma-separated")
    if sizes != sorted(sizes) or sizes[0] < len(storegen.cells()):
        sys.exit(f"error: --sizes {args.sizes!r}; valid: increasing integers >= 60, comma-separated")
    db = args.dir.resolve() / "mlflow.db"
    if db.exists() and storegen.generated_sweeps(db) * len(storegen.cells()) > sizes[0]:
        sys.exit(f"error: {db} already holds more runs than {sizes[0]}; give an empty --dir")
    rows = []
    for n in sizes:
        uri = f"sqlite:///{db}"
        storegen.generate(uri, n)
        rows.append(("SQLite", n, measure(uri, args.repeat, runs=n)))
        print(f"{n} runs, SQLite: " + ", ".join(f"{k} {v:.2f} s" for k, v in rows[-1][2].items() if v is not None),
              flush=True)
        if args.server == "yes":
            with local_server(db, args.dir / "server.log") as server:
                rows.append(("server", n, measure(server, args.repeat, args.server_all_up_to, n)))
            print(f"{n} runs, server: " + ", ".join(f"{k} {v:.2f} s" for k, v in rows[-1][2].items() if v is not None),
                  flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
