"""Bases on the Hub: the model card, offline loads from the HF cache, downloads and pinned revisions
from a local HTTP server speaking the Hub endpoints snapshot_download uses, and push up to HfApi.

Hub settings (HF_ENDPOINT, HF_HUB_OFFLINE) are read when huggingface_hub is imported, so the
loads run in a subprocess with the environment set, through the real snapshot_download.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import torch
from huggingface_hub import ModelCard

from hf_varrate import Bases, BasesError
from hf_varrate.bases import ARTIFACT_FILES, CARD_NAME, CONFIG_NAME, WEIGHTS_NAME
from hf_varrate.bases import push_folder
from hf_varrate.card import render_card

ROOT = Path(__file__).resolve().parents[1]
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
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(calls)], env=full_env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(calls):]]


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
    card = ModelCard(render_card({**META, "model_id": "/some/local/folder"}))
    assert card.data.base_model is None
    assert "Not measured" in card.text


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


# online: a local server speaking the Hub endpoints ------------------------------------------------------
class FakeHub(BaseHTTPRequestHandler):
    """GET api/models/{repo}/revision/{rev}, GET api/models/{repo}/tree/{rev}, HEAD/GET {repo}/resolve/{rev}/{file}."""

    commits: dict[str, dict[str, bytes]] = {}
    refs: dict[str, str] = {}
    log: list[str] = []

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_HEAD(self):
        self._answer(body=False)

    def do_GET(self):
        self._answer(body=True)

    def _answer(self, body: bool):
        path = unquote(urlsplit(self.path).path)
        self.log.append(f"{self.command} {path}")
        prefix = f"/api/models/{REPO}/"
        if path.startswith(prefix + "revision/"):
            commit = self._commit(path.removeprefix(prefix + "revision/"))
            if commit:
                siblings = [{"rfilename": name} for name in sorted(self.commits[commit])]
                self._json({"id": REPO, "modelId": REPO, "sha": commit, "siblings": siblings}, commit)
        elif path.startswith(prefix + "tree/"):
            commit = self._commit(path.removeprefix(prefix + "tree/"))
            if commit:
                self._json([{"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
                            for name, data in sorted(self.commits[commit].items())], commit)
        elif path.startswith(f"/{REPO}/resolve/"):
            revision, _, name = path.removeprefix(f"/{REPO}/resolve/").partition("/")
            commit = self._commit(revision)
            if commit and name not in self.commits[commit]:
                self._error(404, "EntryNotFound")
            elif commit:
                data = self.commits[commit][name]
                self._send(200, data if body else b"", commit, etag=hashlib.sha256(data).hexdigest(), size=len(data))
        else:
            self._error(404, "RepoNotFound")

    def _commit(self, revision: str) -> str | None:
        commit = self.refs.get(revision, revision)
        if commit not in self.commits:
            self._error(404, "RevisionNotFound")
            return None
        return commit

    def _json(self, payload, commit):
        self._send(200, json.dumps(payload).encode(), commit, content_type="application/json")

    def _error(self, status: int, code: str):
        self._send(status, json.dumps({"error": code}).encode(), None, content_type="application/json", code=code)

    def _send(self, status, data, commit, etag=None, size=None, content_type="application/octet-stream", code=None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(size if size is not None else len(data)))
        if commit:
            self.send_header("X-Repo-Commit", commit)
        if etag:
            self.send_header("ETag", f'"{etag}"')
        if code:
            self.send_header("X-Error-Code", code)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture
def fake_hub(tmp_path):
    FakeHub.commits = {COMMIT_A: artifact_files(tmp_path / "a", 11), COMMIT_B: artifact_files(tmp_path / "b", 12)}
    FakeHub.commits[COMMIT_B]["other.bin"] = b"never downloaded"
    FakeHub.refs = {"main": COMMIT_B, "v1": COMMIT_A}
    FakeHub.log = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_download_and_revision_pinning_through_snapshot_download(tmp_path, fake_hub):
    env = {"HF_ENDPOINT": fake_hub, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "0"}
    main, tag, commit, missing = load_in_subprocess(
        env, (REPO, {}), (REPO, {"revision": "v1"}), (REPO, {"revision": COMMIT_A}), (REPO, {"revision": "v9"}))
    assert main == {"calibration": "seed 12"}
    assert tag == commit == {"calibration": "seed 11"}
    assert any(line.startswith(f"GET /{REPO}/resolve/{COMMIT_A}/{WEIGHTS_NAME}") for line in FakeHub.log)
    assert not any("other.bin" in line for line in FakeHub.log)  # only the artifact files are fetched
    assert "not a local directory" in missing["error"] and "RevisionNotFound" in missing["error"]
    # what was downloaded is now served offline from the cache, refs included
    offline = {**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    assert load_in_subprocess(offline, (REPO, {"revision": "v1"}), (REPO, {})) == [
        {"calibration": "seed 11"}, {"calibration": "seed 12"}]


# push: up to the HfApi calls -----------------------------------------------------------------------------
class RecordingApi:
    calls: list[tuple[str, dict]] = []
    uploaded: dict[str, bytes] = {}

    def __init__(self, token=None, **kwargs):
        self.calls.append(("init", {"token": token}))

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", {"repo_id": repo_id, **kwargs}))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        RecordingApi.uploaded = {p.name: p.read_bytes() for p in Path(kwargs["folder_path"]).iterdir()}
        return "commit-info"


@pytest.fixture
def recording_api(monkeypatch):
    import huggingface_hub

    RecordingApi.calls, RecordingApi.uploaded = [], {}
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    return RecordingApi


def test_push_folder_creates_the_repo_and_uploads_the_three_files(tmp_path, recording_api):
    files = artifact_files(tmp_path, 5)
    result = push_folder(tmp_path, "me/bases", private=True, revision="exp", token="hf_x")
    assert result == "commit-info"
    names = [name for name, _ in recording_api.calls]
    assert names == ["init", "create_repo", "create_branch", "upload_folder"]
    assert recording_api.calls[0][1] == {"token": "hf_x"}
    assert recording_api.calls[1][1] == {"repo_id": "me/bases", "private": True, "repo_type": "model", "exist_ok": True}
    assert recording_api.calls[2][1]["branch"] == "exp"
    upload = recording_api.calls[3][1]
    assert upload["repo_id"] == "me/bases" and upload["revision"] == "exp"
    assert sorted(recording_api.uploaded) == sorted(ARTIFACT_FILES)
    assert recording_api.uploaded[WEIGHTS_NAME] == files[WEIGHTS_NAME]  # byte for byte
    assert recording_api.uploaded[CONFIG_NAME] == files[CONFIG_NAME]
    assert 'VarRateCache.from_pretrained("me/bases"' in recording_api.uploaded[CARD_NAME].decode()


def test_push_to_hub_from_memory_and_no_branch_without_revision(recording_api):
    make_bases(6).push_to_hub("me/bases2")
    names = [name for name, _ in recording_api.calls]
    assert names == ["init", "create_repo", "upload_folder"]
    assert sorted(recording_api.uploaded) == sorted(ARTIFACT_FILES)


def test_push_refuses_a_corrupt_folder_before_any_hub_call(tmp_path, recording_api):
    artifact_files(tmp_path, 7)
    (tmp_path / WEIGHTS_NAME).write_bytes(b"garbage")
    with pytest.raises(BasesError, match="sha256"):
        push_folder(tmp_path, "me/bases")
    assert recording_api.calls == []


def test_cli_push(tmp_path, recording_api, capsys):
    from hf_varrate.cli import main

    artifact_files(tmp_path, 8)
    assert main(["push", str(tmp_path), "me/bases3", "--private"]) == 0
    assert "pushed" in capsys.readouterr().out
    assert recording_api.calls[1][1]["private"] is True


def test_a_path_that_is_neither_a_folder_nor_a_repo_id_is_a_bases_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BasesError, match="'a b' is not a local directory"):
        Bases.from_pretrained("a b")  # used to escape as huggingface_hub's HFValidationError
