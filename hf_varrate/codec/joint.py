"""The joint per-token vector z_t = [k~_t ; v_t] over all KV heads (Eq. 1), and its inverse.

Shapes: keys, values [B, H, S, d]; z [B, S, D] with D = 2 * H * d.
"""

from __future__ import annotations

import torch

from .rope import unrotate_rows


def join_kv(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[B, H, S, d] x 2 -> [B, S, D]; keys first, heads in order."""
    batch, heads, seq, dim = keys.shape
    k = keys.transpose(1, 2).reshape(batch, seq, heads * dim)  # [B, S, H*d]
    v = values.transpose(1, 2).reshape(batch, seq, heads * dim)  # [B, S, H*d]
    return torch.cat((k, v), dim=-1)  # [B, S, D]


def split_kv(z: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S, D] -> keys, values [B, H, S, d]."""
    batch, seq, width = z.shape
    dim = width // (2 * num_heads)
    k, v = z.split(width // 2, dim=-1)
    k = k.reshape(batch, seq, num_heads, dim).transpose(1, 2)  # [B, H, S, d]
    v = v.reshape(batch, seq, num_heads, dim).transpose(1, 2)  # [B, H, S, d]
    return k, v


def joint_rows(keys: torch.Tensor, values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """z_t [n, D] fp32 for `positions` [n] of one sequence (keys, values [1, H, S, d]; cos, sin [1, S, d]).

    Gathers the rows first, so nothing of width D is computed for the tokens not asked for; equal to
    `join_kv(unrotate_keys(keys, cos, sin), values.float())[0][positions]` bit for bit.
    """
    _, heads, _, dim = keys.shape
    count, half = positions.numel(), heads * dim
    z = torch.empty(count, 2 * half, dtype=torch.float32, device=keys.device)
    k = keys[0].transpose(0, 1).index_select(0, positions)  # [n, H, d], contiguous
    c, s = cos[0].index_select(0, positions).float(), sin[0].index_select(0, positions).float()  # [n, d]
    unrotate_rows(k, c, s, out=z[:, :half].view(count, heads, dim))
    z[:, half:].view(count, heads, dim).copy_(values[0].transpose(0, 1).index_select(0, positions))
    return z
