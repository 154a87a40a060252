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
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import HFValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers.cache_utils import DynamicSlidingWindowLayer

from .architecture import describe
from .bases import Bases, BasesError
from .binding import bind
from .codec import PromptCode, QuantizedCoefs
from .codec.quantization import BITS, group_counts, packed_bytes
from .config import VarRateConfig
from .layer import VarRateLayer

TENSORS_NAME = "cache.safetensors"
CONFIG_NAME = "cache_config.json"
FORMAT_VERSION = 1
MAX_CONFIG_BYTES = 64 << 20  # per-layer bookkeeping of a large batch stays far below this


class CacheFileError(ValueError):
    """A saved cache is missing, corrupt, or does not fit the model (or bases) it is loaded with."""


def bases_fingerprint(bases: Bases) -> str:
    """sha256 over every layer's basis (index, dtype, shape, bytes): which bases a cache was coded with."""
    digest = hashlib.sha256()
    for i in sorted(bases.tensors):
        tensor = bases.tensors[i].detach().cpu().contiguous()
        digest.update(f"{i}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# saving ------------------------------------------------------------------------------------------------
def save_cache(cache, directory: str | os.PathLike) -> None:
    """Write `cache` (a VarRateCache after its prefill) to `directory` (created if needed)."""
    from . import __version__

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
    digest = _sha256(Path(tmp_name))
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
    _write_atomic(folder / CONFIG_NAME, json.dumps(meta, indent=1, sort_keys=True).encode())


def _save_layer(i: int, layer, tensors: dict) -> dict:
    if not layer.is_initialized or layer.keys is None:
        return {"kind": "empty"}
    if isinstance(layer, VarRateLayer) and layer.codes and not layer.compact and layer.prompt_kept < layer.prompt_len:
        raise CacheFileError(f"layer {i} was cropped into its compressed prompt in materialized storage, which drops "
                             f"exact tokens its codes need; save before cropping, or use storage='compact'")
    if isinstance(layer, DynamicSlidingWindowLayer):
        tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"] = layer.keys, layer.values
        return {"kind": "sliding", "cumulative_length": layer.cumulative_length}
    if not isinstance(layer, VarRateLayer) or not layer.codes:
        tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"] = layer.keys, layer.values
        return {"kind": "exact"}
    rows = [_save_row(f"layers.{i}.rows.{b}", layer, b, tensors) for b in range(len(layer.codes))]
    tail_k, tail_v = (layer.keys, layer.values) if layer.compact else (
        layer.keys[..., layer.prompt_kept :, :], layer.values[..., layer.prompt_kept :, :])
    tensors[f"layers.{i}.appended_keys"], tensors[f"layers.{i}.appended_values"] = tail_k, tail_v
    return {"kind": "varrate", "prompt_len": layer.prompt_len, "prompt_kept": layer.prompt_kept,
            "appended": layer.appended, "rows": rows, "dtype": str(tail_k.dtype).removeprefix("torch.")}


def _save_row(prefix: str, layer: VarRateLayer, b: int, tensors: dict) -> dict:
    code, span, offset = layer.codes[b], layer._spans[b], layer._offsets[b]
    if offset is None:
        raise CacheFileError(f"layer {layer.layer_idx} row {b}: its keys were rotated at positions the cache did not "
                             f"record (no rotary frequencies, or custom position ids), so it cannot be rebuilt; build "
                             f"the cache with model=model and let the model number the positions")
    exact_k, exact_v = layer.exact_tokens(b)
    tensors[f"{prefix}.exact_keys"], tensors[f"{prefix}.exact_values"] = exact_k, exact_v
    row = {"seq_len": code.seq_len, "stride": code.stride, "window": code.window, "width": code.width,
           "kv_bytes": code.kv_bytes, "stored_exactly": code.stored_exactly, "rope_offset": offset,
           "span": list(span) if isinstance(span, tuple) else None}
    if not isinstance(span, tuple):
        tensors[f"{prefix}.slots"] = span
    if code.stored_exactly:
        return row
    tensors[f"{prefix}.neighbours"], tensors[f"{prefix}.ranks"] = code.neighbours, code.ranks
    if isinstance(code.coefs, QuantizedCoefs):
        q = code.coefs
        tensors[f"{prefix}.codes"], tensors[f"{prefix}.mins"], tensors[f"{prefix}.steps"] = q.codes, q.mins, q.steps
        row["quantized"] = {"bits": q.bits, "group": q.group, "count": q.count}
    else:
        tensors[f"{prefix}.coefs"] = code.coefs
    return row


# loading -----------------------------------------------------------------------------------------------
def load_cache(cls, directory: str | os.PathLike, model, *, bases: Bases | None = None, device=None,
               **config_overrides):
    """Rebuild a saved cache for `model` (see `VarRateCache.load`). Every field and tensor is checked
    (`_check_layers`) before anything is built, so a bad file is refused with `CacheFileError`."""
    if model is None:
        raise CacheFileError("model= is required: VarRateCache.load(directory, model=model)")
    folder = Path(directory)
    meta = read_config(folder)
    tensors = read_tensors(folder, meta)
    _check_model(meta, model, folder)
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
    _check_rope(cache, tensors, meta, folder)
    _check_layers(cache, meta, tensors, folder)
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
    required = ("format_version", "config", "model", "bases", "layers", "sha256", "tensor_file")
    if not isinstance(meta, dict) or any(key not in meta for key in required):
        raise CacheFileError(f"{path} misses fields of a saved cache (needs {list(required)}); save the cache again")
    if type(meta["format_version"]) is not int or meta["format_version"] != FORMAT_VERSION:
        raise CacheFileError(f"{path} has format_version {meta['format_version']!r}; this hf_varrate reads "
                             f"{FORMAT_VERSION} (pip install -U hf_varrate, or save the cache again)")
    if meta["tensor_file"] != TENSORS_NAME:
        raise CacheFileError(f"{path} names tensor file {meta['tensor_file']!r}, expected {TENSORS_NAME!r}")
    for field, kind in (("config", dict), ("model", dict), ("bases", dict), ("layers", list), ("sha256", str)):
        _expect(isinstance(meta[field], kind), f"{path}: {field}", meta[field], f"a JSON {kind.__name__}")
    _expect(isinstance(meta["bases"].get("sha256"), str), f"{path}: bases.sha256", meta["bases"].get("sha256"),
            "the sha256 (a string) of the bases the cache was coded with")
    source = meta["bases"].get("source")
    _expect(source is None or isinstance(source, str), f"{path}: bases.source", source,
            "null, 'identity', a folder or a Hub repo id")
    for i, info in enumerate(meta["layers"]):
        _expect(isinstance(info, dict) and info.get("kind") in LAYER_KINDS, f"{path}: layers[{i}]", info,
                f"an object whose kind is one of {list(LAYER_KINDS)}")
    return meta


def read_tensors(folder: Path, meta: dict) -> dict[str, torch.Tensor]:
    path = folder / TENSORS_NAME
    if not path.is_file():
        raise CacheFileError(f"{path} is missing; save the cache again with cache.save_pretrained(dir)")
    if _sha256(path) != meta["sha256"]:
        raise CacheFileError(f"{path} does not match the sha256 in {CONFIG_NAME} (corrupt or modified); save the "
                             f"cache again")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise CacheFileError(f"{path} is not a readable safetensors file ({err}); save the cache again") from err


def _check_model(meta: dict, model, folder: Path) -> None:
    shape, saved = describe(model.config), meta["model"]
    mine = {"num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
            "compressed_layers": list(shape.compressed_layers)}
    for name, value in mine.items():
        if saved.get(name) != value:
            raise CacheFileError(f"{folder} was saved for another model: {name} is {saved.get(name)!r} there but "
                                 f"{value!r} in this one ({saved.get('model_id')!r} vs {shape.model_id!r})")
    if len(meta["layers"]) != shape.num_layers:
        raise CacheFileError(f"{folder} has {len(meta['layers'])} layers, the model {shape.num_layers}")


def _check_rope(cache, tensors: dict, meta: dict, folder: Path) -> None:
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


def _load_bases(meta: dict, model) -> Bases:
    source = meta["bases"].get("source")
    if source == "identity":
        return Bases.identity(model.config)
    if not source:
        raise CacheFileError("the saved cache does not say where its bases came from; pass them: "
                             "VarRateCache.load(dir, model=model, bases=Bases.from_pretrained(...))")
    try:
        return Bases.from_pretrained(source)
    except (BasesError, OSError, HFValidationError) as err:  # HFValidationError: not a folder nor a valid repo id
        raise CacheFileError(f"could not read the bases the cache was saved with ({source}): {err}; pass them: "
                             f"VarRateCache.load(dir, model=model, bases=...)") from err


def _load_layer(cache, i: int, info: dict, tensors: dict, device) -> None:
    """Fill layer i from a checked file (`_check_layers`)."""
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
            layer.prefilled, layer.storage = True, "materialized"
        return
    tail_k, tail_v = tensors[f"layers.{i}.appended_keys"].to(device), tensors[f"layers.{i}.appended_values"].to(device)
    layer.lazy_initialization(tail_k, tail_v)
    layer.prefilled = True
    layer.prompt_len, layer.prompt_kept, layer.appended = info["prompt_len"], info["prompt_kept"], info["appended"]
    for b, row in enumerate(info["rows"]):
        code, span = _load_row(f"layers.{i}.rows.{b}", row, tensors, device)
        layer.codes.append(code)
        layer._spans.append(span)
        layer._offsets.append(row["rope_offset"])
    layer.keys, layer.values = tail_k, tail_v
    target, layer.storage = layer.storage, "compact"  # what was read is a compact layer
    if target != "compact":
        layer.set_storage(target)


def _load_row(prefix: str, row: dict, tensors: dict, device) -> tuple[PromptCode, object]:
    get = lambda name: tensors[f"{prefix}.{name}"].to(device)  # noqa: E731
    exact_k, exact_v = get("exact_keys"), get("exact_values")
    empty = torch.empty(0, dtype=torch.int16, device=device)
    code = PromptCode(row["seq_len"], row["stride"], row["window"], empty.view(0, 1), empty, empty.to(exact_k.dtype),
                      row["width"], row["kv_bytes"], row["stored_exactly"], exact_k, exact_v)
    if not code.stored_exactly:
        code.neighbours, code.ranks = get("neighbours"), get("ranks")
        if "quantized" in row:
            q = row["quantized"]
            code.coefs = QuantizedCoefs(get("codes"), get("mins"), get("steps"), q["bits"], q["group"], q["count"])
        else:
            code.coefs = get("coefs")
    span = tuple(row["span"]) if row["span"] is not None else get("slots")
    return code, span


# checking a saved cache's layers: every field's type and range, every tensor's dtype and shape, and how
# they fit together (exact-token counts, ranks vs coefficients, anchor indices, spans, lengths) ----------
LAYER_KINDS = ("empty", "sliding", "exact", "varrate")
FLOAT_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float16, torch.bfloat16, torch.float32,
                                                             torch.float64)}
INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
MAX_INT = 2**31 - 1  # no count, length or setting of a saved cache comes near this
NOT_CONSISTENT = ("this is not a consistent saved cache (a writer's bug or a hand edit): save it again with "
                  "cache.save_pretrained(dir)")


def _check_layers(cache, meta: dict, tensors: dict, folder: Path) -> None:
    """Raise `CacheFileError` naming the first field or tensor that is not what `save_cache` writes.
    Non-empty layers must agree on batch size, sequence length and dtype (attention reads them together)."""
    first = None  # ((batch, length, dtype) or None if empty, where) of layer 0
    for i, info in enumerate(meta["layers"]):
        ctx = _Where(folder, f"layers[{i}]", f"layers.{i}")
        layer = cache.layers[i]
        sliding = isinstance(layer, DynamicSlidingWindowLayer)
        allowed = ("empty", "sliding") if sliding else ("empty", "exact", "varrate")
        _expect(info["kind"] in allowed, ctx.field("kind"), info["kind"], f"one of {list(allowed)} for this model's "
                f"{type(layer).__name__}")
        if info["kind"] == "varrate":
            found = _check_varrate(cache, i, info, tensors, ctx)
        elif info["kind"] in ("sliding", "exact"):
            found = _check_plain(cache, info, tensors, ctx)
        else:
            found = None
        first = first or (found, ctx)
        if found != first[0]:
            raise CacheFileError(f"{folder}: {ctx.json} holds (batch, tokens, dtype) = {_show(found)} but "
                                 f"{first[1].json} holds {_show(first[0])}, and every layer holds the same tokens; "
                                 f"{NOT_CONSISTENT}")


def _check_plain(cache, info: dict, tensors: dict, ctx: _Where) -> tuple:
    """A sliding layer or an uncompressed full-attention layer: keys and values as they were."""
    keys = _check_kv(cache, tensors, ctx, "keys", "values")
    length = keys.shape[2]
    if info["kind"] == "sliding":
        length = _int(info, "cumulative_length", ctx, low=keys.shape[2])  # sliding layers keep only the last tokens
    return keys.shape[0], length, keys.dtype


def _check_varrate(cache, i: int, info: dict, tensors: dict, ctx: _Where) -> tuple:
    prompt_len = _int(info, "prompt_len", ctx, low=1)
    prompt_kept = _int(info, "prompt_kept", ctx, high=prompt_len)
    dtype = FLOAT_DTYPES.get(info["dtype"]) if isinstance(info.get("dtype"), str) else None
    _expect(dtype is not None, ctx.field("dtype"), info.get("dtype"), f"one of {sorted(FLOAT_DTYPES)}")
    tail = _check_kv(cache, tensors, ctx, "appended_keys", "appended_values", dtype=dtype)
    appended = _int(info, "appended", ctx, low=tail.shape[2], high=tail.shape[2])
    rows = info.get("rows")
    _expect(isinstance(rows, list) and len(rows) == tail.shape[0] and rows, ctx.field("rows"), rows,
            f"a non-empty list of {tail.shape[0]} rows (the batch size of {ctx.tensor('appended_keys')})")
    basis = cache.bases.tensors[i]
    rank = min(cache.config.rank or basis.shape[0], basis.shape[0], cache.model_shape.width)
    ends = [_check_row(cache, row, tensors, ctx.row(b), prompt_len, dtype, rank) for b, row in enumerate(rows)]
    _expect(max(ends) == prompt_len, ctx.field("prompt_len"), prompt_len,
            f"{max(ends)}, the slot after the last real token of the longest row")
    return tail.shape[0], prompt_kept + appended, dtype


def _check_row(cache, row, tensors: dict, ctx: _Where, prompt_len: int, dtype, rank: int) -> int:
    """One sequence's code; returns the slot after its last real token."""
    _expect(isinstance(row, dict), ctx.node(), row, "an object (one sequence's code)")
    seq_len = _int(row, "seq_len", ctx, high=prompt_len)
    stride, window = _int(row, "stride", ctx, low=1), _int(row, "window", ctx, low=1)
    width = cache.model_shape.width
    _int(row, "width", ctx, low=width, high=width)
    kv_bytes = torch.empty(0, dtype=dtype).element_size()
    _int(row, "kv_bytes", ctx, low=kv_bytes, high=kv_bytes)
    _expect(isinstance(row.get("stored_exactly"), bool), ctx.field("stored_exactly"), row.get("stored_exactly"),
            "true or false")
    n_exact = seq_len if row["stored_exactly"] else _exact_count(seq_len, stride, window)
    _check_kv(cache, tensors, ctx, "exact_keys", "exact_values", dtype=dtype, batch=1, tokens=n_exact)
    if not row["stored_exactly"]:
        _check_codes(row, tensors, ctx, seq_len - n_exact, -(-seq_len // stride), dtype, rank)
    first, end = _check_span(row, tensors, ctx, seq_len, prompt_len)
    _expect(type(row.get("rope_offset")) is int and row["rope_offset"] in (0, first), ctx.field("rope_offset"),
            row.get("rope_offset"), f"{'0 or ' if first else ''}{first} (where the row's RoPE positions start)")
    return end


def _check_codes(row: dict, tensors: dict, ctx: _Where, n_coded: int, n_anchors: int, dtype, rank: int) -> None:
    """neighbours [C, c] index the anchors, ranks [C] lie in [0, R], the coefficients number sum(ranks)."""
    neighbours = _tensor(tensors, ctx, "neighbours", INT_DTYPES, (n_coded, None))
    _expect(1 <= neighbours.shape[1] <= n_anchors, ctx.tensor("neighbours"), _describe(neighbours),
            f"1 to {n_anchors} anchor indices per coded token")
    _check_values(neighbours, ctx.tensor("neighbours"), 0, n_anchors - 1, "anchor indices")
    ranks = _tensor(tensors, ctx, "ranks", INT_DTYPES, (n_coded,))
    _check_values(ranks, ctx.tensor("ranks"), 0, rank, "ranks (R = min(config rank, basis rank, D))")
    total = int(ranks.long().sum())
    if "quantized" not in row:
        _tensor(tensors, ctx, "coefs", (dtype,), (total,))
        return
    q = row["quantized"]
    _expect(isinstance(q, dict), ctx.field("quantized"), q, "an object with bits, group and count")
    bits = _int(q, "bits", ctx.sub("quantized"))
    _expect(bits in BITS, ctx.field("quantized.bits"), bits, f"one of {list(BITS)}")
    group = _int(q, "group", ctx.sub("quantized"), low=1)
    _int(q, "count", ctx.sub("quantized"), low=total, high=total)
    _tensor(tensors, ctx, "codes", (torch.uint8,), (packed_bytes(total, bits),))
    groups = int(group_counts(ranks, group).sum())
    mins = _tensor(tensors, ctx, "mins", (torch.float16, torch.float32), (groups,))
    _tensor(tensors, ctx, "steps", (mins.dtype,), (groups,))


def _check_span(row: dict, tensors: dict, ctx: _Where, seq_len: int, prompt_len: int) -> tuple[int, int]:
    """The row's real tokens: (start, stop) slots, or null and the slots themselves. Returns (first slot, end)."""
    span = row.get("span", False)
    if span is not None:
        ok = isinstance(span, list) and len(span) == 2 and all(type(v) is int for v in span)
        ok = ok and 0 <= span[0] and span[1] - span[0] == seq_len and span[1] <= prompt_len
        _expect(ok, ctx.field("span"), span, f"null or [start, start + {seq_len}] within the prompt's "
                f"{prompt_len} slots")
        return span[0], span[1]
    slots = _tensor(tensors, ctx, "slots", (torch.int64,), (seq_len,))
    _check_values(slots, ctx.tensor("slots"), 0, prompt_len - 1, "cache slots")
    _expect(bool((slots[1:] > slots[:-1]).all()), ctx.tensor("slots"), _Text("not increasing"), "increasing slots")
    return (int(slots[0]), int(slots[-1]) + 1) if seq_len else (0, 0)


def _check_kv(cache, tensors: dict, ctx: _Where, key_name: str, value_name: str, *, dtype=None, batch=None,
              tokens=None) -> torch.Tensor:
    """keys and values [B, H, n, d] of the model's H and d, in one float dtype; returns the keys."""
    shape = (batch, cache.model_shape.num_kv_heads, tokens, cache.model_shape.head_dim)
    dtypes = (dtype,) if dtype is not None else tuple(FLOAT_DTYPES.values())
    keys = _tensor(tensors, ctx, key_name, dtypes, shape)
    _tensor(tensors, ctx, value_name, (keys.dtype,), keys.shape)
    return keys


def _tensor(tensors: dict, ctx: _Where, name: str, dtypes, shape) -> torch.Tensor:
    """tensors[name], if its dtype is one of `dtypes` and its shape `shape` (None: any size)."""
    tensor = tensors.get(ctx.prefix + "." + name)
    expected = f"a {'/'.join(str(d).removeprefix('torch.') for d in dtypes)} tensor of shape " \
               f"[{', '.join('*' if n is None else str(n) for n in shape)}]"
    ok = tensor is not None and tensor.dtype in dtypes and tensor.dim() == len(shape)
    ok = ok and all(n is None or n == m for n, m in zip(shape, tensor.shape))
    _expect(ok, ctx.tensor(name), _Text("missing") if tensor is None else _describe(tensor), expected)
    return tensor


def _check_values(tensor: torch.Tensor, where: str, low: int, high: int, what: str) -> None:
    if tensor.numel():
        lo, hi = int(tensor.min()), int(tensor.max())
        _expect(low <= lo and hi <= high, where, _Text(f"values in [{lo}, {hi}]"), f"{what} in [{low}, {high}]")


def _int(info: dict, name: str, ctx: _Where, low: int = 0, high: int = MAX_INT) -> int:
    value = info.get(name)
    expected = f"{low}" if low == high else f"an integer in [{low}, {high}]"
    _expect(type(value) is int and low <= value <= high, ctx.field(name), value, expected)
    return value


def _exact_count(seq_len: int, stride: int, window: int) -> int:
    """|E| of `exact_mask(seq_len, stride, window)`, in closed form (nothing allocated before it is checked)."""
    return -(-max(seq_len - window, 0) // stride) + min(window, seq_len)


def _expect(ok: bool, where: str, found, expected: str) -> None:
    if not ok:
        shown = found if isinstance(found, _Text) else repr(found)
        raise CacheFileError(f"{where} is {shown[:120]}, expected {expected}; {NOT_CONSISTENT}")


class _Text(str):
    """A description to show as is in an error (a tensor's dtype and shape), not a JSON value to repr."""


def _describe(tensor: torch.Tensor) -> _Text:
    return _Text(f"{str(tensor.dtype).removeprefix('torch.')} [{', '.join(map(str, tensor.shape))}]")


def _show(found) -> str:
    return "nothing (empty)" if found is None else f"({found[0]}, {found[1]}, {str(found[2]).removeprefix('torch.')})"


@dataclass(frozen=True)
class _Where:
    """Names a saved cache's fields (`cache_config.json: layers[0].rows[1].seq_len`) and tensors."""

    folder: Path
    json: str
    prefix: str

    def node(self) -> str:
        return f"{self.folder / CONFIG_NAME}: {self.json}"

    def field(self, name: str) -> str:
        return f"{self.node()}.{name}"

    def tensor(self, name: str) -> str:
        return f"{self.folder / TENSORS_NAME}: tensor {self.prefix}.{name}"

    def row(self, b: int) -> _Where:
        return _Where(self.folder, f"{self.json}.rows[{b}]", f"{self.prefix}.rows.{b}")

    def sub(self, name: str) -> _Where:
        return _Where(self.folder, f"{self.json}.{name}", self.prefix)


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
        tmp.write(data)
    os.replace(tmp.name, path)
