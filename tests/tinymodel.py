"""Writes a tiny random-weight llama GGUF with a byte-level vocabulary.

Real llama.cpp loads and decodes it in milliseconds. The vocabulary is SentencePiece
style: <unk>, <s>, </s>, the 256 byte tokens <0x00>..<0xFF>, then a few whole
words, so generated text really does split UTF-8 characters across tokens. The
GGUF carries Gemma's chat template text, which llama.cpp recognises.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from everycycle.hardware.ggufwrite import finish, write_hparams, write_lora

CHAT_TEMPLATE = (  # Gemma's: the assistant's turns are the model's
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
WORDS = [" ", "hello", "world", " the", " a", "ing", "é", "✓", "<start_of_turn>", "<end_of_turn>"]

FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>",
              "<|fim_repo|>", "<|file_sep|>"]
"""Qwen's FIM tokens, which llama.cpp finds by their text."""
FIM_KEYED = {"pre": "<pfx>", "suf": "<sfx>", "mid": "<mdl>"}
"""FIM tokens llama.cpp knows only by the GGUF's ``tokenizer.ggml.fim_*_token_id`` keys."""

N_EMBD = 64
N_HEAD = 4
N_LAYER = 2
N_FF = 128
N_CTX = 16384


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(gguf.TokenType.BYTE)
    for w in WORDS:
        tokens.append(w.replace(" ", "\u2581"))
        types.append(
            gguf.TokenType.CONTROL if w.startswith("<") else gguf.TokenType.NORMAL
        )
    scores = [0.0] * len(tokens)
    for i in range(len(WORDS)):
        scores[259 + i] = -1.0 - i
    return tokens, scores, [int(t) for t in types]


def write_tiny_gguf(path: Path, *, seed: int = 1234,
                    chat_template: str | None = CHAT_TEMPLATE,
                    sliding_window: int | None = None, n_head: int = N_HEAD,
                    n_layer: int = N_LAYER, n_embd: int = N_EMBD, n_ff: int = N_FF,
                    split_max_tensors: int = 0, head_dim: int | None = None,
                    n_ctx: int = N_CTX, inert_layers: int = 0,
                    extra_tokens: int = 0, fim: str | None = None,
                    ends: bool = False) -> Path:
    """Write the tiny model to ``path`` and return it (with ``split_max_tensors``, as a
    split GGUF of that many tensors a part, ``STEM-00001-of-0000N.gguf`` and on beside
    ``path``: the first part is returned).

    With ``sliding_window`` it is a gemma3-architecture model whose layers attend to
    that many positions only (llama.cpp keeps a window-sized KV cache for them). With
    ``head_dim``, its attention heads are that wide (a KV cache that much bigger).

    ``inert_layers`` more layers after the first ``n_layer`` write nothing to the residual
    stream (their output projections are zero): the model costs more and computes the
    same logits as the one without them (same seed), a perfect draft model for it.
    ``extra_tokens`` more words at the end of the vocabulary (a vocabulary a draft
    model cannot share).

    ``fim``: fill-in-the-middle tokens at the end of the vocabulary, ``"text"`` (Qwen's,
    ``FIM_TOKENS``, found by their text) or ``"keys"`` (``FIM_KEYED``, named by the
    GGUF's keys). ``ends``: the model ends every answer at once (its end token is the
    likeliest), so that only ``ignore_eos`` makes it say anything.
    """
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocabulary()
    for i in range(extra_tokens):
        tokens.append(f"extra{i}")
        scores.append(-100.0)
        types.append(int(gguf.TokenType.NORMAL))
    first_fim = len(tokens)
    added = FIM_TOKENS if fim == "text" else list(FIM_KEYED.values()) if fim == "keys" else []
    for word in added:
        tokens.append(word)
        scores.append(0.0)
        types.append(int(gguf.TokenType.CONTROL))
    n_vocab = len(tokens)
    arch = "llama" if sliding_window is None else "gemma3"
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_name(f"tiny-random-{arch}")
    head = head_dim or n_embd // n_head
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    if sliding_window is not None or head_dim is not None:
        w.add_key_length(head)
        w.add_value_length(head)
    write_hparams(w, n_ctx=n_ctx, n_embd=n_embd, n_layer=n_layer + inert_layers, n_ff=n_ff,
                  n_head=n_head,
                  file_type=gguf.LlamaFileType.ALL_F32, tokens=tokens, scores=scores,
                  types=types, head_dim=head)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if fim == "keys":
        for i, which in enumerate(FIM_KEYED):
            w.add_uint32(f"tokenizer.ggml.fim_{which}_token_id", first_fim + i)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    def t(name: str, *shape: int, scale: float = 0.5) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def ones(name: str) -> None:
        w.add_tensor(name, np.ones(n_embd, dtype=np.float32))

    # Dimension 0 of the residual stream is a constant that no layer writes to, and only
    # the end tokens read it (strongly negative): the model never ends a stream by itself, so tests
    # control every stream's length.
    embd = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    embd[:, 0] = 4.0
    if sliding_window is not None:
        embd /= np.sqrt(n_embd)  # gemma scales embeddings up by sqrt(n_embd): attention matters
    w.add_tensor("token_embd.weight", embd)
    ones("output_norm.weight")
    out = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    out[:, 0] = 0.0
    out[2, 0] = 1000.0 if ends else -1000.0
    for i, word in enumerate(WORDS):
        if word.startswith("<"):  # llama.cpp treats <end_of_turn> as end-of-generation too
            out[259 + i, 0] = -1000.0
    out[first_fim:, 0] = -1000.0  # (FIM's pad, repo and file separator end generations)
    w.add_tensor("output.weight", out)
    for i in range(n_layer + inert_layers):
        ones(f"blk.{i}.attn_norm.weight")
        t(f"blk.{i}.attn_q.weight", n_head * head, n_embd)
        t(f"blk.{i}.attn_k.weight", n_head * head, n_embd)
        t(f"blk.{i}.attn_v.weight", n_head * head, n_embd)
        w.add_tensor(f"blk.{i}.attn_output.weight",
                     _no_write_to_dim0(rng, n_embd, n_head * head) * (i < n_layer))
        if sliding_window is not None:  # gemma3's extra norms
            ones(f"blk.{i}.post_attention_norm.weight")
            ones(f"blk.{i}.post_ffw_norm.weight")
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head, np.float32))
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head, np.float32))
        ones(f"blk.{i}.ffn_norm.weight")
        t(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        w.add_tensor(f"blk.{i}.ffn_down.weight",
                     _no_write_to_dim0(rng, n_embd, n_ff) * (i < n_layer))
    finish(w)
    if split_max_tensors:
        return path.with_name(f"{path.stem}-00001-of-{len(w.tensors):05d}.gguf")
    return path


def _no_write_to_dim0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    m = (rng.standard_normal((rows, cols)) * 0.5).astype(np.float32)
    m[0, :] = 0.0
    return m


RERANK_TEMPLATE = "<s>{query}</s>{document}"
"""A ``rerank`` template, as Qwen3-Reranker ships one (its own is longer)."""


def write_tiny_reranker(path: Path, *, seed: int = 4321, template: str | None = None
                        ) -> Path:
    """A tiny random-weight reranker: qwen3's architecture with rank pooling and a
    two-label classifier head (``cls.output``), as Qwen3-Reranker GGUFs are; with
    ``template``, its ``tokenizer.chat_template.rerank``. Returns ``path``."""
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocabulary()
    n_vocab, head = len(tokens), N_EMBD // N_HEAD
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_name("tiny-random-reranker")
    write_hparams(w, n_ctx=2048, n_embd=N_EMBD, n_layer=N_LAYER, n_ff=N_FF, n_head=N_HEAD,
                  file_type=gguf.LlamaFileType.ALL_F32, tokens=tokens, scores=scores,
                  types=types, head_dim=head)
    w.add_key_length(head)
    w.add_value_length(head)
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_pooling_type(gguf.PoolingType.RANK)
    w.add_classifier_output_labels(["yes", "no"])
    if template is not None:
        w.add_chat_template([{"name": "rerank", "template": template}])

    def t(name: str, *shape: int, scale: float = 0.5) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    t("token_embd.weight", n_vocab, N_EMBD, scale=1.0)
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    t("output.weight", n_vocab, N_EMBD)
    t("cls.output.weight", 2, N_EMBD)
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        t(f"blk.{i}.attn_q.weight", N_HEAD * head, N_EMBD)
        t(f"blk.{i}.attn_k.weight", N_HEAD * head, N_EMBD)
        t(f"blk.{i}.attn_v.weight", N_HEAD * head, N_EMBD)
        t(f"blk.{i}.attn_output.weight", N_EMBD, N_HEAD * head)
        w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head, np.float32))
        w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        t(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)
    finish(w)
    return path


def write_tiny_lora(path: Path, *, seed: int = 99, rank: int = 4, alpha: float = 8.0,
                    n_layer: int = N_LAYER, n_embd: int = N_EMBD,
                    arch: str = "llama") -> Path:
    """A tiny random LoRA adapter for the tiny model, in llama.cpp's adapter format
    (``general.type = adapter``, ``adapter.type = lora``, ``adapter.lora.alpha``, and an
    ``….lora_a`` / ``….lora_b`` pair for each adapted weight: the query and value
    projections of every layer). Its delta is alpha / rank · B·A, times the scale."""
    rng = np.random.default_rng(seed)

    def m(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.5).astype(np.float32)

    write_lora(gguf.GGUFWriter(str(path), arch),
               [(f"blk.{i}.{name}.weight", m(rank, n_embd), m(n_embd, rank))
                for i in range(n_layer) for name in ("attn_q", "attn_v")], alpha)
    return path
