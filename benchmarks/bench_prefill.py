"""Compression overhead of VarRate at the prefill, stage by stage, against the plain prefill.

For each (model, dtype, length) in one process:

1. a plain prefill (DynamicCache) whose per-layer codec inputs are captured with evaluation/'s toolkit
   (its time is a plain sample; the capture keeps references and the last 64 rows of each attention input);
2. the codec replayed on those inputs through the library's query hook and `VarRateCache.update`,
   exactly as in a real prefill, `--replays` times (codec seconds, the hook included), and once under
   torch.profiler for the stage breakdown (the `varrate.<stage>` labels);
3. `--inrun` real VarRate prefills with every layer's compression timed inside the run, so codec and
   model time are measured under the same load (overhead = codec / (wall - codec)), interleaved
   with `--plain` more plain prefills (end-to-end ratio, noisier);
4. the codec's FLOPs (counted from the shapes and the ranks actually allocated) against the
   prefill's (2 x non-embedding parameters x S + causal attention).

The exponent of codec time against length is fitted per (model, dtype) from the replay medians.

    python benchmarks/bench_prefill.py                 # the default plan below, ~15 min on 2 busy cores \
(1 torch thread)
    python benchmarks/bench_prefill.py --plan smollm2-135m-instruct:float32:1024,2048 --replays 5
    python benchmarks/bench_prefill.py --preset recommended --set coef_scales=token   # one setting, side by side
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

import common
from hf_varrate import VarRateCache, VarRateLayer, bind, unbind
from hf_varrate.codec import rank_order
from hf_varrate.config import PRESETS

STAGES = ("salience", "allocation", "joint", "anchor_search", "projection", "reconstruction")
# model:dtype:lengths[:inrun:plain]; in-run and plain repeats shrink where one prefill takes minutes
DEFAULT_PLAN = [
    "smollm2-135m-instruct:float32:1024,2048,4096,8192:2,2,3,0:1,1,1,0",
    "smollm2-135m-instruct:bfloat16:1024,2048:1,0:0,0",
    "gemma-3-270m:float32:2048,4096:1,1:0,0",
]


def parse_plan(items: list[str]) -> list[dict]:
    plan = []
    for item in items:
        parts = item.split(":")
        lengths = [int(x) for x in parts[2].split(",")]
        inrun = [int(x) for x in parts[3].split(",")] if len(parts) > 3 else [1] * len(lengths)
        plain = [int(x) for x in parts[4].split(",")] if len(parts) > 4 else [1] * len(lengths)
        for n, r, p in zip(lengths, inrun, plain):
            plan.append({"model": parts[0], "dtype": parts[1], "length": n, "inrun": r, "plain": p})
    return plan


def plain_prefill(model, ids) -> float:
    return common.timed_forward(model, ids, DynamicCache(config=model.config))


def varrate_prefill(model, ids, bases, config) -> tuple[float, float]:
    """A real prefill with every VarRate layer's compression timed; (wall seconds, codec seconds)."""
    cache = VarRateCache(bases, config, model=model)
    spent = [0.0]
    for layer in cache.layers:
        if isinstance(layer, VarRateLayer):
            layer.finish_prompt = _timed(layer.finish_prompt, spent)  # instrumentation of this instance only
    wall = common.timed_forward(model, ids, cache, _hook_timers(model, spent))
    return wall, spent[0]


def _timed(fn, spent):
    def wrapper(*args, **kwargs):
        start = common.clock()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += common.clock() - start
    return wrapper


def _hook_timers(model, spent):
    """Pre-hooks around bind's query hook: one registered before it (start), one after (stop)."""
    from hf_varrate.binding import attention_modules

    unbind(model)
    marks, handles = {}, []
    modules = attention_modules(model)
    for module in modules:
        handles.append(module.register_forward_pre_hook(
            lambda m, a, k: marks.__setitem__(m, common.clock()), with_kwargs=True))
    bind(model)
    for module in modules:
        def stop(m, a, k):
            spent[0] += common.clock() - marks.pop(m, common.clock())
        handles.append(module.register_forward_pre_hook(stop, with_kwargs=True))
    return handles


def replay_codec(model, bases, captured, config, implementation="fast") -> tuple[float, VarRateCache]:
    """Seconds of the codec (the query hook and `VarRateCache.update`) replayed on a captured prefill."""
    cache = VarRateCache(bases, config, model=model, implementation=implementation)
    return common.replay_into(cache, model, captured), cache


def stage_profile(model, bases, captured, config) -> dict:
    cache = VarRateCache(bases, config, model=model)
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # on CUDA: each stage's host time, launches included
        wall = common.replay_into(cache, model, captured)
    stages = {e.key.removeprefix("varrate."): e.cpu_time_total / 1e6 for e in prof.key_averages()
              if e.key.startswith("varrate.")}
    return {"wall_under_profiler": wall, "stages": {s: stages.get(s, 0.0) for s in STAGES}}


def codec_flops(cache: VarRateCache, model) -> dict:
    """FLOPs of the fast path's arithmetic, from the shapes and the ranks it allocated."""
    total = {"salience": 0, "anchor_search": 0, "projection": 0, "reconstruction": 0, "rope": 0}
    text = model.config.get_text_config(decoder=True)
    heads_q = text.num_attention_heads
    dim = getattr(text, "head_dim", None) or text.hidden_size // heads_q
    for layer in cache.layers:
        if not isinstance(layer, VarRateLayer) or not layer.codes or layer.codes[0].stored_exactly:
            continue
        code = layer.codes[0]
        seq, width = code.seq_len, code.width
        window = min(cache.config.obs_window, seq)
        coded, anchors = code.ranks.numel(), code.anchor_pos.numel()
        blocks = sum(rows * (j1 - j0) for j0, j1, rows, _ in rank_order(code.ranks).blocks)
        total["salience"] += 2 * heads_q * window * seq * dim + 5 * heads_q * window * seq
        total["anchor_search"] += 2 * coded * anchors * width + coded * width
        total["projection"] += 2 * blocks * width + (code.neighbours.shape[1] + 1) * coded * width
        total["reconstruction"] += 2 * blocks * width
        total["rope"] += 5 * (coded + anchors) * width // 2 + 3 * coded * width // 2
    total["total"] = sum(total.values())
    return total


def prefill_flops(model, length: int) -> float:
    """2 x non-embedding parameters x S, plus causal attention (QK^T and PV) per layer."""
    config = model.config.get_text_config(decoder=True)
    embed = {id(p) for p in model.get_input_embeddings().parameters()}
    embed |= {id(p) for p in model.get_output_embeddings().parameters()}
    params = sum(p.numel() for p in model.parameters() if id(p) not in embed)
    heads, dim = (config.num_attention_heads,
                  getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    window = getattr(config, "sliding_window", None)
    attention = 0
    for kind in (getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers):
        span = min(length, window) if kind == "sliding_attention" and window else length
        attention += 2 * 2 * heads * dim * length * span / (2 if span == length else 1)
    return 2 * params * length + attention


def warm_model(name: str, dtype: str, args, models: dict) -> tuple:
    """(model, tokenizer, bases, bases name, config) for `name` in `dtype`, bound and warmed up; one model at a
    time. The config is the one `VarRateCache.from_pretrained` would build with these bases (`Bases.config`: the
    preset, the calibration settings and the settings tuned for this model), with `--set` on top."""
    if (name, dtype) not in models:
        models.clear()
        model, tokenizer = common.load(name, dtype)
        bases, bases_name = common.bases_for(name, model)
        config = bases.config(args.preset, budget=args.budget, **args.overrides)
        bind(model)
        ids = common.document_ids(tokenizer, 256)
        plain_prefill(model, ids)  # warm-up
        varrate_prefill(model, ids, bases, config)
        models[(name, dtype)] = (model, tokenizer, bases, bases_name, config)
    return models[(name, dtype)]


def live_prefills(model, ids, bases, config, cfg) -> tuple[list[float], list[float], list[float]]:
    """`cfg['plain']` plain prefills interleaved with `cfg['inrun']` real VarRate ones: (plain seconds,
    in-run overheads codec / (wall - codec), VarRate wall seconds)."""
    plains, inrun, walls = [], [], []
    for r in range(max(cfg["inrun"], cfg["plain"])):
        if r < cfg["plain"]:
            plains.append(plain_prefill(model, ids))
        if r < cfg["inrun"]:
            wall, codec = varrate_prefill(model, ids, bases, config)
            walls.append(wall)
            inrun.append(codec / (wall - codec))
    return plains, inrun, walls


def run_config(cfg, args, models) -> dict:
    name, dtype, length = cfg["model"], cfg["dtype"], cfg["length"]
    model, tokenizer, bases, bases_name, config = warm_model(name, dtype, args, models)
    ids = common.document_ids(tokenizer, length)
    common.log(f"{name} {dtype} {length}: capture")
    captured, first_plain = common.capture_prefill(model, ids)
    plains = [first_plain]
    replays = []
    for _ in range(args.replays):
        seconds, cache = replay_codec(model, bases, captured, config)
        replays.append(seconds)
    with_reference = length <= args.reference_up_to and args.preset == "paper"  # the reference runs the paper only
    reference = [replay_codec(model, bases, captured, config, "reference")[0]
                 for _ in range(args.replays if with_reference else 0)]
    stages = stage_profile(model, bases, captured, config)
    flops = codec_flops(cache, model)
    fp = cache.footprint()
    more_plains, inrun, walls = live_prefills(model, ids, bases, config, cfg)
    plains += more_plains
    del captured
    plain, replay = common.summary(plains), common.summary(replays)
    forward = prefill_flops(model, length)
    result = {"model": name, "dtype": dtype, "length": length, "bases": bases_name, "config": config.to_dict(),
              "plain_seconds": plain, "codec_seconds_replay": replay,
              "overhead_accounted": replay["median"] / plain["median"],
              "codec_seconds_reference": common.summary(reference),
              "overhead_accounted_reference": (common.summary(reference)["median"] / plain["median"]
                                               if reference else None),
              "overhead_in_run": common.summary(inrun), "varrate_wall_seconds": common.summary(walls),
              "overhead_end_to_end": (common.summary(walls)["median"] / plain["median"] - 1) if walls else None,
              "stages": stages, "codec_flops": flops, "prefill_flops": forward,
              "flops_share": flops["total"] / forward, "footprint_fraction": fp.fraction}
    common.log(f"  plain {plain['median']:.2f}s codec {replay['median']:.2f}s "
               f"accounted {result['overhead_accounted']:.1%} in-run {[f'{x:.1%}' for x in inrun]}")
    return result


def markdown(results, env, args) -> str:
    rows = []
    for r in results:
        inrun = r["overhead_in_run"]
        stages = r["stages"]["stages"]
        total = sum(stages.values()) or 1.0
        shares = " / ".join(f"{100 * stages[s] / total:.0f}" for s in STAGES)
        rows.append([r["model"], r["dtype"], r["length"],
                     f"{r['plain_seconds']['median']:.2f} (n={r['plain_seconds']['n']})",
                     f"{r['codec_seconds_replay']['median']:.2f} (n={r['codec_seconds_replay']['n']}, "
                     f"±{r['codec_seconds_replay']['spread']:.0%})",
                     f"{100 * r['overhead_accounted']:.1f}%",
                     f"{100 * r['overhead_accounted_reference']:.1f}%" if r["overhead_accounted_reference"] else "-",
                     f"{100 * inrun['median']:.1f}% (n={inrun['n']})" if inrun["n"] else "-",
                     f"{100 * r['overhead_end_to_end']:+.0f}%" if r["overhead_end_to_end"] is not None else "-",
                     f"{100 * r['flops_share']:.2f}%", shares])
    exps = _exponents(results)
    settings = "".join(f", {k}={v!r}" for k, v in args.overrides.items())
    lines = [f"## Prefill overhead of VarRate (preset {args.preset!r} as each model's bases tune it{settings}, "
             f"budget {args.budget}, {env['torch_threads']} torch thread(s))", "",
             common.table(["model", "dtype", "tokens", "plain prefill s", "codec s (replayed)", "overhead (accounted)",
                           "reference path (before)", "overhead (in run)", "end to end", "codec FLOPs / prefill FLOPs",
                           "stage % (" + " / ".join(STAGES) + ")"], rows), "",
             "Exponent of codec time vs length (log-log fit of the replay medians): "
             + ", ".join(f"{k}: {v:.2f}" for k, v in exps.items()), "",
             "accounted = codec seconds (replayed through VarRateCache.update + the query hook) / plain prefill "
             "seconds; reference path = the same with implementation='reference' (the codec before the fast path); "
             "in run = codec / (wall - codec) inside real VarRate prefills, so both halves share the "
             "machine's load at that moment; end to end = VarRate prefill / plain prefill - 1 (one sample each "
             "at long lengths: the noisiest). Spread = (max - min) / median of the replays.",
             (f"Device: {env['cuda']} ({env['device']}); the stage shares are host-side times (the profiler's CPU "
              f"view: launches, and waits where a stage reads a result back). " if env["cuda"] else "")
             + f"Machine: {env['cpu']}, {env['cores']} cores shared with other jobs (load average at start "
             f"{tuple(round(x, 1) for x in env['load_average'])}, "
             f"at end {tuple(round(x, 1) for x in env['load_average_end'])}).",
             f"Command: python benchmarks/bench_prefill.py {' '.join(args.argv)}".rstrip()]
    return "\n".join(lines)


def _exponents(results) -> dict:
    groups = {}
    for r in results:
        groups.setdefault(f"{r['model']} {r['dtype']}", []).append((r["length"], r["codec_seconds_replay"]["median"]))
    return {k: common.fit_exponent([n for n, _ in v], [t for _, t in v]) for k, v in groups.items() if len(v) > 1}


def main(argv=None):
    import sys

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", nargs="+", default=DEFAULT_PLAN,
                        help="model:dtype:len1,len2[:inrun1,inrun2[:plain1,plain2]] (extra plain / in-run repeats)")
    parser.add_argument("--replays", type=int, default=3, help="codec replays per configuration (median)")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--preset", choices=PRESETS, default="paper",
                        help="the preset the codec runs with, as `Bases.config` builds it for each model's bases "
                        "(from_pretrained's default is 'recommended')")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a VarRateConfig field on top of the preset, e.g. --set coef_scales=token; repeatable")
    parser.add_argument("--reference-up-to", type=int, default=4096,
                        help="also replay implementation='reference' (the codec before this work) up to this length")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="where the model and the codec run: cpu or cuda[:index]")
    parser.add_argument("--out", default="prefill")
    args = parser.parse_args(argv)
    common.use_device(args.device)
    args.argv = sys.argv[1:] if argv is None else argv
    args.overrides = common.field_overrides(args.set)
    common.set_threads(args.threads)
    env = common.environment()
    models, results = {}, []
    for cfg in parse_plan(args.plan):
        results.append(run_config(cfg, args, models))
    env["load_average_end"] = common.environment()["load_average"]
    data = {"env": env, "args": vars(args), "results": results,
            "exponents": _exponents(results)}
    common.write_results(args.out, data, markdown(results, env, args))


if __name__ == "__main__":
    main()
