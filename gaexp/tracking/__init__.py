"""MLflow: prepare the store once, then one flat run per grid cell. Everything goes through an explicit
`MlflowClient(tracking_uri)`: no process-wide tracking URI or active-run stack.

The wing, bottom up: store (prepared once), search (searches to the last page, a sweep's runs), record (a run that
always ends, its params, evaluations and summary), resume (the protocol key, skipping and stale runs), inputs (its
datasets), models (its model). The tags it writes are declared in gaexp/tags.py, the metrics in gaexp/metrics.py.
`gaexp.tracking` names each module's public names.
"""

from gaexp.tracking.store import (is_remote, check_server, without_userinfo, prepare_store, TAGS_INDEX, index_tags,
                                  experiment_id)
from gaexp.tracking.search import PAGE_SIZE, search_all, bulk_read, newest_run, sweeps_of, runs_in_sweep
from gaexp.tracking.record import (MAX_PARAM_LENGTH, MAX_TAG_LENGTH, flatten, curves_tags, curves_of, tracked_run,
                                   log_masked_artifacts, log_params, log_shared, log_eval_point, MlflowLogger, log_summary)
from gaexp.tracking.resume import (protocol_key, find_finished, recorded_process, live_runs, wait_for_live_runs,
                                   shared_source, add_to_sweep, mark_stale_runs, fail_runs_of)
from gaexp.tracking.inputs import (DATA_CONTEXT, TRAINING, VALIDATION, data_digest, dataset_input, data_inputs,
                                   PREPROCESSING, content_inputs, log_content_inputs, DUPLICATE, log_data_inputs)
from gaexp.tracking.models import MODEL_NAME, log_model, load_model

__all__ = ["is_remote", "check_server", "without_userinfo", "prepare_store", "TAGS_INDEX", "index_tags",
           "experiment_id", "PAGE_SIZE", "search_all", "bulk_read", "newest_run", "sweeps_of", "runs_in_sweep",
           "MAX_PARAM_LENGTH", "MAX_TAG_LENGTH", "flatten", "curves_tags", "curves_of", "tracked_run",
           "log_masked_artifacts", "log_params", "log_shared", "log_eval_point", "MlflowLogger", "log_summary", "protocol_key",
           "find_finished", "recorded_process", "live_runs", "wait_for_live_runs", "shared_source", "add_to_sweep", "mark_stale_runs",
           "fail_runs_of",
           "DATA_CONTEXT", "TRAINING", "VALIDATION", "data_digest", "dataset_input", "data_inputs", "PREPROCESSING",
           "content_inputs", "log_content_inputs", "DUPLICATE", "log_data_inputs", "MODEL_NAME", "log_model",
           "load_model"]
