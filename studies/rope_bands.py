"""Where along RoPE's frequencies the keys' coding error lies: `python -m studies.rope_bands`.

RoPE turns each pair of a head's key dimensions (i, i + d/2) by an angle that grows with position at the pair's
own frequency (pair 0 the fastest). Attention over long distances is read mostly through the slow pairs, where
the turn between a far key and the query stays small; if the codes put their error there, far needles would pay
more than near ones. This codes one held-out wiki context with the library (`VarRateCache`, the shipped bases,
the `recommended` preset, fp16-counted, materialized) and prints, per pair, mean over layers: the key relative
error in that pair (RoPE turns a pair rigidly, so it is the same before and after rotation), the pair's share of
the keys' energy and its share of the error's energy.

    python -m studies.rope_bands --model smollm2-135m-instruct --length 4096

Runs in `.venv` too, in about a minute. A diagnostic: nothing is chosen on it.
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from hf_varrate import VarRateCache
from hf_varrate.binding import cache_kwarg
from hf_varrate.models import DEFAULT_MODELS
from hf_varrate.shipped import SHIPPED_ROOT

from studies._context import held_out_context


def pair_energies(keys: torch.Tensor) -> torch.Tensor:
    """[d/2]: the energy of keys [H, S, d] in each RoPE pair (dims i and i + d/2, the layout of rotate_half)."""
    half = keys.shape[-1] // 2
    return (keys[..., :half].square() + keys[..., half:].square()).sum(dim=(0, 1))


def band_table(exact: list[torch.Tensor], coded: list[torch.Tensor]) -> torch.Tensor:
    """[d/2, 3], mean over layers: per pair, the relative error, the keys' energy share, the error's energy share
    (exact and coded: per layer, keys [H, S, d] of the same tokens)."""
    rows = []
    for k, k_hat in zip(exact, coded):
        key, error = pair_energies(k.double()), pair_energies((k_hat - k).double())
        rows.append(torch.stack([(error / key).sqrt(), key / key.sum(), error / error.sum()], dim=1))
    return torch.stack(rows).mean(dim=0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", choices=sorted(DEFAULT_MODELS))
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _, ids = held_out_context(args.model, args.length)
    name = cache_kwarg(model)
    full = DynamicCache(config=model.config)
    model(input_ids=ids, logits_to_keep=1, **{name: full})
    cache = VarRateCache.from_pretrained(SHIPPED_ROOT / args.model, model=model, budget=args.budget,
                                         budget_dtype="float16", storage="materialized")
    model(input_ids=ids, logits_to_keep=1, **{name: cache})
    cache.compress()
    coded = [i for i, layer in enumerate(cache.layers) if getattr(layer, "codes", None)]
    table = band_table([full.layers[i].keys[0] for i in coded],
                       [cache.layers[i].keys[0, :, : ids.shape[1]] for i in coded])
    print(f"# {args.model}, one held-out wiki context of {args.length} tokens, recommended at {args.budget} "
          f"(fp16-counted); {len(coded)} coded layers\n")
    print("| RoPE pair (0: fastest) | key rel. error | share of the keys' energy | share of the error's energy |")
    print("|---|---|---|---|")
    for pair, (error, key, share) in enumerate(table.tolist()):
        print(f"| {pair} | {error:.3f} | {key:.3f} | {share:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
