"""Replay equals live: every method kind rebuilt from a captured prefill gives the cache a live prefill
gives (where kvpress is installed: .venv-eval, since kvpress pins transformers < 5.3), and the smoke config
runs end to end."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch


HAS_KVPRESS = importlib.util.find_spec("kvpress") is not None
needs_kvpress = pytest.mark.skipif(not HAS_KVPRESS, reason="kvpress is not installed (it pins transformers < 5.3): "
                                   "run in .venv-eval (make eval-venv)")
REPO = Path(__file__).resolve().parents[1]


# replay == live (needs kvpress) ----------------------------------------------------------------------
def _prompt(tokenizer, n=300):
    from hf_varrate.demo import essay_text

    return tokenizer(essay_text()[: n * 8], add_special_tokens=False)["input_ids"][:n]


def _context(model, tokenizer, ids, name="smollm2-135m-instruct"):
    from evaluation.capture import capture
    from evaluation.methods import Context

    return Context(model, tokenizer, name, capture(model, ids), ids)


@pytest.mark.eval
@needs_kvpress
def test_varrate_replay_equals_live_prefill(smollm2):
    from hf_varrate import Bases, VarRateCache, VarRateConfig, bound
    from evaluation.methods import make_method

    model, tokenizer = smollm2
    ids = _prompt(tokenizer)
    replay = make_method("v", {"kind": "varrate", "budget": 0.3, "bases": "identity"}).compress(
        _context(model, tokenizer, ids)).cache
    live = VarRateCache(Bases.identity(model.config), VarRateConfig(budget=0.3), model_config=model.config)
    with bound(model), torch.no_grad():
        model.model(input_ids=torch.tensor([ids]), past_key_values=live)
        live.compress()  # the prompt is complete: code it, as the replay did
    for a, b in zip(replay.layers, live.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(a.values, b.values, atol=2e-5, rtol=1e-4)
    assert replay.footprint().bytes == live.footprint().bytes


@pytest.mark.eval
@needs_kvpress
def test_varrate_replay_on_gemma3_keeps_sliding_layers(tiny_gemma3):
    from hf_varrate import Bases, VarRateCache, VarRateConfig, bound
    from evaluation.methods import make_method

    model = tiny_gemma3
    ids = list(range(2, 98))
    replay = make_method("v", {"kind": "varrate", "budget": 0.5, "bases": "identity", "stride": 8, "window": 8,
                               "obs_window": 8}).compress(_context(model, None, ids, "tiny")).cache
    live = VarRateCache(Bases.identity(model.config), VarRateConfig(budget=0.5, stride=8, window=8, obs_window=8),
                        model_config=model.config)
    with bound(model), torch.no_grad():
        model.model(input_ids=torch.tensor([ids]), past_key_values=live)
        live.compress()  # the prompt is complete: code it, as the replay did
    for a, b in zip(replay.layers, live.layers):
        assert type(a) is type(b)
        torch.testing.assert_close(a.keys, b.keys, atol=2e-5, rtol=1e-4)


@pytest.mark.eval
@needs_kvpress
@pytest.mark.parametrize("press_name", ["SnapKVPress", "ExpectedAttentionPress"])
def test_kvpress_replay_equals_live_prefill(smollm2, press_name):
    import kvpress
    from transformers import DynamicCache

    from evaluation.methods import make_method

    model, tokenizer = smollm2
    ids = _prompt(tokenizer)
    replay = make_method("p", {"kind": "kvpress", "press": press_name, "budget": 0.3}).compress(
        _context(model, tokenizer, ids)).cache
    live = DynamicCache()
    with getattr(kvpress, press_name)(compression_ratio=0.7)(model), torch.no_grad():
        model.model(input_ids=torch.tensor([ids]), past_key_values=live)
    for a, b in zip(replay.layers, live.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=2e-5, rtol=1e-4)


@pytest.mark.eval
@needs_kvpress
def test_kvzip_replay_masks_equal_live(smollm2):
    from transformers import DynamicCache

    from hf_varrate.binding import attention_modules
    from evaluation.methods import make_method
    from evaluation.methods.kvpress_methods import clear_masks, local_name_or_path, pinned_kvzip_class

    model, tokenizer = smollm2
    ids = _prompt(tokenizer, 300)  # the 64-token pin must fit in the budget: 64 < 0.5 * 300
    replay = make_method("z", {"kind": "kvpress", "press": "KVzipPress", "budget": 0.5, "pin_last": 64}).compress(
        _context(model, tokenizer, ids))
    press = pinned_kvzip_class()(compression_ratio=0.5)
    press.pin_last = 64
    with local_name_or_path(model, tokenizer), press(model), torch.no_grad():
        model.model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache())
    live = {m.layer_idx: m.masked_key_indices for m in attention_modules(model)}
    clear_masks(model)
    for i, mask in live.items():
        assert all(torch.equal(x, y) for x, y in zip(mask, replay.masks[i]))
        assert not (mask[2] >= len(ids) - 64).any()  # the pin holds
    assert all(m.masked_key_indices is None for m in attention_modules(model))


@pytest.mark.eval
@needs_kvpress
def test_kvzip_at_a_second_budget_reuses_the_scores_and_masks_as_a_fresh_run(smollm2):
    from evaluation.methods import make_method
    from evaluation.methods.kvpress_methods import KVZIP_SCORES

    model, tokenizer = smollm2
    ids = _prompt(tokenizer, 300)
    spec = {"kind": "kvpress", "press": "KVzipPress", "pin_last": 64}
    KVZIP_SCORES.clear()
    fresh = make_method("z", {**spec, "budget": 0.5}).compress(_context(model, tokenizer, ids))
    KVZIP_SCORES.clear()
    first = make_method("z", {**spec, "budget": 0.7}).compress(_context(model, tokenizer, ids))
    ctx = _context(model, tokenizer, ids)  # its capture is a prefill: before the hook that counts passes
    passes = []
    hook = model.model.register_forward_pre_hook(lambda *args: passes.append(1))
    try:
        second = make_method("z", {**spec, "budget": 0.5}).compress(ctx)
    finally:
        hook.remove()
    assert not fresh.extra["kvzip_scores_reused"] and not first.extra["kvzip_scores_reused"]
    assert second.extra["kvzip_scores_reused"]
    assert not passes  # no reconstruction pass ran for the second budget
    assert second.seconds >= first.seconds  # its cost counts the scoring it reused
    for i, mask in fresh.masks.items():
        assert all(torch.equal(x, y) for x, y in zip(mask, second.masks[i]))
    assert sum(len(m[0]) for m in first.masks.values()) < sum(len(m[0]) for m in second.masks.values())


@pytest.mark.eval
@needs_kvpress
def test_kivi_replay_equals_live_and_is_counted_in_real_bytes(smollm2):
    from transformers import QuantizedCache

    from evaluation.footprint import per_layer_bytes
    from evaluation.methods import make_method

    model, tokenizer = smollm2
    ids = _prompt(tokenizer)
    replay = make_method("k", {"kind": "kivi", "nbits": 2}).compress(_context(model, tokenizer, ids)).cache
    live = QuantizedCache(backend="quanto", config=model.config, nbits=2)
    with torch.no_grad():
        model.model(input_ids=torch.tensor([ids]), past_key_values=live)
    for a, b in zip(replay.layers, live.layers):
        torch.testing.assert_close(a._dequantize(a._quantized_keys), b._dequantize(b._quantized_keys))
    # 2-bit codes (1/16 of fp32) + an fp32 scale and shift per group of 64: (0.25 + 8/64) / 4 = 9.375%
    full = len(ids) * 2 * 3 * 64 * 4 * len(live.layers)
    assert sum(per_layer_bytes(replay)) / full == pytest.approx(0.09375, rel=1e-6)


@pytest.mark.eval
@needs_kvpress
def test_kivi_with_per_channel_keys_quantizes_whole_groups_and_keeps_the_rest_exact(smollm2):
    """KIVI's layout (keys per channel): quanto needs whole groups of 64 tokens, so a 300-token prefill
    quantizes 256 and keeps 44 in the full-precision residual; at 256 tokens it equals a live prefill."""
    from transformers import QuantizedCache

    from evaluation.methods import make_method

    model, tokenizer = smollm2
    spec = {"kind": "kivi", "nbits": 2, "axis_key": -1, "axis_value": 0}
    ids = _prompt(tokenizer)
    ctx = _context(model, tokenizer, ids)
    channel = make_method("c", spec).compress(ctx).cache
    token = make_method("t", {"kind": "kivi", "nbits": 2}).compress(ctx).cache
    errors = {}
    for name, cache in (("channel", channel), ("token", token)):
        errors[name] = 0.0
        for layer, keys in zip(cache.layers, ctx.captured.keys):
            quantized = layer._dequantize(layer._quantized_keys)
            n = quantized.shape[-2]
            errors[name] += float((quantized - keys[..., :n, :]).norm() / keys[..., :n, :].norm())
    layer = channel.layers[0]
    assert layer._dequantize(layer._quantized_keys).shape[-2] == 256 and layer.keys.shape[-2] == 44
    torch.testing.assert_close(layer.keys, ctx.captured.keys[0][..., 256:, :])  # the residual is exact
    assert errors["channel"] < 0.6 * errors["token"]  # 0.23 vs 0.62 on average over the layers
    ids = ids[:256]
    replay = make_method("c", spec).compress(_context(model, tokenizer, ids)).cache
    live = QuantizedCache(backend="quanto", config=model.config, nbits=2, axis_key=-1, axis_value=0)
    with torch.no_grad():
        model.model(input_ids=torch.tensor([ids]), past_key_values=live)
    for a, b in zip(replay.layers, live.layers):
        torch.testing.assert_close(a._dequantize(a._quantized_keys), b._dequantize(b._quantized_keys))


@pytest.mark.eval
@needs_kvpress
def test_varrate_press_in_kvpress_pipeline_matches_varrate_cache(smollm2):
    import kvpress  # noqa: F401  (importing kvpress registers the "kv-press-text-generation" pipeline)
    from transformers import pipeline

    from hf_varrate import Bases, VarRateCache, VarRateConfig, bound
    from hf_varrate.press import VarRatePress

    model, tokenizer = smollm2
    context = tokenizer.decode(_prompt(tokenizer, 250))
    press = VarRatePress(Bases.identity(model.config), VarRateConfig(budget=0.5))
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    answer = pipe(context, question="What is this text about?", press=press, max_new_tokens=8)["answer"]
    assert isinstance(answer, str) and answer
    ids = pipe.preprocess(context, [""], "", 10**6)["context_ids"]
    cache = VarRateCache(Bases.identity(model.config), VarRateConfig(budget=0.5), model_config=model.config)
    with bound(model), torch.no_grad():
        model.model(input_ids=ids, past_key_values=cache)
    assert sum(press.layer_bytes().values()) == cache.footprint().bytes


@needs_kvpress
def test_press_from_pretrained_takes_the_cache_presets(tmp_path, tiny_llama):
    from hf_varrate import Bases, VarRateConfig
    from hf_varrate.press import VarRatePress

    Bases.identity(tiny_llama.config).save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="spectrum"):  # identity bases: the default preset drops balance
        default = VarRatePress.from_pretrained(tmp_path, budget=0.3)
    assert default.config == VarRateConfig.preset("recommended", budget=0.3, balance="none")
    paper = VarRatePress.from_pretrained(tmp_path, preset="paper", budget=0.3)
    assert paper.config == VarRateConfig(budget=0.3)


@pytest.mark.eval
@needs_kvpress
def test_smoke_config_runs_end_to_end(tmp_path):
    from evaluation.run import main

    assert main(["--config", str(REPO / "evaluation/configs/smoke.yaml"), "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "examples.jsonl").read_text().splitlines()]
    progress = (tmp_path / "progress.csv").read_text().splitlines()
    assert rows and all(line.endswith(",1,1") for line in progress[1:]), "a planned cell was not run"
    by = {(r["example_id"], r["regime"], r["method"]): r for r in rows}
    for (example, regime, method), row in by.items():
        assert 0.0 <= row["fraction"] <= 1.0 and row["cost"] >= 1.0
        if method == "full":
            assert row["fraction"] == 1.0
        if method.endswith("@0.3"):
            assert row["fraction"] == pytest.approx(0.3, abs=0.01)
        if method == "varrate-press@0.3":  # the kvpress adapter and the cache are the same codec
            twin = by[(example, regime, "varrate@0.3")]
            assert (row["prediction"], row["bytes"]) == (twin["prediction"], twin["bytes"])
    assert {r["regime"] for r in rows if r["task"] == "ppl_wiki"} == {"query_agnostic"}
    for name in ("summary.md", "summary.csv", "comparisons.csv", "run_info.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert len(list((tmp_path / "plots").glob("*.png"))) >= 4


def test_a_tail_is_fed_token_by_token_where_pruned_layers_disagree_on_the_length(tiny_llama, monkeypatch):
    """A press that prunes some layers only (Gemma-3's global ones) leaves layers of different lengths;
    fed in one forward, the tail's later tokens would be visible to its earlier ones in the pruned
    layers. Token by token must give what one forward gives where the lengths agree."""
    from transformers import DynamicCache

    from evaluation.generate import continuation_nll

    ids = torch.randint(5, tiny_llama.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    tail = torch.randint(5, tiny_llama.config.vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()

    def prefilled(prune_first_layer):
        cache = DynamicCache(config=tiny_llama.config)
        with torch.no_grad():
            tiny_llama(ids, past_key_values=cache)
        if prune_first_layer:
            layer = cache.layers[0]
            layer.keys, layer.values = layer.keys[:, :, ::2].contiguous(), layer.values[:, :, ::2].contiguous()
        return cache

    whole = continuation_nll(tiny_llama, prefilled(False), None, tail, 40)
    pruned = prefilled(True)
    assert len({layer.get_seq_length() for layer in pruned.layers}) == 2
    calls = []
    handle = tiny_llama.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        nll, count = continuation_nll(tiny_llama, pruned, None, tail, 40)
    finally:
        handle.remove()
    assert calls == [1] * len(tail) and count == whole[1] == len(tail) - 1
    assert math.isfinite(nll) and nll != whole[0]  # the pruned layer changes the result, through a causal read
    import evaluation.generate as generate

    monkeypatch.setattr(generate, "_lengths_agree", lambda cache: False)  # token by token on the unpruned cache
    by_token = continuation_nll(tiny_llama, prefilled(False), None, tail, 40)
    assert by_token[1] == whole[1] and math.isclose(by_token[0], whole[0], rel_tol=1e-4)
