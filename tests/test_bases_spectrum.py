"""The calibration spectrum (`spectrum.<i>` [R] fp32) in a bases artifact: exact round trips, older
artifacts without it, a BasesError naming the tensor for every bad one, and what calibrate() puts in it."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save, save_file

from hf_varrate import Bases, BasesError
from hf_varrate.bases import CARD_NAME, CONFIG_NAME, WEIGHTS_NAME
from hf_varrate.calibration import calibrate, collect_residuals
from hf_varrate.card import render_card

# the artifact of tests/test_bases.py: the tiny models' shape, D = 64, rank 8
META = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "width": 64, "compressed_layers": [0, 1],
        "rank": 8, "model_id": "tiny/llama", "stride": 16, "window": 64, "n_anchors": 4}


def orthonormal(rank: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(64, rank, generator=g, dtype=torch.float64))
    return q.T.float().contiguous()  # [rank, 64]


def good_tensors() -> dict[str, torch.Tensor]:
    return {"layers.0": orthonormal(8, seed=0), "layers.1": orthonormal(8, seed=1)}


def write_artifact(folder, tensors: dict[str, torch.Tensor], meta: dict):
    """A bases folder written by hand, with a correct sha256."""
    folder.mkdir(parents=True, exist_ok=True)
    blob = save(tensors)
    (folder / WEIGHTS_NAME).write_bytes(blob)
    (folder / CONFIG_NAME).write_text(json.dumps({**meta, "sha256": {WEIGHTS_NAME: hashlib.sha256(blob).hexdigest()}}))
    return folder


def descending(rank: int = 8, seed: int = 0) -> torch.Tensor:
    """Distinct positive values in decreasing order, with digits fp16 could not hold."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(rank, generator=g, dtype=torch.float64) * 10 + 1e-3).sort(descending=True).values


def spectral_bases() -> Bases:
    return Bases.from_tensors({0: orthonormal(8, seed=0), 1: orthonormal(8, seed=1)},
                              spectra={0: descending(seed=0), 1: descending(seed=1)}, **META)


# round trips ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_spectrum_round_trips_bit_for_bit_in_fp32_whatever_the_bases_dtype(tmp_path, dtype):
    bases = spectral_bases()
    bases.save_pretrained(tmp_path, dtype=dtype)
    loaded = Bases.from_pretrained(tmp_path)
    raw = load_file(tmp_path / WEIGHTS_NAME)
    assert sorted(raw) == ["layers.0", "layers.1", "spectrum.0", "spectrum.1"]
    for i in (0, 1):
        assert raw[f"spectrum.{i}"].dtype == torch.float32 and loaded.tensors[i].dtype == dtype
        saved = bases.spectrum(i)
        assert saved.dtype == torch.float32 and saved.shape == (8,)
        assert torch.equal(saved, descending(seed=i).float())  # fp64 in, fp32 kept
        assert torch.equal(loaded.spectrum(i), saved)
        assert loaded.spectrum(i, device="cpu").device.type == "cpu"
    # the spectrum is part of the checksummed file: changing one value fails the sha256 check
    raw["spectrum.1"][3] -= 1e-3
    save_file(raw, tmp_path / WEIGHTS_NAME)
    with pytest.raises(BasesError, match="sha256"):
        Bases.from_pretrained(tmp_path)


def test_artifact_without_spectrum_loads_and_has_none(tmp_path):
    write_artifact(tmp_path, good_tensors(), META)  # the layout of every artifact written before spectra
    loaded = Bases.from_pretrained(tmp_path)
    assert loaded.spectra == {} and loaded.spectrum(0) is None and loaded.spectrum(1) is None
    loaded.save_pretrained(tmp_path / "again")
    assert sorted(load_file(tmp_path / "again" / WEIGHTS_NAME)) == ["layers.0", "layers.1"]
    with pytest.raises(BasesError, match="no tensor for layer 7"):
        loaded.spectrum(7)


def test_identity_bases_have_no_spectrum(tiny_llama):
    bases = Bases.identity(tiny_llama.config)
    assert bases.spectra == {} and bases.spectrum(0) is None


def test_card_lists_the_spectrum_tensors_only_when_present(tmp_path):
    spectral_bases().save_pretrained(tmp_path / "with")
    Bases.from_tensors({0: orthonormal(8, seed=0), 1: orthonormal(8, seed=1)}, **META).save_pretrained(
        tmp_path / "without")
    assert "`spectrum.<i>` [R] float32" in ModelCard.load(tmp_path / "with" / CARD_NAME).text
    assert "`layers.<i>` [R, D] float16" in (tmp_path / "without" / CARD_NAME).read_text()
    assert "spectrum" not in (tmp_path / "without" / CARD_NAME).read_text()
    assert "spectrum.<i>" in render_card(json.loads((tmp_path / "with" / CONFIG_NAME).read_text()), spectrum=True)


# bad spectra -------------------------------------------------------------------------------------------
def _with(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    return {**good_tensors(), "spectrum.0": descending(seed=0).float(), "spectrum.1": descending(seed=1).float(),
            name: value}


def _without(name: str) -> dict[str, torch.Tensor]:
    tensors = _with("spectrum.0", descending(seed=0).float())
    del tensors[name]
    return tensors


def _poke(index: int, value: float) -> torch.Tensor:
    s = descending(seed=1).float()
    s[index] = value
    return s


@pytest.mark.parametrize(
    "tensors, message",
    [
        (_without("spectrum.1"), r"missing \['spectrum.1'\]"),
        (_with("spectrum.5", descending().float()), r"unexpected \['spectrum.5'\]"),
        (_with("spectrum.1", descending(4).float()),
         r"spectrum spectrum.1 has shape \(4,\), expected \[rank\] = \[8\]"),
        (_with("spectrum.1", descending().float()[None]), r"spectrum spectrum.1 has shape \(1, 8\)"),
        (_with("spectrum.1", torch.arange(8, 0, -1, dtype=torch.int32)), "spectrum spectrum.1 has dtype torch.int32"),
        (_with("spectrum.1", _poke(2, float("nan"))), "spectrum spectrum.1 contains NaN or inf"),
        (_with("spectrum.1", _poke(0, float("inf"))), "spectrum spectrum.1 contains NaN or inf"),
        (_with("spectrum.1", _poke(7, -1e-6)), "spectrum spectrum.1 has a negative singular value"),
        (_with("spectrum.1", descending(seed=1).float().flip(0)), "spectrum spectrum.1 is not non-increasing: "
                                                                  "entry 1"),
        (_with("spectrum.1", _poke(5, 100.0)), "spectrum spectrum.1 is not non-increasing: entry 5"),
        (_with("spectrum", descending().float()), r"unexpected \['spectrum'\]"),
        (_with("singular.0", descending().float()), r"unexpected \['singular.0'\]"),
    ],
    ids=["missing-one-layer", "extra-layer", "wrong-length", "wrong-ndim", "int-dtype", "nan", "inf", "negative",
         "ascending", "one-rise", "no-index", "other-name"],
)
def test_bad_spectra_are_rejected_naming_the_tensor(tmp_path, tensors, message):
    write_artifact(tmp_path, tensors, META)
    with pytest.raises(BasesError, match=message) as err:
        Bases.from_pretrained(tmp_path)
    assert "rebuild" in str(err.value)


def test_equal_singular_values_are_allowed(tmp_path):
    flat = torch.ones(8)
    write_artifact(tmp_path, {**good_tensors(), "spectrum.0": flat, "spectrum.1": torch.zeros(8)}, META)
    assert torch.equal(Bases.from_pretrained(tmp_path).spectrum(0), flat)


def test_save_refuses_spectra_for_some_layers_only_or_out_of_order(tmp_path):
    layers = {0: orthonormal(8, seed=0), 1: orthonormal(8, seed=1)}
    partial = Bases.from_tensors(layers, spectra={0: descending()}, **META)
    with pytest.raises(BasesError, match=r"missing \['spectrum.1'\]"):
        partial.save_pretrained(tmp_path)
    with pytest.raises(BasesError, match="not for layer 1"):
        partial.spectrum(1)
    rising = Bases.from_tensors(layers, spectra={0: descending(), 1: descending().flip(0)}, **META)
    with pytest.raises(BasesError, match="spectrum.1 is not non-increasing"):
        rising.save_pretrained(tmp_path)
    assert not (tmp_path / WEIGHTS_NAME).exists()


# calibrate() ---------------------------------------------------------------------------------------------
def test_calibrated_spectrum_is_the_moment_spectrum_and_survives_saving(tmp_path, tiny_llama):
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(2, 128, (300,), generator=g) for _ in range(3)]
    bases = calibrate(tiny_llama, contexts, progress=False)  # R = D = 64
    residual = collect_residuals(tiny_llama, contexts, [0, 1])
    bases.save_pretrained(tmp_path, dtype=torch.float16)
    loaded = Bases.from_pretrained(tmp_path)
    for i in (0, 1):
        s = bases.spectrum(i)
        assert s.dtype == torch.float32 and s.shape == (64,)
        assert bool((s[1:] <= s[:-1]).all()) and float(s[-1]) >= 0 and float(s[0]) > 0
        e = residual[i].double()  # [C, D]
        moment = e.T @ e  # [D, D]
        torch.testing.assert_close(s.double().square().sum(), moment.trace(), rtol=1e-5, atol=0)
        torch.testing.assert_close(s.double(), torch.linalg.svdvals(e), rtol=1e-4, atol=1e-6 * float(s[0]))
        v = bases.tensors[i].double()  # R = D: Sigma = V^T diag(s^2) V is the moment itself
        torch.testing.assert_close(v.T @ torch.diag(s.double().square()) @ v, moment,
                                   rtol=0, atol=1e-5 * float(moment.abs().max()))
        assert torch.equal(loaded.spectrum(i), s)


def test_calibrated_spectrum_at_a_lower_rank_is_the_leading_part(tiny_llama):
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(2, 128, (300,), generator=g) for _ in range(2)]
    full = calibrate(tiny_llama, contexts, progress=False)
    low = calibrate(tiny_llama, contexts, rank=16, progress=False)
    assert low.spectrum(0).shape == (16,)
    assert torch.equal(low.spectrum(0), full.spectrum(0)[:16])
