"""A loopback stand-in for the Hugging Face Hub HTTP API, so Hub tests run offline against the real client.

It implements only what `push_to_hub`, `from_pretrained` and `snapshot_download` use (model repos, one
branch `main`, files committed inline as "regular" blobs, no LFS/Xet), with the same paths, JSON fields,
headers and error codes (`X-Error-Code`) as huggingface.co, so `huggingface_hub` takes its normal code
paths. Bound to 127.0.0.1 on a free port; it shuts itself down after `max_lifetime_s` in any case.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
REV = r"(?P<rev>[^/]+)"  # URL-quoted by the client (`quote(rev, safe="")`)
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob: what the Hub reports as `oid` / `ETag` for a regular (non-LFS) file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    """A model repo: commits as full file snapshots (path -> bytes) and one ref per branch."""

    repo_id: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    created: float = field(default_factory=time.time)

    def commit(self, files: dict[str, bytes], message: str, branch: str = "main") -> str:
        parent = self.refs.get(branch, "")
        digest = hashlib.sha1(f"{parent}\n{message}\n{time.time_ns()}".encode())
        for path in sorted(files):
            digest.update(f"{path}:{git_blob_sha1(files[path])}\n".encode())
        sha = digest.hexdigest()
        self.commits[sha] = dict(files)
        self.refs[branch] = sha
        return sha

    def resolve(self, revision: str) -> str | None:
        """Branch name or full commit sha -> commit sha (None if unknown)."""
        return self.refs.get(revision) or (revision if revision in self.commits else None)


class HubError(Exception):
    """An HTTP error answered the way the Hub does (status, `X-Error-Code`, JSON body)."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class HubServer:
    """The fake Hub: repo storage, a request log, and the HTTP server thread serving them."""

    def __init__(self, token: str = "hf_dummy", max_lifetime_s: float = 120.0, max_body: int = 64 << 20,
                 user: str = "user") -> None:
        self.token, self.max_lifetime_s, self.max_body = token, max_lifetime_s, max_body
        self.user = user  # the token's account: a repo created without a namespace goes there, as on the Hub
        self.repos: dict[str, Repo] = {}
        self.log: list[str] = []  # "METHOD /path" of every request, in order
        self.unhandled: list[str] = []  # requests no route matched: the client used an endpoint we lack
        self.lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread | threading.Timer] = []
        self._stopped = threading.Event()
        self.url = ""  # http://127.0.0.1:<port>, set by start()

    def start(self) -> HubServer:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self.url = "http://{}:{}".format(*self._httpd.server_address[:2])
        serve = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        deadline = threading.Timer(self.max_lifetime_s, self.stop)  # never outlives a stuck test run
        deadline.daemon = True
        self._threads = [serve, deadline]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Idempotent and complete on return: serving stopped, socket closed, serving thread joined."""
        with self.lock:
            httpd, self._httpd = self._httpd, None
        if httpd is None:
            if self._threads:
                self._stopped.wait(timeout=10)  # a concurrent stop (the deadline timer) may still be closing
            return
        httpd.shutdown()
        httpd.server_close()
        self._threads[0].join(timeout=5)
        if threading.current_thread() is not self._threads[1]:
            self._threads[1].cancel()
        self._stopped.set()

    @property
    def running(self) -> bool:
        return bool(self._threads) and not self._stopped.is_set()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # Direct (non-HTTP) access, for test set-up and assertions.
    def seed(self, repo_id: str, files: dict[str, bytes], message: str = "seed") -> str:
        """Create `repo_id` (if needed) with `files` as a new commit on main; returns the commit sha."""
        with self.lock:
            repo = self.repos.setdefault(repo_id, Repo(repo_id))
            return repo.commit({".gitattributes": GITATTRIBUTES, **files}, message)

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return dict(repo.commits[repo.resolve(revision)])


class _Handler(BaseHTTPRequestHandler):
    """Routes one request to the Hub endpoint it mimics; answers errors like the Hub does."""

    hub: HubServer
    protocol_version = "HTTP/1.1"
    timeout = 10  # idle keep-alive connections end on their own

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base-class signature
        pass  # the request log lives in `hub.log`; keep pytest output clean

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # --- plumbing -------------------------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        parts = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        self.hub.log.append(f"{method} {parts.path}")
        try:
            body = self._read_body()
            for route_method, pattern, name in ROUTES:
                match = re.fullmatch(pattern, parts.path)
                if match and (method == route_method or (route_method == "GET" and method == "HEAD")):
                    params = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                    with self.hub.lock:
                        getattr(self, name)(body=body, **params)
                    return
            self.hub.unhandled.append(f"{method} {self.path}")
            raise HubError(404, f"no such endpoint in the loopback Hub: {method} {parts.path}")
        except HubError as err:
            headers = {**err.headers, **({"X-Error-Code": err.code} if err.code else {})}
            self._send(err.status, {"error": err.message}, headers={**headers, "X-Error-Message": err.message})

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise HubError(411, "chunked request bodies are not supported here")
        length = int(self.headers.get("Content-Length") or 0)
        if length > self.hub.max_body:
            raise HubError(413, f"request body of {length} bytes exceeds {self.hub.max_body}")
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, payload: Any = None, headers: dict[str, str] | None = None, raw: bytes | None = None):
        data = raw if raw is not None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream" if raw is not None else "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _check_token(self, write: bool) -> None:
        auth = self.headers.get("Authorization")
        if auth is None and not write:
            return
        if auth != f"Bearer {self.hub.token}":
            raise HubError(401, "Invalid credentials in Authorization header")

    def _repo(self, repo_id: str) -> Repo:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def _commit_of(self, repo: Repo, rev: str) -> str:
        sha = repo.resolve(rev)
        if sha is None:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return sha

    # --- endpoints ------------------------------------------------------------------------------
    def create_repo(self, body: bytes) -> None:
        """POST /api/repos/create: 409 with the url if it exists (the client accepts that with exist_ok)."""
        self._check_token(write=True)
        req = json.loads(body)
        if req.get("type", "model") != "model":
            raise HubError(400, "only model repos are supported here")
        repo_id = f"{req.get('organization') or self.hub.user}/{req['name']}"
        url = f"{self.hub.url}/{repo_id}"
        if repo_id in self.hub.repos:
            self._send(409, {"error": "You already created this model repo", "url": url})
            return
        repo = self.hub.repos[repo_id] = Repo(repo_id)
        repo.commit({".gitattributes": GITATTRIBUTES}, "initial commit")
        self._send(200, {"url": url, "name": repo_id, "id": repo_id})

    def validate_yaml(self, body: bytes) -> None:
        """POST /api/validate-yaml: 400 with `errors` if the README front matter is not a YAML mapping."""
        content = json.loads(body)["content"]
        match = re.match(r"^---\n(.*?)\n---", content, re.S)
        try:
            meta = yaml.safe_load(match.group(1)) if match else {}
            if not isinstance(meta, dict):
                raise ValueError("metadata is not a mapping")
        except (yaml.YAMLError, ValueError) as err:
            self._send(400, {"errors": [{"message": str(err)}], "warnings": []})
            return
        self._send(200, {"errors": [], "warnings": []})

    def preupload(self, body: bytes, repo: str, rev: str) -> None:
        """POST /api/models/{repo}/preupload/{rev}: every file "regular" so its bytes come inline in the commit."""
        self._check_token(write=True)
        target = self._repo(repo)
        sha = self._commit_of(target, rev)
        files = target.commits[sha]
        answer = [
            {
                "path": f["path"],
                "uploadMode": "regular",
                "shouldIgnore": False,
                "oid": git_blob_sha1(files[f["path"]]) if f["path"] in files else None,
            }
            for f in json.loads(body)["files"]
        ]
        self._send(200, {"files": answer, "commitOid": sha})

    def commit(self, body: bytes, repo: str, rev: str) -> None:
        """POST /api/models/{repo}/commit/{rev}: NDJSON header + base64 files / deletions -> a new commit."""
        self._check_token(write=True)
        target = self._repo(repo)
        parent = self._commit_of(target, rev)
        if rev not in target.refs or self.query.get("create_pr"):
            raise HubError(400, "only commits to an existing branch are supported here")
        files = dict(target.commits[parent])
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "commit payload must start with a header line")
        header = lines[0]["value"]
        if header.get("parentCommit") not in (None, parent):
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        for op in lines[1:]:
            key, value = op["key"], op["value"]
            if key == "file" and value.get("encoding") == "base64":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                files.pop(value["path"])
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                files = {p: d for p, d in files.items() if not p.startswith(prefix)}
            else:
                raise HubError(400, f"unsupported commit operation {key!r} (this Hub only accepts inline files)")
        sha = target.commit(files, header["summary"], branch=rev)
        url = f"{self.hub.url}/{target.repo_id}/commit/{sha}"
        self._send(200, {"success": True, "commitOid": sha, "commitUrl": url, "pullRequestUrl": None})

    def model_info(self, body: bytes, repo: str, rev: str = "main") -> None:
        """GET /api/models/{repo}[/revision/{rev}]: the ModelInfo JSON (`sha`, `siblings`, ...)."""
        self._check_token(write=False)
        target = self._repo(repo)
        sha = self._commit_of(target, rev)
        files = target.commits[sha]
        blobs = self.query.get("blobs", "").lower() == "true"
        siblings = [
            {"rfilename": p, **({"size": len(d), "blobId": git_blob_sha1(d)} if blobs else {})}
            for p, d in sorted(files.items())
        ]
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(target.created))
        info = {
            "_id": hashlib.sha1(repo.encode()).hexdigest()[:24],
            "id": repo,
            "modelId": repo,
            "author": repo.split("/")[0],
            "sha": sha,
            "lastModified": stamp,
            "createdAt": stamp,
            "private": False,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
        }
        self._send(200, info)

    def tree(self, body: bytes, repo: str, rev: str, path: str = "") -> None:
        """GET /api/models/{repo}/tree/{rev}[/{path}]: files (git oid, size) and folders, one page."""
        self._check_token(write=False)
        target = self._repo(repo)
        files = target.commits[self._commit_of(target, rev)]
        recursive = self.query.get("recursive", "").lower() == "true"
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        entries: dict[str, dict[str, Any]] = {}
        for p, data in sorted(files.items()):
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix) :].split("/")
            for depth in range(1, len(rest)):  # the folders on the way
                folder = prefix + "/".join(rest[:depth])
                if recursive or depth == 1:
                    entries.setdefault(folder, {"type": "directory", "oid": "0" * 40, "size": 0, "path": folder})
            if recursive or len(rest) == 1:
                entries[p] = {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": p}
        if prefix and not entries:
            raise HubError(404, f"{path} does not exist on {rev}", "EntryNotFound")
        self._send(200, list(entries.values()))

    def resolve(self, body: bytes, repo: str, rev: str, path: str) -> None:
        """GET/HEAD /{repo}/resolve/{rev}/{path}: file bytes with ETag (git oid) and X-Repo-Commit."""
        self._check_token(write=False)
        target = self._repo(repo)
        sha = self._commit_of(target, rev)
        data = target.commits[sha].get(path)
        if data is None:
            raise HubError(404, "Entry not found", "EntryNotFound", headers={"X-Repo-Commit": sha})
        headers = {
            "ETag": f'"{git_blob_sha1(data)}"',
            "X-Repo-Commit": sha,
            "Accept-Ranges": "bytes",
            "Last-Modified": formatdate(target.created, usegmt=True),
        }
        self._send(200, headers=headers, raw=data)


ROUTES: list[tuple[str, str, str]] = [
    ("POST", r"/api/repos/create", "create_repo"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
    ("POST", rf"/api/models/{REPO}/preupload/{REV}", "preupload"),
    ("POST", rf"/api/models/{REPO}/commit/{REV}", "commit"),
    ("GET", rf"/api/models/{REPO}(?:/revision/{REV})?", "model_info"),
    ("GET", rf"/api/models/{REPO}/tree/{REV}(?:/(?P<path>.+))?", "tree"),
    ("GET", rf"/{REPO}/resolve/{REV}/(?P<path>.+)", "resolve"),
]
