"""The evaluation harness: statistics against hand-computed cases, the report's tables, the configs and
the runner, and the VarRatePress import contract (any venv)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
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


def test_answer_nll_comparisons_pair_the_rows_that_have_one_and_lower_is_better():
    from evaluation.report import compare, markdown_comparisons
    rows = [{**_needle_row("a", i, 1.0, 0.5, 0.2), "answer_nll": 0.5} for i in range(4)]
    rows += [{**_needle_row("b", i, 1.0, 0.5, 1.0), "answer_nll": nll} for i, nll in enumerate((1.0, 1.5, None, 0.5))]
    graded = {c["task"]: c for c in compare(rows, [["a", "b"]], samples=200, value="answer_nll")}
    cell = graded["niah_single"]
    assert cell["n"] == 3 and cell["mean_diff"] == pytest.approx(0.5)  # (0.5 + 1.0 + 0.0) / 3, b - a
    assert (cell["wins"], cell["losses"], cell["ties"]) == (2, 0, 1)
    assert graded["niah (pooled)"]["n"] == 3
    assert "nats / answer token" in markdown_comparisons(list(graded.values()))
    assert compare(rows, [["a", "b"]], samples=200)[0]["n"] == 4  # the 0/1 scores still pair every example


def test_answer_nll_is_the_teacher_forced_nll_and_leaves_the_cache_as_it_was(tiny_llama):
    from transformers import DynamicCache

    from evaluation.generate import answer_nll

    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(0))[0].tolist()
    prompt, tail, answer = ids[:30], ids[30:36], ids[36:]
    with torch.no_grad():
        cache = DynamicCache(config=tiny_llama.config)
        tiny_llama(input_ids=torch.tensor([prompt]), past_key_values=cache)
        logits = tiny_llama(input_ids=torch.tensor([ids])).logits[0, 35:39].float()
    expected = float(torch.nn.functional.cross_entropy(logits, torch.tensor(answer)))
    assert answer_nll(tiny_llama, cache, None, tail, answer, len(prompt)) == pytest.approx(expected, rel=1e-4)
    assert cache.get_seq_length() == len(prompt)  # read from a copy: the greedy answer after it sees the prompt alone
    with pytest.raises(ValueError, match="answer's token ids"):
        answer_nll(tiny_llama, cache, None, tail, [], len(prompt))


def test_a_needles_depth_bin_is_its_span_of_the_document_and_the_end_falls_in_the_last():
    from evaluation.tasks.needle import depth_bin

    assert [depth_bin(d, 5) for d in (0.0, 0.19, 0.2, 0.59, 0.999, 1.0)] == [0, 0, 1, 2, 4, 4]
    assert [depth_bin(d, 10) for d in (0.05, 0.95, 1.0)] == [0, 9, 9]


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


def test_importing_the_runner_leaves_the_environment_alone():
    """`python -m evaluation.run` goes offline and makes idle threads sleep; a module that imports it (a test, a
    study) must not: os.environ is what every later subprocess inherits (the fake Hub's tests among them)."""
    import subprocess
    import sys

    code = ("import os, json; before = dict(os.environ); import evaluation.run; "
            "print(json.dumps(sorted(set(os.environ.items()) ^ set(before.items()))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "OMP_WAIT_POLICY")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_a_session_records_the_code_it_started_with(tmp_path, monkeypatch):
    """The checkout may move on while a session runs: its record names the commit and library it imported."""
    from evaluation import run

    started = run.code_source()
    monkeypatch.setattr(run, "git_commit", lambda: "moved-on")
    run.write_run_info(tmp_path, "c.yaml", 0.0, "complete", started)
    run.write_run_info(tmp_path, "c.yaml", 0.0, "complete")
    first, second = json.loads((tmp_path / "run_info.json").read_text())["sessions"]
    assert first["git"] == started["git"] != "moved-on" and first["library"] == started["library"]
    assert second["git"] == "moved-on"  # no source given: taken when written


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


def test_a_copy_of_the_evaluation_elsewhere_reads_the_imported_librarys_shipped_bases(tmp_path, monkeypatch):
    # a second checkout (a worktree for long runs) once paired its own, older shipped bases with the library
    # imported from the first (an editable install); the bases must come with the code that reads them
    import shutil
    import subprocess
    import sys

    import hf_varrate

    shutil.copytree(REPO / "evaluation", tmp_path / "evaluation", ignore=shutil.ignore_patterns("runs", "__pycache__"))
    monkeypatch.delenv("HF_VARRATE_SHIPPED_BASES", raising=False)
    found = subprocess.run([sys.executable, "-c", "from evaluation.methods.varrate import shipped_bases; "
                            "print(shipped_bases())"], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert Path(found.stdout.strip()) == Path(hf_varrate.__file__).resolve().parent / "shipped_bases"


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

    paths = sorted((REPO / "evaluation/configs").glob("*.yaml"))
    assert len(paths) > 6
    for path in paths:  # every committed config, so a report's command runs
        config = load_config(path)
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


def stub_stages(monkeypatch, evaluate):
    """The runner with one example a stage, no bases to wait for, and `evaluate` in place of the model."""
    from evaluation.runner import Runner

    monkeypatch.setattr(Runner, "wait_for_bases", lambda self, stage: None)
    monkeypatch.setattr(Runner, "stage_examples", lambda self, stage: iter([stage]))
    monkeypatch.setattr(Runner, "todo", lambda self, stage, example: ["row"])
    monkeypatch.setattr(Runner, "evaluate", evaluate)


def test_runner_runs_only_the_picked_stages(tmp_path, monkeypatch):
    from evaluation.config import load_config
    from evaluation.runner import Runner

    config = load_config(REPO / "evaluation/configs/full.yaml")
    seen = []
    stub_stages(monkeypatch, lambda self, stage, example, todo: seen.append(stage))
    Runner(config, tmp_path).run(stages=[10, 12])
    assert seen == [config.stages[10], config.stages[12]]


def test_a_stage_running_in_one_process_is_refused_to_another_until_it_ends(tmp_path, monkeypatch):
    """Two processes on one stage of one output would append every row twice: the second is refused before it
    evaluates anything, by a message naming the stage, the holder and the way out; other stages stay free."""
    from evaluation.config import load_config
    from evaluation.runner import Runner, StageBusy

    config = load_config(REPO / "evaluation/configs/full.yaml")
    seen = []
    stub_stages(monkeypatch, lambda self, stage, example, todo: seen.append(stage))
    with Runner(config, tmp_path).stage_lock(3):  # a separate open file: flock refuses it as it would a process
        with pytest.raises(StageBusy, match=rf"stage 3 is being run into {re.escape(str(tmp_path))} "
                           rf"by process {os.getpid()};.*"
                           r"--stages without 3"):
            Runner(config, tmp_path).run(stages=[2, 3])
        with pytest.raises(StageBusy, match="stage 3"):
            Runner(config, tmp_path).run()  # every stage, as a process without --stages asks
        assert seen == []
        Runner(config, tmp_path).run(stages=[2])
        assert seen == [config.stages[2]]
    Runner(config, tmp_path).run(stages=[3])  # released when its holder ends
    assert seen == [config.stages[2], config.stages[3]]


def test_the_command_refuses_a_busy_stage_and_records_the_refusal(tmp_path, monkeypatch):
    from evaluation import run
    from evaluation.runner import Runner

    monkeypatch.setattr(run, "write_report", lambda config, out, path: None)
    with Runner(run.load_config(REPO / "evaluation/configs/smoke.yaml"), tmp_path).stage_lock(0):
        with pytest.raises(SystemExit) as exit_:
            run.main(["--config", str(REPO / "evaluation/configs/smoke.yaml"), "--out", str(tmp_path),
                      "--stages", "0"])
    assert exit_.value.code == 2
    sessions = json.loads((tmp_path / "run_info.json").read_text())["sessions"]
    assert [s["status"][:len("refused: stage 0")] for s in sessions] == ["refused: stage 0"]
    assert not (tmp_path / "examples.jsonl").exists()


@pytest.mark.parametrize("fails", [False, True])
def test_runner_runs_at_the_configs_threads_and_gives_the_callers_back(tmp_path, monkeypatch, fails):
    from evaluation.config import load_config
    from evaluation.runner import Runner

    config = load_config(REPO / "evaluation/configs/full.yaml")
    caller = torch.get_num_threads()
    config.threads = 1 if caller > 1 else 2
    seen = []

    def evaluate(self, stage, example, todo):
        seen.append(torch.get_num_threads())
        if fails:
            raise RuntimeError("a stage failed")

    stub_stages(monkeypatch, evaluate)
    if fails:
        with pytest.raises(RuntimeError, match="a stage failed"):
            Runner(config, tmp_path).run(stages=[0])
    else:
        Runner(config, tmp_path).run(stages=[0])
    assert seen == [config.threads]
    assert torch.get_num_threads() == caller
