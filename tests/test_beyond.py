"""Tier (a): the options beyond the paper, on random tensors (no model).

balance, flat_floor, anchor_share, budget_dtype, the query-agnostic signals, and the presets.
"""

import pytest
import torch

from hf_varrate import VarRateConfig
from hf_varrate.codec import compress_prompt, decode_prompt, encode_prompt
from hf_varrate.codec.balance import balanced_basis
from hf_varrate.codec.pipeline import effective_stride, rank_floor

from test_codec import make_prompt, random_orthonormal


def encode(config, seq_len=600, basis=None, scales=None, dtype=torch.float32, seed=0):
    keys, values, queries, cos, sin = make_prompt(seq_len=seq_len, seed=seed)
    keys, values = keys.to(dtype), values.to(dtype)
    basis = random_orthonormal(64, 64) if basis is None else basis
    return encode_prompt(keys, values, queries.to(dtype), cos, sin, basis, config, 0.25, scales=scales)


def test_paper_preset_is_the_config_default_and_recommended_preset_turns_options_on():
    assert VarRateConfig.preset("paper") == VarRateConfig()
    recommended = VarRateConfig.preset("recommended", budget=0.3)
    assert recommended.budget == 0.3 and recommended != VarRateConfig(budget=0.3)
    with pytest.raises(ValueError, match="preset must be one of"):
        VarRateConfig.preset("fast")


def measured_like(model_config):
    """`calibrated_like` bases that also carry a (flat) per-layer sensitivity measurement at 0.1."""
    bases = calibrated_like(model_config)
    flat = {str(i): [0.1, 0.0] for i in bases.metadata["compressed_layers"]}
    bases.metadata["layer_sensitivity"] = {"levels": [0.5, 1.0], "kl": {"0.1": flat}}
    return bases


@pytest.mark.parametrize("budget, window, coef_bits, layers", [(0.2, 64, 4, "uniform"), (0.15, 64, 4, "uniform"),
                                                               (0.1, 16, 3, "measured"), (0.05, 16, 3, "measured")])
def test_the_recommended_preset_shortens_the_window_and_quantizes_harder_at_a_tenth_or_less(
        tmp_path, tiny_llama, budget, window, coef_bits, layers):
    """At budget 0.1 and below the preset holds 16 exact tokens at the end instead of the bases' 64, codes 3-bit
    coefficients and gives the layers their measured budgets, without the warning an override of a calibration
    setting gets; what the user passes wins, and the paper's preset is untouched."""
    import warnings

    from hf_varrate import Bases

    measured_like(tiny_llama.config).save_pretrained(tmp_path, dtype=torch.float32)
    bases = Bases.from_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = bases.config("recommended", budget=budget)
    assert (config.window, config.coef_bits, config.layer_budgets) == (window, coef_bits, layers)
    assert VarRateConfig.preset("recommended", budget=budget).coef_bits == coef_bits
    assert bases.config("recommended", budget=budget, window=64, coef_bits=4).window == 64
    assert bases.config("recommended", budget=budget, layer_budgets="uniform").layer_budgets == "uniform"
    paper = bases.config("paper", budget=budget)
    assert (paper.window, paper.coef_bits, paper.layer_budgets) == (64, None, "uniform")


def test_the_low_budget_preset_keeps_uniform_layer_budgets_on_bases_without_a_measurement(tmp_path, tiny_llama):
    from hf_varrate import Bases

    calibrated_like(tiny_llama.config).save_pretrained(tmp_path, dtype=torch.float32)
    bases = Bases.from_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="measured sensitivity at budget=0.1.*hf-varrate measure-layers") as caught:
        config = bases.config("recommended", budget=0.1)
    assert {w.filename for w in caught} == {__file__}  # the warning points at the caller's line
    assert config.layer_budgets == "uniform" and config.coef_bits == 3  # the rest of the low-budget preset stays
    assert bases.config("recommended", budget=0.1, layer_budgets="measured").layer_budgets == "measured"  # as asked


@pytest.mark.parametrize("field, value", [("flat_floor", 1.5), ("flat_floor", -0.1), ("anchor_share", 0.0),
                                          ("anchor_share", 2), ("balance", "l2"), ("budget_dtype", "int8")])
def test_bad_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        VarRateConfig(**{field: value})


@pytest.mark.parametrize("option", [{"balance": "rms"}, {"signal": "residual"}, {"signal": "key_norm"}])
def test_reference_implementation_refuses_options_it_lacks(option):
    with pytest.raises(ValueError, match="implementation='fast'"):
        VarRateConfig(implementation="reference", **option)


@pytest.mark.parametrize("flat_floor", [0.0, 0.5, 0.9])
def test_flat_floor_lifts_every_rank_and_keeps_the_total(flat_floor):
    config = VarRateConfig(budget=0.4, r_min=2, flat_floor=flat_floor)
    code = encode(config)
    ranks = code.ranks.long()
    flat = int(ranks.sum()) / ranks.numel()
    paper = encode(config.replace(flat_floor=0.0)).ranks.long()
    assert int(ranks.sum()) == int(paper.sum())  # same bytes: the floor moves rank, never adds it
    assert int(ranks.min()) >= rank_floor(config, int(ranks.sum()), ranks.numel(), 64) >= int(flat_floor * flat) - 1
    if flat_floor >= 0.5:
        assert int(ranks.min()) > int(paper.min())  # the salience signal no longer decides the floor


def test_anchor_share_doubles_the_stride_until_the_exact_set_fits():
    config = VarRateConfig(budget=0.1, stride=16, window=16, r_min=2, anchor_share=0.25)
    stride = effective_stride(config, 2048)
    exact = 2048 // stride + 16
    assert stride > 16 and stride % 16 == 0 and exact <= 0.25 * 0.1 * 2048
    assert effective_stride(config.replace(anchor_share=None), 2048) == 16
    assert effective_stride(config.replace(budget=1.0), 2048) == 16
    # never fewer anchors than n_anchors, however small the budget
    tiny = config.replace(budget=0.01, window=1)
    assert 2048 // effective_stride(tiny, 2048) >= tiny.n_anchors


def test_anchor_share_codes_a_budget_the_paper_stores_exactly():
    keys, values, queries, cos, sin = make_prompt(seq_len=2048)
    basis = random_orthonormal(64, 64)
    paper = VarRateConfig(budget=0.12, window=64, r_min=2)
    assert encode_prompt(keys, values, queries, cos, sin, basis, paper, 0.25).stored_exactly
    config = paper.replace(anchor_share=0.5)
    code, k_hat, v_hat = compress_prompt(keys, values, queries, cos, sin, basis, config, 0.25)
    assert not code.stored_exactly and code.stride > paper.stride
    assert code.nbytes() <= 0.12 * 2048 * 64 * 4  # the budget is met, not exceeded
    exact = code.exact_pos
    k2, v2 = decode_prompt(code, keys[:, :, exact], values[:, :, exact], cos, sin, basis)
    assert torch.equal(k2, k_hat) and torch.equal(v2, v_hat)  # the decoder reads the stride from the code
    assert torch.equal(k_hat[:, :, exact], keys[:, :, exact])


def test_budget_dtype_float16_gives_fp32_prompts_the_ranks_of_fp16_ones():
    config = VarRateConfig(budget=0.3, r_min=4, signal="uniform")  # SnapKV scores would differ by fp16 rounding
    half = encode(config, dtype=torch.float16)
    as_half = encode(config.replace(budget_dtype="float16"))
    assert torch.equal(half.ranks.long(), as_half.ranks.long())
    quantized = config.replace(coef_bits=4, quantized_budget="same_bytes")
    plain = encode(quantized).ranks.long().sum()
    assert encode(quantized.replace(budget_dtype="float16")).ranks.long().sum() < plain  # fp32 flatters 4-bit
    with pytest.raises(ValueError, match="budget_dtype='float32' is wider"):  # would exceed the budget
        encode(config.replace(budget_dtype="float32"), dtype=torch.float16)
    # and the bytes count as the fp16 code's: an fp32 code sized in fp16 takes, counted at 2 bytes a value,
    # exactly what the fp16 code holds, and meets the budget there
    assert as_half.nbytes(kv_bytes=2) == half.nbytes() and as_half.full_nbytes(kv_bytes=2) == half.full_nbytes()
    assert as_half.nbytes(kv_bytes=2) <= 0.3 * half.full_nbytes() < as_half.nbytes()


@pytest.mark.parametrize("signal", ["key_norm", "residual"])
def test_query_agnostic_signals_meet_the_budget_and_round_trip(signal):
    keys, values, queries, cos, sin = make_prompt(seq_len=500)
    basis = random_orthonormal(64, 64)
    config = VarRateConfig(budget=0.4, r_min=2, signal=signal)
    code, k_hat, v_hat = compress_prompt(keys, values, queries, cos, sin, basis, config, 0.25)
    paper = encode_prompt(keys, values, queries, cos, sin, basis, config.replace(signal="snapkv"), 0.25)
    assert int(code.ranks.long().sum()) == int(paper.ranks.long().sum())
    assert not torch.equal(code.ranks, paper.ranks)
    exact = code.exact_pos
    k2, v2 = decode_prompt(code, keys[:, :, exact], values[:, :, exact], cos, sin, basis)
    assert torch.equal(k2, k_hat) and torch.equal(v2, v_hat)


def test_residual_signal_gives_hard_tokens_more_rank():
    keys, values, queries, cos, sin = make_prompt(seq_len=500)
    coded = torch.arange(500)[(torch.arange(500) % 16 != 0) & (torch.arange(500) < 436)]
    outliers = coded[::7]
    keys[:, :, outliers] *= 6  # far from every anchor: large residuals
    config = VarRateConfig(budget=0.4, r_min=2, signal="residual")
    code = encode_prompt(keys, values, queries, cos, sin, random_orthonormal(64, 64), config, 0.25)
    ranks = code.ranks.long()
    is_outlier = torch.isin(code.coded_pos, outliers)
    assert ranks[is_outlier].float().mean() > 2 * ranks[~is_outlier].float().mean()


def synthetic_spectrum(width=64, key_energy=100.0, seed=0):
    """A calibration second moment whose key half carries `key_energy` times the value half's energy."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4000, width, generator=g, dtype=torch.float64)
    a[:, : width // 2] *= key_energy**0.5
    moment = a.T @ a
    eigenvalues, eigenvectors = torch.linalg.eigh(moment)
    order = eigenvalues.argsort(descending=True)
    return eigenvectors[:, order].T.float().contiguous(), eigenvalues[order].clamp(min=0).sqrt().float(), a


def test_balanced_basis_is_orthonormal_and_equalises_the_halves():
    basis, spectrum, samples = synthetic_spectrum()
    balanced, scales, _ = balanced_basis(basis, spectrum)
    assert torch.allclose(balanced @ balanced.T, torch.eye(64), atol=1e-5)
    assert torch.all(scales[:32] == 1)
    scaled = samples.float() * scales
    key_energy, value_energy = scaled[:, :32].square().sum(), scaled[:, 32:].square().sum()
    assert abs(float(key_energy / value_energy) - 1) < 0.05
    assert 8 < float(scales[32]) < 12  # sqrt(100)


def test_balance_trades_key_error_for_value_error():
    """Keys 10x the values' norm: unbalanced PCA spends rank on keys; balanced on both halves alike."""
    basis, spectrum, _ = synthetic_spectrum()
    balanced, scales, _ = balanced_basis(basis, spectrum)
    keys, values, queries, cos, sin = make_prompt(seq_len=600, seed=3)
    keys = keys * 10
    config = VarRateConfig(budget=0.35, r_min=4, signal="uniform")
    errors = {}
    for name, (b, s) in {"none": (basis, None), "rms": (balanced, scales)}.items():
        code, k_hat, v_hat = compress_prompt(keys, values, queries, cos, sin, b, config, 0.25, scales=s)
        exact = code.exact_pos
        k2, v2 = decode_prompt(code, keys[:, :, exact], values[:, :, exact], cos, sin, b, scales=s)
        assert torch.equal(k2, k_hat) and torch.equal(v2, v_hat)
        assert torch.equal(k_hat[:, :, exact], keys[:, :, exact])  # exact tokens stay exact under scaling
        coded = code.coded_pos
        rel = lambda hat, ref: float((hat - ref)[:, :, coded].norm() / ref[:, :, coded].norm())  # noqa: E731
        errors[name] = (rel(k_hat, keys), rel(v_hat, values))
    assert errors["rms"][1] < errors["none"][1]  # values come back better
    assert errors["rms"][0] > errors["none"][0]  # at the keys' expense


def test_a_key_weight_moves_error_from_the_keys_to_the_values():
    """key_weight > 1 divides the value half once more: at the same bytes the keys come back better and the
    values worse than under balance alone; key_weight 1 is balance alone, bit for bit."""
    basis, spectrum, _ = synthetic_spectrum()
    keys, values, queries, cos, sin = make_prompt(seq_len=600, seed=3)
    keys = keys * 10
    config = VarRateConfig(budget=0.35, r_min=4, signal="uniform")
    errors = {}
    for weight in (1.0, 4.0):
        b, s, _ = balanced_basis(basis, spectrum, "rms", weight)
        code, k_hat, v_hat = compress_prompt(keys, values, queries, cos, sin, b, config, 0.25, scales=s)
        coded = code.coded_pos
        rel = lambda hat, ref: float((hat - ref)[:, :, coded].norm() / ref[:, :, coded].norm())  # noqa: E731
        errors[weight] = (rel(k_hat, keys), rel(v_hat, values))
    assert errors[4.0][0] < errors[1.0][0] and errors[4.0][1] > errors[1.0][1]
    plain, plain_scales, _ = balanced_basis(basis, spectrum)
    one, one_scales, _ = balanced_basis(basis, spectrum, "rms", 1.0)
    assert torch.equal(plain, one) and torch.equal(plain_scales, one_scales)
    with pytest.raises(ValueError, match="key_weight must be in"):
        VarRateConfig(key_weight=0)


def calibrated_like(model_config, key_energy=30.0):
    """Bases with a spectrum whose keys carry `key_energy` x the values' energy, for a tiny model."""
    from hf_varrate import Bases
    from hf_varrate.architecture import describe

    shape = describe(model_config)
    basis, spectrum, _ = synthetic_spectrum(shape.width, key_energy)
    layers = shape.compressed_layers
    return Bases.from_tensors({i: basis for i in layers}, model_config, spectra={i: spectrum for i in layers},
                              stride=16, window=64, n_anchors=4)


def test_recommended_preset_end_to_end_compact_equals_materialized(tmp_path, tiny_llama):
    from hf_varrate import VarRateCache, unbind

    calibrated_like(tiny_llama.config).save_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(2, 128, (1, 500), generator=torch.Generator().manual_seed(0))
    logits = {}
    try:
        for storage in ("materialized", "compact"):
            # fp32 projections: compact storage is read over its codes, which agrees with the reconstruction to
            # float rounding in fp32 and to bf16's precision in bf16 (tests/test_attention.py checks both)
            cache = VarRateCache.from_pretrained(tmp_path, model=tiny_llama, preset="recommended", budget=0.3,
                                                 storage=storage, projection_dtype="float32")
            assert cache.config.balance == "rms"
            with torch.no_grad():
                tiny_llama(input_ids=ids, past_key_values=cache, use_cache=True)
                cache.compress()
                logits[storage] = tiny_llama(input_ids=ids[:, -1:] + 1, past_key_values=cache).logits
                cache.compress()
            assert not cache.layers[0].codes[0].stored_exactly
            assert cache.footprint().prompt_fraction <= 0.3 + 1e-3
    finally:
        unbind(tiny_llama)
    assert torch.allclose(logits["compact"], logits["materialized"], atol=1e-4)


def test_balance_without_a_spectrum_says_how_to_get_one(tmp_path, tiny_llama):
    from hf_varrate import Bases, VarRateCache, unbind

    Bases.identity(tiny_llama.config).save_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(2, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    try:
        cache = VarRateCache.from_pretrained(tmp_path, model=tiny_llama, balance="rms", budget=0.3)
        with pytest.raises(ValueError, match="spectrum.*recalibrate"), torch.no_grad():
            tiny_llama(input_ids=ids, past_key_values=cache, use_cache=True)
            cache.compress()
    finally:
        unbind(tiny_llama)


def test_from_pretrained_defaults_to_the_recommended_preset(tmp_path, tiny_llama):
    from hf_varrate import VarRateCache, VarRateConfig, unbind

    calibrated_like(tiny_llama.config).save_pretrained(tmp_path, dtype=torch.float32)
    try:
        default = VarRateCache.from_pretrained(tmp_path, model=tiny_llama, budget=0.3).config
        paper = VarRateCache.from_pretrained(tmp_path, model=tiny_llama, preset="paper", budget=0.3).config
    finally:
        unbind(tiny_llama)
    assert default == VarRateConfig.preset("recommended", budget=0.3, stride=16, window=64, n_anchors=4)
    assert paper == VarRateConfig(budget=0.3, stride=16, window=64, n_anchors=4)


def test_default_preset_falls_back_to_no_balance_on_bases_without_a_spectrum(tmp_path, tiny_llama):
    from hf_varrate import Bases, VarRateCache, unbind

    Bases.identity(tiny_llama.config).save_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(2, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    try:
        with pytest.warns(UserWarning, match="spectrum.*balance='none'"):
            cache = VarRateCache.from_pretrained(tmp_path, model=tiny_llama, budget=0.3)
        assert cache.config.balance == "none" and cache.config.coef_bits == 4  # the rest of the preset stays
        with torch.no_grad():
            tiny_llama(input_ids=ids, past_key_values=cache, use_cache=True)  # compresses instead of failing
            cache.compress()
        assert not cache.layers[0].codes[0].stored_exactly
    finally:
        unbind(tiny_llama)


def test_overriding_a_calibrated_setting_warns(tmp_path, tiny_llama):
    from hf_varrate import VarRateCache, unbind

    calibrated_like(tiny_llama.config).save_pretrained(tmp_path, dtype=torch.float32)
    try:
        with pytest.warns(UserWarning, match="stride"):
            VarRateCache.from_pretrained(tmp_path, model=tiny_llama, stride=32)
    finally:
        unbind(tiny_llama)


def test_a_saved_balanced_cache_reloads_only_with_the_same_spectrum(tmp_path, tiny_llama):
    import copy

    from hf_varrate import CacheFileError, VarRateCache, bind, unbind

    bases = calibrated_like(tiny_llama.config)
    ids = torch.randint(2, 128, (1, 400), generator=torch.Generator().manual_seed(1))
    try:
        cache = VarRateCache(bases, VarRateConfig.preset("recommended", budget=0.3), model=bind(tiny_llama))
        with torch.no_grad():
            tiny_llama(input_ids=ids, past_key_values=cache, use_cache=True)
            cache.compress()
            want = tiny_llama(input_ids=ids[:, -1:], past_key_values=copy.deepcopy(cache)).logits
        cache.save_pretrained(tmp_path / "cache")
        loaded = VarRateCache.load(tmp_path / "cache", model=tiny_llama, bases=bases)
        with torch.no_grad():
            got = tiny_llama(input_ids=ids[:, -1:], past_key_values=loaded).logits
        assert torch.allclose(got, want, atol=1e-5)
        other = calibrated_like(tiny_llama.config, key_energy=3.0)
        other.tensors = bases.tensors  # the very same basis tensors: only the spectrum differs
        with pytest.raises(CacheFileError, match="bases"):
            VarRateCache.load(tmp_path / "cache", model=tiny_llama, bases=other)
    finally:
        unbind(tiny_llama)
