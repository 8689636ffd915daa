"""`make ui [STORE=...]`: the MLflow UI on a store, opened on the runs table.

MLflow 3's UI opens an experiment on its GenAI overview (traces) unless the
experiment page's URL says `?workflowType=machine_learning`; the sidebar's
links keep the parameter. `python -m gaexp.tools.ui` tags every experiment of the
store as model training (`EXPERIMENT_KIND` of gaexp/tags.py, stores made before the
tag included), prints one link per experiment that opens its runs table,
then becomes `mlflow ui` on the same store, host and port; a tracking server's store (http://HOST:PORT)
serves its own UI, so for one the links are printed at its address and nothing is started.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Mapping, Sequence

from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from gaexp import arguments, redact, tracking
from gaexp.tools.server import NO_JOB_RUNNERS

WORKFLOW = "machine_learning"  # the UI's value for model training: runs, models, metrics
STORE_FORM = "sqlite:///ABSOLUTE/PATH.db or http(s)://HOST:PORT"


def base_url(host: str, port: int) -> str:
    """Where a browser on this machine reaches a UI bound to host:port (a wildcard address: loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def runs_link(url: str, experiment_id: str) -> str:
    """The experiment's page in MLflow's UI (hash routing), on its runs table rather than the GenAI overview."""
    return f"{url.rstrip('/')}/#/experiments/{experiment_id}?workflowType={WORKFLOW}"


def parse_port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"--port={text}; valid: an integer in [1, 65535]")
    return int(text)


def store_path(uri: str) -> Path:
    """The database file of a local store; a clear error for any other URI and for a missing file."""
    if not uri.startswith("sqlite:///") or not Path(uri.removeprefix("sqlite:///")).is_absolute():
        raise ValueError(f"--store={uri}; valid: {STORE_FORM}")
    path = Path(uri.removeprefix("sqlite:///"))
    if not path.is_file():
        raise ValueError(f"no MLflow store at {path}; run `make sweep` first (or give --store {STORE_FORM})")
    return path


def tag_experiments(uri: str) -> list[tuple[str, str, int]]:
    """Tag every active experiment that has runs as model training; (id, name, run count) of each."""
    client = MlflowClient(uri)
    found = []
    for experiment in client.search_experiments(view_type=ViewType.ACTIVE_ONLY):
        runs = len(tracking.search_all(client, [experiment.experiment_id]))  # every page: the count is exact
        if runs:
            tracking.prepare_store(uri, experiment.name, None)  # finds it, adds the tag if missing
            found.append((experiment.experiment_id, experiment.name, runs))
    return found


def ui_command(uri: str, host: str, port: int) -> list[str]:
    """`mlflow ui` of this Python's environment (its console script, else `python -m mlflow`)."""
    script = Path(sys.executable).parent / "mlflow"
    mlflow = [str(script)] if script.is_file() else [sys.executable, "-m", "mlflow"]
    return [*mlflow, "ui", "--backend-store-uri", uri, "--host", host, "--port", str(port)]


# The deprecation of a Starlette module MLflow's server imports, printed by each of its workers (4 by default):
# nothing its user can act on. A PYTHONWARNINGS entry: the processes `mlflow ui` starts inherit it.
QUIET_WARNINGS = "ignore:starlette.middleware.wsgi is deprecated:UserWarning"  # StarletteDeprecationWarning's base


def ui_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with QUIET_WARNINGS added to the warning filters it already gives, and MLflow's job runners off
    unless it turns them on (as gaexp's server)."""
    given = environ.get("PYTHONWARNINGS", "")
    return {**NO_JOB_RUNNERS, **environ, "PYTHONWARNINGS": ",".join(filter(None, [given, QUIET_WARNINGS]))}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gaexp.tools.ui", description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default=arguments.default_store(), help=f"{STORE_FORM} (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address the UI listens on (default: %(default)s)")
    parser.add_argument("--port", default="5000", help="port the UI listens on (default: %(default)s)")
    args = parser.parse_args(argv)
    redact.mask_terminal()  # a store's password is never printed
    if tracking.is_remote(args.store):  # a tracking server serves its own UI: the links, nothing started
        try:
            tracking.check_server(args.store)
            experiments = tag_experiments(args.store)
        except (ValueError, OSError) as e:
            sys.exit(redact.mask(f"error: {e}"))
        address = tracking.without_userinfo(args.store)[0]  # the browser asks for the user and password
        for experiment_id, name, runs in experiments:
            print(f"{name}: {runs} runs  {runs_link(address, experiment_id)}")
        print(f"{address} serves its own UI" + ("" if experiments else "; no runs there yet"))
        return
    try:
        port = parse_port(args.port)
        store_path(args.store)
        arguments.require_store(args.store)
        with arguments.store_errors(args.store):
            experiments = tag_experiments(args.store)
    except ValueError as e:
        sys.exit(f"error: {e}")
    url = base_url(args.host, port)
    for experiment_id, name, runs in experiments:
        print(f"{name}: {runs} runs  {runs_link(url, experiment_id)}")
    if not experiments:
        print(f"no runs yet in {args.store}; the UI is at {url}")
    sys.stdout.flush()  # exec replaces the process: print what is buffered first
    command = ui_command(args.store, args.host, port)
    os.execve(command[0], command, ui_environment(os.environ))


if __name__ == "__main__":
    main()
