"""Tier (b) and (d): compact storage (codes only, reconstruct per read) against materialized storage."""

import copy
import warnings

import pytest
import torch

import hf_varrate
from hf_varrate import Bases, CompactLayer, VarRateCache, VarRateLayer, VarRateWarning
from hf_varrate.rotary import RotaryFrequencies

from test_cache import SMALL, greedy, prompt


def make(model, storage, **overrides):
    hf_varrate.bind(model)
    settings = {**SMALL, "budget": 0.4, **overrides}
    return VarRateCache(Bases.identity(model.config), model=model, storage=storage, **settings)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3", "tiny_gemma3"])
@pytest.mark.parametrize("overrides", [{}, {"coef_bits": 3},
                                       {"signal": "uniform", "coef_bits": 4, "projection_dtype": "bfloat16"}])
def test_compact_and_materialized_generate_the_same_tokens(fixture, overrides, request):
    model = request.getfixturevalue(fixture)
    ids = prompt(model, 300)
    caches = {storage: make(model, storage, **overrides) for storage in ("materialized", "compact")}
    outs = {storage: greedy(model, ids, cache, new=12) for storage, cache in caches.items()}
    assert torch.equal(outs["materialized"], outs["compact"])
    compact = [layer for layer in caches["compact"].layers if isinstance(layer, VarRateLayer)]
    assert all(layer.compact for layer in compact)
    assert caches["compact"].footprint().bytes == caches["materialized"].footprint().bytes


def test_left_padded_batch_is_identical_in_both_storages(tiny_llama):
    long, short = prompt(tiny_llama, 320, seed=3), prompt(tiny_llama, 260, seed=4)
    ids, mask = torch.zeros(2, 320, dtype=torch.long), torch.zeros(2, 320, dtype=torch.long)
    ids[0], mask[0] = long[0], 1
    ids[1, 60:], mask[1, 60:] = short[0], 1
    outs = [greedy(tiny_llama, ids, make(tiny_llama, storage), attention_mask=mask) for storage in
            ("materialized", "compact")]
    assert torch.equal(outs[0], outs[1])


def held_tensor_bytes(layer) -> int:
    """Bytes of every distinct tensor storage reachable from a layer's state (not counting the bases,
    the rotary frequencies and the per-forward RoPE memo, which are per model or transient)."""
    seen, total, stack = set(), 0, [layer]
    skip = {"bases", "rope", "memo", "config", "prefill_context"}
    while stack:
        obj = stack.pop()
        if torch.is_tensor(obj):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.extend(v for k, v in vars(obj).items() if k not in skip)
    return total


@pytest.mark.parametrize("overrides", [{}, {"coef_bits": 4}, {"budget": 0.2, "r_min": 16}])
def test_compact_footprint_is_the_bytes_actually_held(tiny_llama, overrides):
    cache = make(tiny_llama, "compact", **overrides)
    greedy(tiny_llama, prompt(tiny_llama, 400), cache, new=5)
    for layer in cache.layers:
        fp = layer.footprint()
        assert fp.bytes == fp.held_bytes == held_tensor_bytes(layer)
    assert cache.footprint().held_bytes == cache.footprint().bytes
    assert cache.rope_memo._tables is None  # RoPE tables live for one forward only


def test_compact_prompt_stays_within_the_budget_and_materialized_holds_more(tiny_llama):
    caches = {s: make(tiny_llama, s, budget=0.3) for s in ("compact", "materialized")}
    for cache in caches.values():
        with torch.no_grad():
            tiny_llama(prompt(tiny_llama, 600), past_key_values=cache)
            cache.compress()
    compact, materialized = caches["compact"].footprint(), caches["materialized"].footprint()
    assert compact.held_bytes <= (0.3 + 0.005) * compact.full_bytes
    assert materialized.held_bytes > compact.full_bytes  # full K/V plus the codes


def test_crop_reorder_select_match_materialized(tiny_llama):
    caches = {s: make(tiny_llama, s) for s in ("materialized", "compact")}
    ids = prompt(tiny_llama, 300, batch=2)
    more = prompt(tiny_llama, 4, batch=2, seed=9)
    nexts = {}
    for storage, cache in caches.items():
        with torch.no_grad():
            tiny_llama(ids, past_key_values=cache)
            cache.compress()
            tiny_llama(more, past_key_values=cache)
            cache.compress()
            cache.crop(-2)  # appended tokens only
            assert cache.get_seq_length() == 302
            cache.crop(-12)  # into the compressed prompt
            assert cache.get_seq_length() == 290 and cache.layers[0].appended == 0
            cache.reorder_cache(torch.tensor([1, 0]))
            cache.batch_repeat_interleave(2)
            cache.batch_select_indices(torch.tensor([0, 3]))
            step = prompt(tiny_llama, 3, batch=2, seed=11)
            positions = torch.arange(290, 293)[None].expand(2, -1)
            nexts[storage] = tiny_llama(step, past_key_values=cache, position_ids=positions).logits
            cache.compress()
    assert torch.equal(nexts["materialized"], nexts["compact"])
    compact = caches["compact"]
    assert compact.get_seq_length() == 293
    for layer in compact.layers:
        assert layer.footprint().bytes == held_tensor_bytes(layer)
    compact.reset()
    assert compact.get_seq_length() == 0 and compact.layers[0].awaits_prefill


def test_deepcopy_reuse_in_compact_storage(tiny_llama):
    doc = prompt(tiny_llama, 300)
    base = make(tiny_llama, "compact")
    with torch.no_grad():
        tiny_llama(doc, past_key_values=base)
        base.compress()
    for seed in (1, 2):
        ids = torch.cat([doc, prompt(tiny_llama, 6, seed=seed)], dim=1)
        fresh = make(tiny_llama, "materialized")
        with torch.no_grad():
            tiny_llama(doc, past_key_values=fresh)
            fresh.compress()
        assert torch.equal(greedy(tiny_llama, ids, copy.deepcopy(base)), greedy(tiny_llama, ids, fresh))
    assert base.get_seq_length() == 300 and base.layers[0].appended == 0


def test_switching_storage_in_place_keeps_the_tokens(tiny_llama):
    doc = prompt(tiny_llama, 300)
    ids = torch.cat([doc, prompt(tiny_llama, 6, seed=1)], dim=1)
    cache = make(tiny_llama, "materialized")
    with torch.no_grad():
        tiny_llama(doc, past_key_values=cache)
        cache.compress()
    expected = greedy(tiny_llama, ids, copy.deepcopy(cache))
    cache.set_storage("compact")
    assert all(layer.compact and isinstance(layer, CompactLayer) for layer in cache.layers)  # layers swapped
    for layer in cache.layers:
        assert layer.footprint().bytes == held_tensor_bytes(layer)
    assert torch.equal(greedy(tiny_llama, ids, copy.deepcopy(cache)), expected)
    cache.set_storage("materialized")
    assert not any(layer.compact for layer in cache.layers) and cache.layers[0].keys.shape[-2] == 300
    assert torch.equal(greedy(tiny_llama, ids, cache), expected)
    with pytest.raises(ValueError, match="storage"):
        cache.set_storage("zipped")


def test_compact_without_the_rotary_frequencies_holds_materialized_and_says_so(tiny_llama):
    with pytest.warns(VarRateWarning, match="model=model"):
        cache = VarRateCache(Bases.identity(tiny_llama.config), model_config=tiny_llama.config, storage="compact")
    assert cache.config.storage == "materialized"
    assert all(layer.storage == "materialized" for layer in cache.layers if isinstance(layer, VarRateLayer))


def test_compact_falls_back_to_materialized_when_positions_are_not_0_to_n(tiny_llama):
    cache = make(tiny_llama, "compact")
    ids = prompt(tiny_llama, 300)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        tiny_llama(ids, past_key_values=cache, position_ids=torch.arange(7, 307)[None])
        cache.compress()
    fallbacks = [str(w.message) for w in caught
                 if issubclass(w.category, VarRateWarning) and "falls back" in str(w.message)]
    assert fallbacks and all("custom position ids?); at offset 0 they differ from ours by" in m for m in fallbacks)
    assert all(layer.storage == "materialized" and not layer.compact for layer in cache.layers)
    assert cache.layers[0].keys.shape[-2] == 300


def test_tables_that_differ_from_ours_in_the_last_bit_keep_compact_storage_and_save(tiny_llama, tmp_path, monkeypatch):
    """A model whose rotary kernel rounds its cos/sin one ulp away from ours (another vectorization or thread
    split) still has its keys re-rotated by ours: compact holds, saves, and answers as materialized does."""
    rotary = tiny_llama.model.rotary_emb
    forward = rotary.forward

    def one_ulp_up(*args, **kwargs):
        cos, sin = forward(*args, **kwargs)
        return torch.nextafter(cos, torch.full_like(cos, 2.0)), torch.nextafter(sin, torch.full_like(sin, 2.0))

    monkeypatch.setattr(rotary, "forward", one_ulp_up)
    ids = prompt(tiny_llama, 300)
    caches = {storage: make(tiny_llama, storage) for storage in ("materialized", "compact")}
    with warnings.catch_warnings():
        warnings.simplefilter("error", VarRateWarning)  # no fallback warning
        outs = {storage: greedy(tiny_llama, ids, cache, new=8) for storage, cache in caches.items()}
    assert all(layer.compact for layer in caches["compact"].layers if isinstance(layer, VarRateLayer))
    assert torch.equal(outs["materialized"], outs["compact"])
    caches["compact"].save_pretrained(tmp_path / "doc")  # every offset recorded


def test_tables_one_position_off_still_fall_back(tiny_llama):
    """The tolerance is rounding, not a position: tables of positions 1..n (one off) are not ours."""
    rope = RotaryFrequencies.from_model(tiny_llama)
    cos, sin = rope.tables_at(torch.arange(1, 301), torch.float32)
    assert rope.offset_of(cos, sin) is None
    assert rope.offset_of(cos, sin, (0, 1)) == 1
    bf_cos, bf_sin = rope.tables_at(torch.arange(1, 301), torch.bfloat16)
    assert rope.offset_of(bf_cos, bf_sin) is None
    assert rope.mismatch(cos, sin) > 1e4 and rope.mismatch(cos, sin, 1) == 0.0  # what a fallback's warning reports
    up = torch.nextafter(cos, torch.full_like(cos, 2.0)), torch.nextafter(sin, torch.full_like(sin, 2.0))
    assert 0.0 < rope.mismatch(*up, 1) <= 1.0  # one ulp: within the rounding `offset_of` allows
    bumped = cos.clone()
    bumped[0, 299, 3] += 0.1
    assert rope.worst_difference(bumped, sin, 1)[1:] == (299, 3)  # where the warning says the tables part


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gemma3"])
def test_rotary_frequencies_reproduce_the_models_tables(fixture, request):
    model = request.getfixturevalue(fixture)
    rope = RotaryFrequencies.from_model(model)
    positions = torch.arange(500)[None]
    rotary = model.model.rotary_emb
    args = (torch.zeros(1), positions) + (("full_attention",) if "gemma" in fixture else ())
    cos, sin = rotary(*args)
    mine_cos, mine_sin = rope.tables(500, torch.float32, "cpu")
    assert torch.equal(mine_cos, cos) and torch.equal(mine_sin, sin)


def test_real_smollm2_compact_equals_materialized(smollm2):
    model, _ = smollm2
    ids = torch.randint(100, 20000, (1, 1200), generator=torch.Generator().manual_seed(0))
    with hf_varrate.bound(model):
        outs = {}
        for storage in ("materialized", "compact"):
            cache = VarRateCache(Bases.identity(model.config), model=model, storage=storage, budget=0.3)
            with torch.no_grad():
                outs[storage] = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache,
                                               pad_token_id=2, attention_mask=torch.ones_like(ids))
            fp = cache.footprint()
            if storage == "compact":
                assert fp.held_bytes == fp.bytes <= 0.305 * fp.full_bytes
    assert torch.equal(outs["materialized"], outs["compact"])


def test_the_default_one_liner_holds_the_budget_and_reads_the_codes(smollm2, monkeypatch):
    """`generate(past_key_values=VarRateCache.from_pretrained(name))`, nothing else (no model=, sdpa): every
    tensor the cache holds after decoding is at most budget + 0.05 of the DynamicCache's K/V, the decode reads
    the codes (a rebuild fails the test), the tokens are materialized storage's, and a DynamicCache on the
    same model gives the same tokens before and after."""
    model, _ = smollm2
    hf_varrate.unbind(model)
    ids = torch.randint(100, 20000, (1, 1500), generator=torch.Generator().manual_seed(1))

    def generate(cache=None):
        kwargs = {} if cache is None else {"past_key_values": cache}
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=2,
                                 attention_mask=torch.ones_like(ids), return_dict_in_generate=True, **kwargs)
        return out.sequences, out.past_key_values

    plain, dynamic = generate()
    full = sum(layer.keys.nbytes + layer.values.nbytes for layer in dynamic.layers)
    materialized, _ = generate(VarRateCache.from_pretrained("smollm2-135m-instruct", storage="materialized"))
    cache = VarRateCache.from_pretrained("smollm2-135m-instruct")
    assert cache.config.storage == "compact" and cache.config.budget == 0.2
    with monkeypatch.context() as patch:
        patch.setattr(CompactLayer, "read", lambda self: pytest.fail("a compact layer was rebuilt, not read"))
        tokens, _ = generate(cache)
    assert torch.equal(tokens, materialized)
    held = sum(held_tensor_bytes(layer) for layer in cache.layers)
    assert held == cache.footprint().held_bytes <= (cache.config.budget + 0.05) * full
    # the bases cost one 8-bit copy per layer (plus its peaks, scales and spectra), the stored tensors released
    copies = len(cache.bases.tensors) * cache.bases.rank * cache.model_shape.width
    assert copies <= cache.footprint().bases_bytes <= 1.06 * copies and cache.bases.tensors.resident() == []
    assert torch.equal(generate()[0], plain)


def test_bases_of_the_same_content_share_their_derived_copies(tiny_llama):
    """Two loads of the same bases (two caches from one folder) derive one set of copies per device, counted
    in both; bases of other content get their own."""
    def edited(edit):  # identity bases with layer 0 edited: content no other test uses, no copies made yet
        bases = Bases.identity(tiny_llama.config)
        return Bases({i: edit(t) if i == 0 else t for i, t in bases.tensors.items()}, bases.metadata)

    first, second = edited(lambda t: t.roll(5, 0)), edited(lambda t: t.roll(5, 0))
    before = second.nbytes()
    split = first.attention_basis(0, "none", "cpu", 2, 16, bits=None)
    held = split[0].untyped_storage()
    assert second.attention_basis(0, "none", "cpu", 2, 16, bits=None)[0].untyped_storage().data_ptr() == held.data_ptr()
    assert second.nbytes() == before + held.nbytes()  # counted by every bases sharing it
    other = edited(lambda t: t.flip(0))
    assert other.attention_basis(0, "none", "cpu", 2, 16, bits=None)[0].untyped_storage().data_ptr() != held.data_ptr()
