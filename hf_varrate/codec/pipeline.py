"""Algorithm 1 for one sequence of one layer: compress a prompt, and reconstruct it.

Shapes: keys, values [1, H, S, d] post-RoPE (one sequence, padding already removed);
queries [1, Hq, W, d] post-RoPE; cos, sin [1, S, d]; basis [R, D] fp32.
"""

from __future__ import annotations

import math

import torch

from ..config import VarRateConfig
from .allocation import topk_ranks, waterfill_ranks
from .anchors import anchor_means, anchor_positions, exact_mask, residuals
from .joint import join_kv, split_kv
from .packing import PromptCode, meta_bytes_per_token, smallest_uint
from .projection import decode, encode, pack, unpack
from .rope import rotate_keys, unrotate_keys
from .salience import coded_salience, snapkv_scores


def coefficient_budget(config: VarRateConfig, seq_len: int, n_exact: int, n_coded: int, width: int,
                       kv_bytes: int, meta_bytes: int) -> int:
    """Eq. 3 in bytes: what kappa * (full K/V bytes) leaves for coefficients after the exact tokens
    and every coded token's side information (anchor indices, rank). Counting the side information
    inside the budget keeps the realised footprint at the budget on small-D models, where Eq. 3's
    coefficient-only count would overshoot by a percent or more."""
    spare = config.budget * seq_len * width * kv_bytes - n_exact * width * kv_bytes - n_coded * meta_bytes
    return max(math.floor(spare / kv_bytes), 0)


def encode_prompt(keys, values, queries, cos, sin, basis, config: VarRateConfig, scaling: float) -> PromptCode:
    """Compress one prompt. Returns its `PromptCode`; `stored_exactly` when the budget can't cover
    the exact set plus the floor for every coded token (or when budget == 1: nothing to save)."""
    _, heads, seq_len, dim = keys.shape
    width = 2 * heads * dim
    rank = min(config.rank or basis.shape[0], basis.shape[0], width)
    is_exact = exact_mask(seq_len, config.stride, config.window, keys.device)
    exact_pos, coded_pos = is_exact.nonzero()[:, 0], (~is_exact).nonzero()[:, 0]
    anchor_pos = anchor_positions(seq_len, config.stride, keys.device)
    kv_bytes = keys.element_size()
    meta = meta_bytes_per_token(config.n_anchors, anchor_pos.numel(), rank)
    total = coefficient_budget(config, seq_len, exact_pos.numel(), coded_pos.numel(), width, kv_bytes, meta)
    n_coded = coded_pos.numel()
    code = PromptCode(seq_len, exact_pos, coded_pos, anchor_pos, _empty(), _empty(), _empty(keys.dtype),
                      width, kv_bytes)
    if n_coded == 0 or config.budget >= 1.0 or total < n_coded * config.r_min:
        code.stored_exactly = True
        code.exact_pos = torch.arange(seq_len, device=keys.device)
        code.coded_pos = code.exact_pos[:0]
        return code
    z = join_kv(unrotate_keys(keys, cos, sin), values.float())[0]  # [S, D] fp32
    resid, neighbours = residuals(z[coded_pos], z[anchor_pos], config.n_anchors, config.distance_chunk)
    salience = _salience(config, queries, keys, scaling, coded_pos, seq_len)
    allocate = waterfill_ranks if config.allocation == "waterfill" else topk_ranks
    ranks = allocate(salience, min(total, n_coded * rank), config.r_min, rank)  # Eq. 5
    coefs = encode(resid, basis[:rank])  # Eq. 6, once at full rank
    code.neighbours = neighbours.to(smallest_uint(anchor_pos.numel() - 1))
    code.ranks = ranks.to(smallest_uint(rank))
    code.coefs = pack(coefs, ranks, keys.dtype)
    return code


def decode_prompt(code: PromptCode, exact_keys, exact_values, cos, sin, basis) -> tuple[torch.Tensor, torch.Tensor]:
    """Reconstruct the full prompt [1, H, S, d] from its code and its exact tokens [1, H, E, d].
    Exact tokens come back bit for bit; coded ones as anchor mean + truncated projection."""
    _, heads, _, dim = exact_keys.shape
    shape = (1, heads, code.seq_len, dim)
    keys = exact_keys.new_empty(shape)
    values = exact_values.new_empty(shape)
    keys[:, :, code.exact_pos] = exact_keys
    values[:, :, code.exact_pos] = exact_values
    if code.stored_exactly or code.coded_pos.numel() == 0:
        return keys, values
    anchor_k, anchor_v = keys[:, :, code.anchor_pos], values[:, :, code.anchor_pos]
    z_anchors = join_kv(unrotate_keys(anchor_k, cos[:, code.anchor_pos], sin[:, code.anchor_pos]), anchor_v.float())[0]
    ranks = code.ranks.long()
    rank = int(ranks.max())
    coefs = unpack(code.coefs, ranks, rank)  # [C, r_max]
    z_hat = decode(anchor_means(z_anchors, code.neighbours.long()), coefs, basis)  # [C, D]
    k_hat, v_hat = split_kv(z_hat[None], heads)  # [1, H, C, d]
    k_hat = rotate_keys(k_hat, cos[:, code.coded_pos], sin[:, code.coded_pos])
    keys[:, :, code.coded_pos] = k_hat.to(keys.dtype)
    values[:, :, code.coded_pos] = v_hat.to(values.dtype)
    return keys, values


def _salience(config, queries, keys, scaling, coded_pos, seq_len):
    snapkv = None
    if config.signal in ("snapkv", "shuffle"):
        snapkv = snapkv_scores(queries, keys, scaling, config.pool_kernel)
    return coded_salience(config.signal, snapkv, coded_pos, seq_len, config.stride, config.window, config.seed)


def _empty(dtype=torch.int16):
    return torch.empty(0, dtype=dtype)
