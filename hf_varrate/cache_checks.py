"""Validation of a saved cache's parsed contents, all of it done before anything is built from them.

This module owns the checks: the top-level fields of `cache_config.json` (`check_meta`), the model and
RoPE frequencies the cache was saved for (`check_model`, `check_rope`), and every layer (`check_layers`, in
`hf_varrate.layer_checks`): each field's JSON type and range, each tensor's dtype and shape, and how
they fit together (exact-token counts, ranks vs coefficients, anchor indices, spans and RoPE positions,
layer lengths, and the same batch, tokens and dtype in every layer). Each failure is a `CacheFileError`
naming the field or tensor, what it holds, what was expected and the fix.

The file names, the format version and the JSON's own fingerprint (`seal`, `check_seal`) are defined
here, so that `hf_varrate.serialization` (which writes and reads the files) imports this module and not
the other way round. The layers' checks are `hf_varrate.layer_checks`' (re-exported here).

Format 2 adds `config_sha256` to `cache_config.json`: the sha256 of the file's canonical JSON without
that field (`config_digest`: keys sorted, no spaces). With `sha256` (the tensor file's, inside the
body) it covers everything a save holds, so a hand edit of a setting is refused, not silently obeyed.
Format 1 (no `config_sha256`) is still read, with a warning that its settings are not covered.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .architecture import describe
from .errors import CacheFileError
from .layer_checks import CONFIG_NAME, FLOAT_DTYPES, LAYER_KINDS, TENSORS_NAME, check_layers, expect

FORMAT_VERSION = 2  # 2: cache_config.json carries config_sha256; 1 is still read
READABLE_VERSIONS = (1, 2)
SEAL_FIELD = "config_sha256"


def check_meta(meta, path: Path) -> None:
    """The top level of a parsed `cache_config.json`: required fields, format version, tensor file name,
    JSON types, the bases' fingerprint and source, and each layer's kind."""
    required = ("format_version", "config", "model", "bases", "layers", "sha256", "tensor_file")
    if not isinstance(meta, dict) or any(key not in meta for key in required):
        raise CacheFileError(f"{path} misses fields of a saved cache (needs {list(required)}); save the cache again")
    if type(meta["format_version"]) is not int or meta["format_version"] not in READABLE_VERSIONS:
        raise CacheFileError(f"{path} has format_version {meta['format_version']!r}; this hf_varrate reads "
                             f"{list(READABLE_VERSIONS)} (pip install -U hf_varrate, or save the cache again)")
    check_seal(meta, path)
    if meta["tensor_file"] != TENSORS_NAME:
        raise CacheFileError(f"{path} names tensor file {meta['tensor_file']!r}, expected {TENSORS_NAME!r}")
    for field, kind in (("config", dict), ("model", dict), ("bases", dict), ("layers", list), ("sha256", str)):
        expect(isinstance(meta[field], kind), f"{path}: {field}", meta[field], f"a JSON {kind.__name__}")
    expect(isinstance(meta["bases"].get("sha256"), str), f"{path}: bases.sha256", meta["bases"].get("sha256"),
            "the sha256 (a string) of the bases the cache was coded with")
    source = meta["bases"].get("source")
    expect(source is None or isinstance(source, str), f"{path}: bases.source", source,
            "null, 'identity', a folder or a Hub repo id")
    for i, info in enumerate(meta["layers"]):
        expect(isinstance(info, dict) and info.get("kind") in LAYER_KINDS, f"{path}: layers[{i}]", info,
                f"an object whose kind is one of {list(LAYER_KINDS)}")


def config_digest(meta: dict) -> str:
    """sha256 of a saved cache's JSON body without its `config_sha256`: sorted keys, no spaces."""
    body = {key: value for key, value in meta.items() if key != SEAL_FIELD}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(meta: dict) -> dict:
    """`meta` with its `config_sha256` (re)computed: what `save_cache` writes."""
    return {**meta, SEAL_FIELD: config_digest(meta)}


def check_seal(meta: dict, path: Path) -> None:
    """A format-2 file's JSON is the one its writer fingerprinted (format 1 has no fingerprint to check)."""
    if meta["format_version"] < 2:
        return
    recorded = meta.get(SEAL_FIELD)
    if not isinstance(recorded, str) or recorded != config_digest(meta):
        what = "records no config_sha256" if not isinstance(recorded, str) else "does not match its config_sha256"
        raise CacheFileError(f"{path} {what} (the file was edited or damaged after it was saved); its settings "
                             f"(budget, balance ...) are fixed when a cache is coded and cannot be changed by "
                             f"editing the file: load the cache as saved (runtime settings such as storage= are "
                             f"arguments of VarRateCache.load), or code the prompt again with the settings you want")


def check_model(meta: dict, model, folder: Path) -> list[str]:
    """The model's shape (layers, kv heads, head dim, compressed layers) is the one the cache was saved for.
    Returns warnings: another model id with the same shape loads (the same weights may have another
    name, e.g. a local folder), but its keys and values are the other model's."""
    shape, saved = describe(model.config), meta["model"]
    mine = {"num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
            "compressed_layers": list(shape.compressed_layers)}
    for name, value in mine.items():
        if saved.get(name) != value:
            raise CacheFileError(f"{folder} was saved for another model: {name} is {saved.get(name)!r} there but "
                                 f"{value!r} in this one ({saved.get('model_id')!r} vs {shape.model_id!r})")
    if len(meta["layers"]) != shape.num_layers:
        raise CacheFileError(f"{folder} has {len(meta['layers'])} layers, the model {shape.num_layers}")
    theirs = saved.get("model_id")
    if isinstance(theirs, str) and theirs and shape.model_id and theirs != shape.model_id:
        return [f"{folder} was saved from model {theirs!r} but is loaded into {shape.model_id!r}; the shapes match, "
                f"so it loads, but its keys and values are those {theirs!r} computed: the answers are right only "
                f"if both names are the same weights. Load it with the model it was saved from"]
    return []


def check_rope(cache, tensors: dict, meta: dict, folder: Path) -> None:
    """The RoPE frequencies and scaling the keys were rotated with are this model's (compressed layers need them)."""
    saved = tensors.get("rope.inv_freq")
    if saved is None:
        if any(info["kind"] == "varrate" for info in meta["layers"]):  # their keys are re-rotated at every read
            raise CacheFileError(f"{folder / TENSORS_NAME} holds no rope.inv_freq, which its compressed layers need; "
                                 f"save the cache again with cache.save_pretrained(dir)")
        return
    mine = None if cache.rope is None else cache.rope.inv_freq.cpu()
    if mine is None or saved.dtype != mine.dtype or saved.shape != mine.shape or not torch.equal(saved, mine) or \
            meta.get("rope_scaling") != cache.rope.scaling:
        raise CacheFileError(f"{folder} was saved with other RoPE frequencies than this model's; load it with the "
                             f"model it was saved with")

__all__ = ["CONFIG_NAME", "FLOAT_DTYPES", "TENSORS_NAME", "check_layers"]
