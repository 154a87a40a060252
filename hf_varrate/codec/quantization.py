"""Group-wise b-bit quantization of the coefficient stream (Section 3.3 "Composability", App. A.4).

Each coded token's r_t coefficients are cut into groups of `group` consecutive coefficients (the
last group of a token may be shorter); a group stores its min and its step in fp16 (fp32 if fp16 would overflow) and every
coefficient as an unsigned b-bit integer, bit-packed 8 values to b bytes. Asymmetric min/step
because a group of leading PCA coefficients is rarely centred on zero.

With `coef_scales="component"` (`axis="component"`, beyond the paper) the scales sit on the other axis: the
coded tokens are cut into groups of `COMPONENT_TOKENS` consecutive tokens, and each component has its own min
and step in each (KIVI's layout for keys), so a small trailing component keeps its precision instead of taking
the step of a large leading one, and the scales cost less per coefficient. The codes keep the stream's order;
the scales are a [ceil(C / COMPONENT_TOKENS), W] grid (W: the widest rank), row-major.

Shapes: packed stream x [N] (N = sum of ranks, token after token), ranks [C], groups [G].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import native

if TYPE_CHECKING:
    from .projection import DenseOrder

BITS = (2, 3, 4, 8)
SCALE_DTYPE = torch.float16
AXES = ("token", "component")
COMPONENT_TOKENS = 64  # tokens per group of one component's scales; VarRateConfig.component_tokens's default


@dataclass
class QuantizedCoefs:
    """A quantized coefficient stream: `codes` bit-packed uint8, fp16 `mins` and `steps` per group."""

    codes: torch.Tensor  # [ceil(N / 8) * bits] uint8
    mins: torch.Tensor  # [G] fp16
    steps: torch.Tensor  # [G] fp16
    bits: int
    group: int  # coefficients of one token per group; axis "component": tokens per group of one component
    count: int  # N
    axis: str = "token"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def nbytes_for(self, ranks: torch.Tensor) -> int:
        """Bytes a stream for these ranks takes (for a cropped prompt's accounting)."""
        groups = scale_count(ranks, self.group, self.axis)
        return packed_bytes(int(ranks.sum()), self.bits) + groups * 2 * self.mins.element_size()

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.mins, self.steps]

    def to(self, device) -> QuantizedCoefs:
        return QuantizedCoefs(self.codes.to(device), self.mins.to(device), self.steps.to(device), self.bits,
                              self.group, self.count, self.axis)


def packed_bytes(count: int, bits: int) -> int:
    """Bytes `pack_bits` takes for `count` values."""
    return count if bits == 8 else -(-count // 8) * bits


def group_counts(ranks: torch.Tensor, group: int) -> torch.Tensor:
    """[C] number of groups of each token: ceil(r_t / group)."""
    return (ranks.long() + group - 1) // group


def scale_count(ranks: torch.Tensor, group: int, axis: str = "token") -> int:
    """How many (min, step) pairs a stream for these ranks holds: one per group of each token, or (axis
    "component") a [ceil(C / group), widest rank] grid."""
    if axis == "component":
        return -(-ranks.numel() // group) * int(ranks.long().max()) if ranks.numel() else 0
    return int(group_counts(ranks, group).sum())


def quantize(x: torch.Tensor, ranks: torch.Tensor, bits: int, group: int) -> QuantizedCoefs:
    """Quantize the packed stream x [N] (token after token, r_t each) to `bits` bits per value."""
    if bits not in BITS:
        raise ValueError(f"coef_bits must be one of {list(BITS)} or None, got {bits!r}")
    x = x.float()
    sizes = group_sizes(ranks, group)
    n_groups, count = sizes.numel(), x.numel()
    gid = torch.repeat_interleave(torch.arange(n_groups, device=x.device), sizes, output_size=count)
    levels = 2**bits - 1
    lo = torch.full((n_groups,), float("inf"), device=x.device).scatter_reduce(0, gid, x, "amin")
    hi = torch.full((n_groups,), float("-inf"), device=x.device).scatter_reduce(0, gid, x, "amax")
    dtype = scale_dtype(lo, hi)
    mins = _round_down(lo, dtype)  # min <= every value of its group, after rounding to fp16
    steps = _round_up((hi - mins.float()) / levels, dtype)  # min + levels * step >= max
    step = torch.repeat_interleave(steps.float(), sizes, output_size=count)
    q = (x - torch.repeat_interleave(mins.float(), sizes, output_size=count)).div_(step)
    q = torch.where(step > 0, q, 0.0).round_().clamp_(0, levels).to(torch.uint8)
    return QuantizedCoefs(pack_bits(q, bits), mins, steps, bits, group, count)


def dequantize(coefs: QuantizedCoefs, ranks: torch.Tensor) -> torch.Tensor:
    """[N] fp32: min + q * step for every coefficient of the stream."""
    q = unpack_bits(coefs.codes, coefs.bits, coefs.count).float()
    if coefs.axis == "component":
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
    if coefs.axis == "component":
        return coefs.steps.float()[component_index(coefs, ranks)] / 2
    sizes = group_sizes(ranks, coefs.group, coefs.mins.numel())
    return torch.repeat_interleave(coefs.steps.float(), sizes, output_size=coefs.count) / 2


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 values < 2**bits [N] -> [ceil(N / 8) * bits] uint8, 8 values per `bits` bytes (little-endian)."""
    if bits == 8:
        return q.contiguous()
    n = q.numel()
    if bits == 4:  # value 2i in byte i's low nibble, 2i + 1 in its high one (what the general path writes)
        pairs = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=q.device)
        pairs[:n] = q
        pairs = pairs.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.int64, device=q.device)
    padded[:n] = q
    shifts = torch.arange(8, device=q.device) * bits
    words = (padded.view(-1, 8) << shifts).sum(dim=1)  # [n / 8] words of 8 * bits bits
    byte_shifts = torch.arange(bits, device=q.device) * 8
    return ((words[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `pack_bits`: -> [count] uint8."""
    if bits == 8:
        return packed[:count]
    if bits == 4:  # value 2i in byte i's low nibble, 2i + 1 in its high one
        return torch.stack((packed & 0xF, packed >> 4), dim=1).view(-1)[:count]
    byte_shifts = torch.arange(bits, device=packed.device) * 8
    words = (packed.view(-1, bits).long() << byte_shifts).sum(dim=1)  # [n / 8]
    shifts = torch.arange(8, device=packed.device) * bits
    return ((words[:, None] >> shifts) & (2**bits - 1)).to(torch.uint8).reshape(-1)[:count]


def scale_dtype(lo: torch.Tensor, hi: torch.Tensor) -> torch.dtype:
    """fp16, unless a group's range would overflow it (then fp32, and its bytes are counted as such)."""
    if lo.numel() == 0:
        return SCALE_DTYPE
    span = float(torch.maximum(hi.abs().max(), lo.abs().max()))
    return SCALE_DTYPE if span < torch.finfo(SCALE_DTYPE).max / 4 else torch.float32


def _round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values of `dtype` <= x (x fp32, finite)."""
    h = x.to(dtype)
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)


def _round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values of `dtype` >= x (x fp32, finite, >= 0)."""
    h = x.to(dtype)
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def quantize_dense(coefs: torch.Tensor, layout: DenseOrder, bits: int) -> QuantizedCoefs:
    """`quantize` of the stream `layout.to_stream(coefs)` from its dense layout coefs [C, K * group] fp32 or bf16
    (`projection.DenseOrder`; may be overwritten). Bit for bit what `quantize` gives, without expanding
    per-group values to the stream: views [C, K, group] broadcast them. Codes of 2-4 bits of runs on CPU go
    through `native.c`'s loops where built (`_quantize_runs`): the same bits, in two passes."""
    if bits not in BITS:
        raise ValueError(f"coef_bits must be one of {list(BITS)} or None, got {bits!r}")
    fast = _quantize_runs(coefs, layout, bits) if layout.runs is not None and bits < 8 else None
    if fast is not None:
        return fast
    rows, group = coefs.shape[0], layout.group
    groups = layout.groups  # [C, K]
    values = layout.fill_padding_(coefs.float()).view(rows, -1, group)  # padding takes a value of its group
    lo, hi = values.amin(dim=2)[groups], values.amax(dim=2)[groups]
    mins, steps, divisors = _scales(lo, hi, bits)
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
    mins, steps, divisors = _scales(*ranges, bits)
    codes = native.quantize_runs(coefs, layout.runs, layout.group, bits, mins.float(), divisors)
    return QuantizedCoefs(codes, mins, steps, bits, layout.group, layout.total)


def _scales(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group's (min, step) in the scales' dtype from its range fp32 (min rounded down, step up, so every value
    has a code within half a step), and the fp32 divisor its codes are computed with: the step, or inf where it
    is 0 (a constant group), which gives the q = 0 `quantize` sets there."""
    dtype = scale_dtype(lo, hi)
    mins = _round_down(lo, dtype)
    steps = _round_up((hi - mins.float()) / (2**bits - 1), dtype)
    return mins, steps, steps.float().masked_fill(steps == 0, float("inf"))


def dequantize_dense(coefs: QuantizedCoefs, layout: DenseOrder) -> torch.Tensor:
    """`dequantize` laid out dense: [C, K * group] fp32, zeros past each row's rank (see `quantize_dense`)."""
    if coefs.axis == "component":
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
    if coefs.axis == "component":
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


def quantize_components(coefs: torch.Tensor, layout: DenseOrder, bits: int,
                        group: int = COMPONENT_TOKENS) -> QuantizedCoefs:
    """Dense coefficients [C, W] (`layout`'s rows, in coded order; fp32 ones may be overwritten) quantized per
    component (axis "component"): each component's values over `group` consecutive tokens share a min and step;
    entries past a row's rank are left out of the ranges and of the stream. Only the columns some token lacks
    (past the smallest rank: one, for uniform ranks) are masked; the others are ranged as they are."""
    if bits not in BITS:
        raise ValueError(f"coef_bits must be one of {list(BITS)} or None, got {bits!r}")
    width = coefs.shape[1]
    ranges = native.component_ranges(coefs, layout.runs, group, width) if bits < 8 else None
    if ranges is not None:  # ranks constant over runs, on CPU: `native.c`'s loops, the same bits in two passes
        mins, steps, divisors = _scales(*ranges, bits)
        codes = native.quantize_component_runs(coefs, layout.runs, group, width, bits, mins.float(), divisors)
        return QuantizedCoefs(codes, mins.reshape(-1), steps.reshape(-1), bits, group, layout.total, "component")
    values = coefs.float()
    blocks = _token_blocks(values, group)
    mins, steps, divisors = _scales(*_component_ranges(blocks, layout, group), bits)
    for block, groups in blocks:
        block.sub_(mins.float()[groups, None]).div_(divisors[groups, None])
    stream = layout.to_stream(values.round_().clamp_(0, 2**bits - 1).to(torch.uint8))
    return QuantizedCoefs(pack_bits(stream, bits), mins.reshape(-1), steps.reshape(-1), bits, group, stream.numel(),
                          "component")


def _token_blocks(x: torch.Tensor, group: int) -> list[tuple[torch.Tensor, slice]]:
    """[C, W] as views (block, its token groups): [C // group, group, W] (the whole groups), then [1, C % group, W]."""
    rows, width = x.shape
    whole = rows - rows % group
    blocks = [(x[:whole].view(whole // group, group, width), slice(0, whole // group))] if whole or not rows else []
    return blocks + ([(x[whole:].view(1, rows - whole, width), slice(whole // group, None))] if rows > whole else [])


def _component_ranges(blocks: list, layout: DenseOrder, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (group of tokens, component)'s min and max [T, W] over the entries within their tokens' ranks (0 and 0
    where no token of the group has the component); only the columns past the smallest rank are masked."""
    full = int(layout.ranks.min()) if layout.ranks.numel() else layout.width  # the columns every token has
    lows, highs = [], []
    for (block, _), (mask, _) in zip(blocks, _token_blocks(layout.mask[:, full:], group)):
        ragged, present = block[..., full:], mask.any(dim=1)
        lo = ragged.masked_fill(~mask, float("inf")).amin(dim=1).masked_fill_(~present, 0.0)
        hi = ragged.masked_fill(~mask, float("-inf")).amax(dim=1).masked_fill_(~present, 0.0)
        lows.append(torch.cat((block[..., :full].amin(dim=1), lo), dim=1))
        highs.append(torch.cat((block[..., :full].amax(dim=1), hi), dim=1))
    return torch.cat(lows), torch.cat(highs)


def dequantize_components(coefs: QuantizedCoefs, layout: DenseOrder) -> torch.Tensor:
    """`quantize_components` undone: [C, W] fp32, zeros past each row's rank."""
    q = layout.from_stream(unpack_bits(coefs.codes, coefs.bits, coefs.count), torch.float32)
    steps, mins = (x.float().view(-1, layout.width) for x in (coefs.steps, coefs.mins))
    for block, groups in _token_blocks(q, coefs.group):
        block.mul_(steps[groups, None]).add_(mins[groups, None])
    return layout.zero_padding_(q)


def component_index(coefs: QuantizedCoefs, ranks: torch.Tensor) -> torch.Tensor:
    """[N] long: each stream value's entry in an axis-"component" scale grid (its token's group, its component)."""
    ranks = ranks.long()
    token = torch.repeat_interleave(torch.arange(ranks.numel(), device=ranks.device), ranks, output_size=coefs.count)
    starts = torch.cumsum(ranks, 0) - ranks
    column = torch.arange(coefs.count, device=ranks.device) - starts[token]
    width = coefs.mins.numel() // max(-(-ranks.numel() // coefs.group), 1)
    return token // coefs.group * width + column
