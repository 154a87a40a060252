"""What per-component scales would cost under ranks that vary: `python -m studies.scale_grid`.

`coef_scales="component"` (a min and step per component over `component_tokens` coded tokens) is SmolLM2's preset
above budget 0.1 and Gemma-3's at 0.1 and below. Its budget sets the scale grid's bytes aside as for ranks that are
(nearly) uniform, where a group's scales cover its tokens' one rank. This codes one held-out wiki context with the
library (`VarRateCache`, the shipped bases, the `recommended` preset, fp16-counted) with the preset's ranks and
with `allocation="distortion"` (per-token scales here, so the ranks are those round 25 measured), and counts, summed
over the coded layers, the scale entries (a min and a step each) a per-component grid of those ranks would hold:
ragged (groups of tokens in their order, each as wide as its widest token), dense (every group as wide as the
widest token of the layer), and by rank (the library's axis "rank", what `coef_scales="component"` takes beside
`allocation="distortion"`: groups of the tokens by decreasing rank, each as wide as its first), against what the
budget sets aside for it (`codec/budget.py`: one entry per `component_tokens` coefficients, plus the partial
groups). The excess, in bytes, is shown as a share of the coefficients' codes: the rank the grid would have to give
up to fit its scales.
"""

from __future__ import annotations

import argparse

import torch

from hf_varrate import VarRateCache
from hf_varrate.binding import cache_kwarg
from hf_varrate.codec.codes import SCALE_DTYPE, scale_count
from hf_varrate.models import DEFAULT_MODELS
from hf_varrate.shipped import SHIPPED_ROOT

from studies._context import held_out_context

ALLOCATIONS = {"the preset's ranks": {},
               "allocation='distortion'": {"allocation": "distortion", "coef_scales": "token"}}


def grid_entries(ranks: torch.Tensor, tokens: int) -> tuple[int, int, int, float]:
    """(ragged, dense, by rank, budgeted) scale entries of one layer's ranks [C] (coded order) in groups of `tokens`:
    by rank is the library's axis "rank" (`codec/components.py`: the tokens by decreasing rank); budgeted restates
    `codec/budget.py`'s charge, with the widest token's rank for the cap."""
    ranks = ranks.long()
    groups = -(-ranks.numel() // tokens)
    padded = ranks.new_zeros(groups * tokens)
    padded[: ranks.numel()] = ranks
    widest = int(ranks.max())
    budgeted = ranks.numel() / tokens + widest + 1 + int(ranks.sum()) / tokens
    by_rank = scale_count(ranks, tokens, "rank")
    return int(padded.view(groups, tokens).amax(dim=1).sum()), groups * widest, by_rank, budgeted


def count(model, ids: torch.Tensor, folder, budget: float, overrides: dict) -> dict[str, float]:
    cache = VarRateCache.from_pretrained(folder, model=model, budget=budget, budget_dtype="float16", **overrides)
    model(input_ids=ids, logits_to_keep=1, **{cache_kwarg(model): cache})
    cache.compress()
    config, found = cache.config, dict.fromkeys(("ragged", "dense", "by rank", "budgeted", "coefficients",
                                                   "spread"), 0.0)
    for layer in cache.layers:
        for code in getattr(layer, "codes", None) or []:
            if code.stored_exactly or code.ranks.numel() == 0:
                continue
            for name, value in zip(("ragged", "dense", "by rank", "budgeted"),
                                   grid_entries(code.ranks, config.component_tokens)):
                found[name] += value
            found["coefficients"] += int(code.ranks.long().sum())
            found["spread"] = max(found["spread"], float(code.ranks.float().std() / code.ranks.float().mean()))
    entry_bytes = 2 * torch.empty(0, dtype=SCALE_DTYPE).element_size()
    code_bytes = found["coefficients"] * (config.coef_bits or 16) / 8
    found["excess"] = max(found["ragged"] - found["budgeted"], 0.0) * entry_bytes / code_bytes
    found["excess by rank"] = max(found["by rank"] - found["budgeted"], 0.0) * entry_bytes / code_bytes
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", choices=sorted(DEFAULT_MODELS))
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--budgets", default="0.2")
    args = parser.parse_args(argv)
    model, _, ids = held_out_context(args.model, args.length)
    print(f"# {args.model}, one held-out wiki context of {args.length} tokens; per-component scale entries\n")
    print("| budget | ranks | largest rank CV of a layer | ragged | dense | by rank | budgeted | excess (of the codes' "
          "bytes): ragged / by rank |")
    print("|---|---|---|---|---|---|---|---|")
    for budget in (float(b) for b in args.budgets.split(",")):
        for label, overrides in ALLOCATIONS.items():
            f = count(model, ids, SHIPPED_ROOT / args.model, budget, overrides)
            print(f"| {budget} | {label} | {f['spread']:.2f} | {f['ragged']:.0f} | {f['dense']:.0f} | "
                  f"{f['by rank']:.0f} | {f['budgeted']:.0f} | {f['excess']:.1%} / {f['excess by rank']:.1%} |",
                  flush=True)


if __name__ == "__main__":
    main()
