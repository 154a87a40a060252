"""Eq. 3 in bytes: how many coefficients a prompt's budget buys, counted in which dtype's bytes."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .codes import SCALE_DTYPE

if TYPE_CHECKING:  # annotations only: the codec reads a config's fields, it never builds one
    from ..config import VarRateConfig


def counted_dtype(config: VarRateConfig, kv_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype whose bytes the budget counts: `config.budget_dtype`, else the K/V's own (`kv_dtype`)."""
    return kv_dtype if config.budget_dtype is None else getattr(torch, config.budget_dtype)


def coefficient_budget(config: VarRateConfig, seq_len: int, n_exact: int, n_coded: int, width: int,
                       kv_bytes: int, meta_bytes: int, rank: int | None = None) -> int:
    """Eq. 3 in bytes: how many coefficients kappa * (full K/V bytes) leaves after the exact tokens
    and every coded token's side information (anchor indices, rank). Counting the side information
    inside the budget keeps the realised footprint at the budget on small-D models.

    A coefficient costs `kv_bytes`, except with `coef_bits` and `quantized_budget="same_bytes"`:
    then it costs bits/8 plus its share of its group's fp16 min and step, and each token is charged
    one more (partial) group up front, so the realised bytes never exceed the budget (with
    `coef_scales="component"`: bits/8 plus its share of its component's scales per `component_tokens` tokens, the
    partial groups up front; uniform ranks make the scale grid at most one column wider, and varying ones, on axis
    "rank", hold at most sum(ranks) / `component_tokens` + the cap entries, `components`' bound). With
    `"same_ranks"` the ranks are those of `kv_bytes` coefficients, less `same_ranks_overshoot` (zero
    unless ranks as small as 1-3 are allowed); `rank` is the rank cap (default: `width`)."""
    spare = config.budget * seq_len * width * kv_bytes - n_exact * width * kv_bytes - n_coded * meta_bytes
    per_coef = kv_bytes
    group_bytes = 2 * torch.empty(0, dtype=SCALE_DTYPE).element_size()
    if config.coef_bits is not None and config.coef_scales == "component":
        spare -= group_bytes * (n_coded / config.component_tokens + (rank or width) + 1) + config.coef_bits  # above
        per_coef = config.coef_bits / 8 + group_bytes / config.component_tokens
    elif config.coef_bits is not None and config.quantized_budget == "same_bytes":
        spare -= n_coded * group_bytes + config.coef_bits  # partial groups, bit-packing pad
        per_coef = config.coef_bits / 8 + group_bytes / config.coef_group
    elif config.coef_bits is not None:
        spare -= same_ranks_overshoot(config, n_coded, kv_bytes, group_bytes, rank or width)
    return math.floor(spare / per_coef)  # < 0: the exact set and side information alone exceed the budget


def same_ranks_overshoot(config: VarRateConfig, n_coded: int, kv_bytes: int, group_bytes: int, rank: int) -> float:
    """The most bytes `n_coded` tokens' quantized coefficients can take beyond the same ranks at `kv_bytes`.

    A token of rank r costs r * bits/8 plus ceil(r / group) groups' min and step, against r * kv_bytes:
    more only at the smallest ranks (a group's 4 bytes outweigh the saving: r = 1 for 4-bit codes of fp32
    K/V, up to r = 3 for 8-bit codes of fp16 K/V), plus the bit-packing pad. The excess is largest at the
    lowest rank a token may get or where a new group starts (r = k * group + 1); a token at rank 0 costs
    nothing either way. Zero at the usual r_min = 16, where every token saves more than the pad."""
    bits, group = config.coef_bits, config.coef_group
    lowest = max(min(config.r_min, rank), 1)
    candidates = [lowest, *range(group * ((lowest - 1) // group + 1) + 1, rank + 1, group)]
    worst = max(r * (bits / 8 - kv_bytes) + group_bytes * -(-r // group) for r in candidates)
    per_token = max(worst, 0.0) if config.r_min == 0 else worst
    return max(0.0, n_coded * per_token + bits)
