"""How well a basis reconstructs held-out keys and values through the real cache.

Each context is run twice: once with a `DynamicCache` (the exact K/V) and once with a bound
`VarRateCache` (what the codec stores after the prefill). The prefill attends to exact K/V in both
runs, so every layer sees the same inputs and the two caches can be compared token for token.
Error per layer: ||X^ - X||_F / ||X||_F over the coded tokens, summed over contexts; reported as
the mean over compressed layers, separately for keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..bases import Bases
from ..binding import bound_as_found, cache_kwarg
from ..cache import VarRateCache
from ..layers import VarRateLayer
from ..config import VarRateConfig


@dataclass
class ReconstructionError:
    """Mean relative errors over layers, per-layer detail, and the cache footprint fraction."""

    budget: float
    keys: float
    values: float
    footprint: float
    per_layer: dict[int, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"budget": self.budget, "keys": self.keys, "values": self.values, "footprint": self.footprint,
                "per_layer": {str(i): v for i, v in self.per_layer.items()}}


def reconstruction_error(model, bases: Bases, contexts: list[torch.Tensor], budget: float = 0.2,
                         config: VarRateConfig | None = None, progress: bool = False) -> ReconstructionError:
    """Relative reconstruction error of the codec with `bases` at `budget` on `contexts` (batch 1 each)."""
    # materialized: the error is read off the reconstruction the layer holds
    config = (config or VarRateConfig(**bases.calibrated_settings)).replace(budget=budget, storage="materialized")
    sums: dict[int, torch.Tensor] = {}  # layer -> [err_k^2, norm_k^2, err_v^2, norm_v^2]
    stored = full = 0
    with bound_as_found(model):
        for ids in tqdm(contexts, desc=f"reconstruction at budget {budget}", unit="context", disable=not progress):
            exact, cache = _run_both(model, bases, config, ids)
            for i, layer in enumerate(cache.layers):
                if isinstance(layer, VarRateLayer):
                    sums[i] = sums.get(i, torch.zeros(4, dtype=torch.float64)) + _squared_errors(layer, exact.layers[i])
            footprint = cache.footprint()
            stored += sum(f.bytes for f in footprint.layers if f.kind == "varrate")
            full += sum(f.full_bytes for f in footprint.layers if f.kind == "varrate")
    per_layer = {i: {"keys": _ratio(s[0], s[1]), "values": _ratio(s[2], s[3])} for i, s in sorted(sums.items())}
    mean = lambda name: sum(v[name] for v in per_layer.values()) / max(len(per_layer), 1)  # noqa: E731
    return ReconstructionError(budget, mean("keys"), mean("values"), stored / full if full else 1.0, per_layer)


def _run_both(model, bases, config, ids):
    device = next(model.parameters()).device
    ids = ids.reshape(1, -1).to(device)
    exact = DynamicCache(config=model.config)
    cache = VarRateCache(bases, config, model_config=model.config)
    name = cache_kwarg(model)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **{name: exact})
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **{name: cache})
        cache.compress()
    return exact, cache


def _squared_errors(layer: VarRateLayer, exact_layer) -> torch.Tensor:
    """[err_k^2, |k|^2, err_v^2, |v|^2] over the coded tokens of the (single) sequence."""
    code = layer.codes[0]
    coded = code.coded_pos.to(layer.keys.device)
    k_hat, v_hat = layer.keys[0][:, coded].double(), layer.values[0][:, coded].double()
    k, v = exact_layer.keys[0][:, coded].double(), exact_layer.values[0][:, coded].double()
    return torch.stack([(k_hat - k).square().sum(), k.square().sum(),
                        (v_hat - v).square().sum(), v.square().sum()]).cpu()


def _ratio(error: torch.Tensor, norm: torch.Tensor) -> float:
    return float((error / norm).sqrt()) if float(norm) > 0 else 0.0
