"""Bases on the Hub: the model card, offline loads from the HF cache, and downloads and pinned revisions
from a local HTTP server speaking the Hub endpoints (tests/fake_hub.py). Pushes: tests/test_hub_push.py.

Hub settings (HF_ENDPOINT, HF_HUB_OFFLINE) are read when huggingface_hub is imported, so the
loads run in a subprocess with the environment set, through the real snapshot_download.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from hf_varrate import Bases, BasesError
from hf_varrate.bases import ARTIFACT_FILES, CARD_NAME, CONFIG_NAME, WEIGHTS_NAME
from hf_varrate.card import render_card

from fake_hub import FakeHubServer, run_python

REPO = "varrate-test/tiny-bases"
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
META = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "width": 64, "compressed_layers": [0, 1],
        "model_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "stride": 16, "window": 64, "n_anchors": 4,
        "license": "apache-2.0"}


def make_bases(seed: int) -> Bases:
    g = torch.Generator().manual_seed(seed)
    layers = {i: torch.linalg.qr(torch.randn(64, 8, generator=g, dtype=torch.float64))[0].T.float() for i in (0, 1)}
    return Bases.from_tensors(layers, **META, calibration=f"seed {seed}")


def artifact_files(folder: Path, seed: int) -> dict[str, bytes]:
    make_bases(seed).save_pretrained(folder)
    return {name: (folder / name).read_bytes() for name in ARTIFACT_FILES}


def load_in_subprocess(env: dict, *calls: tuple[str, dict]) -> list[dict]:
    """Bases.from_pretrained(source, **kwargs) for each call, in one fresh interpreter with `env`;
    returns each load's calibration name, or its BasesError message."""
    code = (
        "import json, sys\n"
        "from hf_varrate import Bases, BasesError\n"
        "for source, kwargs in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        print(json.dumps({'calibration': Bases.from_pretrained(source, **kwargs).metadata['calibration']}))\n"
        "    except BasesError as e:\n"
        "        print(json.dumps({'error': str(e)}))\n"
    )
    return run_python(code, env, json.dumps(calls))


# the model card ----------------------------------------------------------------------------------------
def test_card_parses_and_names_the_base_model(tmp_path):
    bases = make_bases(0)
    bases.metadata["quality"] = {
        "budget": 0.2, "data": "held-out text", "num_contexts": 2, "context_length": 2048,
        "calibrated": {"keys": 0.1234, "values": 0.2345, "footprint": 0.2011},
        "identity": {"keys": 0.5432, "values": 0.6543, "footprint": 0.2011},
    }
    bases.metadata["calibration_seconds"] = 12.5
    bases.save_pretrained(tmp_path)
    card = ModelCard.load(tmp_path / CARD_NAME)
    assert card.data.base_model == META["model_id"]
    assert card.data.library_name == "hf_varrate"
    assert card.data.license == "apache-2.0"
    assert "varrate" in card.data.tags
    assert "0.1234" in card.text and "0.5432" in card.text and "12.5 s" in card.text
    sha = json.loads((tmp_path / CONFIG_NAME).read_text())["sha256"][WEIGHTS_NAME]
    assert sha in card.text
    assert "$" not in card.text.replace("$ ", "")  # every placeholder was filled


def test_card_without_hub_id_has_no_base_model():
    card = ModelCard(render_card({**META, "model_id": "/some/local/folder", "license": None}))
    assert card.data.base_model is None
    assert "Not measured" in card.text
    assert card.data.license == "other"  # unknown: the Hub's value, not a guess


# offline: a hand-built HF cache --------------------------------------------------------------------------
def build_hf_cache(cache_dir: Path, files_by_commit: dict[str, dict[str, bytes]], refs: dict[str, str]) -> None:
    """The layout snapshot_download writes: blobs/<etag>, snapshots/<commit>/<file> -> blob, refs/<name>."""
    repo = cache_dir / ("models--" + REPO.replace("/", "--"))
    for commit, files in files_by_commit.items():
        for name, data in files.items():
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = repo / "snapshots" / commit / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    for ref, commit in refs.items():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)


def test_offline_load_from_the_hf_cache(tmp_path):
    cache = tmp_path / "hub"
    build_hf_cache(cache, {COMMIT_A: artifact_files(tmp_path / "a", 1), COMMIT_B: artifact_files(tmp_path / "b", 2)},
                   {"main": COMMIT_B, "v1": COMMIT_A})
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": "http://127.0.0.1:9"}
    main, tag, commit, missing = load_in_subprocess(
        env, (REPO, {}), (REPO, {"revision": "v1"}), (REPO, {"revision": COMMIT_A}), (REPO, {"revision": "v2"}))
    assert main == {"calibration": "seed 2"}
    assert tag == commit == {"calibration": "seed 1"}
    assert "not a local directory" in missing["error"] and "HF_HUB_OFFLINE" in missing["error"]


def test_local_files_only_uses_the_cache_dir_argument(tmp_path):
    build_hf_cache(tmp_path / "hub", {COMMIT_A: artifact_files(tmp_path / "a", 3)}, {"main": COMMIT_A})
    bases = Bases.from_pretrained(REPO, cache_dir=tmp_path / "hub", local_files_only=True)
    assert bases.metadata["calibration"] == "seed 3"
    with pytest.raises(BasesError, match="getting it from the Hub"):
        Bases.from_pretrained("varrate-test/absent", cache_dir=tmp_path / "hub", local_files_only=True)


def test_corrupt_file_in_the_hf_cache_is_caught(tmp_path):
    files = artifact_files(tmp_path / "a", 4)
    files[WEIGHTS_NAME] = files[WEIGHTS_NAME][:-10]
    build_hf_cache(tmp_path / "hub", {COMMIT_A: files}, {"main": COMMIT_A})
    with pytest.raises(BasesError, match="sha256"):
        Bases.from_pretrained(REPO, cache_dir=tmp_path / "hub", local_files_only=True)


# online: a local server speaking the Hub endpoints (tests/fake_hub.py) ---------------------------------
@pytest.fixture
def served(tmp_path):
    """A fake Hub serving REPO: main (seed 12, plus a file never downloaded) and tag v1 (seed 11)."""
    with FakeHubServer() as hub:
        repo = hub.create_repo(REPO)
        first = hub.commit(repo, "main", artifact_files(tmp_path / "a", 11), "seed 11")
        repo.refs["v1"] = first
        hub.commit(repo, "main", {**artifact_files(tmp_path / "b", 12), "other.bin": b"never downloaded"}, "seed 12")
        yield hub, first


def test_download_and_revision_pinning_through_snapshot_download(tmp_path, served):
    hub, first = served
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "0"}
    main, tag, commit, missing, wrong_folder = load_in_subprocess(
        env, (REPO, {}), (REPO, {"revision": "v1"}), (REPO, {"revision": first}), (REPO, {"revision": "v9"}),
        (REPO, {"subfolder": "nothing-here"}))
    assert main == {"calibration": "seed 12"}
    assert tag == commit == {"calibration": "seed 11"}
    assert any(line.startswith(f"GET /{REPO}/resolve/{first}/{WEIGHTS_NAME}") for line in hub.log)
    assert not any("other.bin" in line for line in hub.log)  # only the artifact files are fetched
    assert "not a local directory" in missing["error"] and "RevisionNotFound" in missing["error"]
    # a repo (or subfolder) without bases names what is missing and where
    assert "holds no bases.safetensors or config.json" in wrong_folder["error"]
    assert "subfolder 'nothing-here'" in wrong_folder["error"]
    # what was downloaded is now served offline from the cache, refs included
    offline = {**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    assert load_in_subprocess(offline, (REPO, {"revision": "v1"}), (REPO, {})) == [
        {"calibration": "seed 11"}, {"calibration": "seed 12"}]


@pytest.mark.parametrize("subfolder", ["/abs", "../up", "a\\b", 3])
def test_a_bad_subfolder_is_refused_naming_it(subfolder):
    with pytest.raises(ValueError, match="subfolder must be a relative path"):
        Bases.from_pretrained(REPO, subfolder=subfolder)


def test_a_path_that_is_neither_a_folder_nor_a_repo_id_is_a_bases_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BasesError, match="'a b' is not a local directory"):
        Bases.from_pretrained("a b")  # used to escape as huggingface_hub's HFValidationError
