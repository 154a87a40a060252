"""Tier (b): VarRateCache inside generate() on tiny random models built offline."""

import copy
import warnings

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

import hf_varrate
from hf_varrate import Bases, MaterializedLayer, VarRateCache, VarRateLayer, VarRateWarning

SMALL = dict(stride=8, window=16, obs_window=16, r_min=2)  # lets 300-token prompts compress on D = 64


def make_cache(model, **overrides):
    hf_varrate.bind(model)
    return VarRateCache(Bases.identity(model.config), model_config=model.config, **{**SMALL, **overrides})


def prompt(model, length=300, batch=1, seed=0):
    return torch.randint(3, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, cache, new=8, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=cache,
                              pad_token_id=0, **kwargs)


def test_budget_one_equals_dynamic_cache(tiny_llama):
    ids = prompt(tiny_llama)
    ref = greedy(tiny_llama, ids, DynamicCache(config=tiny_llama.config))
    cache = make_cache(tiny_llama, budget=1.0)
    assert torch.equal(greedy(tiny_llama, ids, cache), ref)
    assert cache.footprint().fraction == 1.0


def test_compression_runs_and_meets_the_budget(tiny_llama):
    ids = prompt(tiny_llama, 600)
    cache = make_cache(tiny_llama, budget=0.4)
    with torch.no_grad():
        tiny_llama(ids, past_key_values=cache)
        cache.compress()
    fp = cache.footprint()
    assert 0.38 <= fp.fraction <= 0.4 * 1.005
    layer = cache.layers[0]
    assert layer.ranks.numel() == 600 - layer.codes[0].exact_pos.numel()
    assert layer.get_seq_length() == 600 and cache.get_seq_length() == 600


def test_prefill_attends_exact_kv_and_later_reads_see_the_reconstruction(tiny_llama):
    ids = prompt(tiny_llama, 400)
    reference = DynamicCache(config=tiny_llama.config)
    cache = make_cache(tiny_llama, budget=0.3, hold_dtype="model")  # held bit for bit (tests/test_held.py: 'auto')
    with torch.no_grad():
        exact = tiny_llama(ids, past_key_values=reference).logits
        compressed = tiny_llama(ids, past_key_values=cache).logits
        cache.compress()
    torch.testing.assert_close(compressed, exact)  # the prefill's own attention is untouched
    code, stored, ref_keys = cache.layers[0].codes[0], cache.layers[0].keys, reference.layers[0].keys
    assert torch.equal(stored[:, :, code.exact_pos], ref_keys[:, :, code.exact_pos])  # bit for bit
    assert not torch.allclose(stored[:, :, code.coded_pos], ref_keys[:, :, code.coded_pos])  # coded


def test_tokens_after_the_prefill_are_stored_exactly(tiny_llama):
    ids = prompt(tiny_llama, 300)
    cache = make_cache(tiny_llama, budget=0.4)
    reference = DynamicCache(config=tiny_llama.config)
    with torch.no_grad():
        tiny_llama(ids, past_key_values=cache)
        cache.compress()
        tiny_llama(ids, past_key_values=reference)
        follow = prompt(tiny_llama, 5, seed=1)
        tiny_llama(follow, past_key_values=cache)
        cache.compress()
    assert cache.get_seq_length() == 305 and cache.layers[0].appended == 5
    # the appended K/V equal what a clean cache computes for them given the same (compressed) past
    assert cache.layers[0].keys.shape[-2] == 305


def test_deepcopy_reuse_equals_fresh_compress_then_ask(tiny_llama):
    doc = prompt(tiny_llama, 300)
    questions = [prompt(tiny_llama, 6, seed=s) for s in (1, 2)]
    base = make_cache(tiny_llama, budget=0.4)
    with torch.no_grad():
        tiny_llama(doc, past_key_values=base)
        base.compress()
    for q in questions:
        ids = torch.cat([doc, q], dim=1)
        reused = greedy(tiny_llama, ids, copy.deepcopy(base))
        fresh = make_cache(tiny_llama, budget=0.4)
        with torch.no_grad():
            tiny_llama(doc, past_key_values=fresh)
            fresh.compress()
        assert torch.equal(reused, greedy(tiny_llama, ids, fresh))
    assert base.get_seq_length() == 300  # the original is untouched


def test_deepcopy_shares_bases_and_copies_state(tiny_llama):
    cache = make_cache(tiny_llama, budget=0.4)
    with torch.no_grad():
        tiny_llama(prompt(tiny_llama, 300), past_key_values=cache)
        cache.compress()
    clone = copy.deepcopy(cache)
    assert clone.bases is cache.bases and clone.layers[0].bases is cache.layers[0].bases
    assert clone.layers[0].keys is not cache.layers[0].keys
    assert torch.equal(clone.layers[0].keys, cache.layers[0].keys)
    assert clone.layers[0].codes[0].coefs is not cache.layers[0].codes[0].coefs


def test_beam_search_and_sampling_run(tiny_llama):
    ids = prompt(tiny_llama, 300)
    beams = greedy(tiny_llama, ids, make_cache(tiny_llama, budget=0.4), num_beams=2)
    assert beams.shape == (1, 308)
    torch.manual_seed(0)
    with torch.no_grad():
        sampled = tiny_llama.generate(ids, max_new_tokens=8, do_sample=True, top_k=20,
                                      past_key_values=make_cache(tiny_llama, budget=0.4), pad_token_id=0)
    assert sampled.shape == (1, 308)


def test_left_padded_batch_codes_each_row_like_alone(tiny_llama):
    long, short = prompt(tiny_llama, 320, seed=3), prompt(tiny_llama, 260, seed=4)
    ids = torch.zeros(2, 320, dtype=torch.long)
    mask = torch.zeros(2, 320, dtype=torch.long)
    ids[0], mask[0] = long[0], 1
    ids[1, 60:], mask[1, 60:] = short[0], 1
    cache = make_cache(tiny_llama, budget=0.4)
    out = greedy(tiny_llama, ids, cache, attention_mask=mask)
    assert out.shape == (2, 328)
    layer = cache.layers[0]
    assert [code.seq_len for code in layer.codes] == [320, 260]  # padding took no part
    alone = make_cache(tiny_llama, budget=0.4)
    with torch.no_grad():
        tiny_llama(short, past_key_values=alone)
        alone.compress()
    assert (layer.codes[1].ranks.long() - alone.layers[0].codes[0].ranks.long()).abs().max() <= 1
    single = greedy(tiny_llama, short, make_cache(tiny_llama, budget=0.4))
    assert torch.equal(out[1, -8:], single[0, -8:])


def test_short_prompt_is_stored_exactly_with_one_warning(tiny_llama):
    cache = make_cache(tiny_llama, budget=0.2, stride=16, window=64, r_min=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            tiny_llama(prompt(tiny_llama, 100), past_key_values=cache)
            cache.compress()
    assert sum(issubclass(w.category, VarRateWarning) for w in caught) == 1
    assert cache.footprint().fraction == 1.0 and cache.layers[0].rows_stored_exactly == 1


def test_crop_reset_reorder_select(tiny_llama):
    cache = make_cache(tiny_llama, budget=0.4)
    with torch.no_grad():
        tiny_llama(prompt(tiny_llama, 300, batch=2), past_key_values=cache)
        cache.compress()
        tiny_llama(prompt(tiny_llama, 4, batch=2, seed=9), past_key_values=cache)
        cache.compress()
    layer = cache.layers[0]
    full = cache.footprint().bytes
    cache.crop(-2)
    assert cache.get_seq_length() == 302 and layer.appended == 2 and cache.footprint().bytes < full
    cache.crop(-12)  # into the compressed prompt: fewer prompt tokens are counted
    assert cache.get_seq_length() == 290 and layer.appended == 0
    first = layer.codes[0]
    cache.reorder_cache(torch.tensor([1, 0]))
    assert layer.codes[1] is first
    cache.batch_repeat_interleave(2)
    assert len(layer.codes) == 4 and layer.keys.shape[0] == 4
    cache.batch_select_indices(torch.tensor([0, 3]))
    assert len(layer.codes) == 2 and layer.keys.shape[0] == 2
    cache.reset()
    assert cache.get_seq_length() == 0 and layer.codes == [] and layer.awaits_prefill


def test_gemma3_keeps_sliding_layers_and_compresses_full_ones(tiny_gemma3):
    cache = make_cache(tiny_gemma3, budget=0.4)
    kinds = [type(layer) for layer in cache.layers]
    types = tiny_gemma3.config.layer_types
    for kind, layer_type in zip(kinds, types):
        assert kind is (DynamicSlidingWindowLayer if layer_type == "sliding_attention" else MaterializedLayer)
    out = greedy(tiny_gemma3, prompt(tiny_gemma3, 300), cache)
    assert out.shape == (1, 308)
    fp = cache.footprint()
    assert {layer.kind for layer in fp.layers} == {"sliding", "varrate"}
    assert all(layer.fraction < 0.45 for layer in fp.layers if layer.kind == "varrate")


def test_the_cache_is_handed_over_by_the_name_this_transformers_takes(tiny_llama):
    """transformers 5.24 renamed generate's past_key_values= to cache= (the old name warns until 6.0, the new
    one fails before 5.24): `binding.cache_kwarg` picks the one that works here, without a warning."""
    from hf_varrate.binding import cache_kwarg

    ids = prompt(tiny_llama)
    cache = make_cache(tiny_llama, budget=0.4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.no_grad():
            tiny_llama.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0,
                                **{cache_kwarg(tiny_llama): cache})
    assert cache.get_seq_length() == ids.shape[1] + 2 and cache.footprint().fraction < 1


def test_measuring_layer_sensitivity_passes_its_caches_without_a_deprecation_warning(tiny_llama):
    """`hf-varrate measure-layers` prefills and reads back through caches: by the name this transformers takes."""
    from transformers import DynamicCache

    from hf_varrate.calibration.sensitivity import _prefill, _read_back

    ids = prompt(tiny_llama)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        cache = _prefill(tiny_llama, ids[:-2], DynamicCache(config=tiny_llama.config))
        kv = {i: (layer.keys, layer.values) for i, layer in enumerate(cache.layers)}
        log_probs = _read_back(tiny_llama, kv, ids[-2:], len(ids) - 2)
    assert cache.get_seq_length() == len(ids) - 2 and log_probs.shape[0] == 2
