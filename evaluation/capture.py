"""Capture one uncompressed prefill, then replay it into any cache: the toolkit evaluation/ and benchmarks/ share.

Every method evaluated or benchmarked here compresses *after* the prefill's own attention has run on
the exact K/V (VarRate by design; kvpress presses in a forward hook; QuantizedCache returns the exact
states to the prefill). So the prefill's hidden states are identical across methods, and a method is a
function of, per layer: the attention input (hidden states), cos/sin, and the layer's full K/V.
`capture` runs the uncompressed prefill once with pre-hooks that keep those tensors; `replay` feeds
them to a cache through the library's own path (`hf_varrate.binding.prefill_hook`, then
`cache.update`), exactly as a bound attention module does; kvpress's presses are replayed through
their `forward_hook` (evaluation/methods/kvpress_methods.py). `tests/test_evaluation.py` checks the
replays against live runs. Because attention is causal, a prefix of the capture is exactly the
capture of the prefix: one forward over A+Q serves both regimes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache

from hf_varrate import VarRateLayer
from hf_varrate.binding import attention_modules, cache_kwarg


@dataclass
class Captured:
    """Per layer: keys/values [1, H, S, d] post-RoPE; for full-attention layers, the attention input
    hidden [1, S, hidden] (or its last rows: see `capture(hidden_tail=)`) and cos/sin [1, S, d].
    `seconds`: the prefill's time on the clock `capture` was given."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hidden: dict[int, torch.Tensor]
    cos: dict[int, torch.Tensor]
    sin: dict[int, torch.Tensor]
    seconds: float

    @property
    def length(self) -> int:
        return self.keys[0].shape[-2]

    def prefix(self, n: int) -> Captured:
        """The capture of the first `n` tokens (attention is causal, so it is the prefill of the prefix)."""
        if n == self.length:
            return self
        if any(h.shape[-2] != self.length for h in self.hidden.values()):
            raise ValueError(f"prefix({n}) needs the whole attention input, but this capture kept only its last "
                             f"rows; capture without hidden_tail to cut it")
        cut = lambda t: t[..., :n, :]  # noqa: E731  (S is dim -2 for every tensor here)
        return Captured([cut(k) for k in self.keys], [cut(v) for v in self.values],
                        {i: cut(h) for i, h in self.hidden.items()}, {i: cut(c) for i, c in self.cos.items()},
                        {i: cut(s) for i, s in self.sin.items()}, self.seconds)

    def with_kv_dtype(self, dtype: torch.dtype) -> Captured:
        """The same capture with K/V and cos/sin cast to `dtype` (e.g. a 16-bit cache from an fp32 run).
        The attention input keeps its dtype: the model's own q_proj reads it at the replay."""
        cast = lambda tensors: [t.to(dtype) for t in tensors]  # noqa: E731
        return replace(self, keys=cast(self.keys), values=cast(self.values),
                       cos={i: c.to(dtype) for i, c in self.cos.items()},
                       sin={i: s.to(dtype) for i, s in self.sin.items()})


def clock() -> float:
    """The evaluation's cost instrument: this process's CPU time. The machine is shared, so wall time mostly
    measures the neighbours; CPU time counts the work done (run with threads: 1 so no thread spins while
    waiting). Benchmarks pass `time.perf_counter` instead: they report wall seconds under a recorded load."""
    return time.process_time()


def decoder(model):
    """The decoder stack (`model.model`, or its language model for multimodal wrappers)."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


def is_sliding(model, layer_idx: int) -> bool:
    types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
    return bool(types) and types[layer_idx] == "sliding_attention"


def full_attention_layers(model) -> list[int]:
    """Indices of the layers VarRate compresses (Gemma-3's sliding-window layers keep their window)."""
    return [m.layer_idx for m in attention_modules(model) if not is_sliding(model, m.layer_idx)]


def capture(model, ids, *, timer=clock, hidden_tail: int | None = None) -> Captured:
    """Run the uncompressed prefill of `ids` (a list of token ids or a [1, S] tensor; batch 1) and keep
    what compressors need. `hidden_tail`: keep only the last rows of the attention input (enough for the
    window queries of a replay; less memory at long lengths, but no `prefix`)."""
    wanted = set(full_attention_layers(model))
    hidden, cos, sin, handles = {}, {}, {}, []

    def keep(module, args, kwargs):
        i = module.layer_idx
        if i in wanted:
            states = kwargs["hidden_states"].detach()
            hidden[i] = states[:, -hidden_tail:].clone() if hidden_tail else states
            cos[i], sin[i] = (t.detach() for t in kwargs["position_embeddings"])

    for module in attention_modules(model):
        handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    cache = DynamicCache()  # every layer at full length, also Gemma's sliding ones (QuantizedCache needs them)
    try:
        start = timer()
        with torch.no_grad():
            inner = decoder(model)
            inner(input_ids=torch.as_tensor(ids).view(1, -1), use_cache=True, **{cache_kwarg(inner): cache})
        seconds = timer() - start
    finally:
        for handle in handles:
            handle.remove()
    return Captured([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers],
                    hidden, cos, sin, seconds)


def replay(cache, model, captured: Captured, *, timer=clock, hook=None) -> float:
    """Feed a captured prefill to `cache` layer by layer as a bound model's prefill does: for each
    full-attention layer the library's prefill hook (`hook`, default `hf_varrate.binding.prefill_hook`)
    with the kwargs the attention module would get, then `cache.update` for every layer. Returns the
    seconds (on `timer`) spent in the hook and update of the cache's VarRate layers, and in coding the prompt
    they hold (`cache.compress()`, as a prefill that is then reused ends: the question is not coded with it)."""
    if hook is None:
        from hf_varrate.binding import prefill_hook as hook
    spent = 0.0
    with torch.no_grad():
        for module in attention_modules(model):
            i = module.layer_idx
            start = timer()
            if i in captured.hidden:
                rope = (captured.cos[i], captured.sin[i])
                kwargs = {"hidden_states": captured.hidden[i], "position_embeddings": rope,
                          "past_key_values": cache, "attention_mask": None}
                hook(module, (), kwargs)
            cache.update(captured.keys[i], captured.values[i], i)
            if isinstance(cache.layers[i], VarRateLayer):
                spent += timer() - start
        start = timer()
        compress = getattr(cache, "compress", None)
        if compress is not None:
            compress()
            spent += timer() - start
    return spent
