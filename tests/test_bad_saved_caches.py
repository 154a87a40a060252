"""The bad-input matrix, saved caches: files a checksum cannot catch (a writer's bug, a hand edit).

One test per row of docs/bad_inputs.md about saved caches that load with a valid sha256 but hold
inconsistent fields or tensors: each is refused with `CacheFileError` naming the field, the value and
the fix, never a crash or a hang. The rows about truncated, corrupt or missing files, another model
and other bases are backed by tests/test_serialization.py.
"""

import hashlib
import json
import os
import re
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

import hf_varrate
from hf_varrate import Bases, VarRateCache
from hf_varrate.cache_checks import seal

from conftest import TINY_SHAPE

SMALL = dict(stride=8, window=16, obs_window=16, r_min=2)  # lets short prompts compress on D = 64

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def tokens(model, length, batch=1, seed=0):
    return torch.randint(3, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def forward(model, ids, cache, **kwargs):
    with torch.no_grad():
        return model(ids, past_key_values=cache, **kwargs)


serialization = pytest.importorskip("hf_varrate.serialization")
CacheFileError = serialization.CacheFileError
FUZZ = settings(max_examples=int(os.environ.get("HF_VARRATE_EXAMPLES", "25")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
LOAD_SECONDS = 5.0  # every load, good or bad, answers within this (generous on a shared 2-core machine)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def saved_caches(tmp_path_factory):
    """{storage: folder} of one compressed 300-token prompt, and the (module-private) model it fits."""
    from conftest import _build_tiny

    model = _build_tiny(LlamaConfig(**TINY_SHAPE))
    folders = {}
    for storage in ("materialized", "compact"):
        cache = VarRateCache(Bases.identity(model.config), model=hf_varrate.bind(model), budget=0.4,
                             storage=storage, **SMALL)
        forward(model, tokens(model, 300), cache)
        folders[storage] = tmp_path_factory.mktemp(f"saved-{storage}")
        cache.save_pretrained(folders[storage])
    return model, folders


def write_variant(folder, tensor_blob, meta):
    """Write a variant, its JSON resealed (config_sha256 recomputed, as a writer's bug would): so the damage
    meets the checks behind the seal, not just the seal (tests/test_robustness.py checks the seal)."""
    (folder / serialization.TENSORS_NAME).write_bytes(tensor_blob)
    (folder / serialization.CONFIG_NAME).write_text(json.dumps(seal(meta) if isinstance(meta, dict) else meta))


def load_and_use(model, folder, storage):
    """Load, then decode one token; only CacheFileError may come out, and quickly."""
    start = time.perf_counter()
    try:
        cache = VarRateCache.load(folder, model=model, storage=storage)
    except CacheFileError:
        return "refused"
    finally:
        assert time.perf_counter() - start < LOAD_SECONDS
    forward(model, tokens(model, 1, seed=7), cache)
    return "loaded"


def json_paths(value, prefix=()):
    """Every (key or index) path into a parsed JSON value, except the checksum itself."""
    if prefix:
        yield prefix
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if key != "sha256":
            yield from json_paths(item, prefix + (key,))


def child(value, key):
    """value[key] if value is a dict with that key or a list with that index, else None."""
    if isinstance(value, dict) and isinstance(key, str):
        return value.get(key)
    if isinstance(value, list) and isinstance(key, int) and key < len(value):
        return value[key]
    return None


@FUZZ
@given(data=st.data(), storage=st.sampled_from(["materialized", "compact"]), rehash=st.booleans())
def test_fuzz_saved_cache_tensor_bytes_are_refused_with_our_error_only(saved_caches, tmp_path_factory, data,
                                                                        storage, rehash):
    """Mutated and truncated tensor files; with `rehash` the recorded sha256 is updated to match, so the
    parser and consistency checks (not just the checksum) meet the damage."""
    model, folders = saved_caches
    blob = bytearray((folders[storage] / serialization.TENSORS_NAME).read_bytes())
    meta = json.loads((folders[storage] / serialization.CONFIG_NAME).read_text())
    for position, value in data.draw(st.lists(st.tuples(st.integers(0, len(blob) - 1), st.integers(0, 255)),
                                              min_size=1, max_size=8)):
        blob[position] = value
    blob = bytes(blob[: data.draw(st.integers(0, len(blob)))]) if data.draw(st.booleans()) else bytes(blob)
    if rehash:
        meta["sha256"] = hashlib.sha256(blob).hexdigest()
    folder = tmp_path_factory.mktemp("fuzz")
    write_variant(folder, blob, meta)
    load_and_use(model, folder, storage)  # a variant that loads (values changed, say) must also decode


def _corrupt_ranks(meta, tensors):
    tensors["layers.0.rows.0.ranks"] = torch.full_like(tensors["layers.0.rows.0.ranks"], 200)  # > R = 64


def _stringly_source(meta, tensors):
    meta["bases"]["source"] = 7


def _int_row(meta, tensors):
    meta["layers"][0]["rows"][0] = 3


@pytest.mark.parametrize("storage, damage", [
    ("compact", _corrupt_ranks),  # compact storage decodes only at the first read: refused at load all the same
    ("materialized", _corrupt_ranks),
    ("compact", _stringly_source),  # was a TypeError from Path(7)
    ("materialized", _stringly_source),
    ("compact", _int_row),
    ("materialized", _int_row),
], ids=lambda v: getattr(v, "__name__", v))
def test_checksum_valid_but_inconsistent_saved_cache_gives_our_error_only(saved_caches, tmp_path, damage, storage):
    model, folders = saved_caches
    write_damaged(folders[storage], tmp_path, damage)
    assert load_and_use(model, tmp_path, storage) == "refused"


def write_damaged(saved, folder, damage):
    """A copy of the cache saved in `saved`, with `damage(meta, tensors)` applied and a matching sha256."""
    from safetensors.torch import load_file, save

    meta = json.loads((saved / serialization.CONFIG_NAME).read_text())
    tensors = load_file(str(saved / serialization.TENSORS_NAME))
    damage(meta, tensors)
    blob = save(tensors, metadata={"format": "pt", "library": "hf_varrate"})
    meta["sha256"] = hashlib.sha256(blob).hexdigest()
    write_variant(folder, blob, meta)


def _set(path, value):
    """A damage that sets one field of cache_config.json (path: keys and indices) to `value`."""
    def damage(meta, tensors):
        target = meta
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return damage


def _edit(name, edit):
    """A damage that replaces tensor `name` with `edit(tensor)`."""
    def damage(meta, tensors):
        tensors[name] = edit(tensors[name]).contiguous()
    return damage


def _anchor_out_of_range(neighbours):
    neighbours = neighbours.clone()
    neighbours[0, 0] = 200  # 300 tokens at stride 8 have 38 anchors
    return neighbours


def _poison_one(tensor):
    tensor = tensor.clone()
    tensor.view(-1)[3] = float("nan") if tensor.dim() == 1 else float("inf")
    return tensor


def _add_tensor(meta, tensors):
    tensors["layers.0.rows.0.extra"] = torch.zeros(3)


ROW = "layers.0.rows.0"
SAVE_AGAIN = r"; this is not a consistent saved cache .*: save it again with cache.save_pretrained\(dir\)"


@pytest.mark.parametrize("damage, message", [
    (_corrupt_ranks, rf"tensor {ROW}.ranks is values in \[200, 200\], expected ranks .* in \[0, 64\]"),
    (_stringly_source, r"bases.source is 7, expected null, 'identity', a folder or a Hub repo id"),
    (_int_row, r"layers\[0\].rows\[0\] is 3, expected an object"),
    (_set(("layers", 0, "rows", 0, "seq_len"), 290),
     rf"tensor {ROW}.exact_keys is float32 \[1, 2, 52, 16\], expected a float32 tensor of shape \[1, 2, 51, 16\]"),
    (_set(("layers", 0, "rows", 0, "span"), [0, 299]), r"rows\[0\].span is \[0, 299\], expected null or \[start, "),
    (_set(("layers", 0, "rows", 0, "rope_offset"), 5), r"rows\[0\].rope_offset is 5, expected 0 \(where"),
    (_set(("layers", 0, "prompt_len"), 299), r"layers\[0\].prompt_kept is 300, expected an integer in \[0, 299\]"),
    (_set(("layers", 0, "dtype"), "float16"), r"appended_keys is float32 \[1, 2, 0, 16\], expected a float16 tensor"),
    (_set(("layers", 0, "kind"), "sliding"), r"kind is 'sliding', expected one of \['empty', 'exact', 'varrate'\]"),
    (_set(("layers", 1, "prompt_kept"), 299),
     r"layers\[1\] holds \(batch, tokens, dtype\) = \(1, 299, float32\) but layers\[0\] holds \(1, 300, float32\)"),
    (_edit(f"{ROW}.neighbours", _anchor_out_of_range),
     rf"tensor {ROW}.neighbours is values in \[0, 200\], expected anchor indices in \[0, 37\]"),
    (_edit(f"{ROW}.coefs", lambda coefs: coefs[:-1]), rf"tensor {ROW}.coefs is float32 \[\d+\], expected a float32 "
                                                      rf"tensor of shape \[\d+\]"),
    (_edit(f"{ROW}.exact_values", lambda values: values.half()), rf"tensor {ROW}.exact_values is float16"),
    (_edit(f"{ROW}.coefs", _poison_one), rf"tensor {ROW}.coefs is float32 \[\d+\] holding NaN or inf, expected "
                                         rf"finite values"),
    (_edit(f"{ROW}.exact_keys", _poison_one),
     rf"tensor {ROW}.exact_keys is float32 \[1, 2, 52, 16\] holding NaN or inf"),
    (_add_tensor, r"holds tensors no layer of cache_config.json uses: \['layers.0.rows.0.extra'\]"),
], ids=["ranks", "source", "row", "seq_len", "span", "rope_offset", "prompt_len", "dtype", "kind", "lengths",
        "neighbours", "coefs", "exact_dtype", "nan_coefs", "inf_exact", "extra_tensor"])
def test_inconsistent_saved_cache_error_names_the_field_the_value_and_the_fix(saved_caches, tmp_path, damage,
                                                                               message):
    """Each check of the loader: the error names the field or tensor, what it holds, what was expected, and
    says to save the cache again."""
    model, folders = saved_caches
    write_damaged(folders["compact"], tmp_path, damage)
    with pytest.raises(CacheFileError, match=message) as caught:
        VarRateCache.load(tmp_path, model=model)
    assert re.search(SAVE_AGAIN, str(caught.value)), str(caught.value)


def test_a_saved_cache_in_another_dtype_than_the_model_names_both_and_the_fix(saved_caches, tmp_path):
    model, folders = saved_caches
    rotary = {m: m.inv_freq for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)}
    model.to(torch.bfloat16)  # as from_pretrained(dtype=torch.bfloat16) loads it: the RoPE frequencies stay fp32
    for module, inv_freq in rotary.items():
        module.inv_freq = inv_freq
    try:
        with pytest.raises(CacheFileError, match=r"holds float32 keys and values but the model runs in bfloat16.*"
                                                 r"load the model in float32"):
            VarRateCache.load(folders["compact"], model=model)
    finally:
        model.to(torch.float32)
    VarRateCache.load(folders["compact"], model=model)  # and loads again once they agree


@FUZZ
@given(data=st.data(), storage=st.sampled_from(["materialized", "compact"]))
def test_fuzz_saved_cache_config_fields_give_our_error_only(saved_caches, tmp_path_factory, data, storage):
    """Any field of cache_config.json set to any JSON value (and the JSON resealed, so the fields' own checks
    meet it)."""
    model, folders = saved_caches
    blob = (folders[storage] / serialization.TENSORS_NAME).read_bytes()
    meta = json.loads((folders[storage] / serialization.CONFIG_NAME).read_text())
    paths = list(json_paths(meta))
    for path in data.draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3)):
        target = meta
        for key in path[:-1]:  # an earlier draw may have replaced a parent: then this path is gone
            target = child(target, key)
        if child(target, path[-1]) is not None:
            target[path[-1]] = data.draw(JSON_VALUES)
    folder = tmp_path_factory.mktemp("fuzz")
    write_variant(folder, blob, meta)
    load_and_use(model, folder, storage)
