"""A local stand-in for the Hugging Face hub's download and repo-info routes, for hub tests.

Serves ``/{owner}/{repo}/resolve/{revision}/{file}`` (HEAD and GET with Range) with
the headers huggingface-hub reads (X-Repo-Commit, ETag, Content-Length), the model-info
route ``/api/models/{owner}/{repo}[/revision/{revision}]`` (the commit and its files
with their sizes), and the hub's X-Error-Code 404s. ``drop_first_get`` cuts the first body transfer half-way, as a
dropped connection would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class FakeHub:
    files: dict[tuple[str, str, str], bytes] = field(default_factory=dict)  # repo, commit, file
    branches: dict[tuple[str, str], str] = field(default_factory=dict)  # repo, branch -> commit
    drop_first_get: bool = False
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Range
    server: ThreadingHTTPServer | None = None

    def add(self, repo: str, commit: str, name: str, data: bytes, branch: str = "main") -> None:
        self.files[(repo, commit, name)] = data
        self.branches[(repo, branch)] = commit

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _fail(self, code: str) -> None:
                self.send_response(404)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _info(self, parts: list[str]) -> None:
                repo = "/".join(parts[2:4])
                rev = parts[5] if len(parts) > 5 and parts[4] == "revision" else "main"
                if not any(r == repo for r, _, _ in hub.files):
                    return self._fail("RepoNotFound")
                commit = hub.branches.get((repo, rev), rev)
                files = [(n, len(d)) for (r, c, n), d in hub.files.items()
                         if r == repo and c == commit]
                if not files:
                    return self._fail("RevisionNotFound")
                data = json.dumps({"id": repo, "sha": commit, "siblings": [
                    {"rfilename": n, "size": size} for n, size in sorted(files)]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _serve(self, body: bool) -> None:
                hub.requests.append((self.command, self.path, self.headers.get("Range")))
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    return self._info(parts)
                if len(parts) < 5 or parts[2] != "resolve":
                    return self._fail("RepoNotFound")
                repo, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                if not any(r == repo for r, _, _ in hub.files):
                    return self._fail("RepoNotFound")
                commit = hub.branches.get((repo, rev), rev)
                if not any(r == repo and c == commit for r, c, _ in hub.files):
                    return self._fail("RevisionNotFound")
                data = hub.files.get((repo, commit, name))
                if data is None:
                    return self._fail("EntryNotFound")
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0] or 0)
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if not body:
                    return
                if hub.drop_first_get:
                    hub.drop_first_get = False
                    self.wfile.write(data[start : start + (len(data) - start) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)  # a dropped connection mid-body
                    return
                self.wfile.write(data[start:])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@contextlib.contextmanager
def serving(server: FakeHub, monkeypatch: Any) -> Iterator[FakeHub]:
    """``server`` started and named as this test's hub (HF_ENDPOINT, online)."""
    server.start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    try:
        yield server
    finally:
        server.stop()
