"""Tier (a): the codec on random tensors, no model."""

import math

import pytest
import torch

from hf_varrate import VarRateConfig
from hf_varrate.codec import (
    SIGNALS, SignalInputs, coded_salience, register_signal, decode, decode_prompt, encode, encode_prompt, exact_mask,
    join_kv, minmax, nearest_anchors,
    pack, residuals, rotate_keys, split_kv, topk_ranks, unpack, unrotate_keys, waterfill_ranks,
)
from hf_varrate.codec.allocation import distortion_ranks
from hf_varrate.codec.pipeline import compress_prompt


def rope_tables(seq_len, dim, scale=1.0, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
    freqs = torch.outer(torch.arange(seq_len).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale)[None], (emb.sin() * scale)[None]  # [1, S, d]


def random_orthonormal(rank, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(width, width, generator=g))
    return q[:rank].contiguous()


@pytest.mark.parametrize("scale", [1.0, 1.3])
def test_rope_round_trip(scale):
    keys = torch.randn(2, 3, 50, 16)
    cos, sin = rope_tables(50, 16, scale)
    back = rotate_keys(unrotate_keys(keys, cos, sin), cos, sin) / scale**2 * scale**2
    # rotate(unrotate(k)) == k, including an attention_scaling folded into cos/sin
    assert torch.allclose(rotate_keys(unrotate_keys(keys, cos, sin), cos, sin), keys, atol=1e-5)
    assert back.shape == keys.shape


def test_join_split_round_trip():
    k, v = torch.randn(1, 3, 7, 8), torch.randn(1, 3, 7, 8)
    z = join_kv(k, v)
    assert z.shape == (1, 7, 48)
    k2, v2 = split_kv(z, 3)
    assert torch.equal(k, k2) and torch.equal(v, v2)


def test_exact_mask_has_anchors_and_window():
    mask = exact_mask(100, stride=16, window=10)
    assert mask[[0, 16, 32, 48, 64, 80, 96]].all()
    assert mask[90:].all() and not mask[1:16].any() and not mask[81:90].any()


def test_nearest_anchors_matches_brute_force_and_chunking():
    g = torch.Generator().manual_seed(0)
    coded, anchors = torch.randn(300, 24, generator=g) * 50 + 1000, torch.randn(20, 24, generator=g) * 50 + 1000
    brute = torch.cdist(coded.double(), anchors.double()).topk(4, largest=False).indices
    for chunk in (7, 64, 1000):
        got = nearest_anchors(coded, anchors, 4, chunk)
        assert torch.equal(got.sort(dim=1).values, brute.sort(dim=1).values)


def test_residual_is_distance_to_anchor_mean():
    coded, anchors = torch.randn(10, 8), torch.randn(5, 8)
    e, nb = residuals(coded, anchors, 2, 4)
    assert torch.allclose(e, coded - anchors[nb].mean(1), atol=1e-6)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("r_min,r_max", [(16, 64), (0, 10), (4, 4)])
def test_waterfill_hits_budget_respects_bounds_and_is_monotone(seed, r_min, r_max):
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(500, generator=g) ** 3
    total = int(500 * (r_min + (r_max - r_min) * torch.rand(1, generator=g).item()))
    ranks = waterfill_ranks(s, total, r_min, r_max)
    assert int(ranks.sum()) == total  # exactly the budget, never above it
    assert ranks.min() >= r_min and ranks.max() <= r_max
    order = torch.argsort(s)
    assert (ranks[order].diff() >= -1).all()  # monotone in salience up to integer rounding


def test_waterfill_matches_the_papers_iterative_algorithm():
    g = torch.Generator().manual_seed(3)
    s, r_min, r_max, total = torch.rand(200, generator=g) ** 4, 16, 128, 200 * 40
    r = torch.full((200,), float(r_min), dtype=torch.float64)
    active = torch.ones(200, dtype=torch.bool)
    while True:  # Algorithm 1, lines 6-11
        delta = total - r.sum()
        r[active] += delta * s[active].double() / s[active].double().sum()
        over = active & (r > r_max)
        r[over] = r_max
        active &= ~over
        if not over.any():
            break
    ranks = waterfill_ranks(s, total, r_min, r_max)
    assert (ranks.double() - r).abs().max() <= 1.0


def test_constant_salience_is_the_flat_codec():
    ranks = waterfill_ranks(torch.full((100,), 0.3), 100 * 37 + 42, 16, 384)
    assert set(ranks.tolist()) <= {37, 38} and int(ranks.sum()) == 100 * 37 + 42
    flat = coded_salience("uniform", signal_inputs(torch.arange(100), 200))
    assert torch.equal(waterfill_ranks(flat, 3742, 16, 384), ranks)


def test_waterfill_with_all_zero_and_nan_salience():
    ranks = waterfill_ranks(torch.tensor([0.0, 0.0, 1.0, float("nan")]), 4 * 20, 16, 32)
    assert int(ranks.sum()) == 80 and ranks[2] == 32 and ranks.min() >= 16


def test_waterfill_rejects_infeasible_total():
    with pytest.raises(ValueError, match="total rank"):
        waterfill_ranks(torch.rand(10), 10 * 16 - 1, 16, 64)


def test_topk_is_a_binary_split():
    s = torch.rand(100)
    ranks = topk_ranks(s, 100 * 16 + 5 * (64 - 16), 16, 64)
    assert int(ranks.sum()) == 100 * 16 + 5 * 48
    assert set(ranks.tolist()) == {16, 64} and (ranks == 64).sum() == 5
    assert torch.equal(torch.argsort(s)[-5:].sort().values, (ranks == 64).nonzero()[:, 0].sort().values)


def truncation_loss(energy, ranks):
    keep = torch.arange(energy.shape[1])[None] < ranks[:, None]
    return float(energy.masked_fill(keep, 0.0).sum())


def test_distortion_ranks_are_the_least_lossy_of_all_allocations():
    """On decreasing per-token energies (a concave kept energy, as PCA coefficients nearly give) the ranks lose
    no more than the best of every allocation with the same total, found by brute force."""
    import itertools
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        energy = (torch.rand(4, 6, generator=g) * torch.rand(4, 1, generator=g) * 10).sort(1, descending=True).values
        total = 4 + trial % 13  # ranks in [1, 6]
        ranks = distortion_ranks(energy, total, 1, 6)
        assert int(ranks.sum()) == total and ranks.min() >= 1 and ranks.max() <= 6
        best = min(truncation_loss(energy, torch.tensor(r)) for r in itertools.product(range(1, 7), repeat=4)
                   if sum(r) == total)
        assert truncation_loss(energy, ranks) <= best + 1e-5


def test_distortion_ranks_stop_early_at_the_optimum_to_a_thousandth():
    """The price search stops once the ranks are within `slack` per token of the total and fills the rest greedily:
    on PCA-like energies (decaying, chi-square noise, tokens of different scale) that loses at most 0.1% more
    energy than bisecting to the end."""
    g = torch.Generator().manual_seed(7)
    energy = torch.randn(1500, 192, generator=g).square() * torch.linspace(3, 0.1, 192).square() * \
        (torch.rand(1500, 1, generator=g) + 0.5)
    for mean_rank in (20, 60, 120):
        quick = distortion_ranks(energy, 1500 * mean_rank, 8, 192)
        exhaustive = distortion_ranks(energy, 1500 * mean_rank, 8, 192, steps=200, slack=0.0)
        assert int(quick.sum()) == 1500 * mean_rank
        assert truncation_loss(energy, quick) <= truncation_loss(energy, exhaustive) * 1.001


def test_distortion_ranks_follow_each_tokens_energy():
    """Equal tokens get ranks within one of each other; a token with a ten times larger tail gets more; any
    energies (not decreasing, with NaN) still give ranks in bounds that sum to the total and lose no more
    than uniform ranks."""
    energy = torch.full((10, 32), 1.0).cumprod(1) * torch.linspace(1, 0.01, 32)
    ranks = distortion_ranks(energy, 10 * 12 + 3, 4, 32)
    assert int(ranks.sum()) == 123 and int(ranks.max() - ranks.min()) <= 1
    energy[3, 8:] *= 10
    ranks = distortion_ranks(energy, 10 * 12, 4, 32)
    assert int(ranks[3]) == int(ranks.max()) and int(ranks[3]) > int(ranks[0])
    g = torch.Generator().manual_seed(5)
    wild = torch.rand(50, 40, generator=g) * torch.rand(50, 1, generator=g)
    wild[7, 3] = float("nan")
    for total in (50 * 4, 50 * 17, 50 * 40):
        ranks = distortion_ranks(wild, total, 4, 40)
        assert int(ranks.sum()) == total and ranks.min() >= 4 and ranks.max() <= 40
        clean = torch.nan_to_num(wild)
        assert truncation_loss(clean, ranks) <= truncation_loss(clean, torch.full((50,), total // 50)) + 1e-5
    with pytest.raises(ValueError, match="total rank"):
        distortion_ranks(wild, 50 * 4 - 1, 4, 40)


@pytest.mark.parametrize("coef_bits, budget", [(None, 0.4), (3, 0.12)])
def test_distortion_allocation_codes_a_mixed_prompt_better_in_the_same_bytes(coef_bits, budget):
    """Tokens of very different scale: ranks from their own coefficients beat uniform ranks in the same budget,
    and the code decodes to what the encoder reconstructed, bit for bit."""
    keys, values, queries, cos, sin = make_prompt(seq_len=600)
    loud = torch.arange(600) % 5 == 0
    keys[:, :, loud] *= 6
    values[:, :, loud] *= 6
    basis = random_orthonormal(64, 64)
    errors = {}
    for allocation in ("waterfill", "distortion"):
        config = VarRateConfig(budget=budget, r_min=2, signal="uniform", allocation=allocation, coef_bits=coef_bits,
                               quantized_budget="same_bytes", window=16, stride=64)
        code, k_hat, v_hat = compress_prompt(keys, values, queries, cos, sin, basis, config, scaling=0.25)
        exact = code.exact_pos
        k_dec, v_dec = decode_prompt(code, keys[:, :, exact], values[:, :, exact], cos, sin, basis)
        assert torch.equal(k_dec, k_hat) and torch.equal(v_dec, v_hat)
        errors[allocation] = float((k_hat - keys).square().sum() + (v_hat - values).square().sum())
        assert code.nbytes() <= budget * code.full_nbytes()
        if allocation == "distortion":
            coded_loud = loud[code.coded_pos]
            assert code.ranks[coded_loud].float().mean() > code.ranks[~coded_loud].float().mean() + 4
    assert errors["distortion"] < 0.9 * errors["waterfill"]


def test_distortion_allocation_reads_no_signal():
    with pytest.raises(ValueError, match=r"allocation='distortion'.*signal='snapkv'.*signal='uniform'"):
        VarRateConfig(allocation="distortion")
    with pytest.raises(ValueError, match="implementation='reference'.*allocation"):
        VarRateConfig(allocation="distortion", signal="uniform", implementation="reference")


def test_minmax_constant_and_range():
    assert torch.equal(minmax(torch.full((5,), 2.0)), torch.ones(5))
    out = minmax(torch.tensor([1.0, 3.0, 2.0]))
    assert torch.allclose(out, torch.tensor([0.0, 1.0, 0.5]))


def test_pack_unpack_and_error_nonincreasing_in_rank():
    basis = random_orthonormal(48, 48)
    e = torch.randn(30, 48)
    coefs = encode(e, basis)
    errors = []
    for r in range(0, 49, 4):
        ranks = torch.full((30,), r)
        c = unpack(pack(coefs, ranks, torch.float32), ranks, 48)
        errors.append(float((decode(torch.zeros(30, 48), c, basis) - e).norm()))
    assert all(a >= b - 1e-4 for a, b in zip(errors, errors[1:]))
    assert errors[-1] < 1e-4 * float(e.norm())  # full rank reconstructs exactly


def make_prompt(seq_len=400, heads=2, dim=16, hq=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, heads, seq_len, dim, generator=g)
    values = torch.randn(1, heads, seq_len, dim, generator=g)
    queries = torch.randn(1, hq, 64, dim, generator=g)
    cos, sin = rope_tables(seq_len, dim)
    return keys, values, queries, cos, sin


@pytest.mark.parametrize("budget", [0.3, 0.5, 0.8])
def test_encode_prompt_meets_budget_and_keeps_exact_tokens(budget):
    keys, values, queries, cos, sin = make_prompt(seq_len=600)
    basis = random_orthonormal(64, 64)
    config = VarRateConfig(budget=budget, r_min=4)
    code = encode_prompt(keys, values, queries, cos, sin, basis, config, scaling=0.25)
    assert not code.stored_exactly
    assert code.nbytes() <= budget * code.full_nbytes() * 1.005  # within 0.5% of the budget
    assert code.nbytes() >= budget * code.full_nbytes() * 0.98
    assert code.ranks.min() >= 4 and code.ranks.max() <= 64
    exact = code.exact_pos
    k_hat, v_hat = decode_prompt(code, keys[:, :, exact], values[:, :, exact], cos, sin, basis)
    assert torch.equal(k_hat[:, :, exact], keys[:, :, exact]) and torch.equal(v_hat[:, :, exact], values[:, :, exact])


@pytest.mark.parametrize("coef_bits", [None, 3])
def test_byte_parts_name_every_tensor_the_code_holds(coef_bits):
    """`byte_parts` splits `nbytes` into what each tensor holds, counted here from the tensors themselves."""
    keys, values, queries, cos, sin = make_prompt(seq_len=600)
    config = VarRateConfig(budget=0.3, r_min=4, coef_bits=coef_bits, quantized_budget="same_bytes")
    code = encode_prompt(keys, values, queries, cos, sin, random_orthonormal(64, 64), config, scaling=0.25)
    parts = code.byte_parts()
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    coefs = code.coefs
    held = {"exact": code.exact_pos.numel() * 64 * 4, "anchor_indices": size(code.neighbours),
            "ranks": size(code.ranks),
            "codes": size(coefs.codes) if coef_bits else size(coefs),
            "scales": size(coefs.mins) + size(coefs.steps) if coef_bits else 0}
    assert parts == held and sum(parts.values()) == code.nbytes()
    cropped = code.byte_parts(limit=300)
    assert sum(cropped.values()) == code.nbytes(limit=300) and all(cropped[k] <= parts[k] for k in parts)
    assert cropped["ranks"] == int((code.coded_pos < 300).sum()) * code.ranks.element_size()


def test_prompt_in_the_basis_span_reconstructs_exactly():
    """Joint vectors living in the span of the basis's first 8 rows come back exactly at any rank >= 8."""
    g = torch.Generator().manual_seed(1)
    basis = random_orthonormal(64, 64, seed=1)
    z = (torch.randn(1, 500, 8, generator=g) @ basis[:8])  # [1, S, D] in an 8-dim subspace
    k_pre, values = split_kv(z, 2)
    cos, sin = rope_tables(500, 16)
    keys = rotate_keys(k_pre, cos, sin)
    queries = torch.randn(1, 4, 64, 16, generator=g)
    code = encode_prompt(keys, values, queries, cos, sin, basis, VarRateConfig(budget=0.5, r_min=8), 0.25)
    assert not code.stored_exactly and code.ranks.min() >= 8
    k_hat, v_hat = decode_prompt(code, keys[:, :, code.exact_pos], values[:, :, code.exact_pos], cos, sin, basis)
    assert torch.allclose(k_hat, keys, atol=1e-4) and torch.allclose(v_hat, values, atol=1e-4)


def test_infeasible_budget_stores_exactly():
    keys, values, queries, cos, sin = make_prompt(seq_len=200)
    code = encode_prompt(keys, values, queries, cos, sin, torch.eye(64), VarRateConfig(budget=0.2), 0.25)
    assert code.stored_exactly and code.nbytes() == code.full_nbytes()
    assert code.exact_pos.numel() == 200


def test_higher_rank_lower_error_in_the_full_prompt():
    keys, values, queries, cos, sin = make_prompt(seq_len=800)
    basis = random_orthonormal(64, 64)
    errs = []
    for budget in (0.3, 0.5, 0.7, 0.95):
        code = encode_prompt(keys, values, queries, cos, sin, basis, VarRateConfig(budget=budget, r_min=2), 0.25)
        k_hat, v_hat = decode_prompt(code, keys[:, :, code.exact_pos], values[:, :, code.exact_pos], cos, sin, basis)
        errs.append(float((k_hat - keys).norm() + (v_hat - values).norm()))
    assert errs == sorted(errs, reverse=True)


def test_salience_raises_rank_of_attended_tokens():
    keys, values, queries, cos, sin = make_prompt(seq_len=400, hq=4)
    target = 200  # make every window query attend strongly to token 200
    keys[:, :, target] = 0
    queries = keys[:, :, target : target + 1].repeat_interleave(2, dim=1).expand(1, 4, 64, 16).clone()
    keys[:, :, target] = torch.randn(16) * 5
    queries[:] = keys[0, 0, target] * 5
    basis = random_orthonormal(64, 64)
    code = encode_prompt(keys, values, queries, cos, sin, basis, VarRateConfig(budget=0.5, r_min=4), 0.25)
    where = (code.coded_pos == target).nonzero()[0, 0]
    assert code.ranks[where] == code.ranks.max()
    assert math.isclose(float(code.ranks.long().float().mean()), float(code.ranks.float().mean()))


def signal_inputs(coded, seq_len, **changes):
    """SignalInputs of a random 2-head prompt of `seq_len` tokens (queries, keys and residuals drawn)."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, seq_len, 8, generator=g)
    queries = torch.randn(1, 4, min(seq_len, 16), 8, generator=g)
    residuals = torch.randn(coded.numel(), 32, generator=g)
    fields = dict(queries=queries, keys=keys, scaling=8**-0.5, coded=coded, seq_len=seq_len, stride=16, window=64,
                  pool_kernel=5, seed=0, residuals=residuals)
    return SignalInputs(**{**fields, **changes})


def test_a_new_signal_is_one_registered_function():
    """The registry is the only place a signal lives: registering one makes it a valid config value and the
    codec allocates by it, with no other change."""
    @register_signal("late_tokens")
    def late_tokens(x):
        return minmax(x.coded.float())

    try:
        config = VarRateConfig(signal="late_tokens", budget=0.4, stride=8, window=8, r_min=2)
        g = torch.Generator().manual_seed(1)
        keys, values = torch.randn(1, 2, 200, 8, generator=g), torch.randn(1, 2, 200, 8, generator=g)
        cos, sin = torch.ones(1, 200, 8), torch.zeros(1, 200, 8)
        code = encode_prompt(keys, values, keys[:, :, -8:], cos, sin, torch.eye(32), config, 8**-0.5)
        ranks = code.ranks.long()
        assert ranks[-10:].float().mean() > ranks[:10].float().mean()  # rank follows the new signal
        with pytest.raises(ValueError, match="signal"):
            VarRateConfig(signal="no_such_signal")
    finally:
        SIGNALS.pop("late_tokens", None)


@pytest.mark.parametrize("signal", sorted(SIGNALS))
def test_every_registered_signal_scores_the_coded_tokens_in_0_1(signal):
    coded = (~exact_mask(300, 16, 64)).nonzero()[:, 0]
    s_hat = coded_salience(signal, signal_inputs(coded, 300))
    assert s_hat.shape == coded.shape and bool(torch.isfinite(s_hat).all())
    assert bool((s_hat >= 0).all() and (s_hat <= 1).all())

