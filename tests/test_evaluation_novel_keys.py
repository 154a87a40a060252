"""The evaluation-only exact keys for the sentences that differ most from their neighbours
(evaluation/methods/novel_keys.py): sentences as the decoded text has them, the novelty, the choice of whole
sentences, and a method that puts back those coded keys within its total budget."""

from __future__ import annotations

import pytest
import torch

from evaluation.methods import novel_keys as nk
from evaluation.methods.varrate import NOVELTY


def test_a_token_is_in_the_sentence_its_last_character_is_in(smollm2):
    _, tokenizer = smollm2
    text = "The cat sat. Then it ran away!\nA new line starts here? Yes it does."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    sentences = nk.sentence_of(tokenizer, ids)
    words = [tokenizer.decode([i]) for i in ids]
    by_sentence = {}
    for word, sentence in zip(words, sentences.tolist()):
        by_sentence.setdefault(sentence, []).append(word)
    assert ["".join(w).strip() for _, w in sorted(by_sentence.items())] == [
        "The cat sat.", "Then it ran away!", "A new line starts here?", "Yes it does."]
    assert sentences.tolist() == sorted(sentences.tolist())


def test_a_tokenizer_that_does_not_round_trip_is_refused(smollm2):
    _, tokenizer = smollm2
    pieces = [tokenizer(part, add_special_tokens=False)["input_ids"] for part in ("H", "ello", " there.")]
    ids = [i for piece in pieces for i in piece]  # "Hello" in two tokens: it re-encodes as one
    assert ids != tokenizer("Hello there.", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="re-encode"):
        nk.sentence_of(tokenizer, ids)


def sentences_of(sizes: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(sizes)])


def test_the_sentence_unlike_its_neighbours_is_the_most_novel_and_an_empty_one_is_never_chosen():
    generator = torch.Generator().manual_seed(0)
    sizes = [4, 6, 5, 0, 7, 5, 6, 4, 5, 6, 5, 7]
    sentences = sentences_of(sizes)
    common = torch.randn(2 * 8, generator=generator)
    values = common + 0.1 * torch.randn(sentences.numel(), 16, generator=generator)
    values[sentences == 6] = torch.randn(16, generator=generator)  # sentence 6 writes something else
    layer = values.reshape(-1, 2, 8).permute(1, 0, 2)[None]  # [1, H=2, S, d=8]
    novelty = nk.sentence_novelty({0: layer, 3: layer}, sentences, window=2)
    assert novelty.shape == (len(sizes),) and novelty[3] == float("-inf")
    assert int(novelty.argmax()) == 6
    # its neighbours' surroundings hold it, so they come next among the others
    assert set(novelty.argsort(descending=True)[1:3].tolist()) <= {4, 5, 7, 8}
    alone = nk.sentence_novelty({0: layer}, sentences, window=2)
    assert torch.allclose(alone[alone.isfinite()], novelty[novelty.isfinite()])  # the mean of equal layers


def test_whole_sentences_are_chosen_until_the_share_is_held_the_first_left_out():
    sentences = sentences_of([5, 4, 6, 3, 2])  # 20 tokens
    novelty = torch.tensor([9.0, 0.1, 0.5, 0.7, float("-inf")])
    assert nk.novel_tokens(novelty, sentences, 0.1).tolist() == [15, 16, 17]  # sentence 3: 3 >= 2 tokens
    assert nk.novel_tokens(novelty, sentences, 0.2).tolist() == [9, 10, 11, 12, 13, 14, 15, 16, 17]  # 3, then 2
    everything = nk.novel_tokens(novelty, sentences, 0.99).tolist()  # never the first or an empty sentence
    assert everything == list(range(5, 18))


def test_the_novel_sentences_keys_are_put_back_exact_within_the_total_budget(tiny_llama, one_intra_op_thread,
                                                                            monkeypatch):
    from hf_varrate import Bases

    from evaluation.capture import capture, full_attention_layers
    from evaluation.methods import make_method
    from evaluation.methods import read_keys as rk
    from evaluation.methods.base import Context

    ids = torch.randint(2, 128, (700,), generator=torch.Generator().manual_seed(3)).tolist()
    sentences = torch.arange(700) // 7  # a tokenizer is not what this checks: sentences of 7 tokens
    monkeypatch.setattr(nk, "sentence_of", lambda tokenizer, prompt: sentences[: len(prompt)])
    captured = capture(tiny_llama, ids)
    spec = {"kind": "varrate", "preset": "recommended", "budget": 0.3, "budget_dtype": "float16", "balance": "none",
            "storage": "materialized", "eval_novel_keys": 0.05, "eval_novel_window": 3}
    method = make_method("novel5", spec)
    method._bases[("tiny", "test")] = Bases.identity(tiny_llama.config)
    comp = method.compress(Context(tiny_llama, None, "tiny", captured, ids), "test")
    layers = full_attention_layers(tiny_llama)
    chosen = nk.choose(None, ids, captured, layers, 0.05, window=3)
    assert all(torch.equal(chosen[i], chosen[layers[0]]) for i in layers)  # one choice for every layer
    assert 35 <= chosen[layers[0]].numel() < 42 and chosen[layers[0]].numel() % 7 == 0
    assert comp.extra["fraction_fp16"] <= 0.3 + 2e-3
    total = 0
    for i, layer in enumerate(comp.cache.layers):
        coded = layer.codes[0].coded_pos.long()
        put = chosen[i][torch.isin(chosen[i], coded)]
        keys, true = layer.keys[0], captured.keys[i][0]
        assert put.numel() > 0 and torch.equal(keys[:, put], true[:, put].to(keys.dtype))
        rest = coded[~torch.isin(coded, put)]
        assert not torch.equal(keys[:, rest], true[:, rest])
        footprint = comp.cache.footprint().layers[i].bytes
        assert comp.extra["stored_bytes"][i] == footprint + rk.key_bytes(put.numel(), true.shape[0], true.shape[-1])
        total += put.numel()
    assert comp.extra["eval_novel_exact_keys"] == total


def test_eval_novelty_gives_the_novel_sentences_the_rank_the_others_give_up(tiny_llama, one_intra_op_thread,
                                                                           monkeypatch, restore_signals):
    from hf_varrate import Bases

    from evaluation.capture import capture, full_attention_layers
    from evaluation.methods import make_method, varrate
    from evaluation.methods.base import Context

    ids = torch.randint(2, 128, (700,), generator=torch.Generator().manual_seed(4)).tolist()
    sentences = torch.arange(700) // 7
    monkeypatch.setattr(nk, "sentence_of", lambda tokenizer, prompt: sentences[: len(prompt)])
    captured = capture(tiny_llama, ids)
    base = {"kind": "varrate", "preset": "recommended", "budget": 0.3, "budget_dtype": "float16", "balance": "none"}
    compressed = {}
    for name, fields in {"uniform": {}, "novel": {"signal": NOVELTY, "eval_novel_share": 0.05,
                                                 "eval_novel_window": 3, "flat_floor": 0.9}}.items():
        method = make_method(name, {**base, **fields})
        method._bases[("tiny", "test")] = Bases.identity(tiny_llama.config)
        compressed[name] = method.compress(Context(tiny_llama, None, "tiny", captured, ids), "test")
    assert varrate._novel["current"] is None  # set only around the replay
    chosen = nk.most_novel(None, ids, captured, full_attention_layers(tiny_llama), 0.05, window=3)
    assert compressed["novel"].extra["eval_novel_tokens"] == chosen.numel() > 0
    for flat_layer, layer in zip(compressed["uniform"].cache.layers, compressed["novel"].cache.layers):
        flat, code = flat_layer.codes[0], layer.codes[0]
        assert int(code.ranks.long().sum()) == int(flat.ranks.long().sum())  # the same coefficients, moved
        novel = torch.isin(code.coded_pos.long(), chosen)
        ranks, flat_rank = code.ranks.long(), float(flat.ranks.double().mean())
        assert novel.any() and (~novel).any()
        assert ranks[novel].min() > ranks[~novel].max()
        assert ranks[~novel].min() >= int(0.9 * flat_rank) - 1  # the others keep the floor of 0.9 x flat
    assert compressed["novel"].extra["fraction_fp16"] <= 0.3 + 2e-3


@pytest.mark.parametrize("fields, match", [
    ({"signal": "eval_novelty"}, "go together"),
    ({"eval_novel_share": 0.05}, "go together"),
    ({"signal": "eval_novelty", "eval_novel_share": 1.5}, r"in \(0, 1\)"),
    ({"signal": "eval_novelty", "eval_novel_share": 0.05, "storage": "materialized", "eval_novel_keys": 0.02},
     "drop one"),
    ({"signal": "eval_novelty", "eval_novel_share": 0.05, "impl": "press"}, "got impl: 'press'; use impl: cache"),
])
def test_eval_novelty_refuses_a_spec_it_cannot_honour(fields, match, restore_signals):
    from evaluation.methods import make_method

    with pytest.raises(ValueError, match=match):
        make_method("bad", {"kind": "varrate", "preset": "recommended", "budget": 0.2, "budget_dtype": "float16",
                            **fields})


def test_most_novel_shares_choose_as_most_novel_does_at_each_share(tiny_llama, one_intra_op_thread, monkeypatch):
    from evaluation.capture import capture, full_attention_layers

    ids = torch.randint(2, 128, (500,), generator=torch.Generator().manual_seed(6)).tolist()
    monkeypatch.setattr(nk, "sentence_of", lambda tokenizer, prompt: torch.arange(len(prompt)) // 9)
    captured, layers = capture(tiny_llama, ids), full_attention_layers(tiny_llama)
    together = nk.most_novel_shares(None, ids, captured, layers, [0.02, 0.05], window=3)
    for share, rows in together.items():
        assert torch.equal(rows, nk.most_novel(None, ids, captured, layers, share, window=3))
    assert 0 < together[0.02].numel() < together[0.05].numel()
    assert torch.isin(together[0.02], together[0.05]).all()  # the most novel sentences come first at either share
