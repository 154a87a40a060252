"""Evaluation only: exact keys for the tokens the document's own queries read most (a hypothesis).

`studies.needle_attention` found that the needle sentences' own keys carry the preset's loss, and that neither the
keys the codes err on most nor their norms do. A third query-agnostic choice is what the prompt's attention itself
reads: H2O keeps the "heavy hitters", the tokens with the largest accumulated attention. Here each full-attention
layer's heavy hitters are found from every `stride`-th query of the prompt (the prefill's own queries, recomputed
from the captured attention input), each token's attention received divided by the number of those queries that
can see it (so early tokens are not chosen for being seen more often), the first token (a sink, stored exactly)
left out. A VarRate method spec with `eval_read_keys: p` (and `eval_read_stride: s`, default 16) codes the prompt
with the library in materialized storage, then puts back the exact keys of the round(p * S) most read tokens of
each layer that the codec coded. The spec's `budget` is the total: the codec runs at the budget less what those
keys take (fp16 keys and a 4-byte position each), the first pass assuming every chosen token coded, a second
spending what the already-exact ones left. The attention read and both passes are counted in the time.
"""

from __future__ import annotations

import torch

from hf_varrate.binding import attention_modules, window_queries

POSITION_BYTES = 4  # where each exact key goes: an int32 position
STRIDE = 16


def attention_read(model, captured, layers: list[int], stride: int = STRIDE) -> dict[int, torch.Tensor]:
    """{layer: [S]} the mean attention each prompt token gets from the prompt's own queries (every `stride`-th,
    causal, summed over query heads), over the queries that can see it: H2O's accumulated attention, with the
    causal count divided out so early tokens are not favoured for being seen more often."""
    modules = {m.layer_idx: m for m in attention_modules(model)}
    length = captured.length
    rows = torch.arange(stride - 1, length, stride)
    read = {}
    for i in layers:
        queries = window_queries(modules[i], captured.hidden[i], captured.cos[i], captured.sin[i], length)[0][:, rows]
        keys = captured.keys[i][0].repeat_interleave(queries.shape[0] // captured.keys[i].shape[1], dim=0)
        scores = torch.einsum("hqd,hsd->hqs", queries.float(), keys.float()) * modules[i].scaling
        scores = scores.masked_fill(torch.arange(length)[None, None] > rows[None, :, None], float("-inf"))
        received = torch.softmax(scores, dim=-1).sum(dim=(0, 1))  # [S]
        seen = (rows[:, None] >= torch.arange(length)[None]).sum(dim=0).clamp_min(1)
        read[i] = received / seen
    return read


def most_read(read: dict[int, torch.Tensor], share: float) -> dict[int, torch.Tensor]:
    """{layer: the round(share * S) positions the prompt's queries read most (`attention_read`), the first token
    (an attention sink, stored exactly anyway) left out}."""
    chosen = {}
    for i, scores in read.items():
        scores = scores.clone()
        scores[0] = float("-inf")
        chosen[i] = scores.topk(max(1, round(share * scores.numel()))).indices.sort().values
    return chosen


def share(fraction: float) -> float:
    """The fraction of fp16 K/V bytes exact keys for `fraction` of the tokens take (the first pass's guess)."""
    return fraction / 2


def key_bytes(count: int, heads: int, dim: int) -> int:
    """Bytes `count` exact keys of `heads` x `dim` take: fp16 and a position each."""
    return count * (heads * dim * 2 + POSITION_BYTES)


def put_back_keys(cache, captured, chosen: dict[int, torch.Tensor]) -> dict[int, int]:
    """Each materialized layer's chosen coded tokens get their exact keys; returns {layer: how many}."""
    counts = {}
    for i, rows in chosen.items():
        codes = getattr(cache.layers[i], "codes", [])
        if len(codes) != 1:
            raise ValueError(f"exact keys are put back into one coded prompt per layer; layer {i} holds {len(codes)}")
        if codes[0].stored_exactly:
            counts[i] = 0
            continue
        rows = rows[torch.isin(rows, codes[0].coded_pos.long().cpu())]
        keys = cache.layers[i].keys
        keys[0].index_copy_(1, rows, captured.keys[i][0].index_select(1, rows).to(keys.dtype))
        counts[i] = rows.numel()
    return counts
