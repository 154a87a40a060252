"""`VarRateCache`: the codec inside transformers' layered Cache, and its footprint.

Orchestration only: the arithmetic is in `hf_varrate.codec`, one layer's state in `hf_varrate.layers`
(one class per storage mode; switching storage swaps layer objects), saving and loading in
`hf_varrate.serialization`. Sliding-window layers (e.g. Gemma-3's local layers) stay the model's own
sliding layers.
"""

from __future__ import annotations

import copy
import os
import warnings
from dataclasses import dataclass, field

from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from .architecture import check_fits, describe, layer_types
from .bases import Bases
from .binding import bind
from .codec import exact_mask, tensor_bytes
from .config import STORAGES, VarRateConfig
from .errors import VarRateWarning
from .layers import LAYER_CLASSES, CompactLayer, LayerFootprint, MaterializedLayer, VarRateLayer
from .rotary import RopeMemo, RotaryFrequencies
from .serialization import load_cache, save_cache

__all__ = ["Footprint", "VarRateCache"]


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
    def held_bytes(self) -> int:
        """Bytes of the tensors really held: `bytes` in compact storage, full K/V plus codes in materialized."""
        return sum(layer.bytes if layer.held_bytes is None else layer.held_bytes for layer in self.layers)

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
                f"prompt_fraction={self.prompt_fraction:.4f}, held_bytes={self.held_bytes})")


class VarRateCache(Cache):
    """A transformers `Cache` that compresses each full-attention layer's prompt with VarRate.

    Use `VarRateCache.from_pretrained(bases_dir_or_repo, model=model, budget=0.2)`. `model=` (or
    `rope=`) gives the rotary frequencies that `storage="compact"` needs to re-rotate keys.
    """

    is_compileable = False

    def __init__(self, bases: Bases, config: VarRateConfig | None = None, *, model_config=None, model=None,
                 rope: RotaryFrequencies | None = None, **overrides):
        config = config or VarRateConfig()
        config = config.replace(**overrides) if overrides else config
        if model_config is None and model is None:
            raise ValueError("VarRateCache needs model_config= (or model=) to lay out its layers")
        model_config = model.config if model_config is None else model_config
        rope = rope if rope is not None or model is None else RotaryFrequencies.from_model(model)
        if config.storage == "compact" and rope is None:
            raise ValueError(
                "storage='compact' re-rotates keys at every read and needs the model's rotary frequencies: pass "
                "model=model (VarRateCache(bases, model=model, storage='compact')) or use "
                "VarRateCache.from_pretrained(path, model=model, storage='compact')"
            )
        text_config = model_config.get_text_config(decoder=True)
        shape = describe(model_config)
        bases.validate(model_config)  # a BasesError naming what differs, not a shape crash at the prefill
        cap = min(config.rank or bases.rank, bases.rank, shape.width)
        if config.r_min > cap:
            raise ValueError(f"r_min must be <= the rank cap R = min(rank, basis rank, D) = {cap}, got r_min="
                             f"{config.r_min}; lower r_min to at most {cap} (or use bases of higher rank)")
        memo = RopeMemo()
        layers = []
        for i, kind in enumerate(layer_types(text_config)):
            if kind == "sliding_attention":
                layers.append(DynamicSlidingWindowLayer(sliding_window=shape.sliding_window))
            else:
                layers.append(LAYER_CLASSES[config.storage](i, bases, config, rope, memo))
        super().__init__(layers=layers)
        self.config = config
        self.bases = bases
        self.model_shape = shape
        self.rope = rope
        self.rope_memo = memo
        self._last_varrate = max((i for i, layer in enumerate(layers) if isinstance(layer, VarRateLayer)), default=-1)
        self._warned_exact = False

    @classmethod
    def from_pretrained(cls, path_or_repo_id, model, *, preset: str = "recommended", revision=None, cache_dir=None,
                        local_files_only=False, token=None, **config_overrides) -> VarRateCache:
        """Load bases (local directory first, then the Hub), check them against `model`, bind `model`.

        `preset` picks the defaults: 'recommended' (the default: see `VarRateConfig.preset` and the README's
        issue #8 section) or 'paper' (the paper's Section 4.1, for reproduction); keyword arguments override
        single fields (budget=0.3, storage='compact', ...). See `Bases.config` for how the bases shape them."""
        if model is None:
            raise ValueError("model= is required: VarRateCache.from_pretrained(path, model=model) binds it")
        bases = Bases.from_pretrained(path_or_repo_id, revision=revision, cache_dir=cache_dir,
                                      local_files_only=local_files_only, token=token)
        for note in bases.validate(model.config):
            warnings.warn(note, VarRateWarning, stacklevel=2)
        config = bases.config(preset, stacklevel=3, **config_overrides)
        bind(model)
        cache = cls(bases, config, model_config=model.config, model=model)
        cache.bases_source = str(path_or_repo_id)
        return cache

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        check_fits(self.model_shape, layer_idx, num_kv_heads=key_states.shape[1], head_dim=key_states.shape[-1])
        layer = self.layers[layer_idx]
        if isinstance(layer, CompactLayer) and layer.awaits_prefill and key_states.shape[-2] > 1:
            self._hold_compact_if_possible(layer_idx, layer, key_states)
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        if layer_idx == self._last_varrate:
            self.rope_memo.clear()  # the forward's RoPE tables are not kept between forwards
        warn = self.config.budget < 1.0 and not self._warned_exact  # budget 1.0 means: keep everything
        if warn and isinstance(layer, VarRateLayer) and any(map(_over_budget, layer.codes)):
            self._warned_exact = True
            warnings.warn(
                f"budget={self.config.budget} cannot cover the exact set (stride {self.config.stride}, window "
                f"{self.config.window}) plus r_min={self.config.r_min} for every coded token of this prompt, so "
                f"the prompt is stored exactly (nothing lost; see cache.footprint()). Set anchor_share=0.25 (the "
                f"stride then grows to fit the budget), raise the budget or the stride, or lower r_min, to compress it",
                VarRateWarning,
                stacklevel=2,
            )
        return out

    def _hold_compact_if_possible(self, layer_idx: int, layer: CompactLayer, keys) -> None:
        """Compact storage re-rotates with recomputed RoPE tables: a prefill whose tables are not those, bit for
        bit, is held materialized (the layer is swapped), with a warning."""
        reason = layer.rope_known(keys)
        if reason:
            warnings.warn(f"layer {layer_idx}: storage='compact' falls back to 'materialized': {reason}",
                          VarRateWarning, stacklevel=4)
            self.layers[layer_idx] = MaterializedLayer.from_layer(layer)

    def set_storage(self, storage: str) -> VarRateCache:
        """Switch every compressed layer to 'compact' or 'materialized' in place (same tokens either way):
        e.g. keep many compressed documents compact at rest, materialize the one being answered for fast
        decoding, and compact it again afterwards. Returns the cache."""
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {list(STORAGES)}, got {storage!r}")
        if storage == "compact" and self.rope is None:
            raise ValueError("storage='compact' needs the model's rotary frequencies: build the cache with model=model")
        self.config = self.config.replace(storage=storage)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, VarRateLayer):
                self.layers[i] = LAYER_CLASSES[storage].from_layer(layer)
                self.layers[i].config = self.config
        self.rope_memo.clear()
        return self

    def footprint(self) -> Footprint:
        """Measured bytes per layer: codes and exact tokens for VarRate layers, tensors for the others."""
        layers = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, VarRateLayer):
                layers.append(layer.footprint())
            else:
                held = tensor_bytes(layer.keys, layer.values) if layer.is_initialized else 0
                layers.append(LayerFootprint(i, "sliding", held, held))
        return Footprint(layers)

    # a compressed document, saved and loaded (safetensors + JSON; see hf_varrate.serialization) -----------
    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write this cache's codes, exact tokens and settings to `save_directory`."""
        save_cache(self, save_directory)

    @classmethod
    def load(cls, directory: str | os.PathLike, model, *, bases: Bases | None = None, **config_overrides) -> VarRateCache:
        """Load a cache saved by `save_pretrained` for `model` (bound on return). The bases are the ones it was
        saved with (read again from where they came, or pass `bases=`); `storage=` may be overridden."""
        return load_cache(cls, directory, model, bases=bases, **config_overrides)

    def __deepcopy__(self, memo):
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            setattr(clone, name, copy.deepcopy(value, memo))
        clone.rope_memo.clear()
        return clone


def _over_budget(code) -> bool:
    """Stored exactly because the budget fell short; not a prompt with nothing to code (all anchors or window)."""
    return code.stored_exactly and not bool(exact_mask(code.seq_len, code.stride, code.window).all())
