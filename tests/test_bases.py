"""Bases artifacts: exact round trips, integrity (sha256), and a clear BasesError for every bad input."""

from __future__ import annotations

import hashlib
import json
import time
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from hf_varrate import Bases, BasesError, VarRateCache, unbind
from hf_varrate.bases import BUILD_HINT, CONFIG_NAME, WEIGHTS_NAME, looks_local, read_artifact
from hf_varrate.card import render_card
from hf_varrate.errors import VarRateWarning

WIDTH = 64  # the tiny models' D = 2 * 2 heads * 16
META = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "width": WIDTH, "compressed_layers": [0, 1],
        "rank": 8, "model_id": "tiny/llama", "stride": 16, "window": 64, "n_anchors": 4}


def orthonormal(rank: int, width: int = WIDTH, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(width, rank, generator=g, dtype=torch.float64))
    return q.T.float().contiguous()  # [rank, width]


def write_artifact(folder, tensors: dict[str, torch.Tensor], meta: dict, sha: str | None = "auto"):
    """A bases folder written by hand, with a correct sha256 unless told otherwise."""
    folder.mkdir(parents=True, exist_ok=True)
    blob = save(tensors)
    (folder / WEIGHTS_NAME).write_bytes(blob)
    record = dict(meta)
    if sha is not None:
        record["sha256"] = {WEIGHTS_NAME: hashlib.sha256(blob).hexdigest() if sha == "auto" else sha}
    (folder / CONFIG_NAME).write_text(json.dumps(record))
    return folder


def good_tensors(rank: int = 8) -> dict[str, torch.Tensor]:
    return {"layers.0": orthonormal(rank, seed=0), "layers.1": orthonormal(rank, seed=1)}


# round trips ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_save_load_round_trip_is_exact(tmp_path, dtype):
    bases = Bases.from_tensors({0: orthonormal(8, seed=0), 1: orthonormal(8, seed=1)}, **META)
    bases.save_pretrained(tmp_path, dtype=dtype)
    loaded = Bases.from_pretrained(tmp_path)
    for i, tensor in bases.tensors.items():
        assert loaded.tensors[i].dtype == dtype
        assert torch.equal(loaded.tensors[i], tensor.to(dtype))
    assert {k: loaded.metadata[k] for k in META} == META
    assert loaded.metadata["dtype"] == str(dtype).removeprefix("torch.")
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert list(config) == sorted(config)
    assert config["sha256"][WEIGHTS_NAME] == hashlib.sha256((tmp_path / WEIGHTS_NAME).read_bytes()).hexdigest()


def test_identity_round_trip_and_load_into_the_cache(tmp_path, tiny_gemma3):
    Bases.identity(tiny_gemma3.config).save_pretrained(tmp_path, dtype=torch.float32)
    loaded = Bases.from_pretrained(tmp_path)
    assert sorted(loaded.tensors) == [1, 3]  # the full-attention layers only
    assert all(torch.equal(t, torch.eye(WIDTH)) for t in loaded.tensors.values())
    try:
        cache = VarRateCache.from_pretrained(tmp_path, model=tiny_gemma3, budget=0.5)
        ids = torch.randint(2, 128, (1, 400), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            tiny_gemma3(input_ids=ids, past_key_values=cache, use_cache=True)
            cache.compress()
        assert cache.layers[1].codes and not cache.layers[1].codes[0].stored_exactly
    finally:
        unbind(tiny_gemma3)


def test_save_refuses_a_basis_that_would_not_load(tmp_path):
    bad = Bases.from_tensors({0: orthonormal(8) * 2, 1: orthonormal(8)}, **META)
    with pytest.raises(BasesError, match="orthonormal"):
        bad.save_pretrained(tmp_path)
    assert not (tmp_path / WEIGHTS_NAME).exists()


# integrity -------------------------------------------------------------------------------------------
def test_changed_tensor_file_fails_the_sha256_check(tmp_path):
    write_artifact(tmp_path, good_tensors(), META)
    blob = bytearray((tmp_path / WEIGHTS_NAME).read_bytes())
    blob[-3] ^= 0x01
    (tmp_path / WEIGHTS_NAME).write_bytes(bytes(blob))
    with pytest.raises(BasesError, match="sha256") as err:
        Bases.from_pretrained(tmp_path)
    assert "corrupt" in str(err.value) and "hf_varrate.calibration --model tiny/llama" in str(err.value)


def test_truncated_tensor_file_is_an_error(tmp_path):
    write_artifact(tmp_path, good_tensors(), META)
    blob = (tmp_path / WEIGHTS_NAME).read_bytes()
    (tmp_path / WEIGHTS_NAME).write_bytes(blob[: len(blob) // 2])
    with pytest.raises(BasesError, match="sha256"):
        Bases.from_pretrained(tmp_path)
    # the same truncation with a matching checksum still fails, in the parser
    write_artifact(tmp_path, good_tensors(), META)
    meta = {**META, "sha256": {WEIGHTS_NAME: hashlib.sha256(blob[: len(blob) // 2]).hexdigest()}}
    (tmp_path / WEIGHTS_NAME).write_bytes(blob[: len(blob) // 2])
    (tmp_path / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(BasesError, match="could not parse"):
        Bases.from_pretrained(tmp_path)


def test_missing_checksum_is_an_error(tmp_path):
    write_artifact(tmp_path, good_tensors(), META, sha=None)
    with pytest.raises(BasesError, match="records no sha256"):
        Bases.from_pretrained(tmp_path)


@pytest.mark.parametrize("missing", [WEIGHTS_NAME, CONFIG_NAME])
def test_missing_file_names_the_build_command(tmp_path, missing):
    write_artifact(tmp_path, good_tensors(), META)
    (tmp_path / missing).unlink()
    with pytest.raises(BasesError, match=missing) as err:
        Bases.from_pretrained(tmp_path)
    assert BUILD_HINT in str(err.value)


def test_a_path_that_does_not_exist_is_not_looked_up_on_the_hub(tmp_path):
    with pytest.raises(BasesError, match="is not a directory"):
        Bases.from_pretrained(tmp_path / "nope")
    assert looks_local("./x") and looks_local("a/b/c") and looks_local("/abs")
    assert not looks_local("org/name") and not looks_local("name")


# bad tensors -------------------------------------------------------------------------------------------
def _nan_basis():
    t = orthonormal(8)
    t[2, 3] = float("nan")
    return t


@pytest.mark.parametrize(
    "tensors, message",
    [
        ({"layers.0": orthonormal(8)}, r"missing \['layers.1'\]"),
        ({**good_tensors(), "layers.5": orthonormal(8)}, r"unexpected \['layers.5'\]"),
        ({"layers.0": orthonormal(8), "layers.1": orthonormal(4)}, r"shape \(4, 64\), expected .* \[8, 64\]"),
        ({"layers.0": orthonormal(8), "layers.1": orthonormal(8)[None]}, r"shape \(1, 8, 64\)"),
        ({"layers.0": orthonormal(8), "layers.1": torch.zeros(8, WIDTH, dtype=torch.int32)}, "dtype torch.int32"),
        ({"layers.0": orthonormal(8), "layers.1": _nan_basis()}, "NaN or inf"),
        ({"layers.0": orthonormal(8), "layers.1": orthonormal(8) * 1.1}, "orthonormal rows"),
        ({"layers.0": orthonormal(8), "layers.1": torch.ones(8, WIDTH) / 8}, "orthonormal rows"),
    ],
    ids=["missing-layer", "extra-layer", "wrong-rank", "wrong-ndim", "int-dtype", "nan", "scaled", "degenerate"],
)
def test_bad_tensors_are_rejected_with_a_clear_message(tmp_path, tensors, message):
    write_artifact(tmp_path, tensors, META)
    with pytest.raises(BasesError, match=message) as err:
        Bases.from_pretrained(tmp_path)
    assert "rebuild" in str(err.value)


def test_fp16_rounding_is_within_the_orthonormality_tolerance(tmp_path):
    write_artifact(tmp_path, {k: v.half() for k, v in good_tensors(64).items()}, {**META, "rank": 64})
    assert Bases.from_pretrained(tmp_path).rank == 64


def test_shipped_fp16_bases_can_be_saved_again_as_fp32(tmp_path):
    write_artifact(tmp_path / "fp16", {k: v.half() for k, v in good_tensors(64).items()}, {**META, "rank": 64})
    bases = Bases.from_pretrained(tmp_path / "fp16")
    bases.save_pretrained(tmp_path / "fp32", dtype=torch.float32)  # fp16 values, held in fp32: fp16's tolerance
    again = Bases.from_pretrained(tmp_path / "fp32")
    assert again.tensors[0].dtype == torch.float32 and torch.equal(again.tensors[0], bases.tensors[0].float())


@pytest.mark.parametrize("change, message", [
    ({"stride": 0}, r"config\.json field stride .* must be an integer in \[1, 1048576\], got 0"),
    ({"n_anchors": 10**9}, r"config\.json field n_anchors .* got 1000000000"),
    ({"window": "64"}, r"config\.json field window .* got '64'"),
    ({"format_version": 99}, r"config\.json field format_version is 99.*pip install -U hf_varrate"),
])
def test_bad_calibration_settings_in_config_json_are_named_as_coming_from_the_file(tmp_path, change, message):
    write_artifact(tmp_path, good_tensors(), {**META, **change})
    with pytest.raises(BasesError, match=message):
        Bases.from_pretrained(tmp_path)


def test_settings_tuned_for_the_model_are_what_its_preset_takes(tmp_path):
    write_artifact(tmp_path, good_tensors(), {**META, "presets": {"recommended": {"key_weight": 4.0}}})
    bases = Bases.from_pretrained(tmp_path)
    assert bases.config("recommended", balance="none").key_weight == 4.0
    assert bases.config("paper").key_weight == 1.0  # only the preset it was tuned for
    assert bases.config("recommended", balance="none", key_weight=2.0).key_weight == 2.0  # the caller's word wins


def test_settings_tuned_for_low_budgets_apply_only_there(tmp_path):
    tuned = {"recommended": {"key_weight": 4.0, "low_budget": {"coef_scales": "component"}}}
    write_artifact(tmp_path, good_tensors(), {**META, "presets": tuned})
    bases = Bases.from_pretrained(tmp_path)
    low = bases.config("recommended", balance="none", budget=0.1)
    assert (low.coef_scales, low.key_weight, low.coef_bits, low.window) == ("component", 4.0, 3, 16)
    high = bases.config("recommended", balance="none", budget=0.2)
    assert (high.coef_scales, high.key_weight) == ("token", 4.0)
    assert bases.config("recommended", balance="none", budget=0.1, coef_scales="token").coef_scales == "token"
    assert bases.config("paper", budget=0.1).coef_scales == "token"
    assert "key_weight=4.0, at budget <= 0.1: coef_scales='component'" in render_card(bases.metadata)


@pytest.mark.parametrize("override, field", [({"allocation": "topk"}, "allocation"),
                                             ({"coef_bits": None}, "coef_bits")])
def test_tuned_component_scales_give_way_to_settings_that_rule_them_out(tmp_path, override, field):
    tuned = {"recommended": {"low_budget": {"coef_scales": "component"}}}
    write_artifact(tmp_path, good_tensors(), {**META, "presets": tuned})
    bases = Bases.from_pretrained(tmp_path)
    with pytest.warns(VarRateWarning,
                      match=f"tuned coef_scales='component', which needs {field}=.*coef_scales='token'"):
        config = bases.config("recommended", balance="none", budget=0.1, **override)
    assert config.coef_scales == "token" and getattr(config, field) == override[field]  # the user's setting kept
    with pytest.raises(ValueError, match=f"coef_scales='component' needs {field}="):  # asked for by name: no fallback
        bases.config("recommended", balance="none", budget=0.1, coef_scales="component", **override)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to give way to: no warning
        assert bases.config("recommended", balance="none", layer_budgets="uniform",
                            budget=0.1).coef_scales == "component"
        assert bases.config("recommended", balance="none", layer_budgets="uniform", budget=0.1,
                            signal="key_norm").coef_scales == "component"  # varying ranks: scales by rank


@pytest.mark.parametrize("presets, message", [
    ([1], "presets must map preset names"),
    ({"recommended": {"low_budget": 3}}, r"presets\.recommended\.low_budget must map settings"),
    ({"recommended": {"low_budget": {"coef_scales": "diagonal"}}},
     r"presets\.recommended is not a valid setting: coef_sc"),
    ({"fast": {}}, "presets must map preset names"),
    ({"recommended": {"key_weight": -1.0}}, r"presets\.recommended is not a valid setting: key_weight"),
    ({"recommended": {"no_such_field": 1}}, r"presets\.recommended is not a valid setting: .*no_such_field"),
])
def test_bad_tuned_settings_are_named(tmp_path, presets, message):
    write_artifact(tmp_path, good_tensors(), {**META, "presets": presets})
    with pytest.raises(BasesError, match=message):
        Bases.from_pretrained(tmp_path)


# bad config.json ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_layers": "2"}, "num_layers must be a positive integer, got '2'"),
        ({"rank": 0}, "rank must be a positive integer, got 0"),
        ({"head_dim": True}, "head_dim must be a positive integer, got True"),
        ({"width": 32}, "width is 32 but 2 \\* num_kv_heads \\* head_dim is 64"),
        ({"rank": 65}, "rank is 65, above width 64"),
        ({"compressed_layers": [1, 0]}, "compressed_layers must be sorted distinct"),
        ({"compressed_layers": [0, 2]}, "compressed_layers must be sorted distinct"),
        ({"compressed_layers": "0,1"}, "compressed_layers must be sorted distinct"),
    ],
)
def test_bad_config_fields_are_named(tmp_path, change, message):
    write_artifact(tmp_path, good_tensors(), {**META, **change})
    with pytest.raises(BasesError, match=message):
        Bases.from_pretrained(tmp_path)


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00", b"[1, 2]", b"[" * 100_000, b""])
def test_unreadable_config_is_an_error(tmp_path, content):
    write_artifact(tmp_path, good_tensors(), META)
    (tmp_path / CONFIG_NAME).write_bytes(content)
    with pytest.raises(BasesError, match=CONFIG_NAME):
        Bases.from_pretrained(tmp_path)


def test_oversized_config_is_refused_before_parsing(tmp_path):
    write_artifact(tmp_path, good_tensors(), META)
    (tmp_path / CONFIG_NAME).write_bytes(b" " * (2 << 20))
    with pytest.raises(BasesError, match="more than a bases config can be"):
        Bases.from_pretrained(tmp_path)


# fuzzing: random and mutated files give BasesError only, quickly -----------------------------------------
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.data())
def test_fuzz_mutated_tensor_file_with_matching_checksum(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("fuzz")
    blob = bytearray(save(good_tensors()))
    edits = data.draw(st.lists(st.tuples(st.integers(0, len(blob) - 1), st.integers(0, 255)), min_size=1, max_size=8))
    for position, value in edits:
        blob[position] = value
    cut = data.draw(st.integers(0, len(blob)))
    blob = bytes(blob[:cut])
    (folder / WEIGHTS_NAME).write_bytes(blob)
    (folder / CONFIG_NAME).write_text(json.dumps({**META, "sha256": {WEIGHTS_NAME: hashlib.sha256(blob).hexdigest()}}))
    start = time.perf_counter()
    try:
        read_artifact(folder)
    except BasesError:
        pass
    assert time.perf_counter() - start < 2.0


@FUZZ
@given(content=st.binary(max_size=2000) | st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(sorted(META) + ["sha256"]), inner),
    max_leaves=20,
).map(lambda value: json.dumps(value).encode()))
def test_fuzz_random_config_gives_bases_error_only(tmp_path_factory, content):
    folder = write_artifact(tmp_path_factory.mktemp("fuzz"), good_tensors(), META)
    (folder / CONFIG_NAME).write_bytes(content)
    with pytest.raises(BasesError):
        read_artifact(folder)


# meeting a model ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [("num_layers", 3), ("num_kv_heads", 1), ("head_dim", 8), ("width", 32), ("compressed_layers", [0])],
)
def test_validate_names_each_mismatching_field_both_values_and_the_fix(tiny_llama, field, value):
    bases = Bases.identity(tiny_llama.config)
    bases.metadata[field] = value
    with pytest.raises(BasesError) as err:
        bases.validate(tiny_llama.config)
    message = str(err.value)
    want = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "width": 64, "compressed_layers": [0, 1]}[field]
    assert field in message and repr(value) in message and repr(want) in message
    assert "python -m hf_varrate.calibration" in message


def test_validate_rejects_a_basis_of_the_wrong_width(tiny_llama):
    bases = Bases({0: torch.eye(32), 1: torch.eye(32)}, {"rank": 32})  # no shape metadata to compare
    with pytest.raises(BasesError, match=r"shape \(32, 32\), expected \[R <= 64, 64\]"):
        bases.validate(tiny_llama.config)


def test_other_model_id_with_matching_shapes_is_a_warning(tmp_path, tiny_llama):
    bases = Bases.from_tensors({0: orthonormal(8), 1: orthonormal(8, seed=1)}, tiny_llama.config, model_id="org/a")
    tiny_llama.config._name_or_path = "org/b"
    notes = bases.validate(tiny_llama.config)
    assert len(notes) == 1 and "'org/a'" in notes[0] and "'org/b'" in notes[0]
    bases.save_pretrained(tmp_path)
    try:
        with pytest.warns(UserWarning, match="calibrated on 'org/a'"):
            VarRateCache.from_pretrained(tmp_path, model=tiny_llama, r_min=4)  # r_min <= the basis rank 8
    finally:
        unbind(tiny_llama)
    tiny_llama.config._name_or_path = "org/a"
    assert bases.validate(tiny_llama.config) == []
    tiny_llama.config._name_or_path = str(tmp_path)  # a local folder has no id to compare
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bases.validate(tiny_llama.config) == []
