"""Other tools' model stores, read in place: a fake Ollama store (manifest + blobs), an LM
Studio tree and a llama.cpp cache in a temporary HOME; listed, run by their names from
the CLI and over a real daemon's socket and HTTP, recorded in models.toml, and never
written to."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from daemonhelp import EC, daemon_process, greedy_ids
from httphelp import fleet_http, openai_client

from everycycle import paths
from everycycle.client import SyncClient
from everycycle.models import stores

MEDIA = "application/vnd.ollama.image."


def _blob(root: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    (blobs / f"sha256-{digest}").write_bytes(data)
    return f"sha256:{digest}"


def _manifest(root: Path, place: str, layers: list[dict[str, object]]) -> Path:
    path = root / "manifests" / place
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schemaVersion": 2, "mediaType":
                                "application/vnd.docker.distribution.manifest.v2+json",
                                "layers": layers}))
    return path


def _layer(kind: str, digest: str, size: int = 0) -> dict[str, object]:
    return {"mediaType": MEDIA + kind, "digest": digest, "size": size}


@pytest.fixture
def home(tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A HOME with all three stores holding the tiny model (and the HF cache empty)."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    for var in ("OLLAMA_MODELS", "LLAMA_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home / ".cache" / "huggingface"))
    data = tiny_gguf.read_bytes()
    ollama = home / ".ollama" / "models"
    params = json.dumps({"temperature": 0.25, "num_ctx": 2048, "stop": ["<end_of_turn>"],
                         "num_gpu": 99}).encode()
    _manifest(ollama, "registry.ollama.ai/library/tiny/latest", [
        _layer("model", _blob(ollama, data), len(data)),
        _layer("template", _blob(ollama, b"{{ .Prompt }}")),
        _layer("params", _blob(ollama, params))])
    _manifest(ollama, "registry.ollama.ai/someone/tiny/q8", [
        _layer("model", _blob(ollama, data), len(data))])
    lms = home / ".lmstudio" / "models" / "acme" / "Tiny-GGUF"
    lms.mkdir(parents=True)
    shutil.copy(tiny_gguf, lms / "tiny-Q8_0.gguf")
    cache = home / ".cache" / "llama.cpp"
    cache.mkdir(parents=True)
    shutil.copy(tiny_gguf, cache / "acme_Tiny-GGUF_tiny-Q8_0.gguf")
    return home


def _tree(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every file and link under ``root``: its content's hash (a link's target), mode and
    mtime: what "unchanged" means."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        what = (os.readlink(path) if path.is_symlink() else
                hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir")
        out[str(path.relative_to(root))] = (what, st.st_mode, st.st_mtime_ns)
    return out


def _stores(home: Path) -> dict[str, dict[str, tuple[str, int, int]]]:
    return {name: _tree(home / name) for name in (".ollama", ".lmstudio", ".cache/llama.cpp")}


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EC, *args], capture_output=True, text=True, timeout=timeout,
                          check=False, stdin=subprocess.DEVNULL)


@pytest.fixture
def daemon(home: Path, models_file: Path) -> Iterator[None]:
    with daemon_process("--models", str(models_file), "--http", "127.0.0.1:0"):
        yield


def test_every_store_is_listed_run_by_name_and_left_unchanged(
        home: Path, models_file: Path, daemon: None) -> None:
    before = _stores(home)
    listed = cli("models", "--all", "--json", "--models", str(models_file))
    assert listed.returncode == 0, listed.stderr
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert rows["tiny"]["store"] is None  # (the registry's own)
    found = {name: r["store"] for name, r in rows.items() if r["store"]}
    assert found == {"ollama:tiny:latest": "ollama", "ollama:someone/tiny:q8": "ollama",
                     "lmstudio:acme/Tiny-GGUF": "lmstudio",
                     "llamacpp:acme_Tiny-GGUF_tiny-Q8_0": "llamacpp"}
    assert all(rows[n]["available"] and rows[n]["weights_bytes"] for n in found)
    assert rows["ollama:tiny:latest"]["context"] == 2048  # (its num_ctx)
    table = cli("models", "--all", "--wide", "--models", str(models_file))
    assert table.returncode == 0 and "ollama:tiny:latest" in table.stdout + table.stderr
    # Each answers by the name listed: from the CLI (through the daemon) ...
    for name in ("ollama:tiny", "lmstudio:acme/Tiny-GGUF", "llamacpp:acme_Tiny-GGUF_tiny-Q8_0"):
        out = cli("run", "--models", str(models_file), "-m", name, "-n", "6", "hello")
        assert out.returncode == 0, out.stderr
        assert out.stdout, name
    # ... and by a socket client, whose fleet shows it resident by that name.
    with SyncClient() as c:
        assert len(greedy_ids(c, "ollama:someone/tiny:q8", n=4)) == 4
        assert "ollama:someone/tiny:q8" in {m.name for m in c.describe_fleet().loaded_models}
    # ... and over HTTP by the name, as any OpenAI client sends it.
    with openai_client(fleet_http(), "x") as client:
        answer = client.chat.completions.create(
            model="lmstudio:acme/Tiny-GGUF", max_tokens=4,
            messages=[{"role": "user", "content": "hello"}])
        assert answer.model == "lmstudio:acme/Tiny-GGUF"
        assert answer.usage is not None and answer.usage.completion_tokens > 0
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="ollama:nothing", max_tokens=4,
                                           messages=[{"role": "user", "content": "hello"}])
    assert _stores(home) == before


def test_run_in_process_takes_the_stores_sampling_defaults(home: Path, models_file: Path
                                                           ) -> None:
    found = stores.find("ollama:tiny")
    assert found.sampling == {"temperature": 0.25}
    assert found.context == 2048
    assert any("Go text/template" in n for n in found.notes)
    assert any("num_gpu" in n and "stop" in n for n in found.notes)
    out = cli("run", "--no-daemon", "--models", str(models_file), "-m", "ollama:tiny",
              "-n", "6", "hello")
    assert out.returncode == 0, out.stderr
    assert out.stdout
    shown = cli("show", "ollama:tiny", "--models", str(models_file))
    assert shown.returncode == 0, shown.stderr
    assert "Go text/template" in shown.stdout and "temperature 0.25" in shown.stdout


def test_models_add_records_the_file_in_place_pinned_and_a_change_is_caught(
        home: Path, models_file: Path) -> None:
    before = _stores(home)
    added = cli("models", "add", "mine", "ollama:tiny")
    assert added.returncode == 0, added.stderr
    text = paths.user_models_file().read_text()
    assert f'path = "{stores.find("ollama:tiny").path}"' in text
    assert f'sha256 = "{stores.find("ollama:tiny").sha256}"' in text
    assert "temperature = 0.25" in text and "context = 2048" in text
    assert _stores(home) == before  # (nothing copied into it, nothing written)
    ran = cli("run", "--no-daemon", "-m", "mine", "-n", "4", "hello")
    assert ran.returncode == 0, ran.stderr
    lms = cli("models", "add", "mine2", "lmstudio:acme/Tiny-GGUF", "--context", "1024")
    assert lms.returncode == 0, lms.stderr
    assert "context = 1024" in paths.user_models_file().read_text()
    # The model blob changes under us: a clear error naming the file, no traceback.
    weights = stores.find("ollama:tiny").path
    with weights.open("ab") as f:
        f.write(b"\0")
    ran = cli("run", "--no-daemon", "-m", "mine", "-n", "4", "hello")
    assert ran.returncode != 0
    assert "sha256" in ran.stderr and str(weights) in ran.stderr
    assert "Traceback" not in ran.stderr


def test_a_missing_blob_or_an_unknown_name_is_a_clear_error(home: Path, models_file: Path
                                                            ) -> None:
    weights = stores.find("ollama:tiny").path
    weights.unlink()
    out = cli("run", "--no-daemon", "--models", str(models_file), "-m", "ollama:tiny",
              "hello")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "missing from Ollama's store" in out.stderr and "ollama pull tiny:latest" in out.stderr
    out = cli("run", "--no-daemon", "--models", str(models_file), "-m", "ollama:nothing",
              "hello")
    assert out.returncode != 0 and "not found in Ollama's store" in out.stderr
    out = cli("run", "--no-daemon", "--models", str(models_file), "-m", "lmstudio:no/such",
              "hello")
    assert out.returncode != 0 and "not found in LM Studio's store" in out.stderr


def test_hostile_manifests_are_refused_not_followed(home: Path, tmp_path: Path) -> None:
    root = home / ".ollama" / "models"
    outside = tmp_path / "secret.gguf"
    outside.write_bytes(b"GGUF not yours")
    _manifest(root, "registry.ollama.ai/library/dots/latest",
              [_layer("model", "sha256:../../../../secret")])
    _manifest(root, "registry.ollama.ai/library/short/latest",
              [_layer("model", "sha256:abc")])
    link = "a" * 64
    (root / "blobs" / f"sha256-{link}").symlink_to(outside)
    _manifest(root, "registry.ollama.ai/library/link/latest",
              [_layer("model", f"sha256:{link}")])
    (root / "manifests" / "registry.ollama.ai" / "library" / "junk").mkdir()
    (root / "manifests" / "registry.ollama.ai" / "library" / "junk" / "latest").write_text("{")
    found, left = stores.discover()
    refs = {m.ref for m in found}
    assert "ollama:tiny:latest" in refs
    assert not refs & {"ollama:dots:latest", "ollama:short:latest", "ollama:link:latest",
                       "ollama:junk:latest"}
    said = "\n".join(left)
    assert "not sha256 and 64 hex digits" in said and "leads out of the store" in said
    assert "cannot be read" in said
    for name in ("ollama:../../etc/passwd", "ollama:a/b/c/d:e", "ollama:..:x"):
        with pytest.raises(Exception) as caught:
            stores.find(name)
        assert "not an Ollama model name" in str(caught.value)


def test_missing_stores_are_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "nobody"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "nobody" / "hf"))
    for var in ("OLLAMA_MODELS", "LLAMA_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    assert stores.discover() == ([], [])
