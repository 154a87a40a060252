"""The coding spaces beyond the paper, on tiny models: per-layer budgets from the calibration spectra
(layer_budgets="spectrum"), and the copies the bases derive for coding and reading (counted once)."""

import pytest
import torch

from hf_varrate import VarRateConfig

from test_beyond import calibrated_like, synthetic_spectrum


# per-layer budgets from the calibration spectra (layer_budgets="spectrum") -------------------------------
def test_layer_ranks_give_rank_where_the_energy_is_spread():
    from hf_varrate.codec.layer_budget import budget_scale, energy_shares, layer_ranks

    peaked, spread = torch.tensor([0.3**j for j in range(64)]), torch.tensor([0.97**j for j in range(64)])
    energies = energy_shares([peaked.sqrt(), spread.sqrt(), peaked.sqrt()])
    ranks = layer_ranks(energies, flat=20.0, floor=10)
    assert ranks.sum() == 60 and ranks[1] > 20 > ranks[0] >= 10 and ranks[0] == ranks[2]
    # at low ranks the peaked layer's leading directions are worth more: rank goes where it removes most error
    assert layer_ranks(energies, flat=2.0, floor=1).tolist() == [3, 1, 2]  # ties go to the layers in turn
    assert sum(budget_scale(energies, row, 20.0, 10) for row in range(3)) == pytest.approx(3.0)
    same = energy_shares([torch.ones(64)] * 3)
    assert layer_ranks(same, flat=20.0, floor=10).tolist() == [20, 20, 20]  # equal spectra: the uniform budget
    assert layer_ranks(energies, flat=100.0, floor=50).tolist() == [64, 64, 64]  # capped at R


def spread_and_peaked_bases(model_config):
    """Bases whose layer 0 holds its residual energy in few directions and layer 1 spreads it out."""
    from hf_varrate import Bases
    from hf_varrate.architecture import describe

    shape = describe(model_config)
    basis, _, _ = synthetic_spectrum(shape.width, 1.0)
    peaked = torch.tensor([0.3**j for j in range(shape.width)]).sqrt()
    spectra = {0: peaked, 1: torch.tensor([0.97**j for j in range(shape.width)]).sqrt()}
    return Bases.from_tensors({i: basis for i in shape.compressed_layers}, model_config, spectra=spectra,
                              stride=16, window=64, n_anchors=4)


@pytest.mark.parametrize("storage", ["materialized", "compact"])
def test_spectrum_layer_budgets_move_rank_and_keep_the_total(tiny_llama, storage):
    from hf_varrate import VarRateCache, bound

    bases = spread_and_peaked_bases(tiny_llama.config)
    ids = torch.randint(2, 128, (1, 600), generator=torch.Generator().manual_seed(0))
    caches = {}
    for mode in ("uniform", "spectrum"):
        caches[mode] = VarRateCache(bases, model=tiny_llama, budget=0.3, signal="uniform", r_min=4,
                                    layer_budgets=mode, storage=storage)
        with bound(tiny_llama), torch.no_grad():
            tiny_llama(input_ids=ids, past_key_values=caches[mode])
            caches[mode].compress()
    rank = {m: [int(c.layers[i].codes[0].ranks.long().sum()) for i in (0, 1)] for m, c in caches.items()}
    assert rank["spectrum"][1] > rank["uniform"][1] and rank["spectrum"][0] < rank["uniform"][0]
    assert sum(rank["spectrum"]) <= sum(rank["uniform"])  # shared, not added
    assert caches["spectrum"].footprint().prompt_fraction <= 0.3 + 1e-9


def test_spectrum_layer_budgets_in_a_scaled_space_derive_no_coding_copy(tiny_llama):
    """Per-layer budgets under balance='rms' take the scaled spaces' singular values alone: a layer's share
    makes no coding copy of any layer (before, every layer's copy was made on the CPU, an extra one beside a GPU
    cache's), and the energies are those of the balanced bases."""
    from hf_varrate import Bases
    from hf_varrate.architecture import describe
    from hf_varrate.codec.balance import balanced_basis
    from hf_varrate.codec.layer_budget import energy_shares

    shape = describe(tiny_llama.config)
    basis, _, _ = synthetic_spectrum(shape.width, 3.0, seed=7)  # content no other test uses: no shared copies
    spectra = {i: torch.tensor([(0.5 + 0.1 * i) ** (j / 8) for j in range(shape.width)])
               for i in shape.compressed_layers}
    bases = Bases.from_tensors({i: basis for i in shape.compressed_layers}, tiny_llama.config, spectra=spectra)
    config = VarRateConfig(balance="rms", key_weight=2.0, layer_budgets="spectrum")
    before = bases.nbytes()
    shares = {i: bases.layer_share(i, config) for i in shape.compressed_layers}
    assert bases.spaces.copies.coding == {} and bases.nbytes() == before
    energies, _ = shares[shape.compressed_layers[0]]
    expected = energy_shares([balanced_basis(basis, spectra[i], "rms", 2.0)[2] for i in shape.compressed_layers])
    torch.testing.assert_close(energies, expected, rtol=1e-5, atol=1e-7)
    assert sorted(row for _, row in shares.values()) == list(range(len(shape.compressed_layers)))


def test_spectrum_layer_budgets_need_a_spectrum_and_the_fast_path(tiny_llama):
    from hf_varrate import Bases, VarRateCache, bound

    with pytest.raises(ValueError, match="layer_budgets"):
        VarRateConfig(layer_budgets="spectrum", implementation="reference")
    with pytest.raises(ValueError, match="layer_budgets must be one of"):
        VarRateConfig(layer_budgets="sensitivity")
    cache = VarRateCache(Bases.identity(tiny_llama.config), model=tiny_llama, budget=0.3, layer_budgets="spectrum")
    with bound(tiny_llama), torch.no_grad(), pytest.raises(ValueError, match="spectrum.*layer_budgets='uniform'"):
        tiny_llama(input_ids=torch.randint(2, 128, (1, 300)), past_key_values=cache)
        cache.compress()


def test_bases_bytes_count_every_copy_once_and_a_balanced_cache_keeps_no_unscaled_one(tiny_llama):
    """The footprint reports the bases' bytes: the stored tensors plus what coding derived from them, one
    copy per model (two caches share it). A balanced cache codes in the scaled space only, so no fp32 copy of
    the unscaled basis is kept beside it."""
    from hf_varrate import VarRateCache, bound

    bases = calibrated_like(tiny_llama.config)
    stored = bases.nbytes()
    assert stored == sum(t.numel() * t.element_size() for t in {id(t): t for t in
                         [*bases.tensors.values(), *bases.spectra.values()]}.values())
    with bound(tiny_llama), torch.no_grad():
        caches = [VarRateCache(bases, model=tiny_llama, balance="rms", budget=0.4, stride=8, window=16, r_min=2)
                  for _ in range(2)]
        for cache in caches:
            tiny_llama(input_ids=torch.randint(2, 128, (1, 300)), past_key_values=cache)
            cache.compress()
    width, rank = bases.tensors[0].shape[1], bases.tensors[0].shape[0]
    # the scaled basis in 8 bits with an fp32 peak per row and half, and its scales (fp32)
    per_layer = rank * width + (2 * rank + width) * 4
    assert bases.nbytes() == stored + len(bases.tensors) * per_layer  # once, for both caches
    assert all(cache.footprint().bases_bytes == bases.nbytes() for cache in caches)
    natural = {i: bases.coding_basis(i, "rms", "cpu")[0].clone() for i in bases.tensors}  # the caches' copy
    with bound(tiny_llama), torch.no_grad():  # decoding reads the codes: the kept copy is reordered, not copied
        for cache in caches:
            tiny_llama(input_ids=torch.randint(2, 128, (1, 1)), past_key_values=cache)
    assert bases.nbytes() == stored + len(bases.tensors) * per_layer
    assert all(torch.equal(bases.coding_basis(i, "rms", "cpu")[0], natural[i]) for i in bases.tensors)


def test_bases_read_from_a_file_hold_one_8_bit_copy_and_read_the_stored_tensor_again(tmp_path, tiny_llama):
    """Loaded bases (fp16 on disk) code with one 8-bit copy per layer (the default `basis_bits`) and let the stored
    tensor go: bases_bytes is that copy, its scales and the stored spectra, not the stored tensors beside fp32
    copies. The stored tensor comes back from the file, bit for bit, when asked; a file changed or removed since
    the load is a BasesError."""
    from safetensors.torch import load_file, save_file

    from hf_varrate import Bases, VarRateCache, bound
    from hf_varrate.errors import BasesError

    calibrated_like(tiny_llama.config).save_pretrained(tmp_path / "bases")
    bases = Bases.from_pretrained(tmp_path / "bases")
    stored = {i: bases.tensors[i].clone() for i in bases.tensors}
    assert all(t.dtype == torch.float16 for t in stored.values())
    with bound(tiny_llama), torch.no_grad():
        cache = VarRateCache(bases, model=tiny_llama, balance="rms", budget=0.4, stride=8, window=16, r_min=2)
        tiny_llama(input_ids=torch.randint(2, 128, (1, 300)), past_key_values=cache)
        tiny_llama(input_ids=torch.randint(2, 128, (1, 1)), past_key_values=cache)  # reads the codes
    assert bases.tensors.resident() == []  # every layer codes from its copy
    rank, width = stored[0].shape
    per_layer = rank * width + (2 * rank + width + rank) * 4  # int8 copy; fp32 peaks, scales, stored spectrum
    assert cache.footprint().bases_bytes == bases.nbytes() == len(stored) * per_layer
    assert all(bases.coding_basis(i, "rms", "cpu", bits=8)[0].dtype == torch.float16 for i in stored)  # read back
    assert all(torch.equal(bases.tensors[i], stored[i]) for i in stored)  # read again, verified
    assert bases.tensors.resident() == []  # and not kept
    file = tmp_path / "bases" / "bases.safetensors"
    tensors = load_file(file)
    tensors["layers.0"][0] *= -1  # still a valid basis, but not the one loaded
    save_file(tensors, file)
    with pytest.raises(BasesError, match="layer 0's basis .* changed after the bases were loaded"):
        bases.tensors[0]
    file.unlink()
    with pytest.raises(BasesError, match="moved or removed"):
        bases.tensors[0]


def test_the_half_precision_copy_reconstructs_as_well_as_an_fp32_one(tmp_path, tiny_llama):
    """Coding with the fp16 copy (balanced in fp64, rounded once) loses nothing measurable against an fp32 copy
    of the same stored values: the reconstruction error of the keys and the values moves by under 1%."""
    from transformers import DynamicCache

    from hf_varrate import Bases, VarRateCache, bound

    calibrated_like(tiny_llama.config).save_pretrained(tmp_path / "bases")
    half = Bases.from_pretrained(tmp_path / "bases")
    single = Bases({i: half.tensors[i].float() for i in half.tensors}, half.metadata, half.spectra)
    ids = torch.randint(2, 128, (1, 400), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        exact = DynamicCache(config=tiny_llama.config)
        tiny_llama(input_ids=ids, past_key_values=exact)
    errors = {}
    for name, bases in (("half", half), ("single", single)):
        cache = VarRateCache(bases, model=tiny_llama, balance="rms", budget=0.3, stride=8, window=16, r_min=2,
                             coef_bits=4, storage="materialized")
        with bound(tiny_llama), torch.no_grad():
            tiny_llama(input_ids=ids, past_key_values=cache)
        cache.compress()
        assert bases.coding_basis(0, "rms", "cpu")[0].dtype == (torch.float16 if name == "half" else torch.float32)
        errors[name] = [float((getattr(a, part) - getattr(b, part)).norm() / getattr(b, part).norm())
                        for a, b in zip(cache.layers, exact.layers) for part in ("keys", "values")]
    assert min(errors["single"]) > 1e-3  # coded, not stored exactly
    assert errors["half"] == pytest.approx(errors["single"], rel=0.01)
