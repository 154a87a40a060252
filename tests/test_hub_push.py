"""Bases pushed to a Hub and pulled back, end to end, through a local server speaking the Hub's upload and
download endpoints (tests/fake_hub.py): the real HfApi.create_commit up, the real snapshot_download down.

Pushes run in this process (HfApi reads `huggingface_hub.constants.ENDPOINT` when it is built, pointed at
the server here); pulls run in a fresh interpreter with HF_ENDPOINT set, as on another machine.
"""

from __future__ import annotations

import json

import pytest
from huggingface_hub import HfApi, ModelCard
from safetensors import safe_open

from hf_varrate import BasesError
from hf_varrate.bases import ARTIFACT_FILES, CARD_NAME, CONFIG_NAME, WEIGHTS_NAME, push_folder

from fake_hub import FakeHubServer
from test_hub import META, artifact_files, load_in_subprocess, make_bases

REPO = "me/tiny-bases"


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub.constants as constants

    with FakeHubServer() as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        yield server


def pulls(hub, tmp_path, *calls, **env):
    """`Bases.from_pretrained(REPO, **kwargs)` per call in one fresh process: calibration name or error."""
    return load_in_subprocess({"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hf-cache"), **env},
                              *[(REPO, kwargs) for kwargs in calls])


def test_push_then_load_in_a_fresh_process(hub, tmp_path):
    info = make_bases(1).push_to_hub(REPO, token="hf_test_token", private=True)
    repo = hub.repos[REPO]
    assert info.oid == repo.refs["main"] and repo.private
    files = repo.commits[info.oid]
    assert sorted(files) == sorted([".gitattributes", *ARTIFACT_FILES])
    assert "Bearer hf_test_token" in hub.tokens  # the token reached every call that needs it
    assert [line.split("?")[0] for line in hub.log if line.startswith("POST")] == [
        "POST /api/repos/create", "POST /api/validate-yaml", f"POST /api/models/{REPO}/preupload/main",
        f"POST /api/models/{REPO}/commit/main"]
    card = ModelCard(files[CARD_NAME].decode())
    assert card.data.base_model == META["model_id"] and card.data.library_name == "hf_varrate"
    assert card.data.license == "apache-2.0" and "kv-cache-compression" in card.data.tags
    assert f'VarRateCache.from_pretrained("{REPO}"' in card.text
    (tmp_path / "w.safetensors").write_bytes(files[WEIGHTS_NAME])
    with safe_open(tmp_path / "w.safetensors", "pt") as handle:
        header = handle.metadata()
    assert header["kind"] == "bases" and header["model_id"] == META["model_id"] and header["rank"] == "8"
    assert {"library", "library_version", "format_version"} <= set(header)
    assert pulls(hub, tmp_path, {}) == [{"calibration": "seed 1"}]


def test_a_folder_is_uploaded_byte_for_byte_and_a_second_identical_push_changes_nothing(hub, tmp_path):
    files = artifact_files(tmp_path, 2)
    first = push_folder(tmp_path, REPO, commit_message="first")
    stored = hub.repos[REPO].commits[first.oid]
    assert stored[WEIGHTS_NAME] == files[WEIGHTS_NAME] and stored[CONFIG_NAME] == files[CONFIG_NAME]
    second = push_folder(tmp_path, REPO)  # the preupload's oids say nothing changed: no new commit
    assert second.oid == first.oid and hub.repos[REPO].messages[first.oid] == "first"


def test_subfolders_hold_several_bases_in_one_repo(hub, tmp_path):
    make_bases(3).push_to_hub(REPO, subfolder="layer-set-a")
    make_bases(4).push_to_hub(REPO, subfolder="nested/b")
    files = hub.repos[REPO].commits[hub.repos[REPO].refs["main"]]
    assert {f"layer-set-a/{n}" for n in ARTIFACT_FILES} | {f"nested/b/{n}" for n in ARTIFACT_FILES} <= set(files)
    assert 'subfolder="nested/b"' in files[f"nested/b/{CARD_NAME}"].decode()
    a, b, root = pulls(hub, tmp_path, {"subfolder": "layer-set-a"}, {"subfolder": "nested/b"}, {})
    assert a == {"calibration": "seed 3"} and b == {"calibration": "seed 4"}
    assert "holds no bases.safetensors or config.json" in root["error"]


def test_revisions_branches_tags_and_commits_pin_what_is_loaded(hub, tmp_path):
    first = make_bases(5).push_to_hub(REPO)
    HfApi(endpoint=hub.url).create_tag(REPO, tag="v1")
    make_bases(6).push_to_hub(REPO)
    make_bases(7).push_to_hub(REPO, revision="experiment")  # the branch is created from main
    assert hub.repos[REPO].refs["experiment"] != hub.repos[REPO].refs["main"]
    main, tag, commit, branch, missing = pulls(
        hub, tmp_path, {}, {"revision": "v1"}, {"revision": first.oid}, {"revision": "experiment"},
        {"revision": "v9"})
    assert main == {"calibration": "seed 6"} and branch == {"calibration": "seed 7"}
    assert tag == commit == {"calibration": "seed 5"}
    assert "RevisionNotFound" in missing["error"] and "revision v9" in missing["error"]


def test_create_pr_lands_on_refs_pr_and_leaves_main_alone(hub, tmp_path):
    main_commit = make_bases(8).push_to_hub(REPO).oid
    info = make_bases(9).push_to_hub(REPO, create_pr=True, commit_message="better bases")
    assert info.pr_revision == "refs/pr/1" and info.pr_num == 1
    repo = hub.repos[REPO]
    assert repo.refs["main"] == main_commit and repo.refs["refs/pr/1"] == info.oid
    assert repo.messages[info.oid] == "better bases"
    assert any(line.endswith("commit/main?create_pr=1") for line in hub.log)
    assert pulls(hub, tmp_path, {}, {"revision": "refs/pr/1"}) == [{"calibration": "seed 8"},
                                                                   {"calibration": "seed 9"}]
    assert make_bases(10).push_to_hub(REPO, create_pr=True).pr_revision == "refs/pr/2"


def test_local_files_only_and_force_download_after_a_pull(hub, tmp_path):
    make_bases(11).push_to_hub(REPO)
    assert pulls(hub, tmp_path, {}) == [{"calibration": "seed 11"}]
    # offline from the HF cache: no server, the cached files verified as on the first load
    dead = {"HF_ENDPOINT": "http://127.0.0.1:9"}
    assert load_in_subprocess({"HF_HUB_CACHE": str(tmp_path / "hf-cache"), **dead}, (REPO, {"local_files_only": True})
                              ) == [{"calibration": "seed 11"}]
    # a cached file damaged after the pull: caught on load; force_download fetches it again
    [blob] = [p for p in (tmp_path / "hf-cache").rglob(WEIGHTS_NAME)]
    blob.resolve().write_bytes(blob.resolve().read_bytes()[:-4] + b"\0\0\0\0")
    downloads = sum(line.startswith(f"GET /{REPO}/resolve/") for line in hub.log)
    damaged, repaired = pulls(hub, tmp_path, {}, {"force_download": True})
    assert "sha256" in damaged["error"] and "corrupt" in damaged["error"]
    assert repaired == {"calibration": "seed 11"}
    assert sum(line.startswith(f"GET /{REPO}/resolve/") for line in hub.log) > downloads


def test_a_corrupted_file_on_the_hub_is_caught_on_load(hub, tmp_path):
    make_bases(12).push_to_hub(REPO)
    other = artifact_files(tmp_path / "other", 13)[WEIGHTS_NAME]  # a valid tensor file, but not this config's
    HfApi(endpoint=hub.url).upload_file(path_or_fileobj=other, path_in_repo=WEIGHTS_NAME, repo_id=REPO,
                                        commit_message="replace the tensors only")
    [result] = pulls(hub, tmp_path, {})
    assert "sha256" in result["error"] and "corrupt or was changed" in result["error"]


def test_push_refuses_a_corrupt_folder_before_any_hub_call(hub, tmp_path):
    artifact_files(tmp_path, 14)
    (tmp_path / WEIGHTS_NAME).write_bytes(b"garbage")
    with pytest.raises(BasesError, match="sha256"):
        push_folder(tmp_path, REPO)
    assert hub.log == []


def test_cli_push(hub, tmp_path, capsys):
    from hf_varrate.cli import main

    artifact_files(tmp_path, 15)
    assert main(["push", str(tmp_path), REPO, "--private", "--revision", "v2-bases", "--message", "cli"]) == 0
    assert "pushed" in capsys.readouterr().out
    repo = hub.repos[REPO]
    assert repo.private and repo.messages[repo.refs["v2-bases"]] == "cli"
    assert json.loads(repo.commits[repo.refs["v2-bases"]][CONFIG_NAME])["calibration"] == "seed 15"
    assert main(["push", str(tmp_path), REPO, "--subfolder", "cli-sub", "--create-pr"]) == 0
    assert "refs/pr/1" in repo.refs and f"cli-sub/{CONFIG_NAME}" in repo.commits[repo.refs["refs/pr/1"]]
