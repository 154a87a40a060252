"""The measured per-layer budgets experiment (evaluation/layer_sensitivity.py): the knapsack that picks one
budget scale per layer at the uniform bytes, and the float `layer_share` the codec scales its budget by."""

import math

import pytest
import torch

from hf_varrate import VarRateConfig


def test_the_allocation_keeps_the_mean_at_one_and_gives_budget_where_it_removes_most_kl():
    from evaluation.layer_sensitivity import allocate

    levels = [0.5, 1.0, 1.5, 2.0]
    flat = {s: 0.01 for s in levels}  # a layer that barely cares
    steep = {0.5: 1.0, 1.0: 0.5, 1.5: 0.2, 2.0: 0.1}
    scales = allocate({0: flat, 1: steep, 2: flat, 3: dict(steep)}, levels)
    assert sum(scales.values()) == pytest.approx(len(scales))  # the same bytes as uniform
    assert scales[1] == scales[3] == 1.5 and scales[0] == scales[2] == 0.5
    convex = {i: dict(steep) for i in range(3)}  # equal convex curves: nothing beats the uniform scales
    picked = allocate(convex, levels)
    assert sum(steep[picked[i]] for i in range(3)) <= 3 * steep[1.0]


def test_a_float_layer_share_scales_the_coefficient_budget():
    from hf_varrate.codec.pipeline import _layout

    keys, basis = torch.randn(1, 2, 512, 16), torch.eye(64)
    config = VarRateConfig(budget=0.2)
    _, _, total = _layout(keys, basis, config)
    _, _, half = _layout(keys, basis, config, 0.5)
    _, _, same = _layout(keys, basis, config, 1.0)
    assert total > 0 and same == total and half == math.floor(total * 0.5)
