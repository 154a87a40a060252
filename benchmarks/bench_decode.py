"""Decode speed at a long prompt: full K/V (DynamicCache) vs VarRate materialized vs VarRate compact.

One plain prefill is captured; every cache is built from it by replaying the same prefill inputs
(as the model would hand them over), then each decodes the same greedy continuation. Configurations
are interleaved within every repeat, so they see the same machine load; medians over repeats.

    python benchmarks/bench_decode.py                      # SmolLM2 fp32, 4K prompt, 16 new tokens

A configuration is `full` or `<storage>[-<bits>bit][+codes][+torch]`: `+codes` decodes under the
"varrate" attention implementation; every other one under the model's sdpa, where a compact layer is
read over its codes too (its updates hand sdpa `CodedRead` stand-ins: `hf_varrate.attention`).
`+torch` switches off the C loops of `hf_varrate.codec.native` (PyTorch only), to compare.
`--threads 0` keeps torch's default thread count (what a user gets).

    python benchmarks/bench_decode.py --preset recommended --configs full,compact --threads 0 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch
from transformers import DynamicCache

import common
import hf_varrate
from hf_varrate import VarRateCache
from hf_varrate.binding import cache_kwarg
from hf_varrate.codec import native
from hf_varrate.config import PRESETS


def decode(model, cache, first: torch.Tensor, new: int) -> tuple[list[float], list[int]]:
    """Greedy decode `new` tokens; per-step seconds and the tokens."""
    steps, tokens, token, name = [], [], first, cache_kwarg(model)
    with torch.no_grad():
        for _ in range(new):
            start = common.clock()
            logits = model(token, logits_to_keep=1, **{name: cache}).logits
            token = logits[:, -1:].argmax(-1)
            steps.append(common.clock() - start)
            tokens.append(int(token))
    return steps, tokens


def build_caches(model, bases, captured, budget: float, configs: list[str], preset: str = "paper",
                 budget_dtype: str | None = None) -> dict:
    caches = {}
    for name in configs:
        if name == "full":
            cache = DynamicCache(config=model.config)
        else:
            storage, _, bits = name.removesuffix("+torch").removesuffix("+codes").partition("-")
            options = {"coef_bits": int(bits.removesuffix("bit"))} if bits else {}
            config = bases.config(preset, budget=budget, budget_dtype=budget_dtype, storage=storage, **options)
            cache = VarRateCache(bases, config, model=model)
        common.replay_into(cache, model, captured)
        caches[name] = cache
    return caches


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--new", type=int, default=16, help="tokens decoded per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--budget-dtype", choices=["float16", "bfloat16", "float32"],
                        help="count the budget in this dtype's bytes (default: the model's)")
    parser.add_argument("--threads", type=int, default=1, help="0: torch's default")
    parser.add_argument("--device", default="cpu", help="where the model and the caches live: cpu or cuda[:index]")
    parser.add_argument("--configs", default="full,materialized,compact")
    parser.add_argument("--preset", choices=PRESETS, default="paper",
                        help="the VarRate configs' preset ('recommended': from_pretrained's default)")
    parser.add_argument("--out", default="decode")
    return parser.parse_args(argv)


def interleaved_decodes(model, caches: dict, first: torch.Tensor, args) -> tuple[dict, dict, dict]:
    """`args.repeats` rounds, each decoding `args.new` tokens from a copy of every cache, in rotating order.
    Returns (per-step seconds, tokens/s per repeat, the greedy tokens), each by configuration name."""
    configs = list(caches)
    steps, rates, tokens = {name: [] for name in configs}, {name: [] for name in configs}, {}
    for repeat in range(args.repeats):
        order = configs[repeat % len(configs):] + configs[: repeat % len(configs)]
        for name in order:
            model.set_attn_implementation(hf_varrate.ATTENTION if "+codes" in name else "sdpa")
            cache = copy.deepcopy(caches[name])
            with native.disabled() if name.endswith("+torch") else contextlib.nullcontext():
                per_step, tokens[name] = decode(model, cache, first, args.new)
            steps[name] += per_step
            rates[name].append(args.new / sum(per_step))
            common.log(f"repeat {repeat} {name}: {rates[name][-1]:.2f} tok/s")
    return steps, rates, tokens


def markdown(result: dict, args, configs: list[str]) -> str:
    footprints, env = result["bytes_at_rest"], result["env"]
    base = result["tokens_per_second"]["full"]["median"]
    materialized = result["tokens_per_second"].get("materialized", {}).get("median")
    rows = []
    for name in configs:
        rate = result["tokens_per_second"][name]
        rows.append([name, rate["median"], rate["median"] / base,
                     rate["median"] / materialized if materialized else "", rate["spread"],
                     footprints[name]["held"] / 2**20, footprints[name]["held"] / footprints["full"]["held"]])
    device = f"{env['cuda']} ({env['device']})" if env.get("cuda") else f"{env['torch_threads']} CPU thread(s)"
    return (f"## Decode at {args.length} tokens, {args.model} {args.dtype}, preset {args.preset!r}, "
            f"budget {args.budget}{f' (in {args.budget_dtype} bytes)' if args.budget_dtype else ''}, {device}\n\n"
            + common.table(["cache", "tok/s (median)", "vs full", "vs materialized", "spread (max-min)/median",
                            "K/V held MiB", "held vs full"], rows)
            + "\n\n`+codes`: under the \"varrate\" attention implementation; the others under sdpa (compact layers "
            "are read over their codes under both). "
            + "".join(f"Same greedy tokens as {ref}: {same}. " for ref, same in result["same_tokens_as"].items())
            + "\n"
            f"{args.repeats} repeats x {args.new} tokens, configurations interleaved; load average "
            f"{env['load_average']}; bases: {result['bases']}.\n")


def main(argv=None):
    args = parse_args(argv)
    common.use_device(args.device)
    doc = common.captured_document(args.model, args.dtype, args.length, args.threads)
    model, configs = doc.model, args.configs.split(",")
    caches = build_caches(model, doc.bases, doc.captured, args.budget, configs, args.preset, args.budget_dtype)
    first = doc.ids[:, -1:]
    decode(model, copy.deepcopy(caches["full"]), first, 2)  # warm-up
    steps, rates, tokens = interleaved_decodes(model, caches, first, args)
    result = {"env": doc.env, "args": vars(args), "bases": doc.bases_name,
              "tokens_per_second": {n: common.summary(r) for n, r in rates.items()},
              "step_seconds": {n: common.summary(s) for n, s in steps.items()},
              "same_tokens_as": {ref: {n: tokens[n] == tokens[ref] for n in configs if n != ref}
                                 for ref in ("full", "materialized") if ref in tokens},
              "bytes_at_rest": {name: _bytes(cache) for name, cache in caches.items()}}
    common.write_results(args.out, result, markdown(result, args, configs))


def _bytes(cache) -> dict:
    if isinstance(cache, VarRateCache):
        fp = cache.footprint()
        return {"held": fp.held_bytes, "footprint": fp.bytes, "full": fp.full_bytes}
    held = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
    return {"held": held, "footprint": held, "full": held}


if __name__ == "__main__":
    main()
