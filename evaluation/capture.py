"""One prefill, many compressors: capture what every prefill compressor sees, then replay it.

Every method evaluated here compresses *after* the prefill's own attention has run on the exact
K/V (VarRate by design; kvpress presses in a forward hook; QuantizedCache returns the exact states
to the prefill). So the prefill's hidden states are identical across methods, and a method is a
function of, per layer: the attention input (hidden states), cos/sin, and the layer's full K/V.
We run the uncompressed prefill once with pre-hooks that keep those tensors, and each method
rebuilds its cache from them through its own code path (VarRate's prefill hook and cache update,
kvpress's `forward_hook`, QuantizedCache.update). `tests/test_evaluation.py` checks the replay
against live runs. Because attention is causal, a prefix of the capture is exactly the capture
of the prefix: one forward over A+Q serves both regimes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class Captured:
    """Per layer: keys/values [1, H, S, d] post-RoPE; for full-attention layers, the attention input
    hidden [1, S, hidden] and cos/sin [1, S, d]. `seconds`: the prefill's CPU time (see `clock`)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hidden: dict[int, torch.Tensor]
    cos: dict[int, torch.Tensor]
    sin: dict[int, torch.Tensor]
    seconds: float

    @property
    def length(self) -> int:
        return self.keys[0].shape[-2]

    def prefix(self, n: int) -> "Captured":
        if n == self.length:
            return self
        cut = lambda t: t[..., :n, :]  # noqa: E731  (S is dim -2 for every tensor here)
        return Captured([cut(k) for k in self.keys], [cut(v) for v in self.values],
                        {i: cut(h) for i, h in self.hidden.items()}, {i: cut(c) for i, c in self.cos.items()},
                        {i: cut(s) for i, s in self.sin.items()}, self.seconds)


def clock() -> float:
    """The cost instrument: this process's CPU time. The machine is shared, so wall time mostly measures
    the neighbours; CPU time counts the work done (run with threads: 1 so no thread spins while waiting)."""
    return time.process_time()


def decoder(model):
    """The decoder stack (`model.model`, or its language model for multimodal wrappers)."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


def attention_modules(model) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in decoder(model).layers]


def is_sliding(model, layer_idx: int) -> bool:
    types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
    return bool(types) and types[layer_idx] == "sliding_attention"


def full_attention_layers(model) -> list[int]:
    return [i for i in range(len(attention_modules(model))) if not is_sliding(model, i)]


def capture(model, ids: list[int]) -> Captured:
    """Run the uncompressed prefill of `ids` (batch 1) and keep what compressors need."""
    modules = attention_modules(model)
    wanted = set(full_attention_layers(model))
    hidden, cos, sin, handles = {}, {}, {}, []

    def keep(module, args, kwargs):
        i = module.layer_idx
        if i in wanted:
            hidden[i] = kwargs["hidden_states"].detach()
            cos[i], sin[i] = (t.detach() for t in kwargs["position_embeddings"])

    for module in modules:
        handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    cache = DynamicCache()  # every layer at full length, also Gemma's sliding ones (QuantizedCache needs them)
    try:
        start = clock()
        with torch.no_grad():
            decoder(model)(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        seconds = clock() - start
    finally:
        for handle in handles:
            handle.remove()
    keys = [layer.keys for layer in cache.layers]
    values = [layer.values for layer in cache.layers]
    return Captured(keys, values, hidden, cos, sin, seconds)
