"""Low-rank adapters (LoRA) on a model's dense layers, built from ``flax.nnx.LoRA``.

Reference: LoRA (Hu et al., arXiv 2106.09685): a frozen weight W [in, out] is used as
W + (alpha / r) A B with A [in, r] and B [r, out] trained, B starting at zero, so that the
adapted model starts exactly at the base model.

Why ``flax.nnx.LoRA`` and not qwix: the model is already Flax NNX with its own ``Dense`` (2-D
matmuls; ``layers.py``); an ``nnx.LoRA`` child per targeted ``Dense`` adds the two factors as
``nnx.LoRAParam`` variables, a type the rest of the package filters on (``nnx.split_state``)
to train only them, checkpoint only them and switch them off for the reference pass. qwix's
provider intercepts the matmuls of a model it rewrites, which our fused decoding projections
and chunked LM head would bypass.

Adapters live in float32 whatever the base stores; their product runs in the model's compute
dtype. ``A`` is drawn like PEFT's default (uniform with bound 1 / sqrt(in)), ``B`` is zero.
Dropout on the adapter input is not offered: it would make pi_theta a random function, so the
step's first update would no longer have ratio 1 on fresh rows (pi_prox = mu) and no pass
would reproduce the sampler's log-probs; RL recipes with LoRA run without it.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.models.layers import Dense

# Every attention and MLP projection of a Qwen3-family decoder (not the LM head).
DEFAULT_TARGETS = r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"

# PEFT's A: kaiming_uniform(a = sqrt(5)), i.e. uniform in +-1 / sqrt(fan_in).
_A_INIT = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Which dense layers carry adapters, and their shape.

  Attributes:
    rank: r, the adapters' inner width (0 = no adapters).
    alpha: the update is scaled by alpha / r.
    targets: regular expression searched in each dense layer's dotted path
      (``layers.0.self_attn.q_proj``).
  """

  rank: int
  alpha: float
  targets: str = DEFAULT_TARGETS

  @property
  def scale(self) -> float:
    return float(self.alpha) / self.rank


def from_config(model_config) -> LoraConfig | None:
  """The LoraConfig of a config's ``model`` group (``model.lora``), None when rank is 0."""
  lora = model_config.get("lora") if hasattr(model_config, "get") else None
  if lora is None or not lora.rank:
    return None
  return LoraConfig(rank=int(lora.rank), alpha=float(lora.alpha), targets=lora.targets)


def dense_layers(model: nnx.Module) -> list[tuple[str, Dense]]:
  """(dotted path, layer) of every ``Dense`` of ``model``, in graph order."""
  out = []
  for path, module in nnx.iter_modules(model):
    if isinstance(module, Dense):
      out.append((".".join(str(p) for p in path), module))
  return out


def attach(model: nnx.Module, config: LoraConfig, rngs: nnx.Rngs) -> list[str]:
  """Gives every targeted ``Dense`` of ``model`` a fresh adapter (in place).

  Args:
    model: the model (its dense layers are changed in place).
    config: LoraConfig.
    rngs: source of the ``A`` draws.

  Returns:
    The dotted paths of the adapted layers.

  Raises:
    ValueError: ``targets`` matches no dense layer, or a layer already has an adapter.
  """
  pattern = re.compile(config.targets)
  adapted = []
  for path, dense in dense_layers(model):
    if not pattern.search(path):
      continue
    if dense.lora is not None:
      raise ValueError(f"{path} already has an adapter")
    din, dout = dense.kernel.shape
    dense.lora = nnx.LoRA(din, config.rank, dout, dtype=dense.dtype, param_dtype=jnp.float32,
                          a_initializer=_A_INIT, rngs=rngs)
    dense.lora_scale = config.scale
    adapted.append(path)
  if not adapted:
    raise ValueError(f"model.lora.targets {config.targets!r} matches none of the dense layers "
                     f"({', '.join(p for p, _ in dense_layers(model)[:4])}, ...)")
  return adapted


def has_adapters(params) -> bool:
  """Whether a parameter State holds any ``nnx.LoRAParam``."""
  adapters, _ = nnx.split_state(params, nnx.LoRAParam, ...)
  return bool(jax.tree.leaves(adapters))


def split(params) -> tuple:
  """(adapters, base): a parameter State cut into its ``nnx.LoRAParam`` leaves and the rest."""
  return nnx.split_state(params, nnx.LoRAParam, ...)


def combine(adapters, base):
  """The inverse of ``split``: one parameter State."""
  return nnx.merge_state(base, adapters)


def trainable(params) -> tuple:
  """(what the optimiser trains, what stays frozen): ``split`` when ``params`` holds adapters,
  else (params, None). Static: read from the tree's structure, so it may run under jit."""
  return split(params) if has_adapters(params) else (params, None)


def join(trained, frozen):
  """The inverse of ``trainable``: the whole parameter State."""
  return trained if frozen is None else combine(trained, frozen)


def without_adapters(params):
  """``params`` with every adapter's ``B`` at zero: the base model's function, computed by the
  same graph (W x + (alpha / r) (x A) 0 = W x exactly), sharing the base's arrays."""
  b, rest = nnx.split_state(params, nnx.All(nnx.LoRAParam, nnx.PathContains("lora_b")), ...)
  return nnx.merge_state(rest, jax.tree.map(jnp.zeros_like, b))


def merged(model: nnx.Module) -> nnx.Module:
  """A copy of ``model`` with each adapter folded into its kernel (W + (alpha / r) A B, in
  float32, stored back in the kernel's dtype) and no adapters left."""
  graphdef, state = nnx.split(model)
  copy = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
  for _, dense in dense_layers(copy):
    if dense.lora is None:
      continue
    w = dense.kernel[...]
    delta = dense.lora.lora_a[...].astype(jnp.float32) @ dense.lora.lora_b[...].astype(
        jnp.float32)
    dense.kernel[...] = (w.astype(jnp.float32) + dense.lora_scale * delta).astype(w.dtype)
    dense.lora = None
    dense.lora_scale = 1.0
  return copy
