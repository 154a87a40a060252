"""The joint per-token vector z_t = [k~_t ; v_t] over all KV heads (Eq. 1), and its inverse.

Shapes: keys, values [B, H, S, d]; z [B, S, D] with D = 2 * H * d.
"""

from __future__ import annotations

import torch


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
