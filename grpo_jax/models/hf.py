"""Hugging Face checkpoint folders <-> the NNX model of their family.

``from_pretrained(path)`` reads ``config.json``, finds the model family of its ``model_type``
(``family.FAMILIES``), and reads the weights the family's ``hf_name`` maps through safetensors
(numpy, no torch), single-file or sharded with ``model.safetensors.index.json``. A parameter of
the stacked decoder layers (``causal_lm.LAYERS``) is read from, and written as, one tensor per
layer (``model.layers.3.mlp.up_proj.weight`` is slice 3 of ``layers.mlp.up_proj.kernel``).
``save_pretrained(model, path)`` writes a folder that
``transformers.AutoModelForCausalLM.from_pretrained`` loads.
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
from grpo_jax.errors import CheckpointError
from grpo_jax.models import causal_lm
from grpo_jax.models import family as family_lib
from grpo_jax.models.causal_lm import CausalLM

_CONFIG = "config.json"
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def read_hf_config(path: str) -> dict:
  """The ``config.json`` of a Hugging Face model folder, as a dict.

  Raises:
    FileNotFoundError: the folder or its config.json does not exist.
    CheckpointError: config.json is not a JSON object (a torn write or download).
  """
  if not os.path.isdir(path):
    raise FileNotFoundError(f"model folder not found: {path}")
  file = os.path.join(path, _CONFIG)
  if not os.path.exists(file):
    raise FileNotFoundError(f"{path} has no config.json (is it a Hugging Face model folder?)")
  with open(file) as f:
    try:
      config = json.load(f)
    except ValueError as e:
      raise CheckpointError(f"{file} is not readable JSON ({e}); download or save it "
                            "again") from None
  if not isinstance(config, dict):
    raise CheckpointError(f"{file} holds a {type(config).__name__}, not a JSON object")
  return config


def config_from_hf(hf_config: dict, *, param_dtype: str = "float32", dtype: str = "float32"):
  """The model config of a ``config.json`` dict, by its family (``model_type``).

  Raises:
    CheckpointError: an unknown model type, or a setting its family does not support.
  """
  family = family_lib.family_for(hf_config.get("model_type"), hf_config.get("architectures"))
  return family.config_from_hf(hf_config, param_dtype=param_dtype, dtype=dtype)


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
                    rngs: Optional[nnx.Rngs] = None, mesh=None, base: str = "",
                    attention: str = "auto", attention_block: int = 256) -> CausalLM:
  """Loads a Hugging Face checkpoint folder as the NNX model of its family (Qwen3, Qwen2).

  A PEFT LoRA adapter folder (``adapter_config.json``, as ``save_adapter`` writes) loads as
  its base model (``base``, else the folder's ``base_model_name_or_path``) carrying those
  adapters (``adapter_folder.load_adapter``).

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
    mesh: optional ``jax.sharding.Mesh``; parameters are laid out by the family's
      ``param_axes``.
    base: the base model folder of an adapter folder (default: the one it records).
    attention: the attention kernel (``ModelConfig.attention``; not stored in the folder).
    attention_block: queries and keys per block of the ``blocked`` kernel.

  Returns:
    The model, with every parameter taken from the checkpoint.

  Raises:
    FileNotFoundError: the folder or its config.json does not exist.
    CheckpointError: unsupported architecture, or missing / misshaped tensors (named).
    sharding.MeshError: a parameter dimension the mesh does not divide.
  """
  del rngs
  from grpo_jax.models import adapter_folder  # pylint: disable=g-import-not-at-top
  if adapter_folder.is_adapter_folder(path) and not os.path.exists(os.path.join(path, _CONFIG)):
    base = base or adapter_folder.base_model(path)
    model = from_pretrained(base, param_dtype=param_dtype, dtype=dtype, mesh=mesh,
                            attention=attention, attention_block=attention_block)
    adapter_folder.load_adapter(model, path)
    return model
  hf_config = read_hf_config(path)
  model_type = hf_config.get("model_type")
  family = family_lib.family_for(model_type, hf_config.get("architectures"))
  config = family.config_from_hf(hf_config, param_dtype=param_dtype, dtype=dtype).replace(
      attention=attention, attention_block=attention_block)
  abstract = nnx.eval_shape(lambda: family.build(config, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  files = _weight_files(path)

  # (path, variable, transpose, the Hugging Face name of each layer, or the one name)
  plan = []
  for p, var in nnx.to_flat_state(state):
    paths = ([causal_lm.layer_path(p, i) for i in range(var.shape[0])]
             if causal_lm.is_stacked(p) else [p])
    named = [family.hf_name(q) for q in paths]
    plan.append((p, var, named[0][1], [name for name, _ in named]))
  missing = sorted(n for *_, names in plan for n in names if n not in files)
  if missing:
    shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
    raise CheckpointError(f"{path} is missing {len(missing)} tensor(s) the "
                          f"{model_type} architecture needs: {shown}")

  flat = []
  with contextlib.ExitStack() as stack:
    opened = {}

    def source(name):
      """(file, open safetensors handle) of tensor ``name``, each file opened once."""
      file = files[name]
      if file not in opened:
        opened[file] = stack.enter_context(_safetensors(file))
      return file, opened[file]

    for p, var, transpose, names in plan:
      sharding = None if mesh is None else sharding_lib.param_sharding(
          mesh, p, var.shape, family.param_axes)
      sources = [(*source(name), name) for name in names]
      array = _read_parameter(sources, transpose, var.shape, causal_lm.is_stacked(p),
                              jnp.dtype(param_dtype), sharding)
      flat.append((p, var.replace(array)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _read_parameter(sources: list, transpose: bool, shape: tuple, stacked: bool, dtype,
                    sharding) -> jax.Array:
  """One parameter from open safetensors files: whole, or block by block onto ``sharding``.

  Args:
    sources: (file, open handle, tensor name) of the parameter, or of each layer's slice of a
      stacked one (``stacked``: ``shape`` is [L, ...], the tensors the slices).
    transpose: Hugging Face stores the tensors transposed ([out, in]).
    shape: the parameter's shape (kernels [in, out]).
    stacked: the parameter stacks the L tensors of ``sources`` along a leading axis.
    dtype: the dtype it is stored in.
    sharding: its sharding, or None for one whole array.

  Raises:
    CheckpointError: a tensor has another shape, or cannot be read (names it and the file).
  """
  tensor_shape = tuple(shape[1:]) if stacked else tuple(shape)
  tensors = []
  for file, f, name in sources:
    try:
      stored = f.get_slice(name)
      stored_shape = tuple(stored.get_shape())
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f"tensor {name} in {file} cannot be read ({e}): the file is "
                            "truncated or corrupt; download or save it again") from None
    loaded_shape = stored_shape[::-1] if transpose else stored_shape
    if loaded_shape != tensor_shape:
      raise CheckpointError(f"tensor {name} in {file} has shape {loaded_shape}, "
                            f"expected {tensor_shape}")
    tensors.append((file, name, stored))

  def read(source, index: tuple) -> np.ndarray:
    """The [index] block of one tensor (laid out as ours: kernels [in, out])."""
    file, name, stored = source
    index = tuple(index) + (slice(None),) * (len(tensor_shape) - len(index))
    try:
      values = stored[index[::-1]].T if transpose else stored[index]
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f"tensor {name} in {file} cannot be read ({e}): the file is "
                            "truncated or corrupt; download or save it again") from None
    return np.asarray(values).astype(dtype)

  def block(index: tuple) -> np.ndarray:
    """The [index] block of the parameter; of a stacked one, its layers' blocks filled in one
    array (no list of copies beside it)."""
    index = tuple(index)
    if not stacked:
      return read(tensors[0], index)
    layers = tensors[index[0] if index else slice(None)]
    first = read(layers[0], index[1:])
    out = np.empty((len(layers),) + first.shape, first.dtype)
    out[0] = first
    for j, source in enumerate(layers[1:], 1):
      out[j] = read(source, index[1:])
    return out

  if sharding is None:
    return jnp.asarray(block(()))
  return jax.make_array_from_callback(tuple(shape), sharding, block)


def save_pretrained(model: CausalLM, path: str, *, tokenizer=None,
                    max_shard_bytes: Optional[int] = None) -> None:
  """Writes ``model`` as a Hugging Face folder (config.json + safetensors).

  A model with LoRA adapters is written merged (each kernel W + (alpha / r) A B,
  ``lora.merged``); ``adapter_folder.save_adapter`` writes the adapters alone, for PEFT.

  Args:
    model: the NNX model (its family is its config's ``model_type``).
    path: output folder (created if needed).
    tokenizer: optional transformers tokenizer, saved alongside.
    max_shard_bytes: when set, split the weights into shards of at most this many bytes and
      write ``model.safetensors.index.json``.
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

  from grpo_jax.models import lora  # pylint: disable=g-import-not-at-top
  family = family_lib.family_for(model.config.model_type)
  if lora.has_adapters(nnx.state(model, nnx.Param)):
    model = lora.merged(model)
  os.makedirs(path, exist_ok=True)
  family.config_to_hf(model.config).save_pretrained(path)
  tensors = {}
  for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    array = np.asarray(jax.device_get(var[...]))
    # A stacked parameter is written as one tensor per layer.
    pieces = ([(causal_lm.layer_path(p, i), array[i]) for i in range(array.shape[0])]
              if causal_lm.is_stacked(p) else [(p, array)])
    for q, piece in pieces:
      name, transpose = family.hf_name(q)
      tensors[name] = np.ascontiguousarray(piece.T if transpose else piece)
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
