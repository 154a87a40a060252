"""Where a coded prompt's bytes go: `python -m studies.byte_parts`.

The budget counts every byte the codes hold (Eq. 3 in bytes, `codec/budget.py`). This codes one held-out wiki
context with the library (`VarRateCache`, the shipped bases, the `recommended` preset, fp16-counted) at each of
`--budgets` and prints, summed over the coded layers, the share of the prompt's bytes each part takes
(`PromptCode.byte_parts`): the exact tokens (anchors and window, fp16), the coefficients' codes, their
quantization scales (an fp16 min and step per group), the coded tokens' anchor indices and their ranks. What is
not coefficient codes is what a byte-saving idea could hand to rank; docs/accuracy_dev.md (round 24) prices
such bytes in answers.
"""

from __future__ import annotations

import argparse

import torch

from hf_varrate import VarRateCache
from hf_varrate.binding import cache_kwarg
from hf_varrate.models import DEFAULT_MODELS
from hf_varrate.shipped import SHIPPED_ROOT

from studies._context import held_out_context

PARTS = ("exact", "codes", "scales", "anchor_indices", "ranks")


def prompt_parts(model, ids: torch.Tensor, folder, budget: float) -> tuple[dict[str, int], int]:
    """({part: bytes} summed over the coded layers at fp16 K/V, the same layers' fp16 K/V bytes)."""
    cache = VarRateCache.from_pretrained(folder, model=model, budget=budget, budget_dtype="float16")
    model(input_ids=ids, logits_to_keep=1, **{cache_kwarg(model): cache})
    cache.compress()
    totals, full = dict.fromkeys(PARTS, 0), 0
    for layer in cache.layers:
        for code in getattr(layer, "codes", None) or []:
            for part, size in code.byte_parts(kv_bytes=2).items():
                totals[part] += size
            full += code.full_nbytes(kv_bytes=2)
    return totals, full


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", choices=sorted(DEFAULT_MODELS))
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--budgets", default="0.1,0.2")
    args = parser.parse_args(argv)
    model, _, ids = held_out_context(args.model, args.length)
    print(f"# {args.model}, one held-out wiki context of {args.length} tokens; share of the coded prompt's bytes\n")
    print("| budget | footprint (fp16) | " + " | ".join(PARTS) + " |")
    print("|---" * (len(PARTS) + 2) + "|")
    for budget in (float(b) for b in args.budgets.split(",")):
        parts, full = prompt_parts(model, ids, SHIPPED_ROOT / args.model, budget)
        total = sum(parts.values())
        print(f"| {budget} | {total / full:.2%} | " + " | ".join(f"{parts[p] / total:.1%}" for p in PARTS) + " |",
              flush=True)


if __name__ == "__main__":
    main()
