"""Algorithm 1 for one sequence of one layer: compress a prompt, and reconstruct it.

Shapes: keys, values [1, H, S, d] post-RoPE (one sequence, padding already removed);
queries [1, Hq, W, d] post-RoPE; cos, sin [1, S, d]; basis [R, D] (fp32 or half precision).

The fast path works on the coded tokens sorted by decreasing rank (`projection.rank_order`), so
encode and decode cost about sum(r_t) x D instead of C x R x D; where ranks are nearly equal (uniform
signal) the coefficients are instead one zero-padded matrix in coded order (`projection.dense_order`),
coded, quantized and decoded without a sort or a per-block index. Anchor means are row gathers; the
materialized reconstruction reuses the encoder's anchor means. Each stage runs under a
`torch.profiler.record_function("varrate.<stage>")` label, which costs nothing without a profiler.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
from torch.profiler import record_function

from .allocation import distortion_ranks, topk_ranks, waterfill_ranks
from . import native
from .anchors import anchor_positions, exact_mask, gather_means, nearest_anchors_mm
from .budget import coefficient_budget, counted_dtype
from .joint import joint_rows
from .layer_budget import budget_scale
from .packing import PromptCode, meta_bytes_per_token, smallest_uint
from .projection import (DENSE_SLACK, DenseOrder, RankOrder, decode_blocks, decode_dense, dense_order, encode,
                         encode_blocks, encode_dense, layout_shape, matmul_dtype, pack, rank_order, rebuild_layout)
from .codes import QuantizedCoefs
from .components import quantize_components
from .quantization import dequantize, dequantize_dense, quantize, quantize_dense
from .reference import decode_reference, encode_reference
from .rope import rotate_heads
from ..signals import SIGNALS, SignalInputs, coded_salience

if TYPE_CHECKING:  # annotations only: the codec reads a config's fields, it never builds one
    from ..config import VarRateConfig


def encode_prompt(keys, values, queries, cos, sin, basis, config: VarRateConfig, scaling: float,
                  scales: torch.Tensor | None = None, layer_share=None) -> PromptCode:
    """Compress one prompt. Returns its `PromptCode`; `stored_exactly` when the budget can't cover
    the exact set plus the floor for every coded token (or when budget == 1: nothing to save)."""
    return compress_prompt(keys, values, queries, cos, sin, basis, config, scaling, reconstruct=False,
                           scales=scales, layer_share=layer_share)[0]


def compress_prompt(keys, values, queries, cos, sin, basis, config: VarRateConfig, scaling: float,
                    reconstruct: bool = True, scales: torch.Tensor | None = None, layer_share=None):
    """Encode one prompt and (if `reconstruct`) rebuild it in the same pass.

    `scales` [D] (from `balance.coding_basis`) multiplies z_t before coding and divides the decoded
    z_t after; `basis` is then the basis of that scaled space. Returns (code, keys_hat, values_hat);
    the reconstruction [1, H, S, d] equals `decode_prompt(code, ...)` bit for bit, and is None when
    not asked for or stored exactly. `layer_share` = (energies [L, R], this layer's row) scales the
    coefficient budget by `layer_budget.budget_scale` (per-layer budgets; None: the uniform Eq. 3); a float
    scales it directly (the evaluation's measured per-layer budgets, evaluation/layer_sensitivity.py).
    """
    code, rank, total = _layout(keys, basis, config, layer_share)
    if code.stored_exactly:
        return code, None, None
    coded_pos, anchor_pos = code.coded_pos, code.anchor_pos
    floor = rank_floor(config, total, coded_pos.numel(), rank)
    allocate = waterfill_ranks if config.allocation == "waterfill" else topk_ranks
    inputs = SignalInputs(queries, keys, scaling, coded_pos, code.seq_len, config.stride, config.window,
                          config.pool_kernel, config.seed)
    salience = None
    by_energy = config.allocation == "distortion"  # ranks from the coefficients themselves, after the anchors
    if not by_energy and not SIGNALS[config.signal].after_anchors:
        with record_function("varrate.salience"):
            salience = coded_salience(config.signal, inputs)
    if config.implementation == "reference":
        packed = encode_reference(code, keys, values, cos, sin, salience, basis, rank, total, config, floor)
        code.coefs = _store(packed, code.ranks, keys.dtype, config)
        if not reconstruct:
            return code, None, None
        k_hat, v_hat = keys.clone(), values.clone()
        decode_reference(code, coef_values(code), k_hat, v_hat, cos, sin, basis)
        return code, k_hat, v_hat
    plan = None
    if salience is not None:
        with record_function("varrate.allocation"):
            ranks = allocate(salience, total, floor, rank)  # Eq. 5
            plan = _plan(ranks, _group(config), _by_component(config))
            coded_pos = _in_order(coded_pos, plan)  # coded positions, by decreasing rank (RankOrder)
    with record_function("varrate.joint"):
        z_anchors = _joint(keys, values, cos, sin, anchor_pos, scales)  # [A, D] fp32
        z = _joint(keys, values, cos, sin, coded_pos, scales)  # [C, D] fp32
    with record_function("varrate.anchor_search"):
        neighbours = nearest_anchors_mm(z, z_anchors, config.n_anchors, config.distance_chunk)  # [C, c]
        means = _subtract_means(z, z_anchors, neighbours, keep=reconstruct)  # Eq. 2; None unless kept
    mm_dtype = matmul_dtype(config.projection_dtype, keys.device)
    leading = None  # [C, rank] fp32, coded order: every coefficient up to the cap, where the allocation reads them
    if plan is None:
        with record_function("varrate.allocation"):
            if by_energy:
                leading = encode(z, basis[:rank], mm_dtype)  # projected once: allocated by, then stored
                ranks = distortion_ranks(leading.square(), total, floor, rank)
            else:
                salience = coded_salience(config.signal, dataclasses.replace(inputs, residuals=z))  # coded_pos order
                ranks = allocate(salience, total, floor, rank)
            plan = _plan(ranks, _group(config), _by_component(config))
            coded_pos, z, means, neighbours = (t if t is None else _in_order(t, plan)
                                               for t in (coded_pos, z, means, neighbours))
    with record_function("varrate.projection"):
        code.ranks = ranks.to(smallest_uint(rank))
        code.neighbours = _unsort(neighbours, plan).to(smallest_uint(anchor_pos.numel() - 1))
        if isinstance(plan, DenseOrder):
            if leading is not None and plan.width <= leading.shape[1]:  # projected once, for the allocation
                coefs = leading[:, :plan.width].contiguous()
            else:
                coefs = encode_dense(z, basis, plan, mm_dtype, as_computed=config.coef_bits is not None)
            code.coefs = _store_dense(coefs, plan, keys.dtype, config)
        else:  # Eq. 6, truncated per token (each token's leading coefficients, when the allocation computed them)
            packed = encode_blocks(z, basis, plan, mm_dtype) if leading is None else pack(leading, ranks, torch.float32)
            code.coefs = _store(packed, code.ranks, keys.dtype, config)
    if not reconstruct:
        return code, None, None
    with record_function("varrate.reconstruction"):
        k_hat, v_hat = torch.empty_like(keys), torch.empty_like(values)  # _reconstruct writes every slot
        exact = code.exact_pos
        _reconstruct(code, plan, coded_pos, means, basis, k_hat, v_hat, cos, sin, scales,
                     (keys[0].index_select(1, exact), values[0].index_select(1, exact)), mm_dtype)
    return code, k_hat, v_hat


def rank_floor(config: VarRateConfig, total: int, count: int, rank: int) -> int:
    """The smallest rank a coded token gets: r_min, raised to `flat_floor` x the flat rank B / C."""
    flat = total / count if count else 0.0
    return min(max(config.r_min, math.floor(config.flat_floor * flat)), rank)


def effective_stride(config: VarRateConfig, seq_len: int) -> int:
    """The anchor stride for a prompt of `seq_len` tokens: `config.stride`, doubled while the exact set
    takes more than `anchor_share` of the budget (never past seq_len / n_anchors)."""
    stride = config.stride
    if config.anchor_share is None or config.budget >= 1.0:
        return stride
    allowed = config.anchor_share * config.budget * seq_len
    limit = max(seq_len // config.n_anchors, config.stride)
    while 2 * stride <= limit and int(exact_mask(seq_len, stride, config.window).sum()) > allowed:
        stride *= 2
    return stride


def decode_prompt(code: PromptCode, exact_keys, exact_values, cos, sin, basis, *, implementation: str = "fast",
                  out: tuple[torch.Tensor, torch.Tensor] | None = None, scales: torch.Tensor | None = None,
                  projection_dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """Reconstruct the full prompt [1, H, S, d] from its code and its exact tokens [1, H, E, d].
    Exact tokens come back bit for bit; coded ones as anchor mean + truncated projection.
    `out` = (keys, values) [1, H, S, d] (views are fine) receives the result instead of new tensors;
    `basis`, `scales` and `projection_dtype` are those the prompt was compressed with."""
    _, heads, _, dim = exact_keys.shape
    shape = (1, heads, code.seq_len, dim)
    keys, values = out if out is not None else (exact_keys.new_empty(shape), exact_values.new_empty(shape))
    exact = code.exact_pos
    keys[0].index_copy_(1, exact, exact_keys[0])
    values[0].index_copy_(1, exact, exact_values[0])
    if code.stored_exactly or code.ranks.numel() == 0:
        return keys, values
    with record_function("varrate.reconstruction"):
        if implementation == "reference":
            decode_reference(code, coef_values(code), keys, values, cos, sin, basis)
            return keys, values
        plan = code_layout(code)
        coded = _in_order(code.coded_pos, plan)
        z_anchors = _joint(keys, values, cos, sin, code.anchor_pos, scales)
        means = gather_means(z_anchors, _in_order(code.neighbours.long(), plan))
        _reconstruct(code, plan, coded, means, basis, keys, values, cos, sin, scales, (exact_keys[0], exact_values[0]),
                     matmul_dtype(projection_dtype, keys.device))
    return keys, values


def code_layout(code: PromptCode) -> RankOrder | DenseOrder:
    """The layout the encoder chose for this code's coefficients (`_plan`, from what the code holds). Choosing
    it reads the ranks back to the host: that is done once, its outcome kept on the code (`PromptCode.layout`,
    a `LayoutShape`), and later calls rebuild the layout's tensors on the device without reading anything."""
    if code.layout is None:
        quantized = code.coefs if isinstance(code.coefs, QuantizedCoefs) else None
        by_component = quantized is not None and quantized.axis != "token"
        group = quantized.group if quantized is not None and not by_component else 1
        code.layout = layout_shape(_plan(code.ranks, group, by_component))
    return rebuild_layout(code.layout, code.ranks)


def coef_values(code: PromptCode) -> torch.Tensor:
    """The stored coefficient stream as fp32 [sum(ranks)] (dequantized if quantized)."""
    if isinstance(code.coefs, QuantizedCoefs):
        return dequantize(code.coefs, code.ranks)
    return code.coefs.float()


def dense_coef_values(code: PromptCode, plan: DenseOrder) -> torch.Tensor:
    """`coef_values` in the dense layout: [C, width] fp32, zeros past each token's rank."""
    if isinstance(code.coefs, QuantizedCoefs):
        return dequantize_dense(code.coefs, plan)
    return plan.from_stream(code.coefs, torch.float32)


def _joint(keys, values, cos, sin, positions, scales):
    fast = native.joint_rows(keys, values, cos, sin, positions, scales)  # the same bits, in one pass
    if fast is not None:
        return fast
    z = joint_rows(keys, values, cos, sin, positions)
    return z if scales is None else z.mul_(scales)


def _subtract_means(z, z_anchors, neighbours, keep: bool):
    """z -= its anchors' means (Eq. 2), in place; the means [C, D] fp32 if `keep` (the reconstruction adds them
    back), else None. In one C pass where it applies (the same bits as `gather_means` then `sub_`)."""
    fast = native.subtract_means(z, z_anchors, neighbours, keep)
    if fast is not None:
        return fast if keep else None
    means = gather_means(z_anchors, neighbours)
    z.sub_(means)
    return means if keep else None


def _reconstruct(code, plan: RankOrder | DenseOrder, coded, means, basis, keys, values, cos, sin, scales, exact_kv,
                 mm_dtype: torch.dtype = torch.float32) -> None:
    """Write the whole prompt into keys/values [1, H, S, d]: the coded tokens (rows of `means`, in `plan`
    order, at positions `coded`) decoded, the exact ones from `exact_kv` (keys, values [H, E, d]).

    The decoded rows go to a token-major [S, D] buffer (contiguous row copies); one transposing copy
    per half moves it to the head-major layout, where the keys are re-rotated plane by plane. This
    runs about 2x faster than scattering C rows across H strided head planes."""
    if isinstance(plan, DenseOrder):
        z_hat = decode_dense(means, dense_coef_values(code, plan), basis, plan, mm_dtype)  # [C, D] fp32
    else:
        z_hat = decode_blocks(means, coef_values(code), basis, plan, mm_dtype)
    if scales is not None:
        z_hat.div_(scales)
    _, heads, seq_len, dim = keys.shape
    half, exact = heads * dim, code.exact_pos
    rows = z_hat.new_empty(seq_len, 2 * half)
    rows.index_copy_(0, coded, z_hat)
    rows.index_fill_(0, exact, 0.0)  # overwritten below; zeros keep stray NaN patterns out of the rotation
    planes = rows[:, :half].view(seq_len, heads, dim).transpose(0, 1)  # [H, S, d]
    in_place = keys.dtype == torch.float32  # else rotate in fp32 and round once, as the model's dtype requires
    rotated = keys[0] if in_place else torch.empty(planes.shape, device=keys.device)
    rotate_heads(rotated.copy_(planes), cos[0].float(), sin[0].float())
    if not in_place:
        keys[0].copy_(rotated)
    values[0].copy_(rows[:, half:].view(seq_len, heads, dim).transpose(0, 1))
    keys[0].index_copy_(1, exact, exact_kv[0])
    values[0].index_copy_(1, exact, exact_kv[1])


def _layout(keys, basis, config: VarRateConfig, layer_share=None) -> tuple[PromptCode, int, int]:
    """The empty code of this prompt, its rank cap R and coefficient total B (Eq. 3)."""
    _, heads, seq_len, dim = keys.shape
    width = 2 * heads * dim
    rank = min(config.rank or basis.shape[0], basis.shape[0], width)
    stride = effective_stride(config, seq_len)
    n_exact = int(exact_mask(seq_len, stride, config.window, keys.device).sum())
    n_coded = seq_len - n_exact
    n_anchors = anchor_positions(seq_len, stride).numel()
    meta = meta_bytes_per_token(config.n_anchors, n_anchors, rank)
    kv_bytes = counted_dtype(config, keys.dtype).itemsize
    if kv_bytes > keys.element_size():
        raise ValueError(
            f"budget_dtype={config.budget_dtype!r} is wider than the K/V being compressed ({keys.dtype}): counting "
            f"the budget in it would let the cache exceed its budget; use budget_dtype=None (the K/V's own dtype)"
        )
    total = coefficient_budget(config, seq_len, n_exact, n_coded, width, kv_bytes, meta, rank)
    if layer_share is not None and total > 0 and n_coded:
        flat = total / n_coded
        floor = max(config.r_min, math.floor(flat / 2))
        scale = layer_share if isinstance(layer_share, float) else budget_scale(*layer_share, flat=flat, floor=floor)
        total = math.floor(total * scale)
    empty = torch.empty(0, dtype=torch.int16, device=keys.device)
    code = PromptCode(seq_len, stride, config.window, empty.view(0, 1), empty, empty.to(keys.dtype),
                      width, keys.element_size())
    code.stored_exactly = n_coded == 0 or config.budget >= 1.0 or total < n_coded * config.r_min
    return code, rank, min(total, n_coded * rank)


def _store(packed: torch.Tensor, ranks: torch.Tensor, dtype: torch.dtype, config: VarRateConfig):
    """The coefficient stream as stored: the model's dtype, or `coef_bits`-bit groups."""
    if config.coef_bits is None:
        return packed.to(dtype, copy=True)  # a copy: `packed` may be a view of a larger buffer
    return quantize(packed, ranks, config.coef_bits, config.coef_group)


def _plan(ranks: torch.Tensor, group: int, by_component: bool = False) -> RankOrder | DenseOrder:
    """How the coded tokens' coefficients are laid out: one dense matrix where ranks are nearly equal (always
    with scales per component, which need the tokens in coded order), else rank-sorted blocks. A function of the
    ranks and the quantization layout only, so the encoder and every later decode choose the same layout (and
    reconstruct bit for bit alike)."""
    return dense_order(ranks, group, slack=math.inf if by_component else DENSE_SLACK) or rank_order(ranks)


def _group(config: VarRateConfig) -> int:
    return config.coef_group if config.coef_bits is not None and not _by_component(config) else 1


def _by_component(config: VarRateConfig) -> bool:
    return config.coef_bits is not None and config.coef_scales == "component"


def _component_axis(config: VarRateConfig) -> str:
    """Where per-component scales sit: axis "component" for the (nearly) uniform ranks of a flat water-fill,
    axis "rank" (a ragged grid, `components`) wherever a salience signal or the distortion allocation varies them,
    so the scales stay within the budget's allowance however unequal the ranks are."""
    uniform = config.signal == "uniform" and config.allocation == "waterfill"
    return "component" if uniform else "rank"


def _in_order(rows: torch.Tensor, plan: RankOrder | DenseOrder) -> torch.Tensor:
    """rows [C, ...] in coded order, put in the plan's order (by decreasing rank; unchanged when dense)."""
    return rows if isinstance(plan, DenseOrder) else rows[plan.order]


def _store_dense(coefs: torch.Tensor, plan: DenseOrder, dtype: torch.dtype, config: VarRateConfig):
    """`_store` of dense coefficients [C, width] (overwritten; the stream is plan.to_stream(coefs))."""
    if config.coef_bits is None:
        return plan.to_stream(coefs).to(dtype)
    if _by_component(config):
        return quantize_components(coefs, plan, config.coef_bits, config.component_tokens, _component_axis(config))
    return quantize_dense(coefs, plan, config.coef_bits)


def _unsort(rows: torch.Tensor, plan: RankOrder | DenseOrder) -> torch.Tensor:
    if isinstance(plan, DenseOrder):
        return rows
    out = torch.empty_like(rows)
    out[plan.order] = rows
    return out

