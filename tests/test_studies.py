"""The studies built on the harness (studies/): needle confusions, needle attention, kept digits."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch


HAS_KVPRESS = importlib.util.find_spec("kvpress") is not None
needs_kvpress = pytest.mark.skipif(not HAS_KVPRESS, reason="kvpress is not installed (it pins transformers < 5.3): "
                                   "run in .venv-eval (make eval-venv)")
REPO = Path(__file__).resolve().parents[1]


# studies/ -------------------------------------------------------------------------------------------
def test_needle_confusions_tell_another_needles_value_from_a_lost_one():
    from studies.needle_confusions import classify, confusions, planted
    from evaluation.tasks.needle import NEEDLE

    text = " ".join(NEEDLE.format(key=k, value=v) for k, v in [("odd-tiger", "1234567"), ("calm-river", "7654321")])
    values = planted("Essay text. " + text + " More text.")
    assert values == {"odd-tiger": "1234567", "calm-river": "7654321"}
    assert classify(": 1234567.", "1234567", values) == "right"
    assert classify(": 7654321.", "1234567", values) == "another needle"
    assert classify(": 7654329.", "1234567", values) == "not planted"
    assert classify(" is a secret.", "1234567", values) == "no number"
    rows = [{"length": 8, "example_id": "e", "regime": "r", "method": m, "prediction": p, "answers": ["1234567"]}
            for m, p in [("a", "7654321"), ("a", "1234567"), ("b", "1111111")]]
    counts = confusions(rows, {(8, "e"): text})
    assert counts[(8, "r", "a")] == {"another needle": 1, "right": 1} and counts[(8, "r", "b")] == {"not planted": 1}


def test_needle_attention_locates_each_needles_key_words_and_value(smollm2):
    from studies.needle_attention import ASKED_PATTERN, GROUPS, token_groups
    from evaluation.tasks import build_examples

    _, tokenizer = smollm2
    example = build_examples("niah_multikey", tokenizer, True, 512, 1)[0]
    ids = example.segments.context
    asked = ASKED_PATTERN.search(tokenizer.decode(example.segments.tail)).group(1)
    groups = token_groups(tokenizer, ids, asked)
    assert sorted(torch.cat(list(groups.values())).tolist()) == list(range(len(ids)))  # a partition
    text = lambda group: tokenizer.decode([ids[i] for i in groups[group]])  # noqa: E731
    assert text("asked key words").strip() == asked and text("asked value").strip() == example.answers[0]
    others = {k for k, _ in re.findall(r"for (\S+) is: (\d+)", tokenizer.decode(ids))} - {asked}
    assert len(others) == 3 and all(key in text("other key words") for key in others)
    assert "magic numbers for" in text("asked rest") and "magic numbers for" not in text("haystack")
    with pytest.raises(ValueError, match="in 0 needles"):
        token_groups(tokenizer, ids, "no-such-key")
    assert set(groups) == set(GROUPS)


def test_needle_attention_puts_back_exact_rows_in_a_copy_and_groups_query_heads():
    from types import SimpleNamespace

    from studies.needle_attention import answer_attention, put_back, ranks_at, relative_error

    torch.manual_seed(0)
    exact = {0: torch.randn(1, 2, 6, 4)}
    coded = exact[0] + 0.1 * torch.randn(1, 2, 6, 4)
    cache = SimpleNamespace(layers=[SimpleNamespace(keys=coded.clone(), values=coded.clone())])
    patched = put_back(cache, exact, [0], "keys", torch.tensor([1, 4]))
    assert torch.equal(cache.layers[0].keys, coded)  # the original is untouched
    assert torch.equal(patched.layers[0].keys[:, :, [1, 4]], exact[0][:, :, [1, 4]])
    assert torch.equal(patched.layers[0].keys[:, :, [0, 2, 3, 5]], coded[:, :, [0, 2, 3, 5]])
    assert torch.equal(patched.layers[0].values, coded)
    error = relative_error(exact[0][0], patched.layers[0].keys[0])
    assert error[[1, 4]].tolist() == [0.0, 0.0] and (error[[0, 2, 3, 5]] > 0).all()
    query = torch.randn(4, 4)  # 4 query heads over 2 KV heads: heads 0, 1 read KV head 0
    weights = answer_attention(query, exact[0][0], 0.5)
    assert torch.allclose(weights[1], torch.softmax(exact[0][0, 0] @ query[1] * 0.5, dim=0))
    assert torch.allclose(weights[2], torch.softmax(exact[0][0, 1] @ query[2] * 0.5, dim=0))
    code = SimpleNamespace(stored_exactly=False, coded_pos=torch.tensor([1, 2, 4, 5]),
                           ranks=torch.tensor([8, 9, 10, 11]))
    assert ranks_at(code, torch.tensor([0, 2, 5]), 6).tolist() == [9.0, 11.0]  # position 0 is exact: no rank
    assert ranks_at(SimpleNamespace(stored_exactly=True), torch.tensor([0]), 6) is None


def test_needle_attention_scales_the_chosen_keys_to_their_exact_norms_keeping_the_codes_direction():
    from types import SimpleNamespace

    from studies.needle_attention import norm_ratio, put_back

    torch.manual_seed(0)
    exact = {0: torch.randn(1, 2, 6, 4)}
    coded = 0.5 * exact[0] + 0.1 * torch.randn(1, 2, 6, 4)  # shrunk: every norm ratio near a half
    cache = SimpleNamespace(layers=[SimpleNamespace(keys=coded.clone(), values=coded.clone())])
    assert (norm_ratio(exact[0][0], coded[0]) < 0.8).all()
    patched = put_back(cache, exact, [0], "key norms", torch.tensor([0, 3]))
    assert torch.equal(cache.layers[0].keys, coded)  # the original is untouched
    keys = patched.layers[0].keys
    assert torch.allclose(keys[:, :, [0, 3]].norm(dim=-1), exact[0][:, :, [0, 3]].norm(dim=-1))
    assert torch.allclose(torch.cosine_similarity(keys[:, :, [0, 3]], coded[:, :, [0, 3]], dim=-1),
                          torch.ones(1, 2, 2))
    assert torch.equal(keys[:, :, [1, 2, 4, 5]], coded[:, :, [1, 2, 4, 5]])
    assert torch.equal(patched.layers[0].values, coded)
    assert torch.allclose(norm_ratio(exact[0][0][:, [0, 3]], keys[0][:, [0, 3]]), torch.ones(2))
    halved = put_back(cache, exact, [0], "halved key error", torch.tensor([2])).layers[0].keys
    assert torch.allclose(halved[:, :, 2] - exact[0][:, :, 2], (coded[:, :, 2] - exact[0][:, :, 2]) / 2)
    assert torch.equal(halved[:, :, [0, 1, 3, 4, 5]], coded[:, :, [0, 1, 3, 4, 5]])


def test_needle_attention_counts_paired_flips_per_variant():
    from studies.needle_attention import GROUPS, NEEDLES, VARIANTS, flips, summarize

    answers = [{"full": "right", "codes": "another needle"}, {"full": "right", "codes": "right"},
               {"full": "another needle", "codes": "right"}, {"full": "right", "codes": "another needle"}]
    assert flips(answers, "full", "codes") == (2, 1) and flips(answers, "codes", "full") == (1, 2)
    numbers = {f"{kind} error: {g}": 0.1 for kind in ("key", "value") for g in GROUPS}
    numbers |= {f"exact share: {g}": 0.0 for g in GROUPS}
    numbers |= {f"attention {name} L3: {needle}": 0.0 for name in ("full", "codes") for needle in NEEDLES}
    results = [{**numbers, "answers": {**{v: a["codes"] for v in VARIANTS}, **a}} for a in answers]
    table = summarize(results, [3])
    assert "| full | 3 | 1 | 0 | 0 | +2 / -1 | +0 / -0 |" in table
    assert "| codes | 2 | 2 | 0 | 0 | +0 / -0 | +1 / -2 |" in table


def test_needle_attention_groups_a_single_needle_with_no_other_groups(smollm2):
    from studies.needle_attention import ASKED_PATTERN, token_groups
    from evaluation.tasks import build_examples

    _, tokenizer = smollm2
    example = build_examples("niah_single", tokenizer, True, 512, 1)[0]
    ids = example.segments.context
    groups = token_groups(tokenizer, ids, ASKED_PATTERN.search(tokenizer.decode(example.segments.tail)).group(1))
    assert tokenizer.decode([ids[i] for i in groups["asked value"]]).strip() == example.answers[0]
    assert all(len(groups[g]) == 0 for g in groups if g.startswith("other"))
    assert sum(map(len, groups.values())) == len(ids)


def test_needle_attention_places_the_error_in_its_tenth_of_the_prompt_and_tables_answers_by_depth():
    from types import SimpleNamespace

    from studies.needle_attention import depth_table, position_errors

    torch.manual_seed(0)
    exact = torch.randn(1, 2, 20, 4)
    coded = exact.clone()
    coded[:, :, 2:4] += 0.5 * torch.randn(1, 2, 2, 4)  # positions 2-3: the prompt's second tenth of 20 tokens
    context = SimpleNamespace(length=20, keys={0: exact}, values={0: exact})
    found = position_errors(context, SimpleNamespace(layers=[SimpleNamespace(keys=coded, values=exact)]), [0])
    assert found["key error: tenth 1"] > 0.1 and found["exact share: tenth 1"] == 0.0
    assert all(found[f"key error: tenth {t}"] == 0 and found[f"exact share: tenth {t}"] == 1
               for t in (0, *range(2, 10)))
    assert all(found[f"value error: tenth {t}"] == 0 for t in range(10))
    row = lambda depth, codes, nll: {"depth": depth, "answers": {"full": "right", "codes": codes},  # noqa: E731
                                     "answer nll": {"full": 0.1, "codes": nll},
                                     "key error: asked rest": 0.1, "attention full L3: asked needle": 0.02,
                                     "attention codes L3: asked needle": 0.01}
    rows = [row(0.1, "not planted", 0.5), row(0.1, "right", 0.3), row(0.9, "right", 0.1)]
    table = depth_table(rows, [3], ["full", "codes"])
    assert "| 0.0-0.2 | 2 | 2 | 1 | -0.300 [-0.400, -0.200] | 0.100 | 0.0200 | 0.0100 |" in table  # codes less sure
    assert "| 0.8-1.0 | 1 | 1 | 1 | +0.000 [+0.000, +0.000] |" in table
    assert "NLL vs full: codes" in table and "NLL vs full: full" not in table


def test_needle_attention_refuses_a_malformed_override_or_an_unknown_variant_before_loading_a_model():
    from studies.needle_attention import main

    with pytest.raises(SystemExit, match="FIELD=VALUE"):
        main(["--set", "signal"])
    with pytest.raises(SystemExit, match=r"--variants \['exact keys: nowhere'\] unknown"):
        main(["--variants", "codes,exact keys: nowhere"])
    with pytest.raises(ValueError, match=r"\['signl'\] are not VarRateConfig fields"):
        main(["--set", "signl=residual"])
    with pytest.raises(SystemExit, match="--n must be at least 1"):
        main(["--n", "0"])



def test_needle_attention_names_its_method_with_the_overrides_it_ran():
    from studies.needle_attention import chosen_method, parse_args

    method, name, variants = chosen_method(parse_args(["--set", "budget=0.1", "--variants", "exact values: all"]))
    assert name == "recommended@0.2 with budget=0.1" and method.spec["budget"] == 0.1
    assert variants == ["codes", "exact values: all"]
    assert chosen_method(parse_args([]))[1] == "recommended@0.2"

def test_needle_depths_pairs_two_methods_by_example_and_contrasts_early_needles_with_late_ones(tmp_path):
    from studies.needle_depths import contrast, main, paired_rows, table

    row = lambda method, i, depth, score, nll: {"model": "m", "length": 8, "regime": "r", "task": "t",  # noqa: E731
                                                "example_id": f"t-{i}", "method": method, "depth": depth,
                                                "score": score, "answer_nll": nll}
    rows = [row("full", i, d, 1.0, 0.1) for i, d in enumerate([0.1, 0.1, 0.9, 0.9])]
    rows += [row("codes", 0, 0.1, 0.0, 0.5), row("codes", 1, 0.1, 1.0, 0.3), row("codes", 2, 0.9, 1.0, 0.1),
             row("codes", 3, 0.9, 1.0, 0.0), row("other", 4, 0.5, 1.0, 0.0)]  # example 4: one method only
    pairs = paired_rows(rows, "codes", "full")
    assert [(d, s, round(n, 3)) for d, s, n in pairs[("m", 8, "r", "t")]] == [
        (0.1, -100.0, -0.4), (0.1, 0.0, -0.2), (0.9, 0.0, 0.0), (0.9, 0.0, 0.1)]  # NLL: positive, A surer
    mean, low, high = contrast([-0.4, -0.2], [0.0, 0.1], samples=2000)
    assert mean == pytest.approx(-0.35) and low <= -0.35 <= high and high < 0
    assert all(math.isnan(x) for x in contrast([1.0], [0.0, 1.0])[1:])  # one early example: no interval
    text = table("cell", pairs[("m", 8, "r", "t")], 0.4, 0.6, 2000)
    assert "| 0.0-0.2 | 2 | -50.0 [-100.0, +0.0] | -0.300 [-0.400, -0.200] |" in text
    assert "| 0.8-1.0 | 2 | +0.0 [+0.0, +0.0] |" in text and "n = 2 / 2" in text and "answer NLL -0.350 [" in text
    (tmp_path / "examples.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    with pytest.raises(SystemExit, match="no needle example that both --a 'codes' and --b 'peer'"):
        main(["--results", str(tmp_path), "--a", "codes", "--b", "peer"])
    with pytest.raises(SystemExit, match="need 0 < early <= late < 1"):
        main(["--results", str(tmp_path), "--early", "0.7"])
    with pytest.raises(SystemExit, match="does not exist"):
        main(["--results", str(tmp_path / "none")])


def test_rope_bands_read_each_pair_of_rotated_dimensions_together():
    from studies.rope_bands import band_table, pair_energies

    keys = torch.zeros(1, 3, 4)  # d = 4: pairs (0, 2) and (1, 3)
    keys[..., 0], keys[..., 2], keys[..., 1] = 3.0, 4.0, 1.0
    assert pair_energies(keys).tolist() == [75.0, 3.0]
    coded = keys.clone()
    coded[..., 2] += 1.0  # all the error in pair 0
    table = band_table([keys, keys], [coded, coded])
    assert table[0].tolist() == pytest.approx([(3 / 75) ** 0.5, 75 / 78, 1.0])
    assert table[1].tolist() == pytest.approx([0.0, 3 / 78, 0.0])


def test_kept_digits_counts_the_layer_heads_whose_pruned_keys_hold_each_position():
    from types import SimpleNamespace

    from studies.kept_digits import kept_share

    torch.manual_seed(0)
    keys = [torch.randn(1, 2, 10, 4) for _ in range(2)]
    keep = [[[0, 3, 4], [3, 5, 9]], [[4, 5, 6], [4, 7, 8]]]  # per layer, per head: the rows a press kept
    pruned = [torch.stack([k[0, h, rows] for h, rows in enumerate(heads)])[None] for k, heads in zip(keys, keep)]
    cache = SimpleNamespace(layers=[SimpleNamespace(keys=k) for k in pruned])
    assert kept_share(keys, cache, [0, 1], slice(3, 6)).tolist() == [0.5, 0.75, 0.5]  # positions 3, 4, 5
    assert kept_share(keys, cache, [0], slice(3, 6)).tolist() == [1.0, 0.5, 0.5]
    assert kept_share(keys, cache, [1], slice(3, 6)).tolist() == [0.0, 1.0, 0.5]


@pytest.mark.parametrize("threads", [1, 2])
def test_prompt_basis_pays_for_its_rows_and_beats_a_misaligned_basis_only_when_they_are_cheap(threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # the SVD's rounding, and so which rows win, follows the thread count
    try:
        _prompt_basis_checks()
    finally:
        torch.set_num_threads(previous)


def _prompt_basis_checks():
    from types import SimpleNamespace

    from studies.prompt_basis import own_basis_loss, preset_loss

    config = SimpleNamespace(coef_scales="token", coef_bits=4, coef_group=8)
    g = torch.Generator().manual_seed(0)
    rotation = torch.linalg.qr(torch.randn(32, 32, generator=g))[0]
    coefs = (torch.randn(4096, 8, generator=g) * torch.linspace(4, 1, 8)) @ rotation[:8]  # rank 8, off the axes
    total = float(coefs.square().sum())
    shipped = preset_loss(coefs, config, 10.0, 64)  # 10 bytes: 8 coefficients at 4 bits, a fixed basis misses most
    charged, free, rows = own_basis_loss(coefs, config, 10.0, 64)
    assert rows >= 8 and charged < 0.05 * total < shipped  # 8 rows of 32 bytes over 4096 tokens: cheap
    assert free <= charged * (1 + 1e-3)  # no rows to pay for: never worse, to within the SVD's rounding (1e-4 seen)
    few = coefs[:16]  # 8 rows over 16 tokens cost 16 bytes a token: more than the 10 there are
    charged, _, rows = own_basis_loss(few, config, 10.0, 64)
    assert rows == 0 and charged == pytest.approx(float(few.square().sum()))


def test_query_weights_study_scores_exact_keys_as_no_error_and_rotates_queries_as_the_model(tiny_llama):
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from evaluation.capture import capture, decoder
    from studies.query_weights import attention_errors, post_rope_queries

    ids = torch.randint(2, 128, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    captured = capture(tiny_llama, ids)
    module = decoder(tiny_llama).layers[0].self_attn
    with torch.no_grad():
        q = module.q_proj(captured.hidden[0]).view(1, 120, -1, module.head_dim).transpose(1, 2)
        want, _ = apply_rotary_pos_emb(q, q, captured.cos[0], captured.sin[0])
        torch.testing.assert_close(post_rope_queries(module, captured, 0), want[0])
        exact = DynamicCache()
        for i, (k, v) in enumerate(zip(captured.keys, captured.values)):
            exact.update(k, v, i)
        assert attention_errors(tiny_llama, captured, exact, [0, 1], 16) == (0.0, 0.0, 0.0)
        noisy = DynamicCache()
        for i, (k, v) in enumerate(zip(captured.keys, captured.values)):
            noisy.update(k + 0.1 * torch.randn_like(k), v, i)
        out, tv, keys = attention_errors(tiny_llama, captured, noisy, [0, 1], 16)
        assert out > 0 and tv > 0 and keys > 0


def test_byte_parts_study_counts_every_coded_layer_in_fp16_within_the_budget(smollm2):
    from hf_varrate.shipped import SHIPPED_ROOT
    from studies.byte_parts import PARTS, prompt_parts

    model, _ = smollm2
    ids = torch.randint(100, 5000, (1, 600), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        parts, full = prompt_parts(model, ids, SHIPPED_ROOT / "smollm2-135m-instruct", 0.2)
    assert list(parts) == list(PARTS) and full == 30 * 600 * 2 * 3 * 64 * 2  # 30 layers, K and V, 3 heads x 64, fp16
    assert 0.17 * full <= sum(parts.values()) <= 0.2 * full  # fp16-counted: the budget is met
    assert parts["codes"] > parts["scales"] > 0 and parts["exact"] > 0 and parts["anchor_indices"] > parts["ranks"] > 0


def test_sentence_ends_segments_at_ending_tokens_and_change_points():
    from studies.sentence_ends import END, change_points, layer0_spread, starts

    assert [bool(END.search(t)) for t in ["Hello", " world.", " It", "?\"", " ok!)", "\n", " 3.", "5"]] == \
        [False, True, False, True, True, True, True, False]
    assert starts(torch.tensor([False, True, False, True, False])).tolist() == [0, 0, 1, 1, 2]
    values = torch.ones(1, 1, 6, 2)
    values[0, 0, 3:] = torch.tensor([1.0, -1.0])  # tokens 3.. point elsewhere: the one change point is at 3
    assert change_points({0: values}, 6).tolist() == [0, 0, 0, 1, 1, 1]
    ids = torch.tensor([5, 7, 5, 7])
    same = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])[None, None]  # [1, 1, 4, 2]
    assert layer0_spread(same, ids) == 0.0
    moved = same.clone()
    moved[0, 0, 2] = torch.tensor([1.0, 0.5])  # token 5 at two positions with values half apart
    assert layer0_spread(moved, ids) == pytest.approx(0.5)
