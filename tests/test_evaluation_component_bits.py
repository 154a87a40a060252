"""The evaluation-only rewrite behind round 9 (evaluation/methods/component_bits.py): it spends no more than the
bytes it is given (the codec's coefficient bytes), and more bytes lose less."""

from __future__ import annotations

import pytest
import torch

from evaluation.methods import component_bits as cb


def decaying(rows=300, width=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g) * 10 * 0.95 ** torch.arange(width)


@pytest.mark.parametrize("mode", cb.MODES)
@pytest.mark.parametrize("spend", [500.0, 5_000.0, 20_000.0])
def test_the_rewrite_spends_at_most_the_bytes_it_is_given(mode, spend):
    coefs = decaying()
    out = cb.recoded(coefs, mode, 3, 64, spend)
    cost = cb.column_bytes(coefs.shape[0], 64)
    if mode == "per_component":
        kept = int((out != 0).any(0).sum())
        assert kept * float(cost[cb.BITS.index(3)]) <= spend
    else:
        pick = cb.best_bits(cb.column_errors(coefs, 64), cost, spend)
        assert float(cost[pick].sum()) <= spend
    assert float((out - coefs).square().sum()) < float(coefs.square().sum())


def test_more_bytes_lose_less():
    coefs = decaying()
    lost = [float((cb.recoded(coefs, "per_component_best", 3, 64, spend) - coefs).square().sum())
            for spend in (1_000.0, 5_000.0, 20_000.0)]
    assert lost == sorted(lost, reverse=True)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="eval_coefs='per_head'"):
        cb.rewrite(None, None, None, None, "per_head")


def test_a_partial_last_group_is_quantized_as_if_alone():
    """Padding by repeating the last row adds no range: the last 10 rows of 74 (groups of 64) decode as those 10
    rows would on their own, with both quantizers (min and step; the study's mean-and-deviation levels)."""
    from studies.coefficient_bits import leveled_columns

    coefs = torch.randn(74, 6, generator=torch.Generator().manual_seed(0)).abs() + 1  # zero padding would widen
    blocks = cb.column_blocks(coefs, 64)
    assert blocks.shape == (2, 64, 6) and torch.equal(blocks.view(-1, 6)[:74], coefs)
    assert torch.equal(blocks[1, 10:], coefs[-1:].expand(54, 6))
    torch.testing.assert_close(cb.quantize_columns(coefs, 3, 64)[64:], cb.quantize_columns(coefs[64:], 3, 10))
    zero_padded = cb.quantize_columns(torch.cat((coefs[64:], torch.zeros(1, 6))), 3, 11)[:10]
    assert not torch.allclose(cb.quantize_columns(coefs, 3, 64)[64:], zero_padded)
    assert leveled_columns(coefs, 64).shape == coefs.shape
