"""`VarRatePress`: VarRate as a kvpress press, for kvpress's pipeline and evaluation harness.

    from kvpress import KVPressTextGenerationPipeline
    from hf_varrate.press import VarRatePress
    press = VarRatePress.from_pretrained("smollm2-135m-instruct", budget=0.2)
    pipe(context, question=question, press=press)

Like kvpress's presses it works in a forward hook after each attention layer's prefill: it reads
the layer's K/V from the (Dynamic) cache, compresses them with the VarRate codec
(`hf_varrate.codec`, the functions VarRateCache uses) and writes back the reconstruction, so the
prefill attends to exact K/V and everything after reads the coded prompt. Nothing is evicted: the
cache keeps its length. `press.codes` holds each layer's codes; `press.layer_bytes()` what they cost.

Importing this module needs no kvpress (and imports none: kvpress patches transformers' attention
functions on import). Building a press without kvpress installed raises an ImportError that says
how to install it.
"""

from __future__ import annotations

import contextlib
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

INSTALL_HINT = "VarRatePress is a kvpress press and needs kvpress: pip install kvpress (or pip install 'hf_varrate[eval]')"


def require_kvpress() -> None:
    if importlib.util.find_spec("kvpress") is None:
        raise ImportError(INSTALL_HINT)


@dataclass
class VarRatePress:
    """VarRate compression in kvpress's press protocol (`with press(model): ...`, `forward_hook`, `compress`)."""

    bases: Bases
    config: VarRateConfig = field(default_factory=VarRateConfig)
    codes: dict[int, list[PromptCode]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        require_kvpress()
        if not isinstance(self.bases, Bases):
            raise TypeError(f"bases must be a hf_varrate.Bases, got {type(self.bases).__name__}; "
                            f"use VarRatePress.from_pretrained(path_or_repo_id)")

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

    @contextlib.contextmanager
    def __call__(self, model):
        """Hook every attention layer the bases cover (Gemma-3's sliding layers are left alone)."""
        self.post_init_from_model(model)
        covered = set(self.bases.metadata.get("compressed_layers", self.bases.tensors))
        decoder = model.model.language_model if hasattr(model.model, "language_model") else model.model
        handles = [layer.self_attn.register_forward_hook(self.forward_hook, with_kwargs=True)
                   for layer in decoder.layers if layer.self_attn.layer_idx in covered]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def forward_hook(self, module, inputs, kwargs, output):
        hidden = kwargs["hidden_states"]
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        position = kwargs.get("cache_position")
        prefilling = position is not None and int(position[-1]) + 1 == hidden.shape[1]
        if cache is None or not prefilling or hidden.shape[1] <= 1:
            return output
        layer = cache.layers[module.layer_idx]
        if hasattr(layer, "_quantized_keys"):
            raise NotImplementedError("VarRatePress does not compose with QuantizedCache; use a DynamicCache")
        layer.keys, layer.values = self.compress(module, hidden, layer.keys, layer.values, output[1], kwargs)
        return output

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        """Keys/values [B, H, S, d] -> their VarRate reconstruction (same shape); records the codes."""
        cos, sin = kwargs["position_embeddings"]
        basis, scales = self.bases.coding_basis(module.layer_idx, self.config.balance, keys.device,
                                                key_weight=self.config.key_weight)
        share = self.bases.layer_share(module.layer_idx, self.config)
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
