"""Per-token salience (Section 3.2, Eq. 4), the paper's control signals, and the signals beyond it.

Each signal is one function from `SignalInputs` to the normalised salience s-hat [C] in [0, 1] of the
coded tokens, registered under its name with `@register_signal(name, ...)` (`hf_varrate.signals`).
Adding a signal is that function, its registry entry (the decorator) and its test: nothing else changes.

Shapes: queries [1, Hq, W, d] (the last W prompt queries, post-RoPE), keys [1, H, S, d] (post-RoPE),
scores [S], coded [C] long, residuals [C, D]. SnapKV scores are computed in the model's dtype, as
SnapKV does: the allocation downstream sees the same rounding the reference saw (Appendix A.11 pitfall).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..signals import SignalInputs, register_signal


def snapkv_scores(queries: torch.Tensor, keys: torch.Tensor, scaling: float, pool_kernel: int) -> torch.Tensor:
    """[S] attention the window places on each token, averaged over window queries and all query heads.

    The window is the tail of the prompt, so window query i sits at position S - W + i and sees keys
    up to it (causal). GQA: each KV head serves Hq / H query heads. Then SnapKV's moving average.
    """
    _, num_q_heads, window, dim = queries.shape
    _, num_kv_heads, seq_len, _ = keys.shape
    groups = num_q_heads // num_kv_heads
    q = queries.reshape(num_kv_heads, groups * window, dim)  # [H, G*W, d]
    logits = torch.matmul(q, keys[0].transpose(-1, -2).to(q.dtype)) * scaling  # [H, G*W, S]
    logits = logits.view(num_kv_heads, groups, window, seq_len)
    # causal: only the window's own columns can lie in a query's future, so only they are masked
    future = torch.ones(window, window, dtype=torch.bool, device=keys.device).triu(1)  # [W, W]
    logits[..., seq_len - window :].masked_fill_(future, float("-inf"))
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(queries.dtype)
    scores = weights.mean(dim=(0, 1, 2))  # [S], model dtype
    return pool_scores(scores, pool_kernel)


def pool_scores(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """SnapKV's clustering step: a length-`kernel` moving average over adjacent tokens."""
    if kernel <= 1:
        return scores
    return F.avg_pool1d(scores[None, None], kernel, stride=1, padding=kernel // 2)[0, 0]


def position_scores(seq_len: int, stride: int, window: int, device=None) -> torch.Tensor:
    """[S] the 'position' control: an attention-sink bump plus a recency ramp, no content at all."""
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    sink = torch.exp(-pos / stride)
    recency = torch.exp(-(seq_len - 1 - pos) / window)
    return sink + recency


def minmax(scores: torch.Tensor) -> torch.Tensor:
    """Min-max normalise to [0, 1] in fp32; a constant (or non-finite) signal becomes all ones (flat)."""
    s = torch.nan_to_num(scores.float(), nan=0.0, posinf=0.0, neginf=0.0)
    if s.numel() == 0:
        return s
    low, high = s.min(), s.max()
    if not bool(high > low):
        return torch.ones_like(s)
    if not bool(torch.isfinite(high - low)):  # the span overflows fp32 (scores near its max): halve (exact for normals)
        s, low, high = s / 2, low / 2, high / 2
    return (s - low) / (high - low)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


@register_signal("snapkv", query_aware=True, paper=True)
def snapkv_signal(x: SignalInputs) -> torch.Tensor:
    """The paper's salience: attention from the prompt's last queries (Eq. 4), min-max over the coded tokens."""
    return minmax(snapkv_scores(x.queries, x.keys, x.scaling, x.pool_kernel)[x.coded])


@register_signal("uniform", paper=True)
def uniform_signal(x: SignalInputs) -> torch.Tensor:
    """A constant: every coded token gets the flat rank (the paper's flat ablation)."""
    return torch.ones(x.coded.numel(), device=x.coded.device)


@register_signal("random", paper=True)
def random_signal(x: SignalInputs) -> torch.Tensor:
    """Uniform noise, seeded (a control)."""
    return torch.rand(x.coded.numel(), generator=_generator(x.seed)).to(x.coded.device)


@register_signal("shuffle", query_aware=True, paper=True)
def shuffle_signal(x: SignalInputs) -> torch.Tensor:
    """SnapKV's scores permuted: same marginal, alignment destroyed (Appendix A.17)."""
    s_hat = snapkv_signal(x)
    return s_hat[torch.randperm(s_hat.numel(), generator=_generator(x.seed)).to(s_hat.device)]


@register_signal("position", paper=True)
def position_signal(x: SignalInputs) -> torch.Tensor:
    """An attention-sink bump plus a recency ramp: position alone, no content (a control)."""
    return minmax(position_scores(x.seq_len, x.stride, x.window, x.coded.device)[x.coded])


@register_signal("key_norm")
def key_norm_signal(x: SignalInputs) -> torch.Tensor:
    """Query-agnostic: the mean key norm over heads (RoPE keeps norms)."""
    return minmax(x.keys[0].float().norm(dim=-1).mean(dim=0)[x.coded])


@register_signal("residual", after_anchors=True)
def residual_signal(x: SignalInputs) -> torch.Tensor:
    """Query-agnostic: the norm of the token's residual to its anchors (rank follows how hard it is to code)."""
    return minmax(x.residuals.norm(dim=1))


def attention_scale(module) -> float:
    """The softmax scale the attention module uses (Gemma-3 sets its own via query_pre_attn_scalar)."""
    scale = getattr(module, "scaling", None)
    return float(scale) if scale is not None else 1.0 / math.sqrt(module.head_dim)
