"""What a run made: its model as an MLflow LoggedModel (the runs table's Models column), and an old run's model loaded
again, without retraining.
"""

from __future__ import annotations

import importlib
import logging
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Iterator

from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric
from mlflow.models import Model
from mlflow.tracking import MlflowClient

from gaexp.tags import SAME_AS

if TYPE_CHECKING:  # torch and MLflow's flavour load only where a model is logged or loaded (gaexp-status stays light)
    import torch


MODEL_NAME = "model"  # the LoggedModel's name, shown in the runs table's Models column
AUTOLOG_ONLY = "pytorch_lightning"  # what mlflow.pytorch imports at its end for Lightning's autologging alone


def pytorch_flavour() -> ModuleType:
    """mlflow.pytorch, without the Lightning autologging it loads at import where Lightning is installed: Lightning,
    torchmetrics and transformers, 2 s of CPU in each process that logs a model, for a callback gaexp never uses.
    An import of pytorch_lightning fails while mlflow.pytorch loads (it swallows that ImportError) and works again
    after; in a process that loaded Lightning already, nothing changes."""
    if "mlflow.pytorch" not in sys.modules and AUTOLOG_ONLY not in sys.modules:
        sys.modules[AUTOLOG_ONLY] = None  # type: ignore[assignment]  # `import` raises ImportError
        try:
            return importlib.import_module("mlflow.pytorch")
        finally:
            del sys.modules[AUTOLOG_ONLY]
    return importlib.import_module("mlflow.pytorch")


@contextmanager
def requirements_as_read() -> Iterator[None]:
    """Inside: MLflow saves a model without comparing its requirements with the installed packages. gaexp's are
    read from the installed packages (the flavour's get_default_pip_requirements), so they match by construction,
    and the comparison first maps every installed distribution's files to its modules
    (importlib.metadata.packages_distributions): 1.7 s per process where transformers and Lightning are
    installed, a third of a small cell's own time."""
    from mlflow.utils import environment

    compare = environment.warn_dependency_requirement_mismatches
    environment.warn_dependency_requirement_mismatches = lambda requirements: None
    try:
        yield
    finally:
        environment.warn_dependency_requirement_mismatches = compare


class _PickleChosen(logging.Filter):
    """Drops the warning MLflow logs at each pickled save: pickle is chosen on purpose (the 'pt2' graph
    format bakes train/eval mode in, so a reloaded model could not be evaluated another way)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Saving pytorch model by Pickle")


def log_model(client: MlflowClient, run_id: str, model: torch.nn.Module, step: int | None = None,
              name: str = MODEL_NAME) -> str:
    """Log `model` with MLflow's PyTorch flavour as a LoggedModel of the run (the runs table's Models
    column); returns its model id. What `mlflow.pytorch.log_model` does, through this client rather than
    the process-wide tracking URI and active run: the model pickled whole (gaexp must be importable to load
    it), the run's params, and the run's metrics at `step` (default: none) linked to it. Requirements
    are given, not inferred (inference reloads the model in a subprocess, seconds per run)."""
    flavour = pytorch_flavour()
    mlflow_log = logging.getLogger("mlflow.pytorch")
    if not any(isinstance(f, _PickleChosen) for f in mlflow_log.filters):
        mlflow_log.addFilter(_PickleChosen())
    run = client.get_run(run_id)
    logged = client.create_logged_model(run.info.experiment_id, name=name, source_run_id=run_id,
                                        params=dict(run.data.params), model_type="pytorch")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            meta = Model(artifact_path=logged.artifact_location, run_id=run_id, model_uuid=logged.model_id,
                         model_id=logged.model_id)
            with requirements_as_read():
                flavour.save_model(model, Path(tmp, "model"), mlflow_model=meta, serialization_format="pickle",
                                   pip_requirements=flavour.get_default_pip_requirements())
            client.log_model_artifacts(logged.model_id, str(Path(tmp, "model")))
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step or 0)])
        if step is not None:
            metrics = [Metric(m.key, m.value, m.timestamp, m.step, model_id=logged.model_id, run_id=run_id)
                       for key in run.data.metrics for m in client.get_metric_history(run_id, key) if m.step == step]
            client.log_batch(run_id, metrics=metrics)
    except BaseException:
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    return logged.model_id


def load_model(tracking_uri: str, run_id: str, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model a run logged (`log_model`; the last one if several), on `device`, in eval mode: from a SQLite
    store or a tracking server alike, nothing retrained. A run that shared another's computation (SAME_AS) has
    that run's model."""
    import mlflow.artifacts
    flavour = pytorch_flavour()
    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    if SAME_AS in run.data.tags:
        run = client.get_run(run.data.tags[SAME_AS])
    outputs = run.outputs.model_outputs if run.outputs else []
    if not outputs:
        raise ValueError(f"run {run.info.run_name!r} ({run_id}) in {tracking_uri} logged no model "
                         f"(status {run.info.status}; a run logs its model when its training ends)")
    logged = client.get_logged_model(outputs[-1].model_id)
    if logged.status != LoggedModelStatus.READY:
        raise ValueError(f"the model {logged.model_id} of run {run.info.run_name!r} ({run_id}) is {logged.status}, "
                         "not READY: its upload failed")
    with tempfile.TemporaryDirectory() as tmp:
        local = mlflow.artifacts.download_artifacts(artifact_uri=logged.artifact_location, dst_path=tmp,
                                                    tracking_uri=tracking_uri)
        model = flavour.load_model(local, map_location=device)
    return model.eval()
