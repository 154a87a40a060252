"""Attention over a compact layer's codes (under sdpa, through the `CodedRead` stand-ins its updates return,
and under the "varrate" attention implementation) equals attention over its reconstruction, and every
other cache, and every other use of a stand-in, gets plain tensors."""

import contextlib
import copy
import inspect
import sys
import warnings

import pytest
import torch
from transformers import DynamicCache

import hf_varrate
from hf_varrate import Bases, CompactLayer, VarRateCache, VarRateConfig, VarRateLayer, VarRateWarning
from hf_varrate.attention import CodedRead

from test_beyond import calibrated_like
from test_cache import SMALL, greedy, prompt

# the last: the recommended preset (balanced, i.e. scaled, coding; 4-bit dense codes) on calibrated-like bases
OVERRIDES = [{}, {"coef_bits": 3}, {"coef_bits": 2}, {"signal": "uniform", "coef_bits": 4},
             {"preset": "recommended", "budget": 0.3, "projection_dtype": "float32"}]


@pytest.fixture
def attention(request):
    """Restore the model's attention implementation after a test switches it."""
    switched = []

    def use(model, name):
        switched.append((model, model.config._attn_implementation))
        model.set_attn_implementation(name)

    yield use
    for model, name in reversed(switched):
        model.set_attn_implementation(name)


def compact(model, **overrides):
    hf_varrate.bind(model)
    if "preset" in overrides:
        overrides = {"storage": "compact", **overrides}
        return VarRateCache(calibrated_like(model.config), VarRateConfig.preset(overrides.pop("preset"), **overrides),
                            model=model)
    return VarRateCache(Bases.identity(model.config), model=model, **{**SMALL, "budget": 0.4, "storage": "compact",
                                                                        **overrides})


def reads_codes(monkeypatch):
    """Make a rebuild of a compact layer's K/V fail, so a test passes only through the codes."""
    def refuse(self):
        raise AssertionError("the compact layer was rebuilt instead of read through its codes")
    monkeypatch.setattr(CompactLayer, "read", refuse)


@contextlib.contextmanager
def rebuilds():
    """Within the block compact layers rebuild their K/V at every read (the reference the codes' read must meet)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CompactLayer, "attends_codes", lambda self, mask: False)
        yield


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3", "tiny_gemma3"])
@pytest.mark.parametrize("overrides", OVERRIDES)
def test_attention_over_codes_equals_attention_over_the_reconstruction(fixture, overrides, request, attention,
                                                                       monkeypatch):
    model = request.getfixturevalue(fixture)
    ids = prompt(model, 300)
    cache = compact(model, **overrides)
    with torch.no_grad():
        model(ids[:, :-6], past_key_values=cache)
        coded = copy.deepcopy(cache)
        attention(model, "sdpa")
        with rebuilds():
            rebuilt = [model(ids[:, -6:-1], past_key_values=cache).logits,
                       model(ids[:, -1:], past_key_values=cache).logits]
        attention(model, hf_varrate.ATTENTION)
        reads_codes(monkeypatch)
        # five tokens at once (causal mask within them), then one (no mask)
        read = [model(ids[:, -6:-1], past_key_values=coded).logits, model(ids[:, -1:], past_key_values=coded).logits]
    for got, want in zip(read, rebuilt):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert coded.get_seq_length() == cache.get_seq_length() == ids.shape[1]


@pytest.mark.parametrize("overrides", [{"signal": "uniform", "coef_bits": 4, "projection_dtype": "bfloat16"},
                                       {"preset": "recommended", "budget": 0.3, "projection_dtype": "bfloat16"}])
def test_attention_over_codes_with_bf16_projections_is_as_close_as_bf16_allows(tiny_llama, overrides, attention,
                                                                              monkeypatch):
    """With bf16 projection operands the codes' read agrees with the float32 read to bf16's precision."""
    ids = prompt(tiny_llama, 300)
    caches = {dtype: compact(tiny_llama, **{**overrides, "projection_dtype": dtype}) for dtype in ("float32",
                                                                                                    "bfloat16")}
    with torch.no_grad():
        for cache in caches.values():
            tiny_llama(ids[:, :-1], past_key_values=cache)
        exact = tiny_llama(ids[:, -1:], past_key_values=caches["float32"]).logits
        attention(tiny_llama, hf_varrate.ATTENTION)
        reads_codes(monkeypatch)
        read = tiny_llama(ids[:, -1:], past_key_values=caches["bfloat16"]).logits
    error = (read - exact).abs().max()
    assert 0 < error < 2e-3 * exact.abs().max()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gemma3"])
def test_generate_under_varrate_attention_equals_materialized(fixture, request, attention, monkeypatch):
    model = request.getfixturevalue(fixture)
    ids = prompt(model, 300)
    want = greedy(model, ids, compact(model, storage="materialized"), new=12)
    attention(model, hf_varrate.ATTENTION)
    reads_codes(monkeypatch)
    assert torch.equal(greedy(model, ids, compact(model), new=12), want)


def test_a_wrapper_that_reads_the_kv_shape_still_gets_the_codes_read(tiny_llama, attention, monkeypatch):
    """kvpress wraps every registered attention function when imported, and its wrapper reads key.shape
    (query.shape[2] == key.shape[2] tells it a prefill): a CodedRead answers with the K/V's shape."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seen, inner = [], ALL_ATTENTION_FUNCTIONS[hf_varrate.ATTENTION]

    def wrapper(module, query, key, value, attention_mask, dropout=0.0, **kwargs):
        seen.append((query.shape[2] == key.shape[2], tuple(key.shape)))
        return inner(module, query, key, value, attention_mask, dropout, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, hf_varrate.ATTENTION, wrapper)
    ids = prompt(tiny_llama, 300)
    want = greedy(tiny_llama, ids, compact(tiny_llama, storage="materialized"), new=6)
    attention(tiny_llama, hf_varrate.ATTENTION)
    reads_codes(monkeypatch)
    assert torch.equal(greedy(tiny_llama, ids, compact(tiny_llama), new=6), want)
    text = tiny_llama.config
    kv_shape = (1, text.num_key_value_heads, ids.shape[1] + 5, text.hidden_size // text.num_attention_heads)
    assert (False, kv_shape) in seen  # the last step's read: a decode over all but the last new token


def test_varrate_attention_is_sdpa_for_other_caches(tiny_llama, attention):
    ids = prompt(tiny_llama, 200)
    attention(tiny_llama, "sdpa")
    want = greedy(tiny_llama, ids, DynamicCache(config=tiny_llama.config))
    materialized = greedy(tiny_llama, ids, compact(tiny_llama, storage="materialized"))
    attention(tiny_llama, hf_varrate.ATTENTION)
    assert torch.equal(greedy(tiny_llama, ids, DynamicCache(config=tiny_llama.config)), want)
    assert torch.equal(greedy(tiny_llama, ids, compact(tiny_llama, storage="materialized")), materialized)


def test_a_padded_batch_falls_back_to_the_reconstruction(tiny_llama, attention):
    long, short = prompt(tiny_llama, 320, seed=3), prompt(tiny_llama, 260, seed=4)
    ids, mask = torch.zeros(2, 320, dtype=torch.long), torch.zeros(2, 320, dtype=torch.long)
    ids[0], mask[0] = long[0], 1
    ids[1, 60:], mask[1, 60:] = short[0], 1
    want = greedy(tiny_llama, ids, compact(tiny_llama, storage="materialized"), attention_mask=mask)
    attention(tiny_llama, hf_varrate.ATTENTION)
    assert torch.equal(greedy(tiny_llama, ids, compact(tiny_llama), attention_mask=mask), want)


def test_a_stand_in_is_the_rebuilt_kv_to_every_other_operation(tiny_llama):
    """Unbound, under any attention, a compact layer's update hands back two CodedReads: tensors of the K/V's
    shape whose every operation but sdpa sees the rebuilt K/V (built once per pair)."""
    ids = prompt(tiny_llama, 300)
    cache = compact(tiny_llama)
    with torch.no_grad():
        tiny_llama(ids, past_key_values=cache)
    cache.compress()
    hf_varrate.unbind(tiny_llama)
    layer = next(layer for layer in cache.layers if isinstance(layer, VarRateLayer))
    step = torch.randn(1, layer.keys.shape[1], 1, layer.keys.shape[-1])
    keys, values = layer.update(step, step * 2)
    assert isinstance(keys, CodedRead) and isinstance(values, CodedRead)
    assert keys.shape == values.shape == (1, layer.keys.shape[1], ids.shape[1] + 1, layer.keys.shape[-1])
    assert keys.dtype == step.dtype and keys.device == step.device
    want_k, want_v = layer.read()
    got = keys * 1
    assert type(got) is torch.Tensor and torch.equal(got, want_k) and torch.equal(values[:, :, -1:], step * 2)
    assert torch.equal(torch.cat([keys, values]), torch.cat([want_k, want_v]))
    assert "CodedRead" in repr(keys)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_compact_storage_reads_its_codes_under_sdpa_and_rebuilds_under_eager(tiny_llama, implementation, attention,
                                                                           monkeypatch):
    """Nothing to arrange: the model's own sdpa reads the codes (a rebuild would fail the test), eager attention
    rebuilds; either way the tokens of materialized storage, and nothing to warn about."""
    ids = prompt(tiny_llama, 300)
    attention(tiny_llama, implementation)
    want = greedy(tiny_llama, ids, compact(tiny_llama, storage="materialized"), new=8)
    if implementation == "sdpa":
        reads_codes(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(greedy(tiny_llama, ids, compact(tiny_llama), new=8), want)
    assert not [w for w in caught if issubclass(w.category, VarRateWarning)]


def test_importing_hf_varrate_leaves_sdpa_and_other_caches_alone(tiny_llama, attention):
    """transformers' sdpa and torch's kernel are the originals (nothing wrapped), and a DynamicCache's update
    hands sdpa plain tensors."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    registered = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if "kvpress" in sys.modules:  # kvpress wraps every registered attention function when it is imported
        registered = inspect.getclosurevars(registered).nonlocals.get("func", registered)
    assert registered is sdpa_attention_forward
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    seen = []
    attention(tiny_llama, "sdpa")
    cache = DynamicCache(config=tiny_llama.config)
    original = cache.update

    def update(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.extend(type(t) for t in out)
        return out

    cache.update = update
    greedy(tiny_llama, prompt(tiny_llama, 100), cache, new=3)
    assert seen and set(seen) == {torch.Tensor}


@pytest.mark.parametrize("fixture", ["smollm2", "gemma3"])
def test_real_models_generate_the_same_under_varrate_attention(fixture, request, attention, monkeypatch):
    """SmolLM2 (every layer coded) and Gemma-3 (3 global layers coded, 15 sliding ones under sdpa)."""
    model, _ = request.getfixturevalue(fixture)
    ids = torch.randint(100, 20000, (1, 1200), generator=torch.Generator().manual_seed(0))
    outs = {}
    with hf_varrate.bound(model):
        for storage in ("materialized", "compact"):
            attention(model, hf_varrate.ATTENTION if storage == "compact" else "sdpa")
            if storage == "compact":
                reads_codes(monkeypatch)
            cache = VarRateCache(Bases.identity(model.config), model=model, storage=storage, budget=0.3)
            with torch.no_grad():
                outs[storage] = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache,
                                               pad_token_id=0, attention_mask=torch.ones_like(ids))
    assert torch.equal(outs["materialized"], outs["compact"])


def test_a_loaded_compact_cache_answers_over_its_codes(tiny_llama, attention, monkeypatch, tmp_path):
    """Compress once, save, load in a fresh cache and ask (question tokens at once, then decoding) under
    the "varrate" attention: the answer of the in-memory cache under sdpa."""
    from test_serialization import answer, compressed

    cache = compressed(tiny_llama, "compact", coef_bits=4)
    expected = answer(tiny_llama, copy.deepcopy(cache))
    cache.save_pretrained(tmp_path)
    hf_varrate.unbind(tiny_llama)
    loaded = VarRateCache.load(tmp_path, model=tiny_llama)
    attention(tiny_llama, hf_varrate.ATTENTION)
    reads_codes(monkeypatch)
    assert torch.equal(answer(tiny_llama, loaded), expected)


def test_a_stand_in_edited_in_place_is_attended_as_edited(tiny_llama):
    """A wrapper that writes into the keys before sdpa (kvpress masks keys so) is obeyed: once a stand-in has
    been rebuilt for another operation, sdpa runs on the rebuilt, edited tensors."""
    import torch.nn.functional as F

    ids = prompt(tiny_llama, 300)
    cache = compact(tiny_llama)
    with torch.no_grad():
        tiny_llama(ids, past_key_values=cache)
    cache.compress()
    layer = next(layer for layer in cache.layers if isinstance(layer, VarRateLayer))
    step = torch.randn(1, layer.keys.shape[1], 1, layer.keys.shape[-1])
    keys, values = layer.update(step, step)
    query = torch.randn(1, keys.shape[1], 1, keys.shape[-1])
    keys[:, :, :-1] = 0.0  # every token but the last scores 0
    want_k, want_v = layer.read()
    want_k[:, :, :-1] = 0.0
    got = F.scaled_dot_product_attention(query, keys, values)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(query, want_k, want_v))
