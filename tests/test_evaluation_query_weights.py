"""The evaluation-only query-weighted key coding (evaluation/methods/query_weights.py): the queries' energy it
measures, the weights it derives from it, and that with alpha = 0 it codes exactly as the library does."""

from __future__ import annotations

import pytest
import torch

from evaluation.methods import query_weights as qw

from test_beyond import calibrated_like


def test_the_query_energy_is_the_pre_rope_queries_per_kv_head_and_rope_pair(tiny_llama):
    from evaluation.capture import capture, decoder

    ids = [torch.randint(2, 128, (80,), generator=torch.Generator().manual_seed(s)).tolist() for s in (0, 1)]
    energy = qw.query_energy(tiny_llama, ids)
    config = tiny_llama.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    assert sorted(energy) == list(range(config.num_hidden_layers))
    module = decoder(tiny_llama).layers[1].self_attn
    want = 0
    with torch.no_grad():
        for prompt in ids:
            hidden = capture(tiny_llama, prompt).hidden[1]
            q = module.q_proj(hidden)[0].view(-1, heads, dim).double()  # [S, H_q, d]
            want = want + q.square().mean(dim=0) / 2
    want = want.view(kv_heads, heads // kv_heads, dim).sum(dim=1)
    want = (want[:, : dim // 2] + want[:, dim // 2 :]) / 2
    torch.testing.assert_close(energy[1], torch.cat((want, want), dim=1))


def test_the_weights_follow_the_energy_and_keep_the_key_energy():
    energy = torch.tensor([[4.0, 1.0, 0.0, 9.0]], dtype=torch.float64)
    moment = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    w = qw.key_weights(energy, 1.0, moment)
    assert float((w.square() * moment).sum()) == pytest.approx(float(moment.sum()))
    assert w[3] > w[0] > w[1] > w[2] > 0  # a dimension no query reads is floored, not zeroed
    assert torch.allclose(qw.key_weights(energy, 0.0, moment), torch.ones(4, dtype=torch.float64))


def test_alpha_0_codes_as_the_library_and_alpha_1_weighs_the_keys(tiny_llama):
    plain, weighted, zero = (calibrated_like(tiny_llama.config) for _ in range(3))
    width = plain.tensors[0].shape[1]
    g = torch.Generator().manual_seed(0)
    energy = {i: torch.rand(1, width // 2, generator=g, dtype=torch.float64) for i in plain.tensors}
    qw.weigh(zero, energy, 0.0)
    qw.weigh(weighted, energy, 1.0)
    for i in plain.tensors:  # plain first: bases of equal content share derived copies, the weighted ones not
        base, base_scales = plain.coding_basis(i, "rms", "cpu", bits=None)
        same, same_scales = zero.coding_basis(i, "rms", "cpu", bits=None)
        assert torch.equal(base, same) and torch.equal(base_scales, same_scales)
        other, scales = weighted.coding_basis(i, "rms", "cpu", bits=None)
        assert not torch.allclose(other, base)
        assert torch.equal(scales[width // 2 :], base_scales[width // 2 :])  # the value half is untouched
        ratio = (scales[: width // 2] / base_scales[: width // 2]).double()
        order = energy[i].reshape(-1).argsort()
        assert torch.all(ratio[order].diff() >= -1e-6)  # heavier read, larger weight


def test_a_method_with_query_weights_must_materialize():
    from evaluation.methods import make_method

    with pytest.raises(ValueError, match="storage: materialized"):
        make_method("q", {"kind": "varrate", "preset": "recommended", "eval_query_weights": 0.5})
    make_method("q", {"kind": "varrate", "preset": "recommended", "eval_query_weights": 0.5,
                      "storage": "materialized"})
