"""A local HTTP server that speaks the Hugging Face Hub endpoints huggingface_hub's downloads and uploads use.

Read from the installed client (huggingface_hub 1.x and 2.x send the same requests):

- downloads (`snapshot_download`): GET api/models/{repo}/revision/{rev} (repo_info: the commit sha),
  GET api/models/{repo}/tree/{rev}[/{path}] (the file list, recursive), HEAD and GET
  {repo}/resolve/{rev}/{path} (X-Repo-Commit, ETag, Content-Length; no Xet or LFS headers, so plain
  downloads);
- uploads (`HfApi.create_repo`, `create_branch`, `create_tag`, `create_commit`): POST api/repos/create
  (409 if it exists), POST api/models/{repo}/branch/{branch} (409 if it exists), POST
  api/models/{repo}/tag/{rev}, POST api/validate-yaml (for a README.md), POST
  api/models/{repo}/preupload/{rev} (every file "regular", so no LFS or Xet upload follows; `oid` the
  git blob sha1 of the file already there, which lets the client skip unchanged files), and POST
  api/models/{repo}/commit/{rev} (NDJSON: a header line, then one line per file with its base64
  content; `?create_pr=1` puts the commit on a new refs/pr/N instead of the branch).

Revisions arrive URL-quoted in one path segment (`refs%2Fpr%2F1`), so paths are split before they are
unquoted. State lives in the `FakeHubServer` object (repos, their commits and refs, and a log of every
request), so a test can inspect what arrived, corrupt a stored file, or serve a hand-made repo.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

ROOT = Path(__file__).resolve().parents[1]
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def git_oid(data: bytes) -> str:
    """The git blob sha1 of `data` (what the Hub reports as a regular file's oid)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> {path: bytes}
    refs: dict[str, str] = field(default_factory=dict)  # branch, tag or refs/pr/N -> sha
    messages: dict[str, str] = field(default_factory=dict)  # sha -> commit summary
    private: bool = False
    prs: int = 0

    def resolve(self, revision: str) -> str | None:
        sha = self.refs.get(revision, revision)
        return sha if sha in self.commits else None


class FakeHubServer:
    """The server's state and its thread: `with FakeHubServer() as hub: ... hub.url ...`."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.log: list[str] = []  # "METHOD /path?query" of every request
        self.tokens: list[str | None] = []  # the Authorization header of every request
        self.lock = threading.Lock()
        self._count = 0
        handler = type("Handler", (FakeHubHandler,), {"hub": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def create_repo(self, repo_id: str, private: bool = False) -> Repo:
        repo = self.repos[repo_id] = Repo(private=private)
        self.commit(repo, "main", {".gitattributes": GITATTRIBUTES}, "initial commit")
        return repo

    def commit(self, repo: Repo, parent: str | None, files: dict[str, bytes], message: str, ref: str | None = None,
               deleted: tuple[str, ...] = ()) -> str:
        """A new commit: the files of `parent` (a revision), changed by `files` and `deleted`, at `ref`."""
        with self.lock:
            self._count += 1
            base = dict(repo.commits[repo.resolve(parent)]) if parent and repo.resolve(parent) else {}
            base.update(files)
            for path in deleted:
                base.pop(path, None)
            sha = hashlib.sha1(f"{self._count}:{message}".encode() + json.dumps(sorted(base)).encode()).hexdigest()
            repo.commits[sha], repo.messages[sha] = base, message
            repo.refs[ref or parent or "main"] = sha
            return sha


class FakeHubHandler(BaseHTTPRequestHandler):
    hub: FakeHubServer

    def log_message(self, *args):  # keep pytest output clean
        pass

    # routing -------------------------------------------------------------------------------------------
    def do_HEAD(self):
        self._route()

    def do_GET(self):
        self._route()

    def do_POST(self):
        self._route()

    def _route(self):
        split = urlsplit(self.path)
        segments = [unquote(s) for s in split.path.split("/")[1:]]  # split first: revisions may hold '/'
        self.query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        self.body = self.rfile.read(length) if length else b""
        self.hub.log.append(f"{self.command} {unquote(split.path)}" + (f"?{split.query}" if split.query else ""))
        self.hub.tokens.append(self.headers.get("Authorization"))
        try:
            if segments[:1] == ["api"]:
                self._api(segments[1:])
            elif len(segments) >= 5 and segments[2] == "resolve":
                self._resolve("/".join(segments[:2]), segments[3], "/".join(segments[4:]))
            else:
                self._error(404, "RepoNotFound", "no such route")
        except Exception as exc:  # a bug in the fake: answer 500 so the client's error names it
            self._error(500, "ServerError", f"{type(exc).__name__}: {exc}")

    def _api(self, seg: list[str]):
        if self.command == "POST" and seg == ["repos", "create"]:
            return self._create_repo()
        if self.command == "POST" and seg == ["validate-yaml"]:
            return self._json({"errors": [], "warnings": []})
        if len(seg) < 4 or seg[0] != "models":
            return self._error(404, "RepoNotFound", "no such route")
        repo_id, action, rest = f"{seg[1]}/{seg[2]}", seg[3], seg[4:]
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
        handlers = {("GET", "revision"): self._revision, ("GET", "tree"): self._tree,
                    ("POST", "preupload"): self._preupload, ("POST", "commit"): self._commit,
                    ("POST", "branch"): self._branch, ("POST", "tag"): self._tag}
        handler = handlers.get(("GET" if self.command == "HEAD" else self.command, action))
        if handler is None or not rest:
            return self._error(404, "EntryNotFound", "no such route")
        handler(repo_id, repo, rest[0], "/".join(rest[1:]))

    # downloads -------------------------------------------------------------------------------------------
    def _revision(self, repo_id, repo, revision, _):
        sha = self._sha(repo, revision)
        if sha:
            siblings = [{"rfilename": name} for name in sorted(repo.commits[sha])]
            self._json({"id": repo_id, "modelId": repo_id, "sha": sha, "private": repo.private,
                        "siblings": siblings}, sha)

    def _tree(self, repo_id, repo, revision, path):
        sha = self._sha(repo, revision)
        if sha:
            prefix = f"{path}/" if path else ""
            self._json([{"type": "file", "path": name, "size": len(data), "oid": git_oid(data)}
                        for name, data in sorted(repo.commits[sha].items()) if name.startswith(prefix)], sha)

    def _resolve(self, repo_id, revision, path):
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
        sha = self._sha(repo, revision)
        if sha and path not in repo.commits[sha]:
            self._error(404, "EntryNotFound", f"{path} not found")
        elif sha:
            data = repo.commits[sha][path]
            self._send(200, data, sha, headers={"ETag": f'"{git_oid(data)}"'})

    # uploads ---------------------------------------------------------------------------------------------
    def _create_repo(self):
        payload = json.loads(self.body or b"{}")
        repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        if repo_id in self.hub.repos:  # the client reads `url` from the 409 too
            return self._send(409, json.dumps({"error": "You already created this model repo",
                                               "url": f"{self._endpoint()}/{repo_id}"}).encode(), None,
                              content_type="application/json")
        self.hub.create_repo(repo_id, private=payload.get("visibility") == "private" or bool(payload.get("private")))
        self._json({"url": f"{self._endpoint()}/{repo_id}", "name": repo_id})

    def _branch(self, repo_id, repo, branch, _):
        if branch in repo.refs:
            return self._error(409, None, f"Reference already exists: {branch}")
        start = json.loads(self.body or b"{}").get("startingPoint") or "main"
        sha = self._sha(repo, start)
        if sha:
            repo.refs[branch] = sha
            self._json({})

    def _tag(self, repo_id, repo, revision, _):
        sha = self._sha(repo, revision)
        if sha:
            repo.refs[json.loads(self.body)["tag"]] = sha
            self._json({})

    def _preupload(self, repo_id, repo, revision, _):
        sha = repo.resolve(revision) if not self.query.get("create_pr") else repo.resolve("main")
        existing = repo.commits.get(sha, {})
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                  "oid": git_oid(existing[f["path"]]) if f["path"] in existing else None}
                 for f in json.loads(self.body)["files"]]
        self._json({"files": files, "commitOid": sha})

    def _commit(self, repo_id, repo, revision, _):
        lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        files, deleted = {}, []
        for line in lines:
            if line["key"] == "file":
                files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
            elif line["key"] == "deletedFile":
                deleted.append(line["value"]["path"])
            elif line["key"] != "header":
                return self._error(400, None, f"this fake Hub does not take {line['key']!r} operations")
        if not self._sha(repo, revision):
            return
        parent = header.get("parentCommit")
        if parent and not self.query.get("create_pr") and repo.resolve(revision) != parent:
            return self._error(412, None, "A commit has happened since. Please refresh and try again.")
        pr_url = None
        if self.query.get("create_pr"):
            repo.prs += 1
            ref = f"refs/pr/{repo.prs}"
            repo.refs[ref] = repo.resolve(parent or revision)
            sha = self.hub.commit(repo, ref, files, header["summary"], ref=ref, deleted=tuple(deleted))
            pr_url = f"{self._endpoint()}/{repo_id}/discussions/{repo.prs}"
        else:
            sha = self.hub.commit(repo, revision, files, header["summary"], ref=revision, deleted=tuple(deleted))
        self._json({"success": True, "commitOid": sha, "commitUrl": f"{self._endpoint()}/{repo_id}/commit/{sha}",
                    "pullRequestUrl": pr_url})

    # answers ---------------------------------------------------------------------------------------------
    def _sha(self, repo: Repo, revision: str) -> str | None:
        sha = repo.resolve(revision)
        if sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return sha

    def _endpoint(self) -> str:
        return self.hub.url

    def _json(self, payload, sha: str | None = None):
        self._send(200, json.dumps(payload).encode(), sha, content_type="application/json")

    def _error(self, status: int, code: str | None, message: str):
        self._send(status, json.dumps({"error": message}).encode(), None, content_type="application/json",
                   headers={"X-Error-Code": code, "X-Error-Message": message} if code else {})

    def _send(self, status, data: bytes, sha, content_type="application/octet-stream", headers=None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if sha:
            self.send_header("X-Repo-Commit", sha)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def run_python(code: str, env: dict, *args: str, timeout: float = 600) -> list:
    """Run `code` in a fresh interpreter with `env` added (huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE and
    HF_HUB_OFFLINE when it is imported, so a pull from the fake Hub runs in its own process); the JSON of
    each line it prints to stdout that starts with '{' or '['."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_DISABLE_TELEMETRY": "1",
                "HF_HUB_DISABLE_PROGRESS_BARS": "1", **env}
    done = subprocess.run([sys.executable, "-c", code, *args], env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith(("{", "["))]
