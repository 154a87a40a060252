"""How a prompt is held until it is coded: a float32 model's in float16 by default (`hold_dtype="auto"`),
which halves the bytes a VarRate cache holds at the prefill's peak; `hold_dtype="model"` keeps them as the
model computes them, bit for bit."""

import math

import pytest
import torch
from transformers import DynamicCache

import hf_varrate
from hf_varrate import Bases, VarRateCache, VarRateConfig
from hf_varrate.codec import tensor_bytes
from hf_varrate.layers.held import append_held as append_with_peak
from hf_varrate.layers.rows import magnitude

SMALL = dict(stride=8, window=16, obs_window=16, r_min=2)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def kv(length, scale=1.0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 2, length, 8, generator=g) * scale).to(dtype), \
        (torch.randn(1, 2, length, 8, generator=g) * scale).to(dtype)


def empty(dtype=torch.float32):
    return torch.tensor([], dtype=dtype), torch.tensor([], dtype=dtype)


def test_a_float32_prompt_is_held_in_float16_and_its_forward_attends_to_it_exactly():
    keys, values = kv(10)
    held_k, held_v, seen_k, seen_v = append_held(*empty(), keys, values, VarRateConfig())
    assert held_k.dtype == held_v.dtype == torch.float16
    assert seen_k is keys and seen_v is values  # the forward attends to its own tokens exactly
    assert torch.equal(held_k, keys.half()) and torch.equal(held_v, values.half())


def test_a_later_chunk_attends_to_the_earlier_ones_as_held_and_to_itself_exactly():
    first, second = kv(10, seed=0), kv(6, seed=1)
    held_k, held_v, _, _ = append_held(*empty(), *first, VarRateConfig())
    held_k, held_v, seen_k, seen_v = append_held(held_k, held_v, *second, VarRateConfig())
    assert held_k.shape[-2] == 16 and held_k.dtype == torch.float16
    assert seen_k.dtype == torch.float32
    assert torch.equal(seen_k[..., :10, :], first[0].half().float()) and torch.equal(seen_k[..., 10:, :], second[0])
    assert torch.equal(seen_v[..., 10:, :], second[1])


@pytest.mark.parametrize("config", [VarRateConfig(hold_dtype="model"), VarRateConfig(budget=1.0)],
                         ids=["hold_dtype=model", "budget=1.0"])
def test_model_dtype_holding_is_a_dynamic_layer_s(config):
    first, second = kv(10, seed=0), kv(6, seed=1)
    held_k, held_v, seen_k, _ = append_held(*empty(), *first, config)
    held_k, held_v, seen_k, seen_v = append_held(held_k, held_v, *second, config)
    assert held_k.dtype == torch.float32 and seen_k is held_k and seen_v is held_v  # one tensor, as DynamicLayer
    assert torch.equal(held_k, torch.cat([first[0], second[0]], dim=-2))


def test_a_half_precision_model_is_held_as_it_computes():
    keys, values = kv(10, dtype=torch.bfloat16)
    held_k, _, seen_k, _ = append_held(*empty(torch.bfloat16), keys, values, VarRateConfig())
    assert held_k.dtype == torch.bfloat16 and torch.equal(held_k, keys) and seen_k is held_k


def test_keys_beyond_float16_s_range_are_held_in_the_model_s_dtype_and_the_layer_stays_so():
    small, large = kv(10, seed=0), kv(6, scale=1e6, seed=1)
    held_k, held_v, _, _ = append_held(*empty(), *small, VarRateConfig())
    held_k, held_v, seen_k, _ = append_held(held_k, held_v, *large, VarRateConfig())
    assert held_k.dtype == torch.float32 and torch.isfinite(held_k).all()
    assert torch.equal(held_k[..., 10:, :], large[0])  # the overflowing chunk exactly
    held_k, held_v, _, _ = append_held(held_k, held_v, *kv(4, seed=2), VarRateConfig())
    assert held_k.dtype == torch.float32  # once widened, the layer stays wide


def append_held(held_k, held_v, keys, values, config):
    """`append_held` as the layer calls it, told the new tokens' largest magnitude."""
    return append_with_peak(held_k, held_v, keys, values, config, magnitude(keys, values))


def test_magnitude_is_the_largest_absolute_value_and_propagates_nan_and_inf():
    keys, values = torch.tensor([[1.0, -3.0]]), torch.tensor([2.0, 0.5])
    assert magnitude(keys, values) == 3.0
    assert magnitude(torch.tensor([]), torch.tensor([])) == 0.0
    assert math.isnan(magnitude(keys, torch.tensor([1.0, float("nan")])))
    assert magnitude(torch.tensor([float("-inf")]), values) == float("inf")
    assert magnitude(torch.tensor([70000.0], dtype=torch.float32), torch.tensor([1.0], dtype=torch.bfloat16)) == 70000


@pytest.mark.parametrize("top,held", [(65000.0, torch.float16), (65504.0, torch.float32), (65519.0, torch.float32)])
def test_the_float16_hold_is_taken_only_below_float16_s_largest_value(top, held):
    keys, values = kv(4)
    keys[0, 0, 0, 0] = -top
    held_k, held_v, _, _ = append_held(*empty(), keys, values, VarRateConfig())
    assert held_k.dtype == held_v.dtype == held and torch.isfinite(held_k).all()


def held_bytes(cache):
    return sum(tensor_bytes(layer.keys, layer.values) for layer in cache.layers)


def prefill(model, ids, cache):
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)


def test_a_float32_model_s_prefill_holds_half_the_bytes_and_codes_the_rounded_prompt(tiny_llama):
    """The default cache on a float32 model holds half of a DynamicCache's bytes at the end of the prefill; the
    codes are those of the prompt rounded to float16 (its exact tokens too); `hold_dtype="model"` holds all
    of them and keeps the exact tokens bit for bit."""
    hf_varrate.bind(tiny_llama)
    ids = torch.randint(3, tiny_llama.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    reference = DynamicCache()
    prefill(tiny_llama, ids, reference)
    caches = {}
    for hold in ("auto", "model"):
        cache = caches[hold] = VarRateCache(Bases.identity(tiny_llama.config), model_config=tiny_llama.config,
                                            budget=0.4, storage="materialized", hold_dtype=hold, **SMALL)
        prefill(tiny_llama, ids, cache)
    assert held_bytes(caches["auto"]) * 2 == held_bytes(reference) == held_bytes(caches["model"])
    for cache in caches.values():
        cache.compress()
    for auto, model, ref in zip(caches["auto"].layers, caches["model"].layers, reference.layers):
        exact = auto.codes[0].exact_pos
        assert torch.equal(auto.keys[:, :, exact], ref.keys[:, :, exact].half().float())
        assert torch.equal(model.keys[:, :, exact], ref.keys[:, :, exact])
        assert not torch.equal(auto.keys, model.keys)
        assert torch.allclose(auto.keys, model.keys, atol=2e-2, rtol=0)  # rounding, far below the codec's error


def test_the_default_cache_on_a_float32_model_answers_as_the_exactly_held_one(tiny_llama):
    hf_varrate.bind(tiny_llama)
    ids = torch.randint(3, tiny_llama.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(1))
    answers = []
    for hold in ("auto", "model"):
        cache = VarRateCache(Bases.identity(tiny_llama.config), model_config=tiny_llama.config, budget=0.4,
                             hold_dtype=hold, **SMALL)
        with torch.no_grad():
            answers.append(tiny_llama.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache,
                                               pad_token_id=0))
    assert torch.equal(answers[0], answers[1])


def test_hold_dtype_is_checked_and_named():
    with pytest.raises(ValueError, match="hold_dtype"):
        VarRateConfig(hold_dtype="float16")
    assert "hold_dtype" in VarRateConfig.runtime_fields()
