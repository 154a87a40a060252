"""Bytes each method actually keeps, measured the same way for all of them.

- Tensors: numel x element size. Quantized tensors (optimum-quanto) are subclasses holding packed
  codes, scales and zero-points: we recurse through `__tensor_flatten__` and count every inner
  tensor, so a 2-bit cache is charged its codes *and* its per-group scales and shifts.
- Eviction by masking (kvpress's KVzip, AdaKV-style presses keep the tensors and mask entries in
  attention): the masked (head, token) entries are subtracted, i.e. only what is kept is counted.
- VarRate: the cache's own `footprint()` (exact tokens, coefficients at their ranks, anchor indices,
  ranks), the quantity the paper reports.
"""

from __future__ import annotations

import torch


def tensor_bytes(t) -> int:
    if t is None or not isinstance(t, torch.Tensor):
        return 0
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def dynamic_layer_bytes(layer) -> int:
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    return tensor_bytes(keys) + tensor_bytes(values)


def quantized_layer_bytes(layer) -> int:
    """QuantizedLayer: quantized prompt (codes + scales + shifts) plus the full-precision residual buffer."""
    quantized = tensor_bytes(getattr(layer, "_quantized_keys", None)) + tensor_bytes(
        getattr(layer, "_quantized_values", None))
    return quantized + dynamic_layer_bytes(layer)


def masked_bytes(masks: dict | None, keys_by_layer: dict[int, torch.Tensor]) -> dict[int, int]:
    """Bytes of the (head, token) entries masked out per layer: each drops one key and one value row."""
    out = {}
    for i, mask in (masks or {}).items():
        if mask is None:
            continue
        k = keys_by_layer[i]
        out[i] = int(mask[0].numel()) * 2 * k.shape[-1] * k.element_size()
    return out


def per_layer_bytes(cache, masks: dict | None = None) -> list[int]:
    """Measured bytes per layer for a DynamicCache / QuantizedCache / VarRateCache."""
    if hasattr(cache, "footprint"):  # VarRateCache
        return [layer.bytes for layer in cache.footprint().layers]
    sizes = [quantized_layer_bytes(layer) if hasattr(layer, "_quantized_keys") else dynamic_layer_bytes(layer)
             for layer in cache.layers]
    dropped = masked_bytes(masks, {i: layer.keys for i, layer in enumerate(cache.layers)})
    return [size - dropped.get(i, 0) for i, size in enumerate(sizes)]
