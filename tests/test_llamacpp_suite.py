"""llama.cpp's own server tests, like for like: the API files of ``tools/server/tests``
from the sdist we pin run with ``DEBUG_EXTERNAL=1`` against llama-server (built from the
same sdist) and then against our daemon, on the same GGUF (SmolLM2-135M with FIM token
ids in its metadata), each server started as the suite's ``tinyllama2`` preset starts
one (512 tokens over two slots, ``-n 64``, seed 42). A test that passes on llama-server
must pass on ours, but the differences we chose (``DIFFERENCES``, each with its reason).

``.ci/llama-server`` builds llama-server and the suite's venv and prints the three
``EVERYCYCLE_LLAMA*`` variables this module reads; without them it skips, saying so,
unless ``EVERYCYCLE_REQUIRE_LLAMACPP_SUITE=1`` (CI), where it fails."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from daemonhelp import daemon_process
from modelshelp import Entry, models_toml

from everycycle.hardware.ggufwrite import SMOLLM2_FIM, with_fim_keys
from everycycle.models.registry import load_registry, local_file

FILES = ("test_chat_completion", "test_completion", "test_infill", "test_tokenize",
         "test_compat_anthropic", "test_compat_oai_responses", "test_tool_call",
         "test_stream", "test_ignore_eos")
"""The suite's API files run against the plain servers."""
KEYED = "test_security"
"""Run against servers that require its key."""
KEY = "sk-this-is-the-secret-key"
"""test_security's ``TEST_API_KEY``."""
NAMES = ["tinyllama-2", "gpt-3.5-turbo", "gpt-3.5-turbo-instruct", "gpt-4.1", "davinci-002",
         "llama-test-model", "tinyllama-infill", "ggml-org/tinygemma3-GGUF:Q8_0"]
"""The model names the suite sends (llama-server answers any name with its one model;
ours serves these as aliases of the entry ``test``, which is another)."""
N_PREDICT, N_CTX, SLOTS = 64, 512, 2
"""The preset's ``-n``, ``--ctx-size`` and ``--parallel``."""

IMAGE = ("an image sent to a model without vision is the client's error: 400, which "
         "llama-server answers with a 500")
CASE = ("HTTP header names are case-insensitive and uvicorn writes them in lower case (as "
        "HTTP/2 must); the suite looks `Access-Control-Allow-Origin` up in a plain dict")
CORS = ("a browser's preflight is told the headers it may send (`*` does not cover "
        "Authorization) and no credentials (the API's auth is a bearer key, not cookies); "
        "and " + CASE)
DIFFERENCES: dict[str, str] = {
    "test_compat_anthropic::test_anthropic_vision_format_accepted": IMAGE,
    "test_compat_anthropic::test_anthropic_tool_result_with_image": IMAGE,
    "test_compat_anthropic::test_anthropic_empty_messages":
        "an empty `messages` is a 400, as Anthropic's API answers it",
    "test_compat_oai_responses::test_responses_stream_with_llama_telemetry":
        "a response cut by `max_output_tokens` ends with `response.incomplete`, as "
        "OpenAI's Responses API ends it (llama-server sends `response.completed`)",
    "test_security::test_cors_options[origin-Access-Control-Allow-Credentials-true]": CORS,
    "test_security::test_cors_options[web.mydomain.fr-Access-Control-Allow-Headers-*]": CORS,
    "test_security::test_cors_options[localhost-Access-Control-Allow-Origin-localhost]": CASE,
    "test_security::test_cors_options[web.mydomain.fr-Access-Control-Allow-Origin-"
    "web.mydomain.fr]": CASE,
    "test_security::test_cors_options[web.mydomain.fr-Access-Control-Allow-Methods-GET, "
    "POST, DELETE, OPTIONS]": CASE,
    **{f"test_security::test_cors_origins_localhost_reflects[http://{host}]": CASE
       for host in ("localhost", "localhost:8080", "127.0.0.1", "127.0.0.1:3000", "[::1]",
                    "[::1]:3000")},
}
"""Tests that pass on llama-server and not on ours, by design: test id → why."""

pytestmark = pytest.mark.timeout(2400)
"""The first test runs the suite four times (two servers, each kind)."""

ENV = ("EVERYCYCLE_LLAMA_SERVER", "EVERYCYCLE_LLAMACPP_TESTS", "EVERYCYCLE_LLAMACPP_PY")


@dataclass(frozen=True)
class Suite:
    server: Path
    tests: Path
    python: Path


@pytest.fixture(scope="module")
def suite() -> Suite:
    missing = [name for name in ENV if not os.environ.get(name)]
    if missing:
        why = (f"llama.cpp's server suite needs {', '.join(missing)} "
               "(eval \"$(.ci/llama-server)\")")
        if os.environ.get("EVERYCYCLE_REQUIRE_LLAMACPP_SUITE") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return Suite(*(Path(os.environ[name]) for name in ENV))


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M (the default model) with FIM token ids in its metadata."""
    registry = load_registry()
    out = tmp_path_factory.mktemp("suite") / "smollm2-fim.gguf"
    with_fim_keys(local_file(registry.get(registry.default_name())), out, SMOLLM2_FIM)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"no healthy server on port {port} in {timeout:.0f} s")


@contextlib.contextmanager
def llama_server(suite: Suite, gguf: Path, port: int, keyed: bool) -> Iterator[None]:
    """llama-server as the preset starts it (``utils.ServerProcess.start``)."""
    args = [str(suite.server), "--host", "127.0.0.1", "--port", str(port), "--model",
            str(gguf), "--temp", "0.8", "--seed", "42", "--ctx-size", str(N_CTX),
            "--parallel", str(SLOTS), "--n-predict", str(N_PREDICT), "--threads", "2",
            "--batch-size", "32", "--slots", "--jinja", "--alias", "tinyllama-2"]
    if keyed:
        args += ["--api-key", KEY]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(port, proc)
            yield
        finally:
            proc.terminate()
            proc.wait(30)


@contextlib.contextmanager
def our_daemon(gguf: Path, port: int, keyed: bool) -> Iterator[None]:
    """Our daemon with the same model, context, slots, answer length and sampling
    defaults (``--temp 0.8 --seed 42``); the key, when ``keyed``, is the daemon's token
    (written where the daemon keeps it), HTTP requires it even on loopback, and any web
    origin may call it (llama-server's default, which ours is not)."""
    with tempfile.TemporaryDirectory(prefix="ecs", dir="/tmp") as d:
        home = Path(d)
        models = models_toml(
            home / "models.toml",
            Entry("test", gguf, context=N_CTX // SLOTS, parallel=SLOTS,
                  more={"aliases": NAMES, "max_tokens": N_PREDICT, "threads": 2,
                        "seed": 42, "temperature": 0.8}),
            default="test")
        env = {**os.environ, "EVERYCYCLE_HOME": str(home), "HF_HUB_OFFLINE": "1"}
        env.pop("EVERYCYCLE_SOCKET", None)
        if keyed:
            token = home / "config" / "token"
            token.parent.mkdir(mode=0o700, parents=True)
            token.write_text(KEY + "\n")
            token.chmod(0o600)
        args = ["--models", str(models), "--http", f"127.0.0.1:{port}"]
        sock = home / "s.sock"
        if keyed:
            args += ["--http-auth", "--cors-origin", "*"]
        with daemon_process(*args, sock=sock,
                            env=env) as proc:
            subprocess.run([sys.executable, "-m", "everycycle", "load", "test", "--socket",
                            str(sock)], env=env, check=True, capture_output=True,
                           timeout=300)
            wait_healthy(port, proc)
            yield


Outcomes = dict[str, str]
"""Test id (``file::name[params]``) → passed, failed or skipped."""


def run_files(suite: Suite, port: int, files: list[str], report: Path) -> Outcomes:
    """The suite's ``files`` against the server on ``port``; each test's outcome."""
    env = {**os.environ, "DEBUG_EXTERNAL": "1", "PORT": str(port)}
    for name in ("EVERYCYCLE_HOME", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST"):
        env.pop(name, None)
    subprocess.run([str(suite.python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "--timeout", "120", f"--junitxml={report}",
                    *(f"unit/{f}.py" for f in files)],
                   check=False, cwd=suite.tests, env=env, capture_output=True, timeout=1800)
    outcomes: Outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        test = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[test] = ("failed" if kinds & {"failure", "error"} else
                          "skipped" if "skipped" in kinds else "passed")
    return outcomes


@pytest.fixture(scope="module")
def outcomes(suite: Suite, gguf: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, tuple[Outcomes, Outcomes]]:
    """Per server kind (plain, keyed): llama-server's outcomes and ours."""
    out = tmp_path_factory.mktemp("junit")
    runs = {"plain": (list(FILES), False), "keyed": ([KEYED], True)}
    found: dict[str, tuple[Outcomes, Outcomes]] = {}
    for kind, (files, keyed) in runs.items():
        port = free_port()
        with llama_server(suite, gguf, port, keyed):
            theirs = run_files(suite, port, files, out / f"{kind}-llama-server.xml")
        port = free_port()
        with our_daemon(gguf, port, keyed):
            ours = run_files(suite, port, files, out / f"{kind}-ours.xml")
        found[kind] = (theirs, ours)
    return found


@pytest.mark.parametrize("name", [*FILES, KEYED])
def test_what_llama_server_passes_passes_on_ours(
        name: str, outcomes: dict[str, tuple[Outcomes, Outcomes]],
        capsys: pytest.CaptureFixture[str]) -> None:
    theirs, ours = outcomes["keyed" if name == KEYED else "plain"]
    mine = sorted(t for t in theirs if t.startswith(f"{name}::"))
    assert mine, f"{name}: llama-server ran no tests"
    passed = [t for t in mine if theirs[t] == "passed"]
    assert passed, f"{name}: llama-server passed none of its {len(mine)} tests"
    ours_passed = [t for t in mine if ours.get(t) == "passed"]
    with capsys.disabled():  # (the per-file counts, in CI's log)
        sys.stdout.write(f"\nllama.cpp suite, {name}: llama-server passes {len(passed)} of "
                         f"{len(mine)}, ours {len(ours_passed)} "
                         f"({len(set(passed) & set(ours_passed))} of its)\n")
    lost = [t for t in passed if ours.get(t) != "passed" and t not in DIFFERENCES]
    assert not lost, f"{name}: passes on llama-server, not on ours: {lost}"
    stale = [t for t in DIFFERENCES if t.startswith(f"{name}::")
             and (theirs.get(t) != "passed" or ours.get(t) == "passed")]
    assert not stale, f"{name}: listed as a difference, no longer one: {stale}"
