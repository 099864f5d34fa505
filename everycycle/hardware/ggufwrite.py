"""Writing small random-weight GGUFs with the ``gguf`` package: the CPU-kernel probe's
model (cpukernels.py), the test suite's tiny models and LoRA adapters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def write_hparams(w: Any, *, n_ctx: int, n_embd: int, n_layer: int, n_ff: int, n_head: int,
                  file_type: int, tokens: Sequence[str], scores: Sequence[float],
                  types: Sequence[int], head_dim: int | None = None) -> None:
    """A llama-shaped model's hyperparameters and SentencePiece-style vocabulary
    (<unk> 0, <s> 1, </s> 2) on the GGUFWriter ``w``; attention heads ``head_dim`` wide
    (default: ``n_embd / n_head``), rotated in full."""
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(head_dim or n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(file_type)
    w.add_tokenizer_model("llama")
    w.add_token_list(list(tokens))
    w.add_token_scores(list(scores))
    w.add_token_types(list(types))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def finish(w: Any) -> None:
    """Write ``w``'s header, metadata and tensors, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_lora(w: Any, pairs: Sequence[tuple[str, Any, Any]], alpha: float) -> None:
    """A LoRA adapter in llama.cpp's format on the GGUFWriter ``w`` (made for the base
    model's architecture): ``general.type = adapter``, ``adapter.type = lora``, its
    ``alpha``, and for each (base tensor name, A, B) the ``NAME.lora_a`` (rank × in) and
    ``NAME.lora_b`` (out × rank) arrays; then the file is written."""
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for name, a, b in pairs:
        w.add_tensor(f"{name}.lora_a", a)
        w.add_tensor(f"{name}.lora_b", b)
    finish(w)


SMOLLM2_FIM = {"fim_pre": 6, "fim_suf": 7, "fim_mid": 8, "fim_rep": 3, "fim_sep": 5}
"""FIM token ids for SmolLM2 (the default model), whose vocabulary has no FIM tokens of
its own: three of its unused control tokens (``<filename>``, ``<gh_stars>``,
``<issue_start>``) and its repository and file-separator tokens. The suite and the
editor bench compare llama-server and the daemon on it, like for like."""


def with_fim_keys(src: Any, dst: Any, ids: dict[str, int]) -> None:
    """Copy the GGUF ``src`` to ``dst`` with ``tokenizer.ggml.{role}_token_id`` keys
    (``ids``: role → token id) added or replaced; every other key and every tensor as
    it was."""
    import gguf

    reader = gguf.GGUFReader(src, "r")
    keys = {f"tokenizer.ggml.{role}_token_id": tok for role, tok in ids.items()}
    writer = gguf.GGUFWriter(str(dst), arch=reader.fields["general.architecture"].contents(),
                             endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", *keys):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for key, tok in keys.items():
        writer.add_uint32(key, tok)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
