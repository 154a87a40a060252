"""Tier (a): coefficient scales per component (`coef_scales="component"`, beyond the paper): each component's
values over `COMPONENT_TOKENS` consecutive coded tokens share an fp16 min and step, instead of each group of
`coef_group` coefficients of one token (the paper's App. A.4)."""

import pytest
import torch

from hf_varrate import VarRateConfig
from hf_varrate.codec import compress_prompt, decode_prompt, encode_prompt
from hf_varrate.codec.projection import dense_order
from hf_varrate.codec.codes import COMPONENT_TOKENS
from hf_varrate.codec.components import quantize_components
from hf_varrate.codec.quantization import dequantize, dequantize_dense, dequantize_runs, error_bound, quantize_dense

from test_codec import make_prompt, random_orthonormal
from test_quantization import realistic_prompt

COMPONENT = {"coef_scales": "component", "signal": "uniform", "quantized_budget": "same_bytes"}


def decaying(rows=300, width=51, seed=0):
    """Dense coefficients [rows, width] whose components shrink like a PCA spectrum's, and their uniform ranks:
    the first 37 tokens one wider (the water-fill's remainder), so the last column is partly padding."""
    g = torch.Generator().manual_seed(seed)
    coefs = torch.randn(rows, width, generator=g) * 10 * 0.9 ** torch.arange(width)
    ranks = torch.full((rows,), width - 1)
    ranks[:37] = width
    return coefs, ranks


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("rows", [1, COMPONENT_TOKENS, 300])
def test_component_scales_round_trip_within_half_a_step_in_every_layout(bits, rows):
    coefs, ranks = decaying(rows)
    ranks = ranks[:rows]
    plan = dense_order(ranks, 1)
    q = quantize_components(coefs.clone(), plan, bits)
    assert q.axis == "component" and q.count == int(ranks.sum())
    dense = dequantize_dense(q, plan)
    assert (dense[~plan.mask] == 0).all()  # the padding decodes to zero
    stream = plan.to_stream(coefs)
    assert torch.equal(dequantize(q, ranks), plan.to_stream(dense))
    assert torch.equal(dequantize_runs(q, plan), plan.to_stream(dense))
    bound = error_bound(q, ranks)
    assert ((plan.to_stream(dense) - stream).abs() <= bound * (1 + 1e-5) + 1e-6 * stream.abs()).all()
    assert q.nbytes() == q.nbytes_for(ranks)
    groups = -(-rows // COMPONENT_TOKENS) * int(ranks.max())
    assert q.mins.numel() == q.steps.numel() == groups


@pytest.mark.parametrize("ranks_kind", ["uniform", "ragged"])
def test_component_ranges_cover_exactly_the_entries_within_rank(ranks_kind):
    """Each (group of 64 tokens, component)'s min and step come from its tokens' entries within their ranks and
    nothing else: not the padding past a rank, nor the rows a short last group lacks (values here are all above
    2, so a zero let in would move a min). Checked against a brute-force range per group and component."""
    g = torch.Generator().manual_seed(3)
    rows, width, bits = 300, 40, 3  # 4 whole groups of 64 tokens and one of 44
    coefs = 2 + 5 * torch.rand(rows, width, generator=g)
    ranks = torch.randint(1, width + 1, (rows,), generator=g) if ranks_kind == "ragged" else torch.full((rows,), 39)
    if ranks_kind == "uniform":
        ranks[:37] = width
    ranks[256:] = ranks[256:].clamp(max=width - 3)  # the short group lacks the last components altogether
    plan = dense_order(ranks, 1, slack=float("inf"))  # as the codec plans per-component scales
    q = quantize_components(coefs.clone(), plan, bits)
    mins, steps = q.mins.float().view(-1, width), q.steps.float().view(-1, width)
    for t, first in enumerate(range(0, rows, COMPONENT_TOKENS)):
        block, kept = coefs[first:first + COMPONENT_TOKENS], plan.mask[first:first + COMPONENT_TOKENS]
        for j in range(width):
            entries = block[kept[:, j], j]
            if not entries.numel():
                assert mins[t, j] == 0 and steps[t, j] == 0
                continue
            lo, hi = entries.min(), entries.max()
            assert mins[t, j] <= lo and torch.tensor(float(mins[t, j])).half().float() == mins[t, j]
            assert lo - mins[t, j] <= lo * 2**-10  # the fp16 just below the range's min
            assert mins[t, j] + steps[t, j] * (2**bits - 1) >= hi
            assert steps[t, j] * (2**bits - 1) <= (hi - mins[t, j]) * (1 + 2**-9) + 1e-6


def test_a_scale_per_component_keeps_small_components_precise_for_fewer_bytes():
    """The mechanism: per token, a group's step follows its largest (leading) coefficient, so the trailing ones
    round to nearly nothing; per component each gets a step of its own size, and the scales cost less. (The
    leading components pay for it: a range over 64 tokens is wider than one over a token's 32 coefficients.
    Whether the sum falls depends on the spectrum: tests below and studies.coefficient_bits measure it.)"""
    coefs, ranks = decaying()
    plan = dense_order(ranks, 32, slack=float("inf"))  # width 64: two groups of 32 per token
    wide = torch.cat((coefs, coefs.new_zeros(coefs.shape[0], plan.width - coefs.shape[1])), dim=1)
    token = dequantize_dense(quantize_dense(wide.clone(), plan, 3), plan)[:, :51]
    plan1 = dense_order(ranks, 1)
    component = dequantize_dense(quantize_components(coefs.clone(), plan1, 3), plan1)
    mask = plan1.mask
    tail = mask.clone()  # the second half of each per-token group, whose step its first components set
    tail[:, :16] = tail[:, 32:48] = False
    err = lambda decoded, where: float((decoded - coefs)[where].square().sum())  # noqa: E731
    assert err(component, tail) < 0.2 * err(token, tail)
    assert quantize_components(coefs.clone(), plan1, 3).nbytes() < quantize_dense(wide.clone(), plan, 3).nbytes()


@pytest.mark.parametrize("budget", [0.1, 0.2])
def test_component_scales_meet_the_budget_and_buy_rank(budget):
    (keys, values, queries, cos, sin), basis = realistic_prompt()
    codes = {}
    for scales in ("token", "component"):
        config = VarRateConfig(budget=budget, coef_bits=3, window=16, **{**COMPONENT, "coef_scales": scales})
        codes[scales] = encode_prompt(keys, values, queries, cos, sin, basis, config, 0.125)
    code = codes["component"]
    assert code.coefs.axis == "component" and codes["token"].coefs.axis == "token"
    assert code.nbytes() <= budget * code.full_nbytes()
    assert code.nbytes() >= budget * code.full_nbytes() * 0.98
    assert int(code.ranks.max()) - int(code.ranks.min()) <= 1  # uniform ranks: the grid is as wide as a rank
    assert code.ranks.long().sum() > 1.15 * codes["token"].ranks.long().sum()


def test_component_tokens_size_the_scale_groups_and_meet_the_budget():
    """component_tokens=256 shares each component's min and step over 256 coded tokens: a quarter of the scale
    rows of 64, spent on rank within the same budget, and decoded as the encoder reconstructed."""
    (keys, values, queries, cos, sin), basis = realistic_prompt()
    codes = {}
    for tokens in (64, 256):
        config = VarRateConfig(budget=0.2, coef_bits=4, window=16, component_tokens=tokens, **COMPONENT)
        codes[tokens] = compress_prompt(keys, values, queries, cos, sin, basis, config, 0.125)
    for tokens, (code, k_hat, v_hat) in codes.items():
        coded, width = code.ranks.numel(), int(code.ranks.max())
        assert code.coefs.group == tokens and code.coefs.mins.numel() == -(-coded // tokens) * width
        assert 0.98 * 0.2 * code.full_nbytes() <= code.nbytes() <= 0.2 * code.full_nbytes()
        exact = code.exact_pos
        decoded = decode_prompt(code, keys[:, :, exact], values[:, :, exact], cos, sin, basis)
        assert torch.equal(decoded[0], k_hat) and torch.equal(decoded[1], v_hat)
    assert codes[256][0].ranks.long().sum() > codes[64][0].ranks.long().sum()
    assert VarRateConfig().component_tokens == COMPONENT_TOKENS  # the codec's default is the config's (the codec
    # imports no config, so the two literals are held together here)


@pytest.mark.parametrize("seq_len", [700, 2000])
def test_decoding_reproduces_the_encoders_reconstruction(seq_len):
    keys, values, queries, cos, sin = make_prompt(seq_len=seq_len, heads=2, dim=16)
    basis = random_orthonormal(64, 64)
    config = VarRateConfig(budget=0.3, coef_bits=3, **COMPONENT)
    code, k_hat, v_hat = compress_prompt(keys, values, queries, cos, sin, basis, config, 0.25)
    exact = code.exact_pos
    k_dec, v_dec = decode_prompt(code, keys[:, :, exact], values[:, :, exact], cos, sin, basis)
    assert torch.equal(k_dec, k_hat) and torch.equal(v_dec, v_hat)
    assert torch.equal(k_dec[:, :, exact], keys[:, :, exact]) and torch.equal(v_dec[:, :, exact], values[:, :, exact])
    assert code.nbytes() <= 0.3 * code.full_nbytes()


def varying_ranks(rows, width, seed):
    """Ranks in [1, width] that vary token to token, with runs of equal ranks across group boundaries."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.randint(1, width + 1, (rows,), generator=g)
    ranks[rows // 3: rows // 2] = width // 2
    return ranks


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("rows", [1, COMPONENT_TOKENS, 300])
def test_rank_axis_round_trips_within_half_a_step_in_a_ragged_grid(bits, rows):
    """Axis "rank" (varying ranks): the tokens grouped by decreasing rank, each group's scales as wide as its
    widest token. Every value decodes within half its own step, the padding to zero, and the grid holds no more
    entries than the budget's allowance for per-component scales (sum(ranks) / T + the widest rank)."""
    coefs, _ = decaying(rows)
    ranks = varying_ranks(rows, coefs.shape[1], seed=rows + bits)
    plan = dense_order(ranks, 1, slack=float("inf"))
    coefs = coefs[:, :plan.width]  # the layout's width: the widest rank
    q = quantize_components(coefs.clone(), plan, bits, axis="rank")
    assert q.axis == "rank" and q.count == int(ranks.sum())
    dense = dequantize_dense(q, plan)
    assert (dense[~plan.mask] == 0).all()
    stream = plan.to_stream(coefs)
    assert torch.equal(dequantize(q, ranks), plan.to_stream(dense))
    bound = error_bound(q, ranks)
    assert ((plan.to_stream(dense) - stream).abs() <= bound * (1 + 1e-5) + 1e-6 * stream.abs()).all()
    sorted_ranks = ranks.sort(descending=True).values
    assert q.mins.numel() == q.steps.numel() == int(sorted_ranks[::COMPONENT_TOKENS].sum())
    assert q.mins.numel() <= ranks.sum() / COMPONENT_TOKENS + ranks.max()
    assert q.nbytes() == q.nbytes_for(ranks)
    if rows > COMPONENT_TOKENS:  # the ragged grid is smaller than axis "component"'s full one
        assert q.mins.numel() < quantize_components(coefs.clone(), plan, bits).mins.numel()


def test_rank_axis_scales_are_the_ranges_of_the_rank_sorted_groups():
    """Each scale of axis "rank" is the range of one component over one group of the rank order, checked against
    a brute-force sort: tokens sorted by decreasing rank (ties in their order), cut into groups of 64."""
    g = torch.Generator().manual_seed(11)
    rows, width, bits = 300, 40, 3
    coefs = 2 + 5 * torch.rand(rows, width, generator=g)  # all above 2: a zero let in would move a min
    ranks = varying_ranks(rows, width, seed=4)
    plan = dense_order(ranks, 1, slack=float("inf"))
    q = quantize_components(coefs.clone(), plan, bits, axis="rank")
    order = sorted(range(rows), key=lambda t: (-int(ranks[t]), t))
    entry = 0
    for first in range(0, rows, COMPONENT_TOKENS):
        members = order[first:first + COMPONENT_TOKENS]
        for j in range(int(ranks[members[0]])):
            values = torch.stack([coefs[t, j] for t in members if ranks[t] > j])
            lo, hi = float(values.min()), float(values.max())
            low, step = float(q.mins[entry]), float(q.steps[entry])
            assert low <= lo and lo - low <= lo * 2**-10 and low + step * (2**bits - 1) >= hi
            entry += 1
    assert entry == q.mins.numel()


def test_rank_axis_equals_component_axis_where_ranks_never_rise():
    """Ranks that never rise are already in rank order: axis "rank" then keeps axis "component"'s codes, and its
    scales are the component grid's entries within each group's widest rank (the others, absent, are dropped)."""
    coefs, _ = decaying(300)
    ranks = torch.linspace(51, 5, 300).round().long()
    plan = dense_order(ranks, 1, slack=float("inf"))
    by_rank = quantize_components(coefs.clone(), plan, 3, axis="rank")
    by_component = quantize_components(coefs.clone(), plan, 3)
    assert torch.equal(by_rank.codes, by_component.codes)
    present = plan.mask[::COMPONENT_TOKENS]
    assert torch.equal(by_rank.mins, by_component.mins.view(-1, plan.width)[present])
    assert torch.equal(by_rank.steps, by_component.steps.view(-1, plan.width)[present])


@pytest.mark.parametrize("budget", [0.1, 0.2])
@pytest.mark.parametrize("varying", [{"allocation": "distortion"}, {"signal": "snapkv"}, {"signal": "key_norm"},
                                     {"signal": "residual"}])
def test_varying_ranks_with_component_scales_meet_the_budget_and_decode_as_encoded(budget, varying):
    """Ranks that vary (allocation='distortion', or a salience signal water-filled) with coef_scales='component':
    scales on axis "rank", the bytes within the budget (and near it), and the decoder reproducing the encoder's
    reconstruction bit for bit."""
    (keys, values, queries, cos, sin), basis = realistic_prompt()
    keys[:, :, ::5] *= 4  # tokens of different scale, so the ranks do vary
    config = VarRateConfig(budget=budget, coef_bits=3, window=16, **{**COMPONENT, **varying})
    code, k_hat, v_hat = compress_prompt(keys, values, queries, cos, sin, basis, config, 0.125)
    assert code.coefs.axis == "rank" and int(code.ranks.max()) - int(code.ranks.min()) > 1
    assert 0.97 * budget * code.full_nbytes() <= code.nbytes() <= budget * code.full_nbytes()
    exact = code.exact_pos
    k_dec, v_dec = decode_prompt(code, keys[:, :, exact], values[:, :, exact], cos, sin, basis)
    assert torch.equal(k_dec, k_hat) and torch.equal(v_dec, v_hat)


def test_uniform_ranks_keep_the_component_axis():
    """A flat water-fill (signal='uniform') keeps axis "component": its ranks differ by the remainder's one, and
    grouping consecutive tokens is what the shipped presets were tuned with."""
    (keys, values, queries, cos, sin), basis = realistic_prompt()
    config = VarRateConfig(budget=0.2, coef_bits=3, window=16, **COMPONENT)
    code, _, _ = compress_prompt(keys, values, queries, cos, sin, basis, config, 0.125)
    assert code.coefs.axis == "component" and int(code.ranks.max()) - int(code.ranks.min()) <= 1


@pytest.mark.parametrize("field,value", [("coef_bits", None), ("allocation", "topk"),
                                         ("quantized_budget", "same_ranks")])
def test_component_scales_name_what_they_need(field, value):
    settings = {"coef_bits": 3, **COMPONENT, field: value}
    with pytest.raises(ValueError, match=f"coef_scales='component' needs {field}="):
        VarRateConfig(**settings)


def test_unknown_scales_and_the_reference_implementation_are_refused():
    with pytest.raises(ValueError, match="coef_scales must be one of"):
        VarRateConfig(coef_scales="channel")
    with pytest.raises(ValueError, match="implementation='reference'.*coef_scales"):
        VarRateConfig(coef_bits=3, implementation="reference", **COMPONENT)


def test_a_saved_cache_with_an_unknown_scale_axis_is_refused_naming_the_field(tiny_llama, tmp_path):
    import json

    from hf_varrate import Bases, VarRateCache
    from hf_varrate.cache_checks import CONFIG_NAME, seal
    from hf_varrate.errors import CacheFileError

    from test_cache import SMALL

    cache = VarRateCache(Bases.identity(tiny_llama.config), model=tiny_llama, budget=0.4, coef_bits=3,
                         **{**SMALL, **COMPONENT})
    with torch.no_grad():
        tiny_llama(torch.randint(2, 128, (1, 300), generator=torch.Generator().manual_seed(0)), past_key_values=cache)
    cache.compress()
    cache.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
    text = json.dumps(meta)
    assert '"axis": "component"' in text
    (tmp_path / CONFIG_NAME).write_text(json.dumps(seal(json.loads(text.replace('"axis": "component"',
                                                                                  '"axis": "diagonal"')))))
    with pytest.raises(CacheFileError, match="quantized.axis"):
        VarRateCache.load(tmp_path, model=tiny_llama)


@pytest.mark.parametrize("storage", ["materialized", "compact"])
def test_later_turns_are_coded_with_component_scales_too(tiny_llama, storage):
    from test_turns import chat, make_cache

    cache = make_cache(tiny_llama, storage=storage, coef_bits=3, **COMPONENT)
    chat(tiny_llama, cache)
    layer = cache.layers[0]
    codes = [layer.codes[0], *(code for turn in layer.turns for code in turn.codes)]
    assert len(codes) == 3 and all(c.coefs.axis == "component" for c in codes)
    assert not any(c.stored_exactly for c in codes)
    assert abs(cache.footprint().prompt_fraction - 0.3) < 0.05
