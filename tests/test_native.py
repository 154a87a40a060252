"""The C loops of a compact read (`hf_varrate.codec.native`) compute what the PyTorch read computes, and
without a compiler everything still works on PyTorch."""

import copy
import dataclasses
import types
import warnings

import pytest
import torch

import hf_varrate
from hf_varrate.codec import attend, native, native_build, ops
from hf_varrate.codec.projection import DenseOrder
from hf_varrate.codec.codes import unpack_bits
from hf_varrate.codec.components import quantize_components
from hf_varrate.codec.quantization import dequantize_runs, quantize

from test_attention import attention, compact  # noqa: F401 (fixture)
from test_cache import prompt

needs_native = pytest.mark.skipif(not native.available(), reason="the C loops could not be built here (no compiler?)")


@pytest.fixture
def rebuilt_library():
    """Forget the loaded library before and after a test that changes how it is found."""
    native_build.library.cache_clear()
    yield
    native_build.library.cache_clear()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b hold the same bits (fp32 or bf16 tensors of one dtype)."""
    bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


def _runs(rows_and_ranks):
    runs, first = [], 0
    for rows, rank in rows_and_ranks:
        runs.append((first, first + rows, rank))
        first += rows
    return runs


@needs_native
@pytest.mark.parametrize("bits", [4, 3, 2, 8])
@pytest.mark.parametrize("group", [32, 16, 8])
@pytest.mark.parametrize("rows_and_ranks", [[(7, 40), (13, 39)], [(5, 3)], [(1, 1), (4, 33), (2, 64)]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_runs_equals_pytorch_bit_for_bit(bits, group, rows_and_ranks, dtype):
    """Any bit width: values that start mid-byte, cross a byte or end the stream come back as PyTorch's."""
    runs = _runs(rows_and_ranks)
    ranks = torch.cat([torch.full((stop - first,), rank) for first, stop, rank in runs])
    x = torch.randn(int(ranks.sum()), generator=torch.Generator().manual_seed(group)) * 3
    x[: min(group, rows_and_ranks[0][1])] = 0.25  # a constant group: step 0
    coefs = quantize(x, ranks, bits, group)
    assert int(unpack_bits(coefs.codes, bits, coefs.count).max()) == 2**bits - 1  # codes use their top bit too
    with native.disabled():
        want = dequantize_runs(coefs, types.SimpleNamespace(runs=runs, width=None)).to(dtype)
    got = native.dequantize_runs(coefs, runs, dtype)
    assert got.dtype == dtype and same_bits(got, want)


@needs_native
@pytest.mark.parametrize("bits", [4, 3])
@pytest.mark.parametrize("tokens", [64, 16, 5])
@pytest.mark.parametrize("rows_and_ranks", [[(7, 40), (13, 39)], [(5, 3)], [(1, 1), (70, 33), (2, 64)]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_runs_with_component_scales_equals_pytorch_bit_for_bit(bits, tokens, rows_and_ranks, dtype):
    """Scales per component (a [T, width] grid, `tokens` tokens per row of it): the same loop, the same bits."""
    runs = _runs(rows_and_ranks)
    ranks = torch.cat([torch.full((stop - first,), rank) for first, stop, rank in runs])
    width = -(-int(ranks.max()) // 8) * 8
    dense = torch.randn(ranks.numel(), width, generator=torch.Generator().manual_seed(tokens)) * 3
    dense[:, 0] = 0.25  # a constant component: step 0
    layout = DenseOrder(ranks, width, 8, int(ranks.sum()), runs)
    coefs = quantize_components(dense, layout, bits, tokens)
    with native.disabled():
        want = dequantize_runs(coefs, layout).to(dtype)
    got = native.dequantize_runs(coefs, runs, dtype, width)
    assert got.dtype == dtype and coefs.axis == "component" and same_bits(got, want)


@needs_native
def test_component_scales_that_do_not_fit_the_runs_are_left_to_pytorch():
    ranks = torch.full((10,), 6)
    coefs = quantize_components(torch.randn(10, 8), DenseOrder(ranks, 8, 8, 60, [(0, 10, 6)]), 4, 4)
    assert native.dequantize_runs(coefs, [(0, 10, 6)], torch.float32, 8) is not None
    assert native.dequantize_runs(coefs, [(0, 10, 6)], torch.float32) is None  # no width: the grid is unknown
    assert native.dequantize_runs(coefs, [(0, 6, 10)], torch.float32, 8) is None  # ranks past the grid's width
    assert native.dequantize_runs(coefs, [(0, 20, 3)], torch.float32, 8) is None  # more token groups than it holds
    assert native.dequantize_runs(coefs, None, torch.float32, 8) is None  # no runs: ragged ranks


@needs_native
def test_the_library_dequantizes_runs_through_the_c_loop(monkeypatch):
    coefs, calls, loop = quantize(torch.randn(40), torch.full((4,), 10), 4, 8), [], native.dequantize_runs
    monkeypatch.setattr(native, "dequantize_runs", lambda *args: calls.append(args) or loop(*args))
    values = dequantize_runs(coefs, types.SimpleNamespace(runs=[(0, 4, 10)], width=None))
    assert len(calls) == 1 and values.dtype == torch.float32 and values.shape == (40,)


@needs_native
def test_a_stream_too_short_for_its_bit_width_is_left_to_pytorch_and_refused_by_the_op():
    coefs = quantize(torch.randn(40), torch.full((4,), 10), 3, 8)  # 40 values of 3 bits: 15 bytes
    short = dataclasses.replace(coefs, codes=coefs.codes[:14])
    assert native.dequantize_runs(short, [(0, 4, 10)], torch.float32) is None
    with pytest.raises(ValueError, match="40 values of 3 bits do not fit 14 bytes"):
        ops.dequantize_runs_loop(short.codes, 3, coefs.steps.float(), coefs.mins.float(), torch.tensor([[0, 4, 10]]),
                                 8, 0, 40, False)
    with pytest.raises(ValueError, match="of 5 bits"):
        ops.dequantize_runs_loop(coefs.codes, 5, coefs.steps.float(), coefs.mins.float(), torch.tensor([[0, 4, 10]]),
                                 8, 0, 40, False)


@needs_native
def test_runs_that_do_not_fit_the_stream_are_left_to_pytorch():
    coefs = quantize(torch.randn(40), torch.full((4,), 10), 4, 8)
    assert native.dequantize_runs(coefs, [(0, 5, 10)], torch.float32) is None  # 50 values, the stream holds 40
    assert native.dequantize_runs(coefs, [(0, 4, 10)], torch.float32) is not None


def _reference_scores(proj, anchors, neighbours, turns, positions, queries):
    keys = anchors[neighbours].sum(1) + proj.float()  # [C, H * d]
    heads, _, dim = queries.shape
    rotated = (torch.view_as_complex(keys.view(-1, heads, dim // 2, 2))
               * torch.view_as_complex(turns[positions])[:, None])
    return torch.einsum("hrd,chd->hrc", queries, torch.view_as_real(rotated).reshape(-1, heads, dim))


@needs_native
@pytest.mark.parametrize("heads, rows, dim", [(3, 3, 64), (2, 5, 24), (1, 1, 8)])
@pytest.mark.parametrize("n_neighbours", [1, 2, 4])
@pytest.mark.parametrize("proj_dtype", [torch.float32, torch.bfloat16])
def test_coded_key_scores_equal_pytorch(heads, rows, dim, n_neighbours, proj_dtype):
    gen = torch.Generator().manual_seed(dim + n_neighbours)
    tokens, n_anchors, seq_len, width = 37, 6, 50, heads * dim
    proj = torch.randn(tokens, width, generator=gen).to(proj_dtype)
    anchors = torch.randn(n_anchors, width, generator=gen)
    neighbours = torch.randint(n_anchors, (tokens, n_neighbours), generator=gen)
    angles = torch.rand(seq_len, dim // 2, generator=gen) * 6
    turns = torch.stack((angles.cos(), angles.sin()), dim=-1) * 1.1  # cos^2 + sin^2 need not be 1
    positions = torch.randperm(seq_len, generator=gen)[:tokens]
    queries = torch.randn(heads, rows, dim, generator=gen)
    got = native.coded_key_scores(proj, anchors, neighbours, turns, positions, queries)
    want = _reference_scores(proj, anchors, neighbours, turns, positions, queries)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@needs_native
@pytest.mark.parametrize("overrides", [{}, {"preset": "recommended", "budget": 0.3},
                                       {"preset": "recommended", "budget": 0.3, "projection_dtype": "float32"},
                                       {"preset": "recommended", "budget": 0.3, "coef_scales": "component"}])
def test_the_read_over_the_codes_is_the_same_with_or_without_the_c_loops(tiny_llama, overrides, attention,  # noqa: F811
                                                                         monkeypatch):
    ids = prompt(tiny_llama, 300)
    cache = compact(tiny_llama, **overrides)
    attention(tiny_llama, hf_varrate.ATTENTION)
    read, loop = [], native.dequantize_runs

    def spy(coefs, *args):
        read.append((coefs.axis, loop(coefs, *args)))
        return read[-1][1]

    with torch.no_grad():
        tiny_llama(ids[:, :-6], past_key_values=cache)
        torch_cache = copy.deepcopy(cache)
        monkeypatch.setattr(native, "dequantize_runs", spy)
        got = [tiny_llama(ids[:, -6:-1], past_key_values=cache).logits,
               tiny_llama(ids[:, -1:], past_key_values=cache).logits]
        monkeypatch.setattr(native, "dequantize_runs", loop)
        with native.disabled():
            assert not native.available()
            want = [tiny_llama(ids[:, -6:-1], past_key_values=torch_cache).logits,
                    tiny_llama(ids[:, -1:], past_key_values=torch_cache).logits]
    if overrides.get("coef_scales") == "component":  # runs of 4-bit codes, each read through the C loop
        assert read and all(kind == "component" and values is not None for kind, values in read)
    assert native.available()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@needs_native
@pytest.mark.parametrize("heads, dim, n_neighbours", [(3, 64, 4), (1, 24, 2), (2, 8, 1)])
def test_anchor_keys_equal_pytorch(heads, dim, n_neighbours):
    gen = torch.Generator().manual_seed(dim)
    exact_keys, seq_len = torch.randn(heads, 30, dim, generator=gen), 90
    rows = torch.randperm(30, generator=gen)[:12]
    positions = torch.randperm(seq_len, generator=gen)[:12]
    angles = torch.rand(seq_len, dim // 2, generator=gen) * 6
    turns = torch.stack((angles.cos(), angles.sin()), dim=-1) * 0.9  # cos^2 + sin^2 need not be 1
    got = native.anchor_keys(exact_keys, rows, positions, turns, n_neighbours)
    with native.disabled():
        want = attend._anchor_keys(exact_keys, rows, positions, turns, n_neighbours)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_native
@pytest.mark.parametrize("n_neighbours", [1, 4])
def test_add_anchor_shares_equals_index_add(n_neighbours):
    gen = torch.Generator().manual_seed(n_neighbours)
    weights = torch.rand(3, 2, 50 + 12 + 5, generator=gen)  # [H, rows, coded + exact + tail], as attend splits it
    neighbours = torch.randint(7, (50, n_neighbours), generator=gen)
    anchor_rows = torch.randperm(12, generator=gen)[:7]
    want = weights.clone()
    coded, exact, _ = want.split((50, 12, 5), dim=-1)
    with native.disabled():
        attend._add_anchor_shares(coded, exact, neighbours, anchor_rows)
    coded, exact, _ = weights.split((50, 12, 5), dim=-1)
    assert native.add_anchor_shares(coded, exact, neighbours, anchor_rows)
    torch.testing.assert_close(weights, want, rtol=1e-6, atol=1e-7)


@needs_native
def test_the_loops_give_the_same_bits_on_any_number_of_threads():
    gen = torch.Generator().manual_seed(1)
    runs = _runs([(301, 40), (200, 39)])
    ranks = torch.cat([torch.full((stop - first,), rank) for first, stop, rank in runs])
    coefs = quantize(torch.randn(int(ranks.sum()), generator=gen), ranks, 4, 32)
    components = quantize_components(torch.randn(501, 48, generator=gen),
                                     DenseOrder(ranks, 48, 8, int(ranks.sum()), runs), 4)
    args = (torch.randn(501, 48, generator=gen), torch.randn(9, 48, generator=gen),
            torch.randint(9, (501, 4), generator=gen), torch.randn(600, 8, 2, generator=gen),
            torch.randperm(600, generator=gen)[:501], torch.randn(3, 3, 16, generator=gen))
    threads, results = torch.get_num_threads(), []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append((native.dequantize_runs(coefs, runs, torch.bfloat16), native.coded_key_scores(*args),
                            native.dequantize_runs(components, runs, torch.float32, 48)))
    finally:
        torch.set_num_threads(threads)
    for values, scores, component_values in results[1:]:
        assert same_bits(values, results[0][0]) and values.dtype == torch.bfloat16
        assert torch.equal(scores, results[0][1])
        assert same_bits(component_values, results[0][2]) and component_values.dtype == torch.float32


@needs_native
def test_out_of_range_indices_raise_index_error_as_pytorch_would():
    """The C loops do not check their indices: the ops do, before the loop reads out of bounds."""
    anchors, turns, queries = torch.randn(4, 16), torch.randn(10, 8, 2), torch.randn(1, 1, 16)
    proj = torch.randn(3, 16)
    with pytest.raises(IndexError, match=r"neighbours out of range.*\[0, 4\), got \[0, 4\]"):
        native.coded_key_scores(proj, anchors, torch.tensor([[0], [4], [1]]), turns, torch.arange(3), queries)
    with pytest.raises(IndexError, match="positions out of range"):
        native.coded_key_scores(proj, anchors, torch.zeros(3, 1, dtype=torch.long), turns, torch.tensor([0, 1, 10]),
                                queries)
    with pytest.raises(IndexError, match="anchor rows out of range"):
        native.anchor_keys(torch.randn(1, 5, 16), torch.tensor([0, 5]), torch.arange(2), turns, 2)
    assert native.coded_key_scores(proj, anchors, torch.zeros(3, 1, dtype=torch.long), turns, torch.arange(3),
                                   queries) is not None


def test_without_a_compiler_the_loops_are_off_and_say_why(monkeypatch, tmp_path, rebuilt_library):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("HF_VARRATE_CACHE", str(tmp_path))
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    with pytest.warns(RuntimeWarning, match="compact reads use PyTorch.*HF_VARRATE_NATIVE=0"):
        assert not native.available()
    ranks = torch.full((3,), 8)
    assert native.dequantize_runs(quantize(torch.randn(24), ranks, 4, 8), [(0, 3, 8)], torch.float32) is None


def test_a_compiler_that_fails_is_reported_with_its_message(monkeypatch, tmp_path, rebuilt_library):
    compiler = tmp_path / "cc"
    compiler.write_text("#!/bin/sh\necho 'cc: out of luck' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("HF_VARRATE_CACHE", str(tmp_path))
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    with pytest.warns(RuntimeWarning, match="out of luck"):
        assert not native.available()


def test_cc_may_carry_flags(monkeypatch, tmp_path, rebuilt_library):
    """CC="gcc -O2"-style values are a command line, as make reads them."""
    compiler = tmp_path / "cc"
    compiler.write_text('#!/bin/sh\necho "args: $*" >&2\nexit 1\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", f"{compiler} -DFROM_CC")
    monkeypatch.setenv("HF_VARRATE_CACHE", str(tmp_path))
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    with pytest.warns(RuntimeWarning, match="args: -DFROM_CC -O3"):
        assert not native.available()


def test_the_switch_turns_the_loops_off_silently(monkeypatch, rebuilt_library):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not native.available()
