"""Tier (d): the real default model (SmolLM2-135M-Instruct) end to end, identity basis.

The prompt is ~1.5K tokens of essays with one planted fact, so every case runs in seconds on CPU.
"""

import copy

import pytest
import torch
from transformers import DynamicCache

import hf_varrate
from hf_varrate import Bases, VarRateCache
from hf_varrate.demo import FACTS, chat_parts, essay_text, plant

NEW = 8


@pytest.fixture(scope="module")
def bound_smollm2(smollm2):
    model, tokenizer = smollm2
    with hf_varrate.bound(model):
        yield model, tokenizer


@pytest.fixture(scope="module")
def doc(bound_smollm2):
    _, tokenizer = bound_smollm2
    text = plant(essay_text(), tokenizer, 1100, [FACTS[0][0]], [0.5])
    doc_ids, q_ids = chat_parts(tokenizer, text, FACTS[0][1], FACTS[0][3])
    return doc_ids, q_ids, chat_parts(tokenizer, text, FACTS[1][1], FACTS[1][3])[1]


def generate(model, ids, cache, **kwargs):
    ids = torch.tensor(ids) if not torch.is_tensor(ids) else ids
    ids = ids if ids.ndim == 2 else ids[None]
    kwargs.setdefault("attention_mask", torch.ones_like(ids))
    kwargs.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(ids, past_key_values=cache, max_new_tokens=NEW, pad_token_id=2, **kwargs)


def identity_cache(model, **overrides):
    return VarRateCache(Bases.identity(model.config), model_config=model.config, **overrides)


def test_budget_one_is_identical_to_dynamic_cache(bound_smollm2, doc):
    model, _ = bound_smollm2
    ids = doc[0] + doc[1]
    assert torch.equal(generate(model, ids, identity_cache(model, budget=1.0)),
                       generate(model, ids, DynamicCache(config=model.config)))


def test_budget_02_footprint_and_ranks(bound_smollm2, doc):
    model, _ = bound_smollm2
    cache = identity_cache(model, budget=0.2)
    ids = torch.tensor([doc[0] + doc[1]])
    with torch.no_grad():
        model(ids, past_key_values=cache)
    fp = cache.footprint()
    assert 0.15 <= fp.fraction <= 0.205, fp
    generate(model, torch.cat([ids, torch.tensor([[13]])], dim=1), cache)  # later tokens are stored exactly
    after = cache.footprint()
    prompt, added = ids.shape[1], cache.get_seq_length() - ids.shape[1]
    assert after.fraction == pytest.approx((fp.fraction * prompt + added) / (prompt + added), rel=1e-6)
    assert after.prompt_fraction == pytest.approx(fp.fraction)
    layer = cache.layers[5]
    assert layer.ranks.min() >= 16 and layer.ranks.max() <= 384
    assert layer.ranks.float().std() > 0  # graded, not flat


def test_deepcopy_reuse_equals_fresh_compress_then_ask(bound_smollm2, doc):
    model, _ = bound_smollm2
    doc_ids = torch.tensor([doc[0]])
    base = identity_cache(model, budget=0.3)
    with torch.no_grad():
        model(doc_ids, past_key_values=base)
        base.compress()
    for q_ids in doc[1:]:
        reused = generate(model, doc[0] + q_ids, copy.deepcopy(base))
        fresh = identity_cache(model, budget=0.3)
        with torch.no_grad():
            model(doc_ids, past_key_values=fresh)
            fresh.compress()
        assert torch.equal(reused, generate(model, doc[0] + q_ids, fresh))
    assert base.get_seq_length() == len(doc[0])


def test_beam_search_sampling_and_left_padded_batch(bound_smollm2, doc):
    model, tokenizer = bound_smollm2
    ids = doc[0] + doc[1]
    beams = generate(model, ids, identity_cache(model, budget=0.3), num_beams=2)
    assert beams.shape[0] == 1
    torch.manual_seed(0)
    sampled = generate(model, ids, identity_cache(model, budget=0.3), do_sample=True, top_k=5)
    assert sampled.shape[0] == 1
    short = doc[0][:300] + doc[1]
    batch = torch.full((2, len(ids)), 2)
    mask = torch.zeros_like(batch)
    batch[0], mask[0] = torch.tensor(ids), 1
    batch[1, -len(short):], mask[1, -len(short):] = torch.tensor(short), 1
    cache = identity_cache(model, budget=0.3)
    out = generate(model, batch, cache, attention_mask=mask)
    assert [code.seq_len for code in cache.layers[0].codes] == [len(ids), len(short)]
    alone = generate(model, ids, identity_cache(model, budget=0.3))
    assert torch.equal(out[0, len(ids):], alone[0, len(ids):])
