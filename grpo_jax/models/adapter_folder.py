"""LoRA adapters <-> a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

The folder is what ``peft.PeftModel.from_pretrained(base, folder)`` loads onto the Hugging Face
base model in PyTorch: PEFT's LoRA weights ``<module>.lora_A.weight`` [r, in] and
``<module>.lora_B.weight`` [out, r] under the prefix ``base_model.model.``, scaled by
``lora_alpha / r``. ``target_modules`` lists the adapted modules' full Hugging Face names, so
PEFT adapts exactly the layers we did. Our factors are stored [in, r] and [r, out] (kernels are
[in, out]), hence the transposes.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.models import lora as lora_lib

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def is_adapter_folder(path: str) -> bool:
  """Whether ``path`` is a PEFT adapter folder (it has ``adapter_config.json``)."""
  return os.path.isfile(os.path.join(path, CONFIG))


def base_model(path: str) -> str:
  """The base model folder an adapter folder records (``base_model_name_or_path``).

  Raises:
    CheckpointError: it records none, or one that is not a local folder (nothing is
      downloaded: pass the base's folder).
  """
  from grpo_jax.models import hf  # pylint: disable=g-import-not-at-top
  base = _read_config(path).get("base_model_name_or_path") or ""
  if not os.path.isdir(base):
    raise hf.CheckpointError(f"{path}: its base model {base!r} is not a local folder; pass "
                             "the base model's folder (from_pretrained(..., base=FOLDER))")
  return base


def _read_config(path: str) -> dict:
  from grpo_jax.models import hf  # pylint: disable=g-import-not-at-top
  with open(os.path.join(path, CONFIG)) as f:
    try:
      return json.load(f)
    except ValueError as e:
      raise hf.CheckpointError(f"{path}/{CONFIG} is not readable JSON ({e})") from None


def _module_names(model, family) -> dict[str, str]:
  """Our dotted dense-layer path -> its Hugging Face module name (``model.layers.0...q_proj``)."""
  out = {}
  for path, _ in lora_lib.dense_layers(model):
    parts = tuple(int(p) if p.isdigit() else p for p in path.split("."))
    name, _ = family.hf_name(parts + ("kernel",))
    out[path] = name.removesuffix(".weight")
  return out


def save_adapter(model, path: str, *, base_model: str = "") -> None:
  """Writes ``model``'s adapters as a PEFT LoRA folder.

  Args:
    model: a model with adapters (``lora.attach``); every adapter must share one rank and
      scale, as ``attach`` makes them.
    path: the output folder (created if needed).
    base_model: recorded as ``base_model_name_or_path`` (the folder the base is loaded from).

  Raises:
    ValueError: the model has no adapters.
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  from grpo_jax.models import hf  # pylint: disable=g-import-not-at-top

  family = hf.family_for(model.config.model_type)
  names = _module_names(model, family)
  tensors, ranks, scales = {}, set(), set()
  for layer, dense in lora_lib.dense_layers(model):
    if dense.lora is None:
      continue
    a = np.asarray(jax.device_get(dense.lora.lora_a[...]), np.float32)
    b = np.asarray(jax.device_get(dense.lora.lora_b[...]), np.float32)
    tensors[f"{_PREFIX}{names[layer]}.lora_A.weight"] = np.ascontiguousarray(a.T)
    tensors[f"{_PREFIX}{names[layer]}.lora_B.weight"] = np.ascontiguousarray(b.T)
    ranks.add(a.shape[1])
    scales.add(dense.lora_scale)
  if not tensors:
    raise ValueError("the model has no LoRA adapters to save")
  (rank,), (scale,) = ranks, scales
  adapted = sorted(n.removeprefix(_PREFIX).removesuffix(".lora_A.weight")
                   for n in tensors if n.endswith(".lora_A.weight"))
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
      "r": rank, "lora_alpha": scale * rank, "lora_dropout": 0.0, "bias": "none",
      "target_modules": adapted, "fan_in_fan_out": False, "inference_mode": True,
      "use_rslora": False, "use_dora": False, "modules_to_save": None,
      "init_lora_weights": True}
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, CONFIG), "w") as f:
    json.dump(config, f, indent=2)
  save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": "pt"})


def load_adapter(model, path: str) -> None:
  """Attaches the PEFT LoRA adapters of folder ``path`` to ``model`` (in place).

  Raises:
    CheckpointError: the folder is not a LoRA adapter this model can carry (another PEFT
      type, rsLoRA or DoRA, a bias, a module it does not have, misshaped tensors).
  """
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  from grpo_jax.models import hf  # pylint: disable=g-import-not-at-top

  config = _read_config(path)
  unsupported = [k for k, bad in (("peft_type", config.get("peft_type", "LORA") != "LORA"),
                                  ("use_rslora", config.get("use_rslora")),
                                  ("use_dora", config.get("use_dora")),
                                  ("bias", config.get("bias", "none") != "none"),
                                  ("modules_to_save", config.get("modules_to_save")))
                 if bad]
  if unsupported:
    raise hf.CheckpointError(f"{path}: PEFT settings {', '.join(unsupported)} are not "
                             "supported (plain LoRA on dense layers only)")
  weights_file = os.path.join(path, WEIGHTS)
  if not os.path.isfile(weights_file):
    raise hf.CheckpointError(f"{path} has no {WEIGHTS}")
  tensors = load_file(weights_file)
  family = hf.family_for(model.config.model_type)
  names = _module_names(model, family)
  ours = [p for p, n in names.items() if f"{_PREFIX}{n}.lora_A.weight" in tensors]
  if not ours:
    raise hf.CheckpointError(f"{path}: none of its adapters names a layer of this model")
  known = {f"{_PREFIX}{names[p]}.lora_{x}.weight" for p in ours for x in "AB"}
  strays = sorted(set(tensors) - known)
  if strays:
    raise hf.CheckpointError(f"{path}: tensors for modules this model lacks: {strays[:4]}")
  rank = int(config["r"])
  lora_config = lora_lib.LoraConfig(
      rank=rank, alpha=float(config["lora_alpha"]),
      targets="^(" + "|".join(re.escape(p) for p in ours) + ")$")
  lora_lib.attach(model, lora_config, nnx.Rngs(0))
  dense_by_path = dict(lora_lib.dense_layers(model))
  for p in ours:
    dense = dense_by_path[p]
    a = tensors[f"{_PREFIX}{names[p]}.lora_A.weight"].T
    b = tensors[f"{_PREFIX}{names[p]}.lora_B.weight"].T
    if a.shape != dense.lora.lora_a.shape or b.shape != dense.lora.lora_b.shape:
      raise hf.CheckpointError(f"{path}: {names[p]} has adapters {a.shape} x {b.shape}, "
                               f"expected {dense.lora.lora_a.shape} x {dense.lora.lora_b.shape}")
    dense.lora.lora_a[...] = jnp.asarray(a, jnp.float32)
    dense.lora.lora_b[...] = jnp.asarray(b, jnp.float32)
