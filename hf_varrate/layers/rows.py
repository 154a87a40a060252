"""One sequence of a batched prefill: its real (non-padding) tokens' slots and tensors.

A batch's rows may be left-padded; VarRate codes each row's real tokens alone. A row's slots are a
(start, stop) span when they are contiguous (no copy), else a LongTensor of slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Row:
    """One sequence's prefill inputs: its real tokens' slots and tensors (padding removed)."""

    span: tuple[int, int] | torch.Tensor  # (start, stop) slots, or the slots themselves if not contiguous
    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def row_inputs(context, b: int, keys, values) -> Row:
    """Row b's real tokens, from a `PrefillContext` and the prefill's keys / values [B, H, S, d]."""
    seq_len = keys.shape[-2]
    cos, sin = batch_row(context.cos, b), batch_row(context.sin, b)
    if context.key_valid is None:
        span = (0, seq_len)
    else:
        slots = context.key_valid[b].nonzero()[:, 0].to(keys.device)
        contiguous = slots.numel() == 0 or int(slots[-1] - slots[0]) + 1 == slots.numel()
        span = (int(slots[0]), int(slots[-1]) + 1) if contiguous and slots.numel() else slots
        if slots.numel() == 0:
            span = (seq_len, seq_len)
    pick = slice(*span) if isinstance(span, tuple) else span
    k, v, c, s = keys[b : b + 1, :, pick], values[b : b + 1, :, pick], cos[:, pick], sin[:, pick]
    queries = batch_row(context.queries, b)
    n = k.shape[-2]
    queries = queries[:, :, -min(queries.shape[2], n) :] if n else queries[:, :, :0]
    return Row(span, k, v, queries, c, s)


def batch_row(tensor: torch.Tensor, b: int) -> torch.Tensor:
    """Row b of a [B or 1, ...] tensor, keeping the batch dim (cos/sin may be shared across rows)."""
    return tensor[b : b + 1] if tensor.shape[0] > 1 else tensor


def slots_of(span, device) -> torch.Tensor:
    """The cache slots [n] long of a span."""
    if isinstance(span, tuple):
        return torch.arange(*span, device=device)
    return span.to(device)


def covers(span, kept: int) -> bool:
    """Whether `span` is exactly the first `kept` slots."""
    return isinstance(span, tuple) and span == (0, kept)


def place(target: torch.Tensor, span, rows: torch.Tensor) -> None:
    """target[:, :, span] = rows, for target [1, H, S, d]."""
    if isinstance(span, tuple):
        target[:, :, span[0] : span[1]] = rows
    else:
        target[:, :, span] = rows


def magnitude(*tensors: torch.Tensor) -> float:
    """The largest |x| over `tensors` (NaN if any holds a NaN, inf if any an inf; 0.0 if all are empty), in two
    passes each (amax propagates NaN) instead of isfinite's four, and one read back."""
    peaks = [t.abs().amax().float() for t in tensors if t.numel()]
    return float(torch.stack(peaks).amax()) if peaks else 0.0
