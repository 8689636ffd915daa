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
`batches` needs none of them.
"""
