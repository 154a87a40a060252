"""Calibration: residuals shared with the cache, streaming PCA equal to a direct SVD, determinism,
hooks always removed, text sources and contexts, the command line, and held-out quality."""

from __future__ import annotations

import json
import sys
import types
import warnings

import pytest
import torch

from hf_varrate import Bases, VarRateCache, VarRateConfig, bind, unbind
from hf_varrate.calibration import (
    SecondMoments,
    build_contexts,
    calibrate,
    collect_residuals,
    layer_residuals,
    load_texts,
    orient,
    principal_components,
    reconstruction_error,
    residual_hooks,
)
from hf_varrate.calibration import __main__ as cli
from hf_varrate.calibration.collect import ResidualSettings
from hf_varrate.calibration.texts import is_held_out, wiki_documents
from hf_varrate.codec import unpack
from hf_varrate.shipped import shipped_path


def token_contexts(count: int = 3, length: int = 300, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 128, (length,), generator=g) for _ in range(count)]


def attention_hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# the PCA -------------------------------------------------------------------------------------------------
def test_streamed_moments_equal_the_batch_moment():
    e = torch.randn(500, 12, generator=torch.Generator().manual_seed(0))
    moments = SecondMoments(12, [3])
    for part in e.split(77):
        moments.add(3, part)
    assert moments.counts[3] == 500
    torch.testing.assert_close(moments.moments[3], e.double().T @ e.double())


def test_principal_components_sorted_oriented_and_checked():
    g = torch.Generator().manual_seed(1)
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))
    moment = q @ torch.diag(torch.tensor([1.0, 9.0, 4.0, 16.0, 25.0, 0.25], dtype=torch.float64)) @ q.T
    basis, singular = principal_components(moment, 4)
    torch.testing.assert_close(singular, torch.tensor([5.0, 4.0, 3.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(basis.double() @ basis.double().T, torch.eye(4, dtype=torch.float64), atol=1e-6, rtol=0)
    pivots = basis.abs().argmax(dim=1)
    assert bool((basis[torch.arange(4), pivots] > 0).all())
    assert torch.equal(orient(-basis), basis)
    with pytest.raises(ValueError, match="rank must be in"):
        principal_components(moment, 7)


# residuals: the cache's code path --------------------------------------------------------------------------
def test_calibration_residuals_are_what_the_cache_codes(tiny_llama):
    """With the identity basis the cache stores each coded token's leading residual coordinates: they must
    equal the residuals calibration collects on the same prompt."""
    ids = token_contexts(1, 400)[0]
    residual = collect_residuals(tiny_llama, [ids], [0, 1])
    cache = VarRateCache(Bases.identity(tiny_llama.config), model_config=tiny_llama.config, budget=0.5,
                         hold_dtype="model")  # calibration reads the model's float32 K/V
    try:
        bind(tiny_llama)
        with torch.no_grad():
            tiny_llama(input_ids=ids[None], past_key_values=cache, use_cache=True)
        cache.compress()
    finally:
        unbind(tiny_llama)
    for i in (0, 1):
        code = cache.layers[i].codes[0]
        assert not code.stored_exactly and code.coded_pos.numel() == residual[i].shape[0]
        stored = unpack(code.coefs, code.ranks.long(), 64)
        kept = stored != 0
        assert int(kept.sum()) > 0
        torch.testing.assert_close(stored[kept], residual[i][kept], atol=1e-5, rtol=1e-5)


def test_layer_residuals_follow_the_exact_set():
    keys, values = torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16)
    cos, sin = torch.ones(1, 100, 16), torch.zeros(1, 100, 16)
    e = layer_residuals(keys, values, cos, sin, ResidualSettings(stride=16, window=20))
    assert e.shape == (100 - 20 - 5, 64)  # anchors 0, 16, 32, 48, 64 and the last 20 are exact
    short = layer_residuals(keys[:, :, :10], values[:, :, :10], cos[:, :10], sin[:, :10], ResidualSettings())
    assert short.shape == (0, 64)  # a prompt inside the window has nothing to code


# calibrate ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3", "tiny_gemma3"])
def test_calibrated_bases_equal_a_direct_svd_up_to_sign(request, fixture):
    model = request.getfixturevalue(fixture)
    contexts = token_contexts()
    bases = calibrate(model, contexts, progress=False)
    layers = bases.metadata["compressed_layers"]
    assert sorted(bases.tensors) == layers == ([1, 3] if fixture == "tiny_gemma3" else [0, 1])
    residual = collect_residuals(model, contexts, layers)
    for i in layers:
        v = bases.tensors[i].double()
        assert v.shape == (64, 64)
        torch.testing.assert_close(v @ v.T, torch.eye(64, dtype=torch.float64), atol=1e-5, rtol=0)
        energy = (residual[i].double() @ v.T).square().sum(0)  # captured per row, must not increase
        assert bool((energy[1:] <= energy[:-1] * (1 + 1e-6)).all())
        _, singular, vh = torch.linalg.svd(residual[i].double(), full_matrices=False)
        torch.testing.assert_close(energy.sqrt(), singular, atol=1e-6, rtol=1e-4)
        gaps = (singular[:-1] - singular[1:]) / singular[0]
        clear = int(torch.nonzero(gaps < 1e-3)[0]) if bool((gaps < 1e-3).any()) else 63  # rows with a clear gap
        assert clear >= 8
        agreement = (v[:clear] * vh[:clear]).sum(1).abs()  # |cos| between matching rows
        assert bool((agreement > 1 - 1e-4).all()), agreement.min()


def test_calibration_is_deterministic_and_records_its_settings(tiny_llama):
    contexts = token_contexts()
    config = VarRateConfig(stride=8, window=32, n_anchors=2)
    first = calibrate(tiny_llama, contexts, rank=16, config=config, progress=False, seed=5, calibration="x")
    second = calibrate(tiny_llama, contexts, rank=16, config=config, progress=False, seed=5, calibration="x")
    assert all(torch.equal(first.tensors[i], second.tensors[i]) for i in (0, 1))
    meta = first.metadata
    assert (meta["stride"], meta["window"], meta["n_anchors"], meta["rank"]) == (8, 32, 2, 16)
    assert (meta["num_contexts"], meta["context_length"], meta["seed"], meta["calibration"]) == (3, 300, 5, "x")
    assert meta["num_samples"] == 3 * (300 - 32 - 38 + 4)  # 38 anchors (0, 8, ..., 296), 4 of them in the window
    assert first.tensors[0].shape == (16, 64)


def test_bad_calibration_arguments(tiny_llama):
    with pytest.raises(ValueError, match=r"rank must be in \[1, 64\]"):
        calibrate(tiny_llama, token_contexts(1), rank=65, progress=False)
    with pytest.raises(ValueError, match="at least one context"):
        calibrate(tiny_llama, [], progress=False)
    with pytest.warns(UserWarning, match="residuals per layer for rank 64"):
        calibrate(tiny_llama, token_contexts(1, 100), progress=False)


def test_hooks_are_removed_even_when_a_forward_fails(tiny_llama):
    before = attention_hooks(tiny_llama)

    def explode(layer_idx, residuals):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with residual_hooks(tiny_llama, {0, 1}, explode, ResidualSettings()):
            assert attention_hooks(tiny_llama) == before + 2
            with torch.no_grad():
                tiny_llama(input_ids=token_contexts(1, 100)[0][None], use_cache=True)
    assert attention_hooks(tiny_llama) == before
    calibrate(tiny_llama, token_contexts(1), progress=False)
    assert attention_hooks(tiny_llama) == before


# quality ---------------------------------------------------------------------------------------------------
def test_calibrated_bases_reconstruct_better_than_identity(tiny_llama):
    bases = calibrate(tiny_llama, token_contexts(4, 400, seed=1), progress=False)
    held_out = token_contexts(1, 400, seed=2)
    calibrated = reconstruction_error(tiny_llama, bases, held_out, budget=0.5)
    identity = reconstruction_error(tiny_llama, Bases.identity(tiny_llama.config), held_out, budget=0.5)
    assert 0 < calibrated.values < identity.values
    assert 0 < calibrated.keys < identity.keys
    assert abs(calibrated.footprint - 0.5) < 0.01
    assert attention_hooks(tiny_llama) == 0  # it bound the model and unbound it again
    richer = reconstruction_error(tiny_llama, bases, held_out, budget=0.7)
    assert richer.keys < calibrated.keys and richer.values < calibrated.values


# texts and contexts ---------------------------------------------------------------------------------------
class CharTokenizer:
    """One token per character; `add_special_tokens` prepends BOS (id 1)."""

    def __call__(self, text, add_special_tokens=True):
        ids = [2 + ord(c) % 120 for c in text]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


def test_build_contexts_packs_whole_documents_after_the_prefix():
    contexts = build_contexts(CharTokenizer(), ["a" * 30, "b" * 50, "c" * 100, "d" * 10], 2, 41)
    assert [c.shape for c in contexts] == [torch.Size([41]), torch.Size([41])]
    assert contexts[0][0] == 1 and contexts[1][0] == 1
    assert contexts[1][1] == 2 + ord("c") % 120  # the second context starts at a document boundary
    with pytest.raises(ValueError, match="holds only 2 contexts of 41 tokens, 3 asked"):
        build_contexts(CharTokenizer(), ["a" * 30, "b" * 50, "c" * 100], 3, 41)


def test_wiki_split_is_fixed_and_disjoint():
    calibration, held_out = wiki_documents("calibration"), wiki_documents("held_out")
    assert len(calibration) > 8000 and 500 < len(held_out) < 1500
    titles = lambda docs: {doc.split("\n\n")[0] for doc in docs}  # noqa: E731
    assert not titles(calibration) & titles(held_out)
    assert all(is_held_out(title) for title in titles(held_out))
    first, again, other = load_texts(seed=0), load_texts(seed=0), load_texts(seed=1)
    assert first.documents == again.documents and first.documents != other.documents
    assert sorted(first.documents) == sorted(calibration) and "[calibration]" in first.name


def test_text_sources(tmp_path):
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "b.txt").write_text("second")
    (folder / "a.txt").write_text("first")
    (folder / "skip.md").write_text("not text")
    assert sorted(load_texts(str(folder)).documents) == ["first", "second"]
    (tmp_path / "list.json").write_text(json.dumps(["x", {"text": "y"}]))
    assert sorted(load_texts(str(tmp_path / "list.json")).documents) == ["x", "y"]
    (tmp_path / "map.json").write_text(json.dumps({"a": {"body": "p"}, "b": {"body": "q"}}))
    assert sorted(load_texts(str(tmp_path / "map.json"), text_field="body").documents) == ["p", "q"]
    (tmp_path / "rows.jsonl").write_text('{"text": "r1"}\n\n{"text": "r2"}\n')
    assert sorted(load_texts(str(tmp_path / "rows.jsonl")).documents) == ["r1", "r2"]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.json", json.dumps([{"title": "no text field"}]), "string 'text' field"),
        ("bad.json", json.dumps(3), "must hold a list"),
        ("empty.json", json.dumps(["", "  "]), "no text found"),
        ("data.xml", "<a/>", "cannot read calibration text"),
    ],
)
def test_bad_text_sources(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        load_texts(str(tmp_path / name))


def test_missing_sources_and_splits(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_texts(str(tmp_path / "absent.json"))
    with pytest.raises(ValueError, match="holds no .txt files"):
        load_texts(str(tmp_path))
    with pytest.raises(ValueError, match="split must be one of"):
        load_texts(split="test")


def test_saved_dataset_folder_is_read_with_datasets(tmp_path, monkeypatch):
    class FakeDataset:
        column_names = ["text", "id"]

        def __getitem__(self, column):
            return ["d1", "d2"] if column == "text" else [1, 2]

    fake = types.SimpleNamespace(load_from_disk=lambda path: FakeDataset())
    monkeypatch.setitem(sys.modules, "datasets", fake)
    (tmp_path / "dataset_info.json").write_text("{}")
    assert sorted(load_texts(str(tmp_path)).documents) == ["d1", "d2"]
    with pytest.raises(ValueError, match="no column 'body'"):
        load_texts(str(tmp_path), text_field="body")


# the command line -----------------------------------------------------------------------------------------
def test_command_line_calibrates_measures_and_saves(tmp_path, tiny_llama, monkeypatch, capsys):
    monkeypatch.setattr(cli, "load_model", lambda args: (tiny_llama, CharTokenizer(), {"model_id": "tiny/llama"}))
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(8):
        (texts / f"{i}.txt").write_text(f"document {i} " * 40)
    (tmp_path / "held.json").write_text(json.dumps(["held out text " * 40] * 3))
    out = tmp_path / "bases"
    argv = ["--texts", str(texts), "--eval-texts", str(tmp_path / "held.json"), "--num-contexts", "3",
            "--context-length", "300", "--eval-contexts", "1", "--eval-budget", "0.5", "--out", str(out), "--quiet"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "calibrated basis at budget 0.5" in printed and "identity basis at budget 0.5" in printed
    bases = Bases.from_pretrained(out)
    quality = bases.metadata["quality"]
    assert quality["calibrated"]["values"] < quality["identity"]["values"]
    assert bases.metadata["build_command"].endswith(" ".join(argv[-3:]))
    assert (out / "README.md").read_text().count("0.5") >= 1


def test_command_line_without_held_out_text_skips_the_measurement(tmp_path, tiny_llama, monkeypatch, capsys):
    monkeypatch.setattr(cli, "load_model", lambda args: (tiny_llama, CharTokenizer(), {}))
    (tmp_path / "t.json").write_text(json.dumps(["calibration text " * 40] * 4))
    cli.main(["--texts", str(tmp_path / "t.json"), "--num-contexts", "2", "--context-length", "200",
              "--out", str(tmp_path / "out"), "--quiet"])
    assert "quality not measured" in capsys.readouterr().out
    assert "quality" not in Bases.from_pretrained(tmp_path / "out").metadata


def test_command_line_measures_layer_sensitivity_into_the_saved_bases(tmp_path, tiny_llama, monkeypatch, capsys):
    monkeypatch.setattr(cli, "load_model", lambda args: (tiny_llama, CharTokenizer(), {}))
    (tmp_path / "t.json").write_text(json.dumps(["calibration text, and more of it " * 40] * 6))
    argv = ["--texts", str(tmp_path / "t.json"), "--num-contexts", "2", "--context-length", "300", "--window", "16",
            "--measure-layers", "0.3", "--out", str(tmp_path / "out"), "--quiet"]
    assert cli.main(argv) == 0
    assert "budget 0.3: per-layer scales" in capsys.readouterr().out
    measured = Bases.from_pretrained(tmp_path / "out").metadata["layer_sensitivity"]
    assert list(measured["kl"]) == ["0.3"] and set(measured["kl"]["0.3"]) == {"0", "1"}
    assert measured["num_contexts"] == 4 and measured["context_length"] == 300  # measure-layers' defaults, this length
    assert measured["command"].endswith("--measure-layers 0.3 --out " + str(tmp_path / "out") + " --quiet")
    assert "measured per-layer budget scales at 0.3" in (tmp_path / "out" / "README.md").read_text()


def test_hf_varrate_calibrate_is_the_same_command(monkeypatch):
    from hf_varrate import cli as top

    seen = []
    monkeypatch.setattr(cli, "main", lambda argv, prog=None: seen.append(argv) or 0)
    assert top.main(["calibrate", "--out", "x"]) == 0
    assert seen == [["--out", "x"]]
    demo = types.SimpleNamespace(main=lambda argv, prog=None: seen.append(("demo", argv)))
    monkeypatch.setitem(sys.modules, "hf_varrate.demo", demo)
    assert top.main(["demo", "--fast"]) == 0 and seen[-1] == ("demo", ["--fast"])


# the shipped bases, on the real default models (slow) -----------------------------------------------------


@pytest.mark.slow  # loads both real models (through getfixturevalue, which conftest cannot see)
@pytest.mark.parametrize("name, fixture, layers", [
    ("smollm2-135m-instruct", "smollm2", list(range(30))),
    ("gemma-3-270m", "gemma3", [5, 11, 17]),
])
def test_shipped_bases_load_validate_and_record_their_quality(request, monkeypatch, tmp_path, name, fixture, layers):
    model, _ = request.getfixturevalue(fixture)
    monkeypatch.chdir(tmp_path)  # a shipped name resolves from any directory
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no model-id or shape complaint
        cache = VarRateCache.from_pretrained(name, model=model)
    try:
        bases = cache.bases
        assert bases.metadata["compressed_layers"] == layers and bases.rank == bases.metadata["width"]
        assert (bases.metadata["stride"], bases.metadata["window"], bases.metadata["n_anchors"]) == (16, 64, 4)
        artifact = Bases.from_pretrained(shipped_path(name))
        for i in layers:  # the spectrum a key/value-balanced basis is built from
            s = artifact.spectrum(i)
            assert s.shape == (bases.rank,) and bool((s[1:] <= s[:-1]).all()) and float(s[0]) > 0
        quality = bases.metadata["quality"]
        assert quality["budget"] == 0.2 and "held_out" in quality["data"]
        assert quality["calibrated"]["keys"] < quality["identity"]["keys"]
        assert f"{quality['calibrated']['keys']:.4f}" in (shipped_path(name) / "README.md").read_text()
    finally:
        unbind(model)


def test_shipped_smollm2_bases_beat_identity_on_held_out_text(smollm2):
    model, tokenizer = smollm2
    bases = Bases.from_pretrained("smollm2-135m-instruct")
    held_out = load_texts(split="held_out", seed=7)  # another order than the card's measurement
    contexts = build_contexts(tokenizer, held_out.documents, 1, 1024)
    calibrated = reconstruction_error(model, bases, contexts, budget=0.2)
    identity = reconstruction_error(model, Bases.identity(model.config), contexts, budget=0.2)
    assert calibrated.keys < 0.85 * identity.keys
    assert calibrated.values < 0.9 * identity.values
