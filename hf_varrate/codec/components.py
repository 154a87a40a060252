"""Coefficient scales per component (`coef_scales="component"`, `axis="component"`, beyond the paper).

The coded tokens are cut into groups of `COMPONENT_TOKENS` consecutive tokens, and each component has its own
min and step in each (KIVI's layout for keys), so a small trailing component keeps its precision instead of
taking the step of a large leading one, and the scales cost less per coefficient. The codes keep the stream's
order; the scales are a [ceil(C / COMPONENT_TOKENS), W] grid (W: the widest rank), row-major.

Where the ranks vary (a salience signal, or `allocation="distortion"`), a grid that wide would hold scales for
components most tokens of a group lack. Axis "rank" groups the tokens by decreasing rank instead (a stable sort, so
ranks that never rise keep their order): group g holds sorted tokens [g * T, (g + 1) * T), and its grid row is only
as wide as its first, widest token. The rows are ragged, concatenated; each is no wider than the previous group's
narrowest token, so the grid holds at most sum(ranks) / T + the widest rank entries, which the budget's allowance
for axis "component" covers (`budget.coefficient_budget`). The order and the row widths follow from the ranks
alone.

Shapes: dense coefficients [C, W] in coded order (`projection.DenseOrder`'s rows), packed stream [N].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import native
from .codes import COMPONENT_TOKENS, QuantizedCoefs, check_bits, pack_bits, round_scales, unpack_bits
from .projection import rank_mask

if TYPE_CHECKING:
    from .projection import DenseOrder


def quantize_components(coefs: torch.Tensor, layout: DenseOrder, bits: int,
                        group: int = COMPONENT_TOKENS, axis: str = "component") -> QuantizedCoefs:
    """Dense coefficients [C, W] (`layout`'s rows, in coded order; fp32 ones may be overwritten) quantized per
    component (axis "component"): each component's values over `group` consecutive tokens share a min and step;
    entries past a row's rank are left out of the ranges and of the stream. Only the columns some token lacks
    (past the smallest rank: one, for uniform ranks) are masked; the others are ranged as they are. Axis "rank":
    the groups are of tokens by decreasing rank, the grid ragged (see the module's docstring)."""
    check_bits(bits)
    if axis == "rank":
        return _quantize_by_rank(coefs, layout, bits, group)
    width = coefs.shape[1]
    ranges = native.component_ranges(coefs, layout.runs, group, width) if bits < 8 else None
    if ranges is not None:  # ranks constant over runs, on CPU: `native.c`'s loops, the same bits in two passes
        mins, steps, divisors = round_scales(*ranges, bits)
        codes = native.quantize_component_runs(coefs, layout.runs, group, width, bits, mins.float(), divisors)
        return QuantizedCoefs(codes, mins.reshape(-1), steps.reshape(-1), bits, group, layout.total, "component")
    values = coefs.float()
    blocks = _token_blocks(values, group)
    mins, steps, divisors = round_scales(*_component_ranges(blocks, layout, group), bits)
    for block, groups in blocks:
        block.sub_(mins.float()[groups, None]).div_(divisors[groups, None])
    stream = layout.to_stream(values.round_().clamp_(0, 2**bits - 1).to(torch.uint8))
    return QuantizedCoefs(pack_bits(stream, bits), mins.reshape(-1), steps.reshape(-1), bits, group, stream.numel(),
                          "component")


def _quantize_by_rank(coefs: torch.Tensor, layout: DenseOrder, bits: int, group: int) -> QuantizedCoefs:
    """`quantize_components` on axis "rank": the rows taken in `rank_groups` order, the grid cut to each row's width."""
    order, widths = rank_groups(layout.ranks, group)
    present = rank_mask(widths, layout.width)
    values, mask = coefs.float().index_select(0, order), layout.mask.index_select(0, order)
    blocks = _token_blocks(values, group)
    lo, hi = _component_ranges(blocks, _masked(layout.ranks.index_select(0, order), mask, layout.width), group)
    mins, steps, divisors = round_scales(lo[present], hi[present], bits)
    grid_mins, grid_divisors = _grid(present, mins), _grid(present, divisors, fill=float("inf"))
    for block, groups in blocks:
        block.sub_(grid_mins[groups, None]).div_(grid_divisors[groups, None])
    q = torch.empty_like(values).index_copy_(0, order, values.round_().clamp_(0, 2**bits - 1))
    stream = layout.to_stream(q.to(torch.uint8))
    return QuantizedCoefs(pack_bits(stream, bits), mins, steps, bits, group, stream.numel(), "rank")


def rank_groups(ranks: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Axis "rank"'s grouping of coded tokens with ranks [C]: (order [C], the tokens by decreasing rank, stable;
    widths [ceil(C / group)], each group's grid row width: its first token's rank)."""
    sorted_ranks, order = torch.sort(ranks.long(), descending=True, stable=True)
    return order, sorted_ranks[::group]


class _masked:
    """The two fields of a `DenseOrder` that `_component_ranges` reads, for rows in another order."""

    def __init__(self, ranks: torch.Tensor, mask: torch.Tensor, width: int):
        self.ranks, self.mask, self.width = ranks, mask, width


def _grid(present: torch.Tensor, entries: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """A ragged grid's entries [G'] on the full [T, width] grid, `fill` where absent."""
    return entries.new_full(present.shape, fill, dtype=torch.float32).masked_scatter_(present, entries.float())


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
    if coefs.axis == "rank":
        order, widths = rank_groups(layout.ranks, coefs.group)
        present = rank_mask(widths, layout.width)
        steps, mins = _grid(present, coefs.steps), _grid(present, coefs.mins)
        q = q.index_select(0, order)
    else:
        order = None
        steps, mins = (x.float().view(-1, layout.width) for x in (coefs.steps, coefs.mins))
    for block, groups in _token_blocks(q, coefs.group):
        block.mul_(steps[groups, None]).add_(mins[groups, None])
    if order is not None:
        q = torch.empty_like(q).index_copy_(0, order, q)
    return layout.zero_padding_(q)


def component_index(coefs: QuantizedCoefs, ranks: torch.Tensor) -> torch.Tensor:
    """[N] long: each stream value's entry in an axis-"component" (or "rank") scale grid (its token's group, its
    component)."""
    ranks = ranks.long()
    token = torch.repeat_interleave(torch.arange(ranks.numel(), device=ranks.device), ranks, output_size=coefs.count)
    starts = torch.cumsum(ranks, 0) - ranks
    column = torch.arange(coefs.count, device=ranks.device) - starts[token]
    if coefs.axis == "rank":
        order, widths = rank_groups(ranks, coefs.group)
        place = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
        row = place[token] // coefs.group
        return (torch.cumsum(widths, 0) - widths)[row] + column
    width = coefs.mins.numel() // max(-(-ranks.numel() // coefs.group), 1)
    return token // coefs.group * width + column
