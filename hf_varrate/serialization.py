"""Save a compressed cache and load it in another process: compress a document once, answer later.

A saved cache is a directory of two plain files:

- `cache.safetensors`: per VarRate layer and row, the codes (`neighbours`, `ranks`, coefficients or
  their quantized `codes` / `mins` / `steps`) and the exact tokens; the tokens appended after the
  prefill; the sliding layers' K/V; the RoPE `inv_freq` the keys were rotated with.
- `cache_config.json`: sorted keys: format version, library version, the `VarRateConfig`, the
  model's shape, where the bases came from and a sha256 fingerprint of them, per-layer bookkeeping,
  and the sha256 of the tensor file, checked before it is read.

Only safetensors and JSON are read: no pickle, no `torch.load`. Whatever is wrong with a saved cache
(missing, corrupt, another model, other bases, or fields and tensors that disagree: every one is checked
before anything is built) raises `CacheFileError` saying what and how to fix it.
A cache saved in either storage mode holds codes only, so it is as small as the footprint says.

This module owns the files: writing and reading them (atomically, sha256-checked). What a layer or a
code holds in them is the layer's and the code's business (`to_tensors` / `from_tensors`), so the
saved-cache format changes in one place; the checks of the parsed contents live in
`hf_varrate.cache_checks`, with the file names and the format version.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers.cache_utils import DynamicSlidingWindowLayer

from .bases import Bases
from .binding import bind
from .cache_checks import CONFIG_NAME, FORMAT_VERSION, TENSORS_NAME, check_layers, check_meta, check_model, check_rope
from .config import VarRateConfig
from .errors import BasesError, CacheFileError
from .files import sha256_file, write_atomic
from .layers import LAYER_CLASSES, CompactLayer, VarRateLayer
from .version import __version__

MAX_CONFIG_BYTES = 64 << 20  # per-layer bookkeeping of a large batch stays far below this


def bases_fingerprint(bases: Bases) -> str:
    """sha256 over every layer's basis and spectrum (index, dtype, shape, bytes): which bases a cache was
    coded with (`balance="rms"` codes with a basis derived from the spectrum). Bases without a spectrum
    keep the fingerprint they had before spectra existed."""
    digest = hashlib.sha256()
    for i in sorted(bases.tensors):
        for name, tensor in (("", bases.tensors[i]), ("spectrum", bases.spectra.get(i))):
            if tensor is None:
                continue
            tensor = tensor.detach().cpu().contiguous()
            digest.update(f"{name}{i}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# saving ------------------------------------------------------------------------------------------------
def save_cache(cache, directory: str | os.PathLike) -> None:
    """Write `cache` (a VarRateCache after its prefill) to `directory` (created if needed)."""
    tensors, layers = {}, []
    for i, layer in enumerate(cache.layers):
        layers.append(_save_layer(i, layer, tensors))
    if cache.rope is not None:
        tensors["rope.inv_freq"] = cache.rope.inv_freq
    tensors = {name: t.detach().contiguous().cpu().clone() for name, t in tensors.items()}
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    tensor_path = folder / TENSORS_NAME
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp", delete=False) as tmp:
        tmp_name = tmp.name
    save_file(tensors, tmp_name, metadata={"format": "pt", "library": "hf_varrate"})
    digest = sha256_file(Path(tmp_name))
    os.replace(tmp_name, tensor_path)
    shape = cache.model_shape
    meta = {
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "config": cache.config.to_dict(),
        "model": {"model_id": shape.model_id, "num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads,
                  "head_dim": shape.head_dim, "compressed_layers": list(shape.compressed_layers)},
        "bases": {"source": _bases_source(cache), "sha256": bases_fingerprint(cache.bases)},
        "rope_scaling": None if cache.rope is None else cache.rope.scaling,
        "layers": layers,
        "tensor_file": TENSORS_NAME,
        "sha256": digest,
    }
    write_atomic(folder / CONFIG_NAME, json.dumps(meta, indent=1, sort_keys=True).encode())


def _save_layer(i: int, layer, tensors: dict) -> dict:
    if not layer.is_initialized or layer.keys is None:
        return {"kind": "empty"}
    if isinstance(layer, VarRateLayer) and layer.codes:
        info, layer_tensors = layer.to_tensors(f"layers.{i}")
        tensors.update(layer_tensors)
        return info
    tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"] = layer.keys, layer.values
    if isinstance(layer, DynamicSlidingWindowLayer):
        return {"kind": "sliding", "cumulative_length": layer.cumulative_length}
    return {"kind": "exact"}


# loading -----------------------------------------------------------------------------------------------
def load_cache(cls, directory: str | os.PathLike, model, *, bases: Bases | None = None, device=None,
               **config_overrides):
    """Rebuild a saved cache for `model` (see `VarRateCache.load`). Every field and tensor is checked
    (`check_layers`) before anything is built, so a bad file is refused with `CacheFileError`."""
    if model is None:
        raise CacheFileError("model= is required: VarRateCache.load(directory, model=model)")
    folder = Path(directory)
    meta = read_config(folder)
    tensors = read_tensors(folder, meta)
    check_model(meta, model, folder)
    bases = bases if bases is not None else _load_bases(meta, model)
    if bases_fingerprint(bases) != meta["bases"]["sha256"]:
        raise CacheFileError(f"{folder} was coded with other bases than the ones given (sha256 differs); pass the "
                             f"bases it was saved with: VarRateCache.load(dir, model=model, bases=...)")
    try:
        config = VarRateConfig.from_dict(meta["config"], **config_overrides)
    except (TypeError, ValueError) as err:
        raise CacheFileError(f"{folder / CONFIG_NAME} has an invalid config: {err}") from err
    try:  # the cache's own checks of the config against the bases and the model (r_min above the rank cap ...)
        cache = cls(bases, config, model_config=model.config, model=model)
    except ValueError as err:
        given = f" with {config_overrides}" if config_overrides else ""
        raise CacheFileError(f"the config in {folder / CONFIG_NAME}{given} does not fit this model and its bases: "
                             f"{err}") from err
    cache.bases_source = meta["bases"].get("source")
    check_rope(cache, tensors, meta, folder)
    check_layers(cache, meta, tensors, folder, dtype=next(model.parameters()).dtype)
    device = device if device is not None else next(model.parameters()).device
    for i, info in enumerate(meta["layers"]):
        _load_layer(cache, i, info, tensors, device)
    bind(model)
    return cache


def read_config(folder: Path) -> dict:
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise CacheFileError(f"{folder} is not a saved VarRate cache: {CONFIG_NAME} is missing (write one with "
                             f"cache.save_pretrained(dir))")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise CacheFileError(f"{path} is {path.stat().st_size} bytes, larger than any saved cache's config")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CacheFileError(f"{path} is not valid JSON ({err}); save the cache again") from err
    check_meta(meta, path)
    return meta


def read_tensors(folder: Path, meta: dict) -> dict[str, torch.Tensor]:
    path = folder / TENSORS_NAME
    if not path.is_file():
        raise CacheFileError(f"{path} is missing; save the cache again with cache.save_pretrained(dir)")
    if sha256_file(path) != meta["sha256"]:
        raise CacheFileError(f"{path} does not match the sha256 in {CONFIG_NAME} (corrupt or modified); save the "
                             f"cache again")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise CacheFileError(f"{path} is not a readable safetensors file ({err}); save the cache again") from err


def _load_bases(meta: dict, model) -> Bases:
    source = meta["bases"].get("source")
    if source == "identity":
        return Bases.identity(model.config)
    if not source:
        raise CacheFileError("the saved cache does not say where its bases came from; pass them: "
                             "VarRateCache.load(dir, model=model, bases=Bases.from_pretrained(...))")
    try:
        return Bases.from_pretrained(source)
    except (BasesError, OSError) as err:
        raise CacheFileError(f"could not read the bases the cache was saved with ({source}): {err}; pass them: "
                             f"VarRateCache.load(dir, model=model, bases=...)") from err


def _load_layer(cache, i: int, info: dict, tensors: dict, device) -> None:
    """Fill layer i from a checked file (`check_layers`); a coded layer is read compact, then held the
    way the cache's config says."""
    layer, kind = cache.layers[i], info["kind"]
    if kind == "empty":
        return
    if kind in ("sliding", "exact"):
        keys, values = tensors[f"layers.{i}.keys"].to(device), tensors[f"layers.{i}.values"].to(device)
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if kind == "sliding":
            layer.cumulative_length = info["cumulative_length"]
        else:
            layer.prefilled = True
        return
    loaded = CompactLayer.from_tensors(layer, info, tensors, f"layers.{i}", device)
    cache.layers[i] = LAYER_CLASSES[layer.storage].from_layer(loaded)


def _bases_source(cache) -> str | None:
    """Where the bases can be read again: the path or repo id they were loaded from (a local folder
    made absolute, so the cache loads from any working directory), 'identity', or None."""
    source = getattr(cache, "bases_source", None) or _source_of(cache.bases)
    if source and source != "identity" and Path(source).is_dir():
        source = str(Path(source).resolve())
    return source


def _source_of(bases: Bases) -> str | None:
    if bases.metadata.get("calibration") == "identity":
        return "identity"
    return bases.metadata.get("bases_ref") or bases.metadata.get("source")
