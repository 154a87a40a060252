"""The prefill hook: recomputed queries equal the attention kernel's, binding is explicit and reversible."""

import copy

import pytest
import torch
from transformers import (AttentionInterface, AutoModelForCausalLM, DynamicCache, LlamaConfig, MistralConfig,
                          Phi3Config)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import hf_varrate
from hf_varrate import Bases, VarRateCache
from hf_varrate.binding import attention_modules, key_padding

CAPTURED = {}


def capturing_attention(module, query, key, value, attention_mask, dropout=0.0, **kwargs):
    # dropout may come by position: kvpress, once imported, wraps every registered attention function so
    if query.shape[2] > 1:
        CAPTURED[module.layer_idx] = query.detach().clone()
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, **kwargs)


AttentionInterface.register("varrate_test_capture", capturing_attention)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3", "tiny_gemma3"])
def test_hook_queries_equal_kernel_queries(fixture, request):
    model = request.getfixturevalue(fixture)
    cache = VarRateCache(Bases.identity(model.config), model_config=model.config, obs_window=8)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    seen = {}

    def spy(layer):  # read the context the hook hands over, before the layer consumes it
        original = layer.update

        def update(k, v, *a, **kw):
            seen[layer.layer_idx] = layer.prefill_context
            return original(k, v, *a, **kw)

        layer.update = update

    for layer in cache.layers:
        if isinstance(layer, hf_varrate.VarRateLayer):
            spy(layer)
    CAPTURED.clear()
    previous = model.config._attn_implementation
    model.set_attn_implementation("varrate_test_capture")
    try:
        with hf_varrate.bound(model), torch.no_grad():
            model(ids, past_key_values=cache)
    finally:
        model.set_attn_implementation(previous)
    assert seen, "no VarRate layer received a prefill context"
    for idx, context in seen.items():
        assert context is not None, f"layer {idx} got no queries from the hook"
        kernel = CAPTURED[idx][:, :, -8:]
        assert context.queries.shape == kernel.shape
        torch.testing.assert_close(context.queries, kernel, rtol=1e-5, atol=1e-5)


def test_bind_is_idempotent_and_unbind_removes_every_hook(tiny_llama):
    modules = attention_modules(tiny_llama)
    before = [len(m._forward_pre_hooks) for m in modules]
    hf_varrate.bind(tiny_llama)
    hf_varrate.bind(tiny_llama)
    assert [len(m._forward_pre_hooks) for m in modules] == [n + 1 for n in before]
    assert hf_varrate.is_bound(tiny_llama)
    hf_varrate.unbind(tiny_llama)
    assert [len(m._forward_pre_hooks) for m in modules] == before
    assert not hf_varrate.is_bound(tiny_llama)


def test_unbind_removes_the_hooks_of_a_deep_copied_bound_model(tiny_llama):
    hf_varrate.bind(tiny_llama)
    clone = copy.deepcopy(tiny_llama)  # carries copies of the hooks
    hf_varrate.bind(clone)  # idempotent on the copy too: one hook, queries computed once
    assert [len(m._forward_pre_hooks) for m in attention_modules(clone)] == [1] * len(attention_modules(clone))
    assert hf_varrate.is_bound(clone)
    hf_varrate.unbind(clone)
    assert not any(len(m._forward_pre_hooks) for m in attention_modules(clone))
    assert hf_varrate.is_bound(tiny_llama)  # the original keeps its own
    hf_varrate.unbind(tiny_llama)


def test_importing_changes_nothing(tiny_llama):
    assert not any(len(m._forward_pre_hooks) for m in attention_modules(tiny_llama))


def test_unbound_model_raises_a_message_that_says_how_to_bind(tiny_llama):
    hf_varrate.unbind(tiny_llama)
    cache = VarRateCache(Bases.identity(tiny_llama.config), model_config=tiny_llama.config)
    with pytest.raises(RuntimeError, match="bind"):
        tiny_llama(torch.randint(0, 100, (1, 30)), past_key_values=cache)


def test_hook_ignores_other_caches(tiny_llama):
    with hf_varrate.bound(tiny_llama), torch.no_grad():
        ids = torch.randint(0, 100, (1, 30))
        a = tiny_llama(ids, past_key_values=DynamicCache(config=tiny_llama.config)).logits
    b = tiny_llama(ids, past_key_values=DynamicCache(config=tiny_llama.config)).logits
    assert torch.equal(a, b)


def test_bind_rejects_models_without_attention():
    with pytest.raises(ValueError, match="no attention module"):
        hf_varrate.bind(torch.nn.Linear(2, 2))


def test_a_fused_qkv_model_is_refused_naming_the_family():
    config = Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="fused qkv_proj \\(Phi-3 style\\)"):
        hf_varrate.bind(model)


def test_a_model_whose_every_layer_slides_is_a_clear_error():
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    with pytest.raises(ValueError, match="every layer .* sliding-window attention.*Mistral-7B-v0.1"):
        Bases.identity(config)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="full-attention layers only"):
        VarRateCache(Bases.identity(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=2)), model=model)


def test_key_padding_reads_bool_float_and_absent_masks():
    assert key_padding(None, 2, 5) is None
    bool_mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    bool_mask[0, :, :, :2] = False
    valid = key_padding(bool_mask, 2, 5)
    assert valid.tolist() == [[False, False, True, True, True], [True] * 5]
    float_mask = torch.where(bool_mask, 0.0, torch.finfo(torch.float32).min)
    assert torch.equal(key_padding(float_mask, 2, 5), valid)
