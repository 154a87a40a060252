"""A compressed document cache shared through a Hub: `cache.push_to_hub(repo)` here, `VarRateCache.load(repo,
model=model)` in another process (another server), answering with the same greedy tokens.

The Hub is the local server of tests/fake_hub.py (the real HfApi.create_commit up, the real snapshot_download
down). Pushes run in this process; loads run in a fresh interpreter with HF_ENDPOINT and its own HF cache,
as on another machine. The tiny model travels as a saved folder; the real one (slow) is the converted SmolLM2.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import hf_varrate
from hf_varrate import Bases, VarRateCache, VarRateWarning
from hf_varrate.card import render_cache_card
from hf_varrate.cache_checks import CONFIG_NAME, TENSORS_NAME

from fake_hub import FakeHubServer, run_python
from test_cache import prompt
from test_serialization import compressed

LOAD_TINY = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from hf_varrate import VarRateCache, CacheFileError
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="sdpa", dtype=torch.float32).eval()
ids = torch.tensor(json.loads(sys.argv[2]))
for repo_id, kwargs in json.loads(sys.argv[3]):
    try:
        cache = VarRateCache.load(repo_id, model=model, **kwargs)
    except CacheFileError as err:
        print(json.dumps({"error": str(err)}))
        continue
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache, pad_token_id=0)
    print(json.dumps({"tokens": out[0, ids.shape[1]:].tolist(), "length": cache.get_seq_length()}))
"""


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub.constants as constants

    with FakeHubServer() as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        yield server


@pytest.fixture
def tiny(tiny_llama, tmp_path):
    """The tiny Llama as a saved folder (what the other process loads) and loaded back from it here."""
    tiny_llama.save_pretrained(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", attn_implementation="sdpa", dtype=torch.float32)
    return model.eval(), tmp_path / "model"


def expected_tokens(model, cache, ids) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=copy.deepcopy(cache),
                             pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_a_pushed_cache_answers_the_same_in_another_process(hub, tiny, tmp_path):
    model, folder = tiny
    ids = torch.cat([prompt(model, 300), prompt(model, 6, seed=1)], dim=1)
    first = compressed(model, "compact")
    want = expected_tokens(model, first, ids)
    info = first.push_to_hub("me/docs", subfolder="doc-1", token="hf_test_token")
    files = hub.repos["me/docs"].commits[info.oid]
    assert {f"doc-1/{name}" for name in (TENSORS_NAME, CONFIG_NAME, "README.md")} <= set(files)
    card = ModelCard(files["doc-1/README.md"].decode())
    assert card.data.library_name == "hf_varrate" and card.data.license and "compressed-kv-cache" in card.data.tags
    assert 'VarRateCache.load("me/docs", subfolder="doc-1"' in card.text
    (tmp_path / "c.safetensors").write_bytes(files[f"doc-1/{TENSORS_NAME}"])
    with safe_open(tmp_path / "c.safetensors", "pt") as handle:
        assert handle.metadata()["kind"] == "cache" and handle.metadata()["bases"] == "identity"
    # a second document: a new revision of the same subfolder, and one as a pull request
    second = compressed(model, "materialized", budget=0.6)
    want_second = expected_tokens(model, second, ids)
    second.push_to_hub("me/docs", subfolder="doc-1", commit_message="doc 1, budget 0.6")
    pr = second.push_to_hub("me/other", create_pr=True)
    assert pr.pr_revision == "refs/pr/1"
    calls = [("me/docs", {"subfolder": "doc-1", "revision": info.oid}), ("me/docs", {"subfolder": "doc-1"}),
             ("me/other", {"revision": "refs/pr/1", "storage": "compact"}), ("me/other", {}),
             ("me/docs", {"subfolder": "doc-2"})]
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "other-server")}
    pinned, latest, from_pr, main_only, missing = run_python(LOAD_TINY, env, str(folder), json.dumps(ids.tolist()),
                                                            json.dumps(calls))
    assert pinned == {"tokens": want, "length": 306 + 7}
    assert latest["tokens"] == from_pr["tokens"] == want_second
    assert "holds no" in main_only["error"] and "holds no" in missing["error"]
    assert "Bearer hf_test_token" in hub.tokens


def test_local_files_only_force_download_and_corruption_after_a_pull(hub, tiny, tmp_path):
    model, folder = tiny
    ids = torch.cat([prompt(model, 300), prompt(model, 6, seed=1)], dim=1)
    cache = compressed(model, "compact")
    want = expected_tokens(model, cache, ids)
    cache.push_to_hub("me/doc")
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hf-cache")}
    args = str(folder), json.dumps(ids.tolist())
    [pulled] = run_python(LOAD_TINY, env, *args, json.dumps([("me/doc", {})]))
    assert pulled["tokens"] == want
    # offline from the HF cache; then a cached file damaged: caught, and force_download repairs it
    [offline] = run_python(LOAD_TINY, {**env, "HF_ENDPOINT": "http://127.0.0.1:9"}, *args,
                           json.dumps([("me/doc", {"local_files_only": True})]))
    assert offline["tokens"] == want
    [blob] = list((tmp_path / "hf-cache").rglob(TENSORS_NAME))
    data = bytearray(blob.resolve().read_bytes())
    data[-1] ^= 0xFF
    blob.resolve().write_bytes(bytes(data))
    # and on the Hub, a commit that replaces the tensors of another repo's cache with this one's
    compressed(model, "compact", budget=0.6).push_to_hub("me/tampered")
    HfApi(endpoint=hub.url).upload_file(path_or_fileobj=hub.repos["me/doc"].commits[
        hub.repos["me/doc"].refs["main"]][TENSORS_NAME], path_in_repo=TENSORS_NAME, repo_id="me/tampered",
        commit_message="swap the tensors")
    damaged, repaired, tampered = run_python(LOAD_TINY, env, *args, json.dumps(
        [("me/doc", {}), ("me/doc", {"force_download": True}), ("me/tampered", {})]))
    assert "does not match the sha256" in damaged["error"]
    assert repaired["tokens"] == want
    assert "does not match the sha256" in tampered["error"]


def test_a_push_with_bases_from_a_local_folder_warns_that_other_machines_cannot_read_them(hub, tiny_llama, tmp_path):
    Bases.identity(tiny_llama.config).save_pretrained(tmp_path / "bases")
    with hf_varrate.bound(tiny_llama):
        cache = VarRateCache.from_pretrained(tmp_path / "bases", model=tiny_llama, stride=8, window=16, budget=0.4,
                                                   balance="none")
        with torch.no_grad():
            tiny_llama(prompt(tiny_llama, 300), past_key_values=cache)
        with pytest.warns(VarRateWarning, match="another machine cannot read"):
            cache.push_to_hub("me/doc")
    assert TENSORS_NAME in hub.repos["me/doc"].commits[hub.repos["me/doc"].refs["main"]]


def test_a_bad_subfolder_is_refused_before_anything_is_sent(hub, tiny_llama):
    cache = compressed(tiny_llama, "compact")
    with pytest.raises(ValueError, match=r"subfolder must be a relative path .* got '\.\./x'"):
        cache.push_to_hub("me/doc", subfolder="../x")
    with pytest.raises(ValueError, match="subfolder must be a relative path"):
        VarRateCache.load("me/doc", model=tiny_llama, subfolder="/x")
    assert hub.log == []


LOAD_REAL = """
import copy, json, sys, torch
from hf_varrate import VarRateCache
from hf_varrate.models import load_default_model
model, tokenizer = load_default_model("smollm2-135m-instruct")
doc, question = (tokenizer(text, return_tensors="pt").input_ids for text in json.loads(sys.argv[1]))
ids = torch.cat([doc, question], dim=1)
def answer(cache):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache, pad_token_id=2,
                             attention_mask=torch.ones_like(ids))
    return out[0, ids.shape[1]:].tolist()
if sys.argv[2] == "write":
    cache = VarRateCache.from_pretrained("me/smollm2-bases", model=model, budget=0.2)
    with torch.no_grad():
        model(doc, past_key_values=cache)
    cache.compress()
    info = cache.push_to_hub("me/smollm2-doc")
else:
    cache = VarRateCache.load("me/smollm2-doc", model=model)
footprint = cache.footprint().fraction
print(json.dumps({"tokens": answer(copy.deepcopy(cache)), "footprint": footprint, "doc": doc.shape[1]}))
"""


@pytest.mark.slow
def test_real_smollm2_document_cache_shared_through_the_hub(hub, tmp_path):
    """Server A reads the bases from the Hub, codes a document, pushes its cache; server B (its own HF cache)
    loads the cache by repo id, which reads the same bases from the Hub, and answers with A's tokens."""
    Bases.from_pretrained("smollm2-135m-instruct").push_to_hub("me/smollm2-bases")
    facts = " ".join(f"Box {i} is {['red', 'blue', 'green'][i % 3]} and holds {i * 7 % 50} coins." for i in range(40))
    texts = json.dumps([facts, " Question: how many coins does box 4 hold? Answer:"])
    written = run_python(LOAD_REAL, {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "a")}, texts, "write")[0]
    start = len(hub.log)
    read = run_python(LOAD_REAL, {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "b")}, texts, "read")[0]
    assert written["doc"] > 400 and written["footprint"] < 0.5
    assert read == written  # the same greedy tokens, from the same codes
    assert any("/me/smollm2-bases/resolve/" in line for line in hub.log[start:])  # B read the bases too


PINNED_BASES = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from hf_varrate import Bases, VarRateCache, bound
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="sdpa", dtype=torch.float32).eval()
if sys.argv[3] == "save":
    bases = Bases.from_pretrained("me/bases")
    cache = VarRateCache(bases, model=model, budget=0.4, stride=8, window=16, r_min=2)
    with bound(model), torch.no_grad():
        model(torch.tensor(json.loads(sys.argv[4])), past_key_values=cache)
        cache.compress()
    cache.save_pretrained(sys.argv[2])
else:
    bases = VarRateCache.load(sys.argv[2], model=model).bases
print(json.dumps({"revision": bases.revision, "commit": bases.commit, "calibration": bases.metadata["calibration"]}))
"""


def test_a_saved_cache_reads_its_bases_at_the_commit_it_was_built_with(hub, tiny, tmp_path):
    """Bases pulled from a branch record the commit it resolved to, and a saved cache reloads them from that
    commit after the branch has moved on (not the newer bases, which its fingerprint would refuse)."""
    model, folder = tiny

    def push_bases(seed: int):
        g = torch.Generator().manual_seed(seed)
        identity = Bases.identity(model.config)
        width = identity.metadata["width"]
        tensors = {i: torch.linalg.qr(torch.randn(width, width, generator=g, dtype=torch.float64))[0].T.float()
                   for i in identity.tensors}
        return Bases.from_tensors(tensors, model.config, calibration=f"seed {seed}").push_to_hub("me/bases")

    first = push_bases(1)
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hf-cache")}
    doc, ids = str(tmp_path / "doc"), json.dumps(prompt(model, 300).tolist())
    [saved] = run_python(PINNED_BASES, env, str(folder), doc, "save", ids)
    assert saved == {"revision": None, "commit": first.oid, "calibration": "seed 1"}
    meta = json.loads((tmp_path / "doc" / CONFIG_NAME).read_text())
    assert meta["bases"]["commit"] == first.oid
    assert f"commit `{first.oid}`" in render_cache_card(meta, meta["sha256"], "me/docs")  # the pushed card says it
    push_bases(2)  # main moves on
    [loaded] = run_python(PINNED_BASES, env, str(folder), doc, "load")
    assert loaded == {"revision": first.oid, "commit": first.oid, "calibration": "seed 1"}
