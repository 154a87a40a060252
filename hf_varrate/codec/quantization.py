"""Group-wise b-bit quantization of the coefficient stream (Section 3.3 "Composability", App. A.4).

Each coded token's r_t coefficients are cut into groups of `group` consecutive coefficients (the last group of a
token may be shorter); each group has its own min and step (`codes`). `quantize` / `dequantize` are the stream's
reference; `quantize_dense` / `dequantize_dense` / `dequantize_runs` do the same from and to the dense layout
the codec works in, and hand a stream with scales per component (`axis="component"` or `"rank"`) to `components`.

Shapes: packed stream x [N] (N = sum of ranks, token after token), ranks [C], groups [G].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import native
from .codes import (QuantizedCoefs, check_bits, group_counts, pack_bits, round_down, round_scales, round_up,
                    scale_dtype, unpack_bits)
from .components import component_index, dequantize_components

if TYPE_CHECKING:
    from .projection import DenseOrder


def quantize(x: torch.Tensor, ranks: torch.Tensor, bits: int, group: int) -> QuantizedCoefs:
    """Quantize the packed stream x [N] (token after token, r_t each) to `bits` bits per value."""
    check_bits(bits)
    x = x.float()
    sizes = group_sizes(ranks, group)
    n_groups, count = sizes.numel(), x.numel()
    gid = torch.repeat_interleave(torch.arange(n_groups, device=x.device), sizes, output_size=count)
    levels = 2**bits - 1
    lo = torch.full((n_groups,), float("inf"), device=x.device).scatter_reduce(0, gid, x, "amin")
    hi = torch.full((n_groups,), float("-inf"), device=x.device).scatter_reduce(0, gid, x, "amax")
    dtype = scale_dtype(lo, hi)
    mins = round_down(lo, dtype)  # min <= every value of its group, after rounding to fp16
    steps = round_up((hi - mins.float()) / levels, dtype)  # min + levels * step >= max
    step = torch.repeat_interleave(steps.float(), sizes, output_size=count)
    q = (x - torch.repeat_interleave(mins.float(), sizes, output_size=count)).div_(step)
    q = torch.where(step > 0, q, 0.0).round_().clamp_(0, levels).to(torch.uint8)
    return QuantizedCoefs(pack_bits(q, bits), mins, steps, bits, group, count)


def dequantize(coefs: QuantizedCoefs, ranks: torch.Tensor) -> torch.Tensor:
    """[N] fp32: min + q * step for every coefficient of the stream."""
    q = unpack_bits(coefs.codes, coefs.bits, coefs.count).float()
    if coefs.axis != "token":
        index = component_index(coefs, ranks)
        return q.mul_(coefs.steps.float()[index]).add_(coefs.mins.float()[index])
    sizes = group_sizes(ranks, coefs.group, coefs.mins.numel())
    mins = torch.repeat_interleave(coefs.mins.float(), sizes, output_size=coefs.count)
    steps = torch.repeat_interleave(coefs.steps.float(), sizes, output_size=coefs.count)
    return q.mul_(steps).add_(mins)


def group_sizes(ranks: torch.Tensor, group: int, n_groups: int | None = None) -> torch.Tensor:
    """[G] how many coefficients each group holds: `group`, except a token's last group (r_t mod group).
    `n_groups` (G, where the caller knows it: a stream's `mins.numel()`) spares reading the ranks back to the
    host, which a GPU would wait for."""
    ranks = ranks.long()
    counts = group_counts(ranks, group)
    ends = torch.cumsum(counts, 0)  # one past each token's last group
    if n_groups is None:
        n_groups = int(ends[-1]) if ends.numel() else 0
    g = torch.arange(n_groups, device=ranks.device)
    token = torch.searchsorted(ends, g, right=True)  # the token that holds group g
    k = g - (ends - counts).index_select(0, token)  # g's index among its token's groups
    return (ranks.index_select(0, token) - k * group).clamp_(max=group)


def error_bound(coefs: QuantizedCoefs, ranks: torch.Tensor) -> torch.Tensor:
    """[N] the largest |x - dequantize(x)| rounding allows: half a step of the value's group."""
    if coefs.axis != "token":
        return coefs.steps.float()[component_index(coefs, ranks)] / 2
    sizes = group_sizes(ranks, coefs.group, coefs.mins.numel())
    return torch.repeat_interleave(coefs.steps.float(), sizes, output_size=coefs.count) / 2


def quantize_dense(coefs: torch.Tensor, layout: DenseOrder, bits: int) -> QuantizedCoefs:
    """`quantize` of the stream `layout.to_stream(coefs)` from its dense layout coefs [C, K * group] fp32 or bf16
    (`projection.DenseOrder`; may be overwritten). Bit for bit what `quantize` gives, without expanding
    per-group values to the stream: views [C, K, group] broadcast them. Codes of 2-4 bits of runs on CPU go
    through `native.c`'s loops where built (`_quantize_runs`): the same bits, in two passes."""
    check_bits(bits)
    fast = _quantize_runs(coefs, layout, bits) if layout.runs is not None and bits < 8 else None
    if fast is not None:
        return fast
    rows, group = coefs.shape[0], layout.group
    groups = layout.groups  # [C, K]
    values = layout.fill_padding_(coefs.float()).view(rows, -1, group)  # padding takes a value of its group
    lo, hi = values.amin(dim=2)[groups], values.amax(dim=2)[groups]
    mins, steps, divisors = round_scales(lo, hi, bits)
    q = values.sub_(_grid(groups, mins)).div_(_grid(groups, divisors)).round_().clamp_(0, 2**bits - 1)
    q = layout.to_stream(q.to(torch.uint8).view(rows, -1))
    return QuantizedCoefs(pack_bits(q, bits), mins, steps, bits, group, q.numel())


def _quantize_runs(coefs: torch.Tensor, layout: DenseOrder, bits: int) -> QuantizedCoefs | None:
    """`quantize_dense` for ranks constant over runs, through the C loops: group ranges in one pass,
    each group's min and step as `quantize_dense` rounds them (here, on [G] values), codes and packing in
    another. None where the loops do not apply."""
    ranges = native.group_ranges(coefs, layout.runs, layout.group)
    if ranges is None:
        return None
    mins, steps, divisors = round_scales(*ranges, bits)
    codes = native.quantize_runs(coefs, layout.runs, layout.group, bits, mins.float(), divisors)
    return QuantizedCoefs(codes, mins, steps, bits, layout.group, layout.total)


def dequantize_dense(coefs: QuantizedCoefs, layout: DenseOrder) -> torch.Tensor:
    """`dequantize` laid out dense: [C, K * group] fp32, zeros past each row's rank (see `quantize_dense`)."""
    if coefs.axis != "token":
        return dequantize_components(coefs, layout)
    if layout.runs is not None:
        return layout.from_stream(dequantize_runs(coefs, layout))
    groups = layout.groups
    dense = layout.from_stream(unpack_bits(coefs.codes, coefs.bits, coefs.count))
    out = dense.float().view(dense.shape[0], -1, coefs.group)
    out = out.mul_(_grid(groups, coefs.steps)).add_(_grid(groups, coefs.mins)).view_as(dense)
    return layout.zero_padding_(out)


def dequantize_runs(coefs: QuantizedCoefs, layout: DenseOrder) -> torch.Tensor:
    """`dequantize` (bit for bit) for ranks constant over runs (`layout.runs`): each run's codes and group
    scales are row-major blocks of the stream, so the scales broadcast over views instead of being
    expanded per coefficient. 4-bit codes unpack straight into the fp32 result. (In bf16 the same steps
    ran 2x slower on CPU and rounded three times: convert the result instead.) On CPU, codes go through the
    C loop of `native.c` where it is built (any bit width, scales per token or per component): the same
    values, in one pass."""
    fast = native.dequantize_runs(coefs, layout.runs, torch.float32, layout.width)
    if fast is not None:
        return fast
    if coefs.axis != "token":
        return layout.to_stream(dequantize_components(coefs, layout))
    group = coefs.group
    if coefs.bits == 4:
        out = torch.empty(coefs.codes.numel() * 2, device=coefs.codes.device)
        pairs = out.view(-1, 2)  # value 2i in byte i's low nibble, 2i + 1 in its high one
        pairs[:, 0].copy_(coefs.codes & 0xF)
        pairs[:, 1].copy_(coefs.codes >> 4)
        out = out[: coefs.count]
    else:
        out = unpack_bits(coefs.codes, coefs.bits, coefs.count).float()
    offset = first_group = 0
    for first, stop, rank in layout.runs:
        rows, groups, whole = stop - first, -(-rank // group), rank // group * group
        values = out[offset : offset + rows * rank].view(rows, rank)
        steps = coefs.steps[first_group : first_group + rows * groups].view(rows, groups).float()
        mins = coefs.mins[first_group : first_group + rows * groups].view(rows, groups).float()
        head = values[:, :whole].view(rows, -1, group)
        head.mul_(steps[:, : whole // group, None]).add_(mins[:, : whole // group, None])
        if whole < rank:  # each token's last, partial group
            values[:, whole:].mul_(steps[:, -1:]).add_(mins[:, -1:])
        offset += rows * rank
        first_group += rows * groups
    return out


def _grid(groups: torch.Tensor, per_group: torch.Tensor) -> torch.Tensor:
    """Per-group values [G] (stream order) on the [C, K, 1] grid of `groups` (0 where a group is absent)."""
    grid = per_group.new_zeros(groups.shape, dtype=torch.float32).masked_scatter_(groups, per_group.float())
    return grid[..., None]
