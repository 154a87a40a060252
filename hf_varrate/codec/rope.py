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


# Row-major variants for the fast path: tokens first ([n, H, d]), cos/sin [n, d] fp32, written with
# the two halves spelled out, without the concatenation `rotate_half` allocates. `unrotate_rows`
# rounds exactly like `unrotate_keys` (a - (-b)*s is a + b*s in IEEE arithmetic).

def unrotate_rows(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None):
    """Post-RoPE keys [n, H, d] -> pre-RoPE [n, H, d] fp32 (into `out` if given, which may be a
    strided view); bit-identical to `unrotate_keys`."""
    keys = keys.float()
    half = keys.shape[-1] // 2
    cos, sin = cos[:, None], sin[:, None]  # [n, 1, d]
    den = cos * cos + sin * sin
    k1, k2 = keys[..., :half], keys[..., half:]
    out = torch.empty_like(keys) if out is None else out
    first, second = out[..., :half], out[..., half:]
    torch.mul(k1, cos[..., :half], out=first)
    first += k2 * sin[..., :half]
    first /= den[..., :half]
    torch.mul(k2, cos[..., half:], out=second)
    second -= k1 * sin[..., half:]
    second /= den[..., half:]
    return out


def rotate_rows(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE keys [n, H, d] fp32 -> post-RoPE, in place (`keys` may be a strided view); returns
    `keys`. The same arithmetic as `rotate_keys` with fused multiply-adds, so equal to it up to
    rounding (the fast path's encoder and decoder both use this one or `rotate_heads`)."""
    return _rotate_(keys, cos[:, None], sin[:, None])


def rotate_heads(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotate_rows` for head-major keys [H, n, d] fp32 (cos, sin [n, d]), in place; bit-identical to it
    element by element. Each head plane is contiguous here, which runs several times faster than
    rotating the token-major rows of a wider buffer."""
    return _rotate_(keys, cos[None], sin[None])


def _rotate_(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = keys.shape[-1] // 2
    k1, k2 = keys[..., :half], keys[..., half:]
    first = k1.clone()
    k1.mul_(cos[..., :half]).addcmul_(k2, sin[..., :half], value=-1.0)
    k2.mul_(cos[..., half:]).addcmul_(first, sin[..., half:])
    return keys


def rope_turns(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(cos, sin) [1, S, d] -> [S, d/2, 2] fp32: each RoPE pair's (cos, sin), viewable as complex rotations
    (`torch.view_as_complex`). The tables must repeat their first half, as `rope_tables` builds them."""
    half = cos.shape[-1] // 2
    return torch.stack((cos[0, :, :half], sin[0, :, :half]), dim=-1).float()


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """cos, sin [1, n, d] at `positions` [n], computed the way transformers' rotary embeddings compute
    them (fp32 angles, cat(freqs, freqs), cos * attention_scaling, cast last). Whether they match a
    given model's (to within rounding) is checked where they are used."""
    freqs = positions.float()[:, None] * inv_freq.to(device=positions.device, dtype=torch.float32)[None, :]
    cos, sin = freqs.cos(), freqs.sin()  # [n, d/2]
    cos, sin = torch.cat((cos, cos), dim=-1) * scaling, torch.cat((sin, sin), dim=-1) * scaling
    return cos.to(dtype)[None], sin.to(dtype)[None]


def sample_positions(length: int, samples: int = 64, device=None) -> torch.Tensor:
    """Up to `samples` positions spread over 0..length-1, first and last included."""
    return torch.unique(torch.linspace(0, max(length - 1, 0), min(samples, length), device=device).long())
