"""A chat prompt tokenized by its pieces (engine/tokencache.py) is tokenized exactly as
one call of llama.cpp's tokenizer does it: random texts made of the real vocabularies'
special tokens (SmolLM2's BPE, Gemma 3's SPM with its thousands of user-defined tokens,
the tiny byte-level SPM model), plain text, whitespace and JSON, cut into pieces as
short as one character; and a long agent prompt's pieces are kept, so the next turn
tokenizes only what is new."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from templatehelp import GEMMA3, SMOLLM2

from everycycle.engine.kvcache.tokencache import Pieces
from everycycle.engine.llama.vocab import Vocab

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module", params=["smollm2", "gemma3", "tiny"])
def vocab(request: pytest.FixtureRequest, tiny_gguf: Path) -> Iterator[Vocab]:
    import llama_cpp

    path = {"smollm2": SMOLLM2, "gemma3": GEMMA3, "tiny": tiny_gguf}[request.param]
    if not path.exists():
        pytest.skip(f"{path} is not installed")
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model
    yield Vocab(llama_cpp, model)
    llama_cpp.llama_model_free(model)


class EveryPiece(Pieces):
    MIN_CHARS = 1  # every piece looked up and kept: the cuts are all exercised


def whole(vocab: Vocab, text: str) -> list[int]:
    return vocab._tokenize(text, special=True, add_special=False)


def texts(specials: list[str]) -> st.SearchStrategy[str]:
    plain = st.sampled_from([" ", "  ", "\n", "\n\n", "\t", "a", " the", "hello", "é", "✓",
                             '{"type": "object"}', "<", ">", "|", "_", "▁", "<|", "|>",
                             "<start_of", "turn>", "user\n", "0x"])
    return st.lists(st.one_of(st.sampled_from(specials), plain, st.text(max_size=6)),
                    max_size=40).map("".join)


def test_pieces_tokenize_as_one_call_does(vocab: Vocab) -> None:
    specials = vocab._specials()
    texts_of = sorted({t for t, _ in specials if t}, key=len)
    # a sample of the specials: every control one, and user-defined ones of each length
    sample = [t for t, marker in specials if marker][:200] + texts_of[:: max(1, len(texts_of)
                                                                             // 300)]
    pieces = EveryPiece(specials, lambda text: whole(vocab, text))

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(texts(sample))
    def check(text: str) -> None:
        assert pieces.tokenize(text) == whole(vocab, text), text
        assert pieces.tokenize(text) == whole(vocab, text), text  # (kept pieces again)

    check()


def agent_prompt(vocab: Vocab, turn: int) -> str:
    """A long prompt as an agent's turns render it, in the turn markers the vocabulary
    has (ChatML's, or Gemma's): the same system prompt and tools every turn, one more
    exchange each turn."""
    markers = {t for t, marker in vocab._specials() if marker}
    start, end = (("<|im_start|>", "<|im_end|>") if "<|im_start|>" in markers
                  else ("<start_of_turn>", "<end_of_turn>"))
    tools = json.loads((DATA / "mcp" / "playwright.json").read_text())["tools"]
    text = f"{start}system\nYou are an agent. Tools:\n{json.dumps(tools, indent=1)}{end}\n"
    for i in range(turn):
        text += (f"{start}user\nStep {i}: " + "do the thing. " * 200 + f"{end}\n"
                 f"{start}assistant\nDone {i}. " + "It went well. " * 200 + f"{end}\n")
    return text + f"{start}assistant\n"


def test_an_agents_next_turn_tokenizes_only_what_is_new(vocab: Vocab) -> None:
    cache = vocab._piece_cache()
    assert cache is not None
    first = agent_prompt(vocab, 3)
    assert vocab.tokenize(first, special=True) == vocab._tokenize(first, special=True,
                                                                  add_special=True)
    hits, calls = cache.hits, 0
    real = cache._tokenize

    def counted(text: str) -> list[int]:
        nonlocal calls
        calls += len(text)
        return real(text)

    cache._tokenize = counted  # type: ignore[method-assign]
    try:
        nxt = agent_prompt(vocab, 4)
        assert vocab.tokenize(nxt, special=True) == vocab._tokenize(nxt, special=True,
                                                                    add_special=True)
    finally:
        cache._tokenize = real  # type: ignore[method-assign]
    # the system prompt and the three earlier exchanges were kept: only the new
    # exchange (and the short pieces around it) was tokenized
    assert cache.hits > hits
    assert calls < len(nxt) - len(first) + 200, (calls, len(nxt) - len(first))


def test_the_cache_is_bounded(vocab: Vocab) -> None:
    specials: list[tuple[str, bool]] = [("<|x|>", True)]
    kept: dict[str, Any] = {}
    pieces = EveryPiece(specials, lambda text: kept.setdefault(text, whole(vocab, text)),
                        max_chars=100)
    for i in range(20):
        pieces.tokenize(f"<|x|>{'a' * 30}{i}")
    assert pieces._chars <= 100 and len(pieces._kept) <= 4


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 3), max_size=3000), st.integers(0, 3000), st.booleans(),
       st.sampled_from([list, tuple]))
def test_common_prefix_counts_what_two_prompts_share(
        tokens: list[int], cut: int, differ: bool, kind: type) -> None:
    """(compared block by block: a long agent prompt's 20k tokens against each slot)"""
    from everycycle.engine.core.jobs import common_prefix

    cut = min(cut, len(tokens))
    other = tokens[:cut] + [9] + tokens[cut:] if differ else tokens[:cut]
    assert common_prefix(tokens, kind(other)) == cut == common_prefix(kind(tokens), other)
