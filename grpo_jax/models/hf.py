"""Hugging Face checkpoint folders <-> the NNX Qwen3 model.

``from_pretrained(path)`` reads ``config.json`` through transformers' own config classes and the
weights through safetensors (numpy, no torch), single-file or sharded with
``model.safetensors.index.json``. ``save_pretrained(model, path)`` writes a folder that
``transformers.AutoModelForCausalLM.from_pretrained`` loads.

Hugging Face stores a linear layer as ``weight [out, in]``; Flax as ``kernel [in, out]``. The
mapping below is the only place that knows both names.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax import sharding as sharding_lib
from grpo_jax.models.qwen3 import ModelConfig, Qwen3

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class CheckpointError(ValueError):
  """A checkpoint folder that cannot be loaded, with a message naming what is wrong."""


def hf_name(path: tuple) -> tuple[str, bool]:
  """Hugging Face tensor name for an NNX parameter path, and whether to transpose it.

  Args:
    path: a parameter path such as ``('layers', 0, 'self_attn', 'q_proj', 'kernel')``.

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
                          "remove rope scaling from config.json or add it to models/qwen3.py")
  theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
  if theta is None:
    raise CheckpointError("config.json has no rope_theta (nor rope_parameters.rope_theta)")
  return float(theta)


def config_from_hf(hf_config, *, param_dtype: str = "float32",
                   dtype: str = "float32") -> ModelConfig:
  """Our ModelConfig from a transformers Qwen3Config / Qwen2Config."""
  model_type = getattr(hf_config, "model_type", None)
  if model_type not in SUPPORTED_MODEL_TYPES:
    archs = getattr(hf_config, "architectures", None)
    raise CheckpointError(f"unsupported architecture: model_type={model_type!r} "
                          f"(architectures={archs}); supported model types: "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)}")
  if getattr(hf_config, "use_sliding_window", False):
    raise CheckpointError("use_sliding_window=true is not supported (full attention only)")
  heads = hf_config.num_attention_heads
  head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
  is_qwen3 = model_type == "qwen3"
  return ModelConfig(
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


def config_to_hf(config: ModelConfig):
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


def _weight_files(path: str) -> dict[str, str]:
  """Tensor name -> safetensors file for a single-file or sharded folder."""
  index = os.path.join(path, _INDEX)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return {name: os.path.join(path, file) for name, file in weight_map.items()}
  single = os.path.join(path, _SINGLE)
  if os.path.exists(single):
    with _safetensors(single) as f:
      return {name: single for name in f.keys()}
  present = sorted(os.listdir(path))
  raise CheckpointError(f"{path} has neither {_SINGLE} nor {_INDEX} (found: {present}); "
                        "only safetensors weights are supported")


@contextlib.contextmanager
def _safetensors(file: str):
  """safe_open, with an unreadable file (truncated download, not safetensors) named in a
  CheckpointError instead of a library traceback."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  try:
    handle = safe_open(file, framework="numpy")
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f"{file} is not a readable safetensors file ({e}): it is truncated "
                          "or corrupt; download or save it again") from None
  with handle as f:
    yield f


def from_pretrained(path: str, *, param_dtype: str = "float32", dtype: str = "float32",
                    rngs: Optional[nnx.Rngs] = None, mesh=None) -> Qwen3:
  """Loads a Hugging Face Qwen3/Qwen2 checkpoint folder as an NNX ``Qwen3``.

  With a ``mesh`` every parameter is built shard by shard (``jax.make_array_from_callback``):
  each device's block is read from the safetensors file as a slice (memory-mapped, transposed
  block-wise where Hugging Face stores ``[out, in]``), cast and placed on that device, so no
  process ever holds a whole tensor it does not need, let alone the whole model, and no device
  holds more than its shards. In a multi-process run each process reads only the blocks of its
  own devices.

  Args:
    path: folder with config.json and safetensors weights.
    param_dtype: dtype the parameters are stored in after loading.
    dtype: compute dtype.
    rngs: unused by loading (all parameters come from the checkpoint); kept for symmetry.
    mesh: optional ``jax.sharding.Mesh``; parameters are laid out by ``sharding.PARAM_AXES``.

  Returns:
    The model, with every parameter taken from the checkpoint.

  Raises:
    FileNotFoundError: the folder or its config.json does not exist.
    CheckpointError: unsupported architecture, or missing / misshaped tensors (named).
    sharding.MeshError: a parameter dimension the mesh does not divide.
  """
  del rngs
  import transformers  # pylint: disable=g-import-not-at-top

  if not os.path.isdir(path):
    raise FileNotFoundError(f"model folder not found: {path}")
  if not os.path.exists(os.path.join(path, "config.json")):
    raise FileNotFoundError(f"{path} has no config.json (is it a Hugging Face model folder?)")
  config = config_from_hf(transformers.AutoConfig.from_pretrained(path),
                          param_dtype=param_dtype, dtype=dtype)
  abstract = nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  files = _weight_files(path)

  wanted = {}
  for p, var in nnx.to_flat_state(state):
    name, transpose = hf_name(p)
    wanted[name] = (p, transpose, var)
  missing = sorted(n for n in wanted if n not in files)
  if missing:
    shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
    raise CheckpointError(f"{path} is missing {len(missing)} tensor(s) the "
                          f"{'qwen3' if config.qk_norm else 'qwen2'} architecture needs: {shown}")

  by_file: dict[str, list[str]] = {}
  for name in wanted:
    by_file.setdefault(files[name], []).append(name)
  flat = []
  for file, names in by_file.items():
    with _safetensors(file) as f:
      for name in names:
        p, transpose, var = wanted[name]
        sharding = None if mesh is None else sharding_lib.param_sharding(mesh, p, var.shape)
        array = _read_tensor(f, file, name, transpose, var.shape, jnp.dtype(param_dtype),
                             sharding)
        flat.append((p, var.replace(array)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _read_tensor(f, file: str, name: str, transpose: bool, shape: tuple, dtype,
                 sharding) -> jax.Array:
  """One parameter from an open safetensors file: whole, or block by block onto ``sharding``.

  Raises:
    CheckpointError: the tensor has another shape, or cannot be read (names it and the file).
  """
  try:
    stored = f.get_slice(name)
    stored_shape = tuple(stored.get_shape())
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f"tensor {name} in {file} cannot be read ({e}): the file is "
                          "truncated or corrupt; download or save it again") from None
  loaded_shape = stored_shape[::-1] if transpose else stored_shape
  if loaded_shape != tuple(shape):
    raise CheckpointError(f"tensor {name} in {file} has shape {loaded_shape}, "
                          f"expected {tuple(shape)}")

  def block(index: tuple) -> np.ndarray:
    """The [index] block of the parameter (laid out as ours: kernels [in, out])."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    try:
      values = stored[index[::-1]].T if transpose else stored[index]
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f"tensor {name} in {file} cannot be read ({e}): the file is "
                            "truncated or corrupt; download or save it again") from None
    return np.asarray(values).astype(dtype)

  if sharding is None:
    return jnp.asarray(block(()))
  return jax.make_array_from_callback(tuple(shape), sharding, block)


def save_pretrained(model: Qwen3, path: str, *, tokenizer=None,
                    max_shard_bytes: Optional[int] = None) -> None:
  """Writes ``model`` as a Hugging Face folder (config.json + safetensors).

  Args:
    model: the NNX model.
    path: output folder (created if needed).
    tokenizer: optional transformers tokenizer, saved alongside.
    max_shard_bytes: when set, split the weights into shards of at most this many bytes and
      write ``model.safetensors.index.json``.
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

  os.makedirs(path, exist_ok=True)
  config_to_hf(model.config).save_pretrained(path)
  tensors = {}
  for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name, transpose = hf_name(p)
    array = np.asarray(jax.device_get(var[...]))
    tensors[name] = np.ascontiguousarray(array.T if transpose else array)
  for stale in (_SINGLE, _INDEX):
    if os.path.exists(os.path.join(path, stale)):
      os.remove(os.path.join(path, stale))
  if max_shard_bytes is None:
    save_file(tensors, os.path.join(path, _SINGLE), metadata={"format": "pt"})
  else:
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
      nbytes = tensors[name].nbytes
      if current and size + nbytes > max_shard_bytes:
        shards.append(current)
        current, size = {}, 0
      current[name] = tensors[name]
      size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
      file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
      weight_map.update({name: file for name in shard})
    total = sum(t.nbytes for t in tensors.values())
    with open(os.path.join(path, _INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  if tokenizer is not None:
    tokenizer.save_pretrained(path)
