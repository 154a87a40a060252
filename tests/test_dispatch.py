"""A model split across devices with accelerate: every tensor a cache layer holds lives on that layer's device.

On CPU, SmolLM2 dispatched with some decoder layers' weights kept on "cpu" and the others offloaded to
"disk" (they run on the CPU, their weights loaded for each forward) generates the same greedy tokens as
the undispatched model with the same cache, and every tensor each layer holds is on the device the layer
runs on. A layer whose K/V arrive on another device, or that holds a tensor elsewhere, raises a
`DeviceMismatchError` naming the layer, the devices and the fix. With two GPUs, the same over cuda:0/cuda:1.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch
from accelerate import dispatch_model
from accelerate.hooks import remove_hook_from_module

import hf_varrate
from hf_varrate import Bases, VarRateCache
from hf_varrate.demo import FACTS, chat_parts, essay_text, plant
from hf_varrate.devices import SHARED, check_held, held_tensors, layer_devices
from hf_varrate.errors import DeviceMismatchError
from hf_varrate.models import load_default_model
from hf_varrate.serialization import load_cache

NEW = 6
SHIPPED = "smollm2-135m-instruct"


def generate(model, ids: torch.Tensor, cache) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=NEW,
                              do_sample=False, pad_token_id=2)


def varrate_cache(model, storage: str, bases: Bases) -> VarRateCache:
    """A cache with the default preset on `bases`, `model` bound."""
    hf_varrate.bind(model)
    return VarRateCache(bases, bases.config("recommended", storage=storage), model=model)


def device_map(layers: int, devices: list[str]) -> dict[str, str]:
    """Decoder layer i on devices[i * len(devices) // layers] (contiguous blocks); embeddings on the first,
    the final norm and the (tied) head with the embeddings' device."""
    blocks = {f"model.layers.{i}": devices[i * len(devices) // layers] for i in range(layers)}
    return {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0], **blocks, "model.norm": devices[-1],
            "lm_head": devices[0]}


def check_placed(cache: VarRateCache, model) -> dict[int, torch.device]:
    """Every compressed layer coded a prompt and holds each of its tensors, and the bases' copies it reads
    with, on the device its decoder layer runs on. Returns that placement."""
    placed = layer_devices(model)
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, hf_varrate.VarRateLayer):
            continue
        assert layer.codes and not layer.codes[0].stored_exactly, f"layer {i} coded nothing: the test would be empty"
        assert layer.device == placed[i]
        check_held(layer, placed[i])
        names = [name for name, _ in held_tensors(layer, skip=SHARED)]
        assert any(name.startswith("codes[0].") for name in names)  # the walk reaches the codes
        copies = cache.bases.spaces.layer_copies(i)  # on every device some cache on these bases asked for
        assert placed[i] in {t.device for t in copies.values()}, (i, placed[i], list(copies))
    return placed


@pytest.fixture(scope="module")
def prompt(smollm2) -> torch.Tensor:
    _, tokenizer = smollm2
    text = plant(essay_text(), tokenizer, 400, [FACTS[0][0]], [0.5])
    doc, question = chat_parts(tokenizer, text, FACTS[0][1], FACTS[0][3])
    return torch.tensor([doc + question])


@pytest.fixture(scope="module")
def bases() -> Bases:
    """One set of bases for every cache of the module: their per-layer copies are derived once, per device."""
    return Bases.from_pretrained(SHIPPED)


@pytest.fixture(scope="module")
def offloaded(smollm2, tmp_path_factory):
    """A second SmolLM2, dispatched: decoder layers alternate in blocks between "cpu" and "disk"."""
    model, _ = load_default_model(SHIPPED)
    model.eval()
    layers = model.config.num_hidden_layers
    dispatch_model(model, device_map(layers, ["cpu", "disk", "cpu", "disk"]),
                   offload_dir=str(tmp_path_factory.mktemp("offload")))
    try:
        yield model
    finally:
        remove_hook_from_module(model, recurse=True)


@pytest.mark.parametrize("storage", ["materialized", "compact"])
def test_a_model_offloaded_to_cpu_and_disk_generates_the_same_tokens(smollm2, offloaded, prompt, bases, storage):
    model, _ = smollm2
    on_disk = [name for name, p in offloaded.named_parameters() if p.device.type == "meta"]
    assert any(".layers.8." in name for name in on_disk), "no layer was offloaded to disk: the test would be empty"
    assert set(offloaded.hf_device_map.values()) == {"cpu", "disk"}
    outputs, caches = [], []
    for net in (model, offloaded):
        cache = varrate_cache(net, storage, bases)
        try:
            outputs.append(generate(net, prompt, cache))
        finally:
            hf_varrate.unbind(net)
        caches.append(cache)
    assert torch.equal(outputs[0], outputs[1])
    placed = check_placed(caches[1], offloaded)
    assert set(placed.values()) == {torch.device("cpu")}  # disk-offloaded layers run on the CPU


@pytest.mark.usefixtures("one_intra_op_thread")
@pytest.mark.parametrize("storage", ["materialized", "compact"])
@pytest.mark.parametrize("name", ["tiny_llama", "tiny_gemma3"])
def test_a_tiny_model_offloaded_to_disk_generates_the_same_tokens(request, tmp_path, name, storage):
    """The fast tier of the SmolLM2 test: a layer's weights on "disk", Gemma-3's sliding layers included."""
    model = request.getfixturevalue(name)
    ids = torch.randint(2, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    outputs, caches = [], []
    for dispatched in (False, True):
        if dispatched:
            last = model.config.num_hidden_layers - 1
            blocks = {f"model.layers.{i}": "disk" if i == last else "cpu" for i in range(last + 1)}
            dispatch_model(model, {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", **blocks,
                                   "model.norm": "cpu", "lm_head": "cpu"}, offload_dir=str(tmp_path))
            assert model.model.layers[last].self_attn.k_proj.weight.device.type == "meta"
        cache = VarRateCache(Bases.identity(model.config), model=model, budget=0.5, storage=storage)
        with hf_varrate.bound(model):
            outputs.append(generate(model, ids, cache))
        caches.append(cache)
    assert torch.equal(outputs[0], outputs[1])
    for i, layer in enumerate(caches[1].layers):
        if isinstance(layer, hf_varrate.VarRateLayer):
            assert layer.codes and not layer.codes[0].stored_exactly, f"layer {i} coded nothing"
            check_held(layer, layer_devices(model)[i])


@pytest.mark.usefixtures("one_intra_op_thread")
def test_keys_arriving_on_another_device_name_the_layer_and_the_fix(tiny_llama):
    cache = VarRateCache(Bases.identity(tiny_llama.config), model=tiny_llama, budget=0.5)
    with hf_varrate.bound(tiny_llama):
        generate(tiny_llama, torch.arange(2, 66)[None], cache)
    keys, values = cache.layers[1].keys[..., -1:, :], cache.layers[1].values[..., -1:, :]
    with pytest.raises(DeviceMismatchError, match=r"layer 1: key_states arrived on meta .* holds its tensors on cpu"
                       r".*start a new cache \(or cache\.reset\(\)\)"):
        cache.update(keys.to("meta"), values.to("meta"), 1)
    cache.reset()  # a new placement is a new cache: after a reset the layer takes the device of its next K/V
    cache.update(keys.to("meta"), values.to("meta"), 1)
    assert cache.layers[1].device == torch.device("meta")


@pytest.mark.usefixtures("one_intra_op_thread")
@pytest.mark.parametrize("storage", ["materialized", "compact"])
def test_a_held_tensor_on_another_device_is_found_at_the_next_step(tiny_llama, storage):
    cache = VarRateCache(Bases.identity(tiny_llama.config), model=tiny_llama, budget=0.5, storage=storage)
    ids = torch.arange(2, 66)[None]
    with hf_varrate.bound(tiny_llama):
        with torch.no_grad():
            tiny_llama(ids, past_key_values=cache)
        cache.compress()
        code = cache.layers[1].codes[0]
        check_held(cache.layers[1])  # all on the CPU so far
        code.ranks = code.ranks.to("meta")
        with pytest.raises(DeviceMismatchError, match=r"layer 1: its codes\[0\]\.ranks is on meta, but the layer "
                                                      r"runs on cpu.*VarRateCache\.load"):
            check_held(cache.layers[1])
        with pytest.raises(DeviceMismatchError, match=r"layer 1: its codes\[0\]\.ranks is on meta"):
            with torch.no_grad():  # the first step after the prompt is coded walks what each layer holds
                tiny_llama(ids[:, -1:], past_key_values=cache)


@pytest.mark.usefixtures("one_intra_op_thread")
@pytest.mark.parametrize("storage", ["materialized", "compact"])
def test_a_loaded_cache_is_placed_as_the_model_runs_and_checked(tiny_llama, tmp_path, storage):
    cache = VarRateCache(Bases.identity(tiny_llama.config), model=tiny_llama, budget=0.5, storage=storage)
    ids = torch.arange(2, 66)[None]
    with hf_varrate.bound(tiny_llama):
        with torch.no_grad():
            tiny_llama(ids, past_key_values=cache)
        cache.save_pretrained(tmp_path)
    loaded = VarRateCache.load(tmp_path, model=tiny_llama, bases=cache.bases)
    try:
        for layer in loaded.layers:
            check_held(layer, "cpu")
        elsewhere = load_cache(VarRateCache, tmp_path, tiny_llama, bases=cache.bases, device="meta")
        with pytest.raises(DeviceMismatchError, match=r"layer 0: key_states arrived on cpu .* holds its tensors on "
                                                      r"meta"):
            with torch.no_grad():
                tiny_llama(ids[:, -1:], past_key_values=elsewhere)
    finally:
        hf_varrate.unbind(tiny_llama)


@pytest.mark.usefixtures("one_intra_op_thread")
def test_layer_devices_reads_accelerates_execution_device(tiny_llama, tmp_path):
    assert layer_devices(tiny_llama) == {0: torch.device("cpu"), 1: torch.device("cpu")}
    dispatch_model(tiny_llama, {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                                "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"},
                   offload_dir=str(tmp_path))
    assert tiny_llama.model.layers[1].self_attn.k_proj.weight.device.type == "meta"
    assert layer_devices(tiny_llama) == {0: torch.device("cpu"), 1: torch.device("cpu")}


def check_split(devices: list[str], prompt: torch.Tensor, bases: Bases, storage: str) -> None:
    """SmolLM2 split over `devices` (contiguous blocks of layers) generates what it does whole on devices[0],
    with each cache layer's tensors on its layer's device."""
    reference, _ = load_default_model(SHIPPED)
    reference = reference.eval().to(devices[0])
    split, _ = load_default_model(SHIPPED)
    dispatch_model(split.eval(), device_map(split.config.num_hidden_layers, devices), main_device=devices[0])
    outputs, caches = [], []
    try:
        for net in (reference, split):
            cache = varrate_cache(net, storage, bases)
            outputs.append(generate(net, prompt.to(devices[0]), cache))
            caches.append(cache)
    finally:
        hf_varrate.unbind(reference)
        hf_varrate.unbind(split)
    assert torch.equal(outputs[0], outputs[1])
    placed = check_placed(caches[1], split)
    assert set(placed.values()) == {torch.device(device) for device in devices}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices to split the model over")
@pytest.mark.parametrize("storage", ["materialized", "compact"])
def test_a_model_split_over_two_gpus_keeps_each_layer_on_its_gpu(smollm2, prompt, bases, storage):
    check_split(["cuda:0", "cuda:1"], prompt, bases, storage)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is in the standard library from 3.11")
def test_accelerate_is_a_test_dependency_the_package_never_imports():
    import tomllib

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert "accelerate" in project["optional-dependencies"]["dev"]
    assert not [d for d in project["dependencies"] if d.startswith("accelerate")]
    importing = [path.name for path in (root / "hf_varrate").rglob("*.py")
                 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, (ast.Import, ast.ImportFrom))
                 and any((getattr(node, "module", None) or alias.name).startswith("accelerate")
                         for alias in node.names)]
    assert not importing, f"the package imports accelerate in {importing}: make it a dependency again"


def test_the_walk_names_every_tensor_once_and_stops_at_cycles():
    shared = torch.zeros(2)
    box = type("Box", (), {})()
    box.rows = [shared, {"k": shared.clone()}]
    box.me = box  # a cycle
    box.bases = torch.ones(1)  # skipped: shared by the whole cache
    assert [name for name, _ in held_tensors(box, skip=frozenset({"bases"}))] == ["rows[0]", "rows[1]['k']"]
