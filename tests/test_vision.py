"""Images in: the tiny model with a tiny random-weight projector (tinyvision.py) that
libmtmd loads, end to end through a real daemon, its engine process and the clients."""

from __future__ import annotations

import base64
import io
import struct
import subprocess
import zlib
from pathlib import Path

import anyio
import openai
import pytest
from daemonhelp import EC, running_daemon
from httphelp import anthropic_client, fleet_http, ollama_client, openai_client, raw
from PIL import Image
from tinyvision import write_tiny_mmproj

from everycycle.client import connect
from everycycle.protocol import (
    ContentPart,
    Error,
    ErrorKind,
    Message,
    PartType,
    Role,
    ServerEvent,
    Tokens,
)


def png(size: tuple[int, int], color: tuple[int, int, int], fmt: str = "PNG") -> bytes:
    im = Image.new("RGB", size, color)
    for x in range(0, size[0], 4):  # a pattern, so the patches differ
        im.putpixel((x, x % size[1]), (255 - color[0], 255 - color[1], 255 - color[2]))
    out = io.BytesIO()
    im.save(out, fmt)
    return out.getvalue()


RED = png((48, 32), (200, 30, 30))
BLUE = png((32, 32), (20, 40, 220), "WEBP")


def huge_png() -> bytes:
    """A well-formed PNG claiming 100000×100000 pixels (a decompression bomb's header)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


@pytest.fixture
def vision_models(tmp_path: Path, tiny_gguf: Path) -> Path:
    mmproj = write_tiny_mmproj(tmp_path / "mmproj-tiny.gguf")
    f = tmp_path / "vision.toml"
    f.write_text(f'default = "tv"\n[models.tv]\npath = "{tiny_gguf}"\nmmproj = "{mmproj}"\n'
                 "context = 512\nparallel = 1\n"
                 f'[models.plain]\npath = "{tiny_gguf}"\ncontext = 256\nparallel = 1\n')
    return f


def image(data: bytes) -> ContentPart:
    return ContentPart(PartType.IMAGE, data=base64.b64encode(data).decode())


def user(*parts: ContentPart | str) -> Message:
    return Message(Role.USER, tuple(p if isinstance(p, ContentPart)
                                    else ContentPart(PartType.TEXT, p) for p in parts))


async def ask(model: str, *messages: Message) -> list[ServerEvent]:
    async with connect() as c:
        return [e async for e in c.generate(model, messages=messages, max_tokens=8,
                                            temperature=0.0)]


def text_of(events: list[ServerEvent]) -> str:
    assert isinstance(events[-1], Tokens) and events[-1].finished, events[-1]
    return "".join(e.chunk.text for e in events if isinstance(e, Tokens))


pytestmark = pytest.mark.anyio


async def test_images_reach_the_model_and_one_seen_before_is_not_encoded_again(
        vision_models: Path) -> None:
    async with running_daemon(vision_models) as d:
        sup = d.supervisor

        def encoded() -> int | None:
            [m] = [m for m in sup.snapshot().loaded_models if m.name == "tv"]
            return m.images_encoded

        red = text_of(await ask("tv", user(image(RED), "what is it?")))
        blue = text_of(await ask("tv", user(image(BLUE), "what is it?")))
        assert red != blue  # the image reaches the model
        assert text_of(await ask("tv", user(image(RED), "what is it?"))) == red
        assert encoded() == 3
        # A conversation about one image: the follow-up reuses its cells.
        first = user(image(BLUE), "describe it")
        answer = text_of(await ask("tv", first))
        assert encoded() == 4
        text_of(await ask("tv", first, Message(Role.ASSISTANT, answer), user("and then?")))
        assert encoded() == 4
        pid = sup.snapshot().loaded_models[0].engine_pid
        for bad, says in ((RED[:len(RED) // 2], "is truncated"), (huge_png(), "100000×100000"),
                          (b"not an image at all", "not an image")):
            events = await ask("tv", user(image(bad), "what?"))
            assert isinstance(events[-1], Error) and events[-1].kind is ErrorKind.INVALID
            assert says in events[-1].message, events[-1].message
        assert sup.snapshot().loaded_models[0].engine_pid == pid  # the engine lives
        assert text_of(await ask("tv", user(image(RED), "what is it?"))) == red
        refused = await ask("plain", user(image(RED), "what?"))
        assert isinstance(refused[-1], Error) and refused[-1].kind is ErrorKind.INVALID
        assert "model 'plain' cannot read images" in refused[-1].message


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def test_the_http_dialects_send_images(vision_models: Path) -> None:
    async with running_daemon(vision_models, http=("127.0.0.1", 0)):
        url = await anyio.to_thread.run_sync(fleet_http)

        def clients() -> None:
            with openai_client(url, "x") as oa:
                def chat(part: dict[str, object]) -> str | None:
                    r = oa.chat.completions.create(
                        model="tv", max_tokens=8, temperature=0,
                        messages=[{"role": "user", "content": [  # type: ignore[misc,list-item]
                            part, {"type": "text", "text": "what is it?"}]}])
                    return r.choices[0].message.content

                red = chat({"type": "image_url", "image_url": {"url": data_url(RED)}})
                blue = chat({"type": "image_url",
                             "image_url": {"url": data_url(BLUE, "image/webp")}})
                assert red and blue and red != blue
                with pytest.raises(openai.BadRequestError, match="not fetched"):
                    chat({"type": "image_url", "image_url": {"url": "https://x.test/a.png"}})
            with ollama_client(url, timeout=60) as ol:
                said = ol.chat(model="tv", messages=[{
                    "role": "user", "content": "what is it?",
                    "images": [base64.b64encode(RED).decode()]}],
                    options={"temperature": 0, "num_predict": 8})
                assert said.message.content == red
            with anthropic_client(url, "x") as an:
                msg = an.messages.create(model="tv", max_tokens=8, messages=[{
                    "role": "user", "content": [
                        {"type": "image", "source": {"type": "base64", "media_type":
                                                     "image/png",
                                                     "data": base64.b64encode(RED).decode()}},
                        {"type": "text", "text": "what is it?"}]}],
                    extra_body={"temperature": 0})
                assert msg.content[0].type == "text" and msg.content[0].text == red
            too_big = {"model": "tv", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(b"x" * (5 << 20))}}]}]}
            import json
            status, _, _ = raw(url, "POST", "/v1/chat/completions", json.dumps(too_big).encode(),
                               {"content-type": "application/json"})
            assert status == 413

        await anyio.to_thread.run_sync(clients)


def test_run_image_on_a_pipe(vision_models: Path, tmp_path: Path) -> None:
    (tmp_path / "red.png").write_bytes(RED)
    (tmp_path / "blue.webp").write_bytes(BLUE)

    def run(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([*EC, "run", "--models", str(vision_models), "--no-daemon",
                               "-n", "8", "--temperature", "0", *args],
                              capture_output=True, timeout=120, check=False)

    red, blue = run("--image", str(tmp_path / "red.png"), "what is it?"), run(
        "--image", str(tmp_path / "blue.webp"), "what is it?")
    assert red.returncode == 0 and blue.returncode == 0, red.stderr
    assert red.stdout and red.stdout != blue.stdout and red.stderr == b""
    missing = run("--image", str(tmp_path / "nope.png"), "what?")
    assert missing.returncode == 2 and b"nope.png" in missing.stderr
    assert b"Traceback" not in missing.stderr


def test_chat_image_command_on_a_terminal(vision_models: Path, tmp_path: Path) -> None:
    import pexpect
    from daemonhelp import daemon_process
    from test_chat import spawn_chat

    from everycycle.client import SyncClient

    (tmp_path / "red.png").write_bytes(RED)
    with daemon_process("--models", str(vision_models)):
        child = spawn_chat(vision_models)
        try:
            child.expect_exact(">>>")
            child.sendline(f"/image {tmp_path / 'nope.png'}")
            child.expect_exact("nope.png: No such file or directory")
            child.sendline(f"/image {tmp_path / 'red.png'}")
            child.expect_exact("(image red.png goes with your next message)")
            child.sendline("what is it?")
            child.expect_exact(">>>")
            child.sendeof()
            child.expect(pexpect.EOF)
        finally:
            child.close(force=True)
        assert child.exitstatus == 0
        with SyncClient() as c:
            [model] = c.describe_fleet().loaded_models
        assert model.name == "tv" and model.images_encoded == 1  # the image went with it


def test_an_audited_prompt_notes_an_image_by_its_size() -> None:
    from everycycle.daemon.audit import audit_record
    from everycycle.daemon.outcome import Outcome
    from everycycle.protocol import Generate

    req = Generate("r1", "tv", messages=(user(image(RED), "what is it?"),))
    record = audit_record(Outcome("r1", "tv", "cpu", None, "stop"), req, prompts=True)
    assert record["prompt"] == [["user", "what is it?", f"(image, {len(RED)} bytes)"]]
