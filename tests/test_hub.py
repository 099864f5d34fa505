"""Hub downloads through the real huggingface-hub client against a local endpoint."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakehub import FakeHub, serving

from everycycle import paths
from everycycle.errors import InvalidRequestError
from everycycle.models import hub

COMMIT = "0123456789abcdef0123456789abcdef01234567"
EC = [sys.executable, "-m", "everycycle"]


@pytest.fixture
def fake(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    server = FakeHub()
    server.add("acme/tiny", COMMIT, "tiny.gguf", tiny_gguf.read_bytes())
    with serving(server, monkeypatch):
        yield server


def ec(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EC, *args], capture_output=True, text=True, timeout=120,
                          env=os.environ.copy(), check=False)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def registry(tmp_path: Path, digest: str, revision: str = COMMIT) -> Path:
    f = tmp_path / "models.toml"
    f.write_text(
        'default = "hubtiny"\n[models.hubtiny]\nhf_repo = "acme/tiny"\nhf_file = "tiny.gguf"\n'
        f'revision = "{revision}"\nsha256 = "{digest}"\ncontext = 256\nparallel = 1\n'
    )
    return f


def test_pinned_download_lands_in_the_hf_cache(fake: FakeHub, tiny_gguf: Path) -> None:
    out = ec("pull", f"hf://acme/tiny/tiny.gguf@{COMMIT}")
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert path.parts[-3:] == ("snapshots", COMMIT, "tiny.gguf")
    assert str(path).startswith(os.environ["HF_HOME"])
    assert path.read_bytes() == tiny_gguf.read_bytes()
    assert out.stderr == ""  # no progress bar on a pipe


def test_registry_model_pulls_then_runs_offline(fake: FakeHub, tiny_gguf: Path,
                                                 tmp_path: Path) -> None:
    models = registry(tmp_path, sha(tiny_gguf))
    assert ec("pull", "--models", str(models), "hubtiny").returncode == 0
    fake.stop()  # no network at all from here on
    os.environ["HF_HUB_OFFLINE"] = "1"
    out = ec("run", "--models", str(models), "--no-daemon", "--offline", "-n", "4",
             "--temperature", "0", "hello")
    assert out.returncode == 0, out.stderr
    assert out.stdout


def test_sha256_mismatch_is_refused_and_deletes_nothing(fake: FakeHub, tmp_path: Path) -> None:
    models = registry(tmp_path, "0" * 64)
    out = ec("pull", "--models", str(models), "hubtiny")
    assert out.returncode == 2
    assert "0" * 64 in out.stderr and "sha256 is " in out.stderr
    cached = list(Path(os.environ["HF_HOME"]).rglob("tiny.gguf"))
    assert cached and cached[0].exists()
    run = ec("run", "--models", str(models), "--no-daemon", "-n", "2", "x")
    assert run.returncode == 2 and "sha256" in run.stderr


def test_a_dropped_connection_resumes(fake: FakeHub) -> None:
    # Larger than huggingface-hub's 10 MiB read chunk, so the first half reaches the disk.
    blob = os.urandom(24 << 20)
    fake.add("acme/big", COMMIT, "big.gguf", blob)
    fake.drop_first_get = True
    out = ec("pull", f"hf://acme/big/big.gguf@{COMMIT}")
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).read_bytes() == blob
    ranges = [r for m, _, r in fake.requests if m == "GET" and r]
    assert ranges and ranges[0].startswith("bytes=") and ranges[0] != "bytes=0-"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("hf://nobody/none/tiny.gguf", "no such repository"),
        ("hf://acme/tiny/other.gguf", "no such file"),
        ("hf://acme/tiny/tiny.gguf@ffffffffffffffffffffffffffffffffffffffff", "no such revision"),
        ("hf:/bad", "not a hub URL"),
    ],
)
def test_unknown_repo_file_or_revision_is_a_clear_error(fake: FakeHub, url: str,
                                                        says: str) -> None:
    out = ec("pull", url)
    assert out.returncode == 2 and says in out.stderr, out.stderr


def test_models_add_records_the_resolved_commit_and_sha256(fake: FakeHub,
                                                            tiny_gguf: Path) -> None:
    out = ec("models", "add", "mine", "hf://acme/tiny/tiny.gguf")  # branch main
    assert out.returncode == 0, out.stderr
    text = paths.user_models_file().read_text()
    assert f'revision = "{COMMIT}"' in text and sha(tiny_gguf) in text
    assert "context" not in text  # (chosen at load from what it was trained for)
    rows = json.loads(ec("models", "--json").stdout)
    assert {r["name"]: r["available"] for r in rows}["mine"] is True
    mine = {r["name"]: r for r in rows}["mine"]
    assert mine["context_auto"] is True and mine["context"] == 16384  # (the tiny GGUF's)
    again = ec("models", "add", "mine", "hf://acme/tiny/tiny.gguf")
    assert again.returncode == 2 and "already defined" in again.stderr


def test_offline_run_of_an_uncached_model_says_to_pull(tmp_path: Path, tiny_gguf: Path) -> None:
    models = registry(tmp_path, sha(tiny_gguf))
    out = ec("run", "--models", str(models), "--no-daemon", "--offline", "x")
    assert out.returncode == 2 and "everycycle pull hubtiny" in out.stderr


def test_parse_hf_url() -> None:
    assert hub.parse_hf_url("hf://a/b/dir/f.gguf@abc") == hub.HubRef("a/b", "dir/f.gguf", "abc")
    assert hub.parse_hf_url("hf://a/b/f.gguf") == hub.HubRef("a/b", "f.gguf", None)
    with pytest.raises(InvalidRequestError):
        hub.parse_hf_url("hf://a/f.gguf")


def test_run_pulls_a_missing_hub_model_first(fake: FakeHub, tiny_gguf: Path,
                                            tmp_path: Path) -> None:
    models = registry(tmp_path, sha(tiny_gguf))
    out = ec("run", "--models", str(models), "--no-daemon", "-n", "3", "--temperature", "0",
             "hello")
    assert out.returncode == 0, out.stderr
    assert out.stdout and out.stderr == ""
    assert any(m == "GET" for m, _, _ in fake.requests)


def test_pull_shows_a_progress_bar_on_a_terminal(fake: FakeHub) -> None:
    import pty
    import select

    fake.add("acme/big", COMMIT, "big.gguf", os.urandom(3 << 20))
    master, slave = pty.openpty()
    proc = subprocess.Popen([*EC, "pull", f"hf://acme/big/big.gguf@{COMMIT}"],
                            stdout=subprocess.PIPE, stderr=slave, env=os.environ.copy())
    os.close(slave)
    out, _ = proc.communicate(timeout=60)
    term = b""
    while select.select([master], [], [], 0.5)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        term += chunk
    os.close(master)
    assert proc.returncode == 0
    assert b"big.gguf" in term and b"MB" in term  # file, bytes done/total
    assert out.decode().strip().endswith("big.gguf")  # stdout: the path only
