"""The data wing: a dataset from its config to the micro-batches training draws.

- `catalog`: the datasets gaexp knows (conf/data/), a `data` config outside Hydra, `DataError`, and what a reader
  of any kind returns (`Arrays`);
- `limits`: what holding a dataset in memory may take;
- one module per `data.kind`, each a `read(data) -> Arrays`: `idx` (the MNIST family's four IDX files, built from
  their sources and verified by MD5), `torchvision_sets` (a torchvision.datasets class gaexp knows, its own
  download), `folder` (an image folder, decoded once and cached), `custom` (a loader by import path);
- `dataset`: the interface the rest of gaexp uses (`fetch`, `describe`, `open_dataset`, `splits`, `Meta`);
- `batches`: the data in memory (`Split`), the held-out images and the seeded stream of micro-batches;
- `python -m gaexp.data` (`__main__`): fetch a dataset and print what it holds.

Imports point down that list's reverse: `dataset` reads the kinds, the kinds read `catalog` and `limits`;
`batches` needs none of them. `gaexp.data` names what a script of one's own uses (as `from gaexp.data import
data_config` always has); code inside gaexp imports from the module that declares a name.
"""

from gaexp.data.batches import Draw, Split, holdout_split, micro_batch_indices, micro_batches
from gaexp.data.catalog import Arrays, DataError, data_config, names
from gaexp.data.dataset import Dataset, Meta, content_digest, describe, fetch, open_dataset, splits
from gaexp.data.idx import IDX_NAMES, ensure_data, raw_dir, torchvision_class, verify_raw
from gaexp.data.limits import check_memory, memory_limit

__all__ = ["Arrays", "DataError", "Dataset", "Draw", "IDX_NAMES", "Meta", "Split", "check_memory", "content_digest",
           "data_config", "describe", "ensure_data", "fetch", "holdout_split", "memory_limit", "micro_batch_indices",
           "micro_batches", "names", "open_dataset", "raw_dir", "splits", "torchvision_class", "verify_raw"]
