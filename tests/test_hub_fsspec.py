"""A saved cache at an fsspec URL (s3://, gs://, ...): saved, loaded and checked as a local folder is. Tested
with fsspec's in-memory filesystem and file:// (the cloud ones are the same calls on another backend)."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from hf_varrate import CacheFileError, VarRateCache
from hf_varrate.cache_checks import CONFIG_NAME, TENSORS_NAME

from test_serialization import answer, compressed

fsspec = pytest.importorskip("fsspec")


@pytest.fixture
def memory():
    fs = fsspec.filesystem("memory")
    yield fs
    if fs.exists("/docs"):
        fs.rm("/docs", recursive=True)


def test_memory_url_round_trip_answers_the_same(tiny_llama, memory):
    cache = compressed(tiny_llama, "compact")
    expected = answer(tiny_llama, copy.deepcopy(cache))
    cache.save_pretrained("memory://docs/doc-1")
    assert sorted(memory.ls("/docs/doc-1", detail=False)) == sorted(
        [f"/docs/doc-1/{CONFIG_NAME}", f"/docs/doc-1/{TENSORS_NAME}"])
    loaded = VarRateCache.load("memory://docs", model=tiny_llama, subfolder="doc-1", storage="materialized")
    assert loaded.get_seq_length() == 300
    assert torch.equal(answer(tiny_llama, loaded), expected)


def test_file_url_is_an_ordinary_saved_folder(tiny_llama, tmp_path):
    cache = compressed(tiny_llama, "materialized")
    expected = answer(tiny_llama, copy.deepcopy(cache))
    cache.save_pretrained(f"file://{tmp_path}/doc")
    for source in (f"file://{tmp_path}/doc", tmp_path / "doc"):
        assert torch.equal(answer(tiny_llama, VarRateCache.load(source, model=tiny_llama)), expected)


def test_a_damaged_or_missing_file_at_a_url_is_refused(tiny_llama, memory):
    compressed(tiny_llama, "compact").save_pretrained("memory://docs/doc-2")
    with pytest.raises(CacheFileError, match="holds no cache.safetensors or cache_config.json"):
        VarRateCache.load("memory://docs/none", model=tiny_llama)
    data = bytearray(memory.cat_file(f"/docs/doc-2/{TENSORS_NAME}"))
    data[-1] ^= 0xFF
    memory.pipe_file(f"/docs/doc-2/{TENSORS_NAME}", bytes(data))
    with pytest.raises(CacheFileError, match="does not match the sha256"):
        VarRateCache.load("memory://docs/doc-2", model=tiny_llama)
    memory.rm(f"/docs/doc-2/{TENSORS_NAME}")
    with pytest.raises(CacheFileError, match="holds no cache.safetensors"):
        VarRateCache.load("memory://docs/doc-2", model=tiny_llama)


def test_without_fsspec_a_url_says_what_to_install(tiny_llama, monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec.core", None)
    with pytest.raises(ImportError, match=r"pip install 'hf_varrate\[fsspec\]'"):
        VarRateCache.load("s3://bucket/doc", model=tiny_llama)
