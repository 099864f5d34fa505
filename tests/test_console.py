"""The web console in a real browser: Playwright driving Debian's Chromium (no browser
download) against a real daemon. A model loads live, a chat streams, three requests on
a one-slot model show their places, a Cancel on the page ends the CLI run that sent it
(exit 5), an Unload works; hostile names and prompts show as text; a page of another
origin can neither load nor cancel anything."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonhelp import EC, wait_until
from httphelp import blocker, fleet_http

from everycycle.client import SyncClient

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOTS = Path(os.environ.get("EVERYCYCLE_SCREENSHOTS", "")) if os.environ.get(
    "EVERYCYCLE_SCREENSHOTS") else None
HOSTILE = "<img src=x onerror=alert(1)>"

if CHROMIUM is None and os.environ.get("EVERYCYCLE_REQUIRE_BROWSER") == "1":
    raise RuntimeError("chromium is required here (EVERYCYCLE_REQUIRE_BROWSER=1)")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (apt install "
                                "chromium)")


@pytest.fixture
def models(tmp_path: Path, tiny_gguf: Path) -> Path:
    f = tmp_path / "console-models.toml"
    f.write_text(f'default = "tiny"\n[models.tiny]\npath = "{tiny_gguf}"\ncontext = 8192\n'
                 f'parallel = 1\n[models."{HOSTILE}"]\npath = "{tiny_gguf}"\ncontext = 256\n'
                 "parallel = 1\n")
    return f


@pytest.fixture
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                              args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, spawn_daemon: Any, models: Path) -> Iterator[Any]:
    spawn_daemon("--http", "127.0.0.1:0", models=models)
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("dialog", lambda d: (problems.append(f"dialog: {d.message}"), d.dismiss()))
    page.goto(fleet_http() + "/")
    assert page.url.endswith("/console/")
    page.wait_for_selector("#status:has-text('live')")
    yield page
    assert problems == []


def shot(page: Any, name: str) -> None:
    if SHOTS is not None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_a_load_and_a_chat_stream_live(page: Any) -> None:
    # The first screen: the default model in the chat's picker, ready.
    assert page.input_value("#chat-model") == "tiny"
    page.click("#registry button.load[data-model='tiny']")
    page.wait_for_selector("#loaded td:text-is('tiny')")  # drawn from the event
    assert "loaded tiny on cpu" in page.inner_text("#log")
    shot(page, "fleet")
    page.fill("#chat-input", "hello <script>alert(2)</script>")
    page.click("#chat-send")
    page.wait_for_selector("#chat-figures:has-text('generated')", timeout=120_000)
    turns = page.locator("#transcript .turn")
    assert turns.nth(0).inner_text() == "hello <script>alert(2)</script>"
    assert turns.nth(1).inner_text()  # the streamed answer
    assert page.locator("#transcript script").count() == 0
    assert "request chatcmpl-" in page.inner_text("#chat-figures")
    page.wait_for_selector("#finished td:has-text('chatcmpl-')")
    page.wait_for_selector("#usage-model td:text-is('tiny')")
    page.wait_for_selector("#usage-chart rect[height]:not([height='0'])")  # (this hour's)
    shot(page, "chat")
    page.click("#loaded button.unload[data-model='tiny']")
    page.wait_for_selector("#loaded td:text-is('tiny')", state="detached")
    with SyncClient() as c:
        assert c.describe_fleet().loaded_models == ()


def test_places_in_the_queue_and_a_cancel_from_the_page(page: Any, models: Path) -> None:
    hold = blocker(models)  # holds tiny's one slot
    runs = [subprocess.Popen([*EC, "run", "--models", str(models), "-n", "3", "hi"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for _ in range(2)]
    try:
        page.wait_for_selector("#active td:has-text('queued #2')")
        states = page.locator("#active tbody tr td:nth-child(4)").all_inner_texts()
        assert sorted(s.split(" ~")[0] for s in states) == ["queued #1", "queued #2",
                                                             "running"]  # (~ETA beside)
        shot(page, "requests")
        running = page.locator("#active tbody tr", has_text="running")
        # The table redraws as tokens come, in place: the button under the pointer stays.
        button = running.locator("button.cancel").element_handle()
        count = running.locator("td:nth-child(5)")
        before = count.inner_text()
        wait_until(lambda: count.inner_text() != before, "the running row to redraw")
        assert button.evaluate("b => b.isConnected")
        button.click()
        assert hold.wait(60) == 5  # the CLI that sent it: Cancelled
        for p in runs:
            assert p.wait(60) == 0
    finally:
        hold.kill()
        hold.communicate()
        for p in runs:
            p.kill()
            p.communicate()
    page.wait_for_selector("#finished td:has-text('Cancelled')")


def test_hostile_names_and_texts_are_shown_as_text(page: Any) -> None:
    page.wait_for_selector(f"#registry td:text-is('{HOSTILE}')")
    page.select_option("#chat-model", HOSTILE)
    page.fill("#chat-input", "<b>bold</b><img src=x onerror=alert(3)>")
    page.click("#chat-send")
    page.wait_for_selector("#chat-figures:has-text('generated')", timeout=120_000)
    page.wait_for_selector(f"#loaded td:text-is('{HOSTILE}')")
    assert page.locator("main img").count() == 0 and page.locator("main b").count() == 0
    assert HOSTILE in page.inner_text("#log")
    shot(page, "hostile")


def test_another_origin_can_neither_load_nor_cancel(browser: Any, spawn_daemon: Any,
                                                   models: Path, tmp_path: Path) -> None:
    spawn_daemon("--http", "127.0.0.1:0", models=models)
    api = fleet_http()
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "index.html").write_text(
        "<!doctype html><script>\n"
        "window.results = [];\n"
        "async function go(path) {\n"
        f"  try {{ const r = await fetch('{api}' + path, {{method: 'POST'}});\n"
        "    window.results.push(path + ' ' + r.status); }\n"
        "  catch (e) { window.results.push(path + ' refused'); } }\n"
        "Promise.all([go('/v1/models/tiny/load'), go('/v1/requests/x/cancel'),\n"
        "  fetch('" + api + "/v1/models/tiny/load', {method: 'POST', mode: 'no-cors'})\n"
        "    .then(() => window.results.push('no-cors sent'))]);\n"
        "</script>")
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(
        *a, directory=str(tmp_path / "evil"), **k)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        page = browser.new_page()
        page.goto(f"http://localhost:{server.server_address[1]}/index.html")
        wait_until(lambda: len(page.evaluate("window.results")) == 3, "the page's tries")
        results = page.evaluate("window.results")
        assert "/v1/models/tiny/load 403" in results or "/v1/models/tiny/load refused" in results
        with SyncClient() as c:
            assert c.describe_fleet().loaded_models == ()  # (not even the no-cors one)
    finally:
        server.shutdown()
        server.server_close()
