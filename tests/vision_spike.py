"""A spike, not a test: image input through llama.cpp's libmtmd, from Python with ctypes.

It writes the tiny text model (tinymodel.py) and the tiny random-weight projector
(tinyvision.py) to a temporary folder, loads both with raw llama_cpp / llama_cpp.mtmd_cpp
calls, and for two different PNG images: decodes the image bytes with libmtmd's helper
(stb_image), tokenizes a prompt holding the media marker into chunks, evaluates the
chunks, and samples 8 tokens greedily. It prints the chunks, the two token sequences
(they differ), the encode timings, what truncated / non-image bytes do, and how the
image chunks' content ids behave. Run it with ``.venv/bin/python tests/vision_spike.py``.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from tinymodel import write_tiny_gguf
from tinyvision import write_tiny_mmproj

N_CTX = 512
N_BATCH = 64
# One thread: on a loaded machine (more runnable threads than cores), ggml's threads
# spin at their barriers and a 2-thread encode of this tiny graph jumps to 100s of ms.
N_THREADS = 1
N_GENERATE = 8
PROMPT = "look: {marker} what is it?"
GGML_LOG_LEVEL_WARN = 3
# libmtmd is built with video support (MTMD_VIDEO): whatever stb_image cannot decode, the
# helper hands to ffprobe / ffmpeg, found on PATH. Pointing ffmpeg_bin_dir at a folder
# without them makes that launch fail at once.
NO_FFMPEG = b"/nonexistent/ffmpeg-disabled"
IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM")


def looks_like_image(data: bytes) -> bool:
    """Whether ``data`` starts like a PNG, JPEG, GIF or BMP (what stb_image decodes
    here, with PSD, TGA, HDR, PIC and PNM): anything else never reaches libmtmd."""
    return data.startswith(IMAGE_MAGIC)


def say(*parts: object) -> None:
    print(*parts, flush=True)  # noqa: T201 - a spike: its output is the point


def png(width: int, height: int, pixel: Any) -> bytes:
    """An 8-bit RGB PNG, ``pixel(x, y)`` giving each pixel's (r, g, b)."""
    raw = bytearray()
    for y in range(height):
        raw.append(0)  # filter: none
        for x in range(width):
            raw.extend(bytes(pixel(x, y)))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(bytes(raw))) + chunk(b"IEND", b""))


class Spike:
    def __init__(self, model_path: Path, mmproj_path: Path) -> None:
        import llama_cpp
        import llama_cpp.mtmd_cpp as mtmd

        self.L: Any = llama_cpp
        self.M: Any = mtmd
        self.log: list[tuple[int, str]] = []

        # libmtmd logs through its own callback (not llama_log_set's): keep its lines,
        # show the warnings and errors. The CFUNCTYPE object must outlive the library's
        # use of it.
        def on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
            line = text.decode("utf-8", "replace")
            self.log.append((level, line))
            if level >= GGML_LOG_LEVEL_WARN and level != 5 and line.strip():  # 5: CONT
                sys.stderr.write(f"  [mtmd log {level}] {line.rstrip()}\n")

        self._on_log = llama_cpp.llama_log_callback(on_log)
        mtmd.mtmd_helper_log_set(self._on_log, None)  # also calls mtmd_log_set

        def quiet(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
            if level == 4:
                sys.stderr.write(f"  [llama log] {text.decode('utf-8', 'replace').rstrip()}\n")

        self._quiet = llama_cpp.llama_log_callback(quiet)
        llama_cpp.llama_log_set(self._quiet, None)

        L = self.L
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(str(model_path).encode(), mparams)
        assert self.model, "llama_model_load_from_file failed"
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        say(f"text model: n_embd_inp={L.llama_model_n_embd_inp(self.model)} "
            f"n_vocab={self.n_vocab}")

        cparams = L.llama_context_default_params()
        cparams.n_ctx = N_CTX
        cparams.n_batch = N_BATCH
        cparams.n_ubatch = N_BATCH
        cparams.n_seq_max = 1
        cparams.n_threads = N_THREADS
        cparams.n_threads_batch = N_THREADS
        cparams.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cparams)
        assert self.ctx, "llama_init_from_model failed"

        params = mtmd.mtmd_context_params_default()
        params.use_gpu = False
        params.n_threads = N_THREADS
        params.print_timings = False
        params.warmup = False  # the first encode then sizes the compute buffers itself
        params.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED (-1 auto, 1 enabled)
        t0 = time.perf_counter()
        self.mctx = mtmd.mtmd_init_from_file(str(mmproj_path).encode(), self.model, params)
        assert self.mctx, "mtmd_init_from_file failed"
        say(f"mtmd_init_from_file: {1000 * (time.perf_counter() - t0):.1f} ms; "
            f"vision={mtmd.mtmd_support_vision(self.mctx)} "
            f"audio={mtmd.mtmd_support_audio(self.mctx)} "
            f"video helper={mtmd.mtmd_helper_support_video(self.mctx)} "
            f"mrope={mtmd.mtmd_decode_use_mrope(self.mctx)} "
            f"marker={mtmd.mtmd_get_marker(self.mctx)!r} "
            f"default marker={mtmd.mtmd_default_marker()!r}")
        caps = mtmd.mtmd_get_cap_from_file(str(mmproj_path).encode())
        say(f"mtmd_get_cap_from_file: inp_vision={caps.inp_vision} inp_audio={caps.inp_audio}")

    def close(self) -> None:
        self.M.mtmd_free(self.mctx)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)

    # --- images -------------------------------------------------------------------

    def bitmap(self, data: bytes, *, video: bool = False) -> int | None:
        """A bitmap of the encoded image ``data`` (PNG, JPEG, BMP, GIF... via stb_image),
        its id set to the SHA-256 of ``data``; None where libmtmd cannot decode it. With
        ``video``, what stb_image cannot decode goes on to ffprobe on PATH."""
        buf = (ctypes.c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0")
        opt = self.M.mtmd_helper_init_opt_default()
        if not video:
            opt.video_params.ffmpeg_bin_dir = NO_FFMPEG
        wrapper = self.M.mtmd_helper_bitmap_init_from_buf_wrapper(
            self.mctx, buf, len(data), False, opt)
        if wrapper.video_ctx:  # a video: not wanted here
            self.M.mtmd_helper_video_free(wrapper.video_ctx)
        return int(wrapper.bitmap) if wrapper.bitmap else None

    def tokenize(self, prompt: str, bitmaps: list[int]) -> tuple[int, Any]:
        """(mtmd_tokenize's return code, the chunks: free them with mtmd_input_chunks_free)."""
        M = self.M
        raw = prompt.encode()
        text = M.mtmd_input_text(text=raw, text_len=len(raw), add_special=True,
                                 parse_special=True)
        arr = (M.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
        chunks = M.mtmd_input_chunks_init()
        rc = M.mtmd_tokenize(self.mctx, chunks, ctypes.byref(text), arr, len(bitmaps))
        return int(rc), chunks

    def describe(self, chunks: Any) -> list[str]:
        M = self.M
        out = []
        for i in range(M.mtmd_input_chunks_size(chunks)):
            c = M.mtmd_input_chunks_get(chunks, i)
            kind = {0: "TEXT", 1: "IMAGE", 2: "AUDIO"}[M.mtmd_input_chunk_get_type(c)]
            line = (f"chunk {i}: {kind} n_tokens={M.mtmd_input_chunk_get_n_tokens(c)} "
                    f"n_pos={M.mtmd_input_chunk_get_n_pos(c)}")
            if kind == "TEXT":
                n = ctypes.c_size_t()
                toks = M.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                line += f" tokens={[toks[j] for j in range(n.value)]}"
            else:
                img = M.mtmd_input_chunk_get_tokens_image(c)
                cid = M.mtmd_input_chunk_get_id(c)
                line += (f" image_tokens={M.mtmd_image_tokens_get_n_tokens(img)} "
                         f"grid={M.mtmd_image_tokens_get_nx(img)}x"
                         f"{M.mtmd_image_tokens_get_ny(img)} "
                         f"id={cid!r}")
            out.append(line)
        return out

    def image_chunk(self, chunks: Any) -> Any:
        M = self.M
        for i in range(M.mtmd_input_chunks_size(chunks)):
            c = M.mtmd_input_chunks_get(chunks, i)
            if M.mtmd_input_chunk_get_type(c) == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                return c
        raise AssertionError("no image chunk")

    # --- generation ---------------------------------------------------------------

    def evaluate(self, chunks: Any) -> int:
        """Clear the KV cache, evaluate ``chunks`` from position 0: the new n_past."""
        L, M = self.L, self.M
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        new_n_past = L.llama_pos(0)
        rc = M.mtmd_helper_eval_chunks(self.mctx, self.ctx, chunks, 0, 0, N_BATCH, True,
                                       ctypes.byref(new_n_past))
        assert rc == 0, f"mtmd_helper_eval_chunks returned {rc}"
        return int(new_n_past.value)

    def logits(self) -> np.ndarray | None:
        ptr = self.L.llama_get_logits_ith(self.ctx, -1)
        if not ptr:
            return None
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def generate(self, n_past: int, n: int) -> list[int]:
        """Greedily sample ``n`` tokens after the evaluated prompt."""
        L = self.L
        out: list[int] = []
        one = (L.llama_token * 1)()
        for _ in range(n):
            logits = self.logits()
            assert logits is not None and np.isfinite(logits).all()
            tok = int(np.argmax(logits))
            out.append(tok)
            one[0] = tok
            # llama_batch_get_one: positions follow the sequence's last one in the KV
            # cache (n_past), and the one token's logits are output.
            rc = L.llama_decode(self.ctx, L.llama_batch_get_one(one, 1))
            assert rc == 0, f"llama_decode returned {rc}"
            n_past += 1
        return out

    def piece(self, tok: int) -> str:
        buf = ctypes.create_string_buffer(64)
        n = self.L.llama_token_to_piece(self.vocab, tok, buf, len(buf), 0, True)
        return buf.raw[:max(n, 0)].decode("utf-8", "replace")

    def embeddings(self, chunk: Any) -> np.ndarray:
        """Encode an image chunk alone: its embeddings, [n_tokens, n_embd]."""
        M = self.M
        rc = M.mtmd_encode_chunk(self.mctx, chunk)
        assert rc == 0, f"mtmd_encode_chunk returned {rc}"
        n = M.mtmd_input_chunk_get_n_tokens(chunk)
        n_embd = self.L.llama_model_n_embd_inp(self.model)
        ptr = M.mtmd_get_output_embd(self.mctx)
        return np.ctypeslib.as_array(ptr, shape=(n, n_embd)).copy()


    def eval_granular(self, chunks: Any) -> int:
        """Evaluate ``chunks`` as a server would, one chunk at a time: text chunks with
        mtmd_helper_eval_chunk_single, image chunks encoded by mtmd_encode_chunk (their
        embeddings copied out: a cache could keep them) and decoded with
        mtmd_helper_decode_image_chunk. The new n_past."""
        L, M = self.L, self.M
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        n_past = 0
        n = M.mtmd_input_chunks_size(chunks)
        for i in range(n):
            c = M.mtmd_input_chunks_get(chunks, i)
            # the text path ADDS its token count to *new_n_past: start it at n_past
            new_n_past = L.llama_pos(n_past)
            if M.mtmd_input_chunk_get_type(c) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                rc = M.mtmd_helper_eval_chunk_single(self.mctx, self.ctx, c, n_past, 0,
                                                     N_BATCH, i == n - 1,
                                                     ctypes.byref(new_n_past))
            else:
                embd = self.embeddings(c)  # a copy: mtmd's buffer is reused by each encode
                flat = np.ascontiguousarray(embd, dtype=np.float32)
                ptr = flat.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                rc = M.mtmd_helper_decode_image_chunk(self.mctx, self.ctx, c, ptr, n_past, 0,
                                                      N_BATCH, ctypes.byref(new_n_past),
                                                      M.mtmd_helper_post_decode_callback(),
                                                      None)
            assert rc == 0, f"chunk {i}: {rc}"
            n_past = int(new_n_past.value)
        return n_past


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_path = write_tiny_gguf(Path(tmp) / "tiny.gguf")
        mmproj_path = write_tiny_mmproj(Path(tmp) / "tiny-mmproj.gguf")
        say(f"mmproj: {mmproj_path.stat().st_size} bytes")
        spike = Spike(model_path, mmproj_path)
        try:
            run(spike)
        finally:
            spike.close()


def run(s: Spike) -> None:
    M = s.M
    marker = M.mtmd_default_marker().decode()
    prompt = PROMPT.format(marker=marker)
    images = {
        "A (48x32 red-green gradient)": png(48, 32, lambda x, y: (x * 5, y * 7, 40)),
        "B (32x32 blue-yellow checker)": png(
            32, 32, lambda x, y: (250, 220, 0) if (x // 4 + y // 4) % 2 else (0, 30, 200)),
    }
    say(f"\nprompt: {prompt!r}")
    sequences = []
    embds = []
    for name, data in images.items():
        say(f"\n== image {name}: {len(data)} PNG bytes")
        bmp = s.bitmap(data)
        assert bmp is not None
        say(f"bitmap {M.mtmd_bitmap_get_nx(bmp)}x{M.mtmd_bitmap_get_ny(bmp)} "
            f"n_bytes={M.mtmd_bitmap_get_n_bytes(bmp)} "
            f"id={M.mtmd_bitmap_get_id(bmp).decode()}")
        rc, chunks = s.tokenize(prompt, [bmp])
        assert rc == 0, f"mtmd_tokenize returned {rc}"
        say(f"chunks: {M.mtmd_input_chunks_size(chunks)} "
            f"(total tokens {M.mtmd_helper_get_n_tokens(chunks)}, "
            f"positions {M.mtmd_helper_get_n_pos(chunks)})")
        for line in s.describe(chunks):
            say("  " + line)
        chunk = s.image_chunk(chunks)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            e = s.embeddings(chunk)
            times.append(1000 * (time.perf_counter() - t0))
        say(f"mtmd_encode_chunk: {', '.join(f'{t:.2f}' for t in times)} ms; embeddings "
            f"{e.shape} finite={np.isfinite(e).all()} mean={e.mean():.3f} std={e.std():.3f} "
            f"dim0={e[:, 0].min():.2f}..{e[:, 0].max():.2f}")
        embds.append(e)
        t0 = time.perf_counter()
        n_past = s.evaluate(chunks)
        say(f"mtmd_helper_eval_chunks: n_past {n_past} "
            f"in {1000 * (time.perf_counter() - t0):.1f} ms (encode + decode)")
        toks = s.generate(n_past, N_GENERATE)
        say(f"greedy tokens: {toks} = {''.join(s.piece(t) for t in toks)!r}")
        sequences.append(toks)
        M.mtmd_input_chunks_free(chunks)
        M.mtmd_bitmap_free(bmp)
    diff = float(np.abs(embds[0] - embds[1]).mean())
    say(f"\nmean |embedding A - embedding B| = {diff:.3f}")
    say(f"token sequences differ: {sequences[0] != sequences[1]}")
    assert sequences[0] != sequences[1]

    # Same image twice: the same tokens (deterministic) and the same id.
    data_a = next(iter(images.values()))
    bmp = s.bitmap(data_a)
    assert bmp is not None
    rc, chunks = s.tokenize(prompt, [bmp])
    again = s.generate(s.evaluate(chunks), N_GENERATE)
    say(f"image A again: {again} (same as before: {again == sequences[0]})")
    n_past = s.eval_granular(chunks)
    granular = s.generate(n_past, N_GENERATE)
    say(f"image A chunk by chunk (encode, copy, decode_image_chunk): n_past {n_past}, "
        f"{granular} (same: {granular == sequences[0]})")
    M.mtmd_input_chunks_free(chunks)

    say("\n== content ids")
    cid = M.mtmd_input_chunk_get_id
    say(f"mtmd_input_chunk_get_id bound: {hasattr(M, 'mtmd_input_chunk_get_id')}")
    rc, chunks = s.tokenize(prompt, [bmp])
    first = cid(s.image_chunk(chunks)).decode()
    M.mtmd_input_chunks_free(chunks)
    bmp2 = s.bitmap(data_a)
    assert bmp2 is not None
    rc, chunks = s.tokenize(prompt, [bmp2])
    second = cid(s.image_chunk(chunks)).decode()
    M.mtmd_input_chunks_free(chunks)
    say(f"same bytes, two bitmaps: ids equal {first == second}: {first}")
    M.mtmd_bitmap_set_id(bmp2, b"my-own-id")
    rc, chunks = s.tokenize(prompt, [bmp2])
    img_chunk = s.image_chunk(chunks)
    say(f"after mtmd_bitmap_set_id(b'my-own-id'): chunk id {cid(img_chunk)!r}, "
        f"image tokens id {M.mtmd_image_tokens_get_id(M.mtmd_input_chunk_get_tokens_image(img_chunk))!r}")
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_bitmap_set_id(bmp2, None)
    rc, chunks = s.tokenize(prompt, [bmp2])
    say(f"after mtmd_bitmap_set_id(None): chunk id {cid(s.image_chunk(chunks))!r}")
    M.mtmd_input_chunks_free(chunks)
    _, chunks = s.tokenize("no image here", [])
    c0 = M.mtmd_input_chunks_get(chunks, 0)
    say(f"text chunk id: {cid(c0)!r}")
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_bitmap_free(bmp2)

    say("\n== prompt/bitmap mismatches")
    rc, chunks = s.tokenize(prompt, [])
    say(f"marker, no bitmap: mtmd_tokenize -> {rc}")
    M.mtmd_input_chunks_free(chunks)
    rc, chunks = s.tokenize("no marker", [bmp])
    say(f"bitmap, no marker: mtmd_tokenize -> {rc}")
    M.mtmd_input_chunks_free(chunks)
    rc, chunks = s.tokenize(f"{marker}", [bmp])
    say(f"prompt that ends with the image: {s.describe(chunks)}")
    n_past = s.evaluate(chunks)
    logits = s.logits()
    say(f"  evaluated (n_past {n_past}); llama_get_logits_ith(-1) is "
        f"{'NULL' if logits is None else 'a row'}: an image chunk outputs no logits")
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_bitmap_free(bmp)

    say("\n== bad images")
    png_a = data_a
    bad = {
        "truncated PNG (first half)": png_a[: len(png_a) // 2],
        "PNG cut after IHDR": png_a[:33],
        "PNG with corrupt IDAT crc": png_a[:40] + bytes([png_a[40] ^ 0xFF]) + png_a[41:],
        "non-image text bytes": b"hello, this is not an image at all " * 4,
        "8 random bytes": bytes([7, 1, 2, 3, 250, 9, 0, 4]),
        "empty": b"",
        "fake WAV header": b"RIFF\0\0\0\0WAVEfmt " + bytes(32),
    }
    for name, data in bad.items():
        n_log = len(s.log)
        t0 = time.perf_counter()
        bmp_bad = s.bitmap(data)
        ms = 1000 * (time.perf_counter() - t0)
        errors = [t.strip() for lv, t in s.log[n_log:] if lv >= GGML_LOG_LEVEL_WARN]
        if bmp_bad is None:
            say(f"{name}: NULL bitmap in {ms:.1f} ms (looks like an image: "
                f"{looks_like_image(data)}); log: {errors}")
        else:
            say(f"{name}: bitmap {M.mtmd_bitmap_get_nx(bmp_bad)}x"
                f"{M.mtmd_bitmap_get_ny(bmp_bad)} audio={M.mtmd_bitmap_is_audio(bmp_bad)}")
            M.mtmd_bitmap_free(bmp_bad)

    # A fake ffprobe first on PATH, that notes each launch: the default options launch
    # it for undecodable bytes, NO_FFMPEG does not.
    with tempfile.TemporaryDirectory() as bindir:
        note = Path(bindir) / "launched"
        fake = Path(bindir) / "ffprobe"
        fake.write_text(f"#!/bin/sh\necho \"$@\" >> {note}\nexit 1\n")
        fake.chmod(0o755)
        saved = os.environ["PATH"]
        os.environ["PATH"] = f"{bindir}:{saved}"
        try:
            for video in (True, False):
                assert s.bitmap(bad["truncated PNG (first half)"], video=video) is None
                launched = note.read_text().strip() if note.exists() else None
                say(f"truncated PNG, ffmpeg_bin_dir "
                    f"{'NULL (ffprobe from PATH)' if video else repr(NO_FFMPEG)}: NULL; "
                    f"fake ffprobe launched: {launched!r}")
                note.unlink(missing_ok=True)
        finally:
            os.environ["PATH"] = saved

    say("\n== raw RGB bitmap (mtmd_bitmap_init) and a 1x1 image")
    rgb = bytes(range(256)) * 12  # 32x32x3 = 3072
    raw = (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb)
    bmp = M.mtmd_bitmap_init(32, 32, raw)
    say(f"mtmd_bitmap_init: id={M.mtmd_bitmap_get_id(bmp)!r} (no id unless set)")
    rc, chunks = s.tokenize(prompt, [bmp])
    say(f"  tokenize -> {rc}; {s.describe(chunks)[1]}")
    toks = s.generate(s.evaluate(chunks), N_GENERATE)
    say(f"  greedy tokens: {toks}")
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_bitmap_free(bmp)
    tiny = s.bitmap(png(1, 1, lambda x, y: (255, 0, 0)))
    assert tiny is not None
    rc, chunks = s.tokenize(prompt, [tiny])
    say(f"1x1 PNG: tokenize -> {rc}; {s.describe(chunks)[1]}")
    say(f"  greedy tokens: {s.generate(s.evaluate(chunks), N_GENERATE)}")
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_bitmap_free(tiny)


if __name__ == "__main__":
    main()
