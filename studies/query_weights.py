"""Does coding the keys weighted by the queries' energy cut attention's error at equal bytes? \
`python -m studies.query_weights`.

The proxy behind rounds 22 and 23 (docs/accuracy_dev.md): one held-out wiki context of `--length` tokens is
compressed by the `recommended` preset at each budget (fp16-counted, materialized), with the key half of the
coding space as the library weighs it (alpha 0) or weighted by the queries' energy per dimension
(`evaluation/methods/query_weights.py`, measured on two calibration contexts), and with the key weight doubled
or halved. Per option, averaged over the full-attention layers: the relative error of the attention output
and the total variation between the attention distributions, for the queries of the context's last
`--queries` positions over the whole context, and the keys' relative error.

A proxy, not a result: attention inside wiki text, not answers.
"""

from __future__ import annotations

import argparse

import torch

from hf_varrate import Bases, VarRateCache
from hf_varrate.models import DEFAULT_MODELS
from hf_varrate.shipped import SHIPPED_ROOT

from evaluation.capture import capture, decoder, full_attention_layers, replay
from evaluation.methods.query_weights import calibration_contexts, pre_rope_queries, query_energy, weigh

from studies._context import held_out_context

OPTIONS = ((0.0, 1.0), (0.0, 2.0), (0.5, 1.0), (0.5, 0.5), (1.0, 1.0))  # (alpha, key weight x the bases' own)


def post_rope_queries(module, captured, layer: int) -> torch.Tensor:
    """[H_q, S, d] fp32: layer `layer`'s queries as attention scores them."""
    q = pre_rope_queries(module, captured.hidden[layer])
    cos, sin = captured.cos[layer][:, None], captured.sin[layer][:, None]
    half = q.shape[-1] // 2
    rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    return (q * cos + rotated * sin)[0].float()


def attention_errors(model, captured, cache, layers, queries: int) -> tuple[float, float, float]:
    """(attention output relative error, attention TV, key relative error), each averaged over `layers`."""
    modules = {layer.self_attn.layer_idx: layer.self_attn for layer in decoder(model).layers}
    out, tv, keys = [], [], []
    for i in layers:
        q = post_rope_queries(modules[i], captured, i)[:, -queries:]
        exact = [captured.keys[i][0].float(), captured.values[i][0].float()]
        coded = [cache.layers[i].keys[0].float(), cache.layers[i].values[0].float()]
        group = q.shape[0] // exact[0].shape[0]
        length = exact[0].shape[1]
        visible = torch.ones(queries, length, dtype=torch.bool).tril(length - queries)
        scale = getattr(modules[i], "scaling", q.shape[-1] ** -0.5)

        def attend(k, v):
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            p = ((q @ k.transpose(1, 2)) * scale).masked_fill(~visible, float("-inf")).softmax(-1)
            return p, p @ v

        (p, o), (p_hat, o_hat) = attend(*exact), attend(*coded)
        out.append(float((o - o_hat).norm() / o.norm()))
        tv.append(float((p - p_hat).abs().sum(-1).mean() / 2))
        keys.append(float((exact[0] - coded[0]).norm() / exact[0].norm()))
    return tuple(sum(x) / len(x) for x in (out, tv, keys))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m", choices=sorted(DEFAULT_MODELS))
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--budgets", default="0.1,0.2")
    parser.add_argument("--queries", type=int, default=256)
    args = parser.parse_args(argv)
    model, tokenizer, ids = held_out_context(args.model, args.length)
    layers = full_attention_layers(model)
    energy = query_energy(model, calibration_contexts(tokenizer))
    captured = capture(model, ids[0].tolist())
    print(f"# {args.model}, one held-out wiki context of {args.length} tokens, its last {args.queries} positions' "
          f"queries, {len(layers)} full-attention layers\n")
    print("| budget | alpha | key weight | attention output error | attention TV | key error |")
    print("|---|---|---|---|---|---|")
    for budget in (float(b) for b in args.budgets.split(",")):
        for alpha, times in OPTIONS:
            bases = Bases.from_pretrained(str(SHIPPED_ROOT / args.model))
            if alpha:
                weigh(bases, energy, alpha)
            config = bases.config("recommended", budget=budget, budget_dtype="float16", storage="materialized")
            config = config.replace(key_weight=config.key_weight * times)
            cache = VarRateCache(bases, config, model_config=model.config)
            replay(cache, model, captured)
            errors = attention_errors(model, captured, cache, layers, args.queries)
            print(f"| {budget} | {alpha} | {config.key_weight:g} | {errors[0]:.3f} | {errors[1]:.3f} | "
                  f"{errors[2]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
