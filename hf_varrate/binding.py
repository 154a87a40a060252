"""Binding a model to VarRate: one forward pre-hook per attention module.

A `Cache` never sees query states, so the hook recomputes the last `obs_window` queries the way
the attention module does (q_proj, q_norm where the architecture has one, the model's own RoPE)
and hands them, with cos/sin and the key padding, to that layer of the VarRateCache it finds in
the module's kwargs (`cache` in new transformers, `past_key_values` in older ones). For any other
cache, and outside the prefill, the hook does nothing. Nothing is patched: `unbind` removes it all.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

import torch
from transformers.cache_utils import Cache

from .architecture import ModelShape, check_fits
from .codec import attention_scale
from .layers import PrefillContext, VarRateLayer


def attention_modules(model) -> list[torch.nn.Module]:
    """The model's self-attention modules: those with q_proj, k_proj and a layer_idx."""
    return [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "k_proj") and hasattr(m, "layer_idx")]


def cache_kwarg(model) -> str:
    """The name `model`'s forward (and so generate) takes the cache by: transformers 5.24 renamed `past_key_values`
    to `cache` (the old name still works, with a FutureWarning, until 6.0), so code that runs on both passes
    `**{cache_kwarg(model): cache}`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def bind(model):
    """Install the prefill hook on every attention module of `model` (idempotent). Returns `model`."""
    modules = attention_modules(model)
    if not modules:
        fused = any(hasattr(m, "qkv_proj") for m in model.modules())
        family = (f"{type(model).__name__} computes queries, keys and values with one fused qkv_proj (Phi-3 style), "
                  f"which VarRate does not support yet" if fused else
                  f"bind found no attention module (with q_proj, k_proj and layer_idx) in {type(model).__name__}")
        raise ValueError(f"{family}; VarRate supports Llama-style decoders (Llama, Qwen2/3, Mistral, Gemma-3)")
    for module in modules:
        if not _hook_ids(module):
            module.register_forward_pre_hook(prefill_hook, with_kwargs=True)
    return model


def unbind(model):
    """Remove every hook `bind` installed on `model`, also on a deep copy of a bound model (which carries
    copies of the hooks). Returns `model`."""
    for module in attention_modules(model):
        for hook_id in _hook_ids(module):
            del module._forward_pre_hooks[hook_id]
            module._forward_pre_hooks_with_kwargs.pop(hook_id, None)
    return model


def is_bound(model) -> bool:
    modules = attention_modules(model)
    return bool(modules) and all(_hook_ids(m) for m in modules)


def _hook_ids(module: torch.nn.Module) -> list[int]:
    """The ids of `prefill_hook` among the module's forward pre-hooks. The module's own hook table is the
    record (not a table of handles kept here), so a deep copy or a pickle of a bound model is seen as bound."""
    return [hook_id for hook_id, hook in module._forward_pre_hooks.items() if hook is prefill_hook]


@contextlib.contextmanager
def bound(model):
    """`with bound(model): ...` binds for the block and always unbinds afterwards."""
    bind(model)
    try:
        yield model
    finally:
        unbind(model)


@contextlib.contextmanager
def bound_as_found(model):
    """Binds for the block, then leaves `model` as it was found: a model bound before stays bound (library code that
    runs a user's model, e.g. calibration, must not unbind it)."""
    was_bound = is_bound(model)
    bind(model)
    try:
        yield model
    finally:
        if not was_bound:
            unbind(model)


def prefill_hook(module, args, kwargs):
    """The forward pre-hook `bind` installs on an attention module: when the forward is a VarRateCache's
    prefill, hand the cache layer what the codec needs and the model does not pass to a Cache (the
    last `obs_window` queries, the RoPE tables, the attention scale, which slots are padding).

    Public so that a harness replaying a captured prefill into a VarRateCache layer by layer can call it
    with the kwargs the attention module would get (`hidden_states`, `position_embeddings`,
    `past_key_values`, `attention_mask`) before each `cache.update`, as `evaluation/` does."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    shape = getattr(cache, "model_shape", None)
    if not isinstance(cache, Cache) or not isinstance(shape, ModelShape):  # not a VarRateCache
        return None
    check_fits(shape, module.layer_idx,
               num_layers=getattr(getattr(module, "config", None), "num_hidden_layers", None))
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    if hidden.shape[1] == 0:  # the attention would fail on a reshape; say what is wrong instead
        raise ValueError(
            f"VarRateCache got a forward with 0 tokens (hidden_states of shape {tuple(hidden.shape)}): there is "
            f"nothing to compress or attend to; pass at least one token (e.g. the tokenizer's BOS token)"
        )
    layer = cache.layers[module.layer_idx]
    if not isinstance(layer, VarRateLayer) or hidden.shape[1] <= 1 or not (
            layer.awaits_prefill or layer.takes_turns(hidden.shape[0])):  # neither a prompt nor a later turn
        return None
    cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
    window = min(layer.config.obs_window, hidden.shape[1])
    with torch.no_grad():
        queries = window_queries(module, hidden, cos, sin, window)
    valid = key_padding(kwargs.get("attention_mask"), hidden.shape[0], hidden.shape[1])
    layer.prefill_context = PrefillContext(queries, cos, sin, attention_scale(module), valid)
    return None


def window_queries(module, hidden, cos, sin, window: int) -> torch.Tensor:
    """The last `window` queries [B, Hq, W, d], computed exactly as the attention module computes them."""
    h = hidden[:, -window:]
    batch, length, _ = h.shape
    q = module.q_proj(h).view(batch, length, -1, module.head_dim)  # [B, W, Hq, d]
    if getattr(module, "q_norm", None) is not None:
        q = module.q_norm(q)
    q = q.transpose(1, 2)  # [B, Hq, W, d]
    apply_rope = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
    if apply_rope is None:
        raise NotImplementedError(
            f"{type(module).__name__} has no apply_rotary_pos_emb in its modeling module; VarRate needs RoPE"
        )
    q, _ = apply_rope(q, q, cos[:, -window:], sin[:, -window:])
    return q


def key_padding(mask, batch: int, seq_len: int) -> torch.Tensor | None:
    """[B, S] bool of real (non-padding) prompt tokens, read off the mask the attention module gets.

    With left padding the last query sees every real token, so its mask row is the padding mask.
    Returns None when there is no padding to remove.
    """
    if not torch.is_tensor(mask):
        return None
    if mask.ndim == 4:
        row = mask[:, 0, -1, -seq_len:]
    elif mask.ndim == 2:  # a plain 0/1 padding mask (flash-attention style)
        row = mask[:, -seq_len:].bool()
    else:
        return None
    valid = row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2  # additive float mask
    valid = valid.expand(batch, seq_len) if valid.shape[0] == 1 else valid
    return None if bool(valid.all()) else valid
