"""EXPERIMENT: per-layer budgets from measured sensitivity (not in the library).

For each compressed layer l and budget scale s (a multiple of the uniform coefficient budget), compress
layer l alone at s (every other layer exact) and measure how far the model's next-token distribution on a
probe moves from the full cache's: mean KL(full || hybrid) over the probe tokens. The contexts are
calibration text (wiki, calibration split: no task data); the probe is a span of the context repeated after
it, so the model must read it back from the cache (the reuse regime's retrieval). A prefill compresses every
layer from the exact prefill's K/V, so one compressed cache at scale s gives every layer's reconstruction.
Then a multiple-choice knapsack picks one scale per layer minimizing the summed KL with the scales averaging 1
(the same bytes as uniform), and writes {"scales": {layer: s}, ...} for a method's `layer_scales:`.

    python -m evaluation.layer_sensitivity --model smollm2-135m-instruct --length 2048 --budget 0.2 \\
        --out evaluation/runs/sensitivity/smollm2_0.2.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_varrate import VarRateCache
from hf_varrate.calibration.contexts import build_contexts
from hf_varrate.calibration.texts import load_texts
from hf_varrate.models import load_default_model

from .capture import capture, full_attention_layers, replay
from .generate import feed
from .methods.base import dynamic_from_capture
from .methods.varrate import VarRateMethod, resolve_bases


def probe_logprobs(model, captured, probe: list[int], start: int, keys=None, values=None) -> torch.Tensor:
    """Log-probs [P, V] of `probe` after the captured prompt, read through a DynamicCache holding the captured
    K/V with the layers in `keys` / `values` ({layer: tensor}) swapped for those."""
    if keys:
        captured = replace(captured, keys=[keys.get(i, k) for i, k in enumerate(captured.keys)],
                           values=[values.get(i, v) for i, v in enumerate(captured.values)])
    with torch.no_grad():
        logits = feed(model, dynamic_from_capture(model, captured), probe, start, logits_to_keep=0)
    return F.log_softmax(logits[0].float(), dim=-1)


def mean_kl(hybrid: torch.Tensor, reference: torch.Tensor) -> float:
    """KL(reference || hybrid) per probe token."""
    return float(F.kl_div(hybrid, reference, log_target=True, reduction="batchmean"))


def reconstructed(bases, config, model, captured, share, layers) -> tuple[dict, dict]:
    """Every compressed layer's K/V as a VarRateCache with per-layer budget scales `share(layer)` rebuilds them."""
    bases.layer_share = lambda i, config: share(i)
    cache = VarRateCache(bases, config, model_config=model.config)
    replay(cache, model, captured)
    read = {i: cache.layers[i].read() for i in layers}
    return ({i: k.to(captured.keys[i].dtype) for i, (k, _) in read.items()},
            {i: v.to(captured.values[i].dtype) for i, (_, v) in read.items()})


def allocate(kl: dict[int, dict[float, float]], levels: list[float]) -> dict[int, float]:
    """One level per layer, mean exactly 1 (levels on a grid of `unit`), least summed KL (a DP)."""
    layers = sorted(kl)
    unit = min(b - a for a, b in zip(levels, levels[1:]))
    steps = {s: round(s / unit) for s in levels}
    target = round(len(layers) / unit)
    best = {0: (0.0, [])}
    for layer in layers:
        nxt = {}
        for used, (cost, picks) in best.items():
            for s in levels:
                u = used + steps[s]
                if u > target:
                    continue
                c = cost + kl[layer][s]
                if u not in nxt or c < nxt[u][0]:
                    nxt[u] = (c, picks + [s])
        best = nxt
    return dict(zip(layers, best[target][1]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--contexts", type=int, default=4)
    parser.add_argument("--probe", type=int, default=128)
    parser.add_argument("--budget", type=float, required=True)
    parser.add_argument("--preset", default="recommended")
    parser.add_argument("--levels", default="0.5,1,1.5,2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    levels = sorted(float(x) for x in args.levels.split(","))
    model, tokenizer = load_default_model(args.model)
    spec = {"kind": "varrate", "preset": args.preset, "budget_dtype": "float16", "budget": args.budget,
            "projection_dtype": "float32"}
    bases = resolve_bases(model, args.model, "shipped")
    config = VarRateMethod("probe", spec).config_for(bases)
    texts = load_texts(split="calibration")
    layers = full_attention_layers(model)
    prompts = []  # (ids, probe, capture, the full cache's log-probs) per context
    for ids in build_contexts(tokenizer, texts.documents, args.contexts, args.length):
        ids = ids.tolist()
        probe = ids[len(ids) // 2 : len(ids) // 2 + args.probe]
        captured = capture(model, ids)
        prompts.append((ids, probe, captured, probe_logprobs(model, captured, probe, len(ids))))
    kl = {i: {s: 0.0 for s in levels} for i in layers}
    started = time.time()
    for c, (ids, probe, captured, reference) in enumerate(prompts):
        for s in levels:
            keys, values = reconstructed(bases, config, model, captured, lambda i, s=s: s, layers)
            for i in layers:
                hybrid = probe_logprobs(model, captured, probe, len(ids), {i: keys[i]}, {i: values[i]})
                kl[i][s] += mean_kl(hybrid, reference) / len(prompts)
            print(f"context {c} scale {s}: {time.time() - started:.0f} s", flush=True)
    scales = allocate(kl, levels)
    check = {"uniform": 0.0, "allocated": 0.0}  # every layer compressed at once: is the summed KL a fair proxy?
    for ids, probe, captured, reference in prompts:
        for name, share in (("uniform", lambda i: 1.0), ("allocated", lambda i: scales[i])):
            keys, values = reconstructed(bases, config, model, captured, share, layers)
            hybrid = probe_logprobs(model, captured, probe, len(ids), keys, values)
            check[name] += mean_kl(hybrid, reference) / len(prompts)
    print("all layers compressed, mean KL:", check, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "length": args.length, "budget": args.budget,
                                    "contexts": args.contexts, "probe": args.probe, "levels": levels,
                                    "scales": scales, "kl": kl,
                                    "kl_uniform": sum(kl[i][1.0] for i in layers),
                                    "kl_allocated": sum(kl[i][scales[i]] for i in layers),
                                    "kl_all_layers": check}, indent=1))
    print(json.dumps(scales))


if __name__ == "__main__":
    main()
