"""Optional C loops for coding a prompt and for a compact layer's read: when the codec uses them.

Attending over the codes (`attend.attend_codes`) spends most of a read on elementwise passes over
layer-sized buffers: unpacking and scaling the codes, adding the anchor means, RoPE, the scores.
`native.c` does each in one pass; nothing else changes (same arithmetic, same results: bit for bit
for the dequantization, to float rounding for the scores). Each function here returns None (or False)
where its loop does not apply: tensors not on the CPU (a GPU runs the PyTorch path), other dtypes, or no
library (no compiler, or `HF_VARRATE_NATIVE=0`; `native_build` builds it and says why once); the caller
then takes its PyTorch path.

Coding a prompt (`pipeline`'s fast path) spends most of its time outside its matmuls in the same kind of
passes: gathering and un-rotating the joint rows, picking each token's nearest anchors from the distance
scores (`torch.topk` over a few hundred columns is slow on CPU), subtracting the anchor means, and the
4-bit quantization of the coefficients. The prefill's loops below do each in one pass, bit for bit as
the PyTorch path (the anchors' order among exactly equal distances aside: see `smallest_columns`).

The loops run as torch custom ops (`ops`, namespace ``hf_varrate``) with fake implementations, so
`torch.compile` traces a read that uses them as opaque nodes of its graph (eagerly the wrappers call the
ops' kernels directly, without the dispatcher's overhead). They run on `torch.get_num_threads()`
threads (one without OpenMP), with the same results on any number.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from . import ops
from .native_build import ENV_SWITCH, library

__all__ = ["ENV_SWITCH", "add_anchor_shares", "anchor_keys", "available", "coded_key_scores", "dequantize_runs",
           "component_ranges", "disabled", "group_ranges", "joint_rows", "quantize_component_runs", "quantize_runs",
           "smallest_columns", "subtract_means"]

_off = False  # set by `disabled()`


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the C loops are in use (built and loaded here, and not switched off). A compiled graph takes
    the answer at tracing time: compile again (`torch._dynamo.reset()`) after `disabled()` changes it."""
    return not _off and library() is not None


@contextmanager
def disabled():
    """Within this block every caller takes its PyTorch path (to compare the two, or to rule the C loops out)."""
    global _off
    previous, _off = _off, True
    try:
        yield
    finally:
        _off = previous


def _run(op, loop, *args):
    """The custom op while torch.compile traces (an opaque node of its graph), else its kernel `loop` called
    directly (the same function, without the dispatcher's overhead on every call)."""
    return op(*args) if torch.compiler.is_compiling() else loop(*args)


def dequantize_runs(coefs, runs: list[tuple[int, int, int]] | None, dtype: torch.dtype,
                    width: int | None = None) -> torch.Tensor | None:
    """`quantization.dequantize_runs(coefs, layout).to(dtype)` in one pass, for codes of 2, 3, 4 or 8 bits on CPU
    and dtype float32 or bfloat16, with scales per token, or per component (`width`: the layout's, their grid's
    row); None where it does not apply (the caller dequantizes in PyTorch)."""
    codes = coefs.codes
    if (runs is None or codes.device.type != "cpu" or coefs.bits not in (2, 3, 4, 8)
            or coefs.axis not in ("token", "component")
            or dtype not in (torch.float32, torch.bfloat16) or not available()):
        return None
    values = _run_values(runs)
    scales = min(coefs.steps.numel(), coefs.mins.numel())
    if coefs.axis == "component":  # a [T, width] grid: row t // group of token t (runs hold tokens 0..C-1)
        tokens = -(-max((stop for _, stop, _ in runs), default=0) // coefs.group)
        fits = width is not None and tokens * width == scales and all(0 <= first and rank <= width
                                                                      for first, _, rank in runs)
    else:
        width = 0
        fits = sum((stop - first) * -(-rank // coefs.group) for first, stop, rank in runs) <= scales
    if values != coefs.count or values * coefs.bits > 8 * codes.numel() or not fits:
        return None  # not this stream's runs: PyTorch's path raises
    table = torch.tensor(runs, dtype=torch.int64).reshape(-1, 3)
    return _run(ops.dequantize_runs, ops.dequantize_runs_loop, codes.contiguous(), coefs.bits, coefs.steps.float()
                .contiguous(), coefs.mins.float().contiguous(), table, coefs.group, width, coefs.count,
                dtype == torch.bfloat16)


def coded_key_scores(proj: torch.Tensor, anchors: torch.Tensor, neighbours: torch.Tensor, turns: torch.Tensor,
                     positions: torch.Tensor, queries: torch.Tensor) -> torch.Tensor | None:
    """The coded tokens' unscaled scores [H, rows, C]: queries [H, rows, d] (paired dims) against the keys
    `anchors[neighbours].sum(1) + proj`, rotated by `turns[positions]` (see `attend._coded_keys`). proj
    [C, H * d] fp32 or bf16, anchors [A, H * d] fp32, neighbours [C, n] int64, turns [S, d/2, 2] fp32,
    positions [C] int64. None where it does not apply; an index out of range raises IndexError."""
    if proj.device.type != "cpu" or proj.dtype not in (torch.float32, torch.bfloat16) or not available():
        return None
    return _run(ops.coded_key_scores, ops.coded_key_scores_loop, proj.contiguous(), anchors.float().contiguous(),
                neighbours.long().contiguous(), turns.float().contiguous(), positions.long().contiguous(),
                queries.float().contiguous())


def anchor_keys(exact_keys: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, turns: torch.Tensor,
                n_neighbours: int) -> torch.Tensor | None:
    """`attend._anchor_keys` in one pass: exact_keys [H, E, d] (post-RoPE), rows [A] (the anchors among them),
    positions [A], turns [S, d/2, 2] -> [A, H * d] fp32, un-rotated, / n_neighbours, pairs adjacent. None where
    it does not apply; an index out of range raises IndexError."""
    if exact_keys.device.type != "cpu" or not available():
        return None
    return _run(ops.anchor_keys, ops.anchor_keys_loop, exact_keys.float().contiguous(), rows.long().contiguous(),
                positions.long().contiguous(), turns.float().contiguous(), n_neighbours)


def add_anchor_shares(coded: torch.Tensor, exact: torch.Tensor, neighbours: torch.Tensor,
                      anchor_rows: torch.Tensor) -> bool:
    """exact[..., anchor_rows[neighbours[t, n]]] += coded[..., t] / n_neighbours for every t and n, in place:
    coded [..., C] and exact [..., E] are fp32 views into one [..., N] buffer whose last dim is contiguous.
    False where it does not apply (the caller adds them with index_add_); an index out of range raises
    IndexError."""
    if coded.device.type != "cpu" or not ops.shares_rows(coded, exact) or not available():
        return False
    _run(ops.add_anchor_shares, ops.add_anchor_shares_loop, coded, exact, neighbours.long().contiguous(),
         anchor_rows.long().contiguous())
    return True


# The prefill's loops ----------------------------------------------------------------------------------------

def joint_rows(keys: torch.Tensor, values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               scales: torch.Tensor | None) -> torch.Tensor | None:
    """`joint.joint_rows(keys, values, cos, sin, positions)`, then `* scales` where given, in one pass, bit for bit:
    keys, values [1, H, S, d] fp32, cos, sin [1, S, d], positions [n], scales [D] fp32 or None -> z [n, D] fp32.
    None where it does not apply."""
    if (keys.device.type != "cpu" or keys.dtype != torch.float32 or values.dtype != torch.float32 or not available()
            or (scales is not None and scales.dtype != torch.float32)):
        return None
    return _run(ops.joint_rows, ops.joint_rows_loop, keys[0], values[0], cos[0].float(), sin[0].float(),
                positions.long(), scales)


def smallest_columns(scores: torch.Tensor, k: int) -> torch.Tensor | None:
    """`scores.topk(k, dim=-1, largest=False).indices` for scores [n, A] fp32 on CPU ([n, k] int64), the same
    indices in the same order, without topk's selection and sort per row: one pass per row keeps the k + 1
    smallest. Where two of them are equal, the order torch.topk gives equal values is its sort's, so those
    rows (rare but for repeated tokens in the first layers) are taken from torch.topk itself. None where it
    does not apply, and while torch.compile traces (the rows to retake depend on the data)."""
    if (scores.device.type != "cpu" or scores.dtype != torch.float32 or scores.dim() != 2 or k <= 0
            or torch.compiler.is_compiling() or not available()):
        return None
    index, ties = ops.smallest_columns_loop(scores, k)
    rows = ties.nonzero()[:, 0]
    if rows.numel():
        index[rows] = scores.index_select(0, rows).topk(k, dim=-1, largest=False).indices
    return index


def subtract_means(z: torch.Tensor, anchors: torch.Tensor, neighbours: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """`z.sub_(gather_means(anchors, neighbours))` in one pass, bit for bit (Eq. 2): z [C, D] fp32
    contiguous, in place; anchors [A, D] fp32; neighbours [C, c]. Returns the means [C, D] if `keep`, else an
    empty [0, D] tensor; None where it does not apply (nothing done)."""
    if (z.device.type != "cpu" or z.dtype != torch.float32 or anchors.dtype != torch.float32 or not z.is_contiguous()
            or neighbours.shape[1] == 0 or not available()):
        return None
    return _run(ops.subtract_means, ops.subtract_means_loop, z, anchors, neighbours.long(), keep)


def group_ranges(coefs: torch.Tensor, runs: list[tuple[int, int, int]], group: int) -> list[torch.Tensor] | None:
    """Each group's [lo, hi] (fp32 [G], stream order) of dense coefficients [C, W] fp32 or bf16 on CPU whose ranks
    are constant over `runs` (`projection.DenseOrder.runs`), as `quantization.quantize_dense` takes its amin /
    amax. None where it does not apply."""
    if (coefs.device.type != "cpu" or coefs.dtype not in (torch.float32, torch.bfloat16) or coefs.dim() != 2
            or not available() or not _runs_fit(runs, coefs.shape)):
        return None
    groups = sum((stop - first) * -(-rank // group) for first, stop, rank in runs)
    return _run(ops.group_ranges, ops.group_ranges_loop, coefs, _run_table(runs), group, groups)


def quantize_runs(coefs: torch.Tensor, runs: list[tuple[int, int, int]], group: int, bits: int, mins: torch.Tensor,
                  divisors: torch.Tensor) -> torch.Tensor:
    """The packed stream of `bits`-bit codes (2, 3 or 4) of `coefs` (as `group_ranges` takes them), given each
    group's min and divisor (fp32 [G]; inf where a group is constant): what `quantization.quantize_dense` packs,
    bit for bit. Call only where `group_ranges` applied."""
    count = _run_values(runs)
    return _run(ops.quantize_runs, ops.quantize_runs_loop, coefs, _run_table(runs), group, bits, mins, divisors,
                count)


def component_ranges(coefs: torch.Tensor, runs: list[tuple[int, int, int]] | None, group: int,
                     width: int) -> list[torch.Tensor] | None:
    """Each (group of `group` tokens, component)'s [lo, hi] (fp32 [T, width]) of dense coefficients [C, W] fp32 or
    bf16 on CPU whose ranks are constant over `runs`, over the tokens that have the component (0 and 0 where none
    does), as `components.quantize_components` ranges them. None where it does not apply."""
    if (runs is None or coefs.device.type != "cpu" or coefs.dtype not in (torch.float32, torch.bfloat16)
            or coefs.dim() != 2 or not 0 < width <= coefs.shape[1] or not available()
            or not _runs_fit(runs, coefs.shape) or any(rank > width for _, _, rank in runs)):
        return None
    return _run(ops.component_ranges, ops.component_ranges_loop, coefs, _run_table(runs), group, width)


def quantize_component_runs(coefs: torch.Tensor, runs: list[tuple[int, int, int]], group: int, width: int, bits: int,
                            mins: torch.Tensor, divisors: torch.Tensor) -> torch.Tensor:
    """The packed stream of `bits`-bit codes (2, 3 or 4) of `coefs` (as `component_ranges` takes them), given each
    (group of tokens, component)'s min and divisor (fp32 [T, width]; inf where constant): what
    `components.quantize_components` packs, bit for bit. Call only where `component_ranges` applied."""
    count = _run_values(runs)
    return _run(ops.quantize_component_runs, ops.quantize_component_runs_loop, coefs, _run_table(runs), group, width,
                bits, mins.contiguous(), divisors.contiguous(), count)


def _runs_fit(runs, shape) -> bool:
    """Whether runs [(first, stop, rank)] tile rows 0..C of a [C, W] matrix in order, each rank within W."""
    at = 0
    for first, stop, rank in runs:
        if first != at or stop < first or not 0 <= rank <= shape[1]:
            return False
        at = stop
    return at == shape[0]


def _run_values(runs) -> int:
    """How many coefficients runs [(first, stop, rank)] hold."""
    return sum((stop - first) * rank for first, stop, rank in runs)


def _run_table(runs) -> torch.Tensor:
    return torch.tensor(runs, dtype=torch.int64).reshape(-1, 3)
