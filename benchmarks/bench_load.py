"""Compress a document once, answer later: load a saved cache and produce the first answer token,
against re-running the prefill of the document and question from scratch.

The document is compressed and saved once; then, interleaved within each repeat: (a) load it
(`VarRateCache.load`, compact and materialized storage) and run the question to its first answer
token; (b) prefill document + question with a plain DynamicCache to its first token. The model is
loaded once for both (a later process pays that either way); the saved files are in the page cache.

    python benchmarks/bench_load.py                   # SmolLM2 fp32, 4K-token document
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import common
from hf_varrate import VarRateCache, bind
from hf_varrate.binding import cache_kwarg


def first_token(model, ids, cache) -> tuple[float, int]:
    name = cache_kwarg(model)
    start = time.perf_counter()
    with torch.no_grad():
        token = model(ids, logits_to_keep=1, **{name: cache}).logits[:, -1].argmax(-1)
        if hasattr(cache, "compress"):
            cache.compress()  # a document is coded once its prefill ends; the question after it is not
    return time.perf_counter() - start, int(token)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-repeats", type=int, default=2, help="re-prefills (each takes the longest)")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="load")
    args = parser.parse_args(argv)
    common.set_threads(args.threads)
    env = common.environment()
    model, tokenizer = common.load(args.model, args.dtype)
    bases, bases_name = common.bases_for(args.model, model)
    bind(model)
    doc = common.document_ids(tokenizer, args.length)
    question = torch.tensor([tokenizer("\nQuestion: what is this essay about? Answer:",
                                       add_special_tokens=False)["input_ids"]])
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "doc"
        common.log("compressing and saving the document")
        cache = VarRateCache(bases, model=model, budget=args.budget, storage="compact")
        compress_seconds, _ = first_token(model, doc, cache)
        save_start = time.perf_counter()
        cache.save_pretrained(folder)
        save_seconds = time.perf_counter() - save_start
        size = sum(p.stat().st_size for p in folder.iterdir())
        times = {"load_compact": [], "load_materialized": [], "load_only_compact": [], "reprefill": []}
        answers = {}
        for repeat in range(max(args.repeats, args.prefill_repeats)):
            for storage in ("compact", "materialized"):
                if repeat >= args.repeats:
                    continue
                start = time.perf_counter()
                loaded = VarRateCache.load(folder, model=model, bases=bases, storage=storage)
                loaded_at = time.perf_counter()
                seconds, answers[storage] = first_token(model, question, loaded)
                times[f"load_{storage}"].append(loaded_at - start + seconds)
                if storage == "compact":
                    times["load_only_compact"].append(loaded_at - start)
            if repeat < args.prefill_repeats:
                seconds, answers["reprefill"] = first_token(model, torch.cat([doc, question], 1),
                                                            DynamicCache(config=model.config))
                times["reprefill"].append(seconds)
            common.log(f"repeat {repeat}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items() if v))
    stats = {k: common.summary(v) for k, v in times.items()}
    base = stats["reprefill"]["median"]
    result = {"env": env, "args": vars(args), "bases": bases_name, "seconds": stats,
              "speedup_vs_reprefill": {k: base / stats[k]["median"] for k in ("load_compact", "load_materialized")},
              "saved_bytes": size, "save_seconds": save_seconds, "compress_seconds": compress_seconds,
              "first_tokens": answers}
    rows = [["re-prefill document + question (DynamicCache)", stats["reprefill"]["median"], stats["reprefill"]["n"],
             1.0],
            ["load (compact) + question", stats["load_compact"]["median"], stats["load_compact"]["n"],
             base / stats["load_compact"]["median"]],
            ["  of which VarRateCache.load", stats["load_only_compact"]["median"], stats["load_only_compact"]["n"],
             "-"],
            ["load (materialized) + question", stats["load_materialized"]["median"], stats["load_materialized"]["n"],
             base / stats["load_materialized"]["median"]]]
    md = (f"## Load a saved compressed {args.length}-token document and answer, vs re-prefilling "
          f"({args.model} {args.dtype}, budget {args.budget}, {args.threads} thread(s))\n\n"
          + common.table(["path to the first answer token", "seconds (median)", "n", "speedup vs re-prefill"], rows)
          + f"\n\nSaved cache: {size / 2**20:.1f} MiB on disk (safetensors + JSON), written in {save_seconds:.2f} s. "
          f"First answer tokens (compact / materialized / re-prefill): {answers.get('compact')} / "
          f"{answers.get('materialized')} / {answers.get('reprefill')} (the re-prefill attends to the exact "
          f"document, the loaded caches to the compressed one). Load average at start "
          f"{tuple(round(x, 1) for x in env['load_average'])}.\n"
          f"Command: python benchmarks/bench_load.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip()
          + "\n")
    common.write_results(args.out, result, md)


if __name__ == "__main__":
    main()
