"""Held-out reconstruction error of the paper's defaults, each beyond-the-paper option and the `recommended` preset.

The mechanism behind the needle results: how well keys and values come back at the same bytes.
Relative Frobenius error of the coded tokens, mean over layers, on held-out Wikipedia contexts (the
calibration CLI's held-out split, never used to calibrate the shipped bases), budget counted in fp16.

    python benchmarks/bench_presets.py [--model smollm2-135m-instruct] [--contexts 2] [--length 2048]
"""

from __future__ import annotations

import argparse

from common import bases_for, environment, load, log, set_threads, table, write_results

from hf_varrate.calibration import build_contexts, load_texts, reconstruction_error

VARIANTS = {
    "paper": {},
    "balance": {"balance": "rms"},
    "4-bit, same bytes": {"coef_bits": 4, "quantized_budget": "same_bytes"},
    "anchor_share 0.25": {"anchor_share": 0.25},
    "4-bit + anchor_share": {"coef_bits": 4, "quantized_budget": "same_bytes", "anchor_share": 0.25},
    "4-bit + anchor_share + uniform": {"coef_bits": 4, "quantized_budget": "same_bytes", "anchor_share": 0.25,
                                       "signal": "uniform"},
    "uniform (flat)": {"signal": "uniform"},
    "layer_budgets spectrum": {"layer_budgets": "spectrum"},
    "recommended": {"preset": "recommended"},
    "recommended + layer_budgets spectrum": {"preset": "recommended", "layer_budgets": "spectrum"},
    "recommended, fp32 projections": {"preset": "recommended", "projection_dtype": "float32"},
    "recommended, bf16 projections": {"preset": "recommended", "projection_dtype": "bfloat16"},
    "recommended, per-component scales over 128 tokens": {"preset": "recommended", "coef_scales": "component",
                                                          "component_tokens": 128},
    "recommended, per-component scales over 256 tokens": {"preset": "recommended", "coef_scales": "component",
                                                          "component_tokens": 256},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--contexts", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_threads(args.threads)
    model, tokenizer = load(args.model)
    bases, _ = bases_for(args.model, model)
    held_out = load_texts(None, split="held_out", seed=0)
    contexts = build_contexts(tokenizer, held_out.documents, args.contexts, args.length)
    rows, data = [], {"environment": environment(), "args": vars(args), "variants": {}}
    for name, fields in VARIANTS.items():
        fields = dict(fields)
        config = bases.config(fields.pop("preset", "paper"), **fields, budget=args.budget, budget_dtype="float16")
        log(f"{name}: {config}")
        error = reconstruction_error(model, bases, contexts, budget=args.budget, config=config)
        data["variants"][name] = {"keys": error.keys, "values": error.values, "footprint_fp32": error.footprint}
        rows.append([name, f"{error.keys:.3f}", f"{error.values:.3f}", f"{error.footprint:.3f}"])
    markdown = (f"Held-out relative reconstruction error, {args.model}, budget {args.budget} counted in fp16, "
                f"{args.contexts} contexts x {args.length} tokens\n\n"
                + table(["variant", "keys", "values", "footprint (of fp32 K/V)"], rows))
    write_results(f"presets_{args.model}", data, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
