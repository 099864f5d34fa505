"""Writes a tiny random-weight vision projector (an "mmproj" GGUF) for llama.cpp's libmtmd.

It is a LLaVA-style projector, ``clip.projector_type = "mlp"``: a one-block ViT (32x32
RGB images cut into 8x8 patches, so 16 image tokens; width 32, 4 heads) and a two-layer
MLP (``mm.0`` 32 -> 64, GELU, ``mm.2`` 64 -> ``n_embd_text``) into the text model's
embedding space. Of the projector types libmtmd loads, "mlp" needs the fewest keys and
tensors: no tiling, no special image tokens in the text vocabulary, no patch merging, no
M-RoPE, a fixed-size square input (any image is resized to 32x32) and ordinary causal
decoding. The file is under 90 kB (float32 throughout) and one image encodes in well
under a millisecond on one CPU thread (the first encode, which sizes the compute
buffers when warmup is off, in about one).

libmtmd's LLaVA graph runs the first ``block_count - 1`` blocks only (real LLaVA GGUFs
use the penultimate CLIP layer); ``clip.vision.feature_layer = [1]`` makes it run the
single block and take its output. Dimension 0 of every image embedding is 4.0: like
every text token of ``tinymodel.py``, which keeps that constant there so that the
model never ends a stream by itself.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from everycycle.hardware.ggufwrite import finish

PROJECTOR_TYPE = "mlp"
IMAGE_SIZE = 32
PATCH_SIZE = 8
N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
N_EMBD_VISION = 32
N_HEAD_VISION = 4
N_FF_VISION = 64
N_BLOCK_VISION = 1
N_PROJ_HIDDEN = 64
EPS = 1e-5


def write_tiny_mmproj(path: Path, *, n_embd_text: int = 64, seed: int = 7) -> Path:
    """Write the projector to ``path`` and return it; its image embeddings are
    ``n_embd_text`` wide (the text model's n_embd: libmtmd refuses a mismatch)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_name("tiny-random-mmproj")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    # libmtmd reads each key with the type it expects (gguf_get_val_u32 and so on
    # assert the type): the integers must be uint32, the floats float32.
    w.add_string("clip.projector_type", PROJECTOR_TYPE)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_audio_encoder", False)
    w.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    w.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    w.add_uint32("clip.vision.embedding_length", N_EMBD_VISION)
    w.add_uint32("clip.vision.feed_forward_length", N_FF_VISION)
    w.add_uint32("clip.vision.block_count", N_BLOCK_VISION)
    w.add_uint32("clip.vision.projection_dim", n_embd_text)
    w.add_uint32("clip.vision.attention.head_count", N_HEAD_VISION)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", EPS)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.feature_layer", [N_BLOCK_VISION])  # int32 array

    # Shapes are numpy's (rows, columns): ggml's ne is the reverse. A matrix is
    # (out, in), as ggml_mul_mat(w, x) wants.
    def t(name: str, *shape: int, scale: float) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def norm(name: str, n: int) -> None:
        w.add_tensor(f"{name}.weight", np.ones(n, dtype=np.float32))
        w.add_tensor(f"{name}.bias", np.zeros(n, dtype=np.float32))

    d = N_EMBD_VISION
    pixels_in = 3 * PATCH_SIZE * PATCH_SIZE
    # the patch embedding is a stride-PATCH_SIZE conv2d: (out channels, in channels, kh, kw)
    t("v.patch_embd.weight", d, 3, PATCH_SIZE, PATCH_SIZE, scale=1.0 / np.sqrt(pixels_in))
    t("v.patch_embd.bias", d, scale=0.1)
    t("v.position_embd.weight", N_IMAGE_TOKENS, d, scale=0.5)
    norm("v.pre_ln", d)
    for i in range(N_BLOCK_VISION):
        norm(f"v.blk.{i}.ln1", d)
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t(f"v.blk.{i}.{proj}.weight", d, d, scale=1.0 / np.sqrt(d))
            t(f"v.blk.{i}.{proj}.bias", d, scale=0.1)
        norm(f"v.blk.{i}.ln2", d)
        t(f"v.blk.{i}.ffn_up.weight", N_FF_VISION, d, scale=1.0 / np.sqrt(d))
        t(f"v.blk.{i}.ffn_up.bias", N_FF_VISION, scale=0.1)
        t(f"v.blk.{i}.ffn_down.weight", d, N_FF_VISION, scale=1.0 / np.sqrt(N_FF_VISION))
        t(f"v.blk.{i}.ffn_down.bias", d, scale=0.1)
    norm("v.post_ln", d)
    t("mm.0.weight", N_PROJ_HIDDEN, d, scale=1.0 / np.sqrt(d))
    t("mm.0.bias", N_PROJ_HIDDEN, scale=0.1)
    out = (rng.standard_normal((n_embd_text, N_PROJ_HIDDEN))
           * (2.0 / np.sqrt(N_PROJ_HIDDEN))).astype(np.float32)
    out[0, :] = 0.0
    bias = np.zeros(n_embd_text, dtype=np.float32)
    bias[0] = 4.0
    w.add_tensor("mm.2.weight", out)
    w.add_tensor("mm.2.bias", bias)

    finish(w)
    return path
