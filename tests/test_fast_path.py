"""Tier (a): the fast codec path against the reference path it replaces (STYLE habit 8), no model."""

import pytest
import torch
import torch.nn.functional as F

from hf_varrate import VarRateConfig
from hf_varrate.codec import (
    anchor_means, compress_prompt, decode, decode_blocks, decode_prompt, encode, encode_blocks, gather_means,
    join_kv, joint_rows, nearest_anchors, nearest_anchors_mm, pack, rank_order, rotate_keys, rotate_rows,
    snapkv_scores, unpack, unrotate_keys, unrotate_rows,
)
from hf_varrate.codec.projection import matmul_dtype

from test_codec import make_prompt, random_orthonormal, rope_tables


def test_row_major_rope_and_joint_rows_are_bit_identical():
    keys, values, _, cos, sin = make_prompt(seq_len=120, heads=3, dim=16)
    pos = torch.randperm(120, generator=torch.Generator().manual_seed(0))[:50]
    assert torch.equal(joint_rows(keys, values, cos, sin, pos), join_kv(unrotate_keys(keys, cos, sin), values)[0][pos])
    rows = keys[0].transpose(0, 1)  # [S, H, d]
    assert torch.equal(unrotate_rows(rows, cos[0], sin[0]), unrotate_keys(keys, cos, sin)[0].transpose(0, 1))
    rotated = rotate_rows(rows.clone(), cos[0], sin[0])  # fused multiply-adds: equal up to rounding
    torch.testing.assert_close(rotated, rotate_keys(keys, cos, sin)[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    kb, vb, cb, sb = keys.bfloat16(), values.bfloat16(), cos.bfloat16(), sin.bfloat16()
    assert torch.equal(joint_rows(kb, vb, cb, sb, pos), join_kv(unrotate_keys(kb, cb, sb), vb.float())[0][pos])


@pytest.mark.parametrize("offset", [0.0, 1000.0])
def test_nearest_anchors_mm_matches_brute_force(offset):
    g = torch.Generator().manual_seed(1)
    coded = torch.randn(700, 48, generator=g) * 30 + offset
    anchors = torch.randn(40, 48, generator=g) * 30 + offset
    brute = torch.cdist(coded.double(), anchors.double()).topk(4, largest=False).indices.sort(dim=1).values
    for chunk in (1, 64, 5000):
        assert torch.equal(nearest_anchors_mm(coded, anchors, 4, chunk).sort(dim=1).values, brute)
        assert torch.equal(nearest_anchors(coded, anchors, 4, chunk).sort(dim=1).values, brute)


def test_gather_means_equals_the_reference_mean():
    g = torch.Generator().manual_seed(2)
    anchors, neighbours = torch.randn(30, 40, generator=g), torch.randint(0, 30, (500, 4), generator=g)
    torch.testing.assert_close(gather_means(anchors, neighbours.to(torch.uint8)), anchor_means(anchors, neighbours),
                               rtol=0, atol=1e-6)
    assert gather_means(anchors, neighbours).dtype == torch.float32


@pytest.mark.parametrize("case", ["random", "zeros", "full", "block_edges", "one_token", "none"])
def test_rank_blocked_encode_decode_equal_full_rank_masked(case):
    g = torch.Generator().manual_seed(3)
    width, rank, count = 96, 80, {"one_token": 1, "none": 0}.get(case, 400)
    basis = random_orthonormal(rank, width)
    ranks = {
        "random": torch.randint(0, rank + 1, (count,), generator=g),
        "zeros": torch.zeros(count, dtype=torch.long),
        "full": torch.full((count,), rank),
        "block_edges": torch.tensor([0, 1, 31, 32, 33, 63, 64, 65, 80] * 44 + [80] * 4)[:count],
    }.get(case, torch.full((count,), 17))
    resid, means = torch.randn(count, width, generator=g), torch.randn(count, width, generator=g)
    plan = rank_order(ranks)
    packed = encode_blocks(resid[plan.order].contiguous(), basis, plan)
    reference = pack(encode(resid, basis), ranks, torch.float32)
    assert packed.shape == reference.shape
    # fp32 round-off only: BLAS may pick another kernel for a [1, 17] block than for [1, 80] (seen on
    # one thread after other tests changed the thread count), so bit equality is not guaranteed.
    torch.testing.assert_close(packed, reference, rtol=1e-6, atol=1e-6)
    z_hat = decode_blocks(means[plan.order].clone(), packed, basis, plan)
    expected = decode(means, unpack(reference, ranks, max(int(ranks.max()) if count else 1, 1)), basis)
    torch.testing.assert_close(z_hat, expected[plan.order], rtol=0, atol=1e-5)


def snapkv_as_first_written(queries, keys, scaling, pool_kernel):
    """The salience before its causal mask was narrowed to the window's own columns."""
    _, num_q_heads, window, dim = queries.shape
    _, num_kv_heads, seq_len, _ = keys.shape
    q = queries.reshape(num_kv_heads, num_q_heads // num_kv_heads * window, dim)
    logits = torch.matmul(q, keys[0].transpose(-1, -2).to(q.dtype)) * scaling
    logits = logits.view(num_kv_heads, num_q_heads // num_kv_heads, window, seq_len)
    query_pos = torch.arange(seq_len - window, seq_len)
    logits = logits.masked_fill(torch.arange(seq_len)[None, :] > query_pos[:, None], float("-inf"))
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32).to(queries.dtype).mean(dim=(0, 1, 2))
    return F.avg_pool1d(scores[None, None], pool_kernel, stride=1, padding=pool_kernel // 2)[0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_narrowed_causal_mask_gives_bit_identical_salience(dtype):
    keys, _, queries, _, _ = make_prompt(seq_len=300, heads=2, dim=16, hq=4)
    keys, queries = keys.to(dtype), queries.to(dtype)
    assert torch.equal(snapkv_scores(queries, keys, 0.25, 5), snapkv_as_first_written(queries, keys, 0.25, 5))


def reconstruct(impl, keys, values, queries, cos, sin, basis, **overrides):
    config = VarRateConfig(budget=overrides.pop("budget", 0.4), r_min=4, implementation=impl, **overrides)
    code, k_hat, v_hat = compress_prompt(keys, values, queries, cos, sin, basis, config, 0.25)
    return code, k_hat, v_hat


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overrides", [{}, {"coef_bits": 4}, {"allocation": "topk"}, {"signal": "uniform"}])
def test_fast_path_matches_the_reference_path(dtype, overrides):
    """Same ranks, same anchors; reconstruction differs from the reference's by far less than the
    reference's own coding error (flash-attention's yardstick: a multiple of the reference's error)."""
    keys, values, queries, cos, sin = make_prompt(seq_len=700, heads=2, dim=16)
    keys, values, queries, cos, sin = (t.to(dtype) for t in (keys, values, queries, cos, sin))
    basis = random_orthonormal(64, 64)
    ref = reconstruct("reference", keys, values, queries, cos, sin, basis, **overrides)
    fast = reconstruct("fast", keys, values, queries, cos, sin, basis, **overrides)
    assert torch.equal(fast[0].ranks, ref[0].ranks)
    assert (fast[0].neighbours.long().sort(1).values
            != ref[0].neighbours.long().sort(1).values).any(1).float().mean() < 0.01
    own_error = (ref[1].float() - keys.float()).norm() + (ref[2].float() - values.float()).norm()
    gap = (fast[1].float() - ref[1].float()).norm() + (fast[2].float() - ref[2].float()).norm()
    assert gap <= 0.01 * own_error + (1e-4 if dtype == torch.float32 else 0.05)
    exact = fast[0].exact_pos
    assert (torch.equal(fast[1][:, :, exact], keys[:, :, exact])
            and torch.equal(fast[2][:, :, exact], values[:, :, exact]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overrides", [{}, {"coef_bits": 2}, {"coef_bits": 3}, {"coef_bits": 4}, {"signal": "uniform"},
                                       {"signal": "uniform", "coef_bits": 4}])
def test_materialized_reconstruction_equals_decode_prompt_bit_for_bit(overrides, dtype):
    keys, values, queries, cos, sin = (t.to(dtype) for t in make_prompt(seq_len=500, heads=2, dim=16))
    basis = random_orthonormal(64, 64)
    code, k_hat, v_hat = reconstruct("fast", keys, values, queries, cos, sin, basis, **overrides)
    exact = code.exact_pos
    k_dec, v_dec = decode_prompt(code, keys[:, :, exact], values[:, :, exact], cos, sin, basis)
    assert torch.equal(k_hat, k_dec) and torch.equal(v_hat, v_dec)
    k_ref, v_ref = decode_prompt(code, keys[:, :, exact], values[:, :, exact], cos, sin, basis,
                                 implementation="reference")
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output either way
    torch.testing.assert_close(k_dec, k_ref, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(v_dec, v_ref, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("overrides", [{"signal": "uniform"}, {"signal": "uniform", "coef_bits": 4}])
def test_dense_layout_matches_the_rank_blocked_one(overrides, monkeypatch):
    """Uniform ranks take the dense layout; forcing the blocked one must give the same code and, up to fp32
    round-off, the same reconstruction."""
    import hf_varrate.codec.pipeline as pipeline

    keys, values, queries, cos, sin = make_prompt(seq_len=600, heads=2, dim=16)
    basis = random_orthonormal(64, 64)
    assert isinstance(pipeline._plan(torch.full((10,), 20), 1), pipeline.DenseOrder)
    dense = reconstruct("fast", keys, values, queries, cos, sin, basis, **overrides)
    monkeypatch.setattr(pipeline, "_plan", lambda ranks, group, by_component=False: rank_order(ranks))
    blocked = reconstruct("fast", keys, values, queries, cos, sin, basis, **overrides)
    assert torch.equal(dense[0].ranks, blocked[0].ranks) and torch.equal(dense[0].neighbours, blocked[0].neighbours)
    if "coef_bits" not in overrides:
        torch.testing.assert_close(dense[0].coefs, blocked[0].coefs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense[1], blocked[1], rtol=1e-3, atol=1e-3)  # 4-bit: a rounding may flip a level
    torch.testing.assert_close(dense[2], blocked[2], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("overrides", [{}, {"signal": "uniform", "coef_bits": 4}])
def test_bf16_projections_stay_within_their_rounding(overrides):
    """projection_dtype='bfloat16' changes the coded correction by bf16 rounding only: far less than the
    codec's own error, and the materialized reconstruction still equals decode_prompt bit for bit."""
    keys, values, queries, cos, sin = make_prompt(seq_len=600, heads=2, dim=16)
    basis = random_orthonormal(64, 64)
    fp32 = reconstruct("fast", keys, values, queries, cos, sin, basis, **overrides)
    bf16 = reconstruct("fast", keys, values, queries, cos, sin, basis, projection_dtype="bfloat16", **overrides)
    assert torch.equal(fp32[0].ranks, bf16[0].ranks)
    own_error = (fp32[1] - keys).norm() + (fp32[2] - values).norm()
    gap = (bf16[1] - fp32[1]).norm() + (bf16[2] - fp32[2]).norm()
    assert 0 < gap <= 0.05 * own_error
    exact = bf16[0].exact_pos
    k_dec, v_dec = decode_prompt(bf16[0], keys[:, :, exact], values[:, :, exact], cos, sin, basis,
                                 projection_dtype="bfloat16")
    assert torch.equal(bf16[1], k_dec) and torch.equal(bf16[2], v_dec)


def test_projection_dtype_auto_and_reference_refusal():
    assert matmul_dtype("auto", "cpu") in (torch.float32, torch.bfloat16)
    assert matmul_dtype("bfloat16", "cpu") == torch.bfloat16 and matmul_dtype("float32", "cpu") == torch.float32
    with pytest.raises(ValueError, match="projection_dtype must be one of"):
        VarRateConfig(projection_dtype="float16")
    with pytest.raises(ValueError, match="'reference' runs the paper's algorithm only, got projection_dtype"):
        VarRateConfig(implementation="reference", projection_dtype="bfloat16")


def test_decode_prompt_writes_into_given_views():
    keys, values, queries, cos, sin = make_prompt(seq_len=400, heads=2, dim=16)
    basis = random_orthonormal(64, 64)
    code, k_hat, v_hat = reconstruct("fast", keys, values, queries, cos, sin, basis)
    exact = code.exact_pos
    big_k, big_v = torch.zeros(2, 2, 450, 16), torch.zeros(2, 2, 450, 16)
    decode_prompt(code, keys[:, :, exact], values[:, :, exact], cos, sin, basis,
                  out=(big_k[1:2, :, 30:430], big_v[1:2, :, 30:430]))
    assert torch.equal(big_k[1:2, :, 30:430], k_hat) and torch.equal(big_v[1:2, :, 30:430], v_hat)
    assert not big_k[0].any() and not big_k[1, :, :30].any()


def test_rope_tables_reproduce_the_test_tables():
    inv = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    from hf_varrate.codec import rope_tables as tables

    cos, sin = tables(torch.arange(50), inv, 1.3, torch.float32)
    ref_cos, ref_sin = rope_tables(50, 16, 1.3)
    torch.testing.assert_close(cos, ref_cos) and torch.testing.assert_close(sin, ref_sin)
