"""Collect the residuals e_t (Eq. 2) of every compressed layer by running the model on contexts.

The residuals are computed exactly as the cache computes them at a prefill: the keys and values
the layer's cache received (post-RoPE), the model's own cos/sin, `unrotate_keys`, `join_kv`, the
exact set from `exact_mask`, anchors from `anchor_positions` and `residuals`. A forward hook on
each attention module reads them after the module has updated its cache; the hooks live only
inside `residual_hooks` and are removed on the way out, whatever happens.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..binding import attention_modules
from ..codec import anchor_positions, exact_mask, join_kv, residuals, unrotate_keys
from ..config import VarRateConfig

ResidualCallback = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class ResidualSettings:
    """The codec settings residuals depend on; the cache must use the same ones."""

    stride: int = VarRateConfig.stride
    window: int = VarRateConfig.window
    n_anchors: int = VarRateConfig.n_anchors
    distance_chunk: int = VarRateConfig.distance_chunk

    @classmethod
    def from_config(cls, config: VarRateConfig) -> ResidualSettings:
        return cls(config.stride, config.window, config.n_anchors, config.distance_chunk)


def layer_residuals(keys, values, cos, sin, settings: ResidualSettings) -> torch.Tensor:
    """Residuals [C, D] fp32 of one sequence's prompt, as `encode_prompt` forms them.

    keys, values [1, H, S, d] post-RoPE; cos, sin [1, S, d]. C counts the coded (non-exact) tokens.
    """
    seq_len = keys.shape[-2]
    coded = ~exact_mask(seq_len, settings.stride, settings.window, keys.device)
    anchors = anchor_positions(seq_len, settings.stride, keys.device)
    z = join_kv(unrotate_keys(keys, cos, sin), values.float())[0]  # [S, D] fp32
    if not bool(coded.any()):
        return z[:0]
    e, _ = residuals(z[coded], z[anchors], settings.n_anchors, settings.distance_chunk)
    return e  # [C, D]


@contextlib.contextmanager
def residual_hooks(model, layers, callback: ResidualCallback, settings: ResidualSettings):
    """Within the block, every forward of `model` calls `callback(layer_idx, residuals [C, D])` for
    each attention module in `layers`. The hooks are always removed on exit."""
    handles = []
    try:
        for module in attention_modules(model):
            if module.layer_idx in layers:
                hook = functools.partial(_after_attention, callback, settings)
                handles.append(module.register_forward_hook(hook, with_kwargs=True))
        yield model
    finally:
        for handle in handles:
            handle.remove()


def _after_attention(callback, settings, module, args, kwargs, output):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        raise RuntimeError("calibration needs the model to run with a cache (use_cache=True)")
    layer = cache.layers[module.layer_idx]
    cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
    callback(module.layer_idx, layer_residuals(layer.keys, layer.values, cos, sin, settings))


def run_contexts(model, contexts: list[torch.Tensor], layers, callback: ResidualCallback,
                 settings: ResidualSettings, progress: bool = True, desc: str = "calibration") -> None:
    """One prefill per context (batch 1), residuals to `callback`, a tqdm bar ticking per context."""
    device = next(model.parameters()).device
    with residual_hooks(model, set(layers), callback, settings), torch.no_grad():
        for ids in tqdm(contexts, desc=desc, unit="context", disable=not progress):
            model(input_ids=ids.reshape(1, -1).to(device), use_cache=True, logits_to_keep=1)


def collect_residuals(model, contexts: list[torch.Tensor], layers, settings: ResidualSettings | None = None,
                      progress: bool = False) -> dict[int, torch.Tensor]:
    """All residuals per layer, stacked [sum C, D] (for tests and analysis; `calibrate` streams them)."""
    gathered: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    run_contexts(model, contexts, layers, lambda i, e: gathered[i].append(e.cpu()), settings or ResidualSettings(),
                 progress)
    return {i: torch.cat(parts) for i, parts in gathered.items()}
