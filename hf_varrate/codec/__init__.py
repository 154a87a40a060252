"""The VarRate codec as pure tensor functions, one stage per module (Algorithm 1)."""

from .allocation import topk_ranks, waterfill_ranks
from .attend import attend_codes
from .anchors import (anchor_means, anchor_positions, exact_mask, gather_means, nearest_anchors, nearest_anchors_mm,
                      residuals)
from .budget import coefficient_budget
from .codes import QuantizedCoefs
from .joint import join_kv, joint_rows, split_kv
from .packing import PromptCode, tensor_bytes
from .pipeline import coef_values, compress_prompt, decode_prompt, encode_prompt
from .projection import RankOrder, decode, decode_blocks, encode, encode_blocks, matmul_dtype, pack, rank_order, unpack
from .quantization import dequantize, quantize
from .rope import rope_tables, rotate_keys, rotate_rows, sample_positions, unrotate_keys, unrotate_rows
from ..signals import SIGNALS, Signal, SignalInputs, coded_salience, register_signal
from .salience import attention_scale, minmax, pool_scores, snapkv_scores

__all__ = [
    "SIGNALS", "Signal", "SignalInputs", "attention_scale", "matmul_dtype", "register_signal", "tensor_bytes",
    "PromptCode", "QuantizedCoefs", "RankOrder", "anchor_means", "attend_codes", "anchor_positions", "coded_salience",
    "coef_values",
    "coefficient_budget", "compress_prompt", "decode", "decode_blocks", "decode_prompt", "dequantize", "encode",
    "encode_blocks", "encode_prompt", "exact_mask", "gather_means", "join_kv", "joint_rows", "minmax",
    "nearest_anchors", "nearest_anchors_mm", "pack", "pool_scores", "quantize", "rank_order", "residuals",
    "rope_tables", "rotate_keys", "rotate_rows", "sample_positions", "snapkv_scores", "split_kv", "topk_ranks",
    "unpack", "unrotate_keys", "unrotate_rows", "waterfill_ranks",
]
