"""LoRA adapters <-> a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

The folder is what ``peft.PeftModel.from_pretrained(base, folder)`` loads onto the Hugging Face
base model in PyTorch: PEFT's LoRA weights ``<module>.lora_A.weight`` [r, in] and
``<module>.lora_B.weight`` [out, r] under the prefix ``base_model.model.``, scaled by
``lora_alpha / r``. ``target_modules`` lists the adapted modules' full Hugging Face names, so
PEFT adapts exactly the layers we did. Our factors are stored [in, r] and [r, out] (kernels are
[in, out]), hence the transposes.

Loading follows PEFT 0.21's reading of the config (``peft/tuners/lora``): the adapted modules
are those ``target_modules`` selects (with ``exclude_modules``, ``layers_to_transform`` and
``layers_pattern``), and they must be the modules the weights file holds; each module's rank
and alpha come from ``rank_pattern`` / ``alpha_pattern`` (first key matching the end of its
name, else ``r`` / ``lora_alpha``), its scale is alpha / r, or alpha / sqrt(r) with
``use_rslora``. Every other setting either leaves the loaded function as it is (``_INERT``) or
is refused in one line naming the folder and the key: a folder never loads as a function PEFT
would not compute. Saving writes ``rank_pattern`` / ``alpha_pattern`` for the layers whose rank
or scale differs from the most common one (a model loaded from such a folder saves back).
"""

from __future__ import annotations

import collections
import json
import math
import os
import re

import jax
import numpy as np
from flax import nnx

from grpo_jax.errors import CheckpointError
from grpo_jax.models import family as family_lib
from grpo_jax.models import lora as lora_lib

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# PEFT's defaults for a config without r / lora_alpha (peft.LoraConfig).
_DEFAULT_R, _DEFAULT_ALPHA = 8, 8

# adapter_config.json keys (PEFT 0.21's LoraConfig) read by ``load_adapter``.
_READ = frozenset({"peft_type", "r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora",
                   "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern",
                   "bias", "init_lora_weights"})
# Keys that do not change the function PEFT loads on a Hugging Face causal LM: bookkeeping;
# dropout (off: PEFT loads in inference mode); fan_in_fan_out (PEFT resets it to False on
# torch.nn.Linear, the only layer type adapted here); the settings of inits and of QALoRA,
# read only with the init / use_qalora they belong to (themselves checked); Megatron's layer
# types (same product); ensure_weight_tying (it ties adapters of modules_to_save, trained
# tokens or a tied output layer, all refused or absent here).
_INERT = frozenset({"task_type", "base_model_name_or_path", "revision", "inference_mode",
                    "auto_mapping", "peft_version", "lora_dropout", "fan_in_fan_out",
                    "runtime_config", "loftq_config", "eva_config", "corda_config",
                    "lora_ga_config", "qalora_group_size", "megatron_config", "megatron_core",
                    "ensure_weight_tying"})
# Keys that change the function when set (a truthy value), with what they do. A key in none of
# these sets (a newer PEFT's) is refused when set as well.
_REFUSED = {
    "use_dora": "DoRA rescales each output by a learned magnitude",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "full trained copies of other modules",
    "trainable_token_indices": "trained embedding rows",
    "layer_replication": "repeated decoder layers",
    "target_parameters": "LoRA on parameters, not modules",
    "alora_invocation_tokens": "aLoRA adapts only the tokens after its invocation",
    "use_qalora": "QALoRA pools the adapter's input",
    "velora_config": "a LoRA variant",
    "monteclora_config": "a LoRA variant",
    "use_bdlora": "a LoRA variant (block-diagonal factors)",
    "arrow_config": "a LoRA variant (routing)",
    "kasa_config": "a LoRA variant (a diagonal between A and B)",
}
# init_lora_weights values with which PEFT's loading leaves the base weights as they are; the
# others (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA) subtract their initial adapter from the base
# weights, or quantise them, when PEFT loads the folder.
_BASE_KEEPING_INITS = ("gaussian", "eva", "orthogonal", "mica")


def is_adapter_folder(path: str) -> bool:
  """Whether ``path`` is a PEFT adapter folder (it has ``adapter_config.json``)."""
  return os.path.isfile(os.path.join(path, CONFIG))


def base_model(path: str) -> str:
  """The base model folder an adapter folder records (``base_model_name_or_path``).

  Raises:
    CheckpointError: it records none, or one that is not a local folder (nothing is
      downloaded: pass the base's folder).
  """
  base = _read_config(path).get("base_model_name_or_path") or ""
  if not os.path.isdir(base):
    raise CheckpointError(f"{path}: its base model {base!r} is not a local folder; pass "
                             "the base model's folder (from_pretrained(..., base=FOLDER))")
  return base


def _read_config(path: str) -> dict:
  with open(os.path.join(path, CONFIG)) as f:
    try:
      return json.load(f)
    except ValueError as e:
      raise CheckpointError(f"{path}/{CONFIG} is not readable JSON ({e})") from None


def _module_names(model, family) -> dict[str, str]:
  """Our per-layer dotted dense-layer path (``lora.Site.path``) -> its Hugging Face module name
  (``layers.0.self_attn.q_proj`` -> ``model.layers.0.self_attn.q_proj``)."""
  out = {}
  for site in lora_lib.dense_layers(model):
    parts = tuple(int(p) if p.isdigit() else p for p in site.path.split("."))
    name, _ = family.hf_name(parts + ("kernel",))
    out[site.path] = name.removesuffix(".weight")
  return out


def save_adapter(model, path: str, *, base_model: str = "") -> None:
  """Writes ``model``'s adapters as a PEFT LoRA folder.

  Args:
    model: a model with adapters (``lora.attach`` or ``load_adapter``), each layer written at
      its own rank (a stack's zero padding left out). ``r`` and ``lora_alpha`` are the most
      common rank and alpha (the layer's float32 scale x its rank, so that PEFT's alpha / r is
      that scale); layers that differ get ``rank_pattern`` / ``alpha_pattern`` entries, keyed
      by their full escaped name.
    path: the output folder (created if needed).
    base_model: recorded as ``base_model_name_or_path`` (the folder the base is loaded from).

  Raises:
    ValueError: the model has no adapters.
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

  family = family_lib.family_for(model.config.model_type)
  names = _module_names(model, family)
  tensors, ranks, alphas = {}, {}, {}
  for site in lora_lib.dense_layers(model):
    if not site.rank:
      continue
    name = names[site.path]
    a, b = (np.asarray(jax.device_get(f), np.float32) for f in site.factors())
    tensors[f"{_PREFIX}{name}.lora_A.weight"] = np.ascontiguousarray(a.T)
    tensors[f"{_PREFIX}{name}.lora_B.weight"] = np.ascontiguousarray(b.T)
    ranks[name] = site.rank
    alphas[name] = site.scale * site.rank
  if not tensors:
    raise ValueError("the model has no LoRA adapters to save")
  rank = collections.Counter(ranks.values()).most_common(1)[0][0]
  alpha = collections.Counter(alphas.values()).most_common(1)[0][0]
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
      "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
      "target_modules": sorted(ranks), "fan_in_fan_out": False, "inference_mode": True,
      "use_rslora": False, "use_dora": False, "modules_to_save": None,
      "init_lora_weights": True,
      "rank_pattern": {re.escape(n): r for n, r in ranks.items() if r != rank},
      "alpha_pattern": {re.escape(n): a for n, a in alphas.items() if a != alpha}}
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, CONFIG), "w") as f:
    json.dump(config, f, indent=2)
  save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": "pt"})


def _refused_settings(config: dict) -> list[str]:
  """``key=value (why)`` for each setting of ``config`` that changes the function in a way
  a model here cannot carry (empty when it loads as plain LoRA)."""
  out = []
  init = config.get("init_lora_weights", True)
  if config.get("peft_type", "LORA") != "LORA":
    out.append(f"peft_type={config['peft_type']!r} (not LoRA)")
  if config.get("bias", "none") != "none":
    out.append(f"bias={config['bias']!r} (trained base biases)")
  if not (isinstance(init, bool) or init in _BASE_KEEPING_INITS):
    out.append(f"init_lora_weights={init!r} (PEFT rewrites the base weights when it loads it)")
  targets = config.get("target_modules")
  if targets is None:
    out.append("target_modules=None (PEFT would pick its default for the architecture)")
  elif isinstance(targets, str) and (config.get("layers_to_transform") is not None
                                     or config.get("layers_pattern") is not None):
    out.append("target_modules (a regular expression, with layers_to_transform / "
               "layers_pattern: PEFT refuses it)")
  for key, value in config.items():
    if key not in _READ and key not in _INERT and value:
      why = _REFUSED.get(key, "a setting this reader does not know: PEFT 0.21's LoRA fields")
      out.append(f"{key}={value!r} ({why})")
  return out


def _check_patterns(config: dict) -> list[str]:
  """``key (error)`` for each regular expression of ``config`` that does not compile."""
  out = []
  # (key, the pattern as written, the expression PEFT builds from it)
  candidates = [(k, config.get(k), config.get(k)) for k in ("target_modules", "exclude_modules")
                if isinstance(config.get(k), str)]
  candidates += [(k, p, rf"(.*\.)?({p})$") for k in ("rank_pattern", "alpha_pattern")
                 for p in config.get(k) or {}]
  layers_pattern = config.get("layers_pattern") or []
  candidates += [("layers_pattern", p, rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.") for p in (
      [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern)]
  for key, pattern, expression in candidates:
    try:
      re.compile(expression)
    except re.error as e:
      out.append(f"{key} ({pattern!r} is not a regular expression: {e})")
  return out


def _selected(config: dict, name: str, all_linear: set[str]) -> bool:
  """Whether PEFT adapts module ``name`` (``peft.tuners.tuners_utils.check_target_module_exists``;
  ``all_linear``: the names ``target_modules="all-linear"`` stands for)."""
  exclude = config.get("exclude_modules")
  if isinstance(exclude, str):
    if re.fullmatch(exclude, name):
      return False
  elif exclude and (name in exclude or any(name.endswith(f".{e}") for e in exclude)):
    return False
  targets = config["target_modules"]
  if isinstance(targets, str) and targets.lower() == "all-linear":
    targets = all_linear
  if isinstance(targets, str):
    return re.fullmatch(targets, name) is not None
  if name in targets:
    return True
  if not any(name.endswith(f".{t}") for t in targets):
    return False
  layers = config.get("layers_to_transform")
  if layers is None or layers == []:
    return True
  patterns = config.get("layers_pattern")
  match = None
  if not patterns:
    match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
  for pattern in ([patterns] if isinstance(patterns, str) else patterns or []):
    match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", name)
    if match is not None:
      break
  if match is None:
    return False
  index = int(match["idx"])
  return index == layers if isinstance(layers, int) else index in layers


def _pattern_value(patterns: dict, name: str, default):
  """PEFT's value for module ``name``: that of the first key of ``patterns`` matching the end
  of ``name`` at a dot (``peft.utils.other.get_pattern_key``), else ``default``."""
  for key, value in (patterns or {}).items():
    if re.match(rf"(.*\.)?({key})$", name):
      return value
  return default


def _rank_and_alpha(config: dict, name: str) -> tuple[int, float]:
  """Module ``name``'s rank and alpha as PEFT reads them (``LoraModel._create_and_replace``);
  its scale is alpha / rank, or alpha / sqrt(rank) with use_rslora (``update_layer``)."""
  rank = int(_pattern_value(config.get("rank_pattern"), name, config.get("r", _DEFAULT_R)))
  alpha = _pattern_value(config.get("alpha_pattern"), name,
                         config.get("lora_alpha", _DEFAULT_ALPHA))
  return rank, float(alpha)


def load_adapter(model, path: str) -> None:
  """Attaches the PEFT LoRA adapters of folder ``path`` to ``model`` (in place), each module
  with the rank and scale PEFT gives it.

  Raises:
    CheckpointError: the folder is not a LoRA adapter this model can carry as PEFT reads it (a
      setting that changes the function otherwise, such as DoRA or a trained bias; weights
      for modules its target_modules does not select, or the reverse; a module it does not
      have; tensors whose shapes are not the rank PEFT gives them), in one line naming the
      folder and the setting.
  """
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top

  config = _read_config(path)
  refused = _refused_settings(config) or _check_patterns(config)
  if refused:
    raise CheckpointError(f"{path}: PEFT settings not supported here: {'; '.join(refused)}")
  weights_file = os.path.join(path, WEIGHTS)
  if not os.path.isfile(weights_file):
    raise CheckpointError(f"{path} has no {WEIGHTS}")
  tensors = load_file(weights_file)
  family = family_lib.family_for(model.config.model_type)
  names = _module_names(model, family)
  ours = [p for p, n in names.items() if f"{_PREFIX}{n}.lora_A.weight" in tensors]
  if not ours:
    raise CheckpointError(f"{path}: none of its adapters names a layer of this model")
  known = {f"{_PREFIX}{names[p]}.lora_{x}.weight" for p in ours for x in "AB"}
  # PEFT saves a targeted output layer's (or embedding's) weight with its factors
  # (save_embedding_layers) and loads it over the base's: so do we.
  bases = {p: f"{_PREFIX}{names[p]}.base_layer.weight" for p in ours}
  bases = {p: k for p, k in bases.items() if k in tensors}
  strays = sorted(set(tensors) - known - set(bases.values()))
  missing = sorted(known - set(tensors))
  if strays or missing:
    raise CheckpointError(
        f"{path}: tensors this model has no place for (LoRA on modules it lacks, or base "
        f"weights such as a resized embedding): {strays[:4]}" if strays else
        f"{path}: {WEIGHTS} lacks {missing[:4]}")
  all_linear = {n for p, n in names.items() if p != "lm_head"}  # PEFT leaves the output layer
  selected = {p for p, n in names.items() if _selected(config, n, all_linear)}
  if selected != set(ours):
    keys = [k for k in ("target_modules", "exclude_modules", "layers_to_transform",
                        "layers_pattern") if config.get(k) is not None]
    odd = sorted(set(ours) ^ selected, key=list(names).index)[0]
    has = "has weights for" if odd in ours else "has no weights for"
    raise CheckpointError(f"{path}: {has} {names[odd]}, which PEFT's reading of its "
                             f"{' / '.join(keys)} does {'not ' if odd in ours else ''}adapt")
  sites = {site.path: site for site in lora_lib.dense_layers(model)}
  plan = {p: _rank_and_alpha(config, names[p]) for p in ours}
  plans, kernels = {}, {}
  for p in ours:  # all checked before the model is changed
    (rank, alpha), (din, dout) = plan[p], sites[p].shape
    a, b = (tensors[f"{_PREFIX}{names[p]}.lora_{x}.weight"].T for x in "AB")
    if rank < 1 or a.shape != (din, rank) or b.shape != (rank, dout):
      raise CheckpointError(f"{path}: {names[p]} has adapters {a.shape} x {b.shape}, "
                               f"expected {(din, rank)} x {(rank, dout)} (r / rank_pattern)")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    plans[p] = lora_lib.Plan(rank, scale, a, b)
    kernel = tensors[bases[p]].T if p in bases else None
    if kernel is not None and kernel.shape != (din, dout):
      raise CheckpointError(f"{path}: {bases[p]} is {kernel.shape[::-1]}, expected "
                               f"{(dout, din)}")
    kernels[p] = kernel
  lora_lib.adapt(model, plans, nnx.Rngs(0))  # no draws: every factor is the folder's
  for p, kernel in kernels.items():
    if kernel is not None:
      sites[p].set_kernel(kernel)
