"""The evaluation-only key-weighted energy ranks (evaluation/methods/key_energy.py): with the value half weighted
1 they are the library's ranks, with 0 they follow the tokens whose keys, not values, carry the energy, and the
codec's functions are restored afterwards."""

from __future__ import annotations

import pytest
import torch

from evaluation.methods import key_energy as ke
from hf_varrate import VarRateConfig
from hf_varrate.codec import pipeline
from hf_varrate.codec.pipeline import compress_prompt

from test_codec import make_prompt


def loud_prompt():
    """Every 5th token has loud keys, every 5th (offset 2) loud values; the rest are plain."""
    keys, values, queries, cos, sin = make_prompt(seq_len=600)
    loud_keys, loud_values = torch.arange(600) % 5 == 0, torch.arange(600) % 5 == 2
    keys[:, :, loud_keys] *= 6
    values[:, :, loud_values] *= 6
    return (keys, values, queries, cos, sin), loud_keys, loud_values


def ranks_of(prompt, basis):
    config = VarRateConfig(budget=0.4, r_min=2, signal="uniform", allocation="distortion", window=16, stride=64)
    code, _, _ = compress_prompt(*prompt, basis, config, scaling=0.25)
    return code.coded_pos, code.ranks.long()


def test_the_component_weights_split_each_row_into_its_key_and_value_halves():
    basis = torch.tensor([[3.0, 4.0, 0.0, 0.0], [0.0, 1.0, 2.0, 2.0]])
    assert torch.equal(ke.component_weights(basis, 0.0), torch.tensor([25.0, 1.0]))
    assert torch.equal(ke.component_weights(basis, 0.5), torch.tensor([25.0, 5.0]))


def test_weight_1_is_the_library_and_weight_0_ranks_by_the_keys():
    prompt, loud_keys, loud_values = loud_prompt()
    order = torch.stack((torch.arange(32), torch.arange(32, 64)), 1).reshape(-1)
    basis = torch.eye(64)[order]  # components either all key or all value, alternating
    positions, library = ranks_of(prompt, basis)
    with ke.key_energy(1.0):
        _, joint = ranks_of(prompt, basis)
    assert torch.equal(joint, library)
    with ke.key_energy(0.0):
        same_positions, keyed = ranks_of(prompt, basis)
    assert torch.equal(same_positions, positions) and int(keyed.sum()) == int(library.sum())
    by_keys, by_values = loud_keys[positions], loud_values[positions]
    # the library gives loud values as much as loud keys; read on the keys, loud values fall to plain tokens' rank
    assert library[by_values].float().mean() > library[~(by_keys | by_values)].float().mean() + 4
    assert keyed[by_keys].float().mean() > keyed[by_values].float().mean() + 4
    assert keyed[by_keys].float().mean() > library[by_keys].float().mean()


def test_the_codec_is_restored_and_a_bad_weight_is_refused():
    encode, ranks = pipeline.encode, pipeline.distortion_ranks
    with pytest.raises(RuntimeError):
        with ke.key_energy(0.0):
            assert pipeline.encode is not encode
            raise RuntimeError
    assert pipeline.encode is encode and pipeline.distortion_ranks is ranks
    with pytest.raises(ValueError, match=r"eval_energy_value_weight=1\.5.*\[0, 1\]"):
        with ke.key_energy(1.5):
            pass


def test_a_spec_without_the_energy_allocation_is_refused():
    from evaluation.methods.varrate import VarRateMethod

    with pytest.raises(ValueError, match="eval_energy_value_weight.*allocation: distortion"):
        VarRateMethod("keys", {"kind": "varrate", "eval_energy_value_weight": 0.0})
