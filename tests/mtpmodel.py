"""A tiny random-weight GGUF with one MTP ("nextn") layer, which llama.cpp loads with
``load_mtp`` (everycycle's MTP drafting, engine/spec/mtp.py).

Its architecture is Hunyuan-V3 (``hy_v3``, llama.cpp's src/models/hy-v3.cpp): the
simplest of those whose MTP layers llama.cpp runs in this version (plain attention
cache, plain RoPE, a dense FFN in the trunk and in the nextn block). ``block_count``
is the trunk's layers plus the nextn ones, which come last. The vocabulary is
tests/tinymodel.py's (SentencePiece bytes and a few words).

``perfect``: the trunk's and the nextn block's attention and FFN outputs are zero and
``eh_proj`` is ``[I | 0]``, so the model's next token depends on its current token
alone and the MTP layer computes the same function of its input: every MTP draft is
confirmed (the plumbing's test: positions, tokens, the cells trimmed).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from tinymodel import vocabulary

ARCH = "hy_v3"
N_EMBD = 64
N_HEAD = 4
HEAD = N_EMBD // N_HEAD
N_TRUNK = 2
N_NEXTN = 1
N_FF = 128
N_CTX = 4096


def write_mtp_gguf(path: Path, *, seed: int = 1234, perfect: bool = False) -> Path:
    """A tiny model with one MTP layer at ``path`` (``perfect``: see the module's text)."""
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocabulary()
    n_vocab = len(tokens)
    n_all = N_TRUNK + N_NEXTN

    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name("tiny-random-hy_v3-mtp")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(n_all)                      # trunk + nextn blocks
    w.add_uint32(f"{ARCH}.nextn_predict_layers", N_NEXTN)
    w.add_feed_forward_length(N_FF)
    w.add_expert_feed_forward_length(N_FF)        # required key for hy_v3 (unused: no experts)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(HEAD)              # hy_v3 asserts n_rot == head dim
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    # numpy shapes are the reverse of ggml's ne: ggml {n_embd, n_ff} == numpy (n_ff, n_embd)
    def t(name: str, *shape: int, scale: float = 0.3) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def ones(name: str, n: int = N_EMBD) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    t("token_embd.weight", n_vocab, N_EMBD, scale=1.0)
    ones("output_norm.weight")
    t("output.weight", n_vocab, N_EMBD)

    for i in range(n_all):
        ones(f"blk.{i}.attn_norm.weight")
        t(f"blk.{i}.attn_q.weight", N_HEAD * HEAD, N_EMBD)
        t(f"blk.{i}.attn_k.weight", N_HEAD * HEAD, N_EMBD)
        t(f"blk.{i}.attn_v.weight", N_HEAD * HEAD, N_EMBD)
        if perfect:
            w.add_tensor(f"blk.{i}.attn_output.weight", np.zeros((N_EMBD, N_HEAD * HEAD), np.float32))
        else:
            t(f"blk.{i}.attn_output.weight", N_EMBD, N_HEAD * HEAD)
        ones(f"blk.{i}.attn_q_norm.weight", HEAD)
        ones(f"blk.{i}.attn_k_norm.weight", HEAD)
        ones(f"blk.{i}.ffn_norm.weight")
        t(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
        if perfect:
            w.add_tensor(f"blk.{i}.ffn_down.weight", np.zeros((N_EMBD, N_FF), np.float32))
        else:
            t(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)
        if i >= N_TRUNK:  # the nextn (MTP) block
            if perfect:  # y = [I | 0] @ concat(enorm(e), hnorm(h))
                eh = np.concatenate([np.eye(N_EMBD), np.zeros((N_EMBD, N_EMBD))], axis=1)
                w.add_tensor(f"blk.{i}.nextn.eh_proj.weight", eh.astype(np.float32))
            else:
                t(f"blk.{i}.nextn.eh_proj.weight", N_EMBD, 2 * N_EMBD)   # ggml {2*n_embd, n_embd}
            ones(f"blk.{i}.nextn.enorm.weight")
            ones(f"blk.{i}.nextn.hnorm.weight")
            ones(f"blk.{i}.nextn.shared_head_norm.weight")          # optional
            # optional, not written: nextn.embed_tokens / nextn.shared_head_head
            # (fall back to token_embd / output)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


