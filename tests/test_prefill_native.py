"""The prefill's C loops (`hf_varrate.codec.native`: joint rows, nearest anchors, anchor means, 2- to 4-bit
quantization with scales per token or per component) give the PyTorch path's results bit for bit, the nearest
anchors included where distances tie, and a whole prompt's code is the same with or without them."""

import pytest
import torch

from hf_varrate import VarRateConfig
from hf_varrate.codec import compress_prompt, gather_means, joint_rows, native, ops
from hf_varrate.codec.projection import dense_order
from hf_varrate.codec.components import quantize_components
from hf_varrate.codec.quantization import quantize, quantize_dense

from test_codec import make_prompt, random_orthonormal

needs_native = pytest.mark.skipif(not native.available(), reason="the C loops could not be built here (no compiler?)")


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({4: torch.int32, 2: torch.int16, 1: torch.uint8, 8: torch.int64}[tensor.element_size()])


@needs_native
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_joint_rows_equal_pytorch_bit_for_bit(scaled, strided):
    keys, values, _, cos, sin = make_prompt(seq_len=300, heads=3, dim=16)
    keys = keys * 3.0 + 0.5
    if strided:  # [1, S, H, d] storage seen as [1, H, S, d], as a model's transposed projections may hand it over
        keys, values = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (keys, values))
    positions = torch.randperm(300, generator=torch.Generator().manual_seed(1))[:200]
    scales = torch.rand(96, generator=torch.Generator().manual_seed(2)) + 0.5 if scaled else None
    want = joint_rows(keys, values, cos, sin, positions)
    want = want if scales is None else want.mul_(scales)
    got = native.joint_rows(keys, values, cos, sin, positions, scales)
    assert torch.equal(_bits(got), _bits(want))


@needs_native
@pytest.mark.parametrize("columns", [5, 16, 127, 300])
@pytest.mark.parametrize("k", [1, 4, 5])
def test_smallest_columns_equal_topk_ties_included(columns, k):
    if k > columns:
        pytest.skip("k above the columns")
    g = torch.Generator().manual_seed(columns + k)
    scores = torch.randn(400, columns, generator=g)
    scores[:100] = scores[:100].round()  # many exactly equal values: rows torch.topk orders its own way
    scores[100:120, 1:] = scores[100:120, :1]  # whole rows of one value
    scores[120, 3 % columns] = float("nan")
    scores[121] = float("inf")
    want = scores.topk(k, dim=-1, largest=False).indices
    assert torch.equal(native.smallest_columns(scores, k), want)
    index, ties = ops.smallest_columns_loop(scores, k)
    assert ties[100:122].all() and not ties[200:].any()  # distinct values: decided without topk
    assert torch.equal(index[~ties], want[~ties])


@needs_native
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("keep", [False, True])
def test_subtract_means_equals_gather_means_then_sub(k, keep):
    g = torch.Generator().manual_seed(k)
    z, anchors = torch.randn(500, 48, generator=g) * 5, torch.randn(30, 48, generator=g) * 5
    neighbours = torch.randint(30, (500, k), generator=g)
    want_means = gather_means(anchors, neighbours.to(torch.uint8))
    want = z - want_means
    means = native.subtract_means(z, anchors, neighbours, keep)
    assert torch.equal(_bits(z), _bits(want))
    assert torch.equal(_bits(means), _bits(want_means)) if keep else means.numel() == 0


def _dense(ranks, group, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    layout = dense_order(torch.tensor(ranks), group, slack=8.0)  # any padding: the loops must handle it
    coefs = (torch.randn(len(ranks), layout.width, generator=g) * torch.linspace(8, 0.1, layout.width)).to(dtype)
    coefs[1, :group] = 0.25  # a constant group (step 0)
    return layout, coefs


@needs_native
@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 8])
@pytest.mark.parametrize("ranks", [[40] * 7 + [39] * 13, [5] * 3, [33] * 4 + [30] * 3 + [17], [64] * 9])
def test_quantize_dense_through_the_c_loops_equals_pytorch_bit_for_bit(ranks, group, dtype, bits, monkeypatch):
    layout, coefs = _dense(ranks, group, dtype)
    assert layout is not None and layout.runs is not None
    loop, calls = native.quantize_runs, []
    monkeypatch.setattr(native, "quantize_runs", lambda *args: calls.append(args) or loop(*args))
    got = quantize_dense(coefs.clone(), layout, bits)
    assert len(calls) == 1  # through the C loop
    with native.disabled():
        want = quantize_dense(coefs.clone(), layout, bits)
        stream = quantize(layout.to_stream(coefs.float()), layout.ranks, bits, group)
    for a, b in ((got, want), (got, stream)):
        assert (a.count, a.bits, a.group) == (b.count, b.bits, b.group)
        for x, y in zip(a.tensors(), b.tensors()):
            assert x.dtype == y.dtype and torch.equal(_bits(x), _bits(y))


@needs_native
@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [64, 16, 5])
@pytest.mark.parametrize("ranks", [[40] * 7 + [39] * 13, [5] * 3, [33] * 40 + [30] * 30 + [17], [64] * 9])
def test_quantize_components_through_the_c_loops_equals_pytorch_bit_for_bit(ranks, tokens, dtype, bits, monkeypatch):
    """Scales per component over `tokens` tokens, runs of ranks that change inside a group of tokens, a
    component no token of a group has, and a constant one (step 0): the same codes, mins and steps."""
    layout, coefs = _dense(ranks, 8, dtype)
    coefs[:, 2] = 0.5  # a constant component
    loop, calls = native.quantize_component_runs, []
    monkeypatch.setattr(native, "quantize_component_runs", lambda *args: calls.append(args) or loop(*args))
    got = quantize_components(coefs.clone(), layout, bits, tokens)
    assert len(calls) == 1  # through the C loops
    with native.disabled():
        want = quantize_components(coefs.clone(), layout, bits, tokens)
    assert (got.count, got.bits, got.group, got.axis) == (want.count, want.bits, want.group, "component")
    for x, y in zip(got.tensors(), want.tensors()):
        assert x.dtype == y.dtype and torch.equal(_bits(x), _bits(y))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_range_loops_propagate_nan_as_amin_and_amax_do(dtype):
    """A NaN anywhere in a group (not only first) makes its range NaN, as torch's amin / amax do; the other groups
    keep theirs. (The cache refuses non-finite K/V before coding; this is the ops' own contract.)"""
    ranks = [12] * 3 + [9] * 2
    layout, coefs = _dense(ranks, 8, dtype)
    coefs[3, 5] = coefs[2, 1] = float("nan")  # not a group's first value: row 3, group 0; token 2 of its pair
    values = coefs.float()
    lo, hi = native.group_ranges(coefs, layout.runs, 8)
    want_lo, want_hi = [], []
    for row, rank in enumerate(ranks):
        for j0 in range(0, rank, 8):
            group = values[row, j0 : min(j0 + 8, rank)]
            want_lo.append(group.amin())
            want_hi.append(group.amax())
    torch.testing.assert_close(lo, torch.stack(want_lo), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(hi, torch.stack(want_hi), rtol=0, atol=0, equal_nan=True)
    assert lo.isnan().sum() == 2 and hi.isnan().sum() == 2
    width = max(ranks)
    lo, hi = native.component_ranges(coefs, layout.runs, 2, width)
    for t in range(lo.shape[0]):
        for j in range(width):
            have = [row for row in range(2 * t, min(2 * t + 2, len(ranks))) if ranks[row] > j]
            column = values[have, j] if have else torch.zeros(1)
            want = (column.amin(), column.amax()) if have else (column[0], column[0])
            torch.testing.assert_close(torch.stack([lo[t, j], hi[t, j]]), torch.stack(want), rtol=0, atol=0,
                                       equal_nan=True)
    assert lo.isnan().sum() == 2


@needs_native
@pytest.mark.parametrize("overrides", [{"preset": "recommended"},
                                       {"preset": "recommended", "projection_dtype": "float32"},
                                       {"signal": "uniform", "coef_bits": 4}, {"signal": "uniform", "coef_bits": 3},
                                       {"preset": "recommended", "coef_scales": "component"}, {}])
@pytest.mark.parametrize("reconstruct", [False, True])
def test_a_prompt_codes_the_same_with_or_without_the_c_loops(overrides, reconstruct):
    """Repeated tokens make exactly equal anchor distances (as a model's first layers do): the code, ranks,
    anchors and stored coefficients are the same bits either way, and so is the reconstruction."""
    keys, values, queries, cos, sin = make_prompt(seq_len=900, heads=2, dim=32)
    keys[:, :, 400:800], values[:, :, 400:800] = keys[:, :, :400], values[:, :, :400]  # repeated rows
    basis = random_orthonormal(128, 128)
    overrides = dict(overrides)  # pytest hands every run of the parameter the same dict
    preset = overrides.pop("preset", None)
    config = (VarRateConfig.preset(preset, budget=0.3, **overrides) if preset
              else VarRateConfig(budget=0.3, r_min=4, **overrides))
    runs = []
    for off in (False, True):
        with native.disabled() if off else torch.no_grad():
            runs.append(compress_prompt(keys, values, queries, cos, sin, basis, config, 0.2, reconstruct=reconstruct))
    (code, *rebuilt), (want, *rebuilt_want) = runs
    assert not code.stored_exactly
    for name in ("ranks", "neighbours", "coded_pos", "anchor_pos", "exact_pos"):
        assert torch.equal(getattr(code, name), getattr(want, name)), name
    stored = code.coefs.tensors() if hasattr(code.coefs, "tensors") else [code.coefs]
    stored_want = want.coefs.tensors() if hasattr(want.coefs, "tensors") else [want.coefs]
    assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(stored, stored_want))
    for x, y in zip(rebuilt, rebuilt_want):
        assert (x is None and y is None) or torch.equal(_bits(x), _bits(y))


def _op_samples():
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 10, 8, generator=g), torch.randn(10, 2, 8, generator=g).transpose(0, 1)
    layout, coefs = _dense([12] * 3 + [9] * 2, 8, torch.float32)
    table = torch.tensor(layout.runs)
    return {
        "joint_rows": (keys, values, torch.randn(10, 8, generator=g), torch.randn(10, 8, generator=g),
                       torch.tensor([1, 4, 7]), torch.rand(32, generator=g)),
        "smallest_columns": (torch.randn(6, 9, generator=g), 3),
        "subtract_means": (torch.randn(6, 8, generator=g), torch.randn(4, 8, generator=g),
                           torch.randint(4, (6, 2), generator=g), True),
        "group_ranges": (coefs, table, 8, 3 * 2 + 2 * 2),
        "quantize_runs": (coefs, table, 8, 3, torch.randn(10, generator=g), torch.rand(10, generator=g) + 0.1, 54),
        "component_ranges": (coefs, table, 2, coefs.shape[1]),
        "quantize_component_runs": (coefs, table, 2, coefs.shape[1], 3, torch.randn(3, coefs.shape[1], generator=g),
                                    torch.rand(3, coefs.shape[1], generator=g) + 0.1, 54),
    }


@needs_native
@pytest.mark.parametrize("name", ["joint_rows", "smallest_columns", "subtract_means", "group_ranges", "quantize_runs",
                                  "component_ranges", "quantize_component_runs"])
def test_each_prefill_op_passes_torch_library_opcheck(name):
    """Schema (what the op mutates), fake implementation (shapes, dtypes) and dispatch, as torch checks them."""
    torch.library.opcheck(getattr(ops, name), _op_samples()[name],
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@needs_native
def test_the_prefill_loops_give_the_same_bits_on_any_number_of_threads():
    keys, values, queries, cos, sin = make_prompt(seq_len=900, heads=2, dim=32)
    basis, config = random_orthonormal(128, 128), VarRateConfig.preset("recommended", budget=0.3)
    threads, codes = torch.get_num_threads(), []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            codes.append(compress_prompt(keys, values, queries, cos, sin, basis, config, 0.2, reconstruct=False)[0])
    finally:
        torch.set_num_threads(threads)
    for code in codes[1:]:
        assert torch.equal(code.neighbours, codes[0].neighbours)
        assert all(torch.equal(x, y) for x, y in zip(code.coefs.tensors(), codes[0].coefs.tensors()))


@needs_native
def test_the_component_quantizer_refuses_a_scale_grid_of_the_wrong_size():
    layout, coefs = _dense([12] * 5, 8, torch.float32)
    table = torch.tensor(layout.runs)
    with pytest.raises(ValueError, match=r"need 48 values \(a \[T, width\] grid\), got 40 and 48"):
        ops.quantize_component_runs_loop(coefs, table, 2, coefs.shape[1], 3, torch.zeros(40), torch.ones(48), 60)
