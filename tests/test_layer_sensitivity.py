"""Per-layer budgets from measured sensitivity (layer_budgets="measured"), on tiny models: the knapsack that picks
one budget scale per layer at the uniform bytes, the measurement that writes the curves into the bases, and the
cache that codes with them."""

import math
import warnings

import pytest
import torch

from hf_varrate import Bases, VarRateCache, VarRateConfig, bound
from hf_varrate.codec.layer_budget import measured_scales
from hf_varrate.errors import BasesError, VarRateWarning

LEVELS = [0.5, 1.0, 1.5, 2.0]
FLAT = [0.01, 0.01, 0.01, 0.01]  # a layer that barely cares
STEEP = [1.0, 0.5, 0.2, 0.1]


def test_the_allocation_keeps_the_mean_at_one_and_gives_budget_where_it_removes_most_kl():
    scales = measured_scales({0: FLAT, 1: STEEP, 2: FLAT, 3: list(STEEP)}, LEVELS)
    assert sum(scales.values()) == pytest.approx(len(scales))  # the same bytes as uniform
    assert scales[1] == scales[3] == 1.5 and scales[0] == scales[2] == 0.5
    picked = measured_scales({i: list(STEEP) for i in range(3)}, LEVELS)  # equal convex curves
    assert sum(STEEP[LEVELS.index(picked[i])] for i in range(3)) <= 3 * STEEP[1]


def test_a_float_layer_share_scales_the_coefficient_budget():
    from hf_varrate.codec.pipeline import _layout

    keys, basis = torch.randn(1, 2, 512, 16), torch.eye(64)
    config = VarRateConfig(budget=0.2)
    _, _, total = _layout(keys, basis, config)
    _, _, half = _layout(keys, basis, config, 0.5)
    _, _, same = _layout(keys, basis, config, 1.0)
    assert total > 0 and same == total and half == math.floor(total * 0.5)


def tiny_bases(model_config, curves: dict | None = None) -> Bases:
    """Identity bases with a short window (so a 400-token prompt is mostly coded), measured at 0.3 if `curves`."""
    bases = Bases.identity(model_config)
    bases.metadata.update(stride=16, window=16, n_anchors=4)
    if curves is not None:
        bases.metadata["layer_sensitivity"] = {"levels": LEVELS, "kl": {"0.3": {str(i): c for i, c in curves.items()}}}
    return bases


def coded_ranks(model, bases, ids, **settings) -> tuple[list[int], VarRateCache]:
    cache = VarRateCache(bases, model=model, budget=0.3, signal="uniform", r_min=4, window=16, **settings)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    cache.compress()
    return [int(cache.layers[i].codes[0].ranks.long().sum()) for i in (0, 1)], cache


def test_measured_layer_budgets_move_rank_to_the_sensitive_layer_at_the_same_bytes(tiny_llama):
    bases = tiny_bases(tiny_llama.config, {0: FLAT, 1: STEEP})
    ids = torch.randint(2, 128, (1, 400), generator=torch.Generator().manual_seed(0))
    uniform, _ = coded_ranks(tiny_llama, bases, ids)
    measured, cache = coded_ranks(tiny_llama, bases, ids, layer_budgets="measured")
    assert measured[1] > uniform[1] and measured[0] < uniform[0]
    assert sum(measured) <= sum(uniform)  # moved, not added
    assert cache.footprint().prompt_fraction <= 0.3 + 1e-9
    assert bases.spaces.measured_scales(0.3) == {0: 0.5, 1: 1.5}


def test_measured_layer_budgets_need_a_measurement_and_warn_far_from_it(tiny_llama):
    ids = torch.randint(2, 128, (1, 400), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="layer_sensitivity.*hf-varrate measure-layers.*layer_budgets='uniform'"):
        coded_ranks(tiny_llama, tiny_bases(tiny_llama.config), ids, layer_budgets="measured")
    bases = tiny_bases(tiny_llama.config, {0: FLAT, 1: STEEP})
    with pytest.warns(VarRateWarning, match=r"measured at budgets \['0.3'\]; budget=0.1 uses the scales of 0.3"):
        bases.spaces.measured_scales(0.1)
    with warnings.catch_warnings():  # near a measured budget: no warning
        warnings.simplefilter("error", VarRateWarning)
        assert bases.spaces.measured_scales(0.25) == bases.spaces.measured_scales(0.3)


def test_measured_scales_are_looked_up_at_the_bytes_the_budget_buys_in_the_measurements_dtype(tiny_llama):
    # measured in fp16 bytes at 0.3 and 0.6; this fp32 cache at 0.3 counted in its own bytes buys 0.6's
    bases = tiny_bases(tiny_llama.config)
    bases.metadata["layer_sensitivity"] = {"levels": LEVELS, "settings": {"budget_dtype": "float16"}, "kl": {
        "0.3": {"0": STEEP, "1": FLAT}, "0.6": {"0": FLAT, "1": STEEP}}}
    assert bases.spaces.measured_scales(0.3, torch.float32) == {0: 0.5, 1: 1.5}
    assert bases.spaces.measured_scales(0.3, torch.float16) == {0: 1.5, 1: 0.5}
    assert bases.spaces.measured_scales(0.3) == {0: 1.5, 1: 0.5}  # no dtype given: as measured
    ids = torch.randint(2, 128, (1, 400), generator=torch.Generator().manual_seed(0))
    ranks = {}
    for counted in (None, "float16"):
        cache = VarRateCache(bases, model=tiny_llama, budget=0.3, signal="uniform", r_min=4, window=16,
                             layer_budgets="measured", budget_dtype=counted)
        with torch.no_grad():
            tiny_llama(input_ids=ids, past_key_values=cache)
        cache.compress()
        ranks[counted] = [int(cache.layers[i].codes[0].ranks.long().sum()) for i in (0, 1)]
    assert ranks[None][1] > ranks[None][0] and ranks["float16"][0] > ranks["float16"][1]
    with pytest.warns(VarRateWarning, match=r"budget=0.9 counted in torch.float32 \(1.8 in float16\)"):
        bases.spaces.measured_scales(0.9, torch.float32)


def test_measurement_writes_curves_that_survive_a_save_and_drive_the_cache(tiny_gemma3, tmp_path):
    from hf_varrate.calibration.sensitivity import measure_sensitivity, write_measurement
    from hf_varrate.codec.layer_budget import recorded_scales

    bases = tiny_bases(tiny_gemma3.config)
    contexts = [torch.randint(2, 128, (400,), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    measured = measure_sensitivity(tiny_gemma3, bases, contexts, [0.3], probe=32, preset="paper", r_min=4,
                                   signal="uniform", progress=False, metadata={"data": "random ids"})
    curves = measured["kl"]["0.3"]
    assert set(curves) == {"1", "3"} and all(len(row) == 4 and min(row) >= 0 for row in curves.values())
    assert sum(row[0] for row in curves.values()) > sum(row[-1] for row in curves.values())  # less budget, more KL
    assert measured["settings"] == {"budget_dtype": "float16", "r_min": 4, "signal": "uniform"}
    assert measured["data"] == "random ids" and measured["context_length"] == 400
    folder = bases.save_pretrained(tmp_path / "bases", dtype=torch.float32)
    tensors = (folder / "bases.safetensors").read_bytes()
    write_measurement(folder, measured)
    assert (folder / "bases.safetensors").read_bytes() == tensors  # only config.json and the card change
    loaded = Bases.from_pretrained(folder)
    assert loaded.metadata["layer_sensitivity"] == measured
    scales = recorded_scales(measured)["0.3"]
    assert sum(scales.values()) == pytest.approx(2) and loaded.spaces.measured_scales(0.3) == scales
    card = (tmp_path / "bases" / "README.md").read_text()
    assert "measured per-layer budget scales at 0.3" in card
    footprints = {}
    for mode in ("uniform", "measured"):
        cache = VarRateCache(loaded, model=tiny_gemma3, budget=0.3, r_min=4, window=16, layer_budgets=mode)
        with bound(tiny_gemma3), torch.no_grad():
            tiny_gemma3(input_ids=contexts[0][None], past_key_values=cache)
        footprints[mode] = cache.footprint().bytes
    assert footprints["measured"] <= footprints["uniform"] * 1.01  # bytes moved between layers, not added


def test_a_level_that_cannot_be_coded_is_an_error_not_a_free_choice(tiny_llama):
    from hf_varrate.calibration.sensitivity import measure_sensitivity

    contexts = [torch.randint(2, 128, (400,), generator=torch.Generator().manual_seed(1))]
    with pytest.raises(ValueError, match="layer 0 could not be coded.*levels >= 1"), pytest.warns(VarRateWarning):
        measure_sensitivity(tiny_llama, tiny_bases(tiny_llama.config), contexts, [0.3], levels=[0.05, 1.0], probe=16,
                            preset="paper", r_min=16, progress=False)


@pytest.mark.parametrize("field, message", [
    ({"levels": [0.5, 2.0], "kl": {"0.3": {"0": [0, 0], "1": [0, 0]}}}, "layer_sensitivity.levels"),
    ({"levels": LEVELS, "kl": {"0.3": {"0": FLAT}}}, r"layer_sensitivity.kl\['0.3'\] must map every compressed layer"),
    ({"levels": LEVELS, "kl": {"1.5": {"0": FLAT, "1": FLAT}}}, "budget must be in"),
    ({"levels": LEVELS, "kl": {"0.3": {"0": FLAT, "1": [0.1, -1, 0, 0]}}}, "finite KLs >= 0"),
])
def test_a_bad_layer_sensitivity_field_is_named(tiny_llama, tmp_path, field, message):
    bases = tiny_bases(tiny_llama.config)
    bases.metadata["layer_sensitivity"] = field
    with pytest.raises(BasesError, match=message):
        bases.save_pretrained(tmp_path / "bases")


def test_the_command_is_listed_and_documents_itself(capsys):
    from hf_varrate.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["measure-layers", "--help"])
    assert exit_info.value.code == 0
    assert "hf-varrate measure-layers" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "measure-layers" in capsys.readouterr().out


def test_the_command_refuses_what_is_not_a_bases_folder(tmp_path):
    from hf_varrate.cli import main

    with pytest.raises(SystemExit, match="is not a bases folder.*copy shipped or downloaded bases into one first"):
        main(["measure-layers", str(tmp_path / "nowhere"), "--model", "smollm2-135m-instruct"])


def test_scaling_layers_for_a_measurement_leaves_the_bases_as_found_even_on_error(tiny_llama):
    # the evaluation's all-layers check once replaced layer_share for good, so the bases it had been handed
    # went on coding every later cache at the last scales tried
    from evaluation.capture import capture, full_attention_layers
    from evaluation.layer_sensitivity import reconstructed
    from hf_varrate.calibration.sensitivity import layers_scaled

    bases = tiny_bases(tiny_llama.config)
    with pytest.raises(RuntimeError), layers_scaled(bases, lambda i: 2.0):
        assert bases.layer_share(0, None) == 2.0
        raise RuntimeError
    assert "layer_share" not in vars(bases)
    ids = torch.randint(2, 128, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    config = VarRateConfig(budget=0.3, signal="uniform", r_min=4, window=16)
    keys, _ = reconstructed(bases, config, tiny_llama, capture(tiny_llama, ids), lambda i: 0.5,
                            full_attention_layers(tiny_llama))
    assert set(keys) == {0, 1} and "layer_share" not in vars(bases)


def test_prefills_that_read_no_logits_compute_only_the_last_positions(tiny_llama):
    # all of a prefill's logits are [tokens, vocabulary]: on Gemma-3 at 4K, 4.3 GB and half the prefill's time
    from transformers import DynamicCache

    from hf_varrate.calibration.sensitivity import measure_sensitivity
    from hf_varrate.demo import prefill

    rows = []
    hook = tiny_llama.lm_head.register_forward_hook(lambda module, args, out: rows.append(out.shape[-2]))
    try:
        prefill(tiny_llama, DynamicCache(config=tiny_llama.config), [2 + i % 120 for i in range(300)])
        assert rows == [1]
        rows.clear()
        contexts = [torch.randint(2, 128, (400,), generator=torch.Generator().manual_seed(1))]
        measure_sensitivity(tiny_llama, tiny_bases(tiny_llama.config), contexts, [0.3], levels=[1.0], probe=32,
                            preset="paper", r_min=4, signal="uniform", progress=False)
    finally:
        hook.remove()
    assert rows and set(rows) <= {1, 32}  # the prefills' last position, the probe read back


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gemma3"])
def test_read_backs_that_reuse_the_layers_below_the_swap_give_the_same_curves(request, fixture, monkeypatch):
    from contextlib import nullcontext

    from hf_varrate.calibration import sensitivity

    model = request.getfixturevalue(fixture)
    bases = tiny_bases(model.config)
    contexts = [torch.randint(2, 128, (400,), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    settings = dict(levels=[0.5, 1.0], probe=32, preset="paper", r_min=4, signal="uniform", progress=False)
    calls = []
    first = model.get_decoder().layers[0]
    first.mlp.register_forward_pre_hook(lambda module, args: calls.append(1))  # runs only when the layer does
    reused = sensitivity.measure_sensitivity(model, bases, contexts, [0.3], **settings)["kl"]
    calls_reused, calls[:] = len(calls), []
    monkeypatch.setattr(sensitivity, "_decoder_layers_replayed", lambda *args: nullcontext())
    whole = sensitivity.measure_sensitivity(model, bases, contexts, [0.3], **settings)["kl"]
    assert reused == whole  # to the 6 decimals recorded
    assert calls_reused < len(calls)  # the first layer was skipped where a higher one was swapped
    assert "forward" not in vars(first)  # the layers are left as found
