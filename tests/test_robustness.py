"""Saved caches that survive failure and misuse: a failed or killed save keeps the previous one, a save is
never edited or overridden into something it was not, and whoever loads it is told what differs.

The rows of docs/bad_inputs.md about saving and loading (beyond damaged files: tests/test_serialization.py
and tests/test_bad_saved_caches.py) are backed here, with the fault-injection run that kills a saving
process at random points.
"""

import copy
import gc
import json
import os
import random
import signal
import stat
import time
import warnings
from collections import Counter

import pytest
import torch
from safetensors import SafetensorError

import hf_varrate
from hf_varrate import Bases, VarRateCache, VarRateConfig, VarRateWarning
from hf_varrate.cache_checks import CONFIG_NAME, SEAL_FIELD, TENSORS_NAME

from test_cache import SMALL, prompt
from test_serialization import answer, compressed

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
KILL_RUNS = 60


def entries(folder):
    return sorted(p.name for p in folder.iterdir())


def load_quietly(folder, model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", VarRateWarning)
        return VarRateCache.load(folder, model=model, **kwargs)


# 1. a failed save keeps the previous one, whole, and leaves nothing behind --------------------------------
def test_a_failed_tensor_write_keeps_the_previous_save_and_leaves_no_temporary_file(tiny_llama, tmp_path,
                                                                                   monkeypatch):
    first, second = compressed(tiny_llama, doc_len=200), compressed(tiny_llama, doc_len=260)
    target = tmp_path / "doc"
    first.save_pretrained(target)

    def disk_full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(No space left on device (os error 28))")

    monkeypatch.setattr("hf_varrate.serialization.save_file", disk_full)
    with pytest.raises(OSError, match="nothing there was changed"):
        second.save_pretrained(target)
    assert entries(tmp_path) == ["doc"] and entries(target) == sorted([CONFIG_NAME, TENSORS_NAME])
    assert load_quietly(target, tiny_llama).get_seq_length() == 200


def test_a_failure_between_the_two_files_keeps_the_previous_save(tiny_llama, tmp_path, monkeypatch):
    first, second = compressed(tiny_llama, doc_len=200), compressed(tiny_llama, doc_len=260)
    target = tmp_path / "doc"
    first.save_pretrained(target)
    with monkeypatch.context() as patch:  # the JSON cannot be written once the tensors are (a crash, a full disk)
        patch.setattr(json, "dumps", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        with pytest.raises(OSError, match="No space"):
            second.save_pretrained(target)
    assert entries(tmp_path) == ["doc"] and entries(target) == sorted([CONFIG_NAME, TENSORS_NAME])
    assert load_quietly(target, tiny_llama).get_seq_length() == 200


def test_a_failed_bases_save_keeps_the_previous_artifact(tiny_llama, tmp_path, monkeypatch):
    Bases.identity(tiny_llama.config).save_pretrained(tmp_path / "bases")
    flipped = Bases.from_tensors({i: torch.eye(64).flip(0) for i in range(2)}, tiny_llama.config)
    with monkeypatch.context() as patch:
        patch.setattr(json, "dumps", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        with pytest.raises(OSError):
            flipped.save_pretrained(tmp_path / "bases")
    assert entries(tmp_path) == ["bases"]
    assert torch.equal(Bases.from_pretrained(tmp_path / "bases").tensors[0].float(), torch.eye(64))


def test_without_an_atomic_exchange_a_failed_swap_puts_the_previous_save_back(tiny_llama, tmp_path, monkeypatch):
    """Where the OS cannot exchange two folders in one step, the previous save is renamed aside, the new one
    into place, and back if that fails."""
    first, second = compressed(tiny_llama, doc_len=200), compressed(tiny_llama, doc_len=260)
    target = tmp_path / "doc"
    first.save_pretrained(target)
    monkeypatch.setattr("hf_varrate.files._exchange", lambda a, b: False)
    second.save_pretrained(target)
    assert load_quietly(target, tiny_llama).get_seq_length() == 260 and entries(tmp_path) == ["doc"]
    rename = os.rename

    def refuse_the_new_one(src, dst):
        if ".saving-" in str(src):
            raise OSError(5, "Input/output error")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", refuse_the_new_one)
    with pytest.raises(OSError, match="Input/output"):
        first.save_pretrained(target)
    assert load_quietly(target, tiny_llama).get_seq_length() == 260 and entries(tmp_path) == ["doc"]


def test_saving_over_a_folder_with_other_files_is_refused_and_touches_nothing(tiny_llama, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"notes\.txt.*new or empty folder"):
        compressed(tiny_llama, doc_len=200).save_pretrained(tmp_path)
    assert entries(tmp_path) == ["notes.txt"]
    with pytest.raises(FileExistsError, match=r"notes\.txt"):
        Bases.identity(tiny_llama.config).save_pretrained(tmp_path)
    assert entries(tmp_path) == ["notes.txt"]


def test_a_killed_save_leaves_the_previous_or_the_new_save_never_neither(tiny_llama, tmp_path, capsys):
    """Fault injection: a child process saves two caches in turn into one folder and is killed (SIGKILL)
    after a random delay, KILL_RUNS times; after each kill the folder loads as one of the two."""
    caches = {200: compressed(tiny_llama, doc_len=200), 260: compressed(tiny_llama, doc_len=260)}
    target = tmp_path / "doc"
    caches[200].save_pretrained(target)
    start = time.perf_counter()
    caches[260].save_pretrained(tmp_path / "timing")
    per_save = time.perf_counter() - start
    rng, outcomes, interrupted = random.Random(0), Counter(), 0
    for run in range(KILL_RUNS):
        pid = os.fork()
        if pid == 0:  # the child: save until killed
            try:
                for k in range(run, run + 10_000):
                    caches[(200, 260)[k % 2]].save_pretrained(target)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0, 3 * per_save))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        interrupted += any(p.name.startswith(".doc.saving-") for p in tmp_path.iterdir())
        outcomes[load_quietly(target, tiny_llama).get_seq_length()] += 1
    assert set(outcomes) <= {200, 260} and sum(outcomes.values()) == KILL_RUNS
    caches[200].save_pretrained(target)  # the next save removes what the killed ones left
    assert entries(tmp_path) == ["doc", "timing"] and entries(target) == sorted([CONFIG_NAME, TENSORS_NAME])
    with capsys.disabled():
        print(f"\nkilled {KILL_RUNS} saves ({interrupted} mid-save, {per_save * 1000:.0f} ms a save): loaded "
              f"{dict(outcomes)} (tokens of the previous or the new save), never neither")


# 2. what was coded stays as coded ------------------------------------------------------------------------
@pytest.mark.parametrize("knob, value", [("balance", "rms"), ("budget", 0.3), ("window", 8), ("coef_bits", 4),
                                         ("r_min", 4), ("stride", 4), ("seed", 3)])
def test_load_refuses_a_coding_time_setting_naming_it(tiny_llama, tmp_path, knob, value):
    compressed(tiny_llama, doc_len=200).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"^{knob}=.*fixed when the prompt is coded.*'storage'"):
        VarRateCache.load(tmp_path, model=tiny_llama, **{knob: value})
    same = load_quietly(tmp_path, tiny_llama, budget=0.4, storage="compact")  # the saved value, and a runtime one
    assert same.config.storage == "compact" and same.config.budget == 0.4
    with pytest.raises(TypeError, match="did you mean 'storage'"):
        VarRateCache.load(tmp_path, model=tiny_llama, storag="compact")


@pytest.mark.parametrize("edit", [("config", "balance", "rms"), ("config", "budget", 0.9), ("model", "model_id", "x")])
def test_a_hand_edited_cache_config_is_refused(tiny_llama, tmp_path, edit):
    compressed(tiny_llama, doc_len=200).save_pretrained(tmp_path)
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
    meta[edit[0]][edit[1]] = edit[2]
    (tmp_path / CONFIG_NAME).write_text(json.dumps(meta, indent=1, sort_keys=True))
    with pytest.raises(hf_varrate.CacheFileError, match="does not match its config_sha256.*code the prompt again"):
        VarRateCache.load(tmp_path, model=tiny_llama)


def test_a_cache_saved_in_format_1_still_loads_with_a_warning(tiny_llama, tmp_path):
    compressed(tiny_llama, doc_len=200).save_pretrained(tmp_path)
    expected = answer(tiny_llama, VarRateCache.load(tmp_path, model=tiny_llama), doc_len=200)
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
    meta = {**{k: v for k, v in meta.items() if k != SEAL_FIELD}, "format_version": 1}
    (tmp_path / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.warns(VarRateWarning, match="older hf_varrate.*Save it again"):
        loaded = VarRateCache.load(tmp_path, model=tiny_llama)
    assert torch.equal(answer(tiny_llama, loaded, doc_len=200), expected)


# 3.-5. whoever loads it: another model, another working directory, another account -----------------------
def test_a_cache_loaded_into_another_model_of_the_same_shape_warns(tiny_llama, tmp_path):
    tiny_llama.config._name_or_path = "org/a"
    compressed(tiny_llama, doc_len=200).save_pretrained(tmp_path)
    tiny_llama.config._name_or_path = "org/b"
    with pytest.warns(VarRateWarning, match="saved from model 'org/a' but is loaded into 'org/b'"):
        VarRateCache.load(tmp_path, model=tiny_llama)


def test_a_cache_on_bases_read_with_bases_from_pretrained_reloads_from_another_directory(tiny_llama, tmp_path,
                                                                                        monkeypatch):
    Bases.from_tensors({i: torch.eye(64).flip(0) for i in range(2)}, tiny_llama.config).save_pretrained(
        tmp_path / "bases")
    monkeypatch.chdir(tmp_path)
    cache = VarRateCache(Bases.from_pretrained("bases"), model=hf_varrate.bind(tiny_llama), budget=0.4, **SMALL)
    with torch.no_grad():
        tiny_llama(prompt(tiny_llama, 200), past_key_values=cache)
    cache.save_pretrained("doc")
    monkeypatch.chdir(tmp_path / "bases")  # anywhere else
    assert VarRateCache.load(tmp_path / "doc", model=tiny_llama).get_seq_length() == 200


def test_a_cache_on_fp16_identity_bases_reloads(tiny_llama, tmp_path):
    hf_varrate.bind(tiny_llama)
    cache = VarRateCache(Bases.identity(tiny_llama.config, dtype=torch.float16), model=tiny_llama, budget=0.4,
                         **SMALL)
    with torch.no_grad():
        tiny_llama(prompt(tiny_llama, 200), past_key_values=cache)
    expected = answer(tiny_llama, copy.deepcopy(cache), doc_len=200)
    cache.save_pretrained(tmp_path)
    assert torch.equal(answer(tiny_llama, VarRateCache.load(tmp_path, model=tiny_llama), doc_len=200), expected)


@pytest.mark.parametrize("umask, file_mode, folder_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_saved_files_follow_the_umask(tiny_llama, tmp_path, umask, file_mode, folder_mode):
    cache = compressed(tiny_llama, doc_len=200)
    previous = os.umask(umask)
    try:
        cache.save_pretrained(tmp_path / "doc")
        Bases.identity(tiny_llama.config).save_pretrained(tmp_path / "bases")
    finally:
        os.umask(previous)
    for folder in (tmp_path / "doc", tmp_path / "bases"):
        assert stat.S_IMODE(folder.stat().st_mode) == folder_mode
        assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == \
            {p.name: file_mode for p in folder.iterdir()}


# 8. a config is checked once, completely, and stays as checked -------------------------------------------
@pytest.mark.parametrize("seed", ["abc", 1.5, True, 2**64])
def test_a_seed_torch_would_refuse_is_refused_when_the_config_is_built(seed):
    with pytest.raises(ValueError, match=r"seed must be an integer that torch\.manual_seed takes.*seed=0"):
        VarRateConfig(seed=seed)


def test_numpy_scalars_are_taken_as_python_numbers():
    np = pytest.importorskip("numpy")
    config = VarRateConfig(budget=np.float32(0.4), stride=np.int64(8), anchor_share=np.float64(0.25),
                           coef_bits=np.int32(4))
    assert (config.budget, config.stride, config.anchor_share, config.coef_bits) == (0.4, 8, 0.25, 4)
    assert all(type(v) in (int, float) for v in (config.budget, config.stride, config.anchor_share, config.coef_bits))
    json.dumps(config.to_dict())  # what a saved cache records


def test_a_built_config_is_immutable_and_replace_checks():
    config = VarRateConfig()
    with pytest.raises(AttributeError, match=r"immutable.*config\.replace\(stride=-3\)"):
        config.stride = -3
    assert config.stride == 16 and config.replace(stride=8).stride == 8
    with pytest.raises(ValueError, match="stride must be an integer >= 1"):
        config.replace(stride=-3)
    assert copy.deepcopy(config) == config


def test_a_misspelt_keyword_suggests_the_closest_field(tiny_llama):
    with pytest.raises(TypeError, match="no field 'budgt' \\(did you mean 'budget'\\?\\)"):
        VarRateConfig(budgt=0.3)
    with pytest.raises(TypeError, match="did you mean 'anchor_share'"):
        VarRateCache(Bases.identity(tiny_llama.config), model_config=tiny_llama.config, anchor_shar=0.25)
    with pytest.warns(UserWarning, match="did you mean 'window'"):
        VarRateConfig.from_dict({"windw": 8})


def test_a_dict_config_is_read_and_another_type_is_a_type_error(tiny_llama):
    bases = Bases.identity(tiny_llama.config)
    # materialized: identity bases record no RoPE, and compact storage without them falls back (with a warning)
    cache = VarRateCache(bases, {"budget": 0.3, "storage": "materialized", **SMALL}, model_config=tiny_llama.config)
    assert cache.config == VarRateConfig(budget=0.3, storage="materialized", **SMALL)
    with pytest.raises(TypeError, match="config must be a VarRateConfig, a dict of its fields or None, got str"):
        VarRateCache(bases, "recommended", model_config=tiny_llama.config)


# the stored-exactly warning says what would help, given the config ---------------------------------------
@pytest.mark.parametrize("preset, advice", [("paper", "Set anchor_share=0.25"),
                                            ("recommended", r"already grows the stride.*lower window \(e\.g\.")])
def test_the_stored_exactly_advice_depends_on_the_config(tiny_llama, preset, advice):
    config = VarRateConfig.preset(preset, balance="none", r_min=16)
    cache = VarRateCache(Bases.identity(tiny_llama.config), config, model=hf_varrate.bind(tiny_llama))
    with pytest.warns(VarRateWarning, match=advice) as caught, torch.no_grad():
        tiny_llama(prompt(tiny_llama, 100), past_key_values=cache)
        tiny_llama(prompt(tiny_llama, 1, seed=1), past_key_values=cache)  # a decoding step: the prompt is complete
    assert preset == "paper" or not any("Set anchor_share" in str(w.message) for w in caught)


# 9. torch.compile traces the C loops as custom ops (tests/test_compile.py) ----------------------------------
@pytest.mark.slow
def test_compiled_generate_over_a_compact_cache_gives_the_same_tokens(tiny_llama):
    """torch.compile(model.forward) + generate with a compact cache under the "varrate" attention: the same
    tokens as eager, and no crash (the C loops run as custom ops, never on a traced tensor). ~20 s on CPU."""
    import torch._dynamo

    tiny_llama.set_attn_implementation("varrate")
    ids = prompt(tiny_llama, 300)

    def run():
        cache = VarRateCache(Bases.identity(tiny_llama.config), model=hf_varrate.bind(tiny_llama), budget=0.4,
                             storage="compact", coef_bits=4, **SMALL)
        with torch.no_grad():
            return tiny_llama.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=cache, pad_token_id=0)

    expected = run()
    torch._dynamo.reset()
    tiny_llama.forward = torch.compile(tiny_llama.forward, backend="eager")
    try:
        assert torch.equal(run(), expected)
    finally:
        del tiny_llama.forward
        torch._dynamo.reset()
        gc.collect()  # the traced graphs' fake tensors go with the compiled code
