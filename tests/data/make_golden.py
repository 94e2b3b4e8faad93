"""Generate golden reference data for testing the JAX Qwen2/Qwen3 models.

This script builds two tiny, randomly initialised Hugging Face models with
PyTorch ``transformers`` and records their logits, so that the JAX
implementation can be checked against HF's own PyTorch implementation
*without* torch at test time.

It writes (relative to the repository root):

* ``tests/data/tiny_qwen3/``   -- ``Qwen3ForCausalLM`` (float32), saved with
  ``save_pretrained`` as >= 2 safetensors shards plus
  ``model.safetensors.index.json`` (exercises sharded checkpoint loading).
* ``tests/data/tiny_qwen2/``   -- ``Qwen2ForCausalLM`` (float32, tied word
  embeddings, nonzero q/k/v biases), single ``model.safetensors``.
* ``tests/data/golden_logits.npz`` with:
    - ``input_ids``               int32 [2, 12]
    - ``qwen3_logits``            float32 [2, 12, 128]  (plain forward)
    - ``qwen2_logits``            float32 [2, 12, 128]  (plain forward)
    - ``padded_input_ids``        int32 [2, 12]  (row 0: 4 left pads of id 0)
    - ``padded_attention_mask``   int32 [2, 12]  (row 0: 4 zeros then ones)
    - ``padded_position_ids``     int32 [2, 12]  clip(cumsum(mask) - 1, 0)
    - ``qwen3_padded_logits``     float32 [2, 12, 128]  (only positions with
      mask == 1 are meaningful)

Every parameter is re-initialised with normal(0, 0.2) noise (RMSNorm weights,
including q_norm/k_norm, as 1 + normal(0, 0.2)) so that a wrong norm or a
missed tensor shows up in the logits. Logits are computed in float32 eval mode
with ``attn_implementation="eager"``.

Requirements: torch + transformers (only needed to regenerate, not to test).
Rerun from the repository root with:

    python tests/data/make_golden.py

The output is deterministic (fixed torch / numpy seeds).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
QWEN3_DIR = os.path.join(DATA_DIR, "tiny_qwen3")
QWEN2_DIR = os.path.join(DATA_DIR, "tiny_qwen2")
NPZ_PATH = os.path.join(DATA_DIR, "golden_logits.npz")

VOCAB = 128
BATCH, SEQ = 2, 12
NUM_PAD = 4
STD = 0.2


def qwen3_config() -> Qwen3Config:
    # transformers 5.x stores RoPE settings in `rope_parameters`
    # (the legacy `rope_theta=` kwarg is folded into it as well).
    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        max_position_embeddings=256,
        dtype="float32",
        attn_implementation="eager",
    )


def qwen2_config() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        dtype="float32",
        attn_implementation="eager",
    )


@torch.no_grad()
def randomize_(model: torch.nn.Module) -> None:
    """Re-initialise every parameter: N(0, STD), RMSNorm weights 1 + N(0, STD)."""
    norm_param_ids = set()
    for module in model.modules():
        if "RMSNorm" in type(module).__name__:
            for p in module.parameters(recurse=False):
                norm_param_ids.add(id(p))
    n_norm = 0
    # named_parameters() de-duplicates tied parameters (embed/lm_head in Qwen2).
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, dtype=p.dtype) * STD
        if id(p) in norm_param_ids:
            assert name.endswith("norm.weight"), name
            p.copy_(1.0 + noise)
            n_norm += 1
        else:
            assert not name.endswith("norm.weight"), name
            p.copy_(noise)
    assert n_norm > 0


def build(model_cls, config, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    randomize_(model)
    model.eval()
    return model


@torch.no_grad()
def logits_of(model, input_ids, attention_mask=None, position_ids=None) -> np.ndarray:
    kwargs = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = torch.from_numpy(attention_mask).long()
    if position_ids is not None:
        kwargs["position_ids"] = torch.from_numpy(position_ids).long()
    out = model(torch.from_numpy(input_ids).long(), use_cache=False, **kwargs)
    return out.logits.float().numpy().astype(np.float32)


def main() -> None:
    torch.use_deterministic_algorithms(True)

    rng = np.random.default_rng(1234)
    input_ids = rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int32)

    padded_input_ids = rng.integers(1, VOCAB, size=(BATCH, SEQ)).astype(np.int32)
    padded_attention_mask = np.ones((BATCH, SEQ), dtype=np.int32)
    padded_input_ids[0, :NUM_PAD] = 0
    padded_attention_mask[0, :NUM_PAD] = 0
    padded_position_ids = np.clip(np.cumsum(padded_attention_mask, axis=-1) - 1, 0, None).astype(
        np.int32
    )

    qwen3 = build(Qwen3ForCausalLM, qwen3_config(), seed=0)
    qwen2 = build(Qwen2ForCausalLM, qwen2_config(), seed=1)
    assert qwen2.lm_head.weight is qwen2.model.embed_tokens.weight

    qwen3_logits = logits_of(qwen3, input_ids)
    qwen2_logits = logits_of(qwen2, input_ids)
    qwen3_padded_logits = logits_of(
        qwen3, padded_input_ids, padded_attention_mask, padded_position_ids
    )

    # Sanity: the unpadded row of the padded batch must equal a plain forward of it.
    ref_row1 = logits_of(qwen3, padded_input_ids[1:])
    np.testing.assert_allclose(qwen3_padded_logits[1:], ref_row1, rtol=1e-5, atol=1e-5)
    # And the real tokens of row 0 must equal an unpadded forward of those tokens.
    ref_row0 = logits_of(qwen3, padded_input_ids[:1, NUM_PAD:])
    np.testing.assert_allclose(qwen3_padded_logits[0, NUM_PAD:], ref_row0[0], rtol=1e-5, atol=1e-5)

    for d in (QWEN3_DIR, QWEN2_DIR):
        if os.path.isdir(d):
            shutil.rmtree(d)
    # ~460 KB of float32 weights -> "200KB" shards gives >= 2 shards + index json.
    qwen3.save_pretrained(QWEN3_DIR, max_shard_size="200KB")
    qwen2.save_pretrained(QWEN2_DIR)
    assert os.path.exists(os.path.join(QWEN3_DIR, "model.safetensors.index.json"))
    with open(os.path.join(QWEN3_DIR, "model.safetensors.index.json")) as f:
        n_shards = len(set(json.load(f)["weight_map"].values()))
    assert n_shards >= 2, n_shards
    assert os.path.exists(os.path.join(QWEN2_DIR, "model.safetensors"))

    np.savez(
        NPZ_PATH,
        input_ids=input_ids,
        qwen3_logits=qwen3_logits,
        qwen2_logits=qwen2_logits,
        padded_input_ids=padded_input_ids,
        padded_attention_mask=padded_attention_mask,
        padded_position_ids=padded_position_ids,
        qwen3_padded_logits=qwen3_padded_logits,
    )

    real = padded_attention_mask.astype(bool)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"tiny_qwen3: {n_shards} shards")
    print(f"max|qwen3_logits|        = {np.abs(qwen3_logits).max():.4f}")
    print(f"max|qwen2_logits|        = {np.abs(qwen2_logits).max():.4f}")
    print(f"max|qwen3_padded_logits| = {np.abs(qwen3_padded_logits[real]).max():.4f} (real positions)")
    print(f"wrote {QWEN3_DIR}, {QWEN2_DIR}, {NPZ_PATH}")


if __name__ == "__main__":
    main()
