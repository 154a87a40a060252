"""The card's one-liner: `VarRateCache.from_pretrained(bases)` with no model, in `generate()` and `pipeline()`.

Bases written by this version record the model's layer layout and RoPE frequencies, so a cache built
from them alone codes a query-free configuration exactly as a cache bound to the model does: the
same codes, the same tokens. Query-aware signals and older bases need `model=`, and say so.
"""

import json

import pytest
import torch
from transformers import LlamaConfig, pipeline

import hf_varrate
from hf_varrate import Bases, BasesError, VarRateCache
from hf_varrate.bases import layout_metadata
from hf_varrate.codec import coef_values

from conftest import TINY_SHAPE, _build_tiny

SMALL = dict(stride=8, window=16, obs_window=16, r_min=2, signal="uniform", budget=0.4, balance="none")


def saved_bases(model, folder, **metadata):
    """Identity bases that record `model`'s layout and RoPE, saved to `folder` (as calibration writes them)."""
    bases = Bases.identity(model.config)
    bases = Bases(bases.tensors, {**bases.metadata, **layout_metadata(model), **metadata})
    bases.save_pretrained(folder, dtype=torch.float32)
    return folder


def prompt(model, length=300, batch=1, seed=0):
    return torch.randint(3, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, cache, new=8):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=cache, pad_token_id=0,
                              attention_mask=torch.ones_like(ids))


def codes_of(cache):
    return [(layer.codes[0].ranks.tolist(), coef_values(layer.codes[0])) for layer in cache.layers
            if isinstance(layer, hf_varrate.VarRateLayer) and layer.codes]


@pytest.mark.parametrize("storage", ["materialized", "compact"])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gemma3"])
def test_a_cache_without_the_model_codes_as_a_bound_one(fixture, storage, request, tmp_path):
    model = request.getfixturevalue(fixture)
    folder = saved_bases(model, tmp_path / "bases")
    ids = prompt(model)
    unbound = VarRateCache.from_pretrained(folder, storage=storage, **SMALL)
    assert not hf_varrate.is_bound(model)
    out = greedy(model, ids, unbound)
    bound = VarRateCache.from_pretrained(folder, model=model, storage=storage, **SMALL)
    try:
        expected = greedy(model, ids, bound)
    finally:
        hf_varrate.unbind(model)
    assert torch.equal(out, expected)
    mine, theirs = codes_of(unbound), codes_of(bound)
    assert mine and len(mine) == len(theirs)
    for (ranks, coefs), (ranks_b, coefs_b) in zip(mine, theirs):
        assert ranks == ranks_b and torch.equal(coefs, coefs_b)
    assert unbound.footprint().prompt_fraction < 0.45


def test_a_query_aware_signal_without_the_model_says_to_pass_it(tiny_llama, tmp_path):
    folder = saved_bases(tiny_llama, tmp_path / "bases")
    with pytest.raises(ValueError, match=r"signal='snapkv'.*model=model"):
        VarRateCache.from_pretrained(folder, **{**SMALL, "signal": "snapkv"})


def test_bases_without_a_rope_record_say_to_pass_the_model(tiny_llama, tmp_path):
    Bases.identity(tiny_llama.config).save_pretrained(tmp_path, dtype=torch.float32)  # an older artifact's shape
    with pytest.raises(BasesError, match=r"RoPE.*model=model"):
        VarRateCache.from_pretrained(tmp_path, **SMALL)
    cache = VarRateCache.from_pretrained(tmp_path, model=tiny_llama, **SMALL)  # with the model they still serve
    hf_varrate.unbind(tiny_llama)
    assert cache.rope is not None


def test_a_model_whose_rope_differs_from_the_recorded_one_is_refused(tiny_llama, tmp_path):
    folder = saved_bases(tiny_llama, tmp_path / "bases")
    other = _build_tiny(LlamaConfig(**{**TINY_SHAPE, "rope_theta": 500000.0}))
    with pytest.raises(BasesError, match="rotary frequencies"):
        VarRateCache.from_pretrained(folder, model=other, **SMALL)
    hf_varrate.unbind(other)


def test_the_shipped_bases_record_their_layout_and_rope():
    for name, layers in (("smollm2-135m-instruct", 30), ("gemma-3-270m", 18)):
        bases = Bases.from_pretrained(name)
        assert bases.model_shape().num_layers == layers and bases.rope() is not None


@pytest.mark.slow
def test_real_smollm2_without_the_model_answers_as_with_it(smollm2):
    model, _ = smollm2
    ids = torch.randint(100, 20000, (1, 1200), generator=torch.Generator().manual_seed(0))
    out = greedy(model, ids, VarRateCache.from_pretrained("smollm2-135m-instruct"), new=6)
    with hf_varrate.bound(model):
        expected = greedy(model, ids, VarRateCache.from_pretrained("smollm2-135m-instruct", model=model),
                          new=6)
    assert torch.equal(out, expected)


@pytest.mark.slow
def test_the_card_one_liner_in_a_text_generation_pipeline(smollm2):
    model, tokenizer = smollm2
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    cache = VarRateCache.from_pretrained("smollm2-135m-instruct")
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 60)
    out = generator(text, past_key_values=cache, max_new_tokens=4, do_sample=False, return_full_text=False)
    assert isinstance(out[0]["generated_text"], str)
    fp = cache.footprint()
    assert fp.prompt_fraction < 0.25 and all(layer.codes for layer in cache.layers)


def test_a_cache_on_shipped_bases_records_their_name_and_reloads_anywhere(tmp_path, monkeypatch):
    """Shipped bases are recorded by name, not by the folder of this installation, so a saved cache loads
    in another installation (or from another directory) as well."""
    config = LlamaConfig(vocab_size=128, hidden_size=192, intermediate_size=64, num_hidden_layers=30,
                         num_attention_heads=3, num_key_value_heads=3, head_dim=64, rope_theta=100000.0)
    model = _build_tiny(config)
    cache = VarRateCache.from_pretrained("smollm2-135m-instruct", storage="compact")
    with torch.no_grad():
        model(prompt(model, 300), past_key_values=cache)
    cache.save_pretrained(tmp_path / "doc")
    recorded = json.loads((tmp_path / "doc" / "cache_config.json").read_text())["bases"]["source"]
    assert recorded == "smollm2-135m-instruct"
    monkeypatch.chdir(tmp_path)
    loaded = VarRateCache.load(tmp_path / "doc", model=model)
    hf_varrate.unbind(model)
    assert loaded.get_seq_length() == 300 and loaded.layers[0].codes

