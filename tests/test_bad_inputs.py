"""The bad-input matrix: one test per row of docs/bad_inputs.md ("what you do -> what you get").

Every error asserted here names the parameter (or layer), the value received and the fix. Rows about
bases artifacts (another model's bases, truncated, corrupt, missing a layer, wrong dtype,
non-orthonormal) are backed by tests/test_bases.py and are not repeated here.
"""

import copy
import math
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

import hf_varrate
from hf_varrate import Bases, BasesError, VarRateCache, VarRateConfig, VarRateWarning
from hf_varrate.codec import exact_mask

from conftest import TINY_SHAPE

SMALL = dict(stride=8, window=16, obs_window=16, r_min=2)  # lets short prompts compress on D = 64


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def make_cache(model, **overrides):
    hf_varrate.bind(model)
    return VarRateCache(Bases.identity(model.config), model_config=model.config, **{**SMALL, **overrides})


def tokens(model, length, batch=1, seed=0):
    return torch.randint(3, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, cache, new=4, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=cache, pad_token_id=0,
                              **kwargs)


def forward(model, ids, cache, **kwargs):
    with torch.no_grad():
        return model(ids, past_key_values=cache, **kwargs)


def varrate_warnings(caught):
    return [w for w in caught if issubclass(w.category, VarRateWarning)]


def other_llama(**changes):
    torch.manual_seed(1)
    config = LlamaConfig(**{**TINY_SHAPE, **changes})
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


# --- configuration ------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [0.0, -0.1, 1.5, float("nan"), True, "0.2"])
def test_budget_outside_0_1_is_a_value_error_naming_it(budget):
    with pytest.raises(ValueError, match=r"budget must be in \(0.0, 1.0\], got .*; use e.g. budget=0.2"):
        VarRateConfig(budget=budget)


def test_r_min_above_rank_is_a_value_error_naming_both():
    with pytest.raises(ValueError, match="r_min must be <= rank, got r_min=32 and rank=16; lower r_min"):
        VarRateConfig(r_min=32, rank=16)


@pytest.mark.parametrize("r_min, basis_rank", [(100, 64), (16, 8)])
def test_r_min_above_the_effective_rank_cap_fails_at_construction(tiny_llama, r_min, basis_rank):
    """R is capped by the basis rank and D = 2*H*d (64 here): an r_min above it fails when the cache is built,
    not as an allocation error deep inside the prefill (nor as a silent store-exactly)."""
    basis = torch.eye(64)[:basis_rank]
    bases = Bases.from_tensors({0: basis, 1: basis}, tiny_llama.config)
    with pytest.raises(ValueError, match=rf"r_min must be <= the rank cap .* = {basis_rank}, got r_min={r_min}; "
                                         rf"lower r_min to at most {basis_rank}"):
        VarRateCache(bases, model_config=tiny_llama.config, r_min=r_min)


@pytest.mark.parametrize("name", ["stride", "window", "obs_window", "n_anchors", "distance_chunk", "coef_group",
                                  "component_tokens"])
@pytest.mark.parametrize("value", [0, -1, 2.5])
def test_stride_window_and_friends_below_1_are_value_errors(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be an integer >= 1, got {value!r}; use e.g. {name}="):
        VarRateConfig(**{name: value})


def test_unknown_config_keys_are_ignored_with_a_warning_naming_them():
    with pytest.warns(UserWarning, match=r"ignores unknown keys \['budgett'\].*pip install -U hf_varrate"):
        config = VarRateConfig.from_dict({"budgett": 0.3, "stride": 8})
    assert config.stride == 8 and config.budget == VarRateConfig().budget


def test_even_pool_kernel_is_a_value_error():
    with pytest.raises(ValueError, match="pool_kernel must be odd, got 4; use e.g. 5"):
        VarRateConfig(pool_kernel=4)


# --- prompt shapes ------------------------------------------------------------------------------------
def test_empty_prompt_is_a_value_error_and_leaves_the_cache_usable(tiny_llama):
    cache = make_cache(tiny_llama, budget=0.4)
    with pytest.raises(ValueError, match="0 tokens .* pass at least one token"):
        forward(tiny_llama, torch.zeros(1, 0, dtype=torch.long), cache)
    assert cache.get_seq_length() == 0 and cache.layers[0].awaits_prefill
    forward(tiny_llama, tokens(tiny_llama, 300), cache)  # the same cache still compresses a real prompt
    cache.compress()
    assert all(not layer.codes[0].stored_exactly for layer in cache.layers)


def test_one_token_prompt_is_stored_exactly_and_decodes_like_dynamic_cache(tiny_llama):
    ids = tokens(tiny_llama, 1)
    cache = make_cache(tiny_llama, budget=0.4)
    assert torch.equal(greedy(tiny_llama, ids, cache, new=6), greedy(tiny_llama, ids, DynamicCache(), new=6))
    assert cache.layers[0].codes == [] and cache.footprint().fraction == 1.0


@pytest.mark.parametrize("length", [2, 15, 16, 17])
def test_prompt_within_the_window_is_stored_exactly_without_warnings(tiny_llama, length):
    """Window 16, stride 8: with <= window + 1 tokens every token is an anchor or in the window."""
    ids = tokens(tiny_llama, length)
    cache = make_cache(tiny_llama, budget=0.2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = greedy(tiny_llama, ids, cache)
    assert varrate_warnings(caught) == []
    assert torch.equal(out, greedy(tiny_llama, ids, DynamicCache()))
    assert all(code.stored_exactly for layer in cache.layers for code in layer.codes)


def expected_exact(length, stride, window):
    return sorted({i for i in range(0, length, stride)} | set(range(max(length - window, 0), length)))


@pytest.mark.parametrize("length", [18, 24, 25, 31, 32, 33, 40, 41, 48, 49])
def test_stride_and_window_boundary_lengths_split_exact_and_coded_tokens_correctly(tiny_llama, length):
    """Stride 8, window 16: anchors 0, 8, 16, ... below S - 16, plus the last 16 tokens are exact, bit for
    bit; every other token is coded. Lengths straddle multiples of the stride and window + k * stride."""
    stride, window = SMALL["stride"], SMALL["window"]
    exact = expected_exact(length, stride, window)
    assert len(exact) == math.ceil((length - window) / stride) + window  # the count, in closed form
    assert exact_mask(length, stride, window).nonzero()[:, 0].tolist() == exact
    ids = tokens(tiny_llama, length)
    reference, cache = DynamicCache(), make_cache(tiny_llama, budget=0.99, hold_dtype="model")  # bit for bit
    forward(tiny_llama, ids, reference)
    forward(tiny_llama, ids, cache)
    cache.compress()
    for layer, ref in zip(cache.layers, reference.layers):
        code = layer.codes[0]
        assert not code.stored_exactly and code.exact_pos.tolist() == exact
        assert code.coded_pos.tolist() == sorted(set(range(length)) - set(exact))
        assert torch.equal(layer.keys[:, :, code.exact_pos], ref.keys[:, :, code.exact_pos])
        assert torch.equal(layer.values[:, :, code.exact_pos], ref.values[:, :, code.exact_pos])


# --- bad tensors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_nan_or_inf_in_keys_or_values_is_a_value_error_naming_the_layer(tiny_llama, poison):
    ids = tokens(tiny_llama, 300)
    v_proj = tiny_llama.model.layers[0].self_attn.v_proj
    saved = v_proj.weight.detach().clone()
    with torch.no_grad():
        v_proj.weight[0] = float(poison)
    cache = make_cache(tiny_llama, budget=0.4)
    with pytest.raises(ValueError, match="layer 0: keys or values contain NaN or inf at the prefill"):
        forward(tiny_llama, ids, cache)
    assert all(layer.awaits_prefill for layer in cache.layers)  # the refused prefill left no half-state
    with torch.no_grad():
        v_proj.weight.copy_(saved)
    forward(tiny_llama, ids, cache)  # fixed inputs, same cache: compressed as if nothing had happened
    cache.compress()
    assert [len(layer.codes) for layer in cache.layers] == [1, 1]


# --- binding ------------------------------------------------------------------------------------------
def test_unbound_model_is_a_runtime_error_and_a_retry_after_binding_compresses_every_layer(tiny_llama):
    """Regression: the refused prefill used to mark layer 0 as prefilled, so the retry left it uncompressed."""
    hf_varrate.unbind(tiny_llama)
    cache = VarRateCache(Bases.identity(tiny_llama.config), model_config=tiny_llama.config, **SMALL, budget=0.4)
    ids = tokens(tiny_llama, 300)
    with pytest.raises(RuntimeError, match=r"call hf_varrate.bind\(model\) before generate"):
        forward(tiny_llama, ids, cache)
    hf_varrate.bind(tiny_llama)
    forward(tiny_llama, ids, cache)
    cache.compress()
    assert [len(layer.codes) for layer in cache.layers] == [1, 1]
    assert all(not layer.codes[0].stored_exactly for layer in cache.layers)


def test_unbinding_between_prefill_and_decode_still_decodes(tiny_llama):
    """The hook only matters at the prefill: decoding reads the cache and needs no queries."""
    doc, question = tokens(tiny_llama, 300), tokens(tiny_llama, 5, seed=1)
    cache = make_cache(tiny_llama, budget=0.4)
    forward(tiny_llama, doc, cache)
    twin = copy.deepcopy(cache)
    ids = torch.cat([doc, question], dim=1)
    hf_varrate.unbind(tiny_llama)
    unbound = greedy(tiny_llama, ids, cache, new=6)
    hf_varrate.bind(tiny_llama)
    assert torch.equal(unbound, greedy(tiny_llama, ids, twin, new=6))


@pytest.mark.parametrize("change, field", [
    (dict(num_hidden_layers=3), "num_layers"),
    (dict(num_hidden_layers=1), "num_layers"),
    (dict(num_key_value_heads=4), "num_kv_heads"),
    (dict(head_dim=8), "head_dim"),
])
@pytest.mark.parametrize("prefilled", [False, True])
def test_a_cache_used_by_a_different_model_is_a_value_error_naming_the_field(tiny_llama, change, field, prefilled):
    cache = make_cache(tiny_llama, budget=0.4)
    doc = tokens(tiny_llama, 300)
    if prefilled:
        forward(tiny_llama, doc, cache)
    other = hf_varrate.bind(other_llama(**change))
    expected = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16}[field]
    with pytest.raises(ValueError, match=rf"built for a model with {field}={expected} .* build a new cache"):
        greedy(other, torch.cat([doc, tokens(tiny_llama, 5, seed=1)], dim=1), cache)


def test_a_cache_used_by_an_unbound_model_with_other_heads_is_a_value_error(tiny_llama):
    """Without the hook only the K/V shapes are seen: heads and head_dim are still checked at every update."""
    cache = make_cache(tiny_llama, budget=0.4)
    doc = tokens(tiny_llama, 300)
    forward(tiny_llama, doc, cache)
    other = other_llama(head_dim=8)
    with pytest.raises(ValueError, match="built for a model with head_dim=16 but is used .* with head_dim=8"):
        forward(other, tokens(tiny_llama, 5, seed=1), cache)


def test_bases_for_another_model_fail_when_the_cache_is_built(tiny_llama):
    """Also through VarRateCache(...) directly, not only from_pretrained (whose cases test_bases.py covers)."""
    other = other_llama(head_dim=8)
    with pytest.raises(BasesError, match="head_dim is 8 in the bases but 16 in the model"):
        VarRateCache(Bases.identity(other.config), model_config=tiny_llama.config)


# --- reuse --------------------------------------------------------------------------------------------
def test_generate_twice_on_one_cache_continues_from_the_first_call(tiny_llama):
    """Without a copy the second call treats the cache as the conversation so far: only the first prompt
    is compressed; the first answer, the second question and its answer are appended exactly."""
    doc, q1, q2 = tokens(tiny_llama, 300), tokens(tiny_llama, 5, seed=1), tokens(tiny_llama, 5, seed=2)
    cache = make_cache(tiny_llama, budget=0.4)
    first = greedy(tiny_llama, torch.cat([doc, q1], dim=1), cache)
    code = cache.layers[0].codes[0]
    coefs, ranks = code.coefs.clone(), code.ranks.clone()
    conversation = torch.cat([first, q2], dim=1)
    second = greedy(tiny_llama, conversation, cache)
    layer = cache.layers[0]
    assert layer.codes[0].seq_len == 305 and torch.equal(layer.codes[0].coefs, coefs)
    assert torch.equal(layer.codes[0].ranks, ranks)
    assert cache.get_seq_length() == second.shape[1] - 1 and layer.appended == cache.get_seq_length() - 305
    # the same as a fresh cache that compressed doc + q1 once and is asked the whole conversation
    fresh = make_cache(tiny_llama, budget=0.4)
    forward(tiny_llama, torch.cat([doc, q1], dim=1), fresh)
    assert torch.equal(second, greedy(tiny_llama, conversation, fresh))


def test_generate_twice_with_a_non_extending_prompt_appends_it_like_dynamic_cache(tiny_llama):
    """Asking a second, unrelated question of the same cache re-reads it after the first conversation,
    exactly as a DynamicCache would: deepcopy the compressed cache per question instead."""
    doc, q1, q2 = tokens(tiny_llama, 300), tokens(tiny_llama, 5, seed=1), tokens(tiny_llama, 5, seed=2)
    cache, dynamic = make_cache(tiny_llama, budget=0.4), DynamicCache()
    outcomes = []
    for c in (dynamic, cache):
        greedy(tiny_llama, torch.cat([doc, q1], dim=1), c)
        try:
            greedy(tiny_llama, torch.cat([doc, q2], dim=1), c)
            outcomes.append(None)
        except Exception as err:  # transformers < 5.24's generate refuses a prompt shorter than the cache
            outcomes.append(type(err))
    assert outcomes[0] == outcomes[1]  # whatever this transformers does with a DynamicCache, we do too
    if outcomes[0] is None:
        assert cache.get_seq_length() == dynamic.get_seq_length() > 308 + 300  # the document is in there twice
    assert cache.layers[0].codes[0].seq_len == 305  # still only the first prompt is compressed


# --- batches and chunks -------------------------------------------------------------------------------
def test_batch_with_an_all_padding_row_stores_it_empty_and_leaves_other_rows_alone(tiny_llama):
    ids, mask = tokens(tiny_llama, 300, batch=3, seed=3), torch.ones(3, 300, dtype=torch.long)
    ids[1], mask[1] = 0, 0  # all padding
    ids[2, :40], mask[2, :40] = 0, 0  # left padding
    cache = make_cache(tiny_llama, budget=0.4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = greedy(tiny_llama, ids, cache, attention_mask=mask)
    assert varrate_warnings(caught) == []
    codes = cache.layers[0].codes
    assert [(code.seq_len, code.stored_exactly) for code in codes] == [(300, False), (0, True), (260, False)]
    for row, real in ((0, ids[0:1]), (2, ids[2:3, 40:])):
        alone = greedy(tiny_llama, real, make_cache(tiny_llama, budget=0.4))
        assert torch.equal(out[row, -4:], alone[0, -4:])


def test_a_prompt_in_two_forwards_is_held_then_coded_whole(tiny_llama):
    """Chunks of one prompt (no decoding step between them) are one prompt: held while they arrive (this float32
    model's in float16), then coded as a whole (it used to code the first chunk alone and store the second
    exactly)."""
    doc = tokens(tiny_llama, 300)
    cache, reference = make_cache(tiny_llama, budget=0.4), DynamicCache()
    forward(tiny_llama, doc[:, :200], cache)
    forward(tiny_llama, doc[:, 200:], cache)
    forward(tiny_llama, doc, reference)
    layer = cache.layers[0]
    assert layer.holding and not layer.codes and cache.get_seq_length() == 300
    assert torch.equal(layer.keys, reference.layers[0].keys.half())  # layer 0's keys depend on the token alone
    cache.compress()
    assert layer.codes[0].seq_len == 300 and not layer.codes[0].stored_exactly and layer.appended == 0
    coded = layer.codes[0].coded_pos
    assert not torch.equal(layer.keys[:, :, coded], reference.layers[0].keys[:, :, coded])


def test_every_row_of_the_docs_table_names_a_test_that_exists():
    """docs/bad_inputs.md promises a test per row: each `file.py::test_name` it cites must be defined."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cited = re.findall(r"(test_\w+\.py)::(test_\w+)", (root / "docs" / "bad_inputs.md").read_text())
    assert len(cited) > 40
    missing = [f"{file}::{name}" for file, name in cited
               if not re.search(rf"^def {name}\(", (root / "tests" / file).read_text(), re.MULTILINE)]
    assert not missing, f"docs/bad_inputs.md cites tests that do not exist: {missing}"
