"""Per-layer budgets from measured sensitivity, for the evaluation: the scales a method's `layer_scales:` reads.

The measurement is the library's (`hf_varrate.calibration.sensitivity`, what `hf-varrate measure-layers` writes into
bases for `layer_budgets="measured"`): per compressed layer and scale s of the uniform coefficient budget, the
mean KL of the next-token distribution on a span of each calibration context read back after it, with that layer
alone coded at s. `codec.layer_budget.measured_scales` picks one scale per layer at the uniform bytes. This script
adds a check of the proxy, every layer coded at once (uniform against allocated), and writes {"scales", "kl", ...}.

    python -m evaluation.layer_sensitivity --model smollm2-135m-instruct --length 2048 --budget 0.2 \\
        --out evaluation/runs/sensitivity/smollm2_0.2.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_varrate import VarRateCache
from hf_varrate.calibration.contexts import build_contexts
from hf_varrate.calibration.sensitivity import layers_scaled, measure_sensitivity
from hf_varrate.codec.layer_budget import recorded_scales
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
    with layers_scaled(bases, share):
        cache = VarRateCache(bases, config, model_config=model.config)
        replay(cache, model, captured)
        read = {i: cache.layers[i].read() for i in layers}
    return ({i: k.to(captured.keys[i].dtype) for i, (k, _) in read.items()},
            {i: v.to(captured.values[i].dtype) for i, (_, v) in read.items()})


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
    contexts = build_contexts(tokenizer, texts.documents, args.contexts, args.length)
    measured = measure_sensitivity(model, bases, contexts, [args.budget], levels=levels, probe=args.probe,
                                   preset=args.preset, projection_dtype="float32")
    kl = {int(i): dict(zip(levels, row)) for i, row in measured["kl"][repr(args.budget)].items()}
    scales = recorded_scales(measured)[repr(args.budget)]
    check = {"uniform": 0.0, "allocated": 0.0}  # every layer compressed at once: is the summed KL a fair proxy?
    for ids in contexts:
        ids = ids.tolist()
        probe = ids[len(ids) // 2 : len(ids) // 2 + args.probe]
        captured = capture(model, ids)
        reference = probe_logprobs(model, captured, probe, len(ids))
        for name, share in (("uniform", lambda i: 1.0), ("allocated", lambda i: scales[i])):
            keys, values = reconstructed(bases, config, model, captured, share, layers)
            hybrid = probe_logprobs(model, captured, probe, len(ids), keys, values)
            check[name] += mean_kl(hybrid, reference) / len(contexts)
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
