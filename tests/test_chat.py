"""``everycycle chat`` on a real pseudo-terminal, against a real daemon."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pexpect
from conftest import SpawnDaemon
from daemonhelp import EC, wait_until

from everycycle import paths
from everycycle.client import SyncClient


def audit() -> list[dict[str, object]]:
    f = paths.audit_file()
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def requests() -> list[dict[str, object]]:
    return [r for r in audit() if "request_id" in r]


ANSI = re.compile(rb"\x1b(\[[0-9;?]*[A-Za-z]|\][^\x07]*\x07|[()][A-Z0-9]|[=>78])")


def on_screen(child: pexpect.spawn, n: int, timeout: float = 60) -> None:
    """Read the terminal until ``n`` characters of answer (not escapes, not the status
    line's words) have been printed since the last ``expect``."""
    seen = b""
    deadline = time.monotonic() + timeout
    while True:
        plain = ANSI.sub(b"", seen).decode("utf-8", "replace")
        for word in ("loading…", "generating…", "queued: position"):
            plain = plain.replace(word, "")
        if len("".join(plain.split())) >= n:
            return
        assert time.monotonic() < deadline, f"no answer on the screen: {seen[-200:]!r}"
        child.expect(rb"[\s\S]", timeout=deadline - time.monotonic())
        seen += child.after
        with contextlib.suppress(pexpect.TIMEOUT):
            seen += child.read_nonblocking(4096, timeout=0.05)


def streamed(n: int) -> bool:
    """Whether a request has sent at least ``n`` tokens to its client."""
    with SyncClient() as c:
        return any(r.tokens >= n for r in c.describe_fleet().requests or ())


def spawn_chat(models_file: Path, *args: str) -> pexpect.spawn:
    env = {**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1", "TERM": "xterm"}
    child = pexpect.spawn(EC[0], [*EC[1:], "chat", "--models", str(models_file), *args],
                          env=env, timeout=60, dimensions=(40, 200))
    child.logfile_read = sys.stdout.buffer  # the whole transcript, shown if a test fails
    return child


def turn(child: pexpect.spawn, text: str) -> dict[str, object]:
    """Type ``text``, wait for its answer to end, return the daemon's record of it."""
    before = len(requests())
    child.expect_exact(">>>")
    child.sendline(text)
    wait_until(lambda: len(requests()) > before, f"the answer to {text!r}", timeout=60)
    return requests()[-1]


def test_chat_remembers_cancels_clears_and_leaves(spawn_daemon: SpawnDaemon,
                                                  models_file: Path) -> None:
    spawn_daemon("--audit-prompts")
    child = spawn_chat(models_file, "--system", "be brief", "-n", "12", "--temperature", "0")
    try:
        first = turn(child, "hello there")
        assert first["outcome"] == "Finished"
        assert first["prompt"] == [["system", "be brief"], ["user", "hello there"]]
        second = turn(child, "and again")
        prompt = second["prompt"]
        assert isinstance(prompt, list) and len(prompt) == 4, prompt
        assert prompt[:2] == [["system", "be brief"], ["user", "hello there"]]
        assert prompt[2][0] == "assistant" and prompt[3] == ["user", "and again"]

        child.expect_exact(">>>")
        child.sendline("/clear")
        child.expect_exact("(conversation cleared)")
        fresh = turn(child, "fresh start")
        assert fresh["prompt"] == [["system", "be brief"], ["user", "fresh start"]]

        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert "hello there" in (paths.state_dir() / "chat_history").read_text()


def interrupt_answer(child: pexpect.spawn, text: str) -> dict[str, object]:
    """Type ``text``, press Ctrl-C once its answer streams; the daemon's record of it."""
    before = len(requests())
    child.expect_exact(">>>")
    child.sendline(text)
    wait_until(lambda: streamed(20), f"the answer to {text!r} to stream", timeout=120)
    on_screen(child, 10 + len("".join(text.split())))  # some of it on the screen (after
    # the echo of what was typed)
    child.sendintr()
    wait_until(lambda: len(requests()) > before, "the cancel to reach the daemon", timeout=20)
    return requests()[-1]


def test_ctrl_c_cancels_only_the_answer_and_ctrl_d_leaves(spawn_daemon: SpawnDaemon,
                                                          models_file: Path) -> None:
    spawn_daemon("--audit-prompts")
    # the random tiny model never reaches EOS: the answer runs until cancelled (sampled,
    # so no prompt-lookup drafts: greedy ones repeat and can finish 6000 tokens in the
    # moment a loaded machine takes to deliver the Ctrl-C)
    child = spawn_chat(models_file, "-n", "8000", "--temperature", "1")
    try:
        cancelled = interrupt_answer(child, "tell me a long story")
        assert cancelled["outcome"] == "Cancelled", cancelled
        shown = cancelled["output_tokens"]
        assert isinstance(shown, int) and 0 < shown < 8000

        child.expect_exact(">>>")  # back at the prompt, still chatting
        child.sendline("/system answer briefly")
        child.expect_exact("(system prompt set")
        second = interrupt_answer(child, "hi")
        assert second["prompt"] == [["system", "answer briefly"], ["user", "hi"]]
        # the conversation goes on after a cancel, keeping the partial answer as shown
        third = interrupt_answer(child, "x")["prompt"]
        assert isinstance(third, list) and third[1] == ["user", "hi"]
        assert third[2][0] == "assistant" and third[2][1] and third[3] == ["user", "x"]

        child.expect_exact(">>>")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_chat_without_a_daemon_and_from_a_pipe(models_file: Path) -> None:
    import subprocess

    out = subprocess.run([*EC, "chat", "--no-daemon", "--models", str(models_file), "-n", "4",
                          "--temperature", "0"], input="hello\n/clear\nagain\n",
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\n") == 2 and "Traceback" not in out.stderr


def test_ctrl_c_clears_a_typed_line_and_leaves_from_an_empty_prompt(
    models_file: Path,
) -> None:
    child = spawn_chat(models_file, "--no-daemon")
    try:
        child.expect_exact(">>>")
        child.send("half a thought")
        child.sendintr()  # the line is cleared (redrawn in place), the chat stays
        child.sendline("/help")
        child.expect_exact("/clear")
        child.expect_exact(">>>")
        child.sendintr()  # on an empty prompt: leave
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_run_without_a_prompt_on_a_terminal_opens_the_chat(models_file: Path) -> None:
    child = pexpect.spawn(EC[0], [*EC[1:], "run", "--no-daemon", "--models", str(models_file)],
                          env={**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1"}, timeout=60)
    try:
        child.expect_exact(">>>")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_a_chat_whose_last_answer_failed_exits_with_its_code(models_file: Path) -> None:
    import subprocess

    out = subprocess.run([*EC, "chat", "--no-daemon", "--models", str(models_file), "-m",
                          "nope"], input="hello\n", capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 2 and "unknown model 'nope'" in out.stderr
    assert "Traceback" not in out.stderr


def test_chat_carries_on_when_the_daemon_stops(spawn_daemon: SpawnDaemon,
                                               models_file: Path) -> None:
    """One turn through the daemon, `everycycle stop`, another message: one line says
    the daemon went away, and the conversation carries on in-process."""
    import select

    spawn_daemon()
    chat = subprocess.Popen([*EC, "chat", "--models", str(models_file), "-n", "6",
                             "--temperature", "0"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert chat.stdin is not None and chat.stdout is not None
    try:
        chat.stdin.write(b"hello\n")
        chat.stdin.flush()
        first = b""
        deadline = time.monotonic() + 60
        while b"\n" not in first and time.monotonic() < deadline:  # the first answer
            if select.select([chat.stdout], [], [], 1)[0]:
                first += os.read(chat.stdout.fileno(), 4096)
        assert b"\n" in first
        stop = subprocess.run([*EC, "stop"], capture_output=True, timeout=60, check=False)
        assert stop.returncode == 0
        rest, err = chat.communicate(b"and again\n", timeout=120)
    finally:
        if chat.poll() is None:
            chat.kill()
    text = err.decode()
    assert chat.returncode == 0, text
    assert "Traceback" not in text and "ExceptionGroup" not in text
    assert "the daemon went away" in text
    assert rest.strip(), "no second answer"


def test_chat_banner_system_and_help_alias_on_a_terminal(models_file: Path) -> None:
    child = pexpect.spawn(EC[0], [*EC[1:], "chat", "--models", str(models_file)],
                          env={**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1"}, timeout=60)
    try:
        # the in-process note is a line of its own, not run into the banner
        child.expect(r"no daemon: running in-process\r?\n(\x1b\[[0-9;]*[A-Za-z]|\r)*Chatting with")
        child.expect_exact(">>>")
        child.sendline("/system")  # shows it, never clears it silently
        child.expect_exact("(no system prompt; /system TEXT sets one)")
        child.sendline("/system be brief")
        child.expect_exact("(system prompt set; conversation cleared)")
        child.sendline("/system")
        child.expect_exact("(system prompt: be brief)")
        child.sendline("/?")
        child.expect_exact("/clear")
        child.expect_exact(">>>")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_chat_with_a_completion_model_says_what_works(tmp_path: Path, tiny_gguf: Path) -> None:
    import subprocess

    f = tmp_path / "m.toml"
    f.write_text(f'[models.base]\npath = "{tiny_gguf}"\nformat = "raw"\n')
    out = subprocess.run([*EC, "chat", "-m", "base", "--models", str(f)], input="hi\n",
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2
    assert out.stderr.strip() == ('everycycle: base is a completion model: it continues text '
                                  'and has no chat; try everycycle run -m base "Once upon a '
                                  'time"')


def test_typing_during_an_answer_is_not_echoed_and_ctrl_c_says_stopped(
        models_file: Path) -> None:
    child = spawn_chat(models_file, "--no-daemon", "-n", "8000", "--temperature", "1")
    try:
        child.expect_exact(">>>")
        child.sendline("tell me a long story")
        on_screen(child, 60)  # the answer streams (its text beyond the echo of the line)
        child.send("banana")  # typed while it streams
        child.sendintr()  # (the terminal's ^C: after "banana" in the same input stream)
        child.expect_exact("(stopped)")
        assert b"banana" not in child.before  # not echoed into the answer
        child.expect_exact(">>>")  # (Ctrl-C also discarded the typed-ahead input, as
        child.sendeof()           # the terminal does for an interrupt)
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)


def test_a_chat_is_saved_and_resume_carries_it_on(spawn_daemon: SpawnDaemon,
                                                   models_file: Path) -> None:
    from everycycle import conversations

    spawn_daemon("--audit-prompts")
    child = spawn_chat(models_file, "--system", "be brief", "-n", "6", "--temperature", "0")
    try:
        turn(child, "the first question")
        turn(child, "the second question")
        child.expect_exact(">>>")
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    (saved,) = conversations.listed()
    assert [m.role.value for m in saved.messages] == ["user", "assistant"] * 2
    assert saved.system == "be brief" and saved.title == "the first question"
    listing = subprocess.run([*EC, "chat", "--list"], capture_output=True, text=True,
                             timeout=60, check=False, env={**os.environ, "COLUMNS": "200"})
    assert saved.id in listing.stdout and "the first question" in listing.stdout

    # --resume: the messages come back on the screen and go with the next turn
    child = spawn_chat(models_file, "--resume", "-n", "6", "--temperature", "0")
    try:
        child.expect_exact(">>> the first question")
        child.expect_exact(">>> the second question")
        third = turn(child, "the third question")
        prompt = third["prompt"]
        assert isinstance(prompt, list)
        assert prompt[0] == ["system", "be brief"]
        assert [p[1] for p in prompt if p[0] == "user"] == [
            "the first question", "the second question", "the third question"]
        child.expect_exact(">>>")
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    (again,) = conversations.listed()
    assert again.id == saved.id and len(again.messages) == 6
    missing = subprocess.run([*EC, "chat", "--resume-id", "20260101-000000-abcd"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert missing.returncode != 0 and "no saved conversation" in missing.stderr
    assert "Traceback" not in missing.stderr


MARKDOWN = "Run this:\n\n```python\nprint('hi')\n```\n\nThat is **all**.\n"


class Screen:
    """What a terminal shows (pyte emulates it) of all a child printed, kept as the
    transcript is (shown if a test fails)."""

    def __init__(self, child: pexpect.spawn) -> None:
        import pyte

        self.screen = pyte.Screen(200, 40)
        self._stream = pyte.ByteStream(self.screen)
        child.logfile_read = self

    def write(self, data: bytes) -> None:
        self._stream.feed(data)
        sys.stdout.buffer.write(data)

    def flush(self) -> None:
        sys.stdout.flush()

    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen.display]


def test_answers_are_rendered_as_markdown_on_a_terminal(spawn_daemon: SpawnDaemon,
                                                        tiny_gguf: Path,
                                                        tmp_path: Path) -> None:
    models = tmp_path / "md.toml"
    models.write_text(f'[models.md]\npath = "{tiny_gguf}"\n'
                      f"grammar = {json.dumps('root ::= ' + json.dumps(MARKDOWN))}\n")
    spawn_daemon(models=models)
    child = spawn_chat(models, "-m", "md", "-n", "64")
    screen = Screen(child)
    try:
        child.expect_exact(">>>")
        child.sendline("show me")
        child.expect_exact("all")
        child.expect_exact(">>>")
        shown = screen.lines()
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    text = "\n".join(shown)
    # each block once, rendered: no fences, no asterisks, the code in colour
    assert text.count("Run this:") == 1 and text.count("print('hi')") == 1, text
    assert "```" not in text and "**" not in text and "That is all." in text, text
    (row,) = [i for i, line in enumerate(shown) if "print('hi')" in line]
    colours = {ch.fg for ch in screen.screen.buffer[row].values() if ch.data.strip()}
    assert len(colours) > 1, colours  # (highlighted: more than one colour in the line)
    # a pipe: the text as the model wrote it
    piped = subprocess.run([*EC, "chat", "--models", str(models), "-m", "md", "-n", "64"],
                           input="show me\n", capture_output=True, text=True, timeout=120,
                           check=False)
    assert piped.stdout.strip() == MARKDOWN.strip(), piped.stdout
