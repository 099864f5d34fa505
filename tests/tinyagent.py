"""A tiny random-weight llama GGUF that speaks with a real model's tokenizer.

The coding agents send prompts of 30-40 KB (their system prompts and tool schemas). The
byte-level tiny model makes 40,000 tokens of them, and the default model prefills
12,000 tokens in minutes on two cores. This one copies SmolLM2's tokenizer (its BPE
vocabulary, merges, special tokens and chat template) over the tiny model's two layers
of 64 dimensions: the prompt is SmolLM2's 12,000 tokens, prefilled in seconds.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from everycycle.hardware.ggufwrite import finish

N_EMBD, N_HEAD, N_LAYER, N_FF, N_CTX = 64, 4, 2, 128, 32768


def write_tiny_bpe_gguf(path: Path, tokenizer_from: Path, *, seed: int = 7,
                        chat_template: str | None = None, n_ctx: int = N_CTX) -> Path:
    """Write the model to ``path`` with the tokenizer of the GGUF ``tokenizer_from`` (and
    its chat template, unless ``chat_template`` is given), trained for ``n_ctx``."""
    source = gguf.GGUFReader(str(tokenizer_from))
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-random-bpe")
    w.add_context_length(n_ctx)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = 0
    for key, field in source.fields.items():
        if not key.startswith("tokenizer.") or (
                key == "tokenizer.chat_template" and chat_template is not None):
            continue
        value = field.contents()
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, value, field.types[0], sub_type=sub)
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    assert n_vocab, f"{tokenizer_from} has no tokenizer.ggml.tokens"
    if chat_template is not None:
        w.add_chat_template(chat_template)

    def t(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.5).astype(np.float32))

    def ones(name: str) -> None:
        w.add_tensor(name, np.ones(N_EMBD, dtype=np.float32))

    t("token_embd.weight", n_vocab, N_EMBD)
    ones("output_norm.weight")
    t("output.weight", n_vocab, N_EMBD)
    for i in range(N_LAYER):
        ones(f"blk.{i}.attn_norm.weight")
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            t(f"blk.{i}.{name}.weight", N_EMBD, N_EMBD)
        ones(f"blk.{i}.ffn_norm.weight")
        t(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)
    finish(w)
    return path
