"""`VarRateCache`: the codec inside transformers' layered Cache.

Orchestration only: the arithmetic is in `hf_varrate.codec`, one layer's state in `hf_varrate.layers`
(one class per storage mode; switching storage swaps layer objects), the bytes it holds in
`hf_varrate.layers.footprint`, saving and loading in `hf_varrate.serialization`. Sliding-window layers
(e.g. Gemma-3's local layers) stay the model's own sliding layers.
"""

from __future__ import annotations

import copy
import os
import warnings

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from .architecture import check_compressible, check_fits, describe, layer_types
from .bases import Bases, build_hint
from .binding import bind
from .codec import exact_mask, tensor_bytes
from .config import STORAGES, VarRateConfig
from .errors import BasesError, VarRateWarning
from .layers import (LAYER_CLASSES, CompactLayer, Footprint, LayerFootprint, MaterializedLayer, PrefillContext,
                     VarRateLayer)
from .signals import SIGNALS
from .rotary import RopeMemo, RotaryFrequencies
from .serialization import load_cache, push_cache, save_cache

__all__ = ["Footprint", "VarRateCache"]


class VarRateCache(Cache):
    """A transformers `Cache` that compresses each full-attention layer's prompt with VarRate.

    Use `VarRateCache.from_pretrained(name_folder_or_repo_id)` (optionally `model=model` for query-aware
    signals, and config overrides such as `budget=0.2`). Built directly, `VarRateCache(bases, config)`
    lays out its layers as the bases record them; `model=` or `model_config=` lays them out from the model
    (and checks the bases against it); `model=` or `rope=` gives the rotary frequencies that compact storage
    and a cache without the model need, where the bases record none.
    """

    is_compileable = False

    def __init__(self, bases: Bases, config: VarRateConfig | None = None, *, model_config=None, model=None,
                 rope: RotaryFrequencies | None = None, **overrides):
        config = VarRateConfig.coerce(config)  # None, a VarRateConfig or a dict of its fields
        config = config.replace(**overrides) if overrides else config
        model_config = model.config if model_config is None and model is not None else model_config
        shape, kinds = _layout(bases, model_config)
        rope = _rope(bases, model, rope)
        if config.storage == "compact" and rope is None:
            warnings.warn("storage='compact' needs the model's rotary frequencies, not recorded in these bases: pass "
                          "model=model; this cache holds 'materialized' (more bytes)", VarRateWarning, stacklevel=2)
            config = config.replace(storage="materialized")
        cap = min(config.rank or bases.rank, bases.rank, shape.width)
        if config.r_min > cap:
            raise ValueError(f"r_min must be <= the rank cap R = min(rank, basis rank, D) = {cap}, got r_min="
                             f"{config.r_min}; lower r_min to at most {cap} (or use bases of higher rank)")
        memo = RopeMemo()
        layers = []
        for i, kind in enumerate(kinds):
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
    def from_pretrained(cls, path_or_repo_id, model=None, *, preset: str = "recommended", revision=None,
                        subfolder=None, cache_dir=None, force_download=False, local_files_only=False, token=None,
                        **config_overrides) -> VarRateCache:
        """Load bases (local directory first, then the Hub) and build a cache coding with them.

        Without `model`, the cache lays out its layers and rotates keys as the bases record (bases written
        by this version record the model's layout and RoPE frequencies), which serves every query-free
        configuration, the default preset included. `model=` checks the bases against the model and binds
        it (`hf_varrate.bind`), which query-aware signals ('snapkv', 'shuffle') need to see the prefill's
        queries. `preset` picks the defaults: 'recommended' (the default: see `VarRateConfig.preset`) or
        'paper' (the paper's Section 4.1, for reproduction); keyword arguments override single fields
        (budget=0.3, storage='compact', ...). See `Bases.config` for how the bases shape them. The Hub
        arguments (revision, subfolder, cache_dir, force_download, local_files_only, token) are
        `Bases.from_pretrained`'s."""
        bases = Bases.from_pretrained(path_or_repo_id, revision=revision, subfolder=subfolder, cache_dir=cache_dir,
                                      force_download=force_download, local_files_only=local_files_only, token=token)
        config = bases.config(preset, stacklevel=3, **config_overrides)
        if model is None:
            _check_servable_unbound(bases, config)
            cache = cls(bases, config)
        else:
            for note in bases.validate(model.config):
                warnings.warn(note, VarRateWarning, stacklevel=2)
            bind(model)
            cache = cls(bases, config, model_config=model.config, model=model)
        cache.bases_source = str(path_or_repo_id)
        return cache

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        check_fits(self.model_shape, layer_idx, num_kv_heads=key_states.shape[1], head_dim=key_states.shape[-1])
        layer = self.layers[layer_idx]
        batch, new = key_states.shape[0], key_states.shape[-2]
        if isinstance(layer, VarRateLayer) and new > 1 and (layer.awaits_prefill or layer.takes_turns(batch)):
            if layer.prefill_context is None:  # no bound model handed it over
                layer.prefill_context = self._unbound_context(layer, key_states, args, kwargs)
        elif isinstance(layer, VarRateLayer) and layer.holding:  # decoding starts: the prompt is complete
            self._finish_prompt(layer_idx)
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == self._last_varrate:
            self.rope_memo.clear()  # the forward's RoPE tables are not kept between forwards
            self._last_tables = None
        return out

    def _unbound_context(self, layer, keys, args, kwargs) -> PrefillContext | None:
        """Without a bound model, what a query-free signal needs at the prefill: the RoPE tables, from what
        transformers hands `update` (cos/sin before 5.24, position_ids since) and the recorded frequencies.
        None (the prefill then says what to pass) when the signal reads queries or no positions are known."""
        if SIGNALS[self.config.signal].query_aware:
            return None
        passed = args[0] if args and isinstance(args[0], dict) else kwargs.get("kwargs") or kwargs.get("cache_kwargs")
        passed = passed if isinstance(passed, dict) else {}
        cos, sin = passed.get("cos"), passed.get("sin")
        if cos is None or sin is None:
            if self.rope is None:
                return None
            positions = passed.get("position_ids")
            if positions is None:  # a forward without position ids numbers the new tokens after the cached ones
                positions = torch.arange(keys.shape[-2], device=keys.device) + layer.get_seq_length()
            cos, sin = self._tables_at(positions.to(keys.device), keys.dtype)
        queries = keys.new_zeros(keys.shape[0], keys.shape[1], 0, keys.shape[-1])  # query-free: none needed
        return PrefillContext(queries, cos, sin, keys.shape[-1] ** -0.5, None)

    def _tables_at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables at `positions`, one pair for the layers of a forward (each holds them until coding)."""
        last = getattr(self, "_last_tables", None)
        if last is None or last[0] is not positions or last[1] != dtype:
            last = self._last_tables = (positions, dtype, *self.rope.tables_at(positions, dtype))
        return last[2], last[3]

    def compress(self) -> VarRateCache:
        """Code the prompt every layer holds now, instead of at the first decoding step: what a document
        compressed once and reused for many questions needs after its prefill (`model(doc_ids, cache=cache,
        logits_to_keep=1)`), so that the questions read the codes and are not coded with it. Reading the
        footprint, saving, copying and switching storage do the same. Returns the cache."""
        for i, layer in enumerate(self.layers):
            if isinstance(layer, VarRateLayer) and layer.holding:
                self._finish_prompt(i)
            elif isinstance(layer, VarRateLayer) and layer.turn_held:  # a later turn, coded if long enough
                layer.finish_turn()
        self.rope_memo.clear()
        return self

    def _finish_prompt(self, layer_idx: int) -> None:
        """Code layer `layer_idx`'s held prompt. Compact storage re-rotates with recomputed RoPE tables: a
        prompt whose tables are not those, bit for bit, is held materialized (the layer swapped), with a warning."""
        layer = self.layers[layer_idx]
        reason = layer.rope_known() if isinstance(layer, CompactLayer) else None
        if reason:
            warnings.warn(f"layer {layer_idx}: storage='compact' falls back to 'materialized': {reason}",
                          VarRateWarning, stacklevel=4)
            layer = self.layers[layer_idx] = MaterializedLayer.from_layer(layer)
        layer.finish_prompt()
        self._warn_if_stored_exactly(layer)

    def _warn_if_stored_exactly(self, layer: VarRateLayer) -> None:
        """Once per cache: a prompt the budget could not compress was stored as held (every token kept)."""
        if self.config.budget >= 1.0 or self._warned_exact or not any(map(_over_budget, layer.codes)):
            return  # budget 1.0 means: keep everything
        self._warned_exact = True
        seq_len = max(code.seq_len for code in layer.codes if _over_budget(code))
        warnings.warn(
            f"budget={self.config.budget} cannot cover the exact set (stride {self.config.stride}, window "
            f"{self.config.window}) plus r_min={self.config.r_min} for every coded token of this prompt, so "
            f"the prompt is stored as held (every token kept; see hold_dtype and cache.footprint()). "
            f"{_compress_advice(self.config, seq_len)}", VarRateWarning, stacklevel=4)

    def set_storage(self, storage: str) -> VarRateCache:
        """Switch every compressed layer to 'compact' or 'materialized' in place (same tokens either way):
        e.g. keep many compressed documents compact at rest, materialize the one being answered for fast
        decoding, and compact it again afterwards. Returns the cache."""
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {list(STORAGES)}, got {storage!r}")
        self.compress()
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
        """Measured bytes per layer: codes and exact tokens for VarRate layers, tensors for the others (a held
        prompt is coded first, see `compress`)."""
        self.compress()
        layers = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, VarRateLayer):
                layers.append(layer.footprint())
            else:
                held = tensor_bytes(layer.keys, layer.values) if layer.is_initialized else 0
                layers.append(LayerFootprint(i, "sliding", held, held))
        return Footprint(layers, bases_bytes=self.bases.nbytes())

    # a compressed document, saved and loaded (safetensors + JSON; see hf_varrate.serialization) -----------
    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write this cache's codes, exact tokens and settings to `save_directory` (a held prompt is coded first)."""
        self.compress()
        save_cache(self, save_directory)

    def push_to_hub(self, repo_id: str, *, subfolder: str | None = None, private: bool | None = None,
                    revision: str | None = None, token: str | bool | None = None, commit_message: str | None = None,
                    create_pr: bool = False):
        """Save this cache and upload it with a model card to the Hub repo `repo_id` as one commit, for
        `VarRateCache.load(repo_id, model=model)` elsewhere (`serialization.push_cache`). Returns the `CommitInfo`."""
        return push_cache(self, repo_id, subfolder=subfolder, private=private, revision=revision, token=token,
                          commit_message=commit_message, create_pr=create_pr)

    @classmethod
    def load(cls, path_or_repo_id: str | os.PathLike, model, *, bases: Bases | None = None, revision=None,
             subfolder=None, cache_dir=None, force_download=False, local_files_only=False, token=None,
             **config_overrides) -> VarRateCache:
        """Load a cache saved by `save_pretrained` (a folder) or `push_to_hub` (a Hub repo id, with the standard Hub
        arguments) for `model` (bound on return), checked alike. The bases are the ones it was saved with (read
        again from where they came, or pass `bases=`). Only runtime settings may be given (storage=,
        projection_dtype=); a coding-time one (budget, balance, ...) is refused with a ValueError naming it."""
        return load_cache(cls, path_or_repo_id, model, bases=bases, revision=revision, subfolder=subfolder,
                          cache_dir=cache_dir, force_download=force_download, local_files_only=local_files_only,
                          token=token, **config_overrides)

    def __deepcopy__(self, memo):
        self.compress()  # a copy answers from the codes, as the original will
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            setattr(clone, name, copy.deepcopy(value, memo))
        clone.rope_memo.clear()
        return clone


def _check_servable_unbound(bases: Bases, config: VarRateConfig) -> None:
    """Refuse, with what to pass, a cache without a model that could not code its first prompt."""
    if SIGNALS[config.signal].query_aware:
        raise ValueError(f"signal={config.signal!r} reads the prefill's queries, which only a bound model shows the "
                         f"cache: pass model=model (VarRateCache.from_pretrained(path, model=model)), or use a "
                         f"query-free signal such as signal='uniform' (the default preset's)")
    if bases.rope() is None:
        raise BasesError(f"these bases do not record the model's RoPE frequencies (written by an older hf_varrate), "
                         f"so a cache without the model cannot un-rotate keys: pass model=model, or rebuild the "
                         f"bases with this version: {build_hint(bases.metadata)}")
    bases.model_shape()  # the layout (a BasesError if not recorded)


def _layout(bases: Bases, model_config) -> tuple:
    """(ModelShape, each layer's kind) from the model's config, checked against the bases; without a config,
    as the bases record them."""
    if model_config is None:
        shape = bases.model_shape()
        kinds = ["full_attention" if i in shape.compressed_layers else "sliding_attention"
                 for i in range(shape.num_layers)]
        return shape, kinds
    shape = check_compressible(describe(model_config))
    bases.validate(model_config)  # a BasesError naming what differs, not a shape crash at the prefill
    return shape, layer_types(model_config.get_text_config(decoder=True))


def _rope(bases: Bases, model, given: RotaryFrequencies | None) -> RotaryFrequencies | None:
    """The compressed layers' RoPE frequencies: given, the model's, or the bases' record; a model whose
    frequencies differ from those the bases record is refused (its keys would be un-rotated wrongly)."""
    recorded = bases.rope()
    if given is not None:
        return given
    if model is None:
        return recorded
    rope = RotaryFrequencies.from_model(model)
    if rope is not None and recorded is not None and not rope.same_as(recorded):
        raise BasesError(
            f"the model's rotary frequencies (RoPE) differ from those recorded in these bases (calibrated on "
            f"{bases.metadata.get('model_id')!r}): a long-context variant or another rope_scaling? Use bases "
            f"calibrated for this model: {build_hint(bases.metadata)}")
    return rope if rope is not None else recorded


def _compress_advice(config: VarRateConfig, seq_len: int) -> str:
    """What would let a `seq_len`-token prompt compress, given what `config` already does (the 'recommended'
    preset already sets anchor_share: then a short prompt's blocker is the exact window)."""
    if config.anchor_share is None:
        return ("Set anchor_share=0.25 (the stride then grows to fit the budget), raise the budget or the stride, "
                "or lower r_min, to compress it")
    allowed = config.anchor_share * config.budget * seq_len  # tokens the exact set may take
    if config.window > allowed:
        return (f"anchor_share={config.anchor_share} already grows the stride, but the last window={config.window} "
                f"tokens alone exceed the {allowed:.0f} exact tokens this {seq_len}-token prompt's budget allows: "
                f"lower window (e.g. window={max(1, int(allowed) // 2)}) or raise the budget to compress it")
    return (f"anchor_share={config.anchor_share} already grows the stride; raise the budget or lower "
            f"r_min={config.r_min} to compress it")


def _over_budget(code) -> bool:
    """Stored exactly because the budget fell short; not a prompt with nothing to code (all anchors or window)."""
    return code.stored_exactly and not bool(exact_mask(code.seq_len, code.stride, code.window).all())
