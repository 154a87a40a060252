"""Encode once at full rank, truncate per token, decode (Section 3.3, Eq. 6).

Shapes: residuals e [C, D] fp32, basis V [R, D] with orthonormal rows (fp32, or half precision: each matmul
converts it), coefficients [C, R], ranks [C], packed coefficients [sum(ranks)] (row-major: token 0's leading
r_0, then token 1's...).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property

import torch


def encode(residuals: torch.Tensor, basis: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """c_t = V e_t for every coded token, at the full rank R: [C, D] -> [C, R] fp32, the matmul's operands in
    `dtype` (`matmul_dtype`, as `encode_blocks` takes them)."""
    return (residuals.to(dtype) @ basis.to(dtype).T).float()


def rank_mask(ranks: torch.Tensor, rank: int) -> torch.Tensor:
    """[C, R] bool: the nested mask m_{t,j} = 1[j < r_t]."""
    return torch.arange(rank, device=ranks.device)[None, :] < ranks[:, None].long()


def pack(coefs: torch.Tensor, ranks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keep each token's leading r_t coefficients: [C, R] -> [sum(ranks)] in `dtype`."""
    return coefs[rank_mask(ranks, coefs.shape[1])].to(dtype)


def unpack(packed: torch.Tensor, ranks: torch.Tensor, rank: int) -> torch.Tensor:
    """Inverse of `pack`: [sum(ranks)] -> [C, R] fp32 with zeros past each token's rank."""
    coefs = torch.zeros(ranks.numel(), rank, dtype=torch.float32, device=packed.device)
    coefs[rank_mask(ranks, rank)] = packed.float()
    return coefs


def decode(means: torch.Tensor, coefs: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Eq. 6: z-hat_t = z-bar_t + V^T (m_t * c_t). coefs [C, R] already masked -> [C, D] fp32."""
    return means.float() + coefs @ basis[: coefs.shape[1]].float()


# Rank-blocked ("staircase") encode and decode: a token of rank r costs about r x D, not R x D.
# Coded tokens are sorted by decreasing rank, so the tokens that need basis rows [j0, j1) are a
# prefix of that order; each block of BLOCK basis rows is one matmul over that prefix. A block's
# coefficients [rows, j1 - j0] are read from (written to) the packed stream (token-major in coded
# order, as `pack` writes it) by one index per block; entries past a token's rank point at one
# extra slot at the end of the stream, which holds a zero (and receives the encoder's leftovers).

BLOCK = 32


@dataclass
class RankOrder:
    """How one prompt's coded tokens are laid out for the rank-blocked matmuls.

    order [C]: coded indices by decreasing rank (stable); ranks [C] and starts [C]: each sorted
    token's rank and the offset of its coefficients in the packed stream; blocks: (j0, j1, rows,
    full) per block of basis rows, `rows` tokens reach the block, the first `full` fill it.
    """

    order: torch.Tensor
    ranks: torch.Tensor
    starts: torch.Tensor
    blocks: list[tuple[int, int, int, int]]
    total: int  # sum(ranks)

    def index(self, j0: int, j1: int, rows: int, full: int) -> torch.Tensor:
        """[rows, j1 - j0] positions in the packed stream of a block's coefficients (`total` past a rank),
        int32 or int64 as `starts`."""
        cols = torch.arange(j0, j1, device=self.starts.device, dtype=self.starts.dtype)
        index = self.starts[:rows, None] + cols[None, :]
        if full < rows:  # the last rows end inside this block
            tail = index[full:]
            tail.masked_fill_(cols[None, :] >= self.ranks[full:rows, None], self.total)
        return index

    def block_coefs(self, packed: torch.Tensor, dtype: torch.dtype) -> list[tuple[int, int, int, torch.Tensor]]:
        """Each block's coefficients as a matrix: [(j0, j1, rows, coefs [rows, j1 - j0] in `dtype`, zeros past
        each rank)] from the packed stream [sum(ranks)], gathered by index_select (about 2x faster than
        advanced indexing or take)."""
        stream = torch.cat((packed.to(dtype), packed.new_zeros(1, dtype=dtype)))  # `index` points past a rank here
        out = []
        for j0, j1, rows, full in self.blocks:
            index = self.index(j0, j1, rows, full)
            out.append((j0, j1, rows, stream.index_select(0, index.view(-1)).view(index.shape)))
        return out


def rank_order(ranks: torch.Tensor, block: int = BLOCK, merge: float = 0.7) -> RankOrder:
    """Build the `RankOrder` of ranks [C] (any integer dtype).

    Blocks start `block` rows wide; consecutive blocks merge while the tokens reaching the later one
    are at least `merge` times those reaching the first (so padding wastes at most 1 - merge of a
    merged block's work), which halves the number of small matmuls where ranks thin out slowly.
    """
    order, ranks, starts = _rank_sort(ranks.long(), int(ranks.long().sum()))
    width = int(ranks[0]) if ranks.numel() else 0
    edges = torch.arange(0, width + block, block, device=ranks.device).clamp_(max=width)  # j0 of each block, width
    reach = (ranks[None, :] > edges[:, None]).sum(dim=1).tolist()  # tokens with rank > j0
    edges = edges.tolist()
    cuts = [0]
    for b in range(1, len(edges) - 1):
        if reach[b] < merge * reach[cuts[-1]]:
            cuts.append(b)
    cuts.append(len(edges) - 1)
    blocks = []
    for first, last in zip(cuts, cuts[1:]) if width else ():
        j0, j1 = edges[first], edges[last]
        blocks.append((j0, j1, reach[first], reach[last] if j1 < width else int((ranks >= width).sum())))
    return RankOrder(order, ranks, starts, blocks, int(ranks.sum()))


def _rank_sort(ranks: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, ranks sorted by decreasing rank, each token's start in the packed stream, in that order)."""
    sorted_ranks, order = torch.sort(ranks, descending=True, stable=True)
    starts = (torch.cumsum(ranks, 0) - ranks).index_select(0, order)
    if total < 2**31 - 1:  # int32 offsets: indices built and gathered about 1.3x faster
        starts = starts.int()
    return order, sorted_ranks, starts


@dataclass(frozen=True)
class LayoutShape:
    """What choosing a layout read back from the ranks (python numbers only): enough to build the same
    layout again from the ranks without reading them back (`rebuild_layout`), as a decoding step on a GPU
    must not. Kept on a code in place of the layout, whose tensors would cost up to a byte per coefficient."""

    dense: bool
    total: int
    blocks: list | None = None  # RankOrder.blocks
    width: int = 0  # DenseOrder's
    group: int = 1
    runs: list | None = None


def layout_shape(plan: RankOrder | DenseOrder) -> LayoutShape:
    if isinstance(plan, DenseOrder):
        return LayoutShape(True, plan.total, width=plan.width, group=plan.group, runs=plan.runs)
    return LayoutShape(False, plan.total, blocks=plan.blocks)


def rebuild_layout(shape: LayoutShape, ranks: torch.Tensor) -> RankOrder | DenseOrder:
    """The layout `shape` was taken from, for the same ranks [C]: equal to it, with no read back to the host."""
    ranks = ranks.long()
    if shape.dense:
        return DenseOrder(ranks, shape.width, shape.group, shape.total, shape.runs)
    return RankOrder(*_rank_sort(ranks, shape.total), shape.blocks, shape.total)


def encode_blocks(residuals_sorted: torch.Tensor, basis: torch.Tensor, plan: RankOrder,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Eq. 6, truncated: coefficients of residuals [C, D] (rows in `plan.order`) -> packed [sum(ranks)] fp32.
    `dtype`: the matmuls' operand dtype (`matmul_dtype`)."""
    packed = residuals_sorted.new_empty(plan.total + 1)
    residuals_sorted, basis = residuals_sorted.to(dtype), basis.to(dtype)
    for j0, j1, rows, full in plan.blocks:
        coefs = residuals_sorted[:rows] @ basis[j0:j1].T  # [rows, D] x [D, j1 - j0]
        packed[plan.index(j0, j1, rows, full).view(-1)] = coefs.view(-1).float()
    return packed[: plan.total]


def decode_blocks(means_sorted: torch.Tensor, packed: torch.Tensor, basis: torch.Tensor, plan: RankOrder,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Eq. 6: z-hat = z-bar + V[:r]^T c[:r], in place on means [C, D] fp32 (rows in `plan.order`)."""
    basis = basis.to(dtype)
    for j0, j1, rows, coefs in plan.block_coefs(packed, dtype):  # coefs [rows, j1 - j0]
        if dtype == torch.float32:
            means_sorted[:rows].addmm_(coefs, basis[j0:j1])  # [rows, j1 - j0] x [j1 - j0, D]
        else:
            means_sorted[:rows].add_(coefs @ basis[j0:j1])  # the means stay fp32
    return means_sorted


# Dense layout: where ranks are nearly equal (uniform signal, the recommended preset), the coded tokens'
# coefficients fit one zero-padded [C, width] matrix with little waste, so one matmul encodes or decodes
# them all, with no sort and no per-block index, and group-wise quantization works on [C, K, group] views.

DENSE_SLACK = 1.25  # the dense layout is used while C x width <= DENSE_SLACK x sum(ranks)
MAX_RUNS = 8  # ranks constant over at most this many runs of coded order: slices instead of masks


@dataclass
class DenseOrder:
    """Coded tokens in their own order; coefficients as a [C, width] matrix whose row t holds token t's
    r_t coefficients then padding (width: the largest rank, rounded up to a multiple of `group`).

    `runs` [(first, stop, rank)] when the ranks are constant over a few runs of tokens (uniform ranks:
    the water-fill's remainder goes to the first tokens, so two runs): the stream is then a few
    row-major blocks, and every conversion is a slice. Otherwise (None) they go through `mask`.
    """

    ranks: torch.Tensor
    width: int
    group: int
    total: int
    runs: list[tuple[int, int, int]] | None

    @cached_property
    def mask(self) -> torch.Tensor:
        """[C, width] bool: each row's leading r_t entries."""
        return rank_mask(self.ranks, self.width)

    @cached_property
    def kept(self) -> torch.Tensor:
        """[sum(ranks)] long: the flat indices of `mask`'s kept entries, in stream order."""
        return self.mask.view(-1).nonzero()[:, 0]

    @property
    def groups(self) -> torch.Tensor:
        """[C, width / group] bool: group k of token t exists iff k * group < r_t."""
        counts = (self.ranks + self.group - 1) // self.group
        return torch.arange(self.width // self.group, device=self.ranks.device)[None, :] < counts[:, None]

    def to_stream(self, dense: torch.Tensor) -> torch.Tensor:
        """dense [C, width] -> the packed stream [sum(ranks)] (a new tensor)."""
        if self.runs is None:
            return dense.reshape(-1).index_select(0, self.kept)
        return torch.cat([dense[first:stop, :rank].reshape(-1) for first, stop, rank in self.runs])

    def from_stream(self, stream: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The packed stream [sum(ranks)] -> [C, width] (in `dtype`), zeros past each rank."""
        dense = stream.new_zeros((self.ranks.numel(), self.width), dtype=dtype)
        if self.runs is None:
            return dense.masked_scatter_(self.mask, stream.to(dense.dtype))
        offset = 0
        for first, stop, rank in self.runs:
            size = (stop - first) * rank
            dense[first:stop, :rank] = stream[offset : offset + size].view(stop - first, rank)
            offset += size
        return dense

    def zero_padding_(self, dense: torch.Tensor) -> torch.Tensor:
        """Zero every entry past its row's rank, in place."""
        if self.runs is None:
            return dense.masked_fill_(~self.mask, 0)
        for first, stop, rank in self.runs:
            dense[first:stop, rank:] = 0
        return dense

    def fill_padding_(self, dense: torch.Tensor) -> torch.Tensor:
        """Set the padding of each token's last (partial) group to that group's first value, in place: a
        value the group holds, so group minima and maxima ignore the padding. Absent groups keep theirs."""
        if self.runs is None:
            grouped = dense.view(dense.shape[0], -1, self.group)
            return dense.copy_(torch.where(self.mask.view_as(grouped), grouped, grouped[:, :, :1]).view_as(dense))
        for first, stop, rank in self.runs:
            start = rank // self.group * self.group
            if rank % self.group:
                end = start + self.group
                dense[first:stop, rank:end] = dense[first:stop, start : start + 1]
        return dense


def dense_order(ranks: torch.Tensor, group: int = 1, slack: float = DENSE_SLACK) -> DenseOrder | None:
    """The `DenseOrder` of ranks [C], or None where padding would exceed `slack` (use `rank_order`)."""
    ranks = ranks.long()
    total = int(ranks.sum())
    if total == 0:
        return None
    width = -(-int(ranks.max()) // group) * group
    if ranks.numel() * width > slack * total:
        return None
    edges = (ranks[1:] != ranks[:-1]).nonzero()[:, 0] + 1
    runs = None
    if edges.numel() < MAX_RUNS:
        bounds = [0, *edges.tolist(), ranks.numel()]
        values = ranks[bounds[:-1]].tolist()
        runs = [(first, stop, rank) for first, stop, rank in zip(bounds, bounds[1:], values)]
    return DenseOrder(ranks, width, group, total, runs)


def padded_basis(basis: torch.Tensor, width: int) -> torch.Tensor:
    """basis [R, D] cut or zero-padded to `width` rows (width may pass R when rounded up to a group)."""
    if width <= basis.shape[0]:
        return basis[:width]
    return torch.cat((basis, basis.new_zeros(width - basis.shape[0], basis.shape[1])))


def encode_dense(residuals: torch.Tensor, basis: torch.Tensor, plan: DenseOrder,
                 dtype: torch.dtype = torch.float32, as_computed: bool = False) -> torch.Tensor:
    """Eq. 6 for residuals [C, D]: [C, width] fp32 coefficients (entries past a token's rank are not zero:
    `plan.to_stream` keeps the stored ones); in the matmul's `dtype` if `as_computed` (the same values: a
    reader that converts them itself spares a pass)."""
    coefs = residuals.to(dtype) @ padded_basis(basis, plan.width).to(dtype).T
    return coefs if as_computed else coefs.float()


def decode_dense(means: torch.Tensor, coefs: torch.Tensor, basis: torch.Tensor, plan: DenseOrder,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Eq. 6: z-hat = z-bar + V^T c, in place on means [C, D] fp32; coefs [C, width], zeros past each rank."""
    basis = padded_basis(basis, plan.width).to(dtype)
    if dtype == torch.float32:
        return means.addmm_(coefs, basis)
    return means.add_(coefs.to(dtype) @ basis)  # the means stay fp32


def matmul_dtype(name: str, device) -> torch.dtype:
    """`VarRateConfig.projection_dtype` on `device`: 'auto' is bfloat16 where the device multiplies it
    natively (a CUDA GPU with bf16; a CPU with AMX or AVX-512 BF16, as oneDNN reports), else float32."""
    if name == "auto":
        return torch.bfloat16 if _native_bf16(torch.device(device).type) else torch.float32
    return getattr(torch, name)


@cache
@torch.compiler.assume_constant_result  # a property of the machine: torch.compile takes it as a constant
def _native_bf16(device_type: str) -> bool:
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        try:  # a private oneDNN query: a torch build without it gets fp32
            return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False
    return False
