"""Device meshes and shardings: one program for 1 CPU, 8 GPUs or a TPU pod slice.

A ``jax.sharding.Mesh`` with three named axes, sized from ``config.mesh``:

  data    pure data parallelism: the batch is split, the parameters are replicated;
  fsdp    data parallelism with the parameters, gradients and optimiser state split as well
          (ZeRO-3 / FSDP: each layer's weights are all-gathered just before they are used);
  tensor  tensor (model) parallelism: attention heads, MLP width and vocabulary split.

Arrays are described by *logical* axes (``("embed", "mlp")`` for an MLP kernel), and
``LOGICAL_RULES`` maps each logical axis to mesh axes, in the manner of MaxText / big_vision:
parameters by their path (each model family's ``param_axes`` table, ``models/family.py``),
batch rows and replay-buffer entries along ``BATCH_AXES`` (data and fsdp together), optimiser
state following the parameter it belongs to (matched by path), scalars replicated. Inside
jitted code ``constrain`` pins activations to the same rules, and is a no-op when no mesh is
set, so the model code is identical with and without a mesh.

GSPMD (XLA's SPMD partitioner) inserts the collectives: all-gathers of fsdp-split weights,
reductions of the partial sums of tensor-split matmuls, the gradient reduction over the batch
axes. Multi-host runs (``initialize_distributed``) use the same global mesh over every process's
devices; every process runs the same program on the same host inputs (docs/scaling.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
# Rows of a batch (rollouts) and entries of the replay buffer: split over both data axes.
BATCH_AXES = ("data", "fsdp")

# Logical axis -> mesh axes. A logical axis missing here (or None) is replicated.
LOGICAL_RULES = {
    "batch": BATCH_AXES,  # rows of a batch, entries of the replay buffer
    "vocab": ("tensor",),  # V: embedding rows, LM-head columns, logits
    "embed": ("fsdp",),  # D: the model width of every weight matrix (FSDP's split)
    "heads": ("tensor",),  # H * Dh: query heads (q_proj out, o_proj in)
    "kv_heads": ("tensor",),  # K * Dh: key/value heads; K in the KV cache
    "mlp": ("tensor",),  # F: SwiGLU width
    "layers": (),  # L: the stacked decoder layers; never split (the scan reads one at a time)
}

class MeshError(ValueError):
  """A mesh that does not fit the devices or the arrays; the message names the config field."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Axis sizes of the mesh; -1 (at most one axis) takes the devices the others leave.

  Attributes:
    data: data-parallel axis (``config.mesh.data``).
    fsdp: fully-sharded data-parallel axis (``config.mesh.fsdp``).
    tensor: tensor-parallel axis (``config.mesh.tensor``).
  """

  data: int = -1
  fsdp: int = 1
  tensor: int = 1

  def __post_init__(self):
    sizes = dataclasses.asdict(self)
    for name, size in sizes.items():
      if not isinstance(size, int) or (size < 1 and size != -1):
        raise MeshError(f"config.mesh.{name}: {size!r} must be a positive integer or -1 (the "
                        "devices the other axes leave)")
    if list(sizes.values()).count(-1) > 1:
      rest = [f"mesh.{n}" for n, s in sizes.items() if s == -1]
      raise MeshError(f"config.{rest[1]}: only one mesh axis may be -1 (got -1 for "
                      f"{' and '.join(rest)})")

  @classmethod
  def from_config(cls, mesh_config) -> "MeshConfig":
    """From the ``config.mesh`` group (``data``, ``fsdp``, ``tensor``)."""
    return cls(data=mesh_config.data, fsdp=mesh_config.fsdp, tensor=mesh_config.tensor)

  def resolve(self, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) with the -1 axis filled in, for ``num_devices`` devices.

    Raises:
      MeshError: the sizes do not multiply to ``num_devices`` (names the fields and the fix).
    """
    sizes = dataclasses.asdict(self)
    fixed = math.prod(s for s in sizes.values() if s != -1)
    shown = " x ".join(f"{n}={s}" for n, s in sizes.items())
    if -1 in sizes.values():
      if num_devices % fixed:
        raise MeshError(f"config.mesh: {shown} needs a multiple of {fixed} devices, but there "
                        f"are {num_devices}; choose mesh sizes whose product divides "
                        f"{num_devices}")
      sizes = {n: (num_devices // fixed if s == -1 else s) for n, s in sizes.items()}
    elif fixed != num_devices:
      raise MeshError(f"config.mesh: {shown} = {fixed} devices, but there are {num_devices}; "
                      "make the product equal the device count, or set one axis to -1")
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(mesh_config: MeshConfig = MeshConfig(),
              devices: Optional[Sequence[Any]] = None) -> Mesh:
  """A (data, fsdp, tensor) mesh over ``devices`` (default: all of them, every process's).

  The axes are ``Auto`` (GSPMD propagates shardings between the pinned points), and the device
  order is ``jax.make_mesh``'s, which places the innermost (tensor) axis on the fastest links.

  Raises:
    MeshError: the sizes do not fit the number of devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_config.resolve(len(devices))
  auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)


def run_mesh(mesh_config: MeshConfig) -> Optional[Mesh]:
  """The mesh of every device laid out by ``mesh_config``, or None on a single device (the
  unsharded path)."""
  mesh = make_mesh(mesh_config)
  return mesh if mesh.size > 1 else None


def split(generation_config: MeshConfig, training_config: MeshConfig,
          k: int) -> tuple[Mesh, Mesh]:
  """(generation mesh, training mesh) for generation on its own devices
  (``rollout.devices`` = K > 0): the first K devices laid out by ``generation_config``
  (``rollout.generation_mesh``), the others by ``training_config`` (``mesh``). Both are meshes
  even of one device (each side's arrays live on its own devices).

  Raises:
    MeshError: K leaves no device to train on, or a layout does not fit its devices.
  """
  devices = jax.devices()
  if k >= len(devices):
    raise MeshError(f"config.rollout.devices: {k} generation devices leave none of the "
                    f"{len(devices)} to train on; use at most {len(devices) - 1}")
  try:
    generation = make_mesh(generation_config, devices[:k])
  except MeshError as e:
    raise MeshError(str(e).replace("config.mesh", "config.rollout.generation_mesh")
                    + f" (rollout.devices = {k})") from None
  try:
    training = make_mesh(training_config, devices[k:])
  except MeshError as e:
    raise MeshError(f"{e} (the {len(devices) - k} devices rollout.devices = {k} leaves to "
                    "training)") from None
  return generation, training


def axis_size(mesh, axes) -> int:
  """Number of shards along ``axes`` (a mesh axis name, a tuple of them, or None) of a mesh
  or abstract mesh."""
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


def batch_shards(mesh: Optional[Mesh]) -> int:
  """How many ways the batch rows are split (1 without a mesh)."""
  return 1 if mesh is None else axis_size(mesh, BATCH_AXES)


def logical_spec(logical_axes: Sequence[Optional[str]]) -> PartitionSpec:
  """PartitionSpec of an array with the given logical axes, through ``LOGICAL_RULES``."""
  parts = []
  for name in logical_axes:
    axes = LOGICAL_RULES.get(name) if name is not None else None
    parts.append(None if not axes else (axes[0] if len(axes) == 1 else tuple(axes)))
  return PartitionSpec(*parts)


def check_divisible(name: str, shape: Sequence[int], spec: PartitionSpec,
                    axis_sizes: dict) -> None:
  """Raises MeshError when a dimension of ``shape`` is not a multiple of its shard count.

  Args:
    name: what the array is, for the message (e.g. ``layers.mlp.up_proj.kernel``).
    shape: the array's global shape.
    spec: its PartitionSpec.
    axis_sizes: mesh axis name -> size (``dict(mesh.shape)``).
  """
  for dim, (size, axes) in enumerate(zip(shape, spec)):
    if axes is None:
      continue
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    shards = math.prod(axis_sizes[a] for a in axes)
    if size % shards:
      fields = " x ".join(f"mesh.{a}={axis_sizes[a]}" for a in axes)
      raise MeshError(f"config.mesh: {name} has {size} along dimension {dim}, which {fields} "
                      f"({shards} shards) does not divide; choose sizes that divide {size}")


def _path_names(path) -> list[str]:
  """The names along a pytree key path, without the Variable's ``value`` attribute."""
  names = []
  for key in path:
    name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", None)))
    names.append(str(name))
  return names[:-1] if names and names[-1] == "value" else names


def param_logical_axes(names: Sequence, ndim: int, param_axes: Mapping) -> tuple:
  """Logical axes of the array at a parameter path (optimiser state uses the same path).

  Args:
    names: the path, e.g. ``('layers', 'mlp', 'up_proj', 'kernel')``, or that path inside an
      optimiser state (``(..., 'mu', 'layers', 'mlp', 'up_proj', 'kernel')``).
    ndim: the array's rank.
    param_axes: (module, parameter) -> logical axes: a model family's ``param_axes``, or
      every registered family's (``models.family.param_axes()``).

  Returns:
    The last two names (module, parameter) looked up in ``param_axes``; anything else, or an
    entry whose rank does not match (an optimiser's factored statistics), is replicated.
  """
  key = tuple(str(n) for n in names[-2:])
  axes = param_axes.get(key) if len(names) >= 2 else None
  if axes is None or len(axes) != ndim:
    return (None,) * ndim
  return axes


def param_sharding(mesh: Mesh, names: Sequence, shape: Sequence[int],
                   param_axes: Mapping) -> NamedSharding:
  """The NamedSharding of one parameter (or optimiser-state array) by its path.

  Args:
    mesh: the mesh.
    names: the parameter's path.
    shape: its global shape.
    param_axes: as ``param_logical_axes``.

  Raises:
    MeshError: a dimension the mesh axes do not divide (names the parameter and the fields).
  """
  spec = logical_spec(param_logical_axes(names, len(shape), param_axes))
  check_divisible(".".join(str(n) for n in names), shape, spec, dict(mesh.shape))
  return NamedSharding(mesh, spec)


def tree_shardings(mesh: Mesh, tree, param_axes: Mapping) -> Any:
  """NamedShardings for parameters, optimiser state or a TrainState, matched by path.

  Args:
    mesh: the mesh.
    tree: a pytree of arrays or ShapeDtypeStructs (only shapes are read).
    param_axes: as ``param_logical_axes``.

  Returns:
    The same structure with a NamedSharding at every leaf.

  Raises:
    MeshError: a parameter dimension the mesh axes do not divide (names the parameter).
  """
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: param_sharding(mesh, _path_names(path), leaf.shape, param_axes), tree)


def rows_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (row / entry) dimension split over ``BATCH_AXES``; the rest replicated."""
  return NamedSharding(mesh, logical_spec(("batch",)))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def replay_shardings(mesh: Mesh, replay) -> Any:
  """Buffer entries [C, ...] along ``BATCH_AXES`` like the batch; scalars replicated.

  Raises:
    MeshError: the capacity C is not a multiple of the batch shards.
  """
  shards = batch_shards(mesh)
  if replay.capacity % shards:
    raise MeshError(f"config.replay.capacity: {replay.capacity} entries must be a multiple of "
                    f"mesh data x fsdp = {shards} (buffer entries are split like the batch)")
  return jax.tree.map(lambda x: rows_sharding(mesh) if x.ndim else replicated(mesh), replay)


@dataclasses.dataclass(frozen=True)
class StepShardings:
  """Input and output shardings of the jitted train step.

  Attributes:
    mesh: the mesh.
    state: TrainState of NamedShardings (parameters and optimiser state by path).
    replay: ReplayState of NamedShardings.
    ref_params: reference parameters' shardings, or None without a reference.
  """

  mesh: Mesh
  state: Any
  replay: Any
  ref_params: Any

  def _key(self) -> tuple:
    leaves, treedef = jax.tree.flatten((self.state, self.replay, self.ref_params))
    return self.mesh, treedef, tuple(leaves)

  def __eq__(self, other) -> bool:  # by layout, so that equal layouts share a jitted step
    return isinstance(other, StepShardings) and self._key() == other._key()

  def __hash__(self) -> int:
    return hash(self._key())

  @property
  def rows(self) -> NamedSharding:
    return rows_sharding(self.mesh)

  @property
  def replicated(self) -> NamedSharding:
    return replicated(self.mesh)


def step_shardings(mesh: Mesh, state, replay, param_axes: Mapping,
                   ref_params=None) -> StepShardings:
  """Shardings of (state, replay, ref_params) for ``step.make_train_step`` (shapes only);
  ``param_axes`` as ``param_logical_axes``."""
  return StepShardings(
      mesh=mesh, state=tree_shardings(mesh, state, param_axes),
      replay=replay_shardings(mesh, replay),
      ref_params=None if ref_params is None else tree_shardings(mesh, ref_params, param_axes))


def _put_leaf(x, sharding):
  if isinstance(x, jax.Array):
    if x.sharding == sharding:
      return x
    if x.is_fully_addressable and jax.process_count() > 1:
      # A process-local array (every process holds the same values): through the host.
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jax.device_put(np.asarray(jax.random.key_data(x)), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
      x = np.asarray(x)
  # Host values (identical on every process) or a global array to reshard.
  return jax.device_put(x, sharding)


def put(tree, shardings):
  """``tree`` placed on ``shardings`` (a pytree prefix of it; None leaves it as it is).

  Host arrays, single-device arrays and global arrays with another layout all become global
  arrays with the given layout; arrays already laid out so are returned as they are (no copy).
  In a multi-process run every process must pass the same host values.
  """
  if shardings is None:
    return tree
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: _put_leaf(x, shardings), tree)
  return jax.tree.map(lambda s, sub: put(sub, s), shardings, tree,
                      is_leaf=lambda s: s is None or isinstance(s, jax.sharding.Sharding))


def logical_sharding(mesh: Mesh, shape: Sequence[int],
                     logical_axes: Sequence[Optional[str]]) -> NamedSharding:
  """The NamedSharding of an array of ``shape`` by logical axes, as ``constrain`` lays it out:
  replicated when a dimension does not split evenly."""
  spec = logical_spec(logical_axes)
  if any(dim % axis_size(mesh, axes) for dim, axes in zip(shape, spec)):
    spec = PartitionSpec()
  return NamedSharding(mesh, spec)


def constrain(x: jax.Array, logical_axes: Sequence[Optional[str]]) -> jax.Array:
  """Pins an activation's layout by logical axes inside jitted code under ``use_mesh``.

  A no-op when no mesh is set (the single-device path) or when a dimension does not split
  evenly (the compiler then keeps its own choice): a layout hint, never a change of values.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  spec = logical_spec(logical_axes)
  if any(dim % axis_size(mesh, axes) for dim, axes in zip(x.shape, spec)):
    return x
  return jax.lax.with_sharding_constraint(x, spec)


def ambient_batch_shards() -> int:
  """Batch shards of the mesh set by ``use_mesh`` while tracing (1 when none is set)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else axis_size(mesh, BATCH_AXES)


def ambient_tensor_shards() -> int:
  """Shards of the ``tensor`` axis of the mesh set by ``use_mesh`` (1 when none is set)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else axis_size(mesh, ("tensor",))


def use_mesh(fn, mesh: Mesh):
  """``fn`` traced with ``mesh`` as the ambient (abstract) mesh, so ``constrain`` sees it."""

  def wrapped(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)

  return wrapped


class PutInputs:
  """A jitted function whose arguments are first placed on its input shardings (``put``).

  Lets callers pass host arrays (prompts, rewards) or arrays laid out otherwise (the sampler's
  replicated completions) to a function jitted with explicit ``in_shardings``, single- or
  multi-process. ``lower`` and ``_cache_size`` are the jitted function's.
  """

  def __init__(self, jitted, in_shardings: Sequence[Any]):
    self.jitted = jitted
    self.in_shardings = tuple(in_shardings)

  def __call__(self, *args):
    return self.jitted(*(put(a, s) for a, s in zip(args, self.in_shardings)))

  def lower(self, *args):
    return self.jitted.lower(*args)

  def _cache_size(self) -> int:
    return self.jitted._cache_size()  # pylint: disable=protected-access
