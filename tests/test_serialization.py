"""Tier (c): a compressed cache saved to safetensors + JSON, loaded back (in any storage), generating the same."""

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_varrate
from hf_varrate import Bases, VarRateCache
from hf_varrate.cache_checks import CONFIG_NAME, TENSORS_NAME, seal
from hf_varrate.errors import CacheFileError

from conftest import TINY_SHAPE
from test_cache import prompt
from test_cache import SMALL
from test_storage import make


def compressed(model, storage="materialized", doc_len=300, **overrides):
    cache = make(model, storage, **overrides)
    with torch.no_grad():
        model(prompt(model, doc_len), past_key_values=cache)
        cache.compress()
    return cache


def answer(model, cache, doc_len=300, seed=1):
    ids = torch.cat([prompt(model, doc_len), prompt(model, 6, seed=seed)], dim=1)
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache, pad_token_id=0)


COMPONENT_SCALES = {"coef_bits": 3, "coef_scales": "component", "signal": "uniform", "quantized_budget": "same_bytes"}
RANK_SCALES = {**COMPONENT_SCALES, "allocation": "distortion"}  # ranks that vary: scales on axis "rank"


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gemma3"])
@pytest.mark.parametrize("saved", ["materialized", "compact"])
@pytest.mark.parametrize("loaded", ["materialized", "compact"])
@pytest.mark.parametrize("overrides", [{}, {"coef_bits": 3}, {"coef_bits": 2}, COMPONENT_SCALES, RANK_SCALES])
def test_save_load_generate_equals_the_in_memory_run(fixture, saved, loaded, overrides, request, tmp_path):
    model = request.getfixturevalue(fixture)
    cache = compressed(model, saved, **overrides)
    expected = answer(model, copy.deepcopy(cache))
    cache.save_pretrained(tmp_path)
    if overrides is RANK_SCALES:
        assert '"axis": "rank"' in (tmp_path / CONFIG_NAME).read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CONFIG_NAME, TENSORS_NAME])
    hf_varrate.unbind(model)
    loaded_cache = VarRateCache.load(tmp_path, model=model, storage=loaded)
    assert hf_varrate.is_bound(model)
    assert loaded_cache.get_seq_length() == 300 and loaded_cache.config.storage == loaded
    assert loaded_cache.footprint().bytes == cache.footprint().bytes
    assert torch.equal(answer(model, loaded_cache), expected)


def test_saved_file_is_as_small_as_the_footprint(tiny_llama, tmp_path):
    cache = compressed(tiny_llama, "materialized", budget=0.3)
    cache.save_pretrained(tmp_path)
    tensor_bytes = (tmp_path / TENSORS_NAME).stat().st_size
    fp = cache.footprint()
    assert tensor_bytes < fp.bytes + 20_000  # codes + exact tokens + the safetensors header
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert list(meta) == sorted(meta) and meta["bases"]["source"] == "identity"


def test_after_a_conversation_the_appended_tokens_come_back(tiny_llama, tmp_path):
    cache = compressed(tiny_llama, "compact")
    first = answer(tiny_llama, cache)  # the cache now also holds the question and the answer
    cache.save_pretrained(tmp_path)
    loaded = VarRateCache.load(tmp_path, model=tiny_llama)
    assert loaded.get_seq_length() == cache.get_seq_length() == first.shape[1] - 1
    follow = torch.cat([first, prompt(tiny_llama, 4, seed=5)], dim=1)
    with torch.no_grad():
        a = tiny_llama(follow[:, -5:], past_key_values=cache).logits
        cache.compress()
        b = tiny_llama(follow[:, -5:], past_key_values=loaded).logits
    assert torch.equal(a, b)


def test_left_padded_batch_round_trips(tiny_llama, tmp_path):
    ids, mask = torch.zeros(2, 320, dtype=torch.long), torch.zeros(2, 320, dtype=torch.long)
    ids[0], mask[0] = prompt(tiny_llama, 320, seed=3)[0], 1
    ids[1, 60:], mask[1, 60:] = prompt(tiny_llama, 260, seed=4)[0], 1
    cache = make(tiny_llama, "compact")
    with torch.no_grad():
        tiny_llama(ids, attention_mask=mask, past_key_values=cache)
        cache.compress()
    cache.save_pretrained(tmp_path)
    loaded = VarRateCache.load(tmp_path, model=tiny_llama, storage="materialized")
    step, full_mask = prompt(tiny_llama, 1, batch=2, seed=7), torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    positions = torch.tensor([[320], [260]])
    with torch.no_grad():
        a = tiny_llama(step, attention_mask=full_mask, position_ids=positions, past_key_values=cache).logits
        cache.compress()
        b = tiny_llama(step, attention_mask=full_mask, position_ids=positions, past_key_values=loaded).logits
    assert torch.equal(a, b)


def test_right_padded_batch_round_trips(tiny_llama, tmp_path):
    """Every row ends in padding, so the prompt's last slots belong to no row: still our own file, and it loads."""
    ids, mask = torch.zeros(2, 320, dtype=torch.long), torch.zeros(2, 320, dtype=torch.long)
    ids[0, :300], mask[0, :300] = prompt(tiny_llama, 300, seed=3)[0], 1
    ids[1, :260], mask[1, :260] = prompt(tiny_llama, 260, seed=4)[0], 1
    cache = make(tiny_llama, "compact")
    with torch.no_grad():
        tiny_llama(ids, attention_mask=mask, past_key_values=cache)
        cache.compress()
    cache.save_pretrained(tmp_path)
    loaded = VarRateCache.load(tmp_path, model=tiny_llama)
    step, full_mask = prompt(tiny_llama, 1, batch=2, seed=7), torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    positions = torch.tensor([[300], [260]])
    with torch.no_grad():
        a = tiny_llama(step, attention_mask=full_mask, position_ids=positions, past_key_values=cache).logits
        cache.compress()
        b = tiny_llama(step, attention_mask=full_mask, position_ids=positions, past_key_values=loaded).logits
    assert torch.equal(a, b)


def corrupt_byte(path, offset=-10):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip_tensor_byte", "truncate_tensors", "drop_tensors", "drop_config",
                                    "garbage_config", "future_version", "drop_field"])
def test_damaged_files_raise_our_error(tiny_llama, tmp_path, damage):
    compressed(tiny_llama, "compact").save_pretrained(tmp_path)
    tensors, config = tmp_path / TENSORS_NAME, tmp_path / CONFIG_NAME
    meta = json.loads(config.read_text())
    if damage == "flip_tensor_byte":
        corrupt_byte(tensors)
    elif damage == "truncate_tensors":
        tensors.write_bytes(tensors.read_bytes()[:100])
    elif damage == "drop_tensors":
        tensors.unlink()
    elif damage == "drop_config":
        config.unlink()
    elif damage == "garbage_config":
        config.write_bytes(b"\x00{not json")
    elif damage == "future_version":
        config.write_text(json.dumps({**meta, "format_version": 99}))
    elif damage == "drop_field":
        config.write_text(json.dumps({k: v for k, v in meta.items() if k != "layers"}))
    with pytest.raises(CacheFileError):
        VarRateCache.load(tmp_path, model=tiny_llama)


def test_a_consistent_but_wrong_layer_table_raises_our_error(tiny_llama, tmp_path):
    compressed(tiny_llama, "compact").save_pretrained(tmp_path)
    config = tmp_path / CONFIG_NAME
    meta = json.loads(config.read_text())
    meta["layers"][0]["rows"][0]["seq_len"] = 290  # the exact tokens no longer fit the layout
    config.write_text(json.dumps(seal(meta)))  # resealed, as a writer's bug would: the layout checks catch it
    with pytest.raises(CacheFileError, match="not a consistent saved cache"):
        VarRateCache.load(tmp_path, model=tiny_llama)


def test_another_model_or_other_bases_are_refused(tiny_llama, tiny_qwen3, tmp_path):
    compressed(tiny_llama, "compact").save_pretrained(tmp_path)
    wider = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY_SHAPE, "num_key_value_heads": 4}))
    with pytest.raises(CacheFileError, match="num_kv_heads"):
        VarRateCache.load(tmp_path, model=wider)
    scaled = Bases.from_tensors({i: torch.eye(64).flip(0) for i in range(2)}, tiny_llama.config)
    with pytest.raises(CacheFileError, match="other bases"):
        VarRateCache.load(tmp_path, model=tiny_llama, bases=scaled)
    tiny_qwen3.model.rotary_emb.inv_freq.mul_(0.5)  # same shapes, other RoPE
    with pytest.raises(CacheFileError, match="RoPE"):
        VarRateCache.load(tmp_path, model=tiny_qwen3)


def test_bases_from_a_relative_folder_are_found_again_from_anywhere(tiny_llama, tmp_path, monkeypatch):
    Bases.identity(tiny_llama.config).save_pretrained(tmp_path / "bases", card=False)
    monkeypatch.chdir(tmp_path)
    cache = VarRateCache.from_pretrained("bases", model=tiny_llama, **{**SMALL, "budget": 0.4})
    with torch.no_grad():
        tiny_llama(prompt(tiny_llama, 300), past_key_values=cache)
        cache.compress()
    expected = answer(tiny_llama, copy.deepcopy(cache))
    cache.save_pretrained(tmp_path / "doc")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = VarRateCache.load(tmp_path / "doc", model=tiny_llama)
    assert torch.equal(answer(tiny_llama, loaded), expected)


def test_loading_never_unpickles(tiny_llama, tmp_path, monkeypatch):
    compressed(tiny_llama, "compact").save_pretrained(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("torch.load / pickle must not be used")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr("pickle.load", refuse)
    monkeypatch.setattr("pickle.loads", refuse)
    assert VarRateCache.load(tmp_path, model=tiny_llama).get_seq_length() > 0  # loaded without unpickling


def test_materialized_cache_cropped_into_its_prompt_cannot_be_saved(tiny_llama, tmp_path):
    cache = compressed(tiny_llama, "materialized")
    cache.crop(-5)
    with pytest.raises(CacheFileError, match="cropped"):
        cache.save_pretrained(tmp_path)


def test_real_smollm2_save_load_answer(smollm2, tmp_path):
    model, _ = smollm2
    doc = torch.randint(100, 20000, (1, 1000), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([doc, torch.randint(100, 20000, (1, 8), generator=torch.Generator().manual_seed(1))], 1)
    with hf_varrate.bound(model):
        cache = VarRateCache(Bases.identity(model.config), model=model, budget=0.3, storage="compact")
        with torch.no_grad():
            model(doc, past_key_values=cache)
            cache.compress()
            expected = model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=copy.deepcopy(cache),
                                      pad_token_id=2, attention_mask=torch.ones_like(ids))
        cache.save_pretrained(tmp_path)
        loaded = VarRateCache.load(tmp_path, model=model, storage="materialized")
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=loaded, pad_token_id=2,
                                 attention_mask=torch.ones_like(ids))
    assert torch.equal(got, expected)
