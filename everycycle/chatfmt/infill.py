"""Fill-in-the-middle prompts: a model's FIM tokens and the layout llama-server gives an
infill request, so that every client's FIM request reads the same tokens here as there.

The layout is llama.cpp's repo-level pattern (``format_prompt_infill`` in its server,
after https://arxiv.org/pdf/2409.12186)::

    [FIM_REP]myproject\\n
    [FIM_SEP]filename0\\n extra chunk 0
    [FIM_SEP]filename1\\n extra chunk 1
    [FIM_SEP]filename\\n
    [FIM_PRE]prefix middle[FIM_SUF]suffix[FIM_MID]

``[FIM_REP]`` and ``[FIM_SEP]`` only where the model has them (else each chunk follows a
plain-text snippet separator). The prefix keeps its last three quarters of a batch, the
suffix its first quarter (less the middle); the extra chunks fill what the context has
left, their end kept. Pure: the tokenizer is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

FIM_BATCH = 2048
"""The batch the prefix and suffix are cut to fit (llama-server's default ``-b``)."""

_SNIPPET = "\n\n--- snippet ---\n\n"
"""What separates extra chunks for a model without a file separator (llama-server's)."""


class FimTokens(NamedTuple):
    """A vocabulary's fill-in-the-middle tokens, as llama.cpp finds them (the GGUF's
    ``tokenizer.ggml.fim_*_token_id`` keys, else the tokens' text: ``<fim_prefix>``,
    ``<|fim_prefix|>``, ``<PRE>``, …); None where it has none."""

    pre: int | None = None
    suf: int | None = None
    mid: int | None = None
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None

    @property
    def missing(self) -> list[str]:
        """The tokens a fill-in-the-middle prompt needs that the vocabulary lacks."""
        return [name for name, tok in (("prefix", self.pre), ("suffix", self.suf),
                                       ("middle", self.mid)) if tok is None]


FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
            "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
            "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
            "▁<MID>", "<|code_middle|>", "<|middle|>"),
}
"""The texts llama.cpp takes for a vocabulary's FIM prefix, suffix and middle tokens
where its GGUF names none (``llama-vocab.cpp``)."""

_FIM_KEYS = {"pre": ("fim_pre", "prefix"), "suf": ("fim_suf", "suffix"),
             "mid": ("fim_mid", "middle")}
"""Their GGUF keys (``tokenizer.ggml.{name}_token_id``; the second ones deprecated)."""


def fim_texts(meta: Mapping[str, Any], tokens: Sequence[str]) -> tuple[str, str, str] | None:
    """A GGUF's FIM prefix, suffix and middle tokens' texts, found as llama.cpp finds
    them (its keys, else these texts), from its metadata alone (no model loaded);
    None where one is missing. ``tokens``: its ``tokenizer.ggml.tokens``."""
    found = []
    for role, keys in _FIM_KEYS.items():
        ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in keys]
        tid = next((i for i in ids if isinstance(i, int) and 0 <= i < len(tokens)), None)
        if tid is not None:
            found.append(tokens[tid])
            continue
        texts = set(FIM_TEXTS[role])
        text = next((t for t in tokens if t in texts), None)
        if text is None:
            return None
        found.append(text)
    return found[0], found[1], found[2]


class Chunk(NamedTuple):
    """Repo-level context: another file's name and text."""

    filename: str
    text: str


Tokenize = Callable[[Sequence[str]], list[list[int]]]
"""Texts to tokens, plain (no special tokens parsed, none added), one list per text."""


def layout(fim: FimTokens, tokenize: Tokenize, *, prefix: str, suffix: str,
           middle: str = "", extra: Sequence[Chunk] = (), bos: int | None = None,
           n_ctx: int, n_predict: int, n_batch: int = FIM_BATCH) -> list[int]:
    """The prompt's tokens: ``extra`` chunks, then ``prefix`` and ``middle`` (text the
    user has typed after the prefix) around the FIM markers, ``bos`` first where the
    vocabulary adds one. ``fim`` must have its prefix, suffix and middle tokens."""
    assert fim.pre is not None and fim.suf is not None and fim.mid is not None
    texts = [prefix, suffix, middle, "myproject\n", "filename\n", _SNIPPET]
    for chunk in extra:
        texts += [chunk.filename + "\n", chunk.text]
    toks = tokenize(texts)
    t_prefix, t_suffix, t_middle, t_repo, t_file, t_snippet = toks[:6]
    extra_tokens: list[int] = []
    if fim.rep is not None:
        extra_tokens += [fim.rep, *t_repo]
    for i in range(len(extra)):
        t_name, t_text = toks[6 + 2 * i], toks[7 + 2 * i]
        extra_tokens += [fim.sep, *t_name] if fim.sep is not None else t_snippet
        extra_tokens += t_text
    if fim.sep is not None:
        extra_tokens += [fim.sep, *t_file]
    n_prefix = min(len(t_prefix), 3 * (n_batch // 4))
    n_suffix = min(len(t_suffix), max(0, n_batch // 4 - (2 + len(t_middle))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    head = [fim.pre, *t_prefix[len(t_prefix) - n_prefix:], *t_middle]
    tail = [fim.suf, *t_suffix[:n_suffix]]
    out = [bos] if bos is not None else []
    return [*(extra_tokens[len(extra_tokens) - n_extra:] if n_extra else []), *out,
            *head, *tail, fim.mid]
