"""Calibration text streamed with `datasets` (`streaming=True`): a Hub dataset id, or a large local file.

Nothing is read up front: the documents come one at a time as `build_contexts` asks for them, so a
calibration reads only the text its contexts need (or `--max-tokens` of it), never the whole dataset.
Order: the dataset's own, through a seeded shuffle buffer of `SHUFFLE_BUFFER` rows (a stream cannot be
shuffled whole), so `(source, config, split, seed)` fixes the text. `datasets` is the optional extra
`eval`: pip install 'hf_varrate[eval]'.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

SHUFFLE_BUFFER = 10_000
STREAM_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(source: str) -> bool:
    """An "org/name" that is not a local path: a Hub dataset id (always streamed)."""
    return not Path(source).exists() and Path(source).suffix not in STREAM_SUFFIXES and bool(HUB_ID.match(source))


def stream_documents(source: str, *, text_field: str = "text", seed: int | None = 0, config_name: str | None = None,
                     split: str = "train") -> Iterator[str]:
    """The non-empty texts of `source`, lazily: a Hub dataset id (`config_name` and `split` apply), a local
    .json/.jsonl/.parquet/.csv/.arrow file, or a folder written by `Dataset.save_to_disk`."""
    dataset = open_stream(source, config_name, split)
    if seed is not None:
        dataset = dataset.shuffle(seed=seed, buffer_size=SHUFFLE_BUFFER)
    return _texts(dataset, text_field, source)


def open_stream(source: str, config_name: str | None = None, split: str = "train"):
    """A `datasets.IterableDataset` over `source` (see `stream_documents`)."""
    datasets = import_datasets()
    path = Path(source)
    if path.is_dir():
        dataset = datasets.load_from_disk(str(path))
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset[split]
        return dataset.to_iterable_dataset()
    if path.is_file():
        if path.suffix not in STREAM_SUFFIXES:
            raise ValueError(f"cannot stream {path}: use one of {', '.join(STREAM_SUFFIXES)} or a saved dataset folder")
        return datasets.load_dataset(STREAM_SUFFIXES[path.suffix], data_files=str(path), split="train", streaming=True)
    if not HUB_ID.match(source):
        raise FileNotFoundError(f"calibration text {source} is neither a local file or folder nor a Hub dataset id "
                                f"(org/name)")
    return datasets.load_dataset(source, config_name, split=split, streaming=True)


def _texts(dataset, text_field: str, source: str) -> Iterator[str]:
    for row in dataset:
        if text_field not in row:
            raise ValueError(f"dataset {source} has no column {text_field!r} (columns: {sorted(row)}); "
                             f"choose one with --text-field")
        text = row[text_field]
        if isinstance(text, str) and text.strip():
            yield text


def import_datasets():
    """The `datasets` module, or an ImportError that says how to install it."""
    try:
        import datasets
    except ImportError as err:
        raise ImportError("reading a dataset needs the datasets package: pip install 'hf_varrate[eval]'") from err
    return datasets
