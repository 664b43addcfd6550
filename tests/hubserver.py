"""A small stand-in for the Hugging Face Hub on 127.0.0.1, for tests (no hub is reachable here).

It answers what huggingface_hub asks for the calls ctxq makes: the model info with its files and
sizes (`/api/models/REPO[/revision/REV]`), the file tree snapshot_download lists
(`/api/models/REPO/tree/REV`), `HEAD`/`GET` of `/REPO/resolve/REV/PATH` (large files
redirect to `/cdn/...` as the Hub redirects to its CDN; small ones answer directly) with `ETag`,
`X-Repo-Commit`, `X-Linked-Size`, and `Range` requests (206). Private and gated repos answer 401
without a token as the Hub does. It counts the requests and the body bytes it serves; it is
bounded: after `max_requests` it answers 503 and stops, and it stops by itself after `lifetime` s.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LARGE = (".gguf", ".safetensors")  # stored in LFS on the Hub: served through a redirect
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class Repo:
    commit: str
    files: dict[str, Path]
    access: str = "public"  # "public", "gated" or "private"


@dataclass
class HubServer:
    max_requests: int = 400
    lifetime: float = 300.0
    token: str = "hf_test_token"
    repos: dict[str, Repo] = field(default_factory=dict)
    log: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Range
    bytes_served: int = 0
    no_range: set[str] = field(default_factory=set)  # paths served whole, Range ignored (some proxies do)
    stall: dict[str, int] = field(default_factory=dict)  # path -> the next full GET of it sends N bytes, then hangs
    hold: dict[str, threading.Event] = field(default_factory=dict)  # path -> its next range GET waits for the event,
    # then closes the connection unanswered (a header read that a user stops midway)

    def add_repo(self, repo: str, files: dict[str, Path], access: str = "public") -> str:
        commit = hashlib.sha1(repo.encode()).hexdigest()  # a commit-shaped id (40 hex digits)
        self.repos[repo] = Repo(commit, dict(files), access)
        return commit

    def start(self) -> "HubServer":
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        self._timer = threading.Timer(self.lifetime, self.stop)
        self._timer.daemon = True
        self._timer.start()
        self._release = threading.Event()  # ends a stalled transfer
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def stop(self) -> None:
        self._timer.cancel()
        self._release.set()
        threading.Thread(target=self._httpd.shutdown, daemon=True).start()

    def reset_counts(self) -> None:
        self.log.clear()
        self.bytes_served = 0

    def served(self, path_part: str) -> int:
        """How many requests asked for a URL containing `path_part`."""
        return sum(path_part in p for _, p, _ in self.log)


def _etag(path: Path) -> str:
    """The file's sha256 as the Hub gives LFS files, for small files; a stand-in for sparse giants."""
    if path.stat().st_size > 256 << 20:
        return hashlib.sha256(f"{path}:{path.stat().st_size}".encode()).hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def do_HEAD(self):
            self._serve(head=True)

        def do_GET(self):
            self._serve(head=False)

        def _serve(self, head: bool):
            with hub._lock:
                hub.log.append((self.command, self.path, self.headers.get("Range")))
                over = len(hub.log) > hub.max_requests
            if over:
                hub.stop()
                return self._send(503, b"request budget spent", {})
            path = unquote(urlsplit(self.path).path)
            if m := re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/(.+))?$", path):
                return self._api(m[1], m[2] or "main", head)
            if m := re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)$", path):  # list_repo_tree (snapshot_download)
                return self._tree(m[1], m[2], head)
            if m := re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path):
                return self._resolve(m[1], m[2], m[3], head)
            if m := re.match(r"^/cdn/([^/]+/[^/]+)/([0-9a-f]{40})/(.+)$", path):
                return self._file(hub.repos[m[1]].files[m[3]], m[3], m[2], head)
            self._send(404, b"not found", {})

        def _repo(self, name: str, rev: str) -> Repo | None:
            repo = hub.repos.get(name)
            authorized = self.headers.get("Authorization") == f"Bearer {hub.token}"
            if repo is None or (repo.access == "private" and not authorized):
                self._send(401 if repo else 404, b"", {"X-Error-Code": "RepoNotFound",
                                                       "X-Error-Message": "Repository not found"})
                return None
            if repo.access == "gated" and not authorized:
                self._send(401, b"", {"X-Error-Code": "GatedRepo",
                                      "X-Error-Message": "Access to model is restricted"})
                return None
            if rev not in ("main", repo.commit):
                self._send(404, b"", {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"})
                return None
            return repo

        def _api(self, name: str, rev: str, head: bool):
            repo = self._repo(name, rev)
            if repo is None:
                return
            siblings = [{"rfilename": p, "size": f.stat().st_size} for p, f in sorted(repo.files.items())]
            body = json.dumps({"id": name, "modelId": name, "sha": repo.commit, "private": repo.access == "private",
                               "gated": repo.access == "gated" and "auto", "siblings": siblings}).encode()
            self._send(200, b"" if head else body, {"Content-Type": "application/json"}, length=len(body))

        def _tree(self, name: str, rev: str, head: bool):
            repo = self._repo(name, rev)
            if repo is None:
                return
            entries = [{"type": "file", "path": p, "size": f.stat().st_size, "oid": _etag(f)}
                       | ({"lfs": {"oid": _etag(f), "size": f.stat().st_size, "pointerSize": 134}}
                          if p.endswith(LARGE) else {}) for p, f in sorted(repo.files.items())]
            body = json.dumps(entries).encode()
            self._send(200, b"" if head else body, {"Content-Type": "application/json"}, length=len(body))

        def _resolve(self, name: str, rev: str, file: str, head: bool):
            repo = self._repo(name, rev)
            if repo is None:
                return
            if file not in repo.files:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"})
            f = repo.files[file]
            common = {"X-Repo-Commit": repo.commit, "ETag": f'"{_etag(f)}"'}
            if file.endswith(LARGE):  # as the Hub: a redirect to the CDN carrying the file's metadata
                return self._send(302, b"", common | {"Location": f"/cdn/{name}/{repo.commit}/{file}",
                                                      "X-Linked-Size": str(f.stat().st_size),
                                                      "X-Linked-Etag": f'"{_etag(f)}"'})
            self._file(f, file, repo.commit, head, common)

        def _file(self, f: Path, file: str, commit: str, head: bool, extra: dict | None = None):
            size = f.stat().st_size
            start, end = 0, size
            rng = None if file in hub.no_range else _RANGE.match(self.headers.get("Range") or "")
            if rng:
                start = int(rng[1])
                end = min(size, int(rng[2]) + 1) if rng[2] else size
            headers = (extra or {}) | {"ETag": f'"{_etag(f)}"', "Accept-Ranges": "bytes", "X-Repo-Commit": commit}
            status = 200
            if rng:
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
            if head:
                return self._send(status, b"", headers, length=end - start)
            if rng and (held := hub.hold.pop(file, None)) is not None:
                held.wait(60)
                self.close_connection = True
                return
            stall = hub.stall.pop(file, None) if not rng else None
            self._send(status, None, headers, length=end - start)
            with open(f, "rb") as fh:
                fh.seek(start)
                left = end - start if stall is None else min(stall, end - start)
                while left > 0:
                    chunk = fh.read(min(left, 1 << 20))
                    self.wfile.write(chunk)
                    left -= len(chunk)
                    with hub._lock:
                        hub.bytes_served += len(chunk)
            if stall is not None:  # a transfer that hangs mid-body until the client goes (or 60 s pass)
                self.wfile.flush()
                hub._release.wait(60)
                self.close_connection = True

        def _send(self, status: int, body: bytes | None, headers: dict, length: int | None = None):
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body or b"") if length is None else length))
            self.end_headers()
            if body:
                self.wfile.write(body)
                with hub._lock:
                    hub.bytes_served += len(body)

    return Handler


def write_split(src: Path, folder: Path, prefix: str, count: int) -> list[Path]:
    """`src` split into `count` header-only shards named and keyed as llama.cpp's gguf-split writes
    them (PREFIX-0000i-of-0000n.gguf; split.no, split.count, split.tensors.count; the metadata in
    the first shard only)."""
    import gguf

    from ctxq.gguf.reader import read_gguf
    from ctxq.gguf.writer import write_sparse_gguf

    g = read_gguf(src)
    per = -(-len(g.tensors) // count)  # ceil: tensors per shard, the last takes what is left
    out = []
    for i in range(count):
        part = g.tensors[i * per:(i + 1) * per]

        def metadata(w, first=(i == 0), i=i):
            if first:
                for key, value in g.metadata.items():
                    if key not in ("general.architecture", "general.alignment"):
                        vtype, etype = g.value_types[key]
                        w.add_key_value(key, value, gguf.GGUFValueType(vtype),
                                        sub_type=gguf.GGUFValueType(etype) if etype is not None else None)
            w.add_uint16("split.no", i)
            w.add_uint16("split.count", count)
            w.add_int32("split.tensors.count", len(g.tensors))

        path = folder / f"{prefix}-{i + 1:05d}-of-{count:05d}.gguf"
        out.append(write_sparse_gguf(path, g.arch, [(t.name, t.shape, t.type) for t in part], metadata))
    return out
