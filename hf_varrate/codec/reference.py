"""The reference path of Algorithm 1: the codec as first written (full-rank matmuls, rank masks,
a [C, c, D] anchor gather, `cdist`). `implementation="reference"` in `VarRateConfig` selects it;
the fast path in `pipeline.py` is tested against it. Same code layout, so either decodes the other.
"""

from __future__ import annotations

import torch

from .allocation import topk_ranks, waterfill_ranks
from .anchors import anchor_means, residuals
from .joint import join_kv, split_kv
from .packing import PromptCode, smallest_uint
from .projection import decode, encode, pack, unpack
from .rope import rotate_keys, unrotate_keys


def encode_reference(code: PromptCode, keys, values, cos, sin, salience, basis, rank: int, total: int, config,
                     floor: int | None = None):
    """Set `code.neighbours` and `code.ranks`; return the packed coefficients [sum(ranks)] fp32.
    `floor`: the rank floor (default `config.r_min`)."""
    coded_pos, anchor_pos = code.coded_pos, code.anchor_pos
    z = join_kv(unrotate_keys(keys, cos, sin), values.float())[0]  # [S, D] fp32
    resid, neighbours = residuals(z[coded_pos], z[anchor_pos], config.n_anchors, config.distance_chunk)
    allocate = waterfill_ranks if config.allocation == "waterfill" else topk_ranks
    ranks = allocate(salience, total, config.r_min if floor is None else floor, rank)  # Eq. 5
    coefs = encode(resid, basis[:rank])  # Eq. 6, once at full rank
    code.neighbours = neighbours.to(smallest_uint(anchor_pos.numel() - 1))
    code.ranks = ranks.to(smallest_uint(rank))
    return pack(coefs, ranks, torch.float32)


def decode_reference(code: PromptCode, coefs: torch.Tensor, keys, values, cos, sin, basis) -> None:
    """Write the coded tokens into keys, values [1, H, S, d] (exact tokens already in place)."""
    heads = keys.shape[1]
    anchor_pos, coded_pos = code.anchor_pos, code.coded_pos
    anchor_k, anchor_v = keys[:, :, anchor_pos], values[:, :, anchor_pos]
    z_anchors = join_kv(unrotate_keys(anchor_k, cos[:, anchor_pos], sin[:, anchor_pos]), anchor_v.float())[0]
    ranks = code.ranks.long()
    dense = unpack(coefs, ranks, int(ranks.max()))  # [C, r_max]
    z_hat = decode(anchor_means(z_anchors, code.neighbours.long()), dense, basis)  # [C, D]
    k_hat, v_hat = split_kv(z_hat[None], heads)  # [1, H, C, d]
    k_hat = rotate_keys(k_hat, cos[:, coded_pos], sin[:, coded_pos])
    keys[:, :, coded_pos] = k_hat.to(keys.dtype)
    values[:, :, coded_pos] = v_hat.to(values.dtype)
