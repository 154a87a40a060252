"""How a prompt's K/V are held from its prefill until it is coded.

A float32 model's (e.g. on CPU) are held in float16 under `hold_dtype="auto"`: the prefill's peak holds half
the bytes of a DynamicCache's for every compressed layer, instead of all of them until the first decoding
step. A forward still attends to its own tokens exactly; a chunked prefill's later chunks attend to the
earlier ones as held, and the coding reads them as held (fp16 rounding, about 0.05%, far below the codec's
error; the exact tokens are then the model's K/V rounded to float16, as a float16 deployment holds them).
Held in the model's dtype: every layer of a half-precision model, a layer whose K/V would overflow float16,
a cache at budget 1.0 (it keeps everything bit for bit), and every layer under `hold_dtype="model"`.
"""

from __future__ import annotations

import torch

FLOAT16_MAX = torch.finfo(torch.float16).max


def append_held(held_k: torch.Tensor, held_v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                config, peak: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(held keys, held values, keys attended to, values attended to) after a prompt forward's `keys` / `values`
    [B, H, S, d] arrive at a layer holding `held_k` / `held_v` (empty before the first), under `config` (a
    `VarRateConfig`); `peak` is their largest magnitude (finite)."""
    earlier = held_k.numel() > 0
    narrowed = config.hold_dtype == "auto" and config.budget < 1.0 and keys.dtype == torch.float32
    narrow = torch.float16 if narrowed else keys.dtype
    if earlier and held_k.dtype == keys.dtype:
        narrow = keys.dtype  # an earlier chunk was held in the model's dtype: the layer stays so
    if narrow != keys.dtype and peak >= FLOAT16_MAX:  # beyond float16's range (or at its edge)
        narrow = keys.dtype
    if narrow == keys.dtype:  # as a DynamicLayer holds them: one tensor, attended to and held
        held_k = torch.cat([held_k.to(keys.dtype), keys], dim=-2)
        held_v = torch.cat([held_v.to(values.dtype), values], dim=-2)
        return held_k, held_v, held_k, held_v
    new_k, new_v = keys.to(narrow), values.to(narrow)
    if not earlier:
        return new_k, new_v, keys, values
    seen_k = torch.cat([held_k.to(keys.dtype), keys], dim=-2)
    seen_v = torch.cat([held_v.to(values.dtype), values], dim=-2)
    return torch.cat([held_k, new_k], dim=-2), torch.cat([held_v, new_v], dim=-2), seen_k, seen_v
