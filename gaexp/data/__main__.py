"""`python -m gaexp.data`: fetch a dataset (its files, a download, or a folder's cache) and print what it holds."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

import yaml

from gaexp.data.catalog import DataError, data_config, names
from gaexp.data.dataset import fetch, open_dataset


def main(argv: Sequence[str] | None = None) -> None:
    """python -m gaexp.data: fetch a dataset (files, download, or a folder's cache) and print what it holds."""
    parser = argparse.ArgumentParser(prog="python -m gaexp.data",
                                     description="Find, build or download a dataset under a data root, and check it.")
    parser.add_argument("--dataset", default="mnist", help=f"one of {', '.join(names())} (default: %(default)s)")
    parser.add_argument("--root", default="outputs/data", help="data root (default: %(default)s)")
    parser.add_argument("--sources", default=None,
                        help="comma-separated, tried in order (default: the dataset's, conf/data/DATASET.yaml)")
    parser.add_argument("keys", nargs="*", metavar="data.KEY=VALUE",
                        help="the dataset's other keys, e.g. data.path=/data/pets data.size=[64,64]")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        keys = {}
        for item in args.keys:
            name, sep, value = item.partition("=")
            if not sep or not name.startswith("data."):
                raise DataError(f"{item!r}; valid: data.KEY=VALUE, e.g. data.path=/data/pets")
            keys[name.removeprefix("data.")] = yaml.safe_load(value)
        data = data_config(args.dataset, args.root, args.sources.split(",") if args.sources else None, **keys)
        fetch(data)
        d = open_dataset(data, progress=True)
    except (DataError, ValueError) as e:
        sys.exit(f"error: {e}")
    test = f" + {len(d.test):,} test" if d.test is not None else ""
    digest = f", digest {d.meta.digest}" if d.meta.digest else ""
    if data.kind == "text":
        print(f"{d.meta.name}: {len(d.train):,} sequences of up to {d.meta.shape[-1] - 1} predicted tokens "
              f"({'packed' if data.packed else 'one per document'}), {d.meta.num_classes} byte values, from "
              f"{d.meta.source}{digest}")
        return
    print(f"{d.meta.name}: {len(d.train):,} training{test} images of {'x'.join(map(str, d.meta.shape))}, "
          f"{d.meta.num_classes} classes, from {d.meta.source}{digest}")


if __name__ == "__main__":
    main()
