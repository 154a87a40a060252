"""Footprint and reconstruction error with quantized coefficients (paper Section 3.3, Appendix A.4).

One plain prefill is captured; the codec is replayed on it with coefficients in the model's dtype
and at 8, 4 and 3 bits, both with the paper's allocation ('same_ranks': fewer bytes) and holding the
byte budget ('same_bytes': more rank). The K/V are also cast to bf16 and replayed, since the paper's
~9% is measured against a 16-bit cache. Reported: measured footprint (bytes / full K/V bytes in the
same dtype), mean rank, and the relative error of the reconstructed keys and values.

    python benchmarks/bench_footprint.py
"""

from __future__ import annotations

import argparse
import sys

import torch

import common
from hf_varrate import VarRateCache, VarRateLayer


def errors(cache, captured) -> tuple[float, float]:
    """Relative Frobenius error of the stored keys and values against the exact ones, over all layers."""
    num_k = den_k = num_v = den_v = 0.0
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, VarRateLayer):
            continue
        keys, values = captured.keys[i].float(), captured.values[i].float()
        num_k += float((layer.keys.float() - keys).square().sum())
        den_k += float(keys.square().sum())
        num_v += float((layer.values.float() - values).square().sum())
        den_v += float(values.square().sum())
    return (num_k / den_k) ** 0.5, (num_v / den_v) ** 0.5


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="footprint")
    args = parser.parse_args(argv)
    common.set_threads(args.threads)
    env = common.environment()
    model, tokenizer = common.load(args.model, "float32")
    bases, bases_name = common.bases_for(args.model, model)
    ids = common.document_ids(tokenizer, args.length)
    captured32, _ = common.capture_prefill(model, ids)
    variants = [(None, "same_ranks")] + [(b, m) for b in (8, 4, 3) for m in ("same_ranks", "same_bytes")]
    results, rows = [], []
    for kv_dtype in (torch.float32, torch.bfloat16):
        captured = captured32 if kv_dtype == torch.float32 else captured32.with_kv_dtype(kv_dtype)
        for bits, mode in variants:
            cache = VarRateCache(bases, model=model, budget=args.budget, coef_bits=bits, quantized_budget=mode)
            common.replay_into(cache, model, captured)
            fp = cache.footprint()
            ranks = torch.cat([layer.ranks.float() for layer in cache.layers if isinstance(layer, VarRateLayer)])
            err_k, err_v = errors(cache, captured)
            name = "model dtype" if bits is None else f"{bits}-bit, {mode}"
            results.append({"kv_dtype": str(kv_dtype), "bits": bits, "mode": mode, "fraction": fp.fraction,
                            "bytes": fp.bytes, "full_bytes": fp.full_bytes, "mean_rank": float(ranks.mean()),
                            "key_error": err_k, "value_error": err_v})
            rows.append([str(kv_dtype).removeprefix("torch."), name, f"{100 * fp.fraction:.2f}%",
                         float(ranks.mean()), err_k, err_v])
            common.log(f"{kv_dtype} {name}: {fp.fraction:.4f}, mean rank {float(ranks.mean()):.1f}")
    md = (f"## Footprint with quantized coefficients ({args.model}, {args.length} tokens, budget {args.budget})\n\n"
          + common.table(["K/V dtype", "coefficients", "footprint", "mean rank", "key rel. error",
                          "value rel. error"], rows)
          + "\n\nFootprint = measured bytes (exact tokens, anchor indices, ranks, coefficients, group mins and "
          "steps) / full K/V bytes in the same dtype. Groups of 32 coefficients, fp16 min and step each. "
          f"Errors: relative Frobenius error of the stored K/V over all layers. Bases: {bases_name}.\n"
          f"Command: python benchmarks/bench_footprint.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip()
          + "\n")
    common.write_results(args.out, {"env": env, "args": vars(args), "results": results}, md)


if __name__ == "__main__":
    main()
