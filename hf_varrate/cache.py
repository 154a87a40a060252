"""`VarRateLayer` and `VarRateCache`: the codec inside transformers' layered Cache.

Orchestration only; the arithmetic is in `hf_varrate.codec`. A layer's first update with more
than one token is the prefill: the prefill's own attention gets the exact K/V it was given, the
layer stores the reconstruction, and every later token is appended exactly.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from .architecture import describe, layer_types
from .bases import Bases
from .binding import PrefillContext, bind
from .codec import PromptCode, decode_prompt, encode_prompt
from .config import VarRateConfig

UNBOUND_MESSAGE = (
    "VarRateCache needs the model bound to it to see the prefill's queries: build the cache with "
    "VarRateCache.from_pretrained(bases, model=model) or call hf_varrate.bind(model) before generate()"
)


class VarRateWarning(UserWarning):
    """Something the codec did differently from what was asked, without losing data."""


@dataclass
class LayerFootprint:
    layer_idx: int
    kind: str  # "varrate", "sliding" or "exact"
    bytes: int
    full_bytes: int
    rows_stored_exactly: int = 0
    appended_bytes: int = 0  # tokens added after the prefill, stored exactly (part of `bytes`)

    @property
    def fraction(self) -> float:
        return self.bytes / self.full_bytes if self.full_bytes else 1.0

    @property
    def prompt_fraction(self) -> float:
        full = self.full_bytes - self.appended_bytes
        return (self.bytes - self.appended_bytes) / full if full else 1.0


@dataclass
class Footprint:
    """Bytes the cache holds for its sequences vs. the same tokens in a plain DynamicCache."""

    layers: list[LayerFootprint] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(layer.bytes for layer in self.layers)

    @property
    def full_bytes(self) -> int:
        return sum(layer.full_bytes for layer in self.layers)

    @property
    def fraction(self) -> float:
        return self.bytes / self.full_bytes if self.full_bytes else 1.0

    @property
    def prompt_fraction(self) -> float:
        """The compressed prompt alone: what the budget controls (later tokens are stored exactly)."""
        appended = sum(layer.appended_bytes for layer in self.layers)
        full = self.full_bytes - appended
        return (self.bytes - appended) / full if full else 1.0

    def __repr__(self):
        return (f"Footprint(bytes={self.bytes}, full_bytes={self.full_bytes}, fraction={self.fraction:.4f}, "
                f"prompt_fraction={self.prompt_fraction:.4f})")


class VarRateLayer(DynamicLayer):
    """One full-attention layer: compresses its prompt once, then grows exactly like a DynamicLayer.

    `codes[b]` is sequence b's `PromptCode`; `positions[b]` the cache slots of its real (non-padding)
    prompt tokens; `appended` counts tokens added after the prefill.
    """

    def __init__(self, layer_idx: int, bases: Bases, config: VarRateConfig):
        super().__init__()
        self.layer_idx = layer_idx
        self.bases = bases
        self.config = config
        self._reset_state()

    def _reset_state(self):
        self.prefill_context: PrefillContext | None = None
        self.prefilled = False
        self.codes: list[PromptCode] = []
        self.positions: list[torch.Tensor] = []
        self.prompt_len = 0
        self.appended = 0

    @property
    def awaits_prefill(self) -> bool:
        return not self.prefilled

    @property
    def ranks(self):
        """Per-token ranks of the coded tokens: a LongTensor [C] for one sequence, a list for a batch."""
        ranks = [code.ranks.long() for code in self.codes]
        return ranks[0] if len(ranks) == 1 else ranks

    @property
    def rows_stored_exactly(self) -> int:
        return sum(code.stored_exactly for code in self.codes)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.prefilled or key_states.shape[-2] <= 1:
            self.appended += key_states.shape[-2] if self.prefilled else 0
            self.prefilled = True
            return super().update(key_states, value_states)
        self.prefilled = True
        context, self.prefill_context = self.prefill_context, None
        if context is None:
            raise RuntimeError(UNBOUND_MESSAGE)
        self.keys, self.values = self._compress(key_states, value_states, context)
        self.prompt_len = key_states.shape[-2]
        return key_states, value_states  # the prefill attends to the exact K/V

    def _compress(self, keys, values, context: PrefillContext):
        if not (torch.isfinite(keys).all() and torch.isfinite(values).all()):
            raise ValueError(
                f"layer {self.layer_idx}: keys or values contain NaN or inf at the prefill; VarRate refuses to "
                f"code them. Check the model's dtype (fp16 overflow?) and inputs"
            )
        basis = self.bases.for_layer(self.layer_idx, keys.device)
        out_k, out_v = keys.clone(), values.clone()
        for b in range(keys.shape[0]):
            pos = self._row_positions(context, b, keys)
            code = self._compress_row(keys[b : b + 1, :, pos], values[b : b + 1, :, pos], context, b, pos, basis)
            if not code.stored_exactly:
                k, v = keys[b : b + 1, :, pos], values[b : b + 1, :, pos]
                cos, sin = _row(context.cos, b)[:, pos], _row(context.sin, b)[:, pos]
                k_hat, v_hat = decode_prompt(code, k[:, :, code.exact_pos], v[:, :, code.exact_pos], cos, sin, basis)
                out_k[b : b + 1, :, pos], out_v[b : b + 1, :, pos] = k_hat, v_hat
            self.codes.append(code)
            self.positions.append(pos)
        return out_k, out_v

    def _row_positions(self, context, b, keys):
        if context.key_valid is None:
            return torch.arange(keys.shape[-2], device=keys.device)
        return context.key_valid[b].nonzero()[:, 0].to(keys.device)

    def _compress_row(self, k, v, context, b, pos, basis):
        queries = _row(context.queries, b)
        queries = queries[:, :, -min(queries.shape[2], pos.numel()) :] if pos.numel() else queries[:, :, :0]
        cos, sin = _row(context.cos, b)[:, pos], _row(context.sin, b)[:, pos]
        return encode_prompt(k, v, queries, cos, sin, basis, self.config, context.scaling)

    def footprint(self) -> LayerFootprint:
        if not self.codes:  # never compressed: held exactly, like a DynamicLayer
            held = _valid_tokens_bytes(self)
            return LayerFootprint(self.layer_idx, "exact", held, held)
        per_token = self.codes[0].width * self.codes[0].kv_bytes
        kept_prompt = self.get_seq_length() - self.appended
        stored = sum(code.nbytes(limit=kept_prompt - (self.prompt_len - code.seq_len)) for code in self.codes)
        full = sum(min(code.seq_len, kept_prompt - (self.prompt_len - code.seq_len)) for code in self.codes)
        tail = self.appended * len(self.codes) * per_token
        return LayerFootprint(self.layer_idx, "varrate", stored + tail, full * per_token + tail,
                              self.rows_stored_exactly, tail)

    # cache operations: the tensors follow DynamicLayer, the per-sequence codes follow the tensors
    def reset(self) -> None:
        super().reset()
        self._reset_state()

    def crop(self, tokens_to_remove: int) -> None:
        length = self.get_seq_length()
        super().crop(tokens_to_remove)
        removed = length - self.get_seq_length()
        self.appended = max(self.appended - removed, 0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._select_rows([i for i in range(len(self.codes)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        rows = torch.arange(len(self.codes))[indices.cpu() if torch.is_tensor(indices) else indices]
        self._select_rows(rows.tolist())

    def _select_rows(self, rows: list[int]) -> None:
        if self.codes:
            self.codes = [self.codes[i] for i in rows]
            self.positions = [self.positions[i] for i in rows]


class VarRateCache(Cache):
    """A transformers `Cache` that compresses each full-attention layer's prompt with VarRate.

    Sliding-window layers (e.g. Gemma-3's local layers) stay the model's own sliding layers.
    Use `VarRateCache.from_pretrained(bases_dir_or_repo, model=model, budget=0.2)`.
    """

    is_compileable = False

    def __init__(self, bases: Bases, config: VarRateConfig | None = None, *, model_config, **overrides):
        config = (config or VarRateConfig()).replace(**overrides) if overrides else (config or VarRateConfig())
        text_config = model_config.get_text_config(decoder=True)
        shape = describe(model_config)
        layers = []
        for i, kind in enumerate(layer_types(text_config)):
            if kind == "sliding_attention":
                layers.append(DynamicSlidingWindowLayer(sliding_window=shape.sliding_window))
            else:
                layers.append(VarRateLayer(i, bases, config))
        super().__init__(layers=layers)
        self.config = config
        self.bases = bases
        self.model_shape = shape
        self._warned_exact = False

    @classmethod
    def from_pretrained(cls, path_or_repo_id, model, *, revision=None, cache_dir=None, local_files_only=False,
                        token=None, **config_overrides) -> VarRateCache:
        """Load bases (local directory first, then the Hub), check them against `model`, bind `model`."""
        if model is None:
            raise ValueError("model= is required: VarRateCache.from_pretrained(path, model=model) binds it")
        bases = Bases.from_pretrained(path_or_repo_id, revision=revision, cache_dir=cache_dir,
                                      local_files_only=local_files_only, token=token)
        for note in bases.validate(model.config):
            warnings.warn(note, VarRateWarning, stacklevel=2)
        calibrated = {k: bases.metadata[k] for k in ("stride", "window", "n_anchors") if k in bases.metadata}
        config = VarRateConfig(**{**calibrated, **config_overrides})
        bind(model)
        return cls(bases, config, model_config=model.config)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        warn = self.config.budget < 1.0 and not self._warned_exact  # budget 1.0 means: keep everything
        if warn and isinstance(layer, VarRateLayer) and layer.rows_stored_exactly:
            self._warned_exact = True
            warnings.warn(
                f"budget={self.config.budget} cannot cover the exact set (stride {self.config.stride}, window "
                f"{self.config.window}) plus r_min={self.config.r_min} for every coded token of this prompt, so "
                f"the prompt is stored exactly (nothing lost; see cache.footprint()). Raise the budget or the "
                f"stride, or lower r_min, to compress it",
                VarRateWarning,
                stacklevel=2,
            )
        return out

    def footprint(self) -> Footprint:
        """Measured bytes per layer: codes and exact tokens for VarRate layers, tensors for the others."""
        layers = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, VarRateLayer):
                layers.append(layer.footprint())
            else:
                held = _valid_tokens_bytes(layer)
                layers.append(LayerFootprint(i, "sliding", held, held))
        return Footprint(layers)


def _row(tensor: torch.Tensor, b: int) -> torch.Tensor:
    """Row b of a [B or 1, ...] tensor, keeping the batch dim (cos/sin may be shared across rows)."""
    return tensor[b : b + 1] if tensor.shape[0] > 1 else tensor


def _valid_tokens_bytes(layer) -> int:
    if not layer.is_initialized or layer.keys is None:
        return 0
    return layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
