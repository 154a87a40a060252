"""The C loops of `native.c` as torch custom ops (namespace ``hf_varrate``), so that `torch.compile` can trace
a read that uses them.

Each op has a CPU kernel (the C loop, through `native_build.library()`) and a fake implementation (the
output's shape and dtype, for tracing). They are registered for the CPU only: on any other device `native`
returns None and the caller takes its PyTorch path, which is what a GPU runs. A traced graph holds the op
as one opaque node, so the C loop reads real memory at run time, never a traced tensor's (a ctypes call on a
fake tensor, which has no memory, could crash the process).

Arguments are as `native`'s wrappers pass them: contiguous, in the dtypes listed there. An index out of
range raises IndexError (the C loops do not check), as the PyTorch path's indexing would.
"""

from __future__ import annotations

import torch

from .native_build import library

_NAMESPACE = "hf_varrate"


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


def _check_range(index: torch.Tensor, size: int, name: str) -> None:
    if index.numel() and not (0 <= int(index.min()) and int(index.max()) < size):  # CPU tensors: no device sync
        raise IndexError(f"{name} out of range: indices must lie in [0, {size}), got [{int(index.min())}, "
                         f"{int(index.max())}]")


def _loops():
    loops = library()
    if loops is None:  # `native` calls an op only where the library is loaded
        raise RuntimeError("hf_varrate's C loops are not loaded: call the PyTorch path instead")
    return loops


def dequantize_runs_loop(codes: torch.Tensor, bits: int, steps: torch.Tensor, mins: torch.Tensor, runs: torch.Tensor,
                         group: int, width: int, count: int, bf16: bool) -> torch.Tensor:
    """`bits`-bit codes (2, 3, 4 or 8) uint8 [ceil(count / 8) * bits], steps and mins fp32 (per token's group:
    [groups]; per component, width > 0: [T * width]), runs int64 [n, 3] (first, stop, rank) -> values [count],
    bf16 or fp32."""
    if bits not in (2, 3, 4, 8) or codes.numel() * 8 < count * bits:
        raise ValueError(f"dequantize_runs: {count} values of {bits} bits do not fit {codes.numel()} bytes of codes")
    out = torch.empty(count, dtype=torch.bfloat16 if bf16 else torch.float32)
    codes, steps, mins, runs = codes.contiguous(), steps.contiguous(), mins.contiguous(), runs.contiguous()
    _loops().dequantize_runs(_ptr(codes), bits, _ptr(steps), _ptr(mins), _ptr(runs), runs.shape[0], group, width,
                             _ptr(out), int(bf16), torch.get_num_threads())
    return out


dequantize_runs = torch.library.custom_op(f"{_NAMESPACE}::dequantize_runs", dequantize_runs_loop,
                                          mutates_args=(), device_types="cpu")


@dequantize_runs.register_fake
def _(codes, bits, steps, mins, runs, group, width, count, bf16):
    return codes.new_empty(count, dtype=torch.bfloat16 if bf16 else torch.float32)


def coded_key_scores_loop(proj: torch.Tensor, anchors: torch.Tensor, neighbours: torch.Tensor, turns: torch.Tensor,
                          positions: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """proj [C, H * d] fp32 or bf16, anchors [A, H * d] fp32, neighbours [C, n] int64, turns [S, d/2, 2] fp32,
    positions [C] int64, queries [H, rows, d] fp32 -> scores [H, rows, C] fp32 (`native.coded_key_scores`)."""
    _check_range(neighbours, anchors.shape[0], "neighbours")
    _check_range(positions, turns.shape[0], "positions")
    heads, rows, dim = queries.shape
    scores = torch.empty(heads, rows, proj.shape[0])
    proj, anchors, neighbours = proj.contiguous(), anchors.contiguous(), neighbours.contiguous()
    turns, positions, queries = turns.contiguous(), positions.contiguous(), queries.contiguous()
    _loops().coded_key_scores(_ptr(proj), int(proj.dtype == torch.bfloat16), proj.shape[0], heads, dim, _ptr(anchors),
                              _ptr(neighbours), neighbours.shape[1], _ptr(turns), _ptr(positions), _ptr(queries), rows,
                              _ptr(scores), torch.get_num_threads())
    return scores


coded_key_scores = torch.library.custom_op(f"{_NAMESPACE}::coded_key_scores", coded_key_scores_loop,
                                           mutates_args=(), device_types="cpu")


@coded_key_scores.register_fake
def _(proj, anchors, neighbours, turns, positions, queries):
    return queries.new_empty(queries.shape[0], queries.shape[1], proj.shape[0], dtype=torch.float32)


def anchor_keys_loop(exact_keys: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, turns: torch.Tensor,
                     n_neighbours: int) -> torch.Tensor:
    """exact_keys [H, E, d] fp32, rows and positions [A] int64, turns [S, d/2, 2] fp32 -> [A, H * d] fp32
    (`native.anchor_keys`)."""
    heads, n_exact, dim = exact_keys.shape
    _check_range(rows, n_exact, "anchor rows")
    _check_range(positions, turns.shape[0], "positions")
    keys, rows, positions, turns = (exact_keys.contiguous(), rows.contiguous(), positions.contiguous(),
                                    turns.contiguous())
    out = torch.empty(rows.numel(), heads * dim)
    _loops().anchor_keys(_ptr(keys), heads, n_exact, dim, _ptr(rows), _ptr(positions), rows.numel(), _ptr(turns),
                         n_neighbours, _ptr(out))
    return out


anchor_keys = torch.library.custom_op(f"{_NAMESPACE}::anchor_keys", anchor_keys_loop,
                                      mutates_args=(), device_types="cpu")


@anchor_keys.register_fake
def _(exact_keys, rows, positions, turns, n_neighbours):
    return exact_keys.new_empty(rows.shape[0], exact_keys.shape[0] * exact_keys.shape[2], dtype=torch.float32)


def add_anchor_shares_loop(coded: torch.Tensor, exact: torch.Tensor, neighbours: torch.Tensor,
                           anchor_rows: torch.Tensor) -> None:
    """exact[..., anchor_rows[neighbours[t, n]]] += coded[..., t] / n for every t and n, in place: coded [..., C]
    and exact [..., E] fp32 with their last dim contiguous, neighbours [C, n] and anchor_rows [A] int64. In one
    C pass where both have the same leading strides and those flatten to rows of one stride (views into one
    buffer, as `attend` splits its weights); else (e.g. `exact` copied by a traced graph) with index_add_."""
    _check_range(neighbours, anchor_rows.numel(), "neighbours")
    _check_range(anchor_rows, exact.shape[-1], "anchor rows")
    if shares_rows(coded, exact):
        row_stride = coded.stride(-2) if coded.dim() > 1 else coded.shape[-1]
        _loops().add_anchor_shares(_ptr(coded), _ptr(exact), coded.shape[:-1].numel(), row_stride, coded.shape[-1],
                                   _ptr(neighbours), neighbours.shape[1], _ptr(anchor_rows), torch.get_num_threads())
        return
    share = coded / neighbours.shape[1]
    for targets in anchor_rows.index_select(0, neighbours.t().reshape(-1)).view(neighbours.shape[1], -1):
        exact.index_add_(-1, targets, share)


add_anchor_shares = torch.library.custom_op(f"{_NAMESPACE}::add_anchor_shares", add_anchor_shares_loop,
                                            mutates_args=("exact",), device_types="cpu")


@add_anchor_shares.register_fake
def _(coded, exact, neighbours, anchor_rows):
    return None


def shares_rows(coded: torch.Tensor, exact: torch.Tensor) -> bool:
    """Whether `add_anchor_shares`'s C loop can walk coded and exact together: fp32, last dims contiguous, the
    same leading strides, flattening to rows of one stride."""
    if coded.dtype != torch.float32 or exact.dtype != torch.float32 or coded.stride(-1) != 1 or exact.stride(-1) != 1:
        return False
    if coded.stride()[:-1] != exact.stride()[:-1] or coded.shape[:-1] != exact.shape[:-1]:
        return False
    return all(coded.stride(i) == coded.stride(i + 1) * coded.shape[i + 1] for i in range(coded.dim() - 2))


# The prefill's loops (coding a prompt: `pipeline`'s fast path).

def joint_rows_loop(keys: torch.Tensor, values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    positions: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """keys, values [H, S, d] fp32 (any strides, d contiguous), cos, sin [S, d] fp32, positions [n] int64, scales
    [D] fp32 or None -> z [n, D] fp32 (`native.joint_rows`)."""
    heads, seq_len, dim = keys.shape
    _check_range(positions, seq_len, "positions")
    keys, values = _dim_contiguous(keys), _dim_contiguous(values)
    cos, sin, positions = cos.contiguous(), sin.contiguous(), positions.contiguous()
    scales = scales.contiguous() if scales is not None else None
    out = torch.empty(positions.numel(), 2 * heads * dim)
    _loops().joint_rows(_ptr(keys), _ptr(values), heads, dim, keys.stride(0), keys.stride(1), values.stride(0),
                        values.stride(1), _ptr(cos), _ptr(sin), _ptr(positions), positions.numel(),
                        _ptr(scales) if scales is not None else None, _ptr(out), torch.get_num_threads())
    return out


joint_rows = torch.library.custom_op(f"{_NAMESPACE}::joint_rows", joint_rows_loop, mutates_args=(), device_types="cpu")


@joint_rows.register_fake
def _(keys, values, cos, sin, positions, scales):
    return keys.new_empty(positions.shape[0], 2 * keys.shape[0] * keys.shape[2], dtype=torch.float32)


def smallest_columns_loop(scores: torch.Tensor, k: int) -> list[torch.Tensor]:
    """scores [n, A] fp32 -> [indices [n, k] int64, ties [n] bool]: each row's k smallest columns, smallest first
    (equal values in column order), and whether the row has equal values among its k + 1 smallest (or a NaN),
    where torch.topk may order them otherwise (`native.smallest_columns`)."""
    scores = scores.contiguous()
    if not 0 < k <= scores.shape[1]:
        raise ValueError(f"k must be in [1, {scores.shape[1]}] (the columns), got {k}")
    out, ties = torch.empty(scores.shape[0], k, dtype=torch.int64), torch.empty(scores.shape[0], dtype=torch.bool)
    _loops().smallest_columns(_ptr(scores), scores.shape[0], scores.shape[1], k, _ptr(out), _ptr(ties),
                              torch.get_num_threads())
    return [out, ties]


smallest_columns = torch.library.custom_op(f"{_NAMESPACE}::smallest_columns", smallest_columns_loop, mutates_args=(),
                                           device_types="cpu")


@smallest_columns.register_fake
def _(scores, k):
    return [scores.new_empty(scores.shape[0], k, dtype=torch.int64),
            scores.new_empty(scores.shape[0], dtype=torch.bool)]


def subtract_means_loop(z: torch.Tensor, anchors: torch.Tensor, neighbours: torch.Tensor, keep: bool) -> torch.Tensor:
    """z [n, D] fp32 contiguous -= the mean of its rows of anchors [A, D] fp32 (neighbours [n, k] int64), in place;
    returns the means [n, D] if `keep`, else an empty [0, D] tensor (`native.subtract_means`)."""
    _check_range(neighbours, anchors.shape[0], "neighbours")
    if not z.is_contiguous():
        raise ValueError("subtract_means writes z in place: it must be contiguous")
    anchors, neighbours = anchors.contiguous(), neighbours.contiguous()
    means = torch.empty(z.shape[0] if keep else 0, z.shape[1])
    _loops().subtract_means(_ptr(z), z.shape[0], z.shape[1], _ptr(anchors), _ptr(neighbours), neighbours.shape[1],
                            _ptr(means) if keep else None, torch.get_num_threads())
    return means


subtract_means = torch.library.custom_op(f"{_NAMESPACE}::subtract_means", subtract_means_loop, mutates_args=("z",),
                                         device_types="cpu")


@subtract_means.register_fake
def _(z, anchors, neighbours, keep):
    return z.new_empty(z.shape[0] if keep else 0, z.shape[1])


def group_ranges_loop(coefs: torch.Tensor, runs: torch.Tensor, group: int, n_groups: int) -> list[torch.Tensor]:
    """Dense coefficients [C, W] fp32 or bf16, runs int64 [n, 3] (first, stop, rank) -> [lo, hi], fp32 [n_groups]:
    each group's smallest and largest value, stream order (`native.quantize_runs`)."""
    coefs, runs = coefs.contiguous(), runs.contiguous()
    lo, hi = torch.empty(n_groups), torch.empty(n_groups)
    _loops().group_ranges(_ptr(coefs), int(coefs.dtype == torch.bfloat16), coefs.shape[1], _ptr(runs), runs.shape[0],
                          group, _ptr(lo), _ptr(hi), torch.get_num_threads())
    return [lo, hi]


group_ranges = torch.library.custom_op(f"{_NAMESPACE}::group_ranges", group_ranges_loop, mutates_args=(),
                                       device_types="cpu")


@group_ranges.register_fake
def _(coefs, runs, group, n_groups):
    return [coefs.new_empty(n_groups, dtype=torch.float32), coefs.new_empty(n_groups, dtype=torch.float32)]


def quantize_runs_loop(coefs: torch.Tensor, runs: torch.Tensor, group: int, bits: int, mins: torch.Tensor,
                       divisors: torch.Tensor, count: int) -> torch.Tensor:
    """Dense coefficients [C, W] (as `group_ranges_loop`), each group's min and divisor fp32 [G] -> the packed
    `bits`-bit stream (2, 3 or 4) uint8 [ceil(count / 8) * bits] (`native.quantize_runs`)."""
    if bits not in (2, 3, 4):
        raise ValueError(f"quantize_runs: bits must be 2, 3 or 4, got {bits}")
    coefs, runs, mins, divisors = coefs.contiguous(), runs.contiguous(), mins.contiguous(), divisors.contiguous()
    scratch, codes = torch.empty(count, dtype=torch.uint8), torch.empty(-(-count // 8) * bits, dtype=torch.uint8)
    _loops().quantize_runs(_ptr(coefs), int(coefs.dtype == torch.bfloat16), coefs.shape[1], _ptr(runs), runs.shape[0],
                           group, bits, _ptr(mins), _ptr(divisors), _ptr(scratch), count, _ptr(codes),
                           torch.get_num_threads())
    return codes


quantize_runs = torch.library.custom_op(f"{_NAMESPACE}::quantize_runs", quantize_runs_loop, mutates_args=(),
                                        device_types="cpu")


@quantize_runs.register_fake
def _(coefs, runs, group, bits, mins, divisors, count):
    return coefs.new_empty(-(-count // 8) * bits, dtype=torch.uint8)


def component_ranges_loop(coefs: torch.Tensor, runs: torch.Tensor, group: int, width: int) -> list[torch.Tensor]:
    """Dense coefficients [C, W] fp32 or bf16, runs int64 [n, 3] -> [lo, hi], fp32 [ceil(C / group), width]: each
    component's smallest and largest value over each `group` tokens that have it (`native.component_ranges`)."""
    coefs, runs = coefs.contiguous(), runs.contiguous()
    tokens = coefs.shape[0]
    lo, hi = torch.empty(-(-tokens // group), width), torch.empty(-(-tokens // group), width)
    _loops().component_ranges(_ptr(coefs), int(coefs.dtype == torch.bfloat16), coefs.shape[1], _ptr(runs),
                              runs.shape[0], tokens, group, width, _ptr(lo), _ptr(hi), torch.get_num_threads())
    return [lo, hi]


component_ranges = torch.library.custom_op(f"{_NAMESPACE}::component_ranges", component_ranges_loop, mutates_args=(),
                                           device_types="cpu")


@component_ranges.register_fake
def _(coefs, runs, group, width):
    shape = (-(-coefs.shape[0] // group), width)
    return [coefs.new_empty(shape, dtype=torch.float32), coefs.new_empty(shape, dtype=torch.float32)]


def quantize_component_runs_loop(coefs: torch.Tensor, runs: torch.Tensor, group: int, width: int, bits: int,
                                 mins: torch.Tensor, divisors: torch.Tensor, count: int) -> torch.Tensor:
    """Dense coefficients [C, W] (as `component_ranges_loop`), a min and divisor per (group of tokens, component)
    fp32 [T, width] -> the packed `bits`-bit stream (2, 3 or 4) uint8 [ceil(count / 8) * bits]."""
    if bits not in (2, 3, 4):
        raise ValueError(f"quantize_component_runs: bits must be 2, 3 or 4, got {bits}")
    grid = -(-coefs.shape[0] // group) * width
    if mins.numel() != grid or divisors.numel() != grid:
        raise ValueError(f"quantize_component_runs: mins and divisors need {grid} values (a [T, width] grid), got "
                         f"{mins.numel()} and {divisors.numel()}")
    coefs, runs, mins, divisors = coefs.contiguous(), runs.contiguous(), mins.contiguous(), divisors.contiguous()
    scratch, codes = torch.empty(count, dtype=torch.uint8), torch.empty(-(-count // 8) * bits, dtype=torch.uint8)
    _loops().quantize_component_runs(_ptr(coefs), int(coefs.dtype == torch.bfloat16), coefs.shape[1], _ptr(runs),
                                     runs.shape[0], group, width, bits, _ptr(mins), _ptr(divisors), _ptr(scratch),
                                     count, _ptr(codes), torch.get_num_threads())
    return codes


quantize_component_runs = torch.library.custom_op(f"{_NAMESPACE}::quantize_component_runs",
                                                  quantize_component_runs_loop, mutates_args=(), device_types="cpu")


@quantize_component_runs.register_fake
def _(coefs, runs, group, width, bits, mins, divisors, count):
    return coefs.new_empty(-(-count // 8) * bits, dtype=torch.uint8)


def _dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()
