"""The "varrate" attention implementation: attention over a compact layer's codes equals attention over
its reconstruction, and everything else is sdpa."""

import copy
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
OVERRIDES = [{}, {"coef_bits": 3}, {"signal": "uniform", "coef_bits": 4},
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
        rebuilt = [model(ids[:, -6:-1], past_key_values=cache).logits, model(ids[:, -1:], past_key_values=cache).logits]
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


def test_an_unbound_model_never_gets_a_coded_read(tiny_llama, attention):
    """The hook arms one read per forward; without it (unbound, another attention) layers return tensors."""
    ids = prompt(tiny_llama, 300)
    cache = compact(tiny_llama)
    attention(tiny_llama, hf_varrate.ATTENTION)
    with torch.no_grad():
        tiny_llama(ids, past_key_values=cache)  # the prefill: armed, but no read to hand over
    hf_varrate.unbind(tiny_llama)
    layer = next(layer for layer in cache.layers if isinstance(layer, VarRateLayer))
    keys, values = layer.update(torch.zeros(1, *layer.keys.shape[1:2], 1, layer.keys.shape[-1]),
                                torch.zeros(1, *layer.values.shape[1:2], 1, layer.values.shape[-1]))
    assert torch.is_tensor(keys) and not isinstance(keys, CodedRead)
    assert keys.shape[-2] == layer.get_seq_length()


def test_compact_storage_under_sdpa_says_once_how_to_read_the_codes(tiny_llama, attention):
    """A compact cache decoded under sdpa rebuilds its K/V at every step: one VarRateWarning per cache names
    the fix; under the "varrate" attention, in materialized storage and for a batch of two sequences (which
    falls back to the rebuild anyway) there is nothing to say."""
    ids = prompt(tiny_llama, 300)

    def decode_twice(cache, batch=ids):
        with torch.no_grad():
            tiny_llama(batch[:, :-2], past_key_values=cache)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for i in (-2, -1):
                    tiny_llama(batch[:, i:][:, :1], past_key_values=cache)
        return [w for w in caught if issubclass(w.category, VarRateWarning)]

    attention(tiny_llama, "sdpa")
    said = decode_twice(compact(tiny_llama))
    assert len(said) == 1 and "set_attn_implementation('varrate')" in str(said[0].message)
    assert "attn_implementation='sdpa'" in str(said[0].message)
    assert decode_twice(compact(tiny_llama, storage="materialized")) == []
    assert decode_twice(compact(tiny_llama), batch=ids.repeat(2, 1)) == []
    attention(tiny_llama, hf_varrate.ATTENTION)
    assert decode_twice(compact(tiny_llama)) == []


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
