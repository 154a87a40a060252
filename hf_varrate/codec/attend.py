"""Attention over the codes: one sequence's decode-time attention on a compressed prompt, without
rebuilding its values (compact storage's fast read).

Shapes: query [Hq, Q, d]; exact_keys, exact_values [H, E, d] post-RoPE; tail_keys, tail_values [H, T, d]
(the tokens appended after the prefill); turns [S, d/2, 2] (`rope.rope_turns`); basis [R, D] (any float dtype);
scores and weights [H, rep * Q, N] with the query heads that share a KV head stacked (rep = Hq / H,
as `repeat_kv`).

A coded value is its anchor mean plus a projection, v_t = mean_{a in N(t)} v_a + (c_t V)_v / s_v, so

    sum_t p_t v_t = sum_a w_a v_a + ((sum_t p_t c_t) V_v) / s_v,   w_a = sum_{t: a in N(t)} p_t / |N(t)|:

the anchors are exact tokens, so their weights join the exact tokens' and the codes are read once,
as a [rep * Q, C] x [C, r] product per head. Keys are rebuilt (RoPE makes q . k_t depend on t), but
only their half of the joint vector, token-major, with each head's RoPE pairs adjacent so that the
rotation is one complex product. The result equals attention over `decode_prompt`'s reconstruction
up to float rounding.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from . import native
from .packing import PromptCode
from .pipeline import code_layout, coef_values, dense_coef_values
from .projection import DenseOrder, RankOrder, padded_basis
from .codes import QuantizedCoefs
from .quantization import dequantize_runs


def attend_codes(code: PromptCode, query, exact_keys, exact_values, tail_keys, tail_values, turns, split,
                 scaling: float, *, mask=None, softcap=None, mm_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Softmax attention of `query` over the whole prompt (coded + exact tokens) then the tail.

    `mask`: None (every prompt token visible; tail token j visible to query i iff j <= T - Q + i) or
    [Q, S + T] bool (True: attend) / additive float over the cache slots (prompt slots, then the tail),
    as the model's attention mask gives it. `turns`: the prompt positions' RoPE (cos, sin) pairs
    (`rope.rope_turns`, or `RopeMemo.turns`, which keeps them for a forward). `split`: the coding basis as
    attention reads it, (keys' half [R, H * d] with paired dims, values' half [R, H * d], the values' scales [H * d]
    or None, with the coded values divided by them): views of the coding basis with its columns in `paired_columns`
    order, as `Bases.attention_basis` keeps it. Returns [Hq, Q, d] fp32."""
    plan = code_layout(code)
    heads_q, q_len, dim = query.shape
    heads = exact_keys.shape[0]
    rows = heads_q // heads * q_len  # query rows per KV head
    coded, neighbours = code.coded_pos, code.neighbours.long()
    if isinstance(plan, RankOrder):
        coded, neighbours = coded.index_select(0, plan.order), neighbours.index_select(0, plan.order)
    exact, anchors = code.exact_pos, code.anchor_pos
    in_exact = torch.searchsorted(exact, anchors)  # anchors are exact tokens: their rows among them
    basis_k, basis_v, value_scales = split
    q = query.float().reshape(heads, rows, dim)
    pairs = _pair_order(dim, query.device)
    with record_function("varrate.attend_keys"):
        pieces = code_pieces(code, plan, mm_dtype)
        scores = torch.cat((_coded_scores(pieces, neighbours, exact_keys, in_exact, anchors, coded, turns, basis_k,
                                          q[..., pairs]),
                            torch.matmul(q, exact_keys.float().transpose(1, 2)),
                            torch.matmul(q, tail_keys.float().transpose(1, 2))), dim=-1).mul_(scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    _mask_(scores, mask, (coded, exact), code.seq_len, tail_keys.shape[1], rows // q_len)
    weights = torch.softmax(scores, dim=-1)
    n_coded, n_exact = coded.numel(), exact.numel()
    p_coded, p_exact, p_tail = weights.split((n_coded, n_exact, weights.shape[-1] - n_coded - n_exact), dim=-1)
    with record_function("varrate.attend_values"):
        _add_anchor_shares(p_coded, p_exact, neighbours, in_exact)
        out = torch.matmul(p_exact, exact_values.float()) + torch.matmul(p_tail, tail_values.float())
        mixed = _mix_codes(pieces, p_coded.reshape(heads * rows, n_coded))  # [H * rows, width]
        width = mixed.shape[1]
        values = padded_basis(basis_v, width).to(mixed.dtype)  # [width, H * d], as the codes are mixed
        values = values.view(width, heads, dim).transpose(0, 1)  # [H, width, d]
        coded_values = torch.matmul(mixed.view(heads, rows, width), values)
        if value_scales is not None:  # the coded space scaled the values: divided out once, on [H, rows, d]
            coded_values.div_(value_scales.view(heads, 1, dim))
        out += coded_values
    return out.view(heads_q, q_len, dim)


def _coded_scores(pieces, neighbours, exact_keys, in_exact, anchors, coded, turns, basis_k, q):
    """q . k_t for the coded tokens: [H, rows, C] (q [H, rows, d] paired). In one pass of `native.c` where it
    is built; else `_coded_keys`, then `_block_scores`."""
    z_anchors = _anchor_keys(exact_keys, in_exact, anchors, turns, neighbours.shape[1])
    basis = padded_basis(basis_k, max(j1 for _, _, _, j1, _ in pieces)).to(pieces[0][4].dtype)
    if native.available():
        scores = native.coded_key_scores(_projection(pieces, basis), z_anchors, neighbours, turns, coded, q)
        if scores is not None:
            return scores
    return _block_scores(_coded_keys(pieces, neighbours, z_anchors, coded, turns, basis), q)


def _add_anchor_shares(p_coded, p_exact, neighbours, in_exact) -> None:
    """Each anchor of a coded token gets its share of the token's weight (its value is their mean): added into
    p_exact in place (in one pass of `native.c` where it is built)."""
    if native.add_anchor_shares(p_coded, p_exact, neighbours, in_exact):
        return
    share = p_coded / neighbours.shape[1]
    for targets in in_exact.index_select(0, neighbours.t().reshape(-1)).view(neighbours.shape[1], -1):
        p_exact.index_add_(-1, targets, share)


def _anchor_keys(exact_keys, in_exact, anchors, turns, n_neighbours: int) -> torch.Tensor:
    """The anchors' keys [A, H * d] fp32, un-rotated, divided by `n_neighbours` (a sum of a token's anchors is
    their mean), each head's dims paired (`_pair_order`). In one pass of `native.c` where it is built."""
    fast = native.anchor_keys(exact_keys, in_exact, anchors, turns, n_neighbours)
    if fast is not None:
        return fast
    heads, _, dim = exact_keys.shape
    turn = torch.view_as_complex(turns.index_select(0, anchors))  # [A, d/2]
    undo = turn.conj() / (turn.abs().square() * n_neighbours)  # un-rotation (cos^2 + sin^2 may not be 1), / n
    anchor_keys = exact_keys.index_select(1, in_exact)[..., _pair_order(dim, anchors.device)].float()  # [H, A, d]
    z_anchors = torch.view_as_real(torch.view_as_complex(anchor_keys.view(heads, -1, dim // 2, 2)) * undo)
    return z_anchors.transpose(0, 1).reshape(-1, heads * dim)


def _projection(pieces, basis) -> torch.Tensor:
    """sum over the pieces of coefs @ basis rows: [C, H * d], written by the matmuls themselves (in the pieces'
    dtype) when each token is one piece from basis row 0, else accumulated in fp32."""
    rows = max(r1 for _, r1, _, _, _ in pieces)
    if all(j0 == 0 for _, _, j0, _, _ in pieces) and sum(r1 - r0 for r0, r1, _, _, _ in pieces) == rows:
        proj = basis.new_empty(rows, basis.shape[1])
        for r0, r1, _, j1, coefs in pieces:
            torch.mm(coefs, basis[:j1], out=proj[r0:r1])
        return proj
    proj = torch.zeros(rows, basis.shape[1], device=basis.device)
    for r0, r1, j0, j1, coefs in pieces:
        if coefs.dtype == torch.float32:
            proj[r0:r1].addmm_(coefs, basis[j0:j1])
        else:
            proj[r0:r1].add_(coefs @ basis[j0:j1])
    return proj


def _coded_keys(pieces, neighbours, z_anchors, coded, turns, basis):
    """The coded tokens' keys [C, H * d] fp32, post-RoPE, in the plan's order, each head's dims paired
    ((i, i + d/2) adjacent: `_pair_order`), so that RoPE is one complex product. `basis` is the keys' half,
    paired, padded, in the pieces' dtype; `z_anchors` from `_anchor_keys`."""
    keys = F.embedding_bag(neighbours, z_anchors, mode="sum")  # the anchor means [C, H * d]
    for r0, r1, j0, j1, coefs in pieces:
        if coefs.dtype == torch.float32:
            keys[r0:r1].addmm_(coefs, basis[j0:j1])
        else:  # bf16 operands; the keys stay fp32
            keys[r0:r1].add_(coefs @ basis[j0:j1])
    dim = turns.shape[1] * 2
    turns = torch.view_as_complex(turns.index_select(0, coded))[:, None]  # [C, 1, d/2]
    torch.view_as_complex(keys.view(keys.shape[0], -1, dim // 2, 2)).mul_(turns)
    return keys


def _block_scores(keys, q):
    """q . k for keys [C, H * d] and q [H, rows, d] (head h's queries meet head h's keys): [H, rows, C].
    One [C, H * d] x [H * d, H * rows] product with a block-diagonal right side, on the keys as laid out."""
    heads, rows, dim = q.shape
    blocks = q.new_zeros(heads, dim, heads, rows)
    for h in range(heads):
        blocks[h, :, h] = q[h].t()
    scores = keys @ blocks.view(heads * dim, heads * rows)  # [C, H * rows]
    return scores.t().view(heads, rows, -1)


def _mix_codes(pieces, weights):
    """sum_t p_t c_t for each row of weights [M, C] (coded tokens in the plan's order): [M, width] fp32,
    with the pieces' operand dtype (fp32 accumulation)."""
    mixed = weights.new_zeros(weights.shape[0], max(j1 for _, _, _, j1, _ in pieces))
    weights = weights.to(pieces[0][4].dtype)
    for r0, r1, j0, j1, coefs in pieces:
        mixed[:, j0:j1] += (weights[:, r0:r1] @ coefs).float()
    return mixed


def code_pieces(code: PromptCode, plan: RankOrder | DenseOrder, dtype: torch.dtype) -> list:
    """The coefficients as matrices in `dtype`, read once: [(r0, r1, j0, j1, coefs [r1 - r0, j1 - j0])], rows
    r0:r1 of the plan's order, basis rows j0:j1. Rank blocks (`RankOrder`); each run of equal ranks, straight
    from the stream, which holds it row-major (`DenseOrder.runs`); else the dense [C, width] matrix."""
    if isinstance(plan, RankOrder):
        return [(0, rows, j0, j1, coefs) for j0, j1, rows, coefs in plan.block_coefs(coef_values(code), dtype)]
    if plan.runs is None:
        dense = dense_coef_values(code, plan)
        return [(0, dense.shape[0], 0, plan.width, dense.to(dtype))]
    quantized = isinstance(code.coefs, QuantizedCoefs)
    stream = native.dequantize_runs(code.coefs, plan.runs, dtype, plan.width) if quantized else None
    if stream is None:
        stream = (dequantize_runs(code.coefs, plan) if quantized else code.coefs).to(dtype)
    pieces, offset = [], 0
    for first, stop, rank in plan.runs:
        pieces.append((first, stop, 0, rank, stream[offset : offset + (stop - first) * rank].view(-1, rank)))
        offset += (stop - first) * rank
    return pieces


def paired_columns(width: int, dim: int, device) -> torch.Tensor:
    """[D] column order of a basis [R, D] with each head's key dims paired (`_pair_order`), the values as they are:
    `basis[:, paired_columns(...)]` is what attention reads, and `paired_columns(...).argsort()` undoes it."""
    heads = width // 2 // dim
    keys = (torch.arange(heads, device=device)[:, None] * dim + _pair_order(dim, device)).reshape(-1)
    return torch.cat((keys, torch.arange(width // 2, width, device=device)))


@cache
def _pair_order(dim: int, device) -> torch.Tensor:
    """[d] the dims of a head with each RoPE pair (i, i + d/2) adjacent: 0, d/2, 1, d/2 + 1, ..."""
    return torch.arange(dim, device=device).view(2, dim // 2).t().reshape(-1)


def _mask_(scores, mask, prompt_slots, seq_len: int, tail: int, rep: int) -> None:
    """Apply the attention mask to scores [H, rep * Q, P + T] whose prompt columns are the slots `prompt_slots`
    (a tuple of index tensors, in order)."""
    q_len = scores.shape[1] // rep
    if mask is None:
        if q_len > 1:  # causal within the tail: query i sees tail tokens j <= T - Q + i
            i = torch.arange(q_len, device=scores.device)[:, None]
            j = torch.arange(tail, device=scores.device)[None, :]
            scores[..., scores.shape[-1] - tail :].masked_fill_((j > tail - q_len + i).repeat(rep, 1), float("-inf"))
        return
    columns = torch.cat((*prompt_slots, torch.arange(seq_len, seq_len + tail, device=scores.device)))
    picked = mask.index_select(-1, columns).repeat(rep, 1)  # [rep * Q, P + T], rows as in scores
    if picked.dtype == torch.bool:
        scores.masked_fill_(~picked, float("-inf"))
    else:
        scores.add_(picked.float())
