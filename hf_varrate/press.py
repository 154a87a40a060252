"""`VarRatePress`: VarRate as a kvpress press (a kvpress `BasePress`), for kvpress's pipeline and harness.

    from transformers import pipeline
    from hf_varrate.press import VarRatePress
    press = VarRatePress.from_pretrained("smollm2-135m-instruct", budget=0.2)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    pipe(context, question=question, press=press)

Like kvpress's presses it works in a forward hook after each attention layer's prefill: it reads the
layer's K/V from the DynamicCache, codes them with the VarRate codec (`hf_varrate.codec`, the functions
VarRateCache uses) and writes back the reconstruction, so the prefill attends to exact K/V and
everything after reads the coded prompt. `press.codes` holds each layer's codes; `press.layer_bytes()`
what they cost.

What a press can save: kvpress presses hand K/V *tensors* back to the cache, so a press saves memory
only by evicting tokens. VarRate evicts none (every token is kept, at a variable rank), so the cache
holds a full-size reconstruction: the press measures VarRate's quality at a budget, not its memory
(`compression_ratio` is 0, in kvpress's sense of tokens evicted). For the memory, hand the pipeline a
`VarRateCache` in compact storage instead (codes and exact tokens only) and no press, through
`hf_varrate.kvpress_pipeline.VarRateTextGenerationPipeline`, which codes the document alone and gives
each question the document alone (kvpress's own pipeline trims `.keys` directly, which a compact layer
does not hold in full).

Composing: `ComposedPress([VarRatePress(...), SnapKVPress(...)])` codes the prompt, then evicts from
its reconstruction. The other order is refused at the prefill: kvpress's scorer presses keep different
tokens in each head and do not say which, while VarRate codes each token across all heads (D = 2·H·d)
at its rotary position. `KeyRerotationPress` (and kvpress's other wrappers) take a `ScorerPress` only
and refuse VarRatePress with kvpress's bare `AssertionError`: with nothing evicted there is nothing to
re-rotate.

Importing this module needs no kvpress; where kvpress is installed it is imported here (kvpress wraps
transformers' attention functions on import) so that VarRatePress subclasses its BasePress. Building a
press without kvpress raises an ImportError that says how to install it.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass, field

import torch

from .bases import Bases
from .binding import window_queries
from .codec import PromptCode, decode_prompt, encode_prompt
from .codec.salience import attention_scale
from .config import VarRateConfig
from .errors import VarRateWarning
from .layers import VarRateLayer

INSTALL_HINT = ("VarRatePress is a kvpress press and needs kvpress: "
                "pip install kvpress (or pip install 'hf_varrate[eval]')")

try:  # the optional `eval` extra
    from kvpress import BasePress
except ImportError as err:
    BasePress, KVPRESS_IMPORT_ERROR = object, err  # a press cannot be built: `require_kvpress` says why
else:
    KVPRESS_IMPORT_ERROR = None


def require_kvpress() -> None:
    if importlib.util.find_spec("kvpress") is None:
        raise ImportError(INSTALL_HINT)
    if KVPRESS_IMPORT_ERROR is not None:
        raise ImportError(f"{INSTALL_HINT}; kvpress is installed but failed to import: {KVPRESS_IMPORT_ERROR}")


@dataclass
class VarRatePress(BasePress):
    """VarRate compression as a kvpress `BasePress`: `with press(model): ...`, `forward_hook`, `compress`.

    Keeps every token (see the module docstring for what that means for memory and composition)."""

    bases: Bases
    config: VarRateConfig = field(default_factory=VarRateConfig)
    codes: dict[int, list[PromptCode]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        require_kvpress()
        if not isinstance(self.bases, Bases):
            raise TypeError(f"bases must be a hf_varrate.Bases, got {type(self.bases).__name__}; "
                            f"use VarRatePress.from_pretrained(path_or_repo_id)")
        if not isinstance(self.config, VarRateConfig):
            raise TypeError(f"config must be a hf_varrate.VarRateConfig, got {type(self.config).__name__}; "
                            f"use VarRateConfig(budget=...) or VarRatePress.from_pretrained(path, budget=...)")

    @property
    def compression_ratio(self) -> float:
        """The fraction of tokens evicted, as kvpress counts (ComposedPress multiplies these): 0, VarRate
        keeps every token. Its bytes are set by `config.budget`."""
        return 0.0

    @compression_ratio.setter
    def compression_ratio(self, value):
        raise ValueError(f"VarRatePress evicts no tokens, so its compression_ratio stays 0 (got {value!r}); set its "
                         f"byte budget instead: press.config = press.config.replace(budget=1 - compression_ratio)")

    @classmethod
    def from_pretrained(cls, path_or_repo_id, *, preset: str = "recommended", revision=None, subfolder=None,
                        cache_dir=None, force_download=False, local_files_only=False, token=None,
                        **config_overrides) -> VarRatePress:
        """Load bases like VarRateCache.from_pretrained, with the same `preset`, the same Hub arguments and the
        same rules (`Bases.config`); keyword arguments override VarRateConfig fields."""
        bases = Bases.from_pretrained(path_or_repo_id, revision=revision, subfolder=subfolder, cache_dir=cache_dir,
                                      force_download=force_download, local_files_only=local_files_only, token=token)
        return cls(bases, bases.config(preset, stacklevel=3, **config_overrides))

    def post_init_from_model(self, model):
        for note in self.bases.validate(model.config):
            warnings.warn(note, VarRateWarning, stacklevel=3)
        self.codes = {}

    def covers(self, layer_idx: int) -> bool:
        """Whether the bases code this layer (Gemma-3's sliding layers are left alone)."""
        return layer_idx in set(self.bases.metadata.get("compressed_layers", self.bases.tensors))

    def forward_hook(self, module, inputs, kwargs, output):
        """BasePress's hook (prefill only: read K/V, `compress`, write back) on the layers the bases cover,
        after refusing the caches a written-back reconstruction would be wrong for."""
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        hidden = kwargs["hidden_states"]
        if cache is None or hidden.shape[1] <= 1 or not self.covers(module.layer_idx):
            return output
        layer = cache.layers[module.layer_idx]
        if isinstance(layer, VarRateLayer):
            raise ValueError("VarRatePress writes a reconstruction into a DynamicCache, but the cache is a "
                             "VarRateCache, which codes its prompt itself: pass press=None (and, for several "
                             "questions, hf_varrate.kvpress_pipeline.VarRateTextGenerationPipeline), or a DynamicCache")
        if hasattr(layer, "_quantized_keys"):
            raise NotImplementedError("VarRatePress does not compose with QuantizedCache; use a DynamicCache")
        kwargs = {**kwargs, "past_key_values": cache}  # BasePress reads it under its pre-5.3 name
        return super().forward_hook(module, inputs, kwargs, output)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        """Keys/values [B, H, S, d] -> their VarRate reconstruction (same shape); records the codes."""
        if keys.shape[2] != hidden_states.shape[1]:
            raise ValueError(
                f"layer {module.layer_idx}: VarRatePress got {keys.shape[2]} of the prefill's {hidden_states.shape[1]} "
                f"tokens: a press before it evicted tokens (in ComposedPress, or a wrapper), per head and without "
                f"saying which, and VarRate codes each token across all heads at its rotary position. Put "
                f"VarRatePress first: ComposedPress([VarRatePress(...), SnapKVPress(...)])")
        cos, sin = kwargs["position_embeddings"]
        basis, scales = self.bases.coding_basis(module.layer_idx, self.config.balance, keys.device,
                                                key_weight=self.config.key_weight, bits=self.config.basis_bits)
        share = self.bases.layer_share(module.layer_idx, self.config, keys.dtype)
        window = min(self.config.obs_window, hidden_states.shape[1])
        with torch.no_grad():
            queries = window_queries(module, hidden_states, cos, sin, window)  # [B, Hq, W, d]
            out_k, out_v, codes = keys.clone(), values.clone(), []
            for b in range(keys.shape[0]):
                rows = slice(b, b + 1)
                cos_b, sin_b = (cos[rows], sin[rows]) if cos.shape[0] > 1 else (cos, sin)
                k, v = keys[rows], values[rows]
                code = encode_prompt(k, v, queries[rows], cos_b, sin_b, basis, self.config, attention_scale(module),
                                     scales=scales, layer_share=share)
                if not code.stored_exactly:
                    k_hat, v_hat = decode_prompt(code, k[:, :, code.exact_pos], v[:, :, code.exact_pos], cos_b, sin_b,
                                                 basis, scales=scales, projection_dtype=self.config.projection_dtype)
                    out_k[rows], out_v[rows] = k_hat, v_hat
                elif self.config.budget < 1.0:
                    warnings.warn(f"layer {module.layer_idx}: budget={self.config.budget} cannot cover the exact set "
                                  f"plus r_min for every coded token; the prompt is stored exactly", VarRateWarning,
                                  stacklevel=2)
                codes.append(code)
        self.codes[module.layer_idx] = codes
        return out_k, out_v

    def layer_bytes(self) -> dict[int, int]:
        """Bytes the codes of each compressed layer cost (exact tokens, coefficients, anchor indices, ranks)."""
        return {i: sum(code.nbytes() for code in codes) for i, codes in self.codes.items()}
