"""Where a compact layer's read goes: one decode step's attention over the codes, per layer.

Builds a compact cache (replayed from one captured prefill, as bench_decode.py does) and times, for
each layer that attends over its codes, the whole read (`VarRateLayer.attend`, one query token) and
the part of it that turns the stored coefficients into matmul operands (`attend.code_pieces`: unpack,
scale, shift, round to the matmul dtype), each with the C loops of `hf_varrate.codec.native` (the
library's path where they are built) and with PyTorch only (`native.disabled()`). For 4-bit codes it
also times fbgemm's fused 4-bit row-wise kernel (`torch.ops.quantized.embedding_bag_4bit_rowwise_offsets`,
in torch's x86 CPU builds) on the same values plus the round to bf16, for comparison; nothing in the
library uses it.

    python benchmarks/bench_read.py --preset recommended      # SmolLM2 fp32, 4K prompt
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch

import common
from hf_varrate import VarRateCache
from hf_varrate.codec import attend, native
from hf_varrate.codec.pipeline import code_layout, dense_coef_values
from hf_varrate.codec.projection import DenseOrder, matmul_dtype
from hf_varrate.codec.codes import QuantizedCoefs
from hf_varrate.config import PRESETS
from hf_varrate import VarRateLayer


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(common.timed(fn)[0] for _ in range(repeats)) * 1e3


def fused_kernel(code) -> tuple | None:
    """fbgemm's 4-bit row-wise kernel on this code's values, one row per quantization group, and the
    call that reads them all into a [C, width] bf16 matrix; None where it does not apply."""
    kernel = getattr(torch.ops.quantized, "embedding_bag_4bit_rowwise_offsets", None)
    plan = code_layout(code)
    if kernel is None or not isinstance(code.coefs, QuantizedCoefs) or code.coefs.bits != 4:
        return None
    if not isinstance(plan, DenseOrder) or code.coefs.axis != "token" or code.coefs.group % 2:
        return None  # per-component scales (coef_scales="component") have no row-wise groups
    dense = dense_coef_values(code, plan)  # [C, width]: every group padded to `group` values
    packed = torch.ops.quantized.embedding_bag_4bit_prepack(dense.view(-1, code.coefs.group).contiguous())
    rows = torch.arange(packed.shape[0], dtype=torch.int32)

    def read():
        values = kernel(packed, rows, rows, False, 0, False, None, None, False)
        return values.view(dense.shape).to(torch.bfloat16)

    return read


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--preset", choices=PRESETS, default="recommended")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="read")
    return parser.parse_args(argv)


def time_layer(layer, query: torch.Tensor, head_dim: int, repeats: int) -> dict:
    """One compact layer: its whole read and its codes' part, with the C loops and PyTorch only, and fbgemm's."""
    code = layer.codes[0]
    mm_dtype = matmul_dtype(layer.config.projection_dtype, layer.keys.device)
    row = {"layer": layer.layer_idx, "coded_tokens": int(code.ranks.numel()),
           "mean_rank": float(code.ranks.float().mean())}
    for path, context in (("c", contextlib.nullcontext), ("torch", native.disabled)):
        with context():
            row[f"read_ms_{path}"] = median_ms(lambda: layer.attend(query, None, head_dim**-0.5), repeats)
            row[f"codes_ms_{path}"] = median_ms(lambda: attend.code_pieces(code, code_layout(code), mm_dtype), repeats)
    kernel = fused_kernel(code)
    row["fused_codes_ms"] = median_ms(kernel, repeats) if kernel else None
    common.log(f"layer {layer.layer_idx}: read {row['read_ms_c']:.2f} ms (PyTorch only {row['read_ms_torch']:.2f}), "
               f"codes {row['codes_ms_c']:.2f} ms (PyTorch only {row['codes_ms_torch']:.2f}), fbgemm "
               f"{row['fused_codes_ms']} ms")
    return row


def markdown(result: dict, args) -> str:
    med, per_layer, env = result["median"], result["layers"], result["env"]
    c_loops = "C loops" if native.available() else "C loops NOT BUILT here: PyTorch"
    rows = []
    for path, name in (("c", c_loops), ("torch", "PyTorch only")):
        read, codes = med[f"read_ms_{path}"], med[f"codes_ms_{path}"]
        rows += [[f"whole read (attention over the codes, 1 query token), {name}", read],
                 ["  of which reading the codes (unpack, scale, shift, round to the matmul dtype)", codes],
                 ["  the rest (anchor means, keys matmul, RoPE, scores, softmax, value mix)", read - codes]]
    if med["fused_codes_ms"] is not None:
        rows += [["fbgemm 4-bit row-wise kernel + round to bf16, same values (not used by the library)",
                  med["fused_codes_ms"]]]
    return (f"## A compact layer's read at {args.length} tokens, {args.model} {args.dtype}, preset {args.preset!r}, "
            f"budget {args.budget}, {args.threads} thread(s)\n\n"
            + common.table(["part", "ms per layer (median over layers)"], rows)
            + f"\n\n{len(per_layer)} layers, {per_layer[0]['coded_tokens']} coded tokens each, mean rank "
            f"{med['mean_rank']:.0f}; medians of {args.repeats} repeats per layer. Load average {env['load_average']}; "
            f"bases: {result['bases']}.\n")


def main(argv=None):
    args = parse_args(argv)
    doc = common.captured_document(args.model, args.dtype, args.length, args.threads)
    model = doc.model
    config = doc.bases.config(args.preset, budget=args.budget, storage="compact")
    cache = VarRateCache(doc.bases, config, model=model)
    common.replay_into(cache, model, doc.captured)
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    query = torch.randn(1, text.num_attention_heads, 1, head_dim, generator=torch.Generator().manual_seed(0))
    query = query.to(model.dtype)
    per_layer = [time_layer(layer, query, head_dim, args.repeats) for layer in cache.layers
                 if isinstance(layer, VarRateLayer) and layer.attends_codes(None)]
    if not per_layer:
        raise SystemExit(f"no layer attends over its codes at --length {args.length} (a prompt that short is stored "
                         f"exactly): pass a longer --length")
    keys = ("read_ms_c", "read_ms_torch", "codes_ms_c", "codes_ms_torch", "fused_codes_ms", "mean_rank")
    med = {key: statistics.median(row[key] for row in per_layer) if per_layer[0][key] is not None else None
           for key in keys}
    result = {"env": doc.env, "args": vars(args), "bases": doc.bases_name, "layers": per_layer, "median": med}
    common.write_results(args.out, result, markdown(result, args))


if __name__ == "__main__":
    main()
