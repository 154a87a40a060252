"""Bytes per token per layer, and tokens of context per GPU, for a serving-size model (docs/scale.md).

Counts, not measurements: for a prompt of S tokens, the library's own functions give the stride
(`effective_stride`), the exact set (`exact_mask`), the side information per coded token
(`meta_bytes_per_token`), the coefficient total (`coefficient_budget`, Eq. 3) and the ranks
(`waterfill_ranks` under a constant salience: the uniform ranks of the recommended preset); a 4-bit
stream costs `packed_bytes` plus an fp16 min and step per group (`group_counts`), as `QuantizedCoefs`
stores it. Salience-driven ranks (the paper's SnapKV signal) sum to the same total; their 4-bit
groups can cost at most one more partial group, 4 bytes, per coded token ("4-bit bound" below).

    python benchmarks/scale_numbers.py                     # Llama-3.1-8B, S = 32768, an 80 GB GPU
    python benchmarks/scale_numbers.py --seq-len 131072 --kv-heads 8 --head-dim 128 --layers 32
"""

from __future__ import annotations

import argparse
import functools

import torch

from hf_varrate import VarRateConfig
from hf_varrate.codec.allocation import waterfill_ranks
from hf_varrate.codec.anchors import anchor_positions, exact_mask
from hf_varrate.codec.packing import meta_bytes_per_token
from hf_varrate.codec.budget import coefficient_budget
from hf_varrate.codec.pipeline import effective_stride, rank_floor
from hf_varrate.codec.codes import SCALE_DTYPE, group_counts, packed_bytes

KV_BYTES = 2  # fp16 / bf16 K and V
VARIANTS = {  # name -> VarRateConfig fields beyond the budget
    "fp16 coefficients (paper)": {},
    "4-bit, same ranks (paper App. A.4)": {"coef_bits": 4},
    "4-bit, same bytes": {"coef_bits": 4, "quantized_budget": "same_bytes"},
    "4-bit, same bytes, anchor_share 0.25 (recommended)": {"coef_bits": 4, "quantized_budget": "same_bytes",
                                                          "anchor_share": 0.25},
}


def prompt_bytes(config: VarRateConfig, seq_len: int, width: int) -> dict:
    """One layer's bytes for an S-token prompt under `config`, split into exact, side information and
    coefficients, with the stride and the mean rank (uniform ranks)."""
    rank = min(config.rank, width)
    stride = effective_stride(config, seq_len)
    n_exact = int(exact_mask(seq_len, stride, config.window).sum())
    n_coded = seq_len - n_exact
    meta = meta_bytes_per_token(config.n_anchors, anchor_positions(seq_len, stride).numel(), rank)
    total = min(coefficient_budget(config, seq_len, n_exact, n_coded, width, KV_BYTES, meta, rank), n_coded * rank)
    if total < n_coded * config.r_min:
        raise ValueError(f"budget {config.budget} cannot cover the exact set and r_min: the prompt is stored exactly")
    floor = rank_floor(config, total, n_coded, rank)
    ranks = waterfill_ranks(torch.ones(n_coded), total, floor, rank)
    if config.coef_bits is None:
        coefs = int(ranks.sum()) * KV_BYTES
    else:
        scales = 2 * torch.empty(0, dtype=SCALE_DTYPE).element_size()  # min and step
        groups = int(group_counts(ranks, config.coef_group).sum())
        coefs = packed_bytes(int(ranks.sum()), config.coef_bits) + groups * scales
    return {"stride": stride, "exact": n_exact * width * KV_BYTES, "meta": n_coded * meta, "meta_per_token": meta,
            "coefs": coefs, "coded": n_coded, "mean_rank": float(ranks.float().mean()),
            "coefficients": int(ranks.sum()), "max_rank": int(ranks.max())}


@functools.cache
def variant_bytes(budget: float, variant: str, seq_len: int, width: int) -> dict:
    """`prompt_bytes` of one row of the tables (each is asked for by three tables)."""
    return prompt_bytes(VarRateConfig(budget=budget, **VARIANTS[variant]), seq_len, width)


def decode_step(row: dict, args, width: int) -> tuple[float, float]:
    """(MB read, GFLOP) of one decode step's attention over one layer's coded prompt, the way
    `codec.attend_codes` computes it: every coded key rebuilt from its r_t coefficients (RoPE makes
    q.k_t depend on t), values read as (sum_t p_t c_t) V, plus q.k and p.v over the exact tokens."""
    keys = 2 * row["coefficients"] * (width // 2)  # c_t V_k, token by token
    values = 2 * args.query_heads * row["coefficients"]  # sum_t p_t c_t, per query head
    scores = 4 * args.query_heads * args.seq_len * args.head_dim  # q.k and p.v over all S tokens
    basis = row["max_rank"] * width * 2  # the rows of V the step touches (shared by every sequence)
    read = row["exact"] + row["meta"] + row["coefs"] + basis
    return read / 1e6, (keys + values + scores) / 1e9


def report(args) -> None:
    width = 2 * args.kv_heads * args.head_dim  # D
    full = width * KV_BYTES  # bytes per token per layer, uncompressed
    bases = args.layers * min(VarRateConfig.rank, width) * width * 2  # L x R x D in fp16
    free = args.gpu_gb * 1e9 - args.weights_gb * 1e9 - bases
    print(f"D = {width}; fp16 K/V = {full} bytes per token per layer; S = {args.seq_len}; "
          f"bases {bases / 1e6:.1f} MB; {args.gpu_gb:g} GB - {args.weights_gb:g} GB weights - bases = "
          f"{free / 1e9:.2f} GB for the cache")
    print(f"\n| budget | variant | stride | mean rank | exact | anchor idx + rank | coefficients | total "
          f"(bytes/token/layer) | one coded token's record | footprint | tokens per {args.gpu_gb:g} GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| 1 | uncompressed fp16 | - | - | {full} | 0 | 0 | {full} | - | 1.000 | "
          f"{free / (full * args.layers):,.0f} |")
    for budget in args.budgets:
        for name, fields in VARIANTS.items():
            row = variant_bytes(budget, name, args.seq_len, width)
            per_token = [row[k] / args.seq_len for k in ("exact", "meta", "coefs")]
            total = sum(per_token)
            bound = "" if "coef_bits" not in fields or "same_bytes" in fields.values() else \
                f" (<= {total + 4 * row['coded'] / args.seq_len:.1f})"
            print(f"| {budget} | {name} | {row['stride']} | {row['mean_rank']:.1f} | {per_token[0]:.1f} | "
                  f"{per_token[1]:.1f} ({row['meta_per_token']} per coded token) | {per_token[2]:.1f} | "
                  f"{total:.1f}{bound} | {(row['meta'] + row['coefs']) / row['coded']:.1f} | {total / full:.3f} | "
                  f"{free / (total * args.layers):,.0f} |")


def report_decode(args) -> None:
    width = 2 * args.kv_heads * args.head_dim
    full_read = args.seq_len * width * KV_BYTES / 1e6
    full_flops = 4 * args.query_heads * args.seq_len * args.head_dim / 1e9
    print(f"\nOne decode step, one layer, one sequence of S = {args.seq_len} (Hq = {args.query_heads}):\n")
    print("| budget | variant | MB read (codes + exact + basis rows) | GFLOP | FLOP per byte |")
    print("|---|---|---|---|---|")
    print(f"| 1 | uncompressed fp16 | {full_read:.1f} | {full_flops:.2f} | {full_flops * 1e3 / full_read:.1f} |")
    for budget in args.budgets:
        for name in VARIANTS:
            read, flops = decode_step(variant_bytes(budget, name, args.seq_len, width), args, width)
            print(f"| {budget} | {name} | {read:.1f} | {flops:.2f} | {flops * 1e3 / read:.0f} |")


def report_restore(args) -> None:
    """Decompressing a whole coded prompt into fp16 pages once (every layer), against prefilling it again."""
    width = 2 * args.kv_heads * args.head_dim
    causal = 2 * args.layers * args.query_heads * args.head_dim * args.seq_len**2  # q.k and p.v, half the square
    prefill = (2 * args.params * args.seq_len + causal) / 1e12
    print(f"\nRestoring one prompt of S = {args.seq_len} into fp16 K/V, all {args.layers} layers, against a new "
          f"prefill ({prefill:.0f} TFLOP):\n")
    print("| budget | variant | TFLOP to decode (anchor means + V^T c) | share of a prefill |")
    print("|---|---|---|---|")
    for budget in args.budgets:
        for name in VARIANTS:
            row = variant_bytes(budget, name, args.seq_len, width)
            flops = args.layers * (2 * row["coefficients"] * width + row["coded"] * args.n_anchors * width) / 1e12
            print(f"| {budget} | {name} | {flops:.2f} | {flops / prefill:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--query-heads", type=int, default=32)
    parser.add_argument("--params", type=float, default=8.03e9, help="model parameters (prefill FLOPs)")
    parser.add_argument("--n-anchors", type=int, default=VarRateConfig.n_anchors)
    parser.add_argument("--seq-len", type=int, default=32768, help="prompt length S (the exact window is per prompt)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2])
    parser.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory, in 10^9 bytes")
    parser.add_argument("--weights-gb", type=float, default=16.06, help="model weights (8.03e9 bf16 parameters)")
    args = parser.parse_args()
    report(args)
    report_decode(args)
    report_restore(args)


if __name__ == "__main__":
    main()
