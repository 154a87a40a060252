"""Memory: bytes the cache holds at rest, and peak process memory during the prefill and the decode.

Each configuration runs in a fresh subprocess (so one's peak never hides another's): load the model,
then prefill a long document, then decode a few tokens, sampling the process's resident set size
(psutil, every 2 ms) through each phase. Reported relative to the RSS after loading the model, next
to the bytes of the cache's own tensors (`footprint().held_bytes`).

    python benchmarks/bench_memory.py                 # SmolLM2 fp32, 4K tokens: full, materialized, compact

A configuration is `full` or `<storage>[-<bits>bit][+codes]`; `+codes` decodes under the "varrate"
attention implementation (compact layers attend over their codes instead of rebuilding their K/V).

    python benchmarks/bench_memory.py --peak --lengths 2048,4096,8192 --out memory_peak

`--peak` measures what a user's one-liner costs instead: `model.generate(ids, max_new_tokens=...)` with
transformers' own DynamicCache (`dynamic`) against `past_key_values=VarRateCache.from_pretrained(name)`
(`default`: no other argument, so no `model=`), each in a fresh subprocess per length, reading the
process's peak resident memory (`VmHWM` in /proc/self/status) reset after the model is loaded and warmed
up (`clear_refs`), next to every byte the cache's tensors hold after decoding (`--peak-configs` adds
`held-exactly`: the one-liner holding its prompt in the model's dtype until coding, `hold_dtype="model"`).
`--repeats N` runs each cell N times, interleaved, and reports medians: with glibc's default dynamic mmap
threshold the same run's peak moves by up to 200 MiB between processes; \
`MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=131072` in the
environment makes it repeat within 1 MiB (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import threading
import time

import common

MiB = 2**20


class PeakSampler:
    """Highest RSS seen between start() and stop(), sampled by a thread."""

    def __init__(self, interval: float = 0.002):
        import psutil

        self.process, self.interval = psutil.Process(), interval
        self.peak, self._stop, self._thread = 0, threading.Event(), None

    def rss(self) -> int:
        return self.process.memory_info().rss

    def start(self):
        self.peak, self._stop = self.rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.rss())


def settle() -> None:
    """Give freed memory back to the OS before reading a resting RSS (glibc keeps it otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def child(config: str, args) -> dict:
    import torch
    from transformers import DynamicCache

    from hf_varrate import VarRateCache, bind
    from hf_varrate.binding import cache_kwarg

    common.set_threads(args.threads)
    model, tokenizer = common.load(args.model, args.dtype)
    bases, _ = common.bases_for(args.model, model)
    bind(model)
    ids = common.document_ids(tokenizer, args.length)
    with torch.no_grad():
        model(ids[:, :64], logits_to_keep=1)  # first-call allocations are not the cache's
    sampler = PeakSampler()
    settle()
    base = sampler.rss()
    if config.endswith("+codes"):
        model.set_attn_implementation("varrate")
    if config == "full":
        cache = DynamicCache(config=model.config)
    else:
        storage, _, bits = config.removesuffix("+codes").partition("-")
        cache = VarRateCache(bases, model=model, budget=args.budget, storage=storage,
                             coef_bits=int(bits.removesuffix("bit")) if bits else None)
    name = cache_kwarg(model)
    sampler.start()
    with torch.no_grad():
        logits = model(ids, logits_to_keep=1, **{name: cache}).logits
        if isinstance(cache, VarRateCache):
            cache.compress()  # the prompt is coded now, not at the first decoding step
    prefill_peak = sampler.stop()
    settle()
    after_prefill = sampler.rss()
    token = logits[:, -1:].argmax(-1)
    sampler.start()
    with torch.no_grad():
        for _ in range(args.new):
            token = model(token, logits_to_keep=1, **{name: cache}).logits[:, -1:].argmax(-1)
    decode_peak = sampler.stop()
    settle()
    after_decode = sampler.rss()
    if isinstance(cache, VarRateCache):
        held = cache.footprint().held_bytes
    else:
        held = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
    import resource

    return {"config": config, "baseline_rss": base, "prefill_peak": prefill_peak - base,
            "at_rest_after_prefill": after_prefill - base, "decode_peak": decode_peak - base,
            "at_rest_after_decode": after_decode - base, "cache_held_bytes": held,
            "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def vm_kib(field: str) -> int:
    """A `Vm...` line of /proc/self/status, in KiB."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_child(config: str, args) -> dict:
    """One `generate` as a user writes it (`dynamic`: transformers' default cache; `default`: the one-liner
    `past_key_values=VarRateCache.from_pretrained(name)`); the process's peak RSS over it."""
    import torch

    from hf_varrate import VarRateCache

    common.set_threads(args.threads)
    model, tokenizer = common.load(args.model, args.dtype)
    ids = common.document_ids(tokenizer, args.length)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        model.generate(ids[:, :64], attention_mask=mask[:, :64], max_new_tokens=2, do_sample=False)  # warm-up
    settle()
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM restarts from the RSS now (the model loaded)
        f.write("5")
    before = vm_kib("VmRSS")
    settings = {"default": {}, "held-exactly": {"hold_dtype": "model"}}  # the latter: the prompt held in fp32
    kwargs = {} if config == "dynamic" else {"past_key_values": VarRateCache.from_pretrained(args.model,
                                                                                           **settings[config])}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=args.new, do_sample=False,
                             return_dict_in_generate=True, **kwargs)
    peak = vm_kib("VmHWM")
    cache = out.past_key_values
    if isinstance(cache, VarRateCache):
        fp = cache.footprint()
        held, full, bases = fp.held_bytes, fp.full_bytes, fp.bases_bytes
    else:
        held = full = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        bases = 0
    return {"config": config, "length": args.length, "rss_before_kib": before, "vmhwm_kib": peak,
            "peak_above_model_mib": (peak - before) / 1024, "held_bytes": held, "full_bytes": full,
            "bases_bytes": bases, "tokens": out.sequences[0, ids.shape[1]:].tolist()}


def peak_main(args) -> None:
    env, results = common.environment(), []
    passthrough = [f"--{k}={getattr(args, k)}" for k in ("model", "dtype", "new", "threads")]
    for length in [int(n) for n in args.lengths.split(",")]:
        for repeat in range(args.repeats):  # the two interleaved, a fresh process each
            for config in args.peak_configs.split(","):
                common.log(f"peak memory: {config} at {length} ({repeat + 1}/{args.repeats})")
                out = subprocess.run([sys.executable, __file__, "--peak-child", config, f"--length={length}",
                                      *passthrough], capture_output=True, text=True, check=True)
                results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    cells = dict.fromkeys((r["length"], r["config"]) for r in results if r["config"] != "dynamic")
    for length, name in cells:
        dyn = [r for r in results if r["length"] == length and r["config"] == "dynamic"]
        var = [r for r in results if r["length"] == length and r["config"] == name]
        below = sum(v["vmhwm_kib"] < d["vmhwm_kib"] for d, v in zip(dyn, var))
        rows.append([length, name, _spread([r["vmhwm_kib"] / 1024 for r in dyn]),
                     _spread([r["vmhwm_kib"] / 1024 for r in var]), f"{below} of {len(var)}",
                     _spread([r["peak_above_model_mib"] for r in dyn]),
                     _spread([r["peak_above_model_mib"] for r in var]),
                     f"{var[0]['held_bytes'] / dyn[0]['held_bytes']:.3f}",
                     f"{(var[0]['held_bytes'] + var[0]['bases_bytes']) / dyn[0]['held_bytes']:.3f}",
                     var[0]["bases_bytes"] / MiB, all(d["tokens"] == v["tokens"] for d, v in zip(dyn, var))])
    md = (f"## Peak process memory of generate, {args.model} {args.dtype}, {args.new} new tokens\n\n"
          + common.table(["tokens", "VarRateCache", "VmHWM DynamicCache MiB", "VmHWM VarRateCache MiB",
                          "VarRate's below, of the pairs", "peak above model, DynamicCache MiB",
                          "peak above model, VarRateCache MiB", "cache tensors vs DynamicCache",
                          "with the bases' copies", "bases + copies MiB", "same tokens"], rows)
          + f"\n\nFresh process per cell, {args.repeats} of each, interleaved; median (min-max). VmHWM reset after "
          "loading and warming up the model (clear_refs), so both columns include the model. Load average at start "
          f"{tuple(round(x, 1) for x in env['load_average'])}.\n"
          f"Command: python benchmarks/bench_memory.py --peak --lengths {args.lengths} --new {args.new} "
          f"--repeats {args.repeats} --peak-configs {args.peak_configs} --out {args.out}\n")
    common.write_results(args.out, {"env": env, "args": vars(args), "results": results}, md)


def _spread(values: list[float]) -> str:
    """median (min-max) of one cell's repeats; the value alone for one."""
    cell = common.summary(values)
    return f"{cell['median']:.0f}" if cell["n"] == 1 else f"{cell['median']:.0f} ({cell['min']:.0f}-{cell['max']:.0f})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--new", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--configs", default="full,materialized,compact,compact+codes,compact-4bit,compact-4bit+codes")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--peak", action="store_true", help="peak RSS (VmHWM) of generate: DynamicCache vs default")
    parser.add_argument("--lengths", default="2048,4096,8192", help="with --peak")
    parser.add_argument("--peak-child", help=argparse.SUPPRESS)
    parser.add_argument("--peak-configs", default="dynamic,default",
                        help="with --peak: 'dynamic' (transformers' cache, needed), 'default' (the one-liner), "
                        "'held-exactly' (the one-liner with hold_dtype='model': the prompt held in the model's dtype)")
    parser.add_argument("--repeats", type=int, default=1, help="with --peak: fresh processes per cell (medians)")
    parser.add_argument("--out", default="memory")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    if args.peak_child:
        print(json.dumps(peak_child(args.peak_child, args)))
        return
    if args.peak:
        peak_main(args)
        return
    env = common.environment()
    rows, results = [], []
    passthrough = [f"--{k}={getattr(args, k)}" for k in ("model", "dtype", "length", "new", "budget", "threads")]
    for config in args.configs.split(","):
        common.log(f"memory: {config}")
        out = subprocess.run([sys.executable, __file__, "--child", config, *passthrough], capture_output=True,
                             text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    full = next((r["cache_held_bytes"] for r in results if r["config"] == "full"), None)
    for r in results:
        rows.append([r["config"], r["cache_held_bytes"] / MiB,
                     f"{r['cache_held_bytes'] / full:.3f}" if full else "-", r["at_rest_after_prefill"] / MiB,
                     r["prefill_peak"] / MiB, r["decode_peak"] / MiB, r["at_rest_after_decode"] / MiB])
    md = (f"## Memory at {args.length} tokens, {args.model} {args.dtype}, budget {args.budget}\n\n"
          + common.table(["cache", "cache tensors MiB", "vs full", "RSS at rest after prefill MiB",
                          "peak during prefill MiB", "peak during decode MiB", "RSS at rest after decode MiB"], rows)
          + "\n\nRSS figures are process resident memory above the RSS after loading the model (fresh process per "
          f"row, sampled every 2 ms, malloc_trim before each resting reading); decode = {args.new} tokens. "
          f"Load average at start {tuple(round(x, 1) for x in env['load_average'])}.\n"
          f"Command: python benchmarks/bench_memory.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip()
          + "\n")
    common.write_results(args.out, {"env": env, "args": vars(args), "results": results}, md)


if __name__ == "__main__":
    main()
