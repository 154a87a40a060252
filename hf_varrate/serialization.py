"""Save a compressed cache and load it in another process: compress a document once, answer later.

A saved cache is a directory of two plain files:

- `cache.safetensors`: per VarRate layer and row, the codes (`neighbours`, `ranks`, coefficients or
  their quantized `codes` / `mins` / `steps`) and the exact tokens; the tokens appended after the
  prefill; the sliding layers' K/V; the RoPE `inv_freq` the keys were rotated with.
- `cache_config.json`: sorted keys: format version, library version, the `VarRateConfig`, the
  model's shape and id, where the bases came from and a sha256 fingerprint of them, per-layer
  bookkeeping, the sha256 of the tensor file, and `config_sha256`, the sha256 of the JSON itself
  (`cache_checks.seal`): both are checked before anything is read, so neither file can be edited.

A save replaces the directory as a whole (`files.replacing_folder`): both files are written into a
temporary folder beside it, which then takes its place in one step. A failed or killed save leaves
the previous save as it was; a save never mixes the files of two.

Only safetensors and JSON are read: no pickle, no `torch.load`. Whatever is wrong with a saved cache
(missing, corrupt, another model, other bases, or fields and tensors that disagree: every one is checked
before anything is built) raises `CacheFileError` saying what and how to fix it. What was fixed when the
prompt was coded (budget, balance, stride ...) is fixed for good: `load` takes only the runtime
settings (`VarRateConfig.runtime_fields()`: storage, projection_dtype).
A cache saved in either storage mode holds codes only, so it is as small as the footprint says.

The same folder can be a Hub repo (or a subfolder of one: `push_cache` uploads it with a model card as
one commit; `load_cache` takes a repo id with the standard Hub arguments) or an fsspec URL (s3://...,
for `save_cache` and `load_cache`): `hf_varrate.hub` moves the files, which are checked as a local
folder's, so another server answers from the same codes.

This module owns the files: writing and reading them. What a layer or a code holds in them is the
layer's and the code's business (`to_tensors` / `from_tensors`), so the saved-cache format changes in
one place; the checks of the parsed contents live in `hf_varrate.cache_checks`, with the file names and
the format version.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers.cache_utils import DynamicSlidingWindowLayer

from .bases import Bases
from .bases_checks import CARD_NAME, looks_local
from .binding import bind
from .card import render_cache_card, tensor_header
from .cache_checks import (
    CONFIG_NAME,
    FLOAT_DTYPES,
    FORMAT_VERSION,
    TENSORS_NAME,
    check_layers,
    check_meta,
    check_model,
    check_rope,
    seal,
)
from .config import VarRateConfig
from .devices import layer_devices
from .errors import BasesError, CacheFileError, VarRateWarning
from .files import interrupted_save, replacing_folder, sha256_file
from .hub import check_subfolder, download_files, fetched, is_url, put_files, upload_files
from .layers import LAYER_CLASSES, CompactLayer, VarRateLayer
from .shipped import shipped_path
from .version import __version__

MAX_CONFIG_BYTES = 64 << 20  # per-layer bookkeeping of a large batch stays far below this
_HINT = ("Pass the folder or URL a cache was saved to (cache.save_pretrained(dir_or_url)) or the Hub repo it was "
         "pushed to (cache.push_to_hub(repo_id))")


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
    """Write `cache` (a VarRateCache after its prefill) to `directory` (created if needed), replacing a
    previous save there as a whole. On any error nothing at `directory` has changed. An fsspec URL gets the
    files of a local save (`hub.put_files`)."""
    if is_url(directory):
        with tempfile.TemporaryDirectory(prefix="hf_varrate-cache-") as staging:
            save_cache(cache, Path(staging) / "cache")
            return put_files(Path(staging) / "cache", str(directory), (TENSORS_NAME, CONFIG_NAME))
    tensors, layers = {}, []
    for i, layer in enumerate(cache.layers):
        layers.append(_save_layer(i, layer, tensors))
    if cache.rope is not None:
        tensors["rope.inv_freq"] = cache.rope.inv_freq
    tensors = {name: t.detach().contiguous().cpu().clone() for name, t in tensors.items()}
    header = tensor_header("cache", cache.model_shape.model_id, FORMAT_VERSION, bases=_bases_source(cache))
    with replacing_folder(directory, (TENSORS_NAME, CONFIG_NAME), "VarRate cache") as folder:
        _write_tensors(tensors, header, folder / TENSORS_NAME, Path(directory))
        meta = _metadata(cache, layers, sha256_file(folder / TENSORS_NAME))
        with open(folder / CONFIG_NAME, "xb") as handle:
            handle.write(json.dumps(seal(meta), indent=1, sort_keys=True).encode())


def _write_tensors(tensors: dict, header: dict, path: Path, target: Path) -> None:
    try:
        save_file(tensors, str(path), metadata=header)
    except SafetensorError as err:  # safetensors reports a full disk or an I/O error as its own type
        raise OSError(f"could not write the cache's tensors for {target}: {err}; nothing there was changed "
                      f"(free some space, or save elsewhere)") from err


def _metadata(cache, layers: list, tensors_sha256: str) -> dict:
    shape = cache.model_shape
    return {
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "config": cache.config.to_dict(),
        "model": {"model_id": shape.model_id, "num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads,
                  "head_dim": shape.head_dim, "compressed_layers": list(shape.compressed_layers)},
        "bases": {"source": _bases_source(cache), "revision": getattr(cache.bases, "revision", None),
                  "commit": getattr(cache.bases, "commit", None), "subfolder": getattr(cache.bases, "subfolder", None),
                  "sha256": bases_fingerprint(cache.bases), "dtype": _bases_dtype(cache.bases)},
        "rope_scaling": None if cache.rope is None else cache.rope.scaling,
        "layers": layers,
        "tensor_file": TENSORS_NAME,
        "sha256": tensors_sha256,
    }


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
def load_cache(cls, path_or_repo_id: str | os.PathLike, model, *, bases: Bases | None = None, device=None,
               revision: str | None = None, subfolder: str | None = None, cache_dir=None, force_download: bool = False,
               local_files_only: bool = False, token: str | bool | None = None, **runtime):
    """Rebuild a saved cache for `model` (see `VarRateCache.load`) from a folder or a Hub repo id (`locate`).
    Every field and tensor is checked (`check_layers`) before anything is built, so a bad file is refused
    with `CacheFileError`; `runtime` may set only the runtime settings (storage, projection_dtype)."""
    if model is None:
        raise CacheFileError("model= is required: VarRateCache.load(path_or_repo_id, model=model)")
    if is_url(path_or_repo_id):  # checked in a temporary local copy
        url = f"{str(path_or_repo_id).rstrip('/')}/{check_subfolder(subfolder)}" if subfolder else str(path_or_repo_id)
        with fetched(url, (TENSORS_NAME, CONFIG_NAME), error=CacheFileError, hint=_HINT) as folder:
            return load_cache(cls, folder, model, bases=bases, device=device, **runtime)
    hub = {"cache_dir": cache_dir, "local_files_only": local_files_only, "token": token}
    folder = locate(path_or_repo_id, revision=revision, subfolder=subfolder, force_download=force_download, **hub)
    meta = read_config(folder)
    config = _saved_config(meta, runtime, folder)
    tensors = read_tensors(folder, meta)
    for note in check_model(meta, model, folder):
        warnings.warn(note, VarRateWarning, stacklevel=3)
    bases = bases if bases is not None else _load_bases(meta, model, hub)
    if bases_fingerprint(bases) != meta["bases"]["sha256"]:
        raise CacheFileError(f"{folder} was coded with other bases than the ones given (sha256 differs); pass the "
                             f"bases it was saved with: VarRateCache.load(dir, model=model, bases=...)")
    try:  # the cache's own checks of the config against the bases and the model (r_min above the rank cap ...)
        cache = cls(bases, config, model_config=model.config, model=model)
    except ValueError as err:
        raise CacheFileError(f"the config in {folder / CONFIG_NAME} does not fit this model and its bases: "
                             f"{err}") from err
    cache.bases_source = meta["bases"].get("source")
    check_rope(cache, tensors, meta, folder)
    check_layers(cache, meta, tensors, folder, dtype=next(model.parameters()).dtype)
    placed = {} if device is not None else layer_devices(model)  # a model split across devices: each layer's own
    device = device if device is not None else next(model.parameters()).device
    for i, info in enumerate(meta["layers"]):
        _load_layer(cache, i, info, tensors, placed.get(i, device))
    bind(model)
    return cache


def locate(path_or_repo_id: str | os.PathLike, *, subfolder: str | None = None, **hub) -> Path:
    """The local folder of a saved cache: `path_or_repo_id` (its `subfolder`) if that is a folder or can only
    be a path, else the repo's two files downloaded into the HF cache (`hub.download_files`)."""
    subfolder = check_subfolder(subfolder)
    folder = Path(path_or_repo_id).expanduser() / (subfolder or "")
    if folder.is_dir() or looks_local(str(path_or_repo_id)) or interrupted_save(folder) is not None:
        return folder
    return download_files(str(path_or_repo_id), (TENSORS_NAME, CONFIG_NAME), required=(TENSORS_NAME, CONFIG_NAME),
                          error=CacheFileError, subfolder=subfolder, hint=_HINT, **hub)


def push_cache(cache, repo_id: str, *, subfolder: str | None = None, commit_message: str | None = None, **upload):
    """Save `cache` to a temporary folder, read it back through the loader's checks, and upload its two files
    and a model card to `repo_id` as one commit (`hub.upload_files`: `private`, `revision`, `token`,
    `create_pr`). Returns the `CommitInfo`."""
    cache.compress()  # a held prompt is coded first, as save_pretrained does
    source = _bases_source(cache)
    if source and source != "identity" and shipped_path(source) is None and Path(source).is_absolute():
        warnings.warn(f"the cache's bases were read from the local folder {source}, which another machine cannot "
                      f"read: push them too (bases.push_to_hub(repo_id)) and build caches from the repo id, or pass "
                      f"bases= to VarRateCache.load there", VarRateWarning, stacklevel=3)
    with tempfile.TemporaryDirectory(prefix="hf_varrate-cache-") as staging:
        folder = Path(staging) / "cache"
        save_cache(cache, folder)
        meta = read_config(folder)
        read_tensors(folder, meta)  # never upload what would not load
        card = render_cache_card(meta, meta["sha256"], repo_id, check_subfolder(subfolder))
        (folder / CARD_NAME).write_text(card, encoding="utf-8")
        message = commit_message or f"Upload a VarRate-compressed cache for {cache.model_shape.model_id}"
        return upload_files(folder, repo_id, (TENSORS_NAME, CONFIG_NAME, CARD_NAME), subfolder=subfolder,
                            commit_message=message, **upload)


def _saved_config(meta: dict, runtime: dict, folder: Path) -> VarRateConfig:
    """The config the prompt was coded with, with the runtime settings in `runtime` applied. A coding-time
    setting is refused (unless it repeats the saved value): the codes were made with the saved one."""
    allowed = VarRateConfig.runtime_fields()
    fixed = {k: v for k, v in runtime.items() if k not in allowed and meta["config"].get(k, object()) != v}
    if fixed:
        name = next(iter(fixed))
        VarRateConfig.check_keys([name])  # a misspelt name: TypeError with the closest field
        raise ValueError(f"{name}={fixed[name]!r}: {name} is fixed when the prompt is coded (this cache was coded "
                         f"with {name}={meta['config'].get(name)!r}), so VarRateCache.load cannot change it; it "
                         f"takes only the runtime settings {list(allowed)}. To use {name}={fixed[name]!r}, code "
                         f"the prompt again")
    saved = {"basis_bits": None, **meta["config"]}  # a save from before basis_bits was coded with the stored basis
    try:
        return VarRateConfig.from_dict(saved, **runtime)
    except (TypeError, ValueError) as err:
        raise CacheFileError(f"{folder / CONFIG_NAME} has an invalid config: {err}") from err


def read_config(folder: Path) -> dict:
    path = folder / CONFIG_NAME
    if not folder.exists() and interrupted_save(folder) is not None:
        raise CacheFileError(f"{folder} is missing: a save into it was killed mid-swap and left the previous save at "
                             f"{interrupted_save(folder)}; rename that folder back to {folder.name}")
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
    if meta["format_version"] < 2:
        warnings.warn(f"{path} was saved by an older hf_varrate (format {meta['format_version']}), whose settings "
                      f"are not covered by a checksum; it loads as is. Save it again (cache.save_pretrained(dir)) "
                      f"to add one", VarRateWarning, stacklevel=4)
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


def _load_bases(meta: dict, model, hub: dict) -> Bases:
    source = meta["bases"].get("source")
    if source == "identity":
        name = meta["bases"].get("dtype") or "float32"
        dtype = FLOAT_DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise CacheFileError(f"bases.dtype is {meta['bases'].get('dtype')!r}, expected one of "
                                 f"{sorted(FLOAT_DTYPES)}; save the cache again")
        return Bases.identity(model.config, dtype=dtype)
    if not source:
        raise CacheFileError("the saved cache does not say where its bases came from; pass them: "
                             "VarRateCache.load(dir, model=model, bases=Bases.from_pretrained(...))")
    revision, commit, subfolder = (meta["bases"].get(name) for name in ("revision", "commit", "subfolder"))
    for name, value in (("revision", revision), ("commit", commit), ("subfolder", subfolder)):
        if value is not None and not isinstance(value, str):
            raise CacheFileError(f"bases.{name} is {value!r}, expected null or a string; save the cache again")
    try:  # the commit the bases were read at, not where a branch points now
        return Bases.from_pretrained(source, revision=commit or revision, subfolder=subfolder, **hub)
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
    source = getattr(cache.bases, "source", None) or getattr(cache, "bases_source", None) or _source_of(cache.bases)
    if source and source != "identity" and shipped_path(source) is None and Path(source).is_dir():
        source = str(Path(source).resolve())
    return source


def _source_of(bases: Bases) -> str | None:
    if bases.metadata.get("calibration") == "identity":
        return "identity"
    return bases.metadata.get("bases_ref") or bases.metadata.get("source")


def _bases_dtype(bases: Bases) -> str:
    """The dtype the bases are held in: identity bases are rebuilt in it at load (fp16 and fp32 identities
    fingerprint differently)."""
    return str(next(iter(bases.tensors.values())).dtype).removeprefix("torch.")
