"""The CLI as users run it: real subprocesses against a real daemon, and embedded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SpawnDaemon
from daemonhelp import EC, wait_until
from httphelp import audit
from typer.testing import CliRunner

from everycycle import paths
from everycycle.cli import app
from everycycle.client import SyncClient
from everycycle.protocol import FleetDescription, decode_event


def ec(*args: str, input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EC, *args], input=input, capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy(), check=False)


@pytest.fixture
def daemon(spawn_daemon: SpawnDaemon) -> subprocess.Popen[bytes]:
    return spawn_daemon()


def test_run_streams_only_generated_text_and_matches_embedded(
    daemon: subprocess.Popen[bytes], models_file: Path
) -> None:
    args = ["run", "--models", str(models_file), "-n", "12", "--temperature", "0", "hello"]
    via_daemon = ec(*args)
    embedded = ec(*args, "--no-daemon")
    assert via_daemon.returncode == 0 and embedded.returncode == 0, via_daemon.stderr
    assert via_daemon.stdout and via_daemon.stdout == embedded.stdout


def test_o_sets_any_sampling_parameter_the_same_through_the_daemon_and_embedded(
    daemon: subprocess.Popen[bytes], models_file: Path
) -> None:
    args = ["run", "--models", str(models_file), "-n", "16", "--temperature", "0", "--raw",
            "hello"]
    plain = ec(*args)
    penalised = [*args, "-o", "frequency_penalty=2", "-o", "logit_bias={\"42\": 20}"]
    via_daemon, embedded = ec(*penalised), ec(*penalised, "--no-daemon")
    assert via_daemon.returncode == 0 and embedded.returncode == 0, via_daemon.stderr
    assert via_daemon.stdout == embedded.stdout != plain.stdout
    for bad, says in (("nope=1", "unknown sampling option 'nope'"),
                      ("mirostat=3", "mirostat must be between 0 and 2"),
                      ("top_k", "-o takes NAME=VALUE")):
        out = ec(*args, "-o", bad)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.startswith("everycycle: usage: ") and says in out.stderr


def test_piped_stdin_is_appended_to_the_prompt(daemon: subprocess.Popen[bytes],
                                               models_file: Path) -> None:
    base = ["run", "--models", str(models_file), "-n", "8", "--temperature", "0"]
    piped = ec(*base, "Summarize:", input="hello world")
    joined = ec(*base, "Summarize:\n\nhello world")
    other = ec(*base, "Summarize:")
    assert piped.stdout == joined.stdout
    assert piped.stdout != other.stdout


def test_json_prints_the_server_events(daemon: subprocess.Popen[bytes], models_file: Path) -> None:
    out = ec("run", "--models", str(models_file), "-n", "4", "--json", "hi")
    events = [decode_event(line) for line in out.stdout.encode().splitlines()]
    assert type(events[0]).__name__ == "Accepted"
    assert type(events[-1]).__name__ == "Tokens" and events[-1].finished  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["-m", "nope", "x"], 2),
        (["--temperature", "-1", "x"], 2),
        (["-m", "missing", "x"], 2),
        (["--deadline", "0.2", "-n", "8000", "--temperature", "1", "x"], 5),
    ],
)
def test_exit_codes(daemon: subprocess.Popen[bytes], models_file: Path, args: list[str],
                    code: int) -> None:
    out = ec("run", "--models", str(models_file), *args)
    assert out.returncode == code, out.stderr
    assert out.stdout == "" or code == 5
    assert out.stderr.startswith("everycycle: ")


def test_model_not_loaded_and_rejected_exit_codes(spawn_daemon: SpawnDaemon,
                                                  models_file: Path) -> None:
    spawn_daemon("--no-auto-load", "--max-queue", "0")
    assert ec("run", "--models", str(models_file), "x").returncode == 3
    assert ec("load", "tiny").returncode == 0
    blocker = subprocess.Popen([*EC, "run", "--models", str(models_file), "-n", "8000",
                                "--temperature", "1", "x"], stdout=subprocess.PIPE)
    try:
        assert blocker.stdout is not None
        blocker.stdout.read(1)  # it holds the only slot now
        assert ec("run", "--models", str(models_file), "x").returncode == 4
    finally:
        blocker.kill()
        blocker.communicate()


def test_sigint_cancels_on_the_daemon_and_exits_130(
    daemon: subprocess.Popen[bytes], models_file: Path
) -> None:
    proc = subprocess.Popen([*EC, "run", "--models", str(models_file), "-n", "8000",
                             "--temperature", "1", "x"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.read(1)  # it is streaming
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, err
    assert b"Traceback" not in err
    assert audit()[-1]["outcome"] == "Cancelled"


def test_closed_stdout_cancels_quietly(daemon: subprocess.Popen[bytes], models_file: Path) -> None:
    cmd = (f"{sys.executable} -m everycycle run --models {models_file} -n 8000 "
           "--temperature 1 x | head -c 1")
    out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.encode()) == 1 and out.stderr == ""
    wait_until(lambda: any(r["outcome"] == "Cancelled" for r in audit()),
               "the daemon to record the cancel", timeout=10)


def test_fleet_json_and_table(daemon: subprocess.Popen[bytes], models_file: Path) -> None:
    assert ec("load", "tiny").returncode == 0
    out = ec("fleet", "--json")
    event = decode_event(out.stdout.encode())
    assert isinstance(event, FleetDescription)
    assert [m.name for m in event.snapshot.loaded_models] == ["tiny"]
    table = ec("fleet")
    assert "tiny" in table.stderr + table.stdout and "cpu" in table.stderr + table.stdout


def test_fleet_without_daemon_exits_69() -> None:
    out = ec("fleet")
    assert out.returncode == 69 and "cpu" in out.stderr and out.stdout == ""
    assert ec("fleet", "--json").returncode == 69


def test_run_without_prompt_and_nothing_piped_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["run"], input="")
    assert result.exit_code == 2


def test_models_json_lists_the_registry(models_file: Path) -> None:
    result = CliRunner().invoke(app, ["models", "--json", "--models", str(models_file)])
    rows = json.loads(result.stdout)
    assert {r["name"]: r["available"] for r in rows} == {"tiny": True, "tiny4": True,
                                                          "missing": False}


def test_help_and_version() -> None:
    runner = CliRunner()
    assert "Usage" in runner.invoke(app, []).output
    assert runner.invoke(app, ["--version"]).output.startswith("everycycle ")
    for cmd in ("run", "fleet", "models", "load", "unload", "cancel", "stop", "daemon", "pull"):
        assert "Example" in runner.invoke(app, [cmd, "--help"]).output


def test_second_daemon_is_refused_in_one_line(daemon: subprocess.Popen[bytes],
                                              models_file: Path) -> None:
    out = ec("daemon", "--models", str(models_file))
    assert out.returncode == 1 and f"pid {daemon.pid}" in out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.parametrize("where", ["open/x.sock", "file-not-dir/x.sock", "long"])
def test_daemon_start_up_failures_are_one_line(where: str, tmp_path: Path,
                                               models_file: Path) -> None:
    (tmp_path / "file-not-dir").write_text("")
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    sock = tmp_path / ("x" * 120 + ".sock" if where == "long" else where)
    out = ec("daemon", "--models", str(models_file), "--socket", str(sock))
    assert out.returncode in (1, 2), out.stderr
    assert "Traceback" not in out.stderr and out.stderr.startswith("everycycle: "), out.stderr
    assert out.stderr.count("\n") == 1, out.stderr


def test_daemon_with_a_broken_models_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "models.toml"
    bad.write_text("default = 3\n")
    out = ec("daemon", "--models", str(bad))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "default must be a string" in out.stderr


def test_cli_does_not_import_llama_cpp() -> None:
    code = "import sys, everycycle.cli; assert 'llama_cpp' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.shipped
def test_default_model_answers_offline() -> None:
    out = ec("run", "--no-daemon", "--temperature", "0",
             "What is the capital of France? Answer in one word.", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout and out.stderr == ""


@pytest.mark.shipped
def test_base_model_completes_raw_text_offline() -> None:
    out = ec("run", "--no-daemon", "-m", "gemma-3-270m", "-n", "8", "--temperature", "0",
             "The capital of France is", timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and out.stderr == ""


def test_daemon_detach_then_stop(models_file: Path) -> None:
    out = ec("daemon", "--detach", "--models", str(models_file))
    assert out.returncode == 0, out.stderr
    assert "serving" in out.stderr and out.stdout == ""
    pid_file = paths.pid_file_for(paths.socket_path())
    pid = int(pid_file.read_text())
    assert ec("fleet", "--json").returncode == 0
    assert ec("stop").returncode == 0
    wait_until(lambda: not paths.socket_path().exists(), "the socket to go")
    assert not pid_file.exists()

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_until(gone, "the daemon process to exit", timeout=10)


def _read_until(fd: int, marker: bytes, timeout: float = 30) -> bytes:
    """What ``fd`` gives up to and including ``marker``; fails after ``timeout``."""
    import select

    seen = b""
    deadline = time.monotonic() + timeout
    while marker not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {marker!r} in {seen[-300:]!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            assert chunk, f"the stream ended before {marker!r}: {seen[-300:]!r}"
            seen += chunk
    return seen


class _Drain:
    """Keeps reading ``fd`` (a pty's master) on a thread, so that the process writing to
    it never blocks on a full terminal; ``text`` is all it read once ``join`` returns."""

    def __init__(self, fd: int) -> None:
        import threading

        self.fd, self.chunks = fd, list[bytes]()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # EIO: the other side closed
                return
            if not chunk:
                return
            self.chunks.append(chunk)

    def join(self) -> bytes:
        self._thread.join(timeout=30)
        return b"".join(self.chunks)


def _read_all(fd: int) -> bytes:
    import select

    out = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if not ready:
            return out
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return out
        if not chunk:
            return out
        out += chunk


def test_status_line_on_a_terminal_and_only_text_on_stdout(
    daemon: subprocess.Popen[bytes], models_file: Path
) -> None:
    import pty

    blocker = subprocess.Popen([*EC, "run", "--models", str(models_file), "-n", "8000",
                                "--temperature", "1", "x"], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
    assert blocker.stdout is not None
    blocker.stdout.read(1)
    master, slave = pty.openpty()
    proc = subprocess.Popen([*EC, "run", "--models", str(models_file), "-n", "6",
                             "--temperature", "0", "hello"], stdout=subprocess.PIPE,
                            stderr=slave)
    os.close(slave)

    def queued() -> bool:
        with SyncClient() as c:
            return any(m.queued for m in c.describe_fleet().loaded_models)

    wait_until(queued, "the second run to be queued")
    blocker.kill()
    blocker.communicate()
    out, _ = proc.communicate(timeout=30)
    term = _read_all(master).decode("utf-8", "replace")
    os.close(master)
    assert proc.returncode == 0
    assert "queued: position 1" in term and "\x1b[2K" in term
    assert "queued" not in out.decode() and "\x1b" not in out.decode()
    plain = ec("run", "--models", str(models_file), "-n", "6", "--temperature", "0", "hello")
    assert plain.stdout == out.decode() and plain.stderr == ""


def test_verbose_status_without_a_terminal(daemon: subprocess.Popen[bytes],
                                           models_file: Path) -> None:
    out = ec("run", "-v", "--models", str(models_file), "-n", "4", "hello")
    assert out.returncode == 0 and "generating" in out.stderr


def test_fleet_watch_refreshes_until_interrupted(daemon: subprocess.Popen[bytes]) -> None:
    import pty

    master, slave = pty.openpty()  # a terminal: the live view draws as it goes
    proc = subprocess.Popen([*EC, "fleet", "--watch"], stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    try:
        err = _read_until(master, b"executors on")  # it has drawn the table
        drain = _Drain(master)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        err += drain.join()
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out == b"" and b"Traceback" not in err


def test_a_model_without_a_chat_template_says_so_once(tmp_path: Path) -> None:
    from tinymodel import write_tiny_gguf

    bare = write_tiny_gguf(tmp_path / "bare.gguf", chat_template=None)
    f = tmp_path / "m.toml"
    f.write_text(f'default = "bare"\n[models.bare]\npath = "{bare}"\ncontext = 256\n'
                 "parallel = 1\n")
    out = ec("run", "--no-daemon", "--models", str(f), "-n", "3", "hello")
    assert out.returncode == 0 and out.stdout
    assert out.stderr.count("has no chat template") == 1, out.stderr
    quiet = ec("run", "--no-daemon", "--models", str(f), "-n", "3", "--raw", "hello")
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_models_says_which_are_chat_and_which_complete(models_file: Path) -> None:
    rows = json.loads(ec("models", "--json").stdout)
    kinds = {r["name"]: r["kind"] for r in rows}
    assert kinds["smollm2-135m"] == "chat" and kinds["gemma-3-270m"] == "completion"


def test_no_xdg_runtime_dir_is_not_a_warning_on_stderr(tmp_path: Path) -> None:
    # As root in a container, or under su or cron: platformdirs warns on every call.
    env = {k: v for k, v in os.environ.items()
           if k not in ("XDG_RUNTIME_DIR", "EVERYCYCLE_HOME", "EVERYCYCLE_SOCKET")}
    out = subprocess.run([sys.executable, "-W", "default", "-c",
                          "from everycycle import paths; print(paths.socket_path())"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stderr == ""
    assert out.stdout.strip().endswith("everycycle.sock")


def test_without_a_daemon_the_commands_say_how_to_start_one() -> None:
    for cmd in (["load", "tiny"], ["unload", "tiny"], ["cancel", "abc"]):
        out = ec(*cmd)
        assert out.returncode == 69, (cmd, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "start one with `everycycle daemon --detach`" in lines[0]
    out = ec("stop")  # nothing running: what was asked for already holds
    assert out.returncode == 0 and "nothing to stop" in out.stderr and out.stdout == ""


def test_load_unload_and_stop_say_what_they_did(daemon: subprocess.Popen[bytes]) -> None:
    out = ec("load", "tiny")
    assert out.returncode == 0, out.stderr
    assert out.stderr.startswith("everycycle: loaded tiny on cpu (engine pid "), out.stderr
    out = ec("unload", "tiny")
    assert (out.returncode, out.stderr) == (0, "everycycle: unloaded tiny\n")
    out = ec("stop")
    assert (out.returncode, out.stderr) == (0, "everycycle: daemon stopped\n")
    daemon.wait(30)


def test_fleet_watch_says_when_the_daemon_goes_away(daemon: subprocess.Popen[bytes]) -> None:
    import pty

    master, slave = pty.openpty()
    watch = subprocess.Popen([*EC, "fleet", "--watch"], stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    try:
        seen = _read_until(master, b"executors on")  # it is watching
        drain = _Drain(master)  # (it redraws all the while: a full terminal would block it)
        assert ec("stop").returncode == 0
        watch.communicate(timeout=60)
        err = (seen + drain.join()).decode("utf-8", "replace")
    finally:
        os.close(master)
        if watch.poll() is None:
            watch.kill()
    assert watch.returncode == 69
    assert "everycycle: the daemon went away" in err


def test_daemon_detach_prints_the_daemons_own_reason_and_code(
        daemon: subprocess.Popen[bytes], tmp_path: Path) -> None:
    out = ec("daemon", "--detach")
    assert out.returncode == daemon_exit_code_for_a_second_daemon()
    assert out.stderr.strip().splitlines() == [
        f"everycycle: {paths.socket_path()} is already served by pid {daemon.pid}"]
    broken = tmp_path / "broken.toml"
    broken.write_text("bad [\n")
    out = ec("daemon", "--detach", "--socket", str(tmp_path / "s.sock"), "--models",
             str(broken))
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and str(broken) in out.stderr
    assert "see " not in out.stderr  # the reason itself, not a pointer to the log


def daemon_exit_code_for_a_second_daemon() -> int:
    """What `everycycle daemon` in the foreground exits with when one already serves."""
    return ec("daemon").returncode


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9", "http://nosuchhost.invalid"])
def test_pull_without_network_is_fast_and_one_line(endpoint: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    for cmd in (["pull", "hf://nosuchowner/nosuchrepo/file.gguf"],
                ["models", "add", "m", "hf://nosuchowner/nosuchrepo/file.gguf"]):
        out = ec(*cmd)  # (no retries with backoff: ec's own timeout is the hang guard)
        assert out.returncode == 69, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "a network problem" in lines[0], lines
        assert "offline, use a model already downloaded" in lines[0]


def test_pull_of_a_web_address_suggests_the_hf_form() -> None:
    out = ec("pull", "https://huggingface.co/a/b/resolve/main/c.gguf")
    assert out.returncode == 2
    assert out.stderr.strip() == ("everycycle: 'https://huggingface.co/a/b/resolve/main/"
                                  "c.gguf' is a web address; pull it as hf://a/b/c.gguf@main")


def test_fleet_lists_active_requests_to_cancel_by_id(daemon: subprocess.Popen[bytes]) -> None:
    import threading

    from everycycle.client import SyncClient
    from everycycle.protocol import Error

    ended: list[object] = []

    def long_one() -> None:
        with SyncClient() as c:
            ended.extend(c.generate("tiny", "go", max_tokens=8000, temperature=1.0,
                                    request_id="findme"))

    t = threading.Thread(target=long_one)
    t.start()
    try:
        def listed() -> bool:
            out = ec("fleet", "--json")
            snap = json.loads(out.stdout)["FleetDescription"]
            return any(r["request_id"] == "findme" and r["state"] == "running"
                       and r["principal"] == "local" and r["model"] == "tiny"
                       for r in snap.get("requests") or [])

        wait_until(listed, "the request in fleet --json")
        table = subprocess.run([*EC, "fleet"], capture_output=True, text=True, timeout=60,
                               env={**os.environ, "COLUMNS": "80"}, check=False)
        assert "findme" in table.stderr and "everycycle cancel ID" in table.stderr
        assert ec("cancel", "findme").returncode == 0
    finally:
        t.join(60)
    last = ended[-1]
    assert isinstance(last, Error) and last.kind.value == "Cancelled", last


@pytest.mark.parametrize(("args", "words"), [
    (["run", "--deadline", "-3", "hi"], "--deadline"),
    (["run", "-n", "0", "hi"], "-n"),
    (["run", "--temperature", "-1", "hi"], "--temperature"),
    (["run", "--top-k", "abc", "hi"], "--top-k"),
])
def test_bad_options_are_usage_errors_in_the_users_words(args: list[str], words: str) -> None:
    out = ec(*args)
    assert out.returncode == 2, out.stderr
    assert words in out.stderr and "max_tokens" not in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_an_empty_prompt_and_an_empty_models_file(tmp_path: Path) -> None:
    out = subprocess.run([*EC, "run", ""], stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 2 and "the prompt is empty" in out.stderr and out.stdout == ""
    empty = tmp_path / "models.toml"
    empty.write_text("# nothing yet\n")
    out = ec("models", "--models", str(empty))
    assert out.returncode == 2 and f"{empty} is empty" in out.stderr, out.stderr


def test_keys_add_warns_of_a_model_the_registry_lacks() -> None:
    out = ec("keys", "add", "bob", "-m", "nosuchmodel")
    assert out.returncode == 0 and out.stdout.startswith("ec-")
    assert "warning: the registry has no model 'nosuchmodel'" in out.stderr


def test_ollama_names_ps_list_serve_and_stop_model(spawn_daemon: SpawnDaemon,
                                                   models_file: Path) -> None:
    out = ec("list", "--models", str(models_file))
    assert out.returncode == 0 and "tiny4" in out.stdout + out.stderr
    assert ec("serve", "--help").returncode == 0
    spawn_daemon()
    assert ec("load", "tiny").returncode == 0
    out = subprocess.run([*EC, "ps"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "100"}, check=False)
    assert out.returncode == 0 and "tiny" in out.stderr and "loaded models" in out.stderr
    out = ec("stop", "tiny")  # a model: unloads it, the daemon serves on
    assert (out.returncode, out.stderr) == (0, "everycycle: unloaded tiny\n")
    assert ec("fleet").returncode == 0


def test_run_verbose_gives_the_id_then_the_figures(daemon: subprocess.Popen[bytes]) -> None:
    out = ec("run", "-m", "tiny", "-v", "-n", "5", "--temperature", "0", "hello")
    assert out.returncode == 0, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith("everycycle: request ") and len(lines[0].split()[-1]) == 32
    assert "everycycle: (cut off after 5 tokens: -n 5)" in lines
    figures = lines[-1]
    assert figures.startswith("everycycle: prompt ") and "generated 5 (length)" in figures
    assert "tokens/s" in figures and "first token" in figures
    plain = ec("run", "-m", "tiny", "-n", "5", "--temperature", "0", "hello")  # quiet
    assert plain.stderr == "" and plain.stdout == out.stdout


def test_usage_comes_only_to_a_generate_that_asks() -> None:
    from everycycle.protocol import Generate, Usage, decode_event, encode, is_terminal

    line = encode(Usage("r", 7, 3, 5, "length"))
    assert line == (b'{"Usage":{"request_id":"r","prompt_tokens":7,"cached_tokens":3,'
                    b'"generated_tokens":5,"finish_reason":"length"}}\n')
    assert decode_event(line.rstrip(b"\n")) == Usage("r", 7, 3, 5, "length")
    assert not is_terminal(Usage("r", 7, 3, 5, "length"))
    assert b"usage" not in encode(Generate("g", "m", "p"))  # a seed line stays as it was


def test_show_a_model(models_file: Path) -> None:
    out = ec("show", "tiny", "--models", str(models_file))
    assert out.returncode == 0, out.stderr
    assert "architecture     llama" in out.stdout and "chat template:" in out.stdout
    assert "<start_of_turn>" in out.stdout
    info = json.loads(ec("show", "tiny", "--json", "--models", str(models_file)).stdout)
    assert (info["name"], info["context"], info["kind"]) == ("tiny", 8192, "chat")
    out = ec("show", "missing", "--models", str(models_file))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1


def test_rm_removes_only_your_own_entries(tiny_gguf: Path) -> None:
    from everycycle.models.registry import load_registry
    from everycycle.models.userfile import add_user_entry

    add_user_entry("mine", {"path": str(tiny_gguf), "context": 256})
    add_user_entry("other one", {"path": str(tiny_gguf), "context": 512})
    assert {"mine", "other one"} <= set(load_registry().models)
    out = ec("rm", "mine")
    assert out.returncode == 0 and "removed 'mine'" in out.stderr, out.stderr
    names = set(load_registry().models)
    assert "mine" not in names and "other one" in names
    out = ec("rm", "smollm2-135m")  # shipped: not the user's to remove
    assert out.returncode == 2 and "shipped" in out.stderr
    assert ec("rm", "nosuch").returncode == 2


def test_launch_warns_when_the_context_cannot_hold_the_agents_prompt(
        spawn_daemon: SpawnDaemon, tiny_gguf: Path, tmp_path: Path) -> None:
    models = tmp_path / "contexts.toml"
    models.write_text("".join(f'[models.c{n}]\npath = "{tiny_gguf}"\ncontext = {n}\n'
                              for n in (512, 16384, 32768)))
    # A stand-in `claude` (a real program on PATH) that shows where launch sent it.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "claude"
    fake.write_text('#!/bin/sh\necho "claude at $ANTHROPIC_BASE_URL with $*"\n'
                    'echo "billing line: $CLAUDE_CODE_ATTRIBUTION_HEADER"\n'
                    'echo "idle limit: $CLAUDE_STREAM_IDLE_TIMEOUT_MS"\n')
    fake.chmod(0o755)
    spawn_daemon("--http", "127.0.0.1:0", models=models)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    def launch(model: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*EC, "launch", "claude", "-m", model, "--models", str(models)],
                              capture_output=True, text=True, env=env, timeout=60,
                              check=False)
        assert done.returncode == 0, done.stderr
        assert "claude at http://127.0.0.1:" in done.stdout, done.stdout
        assert f"--model {model}" in done.stdout
        assert "billing line: 0" in done.stdout  # (a stable prefix, cached across turns)
        assert "idle limit: 1800000" in done.stdout  # (a slow prefill is not a dead stream)
        return done

    small = launch("c512").stderr
    assert ("model 'c512' has a 512-token context; claude's first request alone is about "
            "12,000 tokens") in small
    assert "refused as too long" in small and "context = 32768" in small
    assert "little room" in launch("c16384").stderr
    assert "warning" not in launch("c32768").stderr
