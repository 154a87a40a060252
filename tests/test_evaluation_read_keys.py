"""The evaluation-only exact keys for the most read tokens (evaluation/methods/read_keys.py): the attention read
as the model computes it, the choice, and a method that puts back only the chosen coded keys within its total
budget."""

from __future__ import annotations

import pytest
import torch

from evaluation.methods import read_keys as rk


def test_the_attention_read_is_what_the_model_computes_over_the_queries_that_see_each_token(tiny_llama):
    from evaluation.capture import capture, full_attention_layers

    ids = torch.randint(3, tiny_llama.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    layers = full_attention_layers(tiny_llama)
    with torch.no_grad():
        read = rk.attention_read(tiny_llama, capture(tiny_llama, ids), layers, stride=4)
        tiny_llama.set_attn_implementation("eager")
        weights = tiny_llama(torch.tensor([ids]), output_attentions=True).attentions
    rows = torch.arange(3, 40, 4)
    for i in layers:
        received = weights[i][0][:, rows].sum(dim=(0, 1))  # every 4th query, heads summed
        seen = (rows[:, None] >= torch.arange(40)[None]).sum(dim=0)
        assert torch.allclose(read[i], received / seen, atol=1e-5)


def test_the_most_read_are_chosen_per_layer_and_never_the_first_token():
    from studies.needle_attention import random_keys

    read = {3: torch.tensor([9.0, 0.1, 0.5, 0.2, 0.4, 0.3, 0.0, 0.6, 0.05, 0.15])}
    assert rk.most_read(read, 0.2)[3].tolist() == [2, 7]  # the sink at 0 is stored exactly anyway
    assert rk.most_read(read, 0.01)[3].tolist() == [7]  # at least one
    drawn = random_keys(1000, [0, 5], 0.02)  # the study's control draws as many, also never the first
    assert all(len(rows) == 20 and 0 not in rows.tolist() and len(set(rows.tolist())) == 20 for rows in drawn.values())
    assert drawn[0].tolist() != drawn[5].tolist() and random_keys(1000, [0], 0.02)[0].tolist() == drawn[0].tolist()


def spec(**fields):
    return {"kind": "varrate", "preset": "recommended", "budget": 0.3, "budget_dtype": "float16", "balance": "none",
            "storage": "materialized", "eval_read_keys": 0.05, "eval_read_stride": 8, **fields}


def test_only_the_chosen_coded_keys_are_put_back_exact_within_the_total_budget(tiny_llama, one_intra_op_thread):
    from hf_varrate import Bases

    from evaluation.capture import capture, full_attention_layers
    from evaluation.methods import make_method
    from evaluation.methods.base import Context

    bases = Bases.identity(tiny_llama.config)
    ids = torch.randint(2, 128, (700,), generator=torch.Generator().manual_seed(3)).tolist()
    captured = capture(tiny_llama, ids)
    method = make_method("read5", spec())
    method._bases[("tiny", "test")] = bases
    comp = method.compress(Context(tiny_llama, None, "tiny", captured, ids), "test")
    alone = make_method("alone", {k: v for k, v in spec().items() if not k.startswith("eval_read")})
    alone._bases[("tiny", "test")] = bases
    spends = alone.compress(Context(tiny_llama, None, "tiny", captured, ids), "test").extra["fraction_fp16"]
    # the total, the exact keys' bytes in it: at most the budget, and short of it by no more than the codec alone is
    assert spends - 0.01 <= comp.extra["fraction_fp16"] <= 0.3 + 2e-3
    assert comp.extra["eval_read_codec_budget"] < 0.3 - rk.share(0.05) + 0.05
    plain = make_method("codec", {k: v for k, v in spec(budget=comp.extra["eval_read_codec_budget"]).items()
                                  if not k.startswith("eval_read")})
    plain._bases[("tiny", "test")] = bases
    reference = plain.compress(Context(tiny_llama, None, "tiny", captured, ids), "test").cache
    chosen = rk.most_read(rk.attention_read(tiny_llama, captured, full_attention_layers(tiny_llama), 8), 0.05)
    footprint, total = comp.cache.footprint().layers, 0
    for i, layer in enumerate(comp.cache.layers):
        coded = layer.codes[0].coded_pos.long()
        put = chosen[i][torch.isin(chosen[i], coded)]
        others = torch.ones(len(ids), dtype=torch.bool)
        others[put] = False
        keys, true = layer.keys[0], captured.keys[i][0]
        assert put.numel() > 0 and torch.equal(keys[:, put], true[:, put].to(keys.dtype))
        assert not torch.equal(keys[:, coded[~torch.isin(coded, put)]], true[:, coded[~torch.isin(coded, put)]])
        assert torch.equal(keys[:, others], reference.layers[i].keys[0][:, others])  # the rest are the codec's
        assert torch.equal(layer.values, reference.layers[i].values)
        heads, dim = true.shape[0], true.shape[-1]
        assert comp.extra["stored_bytes"][i] == footprint[i].bytes + rk.key_bytes(put.numel(), heads, dim)
        total += put.numel()
    assert comp.extra["eval_read_exact_keys"] == total


@pytest.mark.parametrize("fields, match", [({"storage": "compact"}, "materialized"),
                                           ({"eval_read_keys": 0}, "eval_read_keys=0"),
                                           ({"eval_keys_bits": 4, "key_weight": 0.01}, r"none of \['eval_keys_bits'\]"),
                                           ({"eval_novel_keys": 0.02}, r"none of \['eval_novel_keys'\]")])
def test_a_spec_the_rewrite_cannot_honour_is_refused_naming_what_to_change(fields, match):
    from evaluation.methods import make_method

    with pytest.raises(ValueError, match=match):
        make_method("bad", spec(**fields))
