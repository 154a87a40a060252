"""VarRate through the library's own path: a VarRateCache fed layer by layer.

For each full-attention layer we call the library's prefill hook exactly as a bound attention
module would (it computes the window queries from the layer's input, cos/sin and the module), then
`cache.update(keys, values)`, which compresses. `impl: press` runs hf_varrate.press.VarRatePress
(the kvpress adapter) instead, through kvpress's forward_hook. Any VarRateConfig field may be given
in the method spec (budget, signal, allocation, r_min, stride, ...), so new codec options need no
harness change. The config comes from `Bases.config`: a spec without `preset:` is the paper preset with
the bases' calibrated stride/window/n_anchors and the spec's fields on top; `preset: recommended` starts
from that preset instead.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from hf_varrate import Bases, VarRateCache, VarRateConfig
from hf_varrate.errors import CalibrationOverrideWarning

from ..capture import clock, replay
from .base import Compressed, Context, dynamic_from_capture

REPO = Path(__file__).resolve().parents[2]
NOT_CONFIG = {"kind", "bases", "impl", "preset"}


def shipped_bases() -> Path:
    """Where the shipped bases live: the package's (hf_varrate/shipped_bases/), or $HF_VARRATE_SHIPPED_BASES."""
    return Path(os.environ.get("HF_VARRATE_SHIPPED_BASES", REPO / "hf_varrate" / "shipped_bases"))


def resolve_bases(model, model_name: str, which: str) -> Bases:
    """'identity', 'shipped' (hf_varrate/shipped_bases/<model>/) or a directory / Hub repo id."""
    if which == "identity":
        return Bases.identity(model.config)
    path = shipped_bases() / model_name if which == "shipped" else which
    bases = Bases.from_pretrained(str(path))
    bases.validate(model.config)
    return bases


class VarRateMethod:
    kind = "varrate"

    def __init__(self, name: str, spec: dict):
        self.name, self.spec = name, spec
        self.overrides = {k: v for k, v in spec.items() if k not in NOT_CONFIG}
        known = set(VarRateConfig.__dataclass_fields__)
        unknown = sorted(set(self.overrides) - known)
        if unknown:  # a typo must not silently run the defaults under a new name
            raise ValueError(f"method {name!r}: {unknown} are not VarRateConfig fields (nor kind/bases/impl); "
                             f"known fields: {sorted(known)}")
        self.impl = spec.get("impl", "cache")
        self._bases: dict[tuple[str, str], Bases] = {}  # by (model, which): one run may switch models

    def config_for(self, bases: Bases) -> VarRateConfig:
        """`bases.config(preset, **fields)`: the spec's preset ('paper' when it names none), the bases'
        calibrated stride/window/n_anchors, then the spec's fields."""
        with warnings.catch_warnings():  # a spec that sets stride/window/n_anchors means to: an ablation
            warnings.filterwarnings("ignore", category=CalibrationOverrideWarning)
            return bases.config(self.spec.get("preset", "paper"), **self.overrides)

    def bases(self, ctx: Context, default: str) -> Bases:
        key = (ctx.model_name, self.spec.get("bases", default))
        if key not in self._bases:
            self._bases[key] = resolve_bases(ctx.model, *key)
        return self._bases[key]

    def compress(self, ctx: Context, default_bases: str = "shipped") -> Compressed:
        bases = self.bases(ctx, default_bases)
        config = self.config_for(bases)
        start = clock()
        if self.impl == "press":
            from .kvpress_methods import replay_press
            from hf_varrate.press import VarRatePress

            press = VarRatePress(bases=bases, config=config)
            cache = replay_press(press, ctx, dynamic_from_capture(ctx.model, ctx.captured))
            seconds = clock() - start
            return Compressed(cache, seconds, extra={"stored_bytes": press.layer_bytes()})
        cache = VarRateCache(bases, config, model_config=ctx.model.config)
        replay(cache, ctx.model, ctx.captured)
        seconds = clock() - start
        extra = {**rank_diagnostics(cache), **fp16_fraction(cache), "bases": self.spec.get("bases", default_bases),
                 "bases_sha256": weights_sha(bases)}
        return Compressed(cache, seconds, extra=extra)


def weights_sha(bases: Bases) -> str | None:
    """The first 12 hex digits of the bases tensor file's sha256 (identity bases: None)."""
    sha = bases.metadata.get("sha256")
    sha = sha.get("bases.safetensors") if isinstance(sha, dict) else sha
    return str(sha)[:12] if sha else None


def fp16_fraction(cache) -> dict:
    """What the compressed layers would hold with K/V in fp16 (`PromptCode.nbytes(kv_bytes=2)`), over fp16
    K/V of the same layers. The models run in fp32 on CPU; with `budget_dtype: float16` this is the
    fraction the budget was met in, and the one an fp16 deployment would measure."""
    codes = [code for layer in cache.layers for code in getattr(layer, "codes", [])]
    full = sum(code.full_nbytes(kv_bytes=2) for code in codes)
    return {"fraction_fp16": sum(code.nbytes(kv_bytes=2) for code in codes) / full if full else None}


def rank_diagnostics(cache) -> dict:
    """Mean allocated rank of coded tokens by position decile (the paper's Figure 7), share at the floor."""
    sums, counts = torch.zeros(10, dtype=torch.float64), torch.zeros(10, dtype=torch.float64)
    at_floor = coded = exact_layers = 0
    for layer in cache.layers:
        for code in getattr(layer, "codes", []):
            if code.stored_exactly:
                exact_layers += 1
                continue
            decile = (code.coded_pos.cpu() * 10 // code.seq_len).clamp(max=9)
            ranks = code.ranks.long().cpu().double()
            sums.index_add_(0, decile, ranks)
            counts.index_add_(0, decile, torch.ones_like(ranks))
            at_floor += int((ranks <= cache.config.r_min).sum())
            coded += ranks.numel()
    mean = [round(s / c, 2) if c else None for s, c in zip(sums.tolist(), counts.tolist())]  # None: no coded token
    return {"rank_by_decile": mean, "floor_share": at_floor / coded if coded else None,
            "layers_stored_exactly": exact_layers}
