"""The evaluation-only keys quantized per channel beside low-rank values (evaluation/methods/kivi_keys.py): the
quantizer's error and groups, the bytes it is charged, and a method that rewrites only the coded tokens' keys
within its total budget."""

from __future__ import annotations

import pytest
import torch

from evaluation.methods import kivi_keys as kk


def test_each_channel_is_quantized_over_its_own_groups_within_half_a_step():
    keys = torch.randn(150, 6, generator=torch.Generator().manual_seed(0))
    keys[:, 2] = 3.25  # a constant channel comes back exactly
    keys[10, 4] = 40.0  # an outlier widens only its own group of its own channel
    out = kk.quantize_channels(keys, 3, 64)
    assert torch.equal(out[:, 2], keys[:, 2])
    for start in range(0, 150, 64):  # groups of 64, the last of 22 alone
        block, got = keys[start:start + 64], out[start:start + 64]
        step = (block.amax(0) - block.amin(0)) / 7
        assert ((got - block).abs() <= step / 2 + 1e-6).all()
    error = (out - keys).abs()
    assert error[64:, 4].max() < error[:64, 4].max() / 4  # the outlier's group pays for it, the next ones do not
    assert torch.unique(out[:64, 0]).numel() <= 8
    with pytest.raises(ValueError, match="eval_keys_bits=0"):
        kk.quantize_channels(keys, 0, 64)


def test_the_bytes_charged_are_the_codes_and_a_scale_pair_per_group_and_channel():
    assert kk.key_bytes(128, 256, 3, 64) == 128 * 256 * 3 // 8 + 4 * 256 * 2
    assert kk.key_bytes(130, 10, 2, 64) == 325 + 4 * 10 * 3  # a partial group pays its scales too
    assert kk.key_bytes(640, 64, 3, 64) / (640 * 64 * 2 * 2) == pytest.approx(kk.share(3, 64))


def spec(**fields):
    return {"kind": "varrate", "preset": "recommended", "budget": 0.5, "budget_dtype": "float16",
            "storage": "materialized", "key_weight": 0.01, "eval_keys_bits": 8, **fields}


def spectral_bases(model):
    """Identity bases with a calibration spectrum, which a key weight other than 1 needs."""
    from hf_varrate import Bases

    width = 2 * model.config.num_key_value_heads * model.config.head_dim
    spectrum = torch.linspace(2.0, 0.1, width)
    return Bases.from_tensors({i: torch.eye(width) for i in range(2)}, model.config,
                              spectra={i: spectrum for i in range(2)}, calibration="test")


def test_only_the_coded_keys_are_rewritten_within_the_total_budget(tiny_llama, one_intra_op_thread):
    from evaluation.capture import capture
    from evaluation.methods import make_method
    from evaluation.methods.base import Context
    bases = spectral_bases(tiny_llama)
    ids = torch.randint(2, 128, (700,), generator=torch.Generator().manual_seed(3)).tolist()
    captured = capture(tiny_llama, ids)
    method = make_method("k8", spec())
    method._bases[("tiny", "test")] = bases
    comp = method.compress(Context(tiny_llama, None, "tiny", captured, ids), "test")
    assert 0.49 <= comp.extra["fraction_fp16"] <= 0.5 + 1e-3  # the total, the keys' bytes in it
    assert comp.extra["eval_keys_codec_budget"] < 0.5 - kk.share(8, 64) + 0.05
    plain = make_method("codec", {k: v for k, v in spec(budget=comp.extra["eval_keys_codec_budget"]).items()
                                  if not k.startswith("eval_keys")})
    plain._bases[("tiny", "test")] = bases
    reference = plain.compress(Context(tiny_llama, None, "tiny", captured, ids), "test").cache
    footprint = comp.cache.footprint().layers
    for i, layer in enumerate(comp.cache.layers):
        code = layer.codes[0]
        coded = code.coded_pos.long()
        exact = torch.ones(len(ids), dtype=torch.bool)
        exact[coded] = False
        keys, true = layer.keys[0], captured.keys[i][0]
        assert torch.equal(layer.values, reference.layers[i].values)  # the values are the codec's
        assert torch.equal(keys[:, exact], reference.layers[i].keys[0][:, exact])  # exact tokens keep the codec's keys
        error = (keys[:, coded] - true[:, coded]).norm() / true[:, coded].norm()
        coded_error = (reference.layers[i].keys[0][:, coded] - true[:, coded]).norm() / true[:, coded].norm()
        assert error < 0.01 < coded_error  # 8-bit keys, where the value-weighted codec alone loses them
        heads, dim = true.shape[0], true.shape[-1]
        assert comp.extra["stored_bytes"][i] == footprint[i].bytes + kk.key_bytes(coded.numel(), heads * dim, 8, 64)


def test_a_spec_that_cannot_rewrite_or_cannot_fit_the_keys_is_refused(tiny_llama):
    from evaluation.capture import capture
    from evaluation.methods import make_method
    from evaluation.methods.base import Context

    with pytest.raises(ValueError, match="eval_keys_bits.*storage"):
        make_method("k", {k: v for k, v in spec().items() if k != "storage"})
    with pytest.raises(ValueError, match="key_weight"):
        make_method("k", {k: v for k, v in spec().items() if k != "key_weight"})
    method = make_method("k", spec(budget=0.2))  # 8-bit keys take 0.27 of the bytes
    ids = torch.randint(2, 128, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    with pytest.raises(ValueError, match=r"eval_keys_bits=8 take 0\.266.*budget=0\.2"):
        method.compress(Context(tiny_llama, None, "tiny", capture(tiny_llama, ids), ids), "identity")
    starved = make_method("k", spec(budget=0.28))  # 8-bit keys leave the values 0.0144: less than the exact tokens
    starved._bases[("tiny", "test")] = spectral_bases(tiny_llama)
    with pytest.raises(ValueError, match=r"budget=0\.0144.*layers \[0, 1\] were stored exactly; lower the bits"):
        starved.compress(Context(tiny_llama, None, "tiny", capture(tiny_llama, ids), ids), "test")
