"""Reading llama-server's native requests: its prompts (text, token ids, a mix of both,
or several of them), its infill fields, and the options its clients send beside the
OpenAI ones (``n_predict``, ``n_probs``, ``ignore_eos``, …). Every mistake is an
HttpError (400) naming the field, as llama-server words it where it has words.

What is read and what is only accepted (llama-server's knobs that choose nothing here)
is listed once, in ``ACCEPTED``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...protocol import Infill, InfillChunk
from .common import HttpError, protocol_errors

Piece = str | int
"""Part of a prompt: text to tokenize, or a token id."""

Prompt = tuple[Piece, ...]

log = logging.getLogger(__name__)


ACCEPTED = frozenset({
    "cache_prompt",  # a slot's cells are always reused where a prompt extends them
    "id_slot",  # the scheduler seats a request in the slot that holds most of its prompt
    "n_keep", "n_discard",  # the context is never shifted: a full context ends the answer
    "t_max_prompt_ms",  # a prompt is read whole
    "timings_per_token",  # the last object carries the timings
    "return_progress",  # prompt progress comes where the prompt is long (OpenAI streams)
    "typical_p", "mirostat", "mirostat_tau", "mirostat_eta",  # (the sampling table's)
    "api_key", "image_data", "multimodal_data", "slot_id",
})
"""Fields of llama-server's that its clients send and this dialect accepts without
their changing anything here (each with its reason); the others it reads."""


def _prompt_error(what: str) -> HttpError:
    return HttpError(400, f"{what} must be a string, a list of token ids (and strings), "
                     "or a list of such prompts", "invalid_prompt")


def _piece_list(value: list[Any], what: str) -> Prompt:
    out: list[Piece] = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | str):
            raise _prompt_error(what)
        if isinstance(item, int) and item < 0:
            raise HttpError(400, f"{what}: token ids are 0 or more", "invalid_prompt")
        out.append(item)
    return tuple(out)


def _one(value: Any, what: str) -> Prompt:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, dict):  # {"prompt_string": …, "multimodal_data": […]}
        if value.get("multimodal_data"):
            raise HttpError(400, f"{what}: multimodal_data is not supported on this route; "
                            "send images to /v1/chat/completions", "unsupported_content")
        text = value.get("prompt_string")
        if not isinstance(text, str):
            raise HttpError(400, f"{what}: a JSON prompt needs `prompt_string`",
                            "invalid_prompt")
        return (text,)
    if isinstance(value, list) and value:
        return _piece_list(value, what)
    raise _prompt_error(what)


def prompts(value: Any, what: str = "`prompt`") -> list[Prompt]:
    """llama-server's ``prompt``: one (a string, or token ids mixed with strings) or a
    list of them. Raises HttpError (400)."""
    if isinstance(value, list) and value and any(
            isinstance(v, int) and not isinstance(v, bool) for v in value) and all(
            isinstance(v, int | str) and not isinstance(v, bool) for v in value):
        return [_piece_list(value, what)]  # one mixed sequence
    if isinstance(value, list) and value:
        return [_one(v, f"{what}[{i}]") for i, v in enumerate(value)]
    return [_one(value, what)]


def integer(data: dict[str, Any], name: str, default: int | None = None) -> int | None:
    """An integer field (absent: ``default``). Raises HttpError (400)."""
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise HttpError(400, f"`{name}` must be an integer", "invalid_type")
    return value


def flag(data: dict[str, Any], name: str, default: bool = False) -> bool:
    """A boolean field. Raises HttpError (400)."""
    value = data.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HttpError(400, f"`{name}` must be a boolean", "invalid_type")
    return value


def strings(data: dict[str, Any], name: str) -> list[str]:
    """A list of strings (absent: empty). Raises HttpError (400)."""
    value = data.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise HttpError(400, f"`{name}` must be a list of strings", "invalid_type")
    return value


@dataclass(frozen=True, slots=True)
class Completion:
    """What a native completion asks beyond the Generate: how its answer looks."""

    n_predict: int | None
    """Tokens at most (None: until the end or the context is full; 0: read the prompt
    only, llama.vim's warm-up)."""
    n_probs: int
    post_sampling: bool
    return_tokens: bool
    response_fields: tuple[str, ...]
    stream: bool


def completion(data: dict[str, Any]) -> tuple[Completion, dict[str, Any]]:
    """The answer's shape, and the Generate fields of llama-server's own options
    (``max_tokens``, ``logprobs``, ``ignore_eos``). Raises HttpError (400)."""
    if ignored := sorted(ACCEPTED & data.keys()):
        log.debug("accepted, changing nothing here: %s", ", ".join(ignored))
    n_predict = integer(data, "n_predict", integer(data, "max_tokens"))
    if n_predict is not None and n_predict < 0:
        n_predict = None  # (-1: as many as the context holds)
    n_probs = integer(data, "n_probs", 0) or 0
    if n_probs < 0:
        raise HttpError(400, "`n_probs` must be 0 or more", "invalid_value")
    shape = Completion(
        n_predict=n_predict, n_probs=min(n_probs, 20),
        post_sampling=flag(data, "post_sampling_probs"),
        return_tokens=flag(data, "return_tokens"),
        response_fields=tuple(strings(data, "response_fields")),
        stream=flag(data, "stream"))
    fields: dict[str, Any] = {}
    if n_predict is not None:
        fields["max_tokens"] = max(1, n_predict)
    if n_probs:
        fields["logprobs"] = shape.n_probs
        if shape.post_sampling:
            fields["post_sampling_probs"] = True
    if flag(data, "ignore_eos"):
        fields["ignore_eos"] = True
    for name in ("n_indent", "t_max_predict_ms"):
        value = integer(data, name, 0) or 0
        if value < 0:
            raise HttpError(400, f"`{name}` must be 0 or more", "invalid_value")
        if value:
            fields[name] = value
    return shape, fields


def infill(data: dict[str, Any]) -> tuple[str, Infill]:
    """``/infill``'s ``input_prefix``, ``input_suffix``, ``input_extra`` and ``prompt``:
    the text before the cursor, and the rest of the fill. Raises HttpError (400) with
    llama-server's words."""
    prompt = data.get("prompt", "")
    if not isinstance(prompt, str):
        raise HttpError(400, '"prompt" must be a string', "invalid_request_error")
    for name in ("input_prefix", "input_suffix"):
        if name not in data:
            raise HttpError(400, f'"{name}" is required', "invalid_request_error")
        if not isinstance(data[name], str):
            raise HttpError(400, f'"{name}" must be a string', "invalid_request_error")
    extra = data.get("input_extra", [])
    if not isinstance(extra, list):
        raise HttpError(400, '"input_extra" must be an array of {"filename": string, '
                        '"text": string}', "invalid_request_error")
    chunks: list[InfillChunk] = []
    for chunk in extra:
        text = chunk.get("text") if isinstance(chunk, dict) else None
        if not isinstance(text, str):
            raise HttpError(400, 'extra_context chunk must contain a "text" field with a '
                            "string value", "invalid_request_error")
        name = chunk.get("filename", "tmp")
        if not isinstance(name, str):
            raise HttpError(400, "extra_context chunk's \"filename\" field must be a string",
                            "invalid_request_error")
        chunks.append(protocol_errors(InfillChunk, name or "tmp", text))
    return data["input_prefix"], protocol_errors(Infill, data["input_suffix"], tuple(chunks),
                                                 prompt)


def token_ids(value: Any, what: str) -> list[int]:
    """A list of token ids. Raises HttpError (400)."""
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise HttpError(400, f"{what} must be a list of token ids", "invalid_type")
    return value


def nested(fields: Sequence[str], obj: dict[str, Any]) -> dict[str, Any]:
    """llama-server's ``response_fields``: each path (``a/b``) that ``obj`` has, by its
    path."""
    out: dict[str, Any] = {}
    for path in fields:
        value: Any = obj
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out
