"""Low-rank adapters (LoRA) on a model's dense layers.

Reference: LoRA (Hu et al., arXiv 2106.09685): a frozen weight W [in, out] is used as
W + (alpha / r) A B with A [in, r] and B [r, out] trained, B starting at zero, so that the
adapted model starts exactly at the base model.

Why own adapters and not qwix: the model is already Flax NNX with its own ``Dense`` (2-D
matmuls; ``layers.py``); an ``Adapter`` child per targeted ``Dense`` adds the two factors as
``nnx.LoRAParam`` variables, a type the rest of the package filters on (``nnx.split_state``)
to train only them, checkpoint only them and switch them off for the reference pass. qwix's
provider intercepts the matmuls of a model it rewrites, which our fused decoding projections
and chunked LM head would bypass.

The decoder layers are stacked (``causal_lm.LAYERS``), and so are the adapters of their dense
layers: A [L, in, r] and B [L, r, out], with the scale of each layer ([L], a non-trained
variable) so that one step of the layer scan reads its own layer's factors and scale. Targets
are chosen per layer (``layers.1.self_attn.q_proj``, a ``Site``): a layer left out has a zero
scale and zero factors. Layers may have different ranks (PEFT's ``rank_pattern``); the stack
has the largest, and a layer of rank r < width has zero columns r.. of A and zero rows r.. of
B. Those are inert, in the output and in training: the padded part adds
sum_j (x A)[:, j] B[j, :] = 0 over j >= r, since column j of A is zero, and its gradients,
dB[j, :] = scale (x A)[:, j]^T g and dA[:, j] = scale x^T (g B[j, :]^T), are zero since A's
column j and B's row j are; an optimiser that moves a zero gradient nowhere (AdamW: zero
moments give a zero step, and decay keeps zero at zero) leaves them zero.

Adapters live in float32 whatever the base stores; their product runs in the model's compute
dtype. ``A`` is drawn like PEFT's default (uniform with bound 1 / sqrt(in)), ``B`` is zero.
Dropout on the adapter input is not offered: it would make pi_theta a random function, so the
step's first update would no longer have ratio 1 on fresh rows (pi_prox = mu) and no pass
would reproduce the sampler's log-probs; RL recipes with LoRA run without it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.models import causal_lm
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
    targets: regular expression searched in each dense layer's dotted path, per layer
      (``layers.0.self_attn.q_proj``, ``lm_head``).
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


class Scale(nnx.Variable):
  """An adapter's scale, alpha / r (alpha / sqrt(r) under rsLoRA): [L] for a stacked dense
  layer (0 where a layer has no adapter), a scalar otherwise. Not an ``nnx.Param``: nothing
  trains it, and ``split`` leaves it with the frozen base."""


class Adapter(nnx.Module):
  """The adapters of one ``Dense``: factors A [(L,) in, r] and B [(L,) r, out] (r the largest
  rank of its layers), their ``Scale``, and each layer's own rank (static)."""

  def __init__(self, a, b, scale, ranks: tuple[int, ...], dtype):
    self.lora_a = nnx.LoRAParam(a)
    self.lora_b = nnx.LoRAParam(b)
    self.scale = Scale(scale)
    self.ranks = ranks
    self.dtype = dtype

  def __call__(self, x2):
    """scale (x2 A) B in the compute dtype, for one layer's factors (x2 [rows, in])."""
    a, b = (f[...].astype(self.dtype) for f in (self.lora_a, self.lora_b))
    out = x2.astype(self.dtype) @ a @ b
    return self.scale[...].astype(out.dtype) * out


@dataclasses.dataclass(frozen=True)
class Site:
  """One layer's dense projection: a ``Dense``, or layer ``index`` of a stacked one.

  Attributes:
    path: the per-layer dotted path (``layers.0.self_attn.q_proj``, ``lm_head``), in which
      ``LoraConfig.targets`` is searched.
    dense: the Dense.
    index: the layer in the stack; None for a Dense that is not stacked.
  """

  path: str
  dense: Dense
  index: Optional[int]

  @property
  def _at(self) -> tuple:
    return () if self.index is None else (self.index,)

  @property
  def shape(self) -> tuple[int, int]:
    """(in, out) of the layer's kernel."""
    return tuple(self.dense.kernel.shape[-2:])

  @property
  def rank(self) -> int:
    """The layer's adapter rank (0: no adapter)."""
    lora = self.dense.lora
    return 0 if lora is None else lora.ranks[self.index or 0]

  @property
  def scale(self) -> float:
    """The layer's adapter scale (as stored: float32)."""
    return float(self.dense.lora.scale[...][self._at])

  def factors(self) -> tuple[jax.Array, jax.Array]:
    """The layer's A [in, rank] and B [rank, out]."""
    lora, r = self.dense.lora, self.rank
    return lora.lora_a[...][self._at][:, :r], lora.lora_b[...][self._at][:r]

  def set_factors(self, a=None, b=None) -> None:
    """Sets the layer's A [in, rank] and / or B [rank, out] (in place)."""
    lora, r = self.dense.lora, self.rank
    for factor, value, index in ((lora.lora_a, a, (slice(None), slice(0, r))),
                                 (lora.lora_b, b, (slice(0, r),))):
      if value is None:
        continue
      part = factor[...][self._at][index]
      if tuple(np.shape(value)) != part.shape:
        raise ValueError(f"{self.path}: factor of shape {np.shape(value)}, expected {part.shape}")
      factor[...] = factor[...].at[self._at + index].set(jnp.asarray(value, factor.dtype))

  def set_kernel(self, kernel) -> None:
    """Replaces the layer's kernel [in, out] (in place, keeping the stack's layout)."""
    old = self.dense.kernel[...]
    new = old.at[self._at].set(jnp.asarray(kernel, old.dtype))
    self.dense.kernel[...] = jax.device_put(new, old.sharding)


def dense_layers(model: nnx.Module) -> list[Site]:
  """Every layer's dense projection, in graph order, the stacked decoder layers' one layer
  after the other (``layers.0.mlp.down_proj``, ..., ``layers.0.self_attn.v_proj``,
  ``layers.1.mlp.down_proj``, ..., ``lm_head``): the order in which ``attach`` draws."""
  found = [(path, module) for path, module in nnx.iter_modules(model)
           if isinstance(module, Dense)]
  stacked = [(path, dense) for path, dense in found if causal_lm.is_stacked(path)]
  dotted = lambda path: ".".join(str(p) for p in path)
  sites = []
  for path, dense in found:
    if not causal_lm.is_stacked(path):
      sites.append(Site(dotted(path), dense, None))
    elif dense is stacked[0][1]:
      sites += [Site(dotted(causal_lm.layer_path(p, i)), d, i)
                for i in range(dense.kernel.shape[0]) for p, d in stacked]
  return sites


@dataclasses.dataclass(frozen=True)
class Plan:
  """The adapter of one ``Site``: its rank, its scale, and its factors (None: A drawn, B = 0).

  Attributes:
    rank: r.
    scale: alpha / r (or alpha / sqrt(r)).
    a: A [in, r], or None to draw it.
    b: B [r, out], or None for zeros.
  """

  rank: int
  scale: float
  a: Optional[np.ndarray] = None
  b: Optional[np.ndarray] = None


def adapt(model: nnx.Module, plans: Mapping[str, Plan], rngs: nnx.Rngs) -> None:
  """Gives every site ``plans`` names its adapter (in place); the other layers of a stack
  whose dense layer gets adapters get zero ones (rank 0, scale 0).

  Each drawn A is drawn as ``nnx.LoRA`` draws one (A's key, then B's), site by site in the
  order of ``dense_layers``: the draws of separate layers, whichever way they are stored.

  Raises:
    ValueError: a site already has an adapter.
  """
  per_dense = {}  # id -> (dense, {layer index: (rank, scale, a, b)})
  for site in dense_layers(model):
    if site.path not in plans:
      continue
    if site.dense.lora is not None:
      raise ValueError(f"{site.path} already has an adapter")
    plan, (din, dout) = plans[site.path], site.shape
    a, b = plan.a, plan.b
    if a is None:
      a = nnx.LoRA(din, plan.rank, dout, param_dtype=jnp.float32, a_initializer=_A_INIT,
                   rngs=rngs).lora_a[...]
    per_dense.setdefault(id(site.dense), (site.dense, {}))[1][site.index] = (
        plan.rank, plan.scale, a, b)
  for dense, layers in per_dense.values():
    lead = tuple(dense.kernel.shape[:-2])  # (L,) stacked, () not
    din, dout = dense.kernel.shape[-2:]
    width = max(rank for rank, *_ in layers.values())
    a_all = jnp.zeros(lead + (din, width), jnp.float32)
    b_all = jnp.zeros(lead + (width, dout), jnp.float32)
    scales = np.zeros(lead, np.float32)
    ranks = [0] * (lead[0] if lead else 1)
    for index, (rank, scale, a, b) in layers.items():
      at = () if index is None else (index,)
      a_all = a_all.at[at + (slice(None), slice(0, rank))].set(jnp.asarray(a, jnp.float32))
      if b is not None:
        b_all = b_all.at[at + (slice(0, rank),)].set(jnp.asarray(b, jnp.float32))
      scales[at] = scale
      ranks[index or 0] = rank
    dense.lora = Adapter(a_all, b_all, jnp.asarray(scales), tuple(ranks), dense.dtype)


def attach(model: nnx.Module, config: LoraConfig, rngs: nnx.Rngs) -> list[str]:
  """Gives every targeted layer of ``model`` a fresh adapter (in place).

  Args:
    model: the model (its dense layers are changed in place).
    config: LoraConfig; ``targets`` is searched in each layer's path (``Site.path``).
    rngs: source of the ``A`` draws.

  Returns:
    The per-layer dotted paths of the adapted layers.

  Raises:
    ValueError: ``targets`` matches no dense layer, or a layer already has an adapter.
  """
  pattern = re.compile(config.targets)
  sites = dense_layers(model)
  chosen = [site.path for site in sites if pattern.search(site.path)]
  if not chosen:
    raise ValueError(f"model.lora.targets {config.targets!r} matches none of the dense layers "
                     f"({', '.join(site.path for site in sites[:4])}, ...)")
  adapt(model, {path: Plan(config.rank, config.scale) for path in chosen}, rngs)
  return chosen


def has_adapters(params) -> bool:
  """Whether a parameter State holds any ``nnx.LoRAParam``."""
  adapters, _ = nnx.split_state(params, nnx.LoRAParam, ...)
  return bool(jax.tree.leaves(adapters))


def split(params) -> tuple:
  """(adapters, base): a parameter State cut into its ``nnx.LoRAParam`` leaves and the rest
  (the base's parameters and the adapters' scales)."""
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
  adapted = [m for _, m in nnx.iter_modules(copy) if isinstance(m, Dense) and m.lora is not None]
  for dense in adapted:
    lora, w = dense.lora, dense.kernel[...]
    # Per layer of a stack (batched matmul); a layer without adapter adds 0 * 0 exactly.
    delta = lora.lora_a[...].astype(jnp.float32) @ lora.lora_b[...].astype(jnp.float32)
    scale = lora.scale[...][..., None, None]
    dense.kernel[...] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
    dense.lora = None
  return copy
