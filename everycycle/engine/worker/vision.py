"""Images in: a vision projector (libmtmd) beside the model, on the engine thread.

A job's images are decoded with Pillow (never by hand, and never with libmtmd's own
decoder, which falls back to running ffprobe on bytes it cannot read), checked against
the size limits, and handed to libmtmd as RGB bitmaps whose id is the sha256 of the
image file. ``mtmd_tokenize`` splits the rendered prompt at its media markers into text
and image chunks. A slot remembers what its KV cells hold as one key per position: text
tokens as themselves, an image's positions as a key derived from its id, so a follow-up
about the same image reuses its cells and does not encode it again.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import InternalError, InvalidRequestError
from ..llama.llamalog import route_mtmd_log

MAX_SIDE = 8192
MAX_PIXELS = 32_000_000
"""An image's size, at most (a decompression bomb is refused before it is decoded)."""
_TEXT, _IMAGE = 0, 1


def decode_image(data: bytes, which: int) -> tuple[int, int, bytes]:
    """(width, height, RGB bytes) of an image file: PNG, JPEG, WebP, GIF, BMP. Raises
    InvalidRequestError, naming image ``which`` (1-based), for anything else."""
    from PIL import Image, UnidentifiedImageError

    Image.MAX_IMAGE_PIXELS = None  # (its bomb check, replaced by ours: before decoding)
    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            if max(w, h) > MAX_SIDE or w * h > MAX_PIXELS:
                raise InvalidRequestError(
                    f"image {which} is {w}×{h} pixels; at most {MAX_SIDE} a side and "
                    f"{MAX_PIXELS // 1_000_000} megapixels")
            im.load()
            return w, h, im.convert("RGB").tobytes()
    except InvalidRequestError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError,
            SyntaxError, EOFError) as exc:
        why = "not an image" if isinstance(exc, UnidentifiedImageError) else str(exc)
        raise InvalidRequestError(f"image {which} cannot be read ({why}): send a PNG, "
                                  "JPEG, WebP or GIF file") from None


def _key(image_id: bytes) -> int:
    """The cache key of an image's positions: negative, so never a token id."""
    return -1 - (int.from_bytes(hashlib.sha256(image_id).digest()[:4], "little") >> 1)


@dataclass(eq=False)
class Prompt:
    """A job's prompt as libmtmd chunks (freed with ``free``), and one cache key per
    position (text tokens, or an image's key)."""

    chunks: Any
    keys: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    """The position each chunk starts at."""

    def chunk_at(self, position: int) -> int:
        """The index of the chunk a reuse of ``position`` positions resumes at; a reuse
        never ends inside an image (it backs up to the image's start)."""
        for i, start in enumerate(self.starts):
            end = self.starts[i + 1] if i + 1 < len(self.starts) else len(self.keys)
            if start <= position < end:
                return i
        return len(self.starts)


class Vision:
    """The projector of one model, for its engine thread (one encode at a time)."""

    def __init__(self, model: Any, mmproj: Path, *, n_threads: int, use_gpu: bool) -> None:
        import llama_cpp.mtmd_cpp as M

        self._M = M
        route_mtmd_log(M)
        params = M.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = n_threads
        params.print_timings = False
        params.warmup = False
        self._ctx = M.mtmd_init_from_file(str(mmproj).encode(), model, params)
        if not self._ctx:
            raise InvalidRequestError(f"llama.cpp could not load the vision projector "
                                      f"{mmproj} (not a projector for this model?)")
        if not M.mtmd_support_vision(self._ctx):
            M.mtmd_free(self._ctx)
            raise InvalidRequestError(f"{mmproj} is not a vision projector")
        self.mrope = bool(M.mtmd_decode_use_mrope(self._ctx))
        """Positions are not one per token (Qwen2-VL): no prefix reuse past an image."""
        self.images_encoded = 0

    def prompt(self, text: str, images: Sequence[bytes]) -> Prompt:
        """``text`` (with one media marker per image) tokenized with ``images``. Raises
        InvalidRequestError for an image that cannot be read or a marker count that
        does not match."""
        M = self._M
        bitmaps = []
        try:
            for i, data in enumerate(images):
                w, h, rgb = decode_image(data, i + 1)
                bmp = M.mtmd_bitmap_init(w, h, (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb))
                if not bmp:
                    raise InternalError(f"libmtmd could not take image {i + 1}")
                bitmaps.append(bmp)
                M.mtmd_bitmap_set_id(bmp, hashlib.sha256(data).hexdigest().encode())
            chunks = M.mtmd_input_chunks_init()
            raw = text.encode("utf-8")
            given = M.mtmd_input_text(text=raw, text_len=len(raw), add_special=True,
                                      parse_special=True)
            array = (M.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            rc = M.mtmd_tokenize(self._ctx, chunks, ctypes.byref(given), array, len(bitmaps))
            if rc != 0:
                M.mtmd_input_chunks_free(chunks)
                raise InvalidRequestError(
                    f"the prompt has {text.count(M.mtmd_default_marker().decode())} image "
                    f"places for {len(bitmaps)} images" if rc == 1 or rc == 2 else
                    f"libmtmd could not tokenize the prompt (error {rc})")
        finally:
            for bmp in bitmaps:
                M.mtmd_bitmap_free(bmp)
        prompt = Prompt(chunks)
        for i in range(M.mtmd_input_chunks_size(chunks)):
            chunk = M.mtmd_input_chunks_get(chunks, i)
            prompt.starts.append(len(prompt.keys))
            if M.mtmd_input_chunk_get_type(chunk) == _TEXT:
                n = ctypes.c_size_t(0)
                tokens = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                prompt.keys.extend(tokens[j] for j in range(n.value))
            else:
                key = _key(M.mtmd_input_chunk_get_id(chunk) or b"")
                prompt.keys.extend([key] * M.mtmd_input_chunk_get_n_tokens(chunk))
        return prompt

    def is_image(self, prompt: Prompt, index: int) -> bool:
        chunk = self._M.mtmd_input_chunks_get(prompt.chunks, index)
        return bool(self._M.mtmd_input_chunk_get_type(chunk) == _IMAGE)

    def text_tokens(self, prompt: Prompt, index: int) -> list[int]:
        start = prompt.starts[index]
        end = prompt.starts[index + 1] if index + 1 < len(prompt.starts) else len(prompt.keys)
        return prompt.keys[start:end]

    def eval_chunk(self, lctx: Any, prompt: Prompt, index: int, n_past: int, seq: int,
                   n_batch: int) -> int:
        """Decode chunk ``index`` into sequence ``seq`` from position ``n_past`` (an
        image: encoded first); the position after it. Raises InternalError."""
        M = self._M
        chunk = M.mtmd_input_chunks_get(prompt.chunks, index)
        new = ctypes.c_int32(n_past)  # (the text path adds to it; the image path sets it)
        rc = M.mtmd_helper_eval_chunk_single(self._ctx, lctx, chunk, n_past, seq, n_batch,
                                             False, ctypes.byref(new))
        if rc != 0:
            raise InternalError(f"libmtmd could not evaluate the prompt (error {rc})")
        if M.mtmd_input_chunk_get_type(chunk) == _IMAGE:
            self.images_encoded += 1
        return int(new.value)

    def free_prompt(self, prompt: object) -> None:
        assert isinstance(prompt, Prompt)
        if prompt.chunks:
            self._M.mtmd_input_chunks_free(prompt.chunks)
            prompt.chunks = None

    def close(self) -> None:
        if self._ctx:
            self._M.mtmd_free(self._ctx)
            self._ctx = None
