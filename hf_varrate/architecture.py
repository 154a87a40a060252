"""What the codec needs to know about a model's attention, read from its config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """Attention geometry of a decoder: L layers, H kv heads, d head dim, D = 2*H*d."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    compressed_layers: tuple[int, ...]  # full-attention layers; sliding ones stay the model's own
    sliding_window: int | None
    model_id: str | None

    @property
    def width(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim


def describe(model_config) -> ModelShape:
    """Read the attention geometry of a transformers config (text config for multimodal ones)."""
    config = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    num_layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelShape(
        num_layers=num_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        compressed_layers=tuple(i for i, kind in enumerate(layer_types(config)) if kind == "full_attention"),
        sliding_window=getattr(config, "sliding_window", None),
        model_id=getattr(model_config, "_name_or_path", None) or None,
    )


def layer_types(config) -> list[str]:
    """'full_attention' or 'sliding_attention' per layer, as transformers' DynamicCache decides it."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return ["sliding_attention" if kind in ("sliding_attention", "chunked_attention") else kind for kind in types]
    kind = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    return [kind] * config.num_hidden_layers


def check_fits(shape, layer_idx: int, *, num_layers: int | None = None, num_kv_heads: int | None = None,
               head_dim: int | None = None) -> None:
    """Raise ValueError unless what a forward brings fits the model a VarRateCache was built for.

    A cache holds one model's K/V: another model's would crash on a shape deep inside attention, or
    (same shapes, fewer layers) silently attend to keys it never computed. `shape` is a `ModelShape`.
    """
    seen = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    for name, value in seen.items():
        expected = getattr(shape, name)
        if value is not None and value != expected:
            raise ValueError(
                f"this VarRateCache was built for a model with {name}={expected} but is used (layer {layer_idx}) "
                f"by a model with {name}={value}; a cache holds one model's K/V: build a new cache for this "
                f"model with VarRateCache.from_pretrained(bases, model=model)"
            )
    if not 0 <= layer_idx < shape.num_layers:
        raise ValueError(
            f"layer_idx must be in [0, {shape.num_layers}) for this VarRateCache, got {layer_idx}: the model "
            f"has more layers than the one the cache was built for; build a new cache for this model with "
            f"VarRateCache.from_pretrained(bases, model=model)"
        )


def check_compressible(shape: ModelShape) -> ModelShape:
    """Raise ValueError for a model with no full-attention layer to compress; return `shape`."""
    if not shape.compressed_layers:
        raise ValueError(
            f"every layer of {shape.model_id or 'this model'} is sliding-window attention (sliding_window="
            f"{shape.sliding_window}, as in Mistral-7B-v0.1): VarRate compresses full-attention layers only, and "
            f"there are none; use transformers' DynamicCache (the window already bounds its memory)")
    return shape

