"""What one sequence's compressed prompt holds, and how many bytes that is.

Shapes: S valid prompt tokens, E exact, C coded, c anchors per coded token, H kv heads, d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PromptCode:
    """One sequence's prompt after compression (one layer).

    `exact_pos` / `coded_pos` / `anchor_pos` follow from (S, stride, window) and are not charged;
    `neighbours`, `ranks` and `coefs` are the codes; `exact_keys` / `exact_values` are only held
    here in compact storage (materialized storage keeps them inside the full-length tensors).
    """

    seq_len: int
    exact_pos: torch.Tensor  # [E] long
    coded_pos: torch.Tensor  # [C] long
    anchor_pos: torch.Tensor  # [A] long
    neighbours: torch.Tensor  # [C, c] small int, indices into anchor_pos
    ranks: torch.Tensor  # [C] small int
    coefs: torch.Tensor  # [sum(ranks)] storage dtype
    width: int  # D
    kv_bytes: int  # bytes per element of the model's K/V
    stored_exactly: bool = False
    exact_keys: torch.Tensor | None = field(default=None, repr=False)  # [H, E, d]
    exact_values: torch.Tensor | None = field(default=None, repr=False)  # [H, E, d]

    def nbytes(self, limit: int | None = None) -> int:
        """Bytes this prompt costs: exact tokens at full width plus every coded token's codes.

        `limit` counts only the first `limit` tokens (after a crop into the prompt); without it the
        result equals the bytes of the tensors this code holds (plus the exact tokens).
        """
        limit = self.seq_len if limit is None else max(min(limit, self.seq_len), 0)
        n_exact = int((self.exact_pos < limit).sum())
        exact = n_exact * self.width * self.kv_bytes
        if self.stored_exactly:
            return exact
        keep = self.coded_pos < limit
        per_token = self.neighbours.shape[1] * self.neighbours.element_size() + self.ranks.element_size()
        coefs = int(self.ranks[keep].long().sum()) * self.coefs.element_size()
        return exact + int(keep.sum()) * per_token + coefs

    def full_nbytes(self) -> int:
        """Bytes the same prompt takes uncompressed in the same dtype."""
        return self.seq_len * self.width * self.kv_bytes


def smallest_uint(max_value: int) -> torch.dtype:
    """The narrowest integer dtype that holds 0..max_value (torch has no uint16 arithmetic, so int16)."""
    if max_value < 256:
        return torch.uint8
    if max_value < 2**15:
        return torch.int16
    return torch.int32


def meta_bytes_per_token(n_anchors: int, num_anchors: int, rank: int) -> int:
    """Bytes of side information per coded token: its anchor indices and its rank."""
    index_bytes = torch.empty(0, dtype=smallest_uint(num_anchors - 1)).element_size()
    rank_bytes = torch.empty(0, dtype=smallest_uint(rank)).element_size()
    return n_anchors * index_bytes + rank_bytes
