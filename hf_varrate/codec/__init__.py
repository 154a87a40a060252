"""The VarRate codec as pure tensor functions, one stage per module (Algorithm 1)."""

from .allocation import topk_ranks, waterfill_ranks
from .anchors import anchor_means, anchor_positions, exact_mask, nearest_anchors, residuals
from .joint import join_kv, split_kv
from .packing import PromptCode
from .pipeline import coefficient_budget, decode_prompt, encode_prompt
from .projection import decode, encode, pack, unpack
from .rope import rotate_keys, unrotate_keys
from .salience import coded_salience, minmax, pool_scores, snapkv_scores

__all__ = [
    "PromptCode", "anchor_means", "anchor_positions", "coded_salience", "coefficient_budget", "decode",
    "decode_prompt", "encode", "encode_prompt", "exact_mask", "join_kv", "minmax", "nearest_anchors", "pack",
    "pool_scores", "residuals", "rotate_keys", "snapkv_scores", "split_kv", "topk_ranks", "unpack",
    "unrotate_keys", "waterfill_ranks",
]
