"""Web pages cannot use the daemon's HTTP API: DNS rebinding (a foreign Host), a
cross-origin request without an allowed Origin and a non-JSON body are refused; an
allowed Origin gets CORS headers and its preflight answered."""

from __future__ import annotations

import http.client
import json

import pytest
from conftest import SpawnDaemon

from everycycle.client import SyncClient

BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 2}).encode()


def request(url: str, method: str, path: str, headers: dict[str, str],
            body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    host, _, port = url.removeprefix("http://").rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.putrequest(method, path, skip_host="host" in {k.lower() for k in headers})
        for key, value in headers.items():
            conn.putheader(key, value)
        if body is not None:
            conn.putheader("content-length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


@pytest.fixture
def url(spawn_daemon: SpawnDaemon) -> str:
    spawn_daemon("--http", "127.0.0.1:0", "--cors-origin", "http://localhost:3000",
                 "--allow-host", "box.lan")
    with SyncClient() as c:
        found = c.describe_fleet().http
    assert found is not None
    return found


JSON = {"content-type": "application/json"}


def test_a_rebinding_host_is_refused_and_loopback_names_are_not(url: str) -> None:
    port = url.rpartition(":")[2]
    status, _, body = request(url, "GET", "/v1/models", {"Host": f"evil.example:{port}"})
    assert status == 403 and b"evil.example" in body
    status, _, _ = request(url, "POST", "/v1/chat/completions",
                           {"Host": "evil.example", **JSON}, BODY)
    assert status == 403
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "box.lan"):
        status, _, _ = request(url, "GET", "/v1/models", {"Host": host})
        assert status == 200, host


def test_a_cross_origin_post_without_an_allowed_origin_is_refused(url: str) -> None:
    for origin in ("http://evil.example", "null", "http://localhost:3001"):
        status, headers, body = request(url, "POST", "/v1/chat/completions",
                                        {"Origin": origin, **JSON}, BODY)
        assert status == 403, origin
        assert "access-control-allow-origin" not in headers
        assert json.loads(body)["error"]["message"].startswith("origin")
    status, _, _ = request(url, "OPTIONS", "/v1/chat/completions",
                           {"Origin": "http://evil.example",
                            "Access-Control-Request-Method": "POST"})
    assert status == 403


def test_an_allowed_origin_gets_cors_headers_and_its_preflight_answered(url: str) -> None:
    origin = {"Origin": "http://localhost:3000"}
    status, headers, _ = request(url, "OPTIONS", "/v1/chat/completions",
                                 {**origin, "Access-Control-Request-Method": "POST",
                                  "Access-Control-Request-Headers": "content-type"})
    assert status == 200
    assert headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in headers["access-control-allow-methods"]
    assert "content-type" in headers["access-control-allow-headers"]
    status, headers, body = request(url, "POST", "/v1/chat/completions", {**origin, **JSON},
                                    BODY)
    assert status == 200, body
    assert headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "x-request-id" in headers["access-control-expose-headers"]


def test_a_json_body_sent_as_text_or_a_form_is_refused(url: str) -> None:
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        status, _, body = request(url, "POST", "/v1/chat/completions",
                                  {"Content-Type": kind}, BODY)
        assert status == 415, kind
        assert "application/json" in json.loads(body)["error"]["message"]
    status, _, _ = request(url, "POST", "/v1/chat/completions",
                           {"Content-Type": "application/json; charset=utf-8"}, BODY)
    assert status == 200


def test_ollamas_routes_take_curls_form_type_but_not_from_a_page(url: str) -> None:
    body = json.dumps({"model": "tiny", "prompt": "hi", "stream": False,
                       "options": {"num_predict": 2}}).encode()
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, _, _ = request(url, "POST", "/api/generate", form, body)
    assert status == 200
    status, _, _ = request(url, "POST", "/api/generate",
                           {**form, "Origin": "http://localhost:3000"}, body)
    assert status == 415
    status, _, _ = request(url, "POST", "/api/generate", {"Content-Type": "text/plain"}, body)
    assert status == 415
    status, _, _ = request(url, "POST", "/v1/chat/completions", form, BODY)
    assert status == 415
