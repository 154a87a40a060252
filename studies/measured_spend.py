"""Where measured per-layer budgets put the bytes when the budget is counted in fp32: `python -m
studies.measured_spend`.

The shipped bases measured each layer's sensitivity with budgets counted in fp16. A CPU cache holds fp32 K/V and,
by default, counts its budget in those bytes, so budget 0.1 buys the coefficients of 0.2 counted in fp16. This
codes one 2K-token calibration context with SmolLM2 and its shipped bases at `--budget` (the `recommended`
preset, default counting) twice: with the scales looked up at the bytes the budget buys (what the cache does)
and with the scales recorded at the same number (what it did before), and prints, per scale, the layers and
their mean rank per coded token, and the share of the whole cache each spends.
"""

from __future__ import annotations

import argparse

import torch

from hf_varrate import VarRateCache
from hf_varrate.binding import cache_kwarg
from hf_varrate.calibration.sensitivity import layers_scaled
from hf_varrate.calibration.texts import load_texts
from hf_varrate.models import load_default_model
from hf_varrate.shipped import SHIPPED_ROOT


def spend(model, ids, folder, budget: float, scales: dict[int, float]) -> tuple[dict, float]:
    """({scale: (layers, mean rank per coded token)}, the footprint's prompt fraction) of one coded prefill."""
    cache = VarRateCache.from_pretrained(folder, model=model, budget=budget)
    with layers_scaled(cache.bases, lambda i: scales[i]), torch.no_grad():
        model(input_ids=ids, logits_to_keep=1, **{cache_kwarg(model): cache})
        cache.compress()
    ranks: dict[float, list[float]] = {}
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "codes", None):
            ranks.setdefault(scales[i], []).append(layer.codes[0].ranks.float().mean().item())
    return {s: (len(r), sum(r) / len(r)) for s, r in sorted(ranks.items())}, cache.footprint().prompt_fraction


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    model, tokenizer = load_default_model("smollm2-135m-instruct")
    folder = SHIPPED_ROOT / "smollm2-135m-instruct"
    text = "\n\n".join(load_texts(split="calibration").documents[:40])
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]
    spaces = VarRateCache.from_pretrained(folder, model=model).bases.spaces
    for name, scales in (("at the bytes (fp32 counted as fp16)", spaces.measured_scales(args.budget, torch.float32)),
                         ("at the number (before)", spaces.measured_scales(args.budget))):
        by_scale, fraction = spend(model, ids, folder, args.budget, scales)
        rows = ", ".join(f"{s}x: {n} layers at rank {r:.0f}" for s, (n, r) in by_scale.items())
        print(f"{name}: {rows}; {fraction:.2%} of the cache (budget {args.budget})")


if __name__ == "__main__":
    main()
