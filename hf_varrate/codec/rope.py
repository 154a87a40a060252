"""RoPE un-rotation and re-rotation with the model's own cos/sin (Section 3.1, Eq. 1).

Shapes: keys [B, H, S, d]; cos, sin [B, S, d] as the model's rotary embedding returns them.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The half-rotation used by Llama-family RoPE: (x1, x2) -> (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def unrotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Post-RoPE keys -> pre-RoPE keys, in fp32.

    The inverse of `k * cos + rotate_half(k) * sin` is `(k * cos - rotate_half(k) * sin) / (cos^2 + sin^2)`;
    the denominator absorbs any `attention_scaling` folded into cos and sin.
    """
    keys = keys.float()
    cos, sin = cos.float().unsqueeze(1), sin.float().unsqueeze(1)  # [B, 1, S, d]
    return (keys * cos - rotate_half(keys) * sin) / (cos * cos + sin * sin)


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE keys -> post-RoPE keys, exactly as `apply_rotary_pos_emb` rotates them (fp32)."""
    keys = keys.float()
    cos, sin = cos.float().unsqueeze(1), sin.float().unsqueeze(1)  # [B, 1, S, d]
    return keys * cos + rotate_half(keys) * sin
