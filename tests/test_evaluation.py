"""The evaluation harness and the studies built on it (studies/): statistics against hand-computed cases
(any venv), the VarRatePress import contract (any venv), and, where kvpress is installed (.venv-eval:
kvpress pins transformers < 5.3), replay-vs-live equivalence of every method kind and the smoke config."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch

from evaluation.stats import bootstrap_mean_ci, paired_comparison, sign_test

HAS_KVPRESS = importlib.util.find_spec("kvpress") is not None
needs_kvpress = pytest.mark.skipif(not HAS_KVPRESS, reason="kvpress is not installed (it pins transformers < 5.3): "
                                   "run in .venv-eval (make eval-venv)")
REPO = Path(__file__).resolve().parents[1]


# statistics -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("wins, losses, expected", [
    (8, 2, 2 * (1 + 10 + 45) / 1024),  # 2 * P(X <= 2), X ~ Bin(10, 1/2)
    (5, 0, 2 / 32),
    (3, 3, 1.0),  # 2 * 42/64 > 1, capped
    (0, 0, 1.0),  # no untied pairs: no evidence
    (1, 12, 2 * (1 + 13) / 8192),
])
def test_sign_test_matches_hand_computed(wins, losses, expected):
    assert sign_test(wins, losses) == pytest.approx(expected, rel=1e-12)


def test_bootstrap_ci_matches_exact_enumeration():
    # d = [0, 0, 1]: the resampled mean is k/3 with k ~ Bin(3, 1/3): P = 8/27, 12/27, 6/27, 1/27.
    # 2.5th percentile: 0 (P(0) > 2.5%); 97.5th: 1 (P(mean <= 2/3) = 26/27 < 97.5%).
    assert bootstrap_mean_ci([0, 0, 1]) == (0.0, 1.0)
    # d = [0, 1]: means 0, 1/2, 1 with P = 1/4, 1/2, 1/4.
    assert bootstrap_mean_ci([0, 1]) == (0.0, 1.0)


def test_bootstrap_ci_of_constant_and_seeded():
    assert bootstrap_mean_ci([2.5] * 7) == (2.5, 2.5)
    data = [0, 1, 1, 0, 1, 1, 1, 0, 1, 1]
    assert bootstrap_mean_ci(data, seed=3) == bootstrap_mean_ci(data, seed=3)
    low, high = bootstrap_mean_ci(data)
    assert low < 0.7 < high and 0.3 <= low and high <= 1.0


@pytest.mark.parametrize("n", [1, 10, 50, 100, 200])
def test_sign_test_is_scipys_binomial_test(n):
    from scipy.stats import binomtest

    for wins in range(0, n + 1, max(1, n // 10)):
        assert sign_test(wins, n - wins) == pytest.approx(binomtest(wins, n, 0.5).pvalue, rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("n, seed", [(2, 0), (17, 1), (48, 2), (100, 3)])
def test_bootstrap_draws_what_the_committed_tables_were_made_with(n, seed):
    """scipy's resampling, batch by batch, is the hand-written one the committed tables came from: same
    draws from the same seeded Generator, same means, same percentiles, to the last bit."""
    import numpy as np

    data = np.random.default_rng(seed).normal(size=n) * 0.01
    rng, means = np.random.default_rng(0), np.empty(20_000)
    for start in range(0, 20_000, 2_000):
        means[start:start + 2_000] = data[rng.integers(0, n, size=(2_000, n))].mean(axis=1)
    tail = (1.0 - 0.95) / 2 * 100
    assert bootstrap_mean_ci(data) == tuple(float(v) for v in np.percentile(means, [tail, 100 - tail]))


def test_paired_comparison_counts_and_verdict():
    result = paired_comparison([1, 1, 1, 0], [0, 0, 0, 0])
    assert (result.n, result.wins, result.losses, result.ties) == (4, 3, 0, 1)
    assert result.mean_diff == 0.75 and result.sign_p == pytest.approx(0.25)
    assert result.ci_low == 0.25 and result.ci_high == 1.0  # resamples of 4 with >= one 1 w.p. 1-(1/4)^4
    assert result.significant and result.verdict == "better"
    tie = paired_comparison([1, 0, 1, 0], [0, 1, 0, 1])
    assert tie.mean_diff == 0 and tie.verdict == "tie" and not tie.significant
    worse = paired_comparison([0] * 30, [1] * 30)
    assert worse.verdict == "worse" and worse.sign_p == pytest.approx(2 / 2**30)
    with pytest.raises(ValueError, match="same shape"):
        paired_comparison([1, 2], [1])


def test_paired_comparison_empty_is_nan():
    result = paired_comparison([], [])
    assert result.n == 0 and math.isnan(result.mean_diff) and result.verdict == "tie"


# report ---------------------------------------------------------------------------------------------
def _needle_row(method, example, score, depth, fraction, ranks=None):
    return {"model": "m", "task": "niah_single", "length": 2048, "regime": "query_agnostic", "method": method,
            "example_id": example, "score": score, "depth": depth, "fraction": fraction, "metric": "all",
            **({"rank_by_decile": ranks} if ranks else {})}


def test_comparisons_carry_each_methods_measured_footprint():
    from evaluation.report import compare, markdown_comparisons
    rows = [_needle_row("a", i, 1.0, 0.5, 1.0) for i in range(4)]  # 'a' stored its prompts exactly
    rows += [_needle_row("b", i, 0.0, 0.5, 0.1 + 0.02 * i) for i in range(3)]  # one example fewer
    pooled_and_cell = compare(rows, [["a", "b"]], samples=200)
    assert {c["task"] for c in pooled_and_cell} == {"niah_single", "niah (pooled)"}
    for c in pooled_and_cell:
        assert c["n"] == 3 and c["fraction_a"] == 1.0 and c["fraction_b"] == pytest.approx(0.12)
    assert "| 100.0% / 12.0% |" in markdown_comparisons(pooled_and_cell)


def test_needle_ranks_put_each_needles_score_beside_the_rank_at_its_decile():
    from evaluation.report import markdown_needle_ranks, needle_ranks
    profile = [10.0 * (k + 1) for k in range(10)]  # decile k got rank 10 (k + 1)
    rows = [_needle_row("v", 0, 1.0, 0.1, 0.2, profile), _needle_row("v", 1, 0.0, 0.15, 0.2, profile),
            _needle_row("v", 2, 1.0, 0.95, 0.2, profile), _needle_row("full", 0, 1.0, 0.1, 1.0),  # no profile
            _needle_row("x", 0, 1.0, 0.5, 1.0, [None] * 10)]  # stored exactly: a profile of Nones
    table = needle_ranks(rows)
    assert [(r["method"], r["depth_low"], r["n"]) for r in table] == [("v", 0.0, 2), ("v", 0.8, 1), ("x", 0.4, 1)]
    assert table[2]["rank_at_needle"] is None and table[2]["coded"] == 0
    assert table[0]["score"] == 50.0 and table[0]["rank_at_needle"] == 20.0  # deciles 1 and 1
    assert table[1]["score"] == 100.0 and table[1]["rank_at_needle"] == 100.0
    text = markdown_needle_ranks(table)
    assert "| depth 0.0-0.2 | depth 0.4-0.6 | depth 0.8-1.0 |" in text
    assert "| 50% (20; n = 2) |  | 100% (100; n = 1) |" in text and "| 100% (stored exactly; n = 1) |" in text


def test_needle_digits_count_the_digits_an_answer_copies_from_the_start():
    from evaluation.report import markdown_needle_digits, needle_digits

    def row(method, example, prediction, answer="2049948"):
        return {**_needle_row(method, example, float(answer in prediction), 0.5, 0.2), "prediction": prediction,
                "answers": [answer]}

    rows = [row("v", 0, "2048.\nThe special"), row("v", 1, ": 2049948."), row("v", 2, "no number"),
            row("v", 3, "9"), row("v", 4, "20499481234")]  # 3, 7, 0, 0 and 7 digits of 7
    (table,) = needle_digits(rows)
    assert table["n"] == 5 and table["score"] == 40.0
    assert abs(table["leading_digits"] - 100 * (3 + 7 + 0 + 0 + 7) / 35) < 1e-9
    assert table["first_digit"] == 60.0
    assert "| m | niah_single | 2048 | query_agnostic | v | 5 | 40% | 49% | 60% |" in markdown_needle_digits([table])


def test_processes_stopping_together_each_keep_their_run_info_entry(tmp_path):
    """Two --stages processes into one output stop together; neither's session may overwrite the other's."""
    import subprocess
    import sys

    code = ("import sys, time; from pathlib import Path; from evaluation.run import write_run_info; "
            "[write_run_info(Path(sys.argv[1]), 'c.yaml', time.time(), f'p{sys.argv[2]}-{i}') for i in range(3)]")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(p)], cwd=REPO) for p in range(4)]
    assert all(proc.wait(timeout=300) == 0 for proc in procs)
    sessions = json.loads((tmp_path / "run_info.json").read_text())["sessions"]
    assert sorted(s["status"] for s in sessions) == sorted(f"p{p}-{i}" for p in range(4) for i in range(3))


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


# VarRatePress import contract -----------------------------------------------------------------------
def test_press_module_imports_without_kvpress_and_names_the_install(monkeypatch):
    import sys

    import hf_varrate.press as press_module

    assert "kvpress" not in sys.modules or HAS_KVPRESS  # importing the module imported no kvpress
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kvpress" else real(name, *a))
    with pytest.raises(ImportError, match="pip install kvpress"):
        press_module.VarRatePress(bases=None)


def test_kvzips_temporary_tokenizer_folder_is_removed_when_the_process_exits():
    import subprocess
    import sys

    script = (
        "from evaluation.methods.kvpress_methods import saved_tokenizer\n"
        "class Tokenizer:\n"
        "    def save_pretrained(self, folder):\n"
        "        open(folder + '/tokenizer.json', 'w').write('{}')\n"
        "tokenizer = Tokenizer()\n"
        "folder = saved_tokenizer(tokenizer)\n"
        "assert saved_tokenizer(tokenizer) == folder\n"
        "print(folder)\n"
    )
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, check=True)
    folder = Path(done.stdout.strip())
    assert folder.name.startswith("evaluation-tokenizer-")
    assert not folder.exists()


def test_config_driven_methods_refuse_typos():
    from evaluation.methods import make_method

    method = make_method("flat", {"kind": "varrate", "budget": 0.2, "signal": "uniform", "bases": "identity"})
    assert method.overrides == {"budget": 0.2, "signal": "uniform"}
    with pytest.raises(ValueError, match="budgte"):
        make_method("typo", {"kind": "varrate", "budgte": 0.2})
    with pytest.raises(ValueError, match="kind must be one of"):
        make_method("x", {"kind": "snapkv"})


def test_a_method_run_on_two_models_loads_each_models_own_bases(monkeypatch):
    # a process running a SmolLM2 stage then a Gemma-3 stage once handed Gemma-3 SmolLM2's bases
    from evaluation.methods import make_method
    from evaluation.methods import varrate as varrate_method
    from evaluation.methods.base import Context

    loads = []
    monkeypatch.setattr(varrate_method, "resolve_bases", lambda model, name, which: loads.append((name, which)) or name)
    method = make_method("v", {"kind": "varrate", "budget": 0.2})
    contexts = [Context(None, None, name, None, []) for name in ("smollm2-135m-instruct", "gemma-3-270m")]
    names = [method.bases(ctx, "shipped") for ctx in contexts + contexts]
    assert names == ["smollm2-135m-instruct", "gemma-3-270m"] * 2
    assert loads == [("smollm2-135m-instruct", "shipped"), ("gemma-3-270m", "shipped")]  # each loaded once


def test_preset_spec_starts_from_the_library_preset_and_fields_override_it():
    import warnings

    from hf_varrate import Bases, VarRateConfig, VarRateWarning
    from evaluation.methods import make_method

    calibrated = {"stride": 16, "window": 64, "n_anchors": 4}
    bases = Bases.from_tensors({0: torch.eye(8)}, spectra={0: torch.linspace(8, 1, 8)}, **calibrated)
    method = make_method("r", {"kind": "varrate", "preset": "recommended", "budget": 0.3, "signal": "residual"})
    config = method.config_for(bases)
    assert config == VarRateConfig.preset("recommended", budget=0.3, signal="residual", **calibrated)
    assert make_method("p", {"kind": "varrate", "budget": 0.3}).config_for(bases) == VarRateConfig(budget=0.3)
    # the config is Bases.config's: bases without a spectrum fall back to balance='none', and say so
    bare = Bases.from_tensors({0: torch.eye(8)}, **calibrated)
    with pytest.warns(VarRateWarning, match="balance='none' is used"):
        assert method.config_for(bare) == config.replace(balance="none")
    with warnings.catch_warnings():  # a spec that sets a calibration setting means to: no warning
        warnings.simplefilter("error")
        assert make_method("s", {"kind": "varrate", "stride": 8}).config_for(bases) == VarRateConfig(stride=8)


def test_fp16_fraction_counts_the_bytes_an_fp16_cache_would_hold(tiny_llama):
    from evaluation.methods.varrate import fp16_fraction
    from hf_varrate import Bases, VarRateCache, VarRateConfig, bound

    config = VarRateConfig.preset("recommended", budget=0.3, budget_dtype="float16", balance="none")
    cache = VarRateCache(Bases.identity(tiny_llama.config), config, model_config=tiny_llama.config)
    with bound(tiny_llama), torch.no_grad():
        tiny_llama(input_ids=torch.randint(2, 128, (1, 600), generator=torch.Generator().manual_seed(0)),
                   past_key_values=cache)
        cache.compress()
    fraction = fp16_fraction(cache)["fraction_fp16"]
    assert 0.25 < fraction <= 0.3 + 1e-9  # met in fp16 terms ...
    assert cache.footprint().prompt_fraction < 0.2  # ... which the fp32 cache undercuts


def test_configs_parse():
    from evaluation.config import load_config

    for name in ("smoke", "full", "beyond_dev", "beyond_heldout", "beyond_heldout_gemma", "beyond_dev_gemma"):
        config = load_config(REPO / f"evaluation/configs/{name}.yaml")
        assert config.stages and all(m in config.methods for s in config.stages for m in s.methods)


def test_stages_option_picks_stages_by_index_and_names_a_bad_one():
    from evaluation.config import parse_stages

    assert parse_stages("10", 17) == [10]
    assert parse_stages("11-", 17) == list(range(11, 17))
    assert parse_stages("3,5-7,5", 17) == [3, 5, 6, 7]
    with pytest.raises(ValueError, match=r"stages 0-16.*'17'"):
        parse_stages("17", 17)
    with pytest.raises(ValueError, match=r"--stages.*'11-' .*got 'x'"):
        parse_stages("x", 17)
    with pytest.raises(ValueError, match=r"'7-5' is an empty range"):
        parse_stages("7-5", 17)


def test_runner_runs_only_the_picked_stages(tmp_path, monkeypatch):
    from evaluation.config import load_config
    from evaluation.runner import Runner

    config = load_config(REPO / "evaluation/configs/full.yaml")
    seen = []
    monkeypatch.setattr(Runner, "wait_for_bases", lambda self, stage: None)
    monkeypatch.setattr(Runner, "stage_examples", lambda self, stage: iter([stage]))
    monkeypatch.setattr(Runner, "todo", lambda self, stage, example: ["row"])
    monkeypatch.setattr(Runner, "evaluate", lambda self, stage, example, todo: seen.append(stage))
    Runner(config, tmp_path).run(stages=[10, 12])
    assert seen == [config.stages[10], config.stages[12]]

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
    handle = tiny_llama.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[1]),
                                                  with_kwargs=True)
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
