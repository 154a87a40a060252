"""Property-based tests (hypothesis) of the codec on random tensors: no model.

For random lengths, budgets, strides, windows, ranks and salience vectors (constant, spiky, all
zero, ties, NaN) the allocation meets its total within the floor and the cap, exact tokens come back
bit for bit, a token's reconstruction error never grows with its rank, and nothing raises except
the documented ValueError for an infeasible total. Examples are few and the deadline is off (the
CI machine is shared); raise HF_VARRATE_EXAMPLES for a longer hunt.
"""

import dataclasses
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from hf_varrate import VarRateConfig
from hf_varrate.codec import (
    SIGNALS, SignalInputs, coded_salience, compress_prompt, decode_prompt, encode_prompt, exact_mask, minmax, pack,
    pool_scores, snapkv_scores, topk_ranks, unpack, waterfill_ranks,
)

EXAMPLES = int(os.environ.get("HF_VARRATE_EXAMPLES", "40"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEADS, DIM = 2, 8  # D = 2 * H * d = 32: small enough for many examples per second
WIDTH = 2 * HEADS * DIM


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# --- strategies ---------------------------------------------------------------------------------------
@st.composite
def salience_vectors(draw, max_len=200):
    """[C] salience of one of the shapes that trip allocators up."""
    count = draw(st.integers(0, max_len))
    kind = draw(st.sampled_from(["random", "constant", "zero", "spiky", "ties", "nan"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    s = torch.rand(count, generator=g)
    if kind == "constant":
        s = torch.full((count,), draw(st.floats(0, 1)))
    elif kind == "zero":
        s = torch.zeros(count)
    elif kind == "spiky":
        s = torch.zeros(count)
        s[torch.randperm(count, generator=g)[: max(count // 20, 1)]] = 1.0
    elif kind == "ties":
        s = torch.randint(0, 3, (count,), generator=g).float() / 2
    elif kind == "nan" and count:
        s[torch.rand(count, generator=g) < 0.3] = float("nan")
    return s


@st.composite
def allocation_problems(draw):
    s = draw(salience_vectors())
    r_min = draw(st.integers(0, 16))
    r_max = draw(st.integers(r_min, 64))
    total = draw(st.integers(s.numel() * r_min, s.numel() * r_max))
    return s, total, r_min, r_max


def random_orthonormal(rank, width, seed):
    q, _ = torch.linalg.qr(torch.randn(width, width, generator=torch.Generator().manual_seed(seed)))
    return q[:rank].contiguous()


def rope_tables(seq_len, dim, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
    emb = torch.outer(torch.arange(seq_len).float(), inv).repeat(1, 2)
    return emb.cos()[None], emb.sin()[None]  # [1, S, d]


@st.composite
def prompts(draw):
    """(keys, values, queries, cos, sin, basis, config) for one random prompt and codec setting."""
    seq_len = draw(st.integers(1, 240))
    rank = draw(st.integers(1, WIDTH))
    config = VarRateConfig(
        budget=draw(st.floats(0.01, 1.0)),
        r_min=draw(st.integers(0, min(rank, 8))),
        rank=rank,
        stride=draw(st.integers(1, 24)),
        window=draw(st.integers(1, 48)),
        obs_window=draw(st.integers(1, 48)),
        n_anchors=draw(st.integers(1, 6)),
        pool_kernel=draw(st.sampled_from([1, 3, 5, 7])),
        signal=draw(st.sampled_from(["snapkv", "uniform", "random", "shuffle", "position"])),
        allocation=draw(st.sampled_from(["waterfill", "topk"])),
        coef_bits=draw(st.sampled_from([None, None, 4, 8])),
        quantized_budget=draw(st.sampled_from(["same_ranks", "same_bytes"])),
        implementation=draw(st.sampled_from(["fast", "reference"])),
        distance_chunk=draw(st.integers(1, 64)),
    )
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    keys = torch.randn(1, HEADS, seq_len, DIM, generator=g) * scale
    values = torch.randn(1, HEADS, seq_len, DIM, generator=g) * scale
    if draw(st.booleans()):  # repeated tokens: ties in every distance and score
        keys[:, :, ::2], values[:, :, ::2] = keys[:, :, :1].clone(), values[:, :, :1].clone()
    queries = torch.randn(1, 2 * HEADS, min(config.obs_window, seq_len), DIM, generator=g)
    cos, sin = rope_tables(seq_len, DIM)
    basis = random_orthonormal(rank, WIDTH, seed)
    return keys, values, queries, cos, sin, basis, config


# --- allocation ---------------------------------------------------------------------------------------
@SETTINGS
@given(allocation_problems())
def test_waterfill_meets_the_total_within_floor_and_cap_and_follows_salience(problem):
    s, total, r_min, r_max = problem
    ranks = waterfill_ranks(s, total, r_min, r_max)
    assert ranks.shape == s.shape and ranks.dtype == torch.long
    assert int(ranks.sum()) == total
    if s.numel():
        assert int(ranks.min()) >= r_min and int(ranks.max()) <= r_max
    clean = torch.nan_to_num(s, nan=0.0)  # NaN counts as zero salience
    order = torch.argsort(clean, stable=True)
    assert bool((ranks[order].diff() >= 0).all()) or _ties_only(clean[order], ranks[order])
    for value in clean.unique():  # equal salience, equal rank up to the one unit rounding hands out
        same = ranks[clean == value]
        assert int(same.max() - same.min()) <= 1


def _ties_only(s_sorted, r_sorted):
    """Rank may drop along increasing salience only between tokens of equal salience."""
    drops = (r_sorted.diff() < 0).nonzero()[:, 0]
    return bool((s_sorted[drops] == s_sorted[drops + 1]).all())


@SETTINGS
@given(allocation_problems())
def test_constant_salience_gives_the_flat_codec(problem):
    s, total, r_min, r_max = problem
    ranks = waterfill_ranks(torch.full_like(s, 0.7), total, r_min, r_max)
    if s.numel():
        assert int(ranks.max() - ranks.min()) <= 1 and int(ranks.sum()) == total


@SETTINGS
@given(allocation_problems())
def test_topk_is_a_binary_split_meeting_the_total(problem):
    s, total, r_min, r_max = problem
    ranks = topk_ranks(s, total, r_min, r_max)
    assert int(ranks.sum()) == total
    if s.numel():
        assert int(ranks.min()) >= r_min and int(ranks.max()) <= r_max
        assert int(((ranks > r_min) & (ranks < r_max)).sum()) <= 1  # at most one token in between


@SETTINGS
@given(salience_vectors(max_len=50), st.integers(0, 16), st.integers(0, 64), st.integers(1, 100))
def test_an_infeasible_total_is_the_documented_value_error(s, r_min, r_max, excess):
    assume(s.numel() > 0)
    for allocate in (waterfill_ranks, topk_ranks):
        if r_min > r_max:
            with pytest.raises(ValueError, match=f"r_min must be <= the rank cap R, got r_min={r_min}"):
                allocate(s, s.numel() * r_min, r_min, r_max)
            continue
        for total in (s.numel() * r_min - excess, s.numel() * r_max + excess):
            with pytest.raises(ValueError, match=r"total rank must be in \["):
                allocate(s, total, r_min, r_max)


# --- salience -----------------------------------------------------------------------------------------
@SETTINGS
@given(st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32)), max_size=100))
@example([3.4028234663852886e38, -1.0141204801825835e31])  # found by hypothesis: the span overflowed fp32
def test_minmax_is_always_finite_and_in_0_1(values):
    out = minmax(torch.tensor(values, dtype=torch.float32))
    assert out.shape == (len(values),) and bool(torch.isfinite(out).all())
    assert bool((out >= 0).all() and (out <= 1).all())


@SETTINGS
@given(st.integers(1, 200), st.integers(1, 64), st.sampled_from([1, 3, 5, 9]), st.integers(0, 2**16),
       st.sampled_from([torch.float32, torch.bfloat16]))
def test_snapkv_scores_are_a_finite_distribution_over_the_prompt(seq_len, window, kernel, seed, dtype):
    window = min(window, seq_len)
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(1, 2 * HEADS, window, DIM, generator=g).to(dtype)
    keys = torch.randn(1, HEADS, seq_len, DIM, generator=g).to(dtype)
    raw = snapkv_scores(queries, keys, DIM**-0.5, 1)
    assert raw.shape == (seq_len,) and raw.dtype == dtype and bool(torch.isfinite(raw).all())
    assert math.isclose(float(raw.float().sum()), 1.0, rel_tol=0.02)  # every query's weights sum to one
    pooled = pool_scores(raw, kernel)
    assert pooled.shape == (seq_len,) and bool((pooled >= 0).all())


@SETTINGS
@given(st.sampled_from(sorted(SIGNALS)), salience_vectors(), st.integers(1, 32), st.integers(1, 64),
       st.integers(0, 100))
def test_coded_salience_is_finite_in_0_1_for_every_signal(signal, scale, stride, window, seed):
    """Every registered signal, on keys and residuals whose per-token magnitude is one of the shapes that
    trip allocators up (constant, zero, spiky, tied, NaN)."""
    seq_len = scale.numel()
    coded = (~exact_mask(seq_len, stride, window)).nonzero()[:, 0]
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, HEADS, seq_len, DIM, generator=g) * scale[None, None, :, None]
    queries = torch.randn(1, 2 * HEADS, min(seq_len, 8), DIM, generator=g)
    residuals = torch.randn(coded.numel(), 2 * HEADS * DIM, generator=g) * scale[coded, None]
    inputs = SignalInputs(queries, keys, DIM**-0.5, coded, seq_len, stride, window, 5, seed, residuals)
    s_hat = coded_salience(signal, inputs)
    assert s_hat.shape == coded.shape and bool(torch.isfinite(s_hat).all())
    assert bool((s_hat >= 0).all() and (s_hat <= 1).all())


# --- the whole prompt ---------------------------------------------------------------------------------
@SETTINGS
@given(prompts())
def test_encode_decode_keeps_exact_tokens_and_respects_floor_cap_and_budget(prompt):
    keys, values, queries, cos, sin, basis, config = prompt
    seq_len = keys.shape[2]
    code, k_hat, v_hat = compress_prompt(keys, values, queries, cos, sin, basis, config, DIM**-0.5)
    exact = code.exact_pos
    mask = exact_mask(seq_len, config.stride, config.window)
    if code.stored_exactly:
        assert exact.tolist() == list(range(seq_len)) and code.nbytes() == code.full_nbytes()
        return
    assert exact.tolist() == mask.nonzero()[:, 0].tolist()
    ranks = code.ranks.long()
    assert ranks.numel() == seq_len - exact.numel()
    assert int(ranks.min()) >= config.r_min and int(ranks.max()) <= basis.shape[0]
    assert code.nbytes() <= config.budget * code.full_nbytes() * 1.005  # Eq. 3, side information included
    out = decode_prompt(code, keys[:, :, exact], values[:, :, exact], cos, sin, basis,
                        implementation=config.implementation)
    assert torch.equal(out[0][:, :, exact], keys[:, :, exact]) and torch.equal(out[1][:, :, exact], values[:, :, exact])
    assert torch.equal(out[0], k_hat) and torch.equal(out[1], v_hat)  # one pass == encode then decode
    assert bool(torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all())


@pytest.mark.parametrize("seed", range(3))
def test_same_rank_quantized_codes_at_rank_one_stay_within_the_budget(seed):
    """Found by the property test above on CI: with quantized_budget='same_ranks' and ranks of 1, a token's
    4-bit value plus its group's fp16 min and step (4.5 bytes) cost more than one fp32 coefficient (4 bytes),
    and the code overshot its budget (748 bytes for 740)."""
    seq_len = 37
    config = VarRateConfig(budget=0.15625, r_min=0, rank=1, stride=9, window=1, obs_window=1, n_anchors=1,
                           pool_kernel=1, coef_bits=4, quantized_budget="same_ranks")
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(2, 1, HEADS, seq_len, DIM, generator=g)
    queries = torch.randn(1, 2 * HEADS, 1, DIM, generator=g)
    code, _, _ = compress_prompt(keys, values, queries, *rope_tables(seq_len, DIM), random_orthonormal(1, WIDTH, seed),
                                 config, DIM**-0.5)
    assert not code.stored_exactly and int(code.ranks.max()) == 1
    assert code.nbytes() <= config.budget * code.full_nbytes()


@pytest.mark.parametrize("kv_bytes, bits", [(4, 4), (2, 4), (2, 8), (4, 3)])
def test_same_rank_quantization_reserves_nothing_at_the_usual_rank_floor(kv_bytes, bits):
    """At r_min = 16 every quantized token saves more than the packing pad: the paper's same-ranks budget
    (App. A.4) is unchanged; only a floor of 0-2 makes the budget reserve bytes."""
    from hf_varrate.codec.budget import same_ranks_overshoot

    usual = VarRateConfig(coef_bits=bits, quantized_budget="same_ranks")
    assert same_ranks_overshoot(usual, 500, kv_bytes, 4, 384) == 0.0
    assert same_ranks_overshoot(usual.replace(r_min=0), 500, kv_bytes, 4, 384) > 0


@SETTINGS
@given(prompts(), st.integers(1, 64))
def test_a_tokens_reconstruction_error_never_grows_with_its_rank(prompt, cut):
    """Drop `cut` trailing coefficients from every coded token (same anchors): no token gets closer."""
    keys, values, queries, cos, sin, basis, config = prompt
    config = config.replace(coef_bits=None)  # quantization noise is not monotone in rank
    code = encode_prompt(keys, values, queries, cos, sin, basis, config, DIM**-0.5)
    assume(not code.stored_exactly and code.ranks.numel() > 0)
    ranks = code.ranks.long()
    lower = (ranks - cut).clamp(min=0)
    coefs = unpack(code.coefs, ranks, basis.shape[0])  # [C, R], zeros past each rank
    truncated = dataclasses.replace(code, ranks=lower.to(code.ranks.dtype), coefs=pack(coefs, lower, code.coefs.dtype))
    exact, coded = code.exact_pos, code.coded_pos
    errors = []
    for c in (code, truncated):
        k_hat, v_hat = decode_prompt(c, keys[:, :, exact], values[:, :, exact], cos, sin, basis)
        err = (k_hat - keys).square().sum(dim=(0, 1, 3)) + (v_hat - values).square().sum(dim=(0, 1, 3))  # [S]
        errors.append(err[coded])
    full, fewer = errors
    scale = (keys.square().sum(dim=(0, 1, 3)) + values.square().sum(dim=(0, 1, 3)))[coded]
    assert bool((full <= fewer + 1e-4 * scale + 1e-6).all())
