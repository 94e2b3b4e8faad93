"""The Qwen3 family's Hugging Face side: config.json <-> ``ModelConfig``, tensor names, and
its registration as the ``qwen3`` and ``qwen2`` model families (Qwen2 and Qwen2.5 share the
model: q/k/v bias instead of q/k norm).

Hugging Face stores a linear layer as ``weight [out, in]``; Flax as ``kernel [in, out]``.
``hf_name`` is the only place that knows both names.
"""

from __future__ import annotations

from typing import Mapping

from grpo_jax.errors import CheckpointError
from grpo_jax.models import qwen3
from grpo_jax.models.family import FAMILIES, Family


def hf_name(path: tuple) -> tuple[str, bool]:
  """Hugging Face tensor name for an NNX parameter path, and whether to transpose it.

  Args:
    path: a parameter path such as ``('embed_tokens', 'embedding')``, or one layer's slice of a
      stacked one (``causal_lm.layer_path``) such as
      ``('layers', 0, 'self_attn', 'q_proj', 'kernel')``.

  Returns:
    (name, transpose), e.g. ``('model.layers.0.self_attn.q_proj.weight', True)``.
  """
  *module, leaf = [str(p) for p in path]
  if module == ["lm_head"]:
    return "lm_head.weight", True
  suffix = {"kernel": "weight", "bias": "bias", "scale": "weight", "embedding": "weight"}[leaf]
  return ".".join(["model", *module, suffix]), leaf == "kernel"


def _rope_theta(hf_config) -> float:
  params = getattr(hf_config, "rope_parameters", None) or {}
  scaling = getattr(hf_config, "rope_scaling", None) or {}
  kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
  if kind != "default":
    raise CheckpointError(f"rope_type {kind!r} is not supported yet (only 'default' RoPE); "
                          "remove rope scaling from config.json or add it to models/layers.py")
  theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
  if theta is None:
    raise CheckpointError("config.json has no rope_theta (nor rope_parameters.rope_theta)")
  return float(theta)


def config_from_hf(hf: Mapping, *, param_dtype: str = "float32",
                   dtype: str = "float32") -> qwen3.ModelConfig:
  """Our ModelConfig from a Qwen3 / Qwen2 ``config.json`` (read as transformers reads it,
  with its defaults for absent fields)."""
  import transformers  # pylint: disable=g-import-not-at-top

  hf_config = transformers.AutoConfig.for_model(**hf)
  if getattr(hf_config, "use_sliding_window", False):
    raise CheckpointError("use_sliding_window=true is not supported (full attention only)")
  heads = hf_config.num_attention_heads
  head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
  is_qwen3 = hf_config.model_type == "qwen3"
  return qwen3.ModelConfig(
      vocab_size=hf_config.vocab_size,
      hidden_size=hf_config.hidden_size,
      intermediate_size=hf_config.intermediate_size,
      num_layers=hf_config.num_hidden_layers,
      num_heads=heads,
      num_kv_heads=hf_config.num_key_value_heads or heads,
      head_dim=head_dim,
      rope_theta=_rope_theta(hf_config),
      rms_norm_eps=hf_config.rms_norm_eps,
      tie_word_embeddings=bool(hf_config.tie_word_embeddings),
      qkv_bias=bool(getattr(hf_config, "attention_bias", False)) if is_qwen3 else True,
      qk_norm=is_qwen3,
      param_dtype=param_dtype,
      dtype=dtype)


def config_to_hf(config: qwen3.ModelConfig):
  """A transformers config object describing ``config`` (Qwen3 when it has q/k norm)."""
  import transformers  # pylint: disable=g-import-not-at-top

  common = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
                num_key_value_heads=config.num_kv_heads, rms_norm_eps=config.rms_norm_eps,
                tie_word_embeddings=config.tie_word_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
                max_position_embeddings=32768, hidden_act="silu", torch_dtype=config.param_dtype)
  if config.qk_norm:
    cfg = transformers.Qwen3Config(head_dim=config.head_dim, attention_bias=config.qkv_bias,
                                   **common)
    cfg.architectures = ["Qwen3ForCausalLM"]
  else:
    if not config.qkv_bias or config.head_dim * config.num_heads != config.hidden_size:
      raise CheckpointError("a model without q/k norm is saved as Qwen2, which requires "
                            "qkv_bias=True and head_dim * num_heads == hidden_size")
    cfg = transformers.Qwen2Config(**common)
    cfg.architectures = ["Qwen2ForCausalLM"]
  return cfg


QWEN3_FAMILY = Family(config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                      build=qwen3.Qwen3, hf_name=hf_name, param_axes=qwen3.PARAM_AXES)
FAMILIES.register("qwen3")(QWEN3_FAMILY)
FAMILIES.register("qwen2")(QWEN3_FAMILY)
