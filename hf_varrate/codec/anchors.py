"""Strided anchors, the recent window, and nearest-anchor residuals (Section 3.1, Eq. 2).

Shapes: S tokens, A anchors, C coded tokens, c = n_anchors, D joint width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native


def exact_mask(seq_len: int, stride: int, window: int, device=None) -> torch.Tensor:
    """[S] bool: True for the exact set E = anchors at stride `stride` from token 0, plus the last `window`."""
    mask = torch.zeros(seq_len, dtype=torch.bool, device=device)
    mask[::stride] = True
    mask[max(seq_len - window, 0) :] = True
    return mask


def exact_positions(seq_len: int, stride: int, window: int, device=None) -> torch.Tensor:
    """[E] long: the positions `exact_mask` marks, in increasing order, built from their closed form (no
    `nonzero`, whose data-dependent size reads the device back on a GPU)."""
    start = max(seq_len - window, 0)  # the recent window
    return torch.cat((torch.arange(0, start, stride, device=device), torch.arange(start, seq_len, device=device)))


def coded_positions(seq_len: int, stride: int, window: int, device=None) -> torch.Tensor:
    """[C] long: the positions `exact_mask` leaves out, in increasing order: before the window, every token
    but the multiples of `stride`, in closed form (each stride's positions after its anchor, the first C)."""
    start = max(seq_len - window, 0)
    blocks = -(-start // stride)  # the anchors before the window
    grid = torch.arange(blocks * stride, device=device).view(blocks, stride)[:, 1:]  # (k // (stride - 1) mis-compiles
    return grid.reshape(-1)[: start - blocks]  # under inductor on CPU where C is not a multiple of stride - 1)


def anchor_positions(seq_len: int, stride: int, device=None) -> torch.Tensor:
    """[A] long: positions 0, stride, 2*stride, ... (the anchors; a subset of the exact set)."""
    return torch.arange(0, seq_len, stride, device=device)


def nearest_anchors(z_coded: torch.Tensor, z_anchors: torch.Tensor, n_anchors: int, chunk: int) -> torch.Tensor:
    """[C, c] long: for each coded vector, its `n_anchors` nearest anchors (indices into z_anchors).

    Distances are fp32 and computed `chunk` coded tokens at a time, so memory is bounded by chunk x A.
    Both sets are centred on the anchors' mean first: the squared-norm expansion inside `cdist`
    then works on small norms and does not cancel (the paper's Appendix A.11 pitfall).
    """
    anchors = z_anchors.float()
    centre = anchors.mean(dim=0, keepdim=True)  # [1, D]
    anchors = anchors - centre
    k = min(n_anchors, anchors.shape[0])
    out = torch.empty(z_coded.shape[0], k, dtype=torch.long, device=z_coded.device)
    for start in range(0, z_coded.shape[0], chunk):
        block = z_coded[start : start + chunk].float() - centre  # [chunk, D]
        dist = torch.cdist(block, anchors)  # [chunk, A], fp32
        out[start : start + chunk] = dist.topk(k, dim=-1, largest=False).indices
    return out


def anchor_means(z_anchors: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """[C, D] fp32: the mean of each coded token's anchors, z-bar_t in Eq. 2."""
    return z_anchors.float()[neighbours].mean(dim=1)  # [C, c, D] -> [C, D]


def residuals(z_coded: torch.Tensor, z_anchors: torch.Tensor, n_anchors: int, chunk: int):
    """Eq. 2: e_t = z_t - mean of its c nearest anchors. Returns (e [C, D] fp32, neighbours [C, c])."""
    neighbours = nearest_anchors(z_coded, z_anchors, n_anchors, chunk)
    return z_coded.float() - anchor_means(z_anchors, neighbours), neighbours


def nearest_anchors_mm(z_coded: torch.Tensor, z_anchors: torch.Tensor, n_anchors: int, chunk: int) -> torch.Tensor:
    """The fast path's `nearest_anchors`: [C, c] long, the same neighbours up to fp32 near-ties.

    Ranks anchors by |b - m|^2 - 2 (z - m).(b - m), which is |z - b|^2 minus a per-row constant:
    one fp32 matmul per chunk of `chunk` rows, no sqrt, no clamp, memory bounded by chunk x A.
    Centring on the anchors' mean m keeps the expansion free of cancellation (Appendix A.11); it
    is never evaluated in half precision. On CPU the k smallest of each row come from a C loop
    (`native.smallest_columns`: the same anchors in the same order).
    """
    anchors = z_anchors.float()
    centre = anchors.mean(dim=0, keepdim=True)  # [1, D]
    anchors = anchors - centre
    bias = anchors.square().sum(dim=-1)  # [A]
    k = min(n_anchors, anchors.shape[0])
    out = torch.empty(z_coded.shape[0], k, dtype=torch.long, device=z_coded.device)
    for start in range(0, z_coded.shape[0], chunk):
        block = z_coded[start : start + chunk].float() - centre  # [chunk, D]
        score = torch.addmm(bias, block, anchors.T, alpha=-2.0)  # [chunk, A], fp32
        fast = native.smallest_columns(score, k)
        out[start : start + chunk] = fast if fast is not None else score.topk(k, dim=-1, largest=False).indices
    return out


def gather_means(z_anchors: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """[C, D] fp32 anchor means, z-bar_t, in one fused gather-and-average (an embedding bag of c
    rows per token) instead of materialising [C, c, D]."""
    return F.embedding_bag(neighbours.long(), z_anchors.float(), mode="mean")
