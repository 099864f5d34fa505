"""The tiny GGUF the suite runs on: real llama.cpp loads it and decodes tokens."""

from __future__ import annotations

from pathlib import Path

import llama_cpp


def test_tiny_gguf_is_small(tiny_gguf: Path) -> None:
    assert 50_000 < tiny_gguf.stat().st_size < 2_000_000


def test_llama_cpp_loads_and_decodes_the_tiny_gguf(tiny_gguf: Path) -> None:
    llm = llama_cpp.Llama(str(tiny_gguf), n_ctx=128, verbose=False, seed=1)
    out = llm.create_completion("hello", max_tokens=8, temperature=0.0)
    assert out["usage"]["completion_tokens"] >= 1
    tokens = llm.tokenize(b"hello world")
    assert tokens[0] == 1 and len(tokens) > 2
    llm.close()
