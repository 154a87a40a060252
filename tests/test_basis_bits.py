"""The coding basis held in 8 bits (`basis_bits=8`, the default): half a 16-bit basis's bytes, a scale per row
and half, an error per basis vector below the codec's own, and the same answers."""

import dataclasses

import pytest
import torch

from hf_varrate import Bases, VarRateCache, VarRateConfig, bound
from hf_varrate.codec.basis_bits import Int8Basis, quantize_basis, readable
from hf_varrate.shipped import shipped_path

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_an_identity_basis_reads_back_exactly(dtype):
    basis = torch.eye(12, dtype=dtype)
    held = quantize_basis(basis)
    assert held.codes.dtype == torch.int8 and held.read().dtype == dtype
    assert torch.equal(held.read(), basis)


def test_each_half_of_a_row_has_its_own_scale():
    g = torch.Generator().manual_seed(0)
    basis = torch.randn(6, 16, generator=g)
    basis[:, 8:] *= 1e-3  # a value half scaled down against its keys, as balance and key_weight do
    read = quantize_basis(basis).read()
    error = (read - basis).abs()
    assert (error[:, :8] <= basis[:, :8].abs().amax(dim=1, keepdim=True) / 254 + 1e-7).all()
    assert (error[:, 8:] <= basis[:, 8:].abs().amax(dim=1, keepdim=True) / 254 + 1e-10).all()  # not the keys' step


def test_columns_reorder_within_a_half_and_not_across():
    basis = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    held = quantize_basis(basis)
    order = torch.tensor([1, 0, 3, 2, 4, 5, 6, 7])
    assert torch.equal(held.index_select(1, order).read(), held.read().index_select(1, order))
    with pytest.raises(ValueError, match="within the key half and the value half"):
        held.index_select(1, torch.tensor([4, 1, 2, 3, 0, 5, 6, 7]))
    with pytest.raises(ValueError, match="odd width"):
        quantize_basis(torch.randn(4, 7))


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_the_shipped_bases_lose_about_one_percent_per_basis_vector(model):
    """Every layer of the shipped bases, in the coding space their preset codes in: the rms relative error per
    row (basis vector) is about 1% (0.8% on SmolLM2, 1.1% on Gemma-3), the worst row's under 4%; the 8-bit copy
    is half the fp16 one's bytes."""
    bases = Bases.from_pretrained(shipped_path(model))
    config = bases.config("recommended")
    errors = []
    for i in sorted(bases.tensors):
        exact, _ = bases.coding_basis(i, config.balance, "cpu", key_weight=config.key_weight, bits=None)
        held = quantize_basis(exact)
        assert held.codes.nbytes == exact.nbytes // 2
        errors.append((held.read().float() - exact.float()).norm(dim=1) / exact.float().norm(dim=1))
    errors = torch.cat(errors)
    assert errors.pow(2).mean().sqrt() < 0.015 and errors.max() < 0.04


def test_the_default_cache_codes_with_the_8_bit_copy_and_basis_bits_none_with_the_stored_one(tiny_llama):
    """Both read the basis they coded with; the 8-bit one moves the decoded K/V far less than the codec's own
    error, and `basis_bits=None` codes as before (the stored basis, unchanged)."""
    from test_beyond import calibrated_like

    bases = calibrated_like(tiny_llama.config)
    ids = torch.randint(2, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    decoded = {}
    with bound(tiny_llama), torch.no_grad():
        exact = tiny_llama(input_ids=ids, use_cache=True).past_key_values
        for bits in (8, None):
            cache = VarRateCache(bases, model=tiny_llama, balance="rms", budget=0.3, stride=8, window=16, r_min=2,
                                 basis_bits=bits)
            tiny_llama(input_ids=ids, past_key_values=cache)
            cache.compress()
            decoded[bits] = [layer.read() for layer in cache.layers]
    copies = bases.spaces.copies.coding
    assert {key[-1] for key in copies} == {8, None}
    assert all(isinstance(copy.basis, Int8Basis) == (key[-1] == 8) for key, copy in copies.items())
    for i, (k8, v8) in enumerate(decoded[8]):
        k, v = decoded[None][i]
        k_exact, v_exact = exact.layers[i].keys, exact.layers[i].values
        codec_error = (k - k_exact).norm() + (v - v_exact).norm()
        bits_error = (k8 - k).norm() + (v8 - v).norm()
        assert 0 < bits_error < 0.2 * codec_error


def test_on_smollm2_the_8_bit_basis_adds_almost_nothing_to_the_codec_s_error(smollm2):
    """The default cache on a 2K prompt: relative K/V error over every coded layer, 16-bit vs 8-bit basis (measured
    0.0424 vs 0.0429)."""
    from hf_varrate.calibration.texts import wiki_documents

    model, tokenizer = smollm2
    ids = tokenizer("\n\n".join(wiki_documents()[-400:]), return_tensors="pt").input_ids[:, :2048]
    with torch.no_grad():
        exact = model(ids, use_cache=True).past_key_values

    def error(bits):
        cache = VarRateCache.from_pretrained("smollm2-135m-instruct", model=model, basis_bits=bits)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        cache.compress()
        pairs = [(layer.read(), (exact.layers[i].keys, exact.layers[i].values)) for i, layer in enumerate(cache.layers)]
        wrong = sum((k - ke).norm() ** 2 + (v - ve).norm() ** 2 for (k, v), (ke, ve) in pairs)
        return float((wrong / sum(ke.norm() ** 2 + ve.norm() ** 2 for _, (ke, ve) in pairs)).sqrt())

    sixteen, eight = error(None), error(8)
    assert 0.01 < sixteen < eight < 1.05 * sixteen


def test_basis_bits_names_its_choices():
    with pytest.raises(ValueError, match="basis_bits"):
        VarRateConfig(basis_bits=4)
    assert VarRateConfig().basis_bits == 8 and VarRateConfig.preset("paper").basis_bits == 8
    from hf_varrate.config_checks import GROUPS

    assert {f.metadata["group"] for f in dataclasses.fields(VarRateConfig)} <= set(GROUPS)
    assert "basis_bits" not in VarRateConfig.runtime_fields()  # a saved cache cannot be read with another


def test_readable_passes_a_tensor_through():
    basis = torch.randn(3, 4)
    assert readable(basis) is basis


def test_a_saved_cache_is_read_with_the_basis_it_was_coded_with(tmp_path, tiny_llama):
    """`basis_bits` is fixed when the prompt is coded: a load keeps the saved value and refuses another; a save
    from before the field existed was coded with the stored basis, and loads so."""
    import json

    from test_bad_saved_caches import seal
    from test_beyond import calibrated_like

    from hf_varrate import serialization

    bases = calibrated_like(tiny_llama.config)
    bases.save_pretrained(tmp_path / "bases", dtype=torch.float32)
    bases = Bases.from_pretrained(tmp_path / "bases")
    ids = torch.randint(2, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    with bound(tiny_llama), torch.no_grad():
        cache = VarRateCache(bases, model=tiny_llama, balance="rms", budget=0.3, stride=8, window=16, r_min=2)
        tiny_llama(input_ids=ids, past_key_values=cache)
        cache.compress()
    cache.save_pretrained(tmp_path / "saved")
    assert VarRateCache.load(tmp_path / "saved", model=tiny_llama).config.basis_bits == 8
    with pytest.raises(ValueError, match="basis_bits is fixed when the prompt is coded"):
        VarRateCache.load(tmp_path / "saved", model=tiny_llama, basis_bits=None)
    path = tmp_path / "saved" / serialization.CONFIG_NAME
    meta = json.loads(path.read_text())
    del meta["config"]["basis_bits"]
    path.write_text(json.dumps(seal(meta)))
    assert VarRateCache.load(tmp_path / "saved", model=tiny_llama).config.basis_bits is None
