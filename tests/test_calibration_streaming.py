"""Streamed calibration text: local dataset files and folders read lazily through `datasets` streaming,
a Hub id routed to `load_dataset(..., streaming=True)` (faked: nothing downloads), `max_tokens`, and the
command line's --streaming / --max-tokens. Needs `datasets` (the `eval` extra) except where noted."""

from __future__ import annotations

import json

import pytest
import torch

from hf_varrate import Bases
from hf_varrate.calibration import __main__ as cli
from hf_varrate.calibration import build_contexts, load_texts
from hf_varrate.calibration.stream import is_hub_id

DOCUMENTS = [f"document {i}: " + "word " * (5 + i % 7) for i in range(60)]


class CharTokenizer:
    """One token per character; `add_special_tokens` prepends BOS (id 1)."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [2 + ord(c) % 120 for c in text]}


class Counted:
    """An iterable that counts how many documents were taken from it."""

    def __init__(self, documents):
        self.documents, self.taken = documents, 0

    def __iter__(self):
        for document in self.documents:
            self.taken += 1
            yield document


@pytest.fixture
def datasets(monkeypatch):
    datasets = pytest.importorskip("datasets", reason="streaming needs the datasets package (the eval extra)")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # a slip would fail, not download
    return datasets


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCUMENTS)))
    return path


# max_tokens and laziness (no datasets needed) --------------------------------------------------------------
def test_contexts_read_only_the_documents_they_need():
    documents = Counted(DOCUMENTS)
    contexts = build_contexts(CharTokenizer(), documents, 2, 60)
    assert len(contexts) == 2 and documents.taken < 10


def test_max_tokens_caps_the_text_read():
    documents = Counted(DOCUMENTS)
    with pytest.raises(ValueError, match=r"stopped at max_tokens=100: raise --max-tokens"):
        build_contexts(CharTokenizer(), documents, 3, 60, max_tokens=100)
    assert documents.taken <= 5  # about 100 characters of text, then it stopped
    enough = build_contexts(CharTokenizer(), DOCUMENTS, 2, 60, max_tokens=10_000, progress=True)
    assert all(torch.equal(a, b) for a, b in zip(enough, build_contexts(CharTokenizer(), DOCUMENTS, 2, 60)))
    with pytest.raises(ValueError, match="max_tokens must be a positive"):
        build_contexts(CharTokenizer(), DOCUMENTS, 2, 60, max_tokens=0)


def test_what_counts_as_a_hub_id(tmp_path):
    assert is_hub_id("Salesforce/wikitext") and not is_hub_id("wikitext")
    assert not is_hub_id(str(tmp_path)) and not is_hub_id("data/absent.jsonl")


# local files and folders, streamed -------------------------------------------------------------------------
def test_a_local_jsonl_file_streams_lazily_in_a_seeded_order(datasets, jsonl):
    texts = load_texts(str(jsonl), streaming=True, seed=0)
    assert not isinstance(texts.documents, list) and texts.name == str(jsonl)
    first = list(texts.documents)
    assert sorted(first) == sorted(DOCUMENTS) and first != DOCUMENTS
    assert list(load_texts(str(jsonl), streaming=True, seed=0).documents) == first
    assert list(load_texts(str(jsonl), streaming=True, seed=1).documents) != first


def test_saved_dataset_folders_and_parquet_files_stream(datasets, tmp_path):
    dataset = datasets.Dataset.from_dict({"body": DOCUMENTS + ["  "], "n": list(range(61))})
    dataset.save_to_disk(str(tmp_path / "saved"))
    dataset.to_parquet(str(tmp_path / "docs.parquet"))
    for source in (tmp_path / "saved", tmp_path / "docs.parquet"):
        texts = load_texts(str(source), streaming=True, text_field="body")
        assert sorted(texts.documents) == sorted(DOCUMENTS)  # the blank row is skipped
    with pytest.raises(ValueError, match="no column 'text'"):
        next(iter(load_texts(str(tmp_path / "saved"), streaming=True).documents))


def test_a_hub_id_is_streamed(datasets, monkeypatch, jsonl):
    calls, real_load_dataset = [], datasets.load_dataset

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        return real_load_dataset("json", data_files=str(jsonl), split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    texts = load_texts("org/corpus", dataset_config="en", dataset_split="validation")
    assert calls == [("org/corpus", "en", {"split": "validation", "streaming": True})]
    assert texts.name == "org/corpus [en] [validation]"
    contexts = build_contexts(CharTokenizer(), texts.documents, 2, 60)
    assert len(contexts) == 2


def test_a_source_that_is_neither_file_nor_hub_id(datasets, tmp_path):
    with pytest.raises(FileNotFoundError, match="nor a Hub dataset id"):
        list(load_texts(str(tmp_path / "absent"), streaming=True).documents)
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(ValueError, match="cannot stream"):
        list(load_texts(str(tmp_path / "notes.md"), streaming=True).documents)


# the command line ------------------------------------------------------------------------------------------
def test_command_line_streams_within_max_tokens(datasets, tmp_path, tiny_llama, monkeypatch, jsonl):
    monkeypatch.setattr(cli, "load_model", lambda args: (tiny_llama, CharTokenizer(), {"model_id": "tiny/llama"}))
    argv = ["--texts", str(jsonl), "--streaming", "--num-contexts", "2", "--context-length", "150",
            "--rank", "16", "--out", str(tmp_path / "bases"), "--quiet"]
    assert cli.main([*argv, "--max-tokens", "2000"]) == 0
    bases = Bases.from_pretrained(tmp_path / "bases")
    assert bases.metadata["calibration"] == str(jsonl) and bases.metadata["world_size"] == 1
    with pytest.raises(ValueError, match="stopped at max_tokens=200"):
        cli.main([*argv, "--max-tokens", "200"])


def test_command_line_measures_on_another_split_of_the_same_hub_dataset(datasets, tmp_path, tiny_llama, monkeypatch,
                                                                       jsonl):
    splits, real_load_dataset = [], datasets.load_dataset

    def fake_load_dataset(path, name=None, *, split, streaming):
        splits.append(split)
        return real_load_dataset("json", data_files=str(jsonl), split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(cli, "load_model", lambda args: (tiny_llama, CharTokenizer(), {}))
    cli.main(["--texts", "org/corpus", "--eval-texts", "org/corpus", "--eval-dataset-split", "validation",
              "--num-contexts", "2", "--context-length", "150", "--eval-contexts", "1", "--eval-budget", "0.5",
              "--eval-context-length", "300", "--rank", "16",
              "--out", str(tmp_path / "bases"), "--quiet"])
    assert splits == ["train", "validation"]
    meta = Bases.from_pretrained(tmp_path / "bases").metadata
    assert meta["calibration"] == "org/corpus [train]" and meta["quality"]["data"] == "org/corpus [validation]"
