"""Record what a client sends: an HTTP proxy in front of the daemon that appends each
JSON POST (its path, headers without credentials, and body) to a JSON-lines file, in
the form tests/test_agents.py replays, and passes the answer back as it streams.

    python tests/recordproxy.py --to http://127.0.0.1:11777 --out claude.jsonl --port 11778

then point the agent at port 11778 as its docs say (e.g. ANTHROPIC_BASE_URL).
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SECRET = frozenset(("authorization", "x-api-key", "cookie"))
HOP = frozenset(("connection", "keep-alive", "transfer-encoding", "host", "content-length"))


def serve(target: str, out: Path, port: int) -> ThreadingHTTPServer:
    where = urllib.parse.urlsplit(target)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            # Each request names itself (x-request-id), so the daemon's audit record of
            # it can be found: what it prefilled and reused.
            headers.setdefault("x-request-id", f"rec-{uuid.uuid4().hex}")
            if self.command == "POST":
                try:
                    parsed = json.loads(body)
                except ValueError:
                    parsed = None
                if parsed is not None:
                    kept = {k: v for k, v in headers.items()
                            if k not in SECRET | HOP | {"x-request-id"}}
                    line = json.dumps({"path": self.path, "headers": kept, "body": parsed,
                                       "request_id": headers["x-request-id"]},
                                      ensure_ascii=False)
                    with lock, out.open("a") as f:
                        f.write(line + "\n")
            upstream = http.client.HTTPConnection(where.hostname or "127.0.0.1",
                                                  where.port or 80, timeout=900)
            upstream.request(self.command, self.path, body or None,
                             {k: v for k, v in headers.items() if k not in HOP})
            answer = upstream.getresponse()
            self.send_response(answer.status)
            for k, v in answer.getheaders():
                if k.lower() not in HOP:
                    self.send_header(k, v)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            while chunk := answer.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            upstream.close()

        do_GET = do_POST = do_DELETE = _forward

        def log_message(self, format: str, *args: object) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--to", required=True, help="The daemon's HTTP base URL.")
    p.add_argument("--out", required=True, type=Path, help="JSON-lines file to append to.")
    p.add_argument("--port", type=int, default=11778)
    args = p.parse_args()
    serve(args.to, args.out, args.port).serve_forever()


if __name__ == "__main__":
    main()
