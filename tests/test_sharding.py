"""Mesh sizing, logical-axis rules, divisibility errors and config checks (one device).

What needs several devices (sharded == unsharded, restore onto another mesh) is in
test_multidevice.py; the rules here are pure functions of shapes and axis sizes, checked on
abstract meshes where a mesh is needed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec as P

from configs import grpo, popo
from grpo_jax import configuration, sharding
from grpo_jax.models import family
from grpo_jax.models.architectures import architecture
from grpo_jax.models.qwen3 import Qwen3
from grpo_jax.rl import step as step_lib

MESH_222 = AbstractMesh((2, 2, 2), sharding.MESH_AXES)


@pytest.mark.parametrize("sizes,devices,expected", [
    ((-1, 1, 1), 8, (8, 1, 1)),  # data takes every device
    ((2, -1, 2), 8, (2, 2, 2)),  # 8 / (2 * 2) = 2 left for fsdp
    ((1, 1, -1), 4, (1, 1, 4)),
    ((2, 2, 2), 8, (2, 2, 2)),
    ((-1, 1, 1), 1, (1, 1, 1)),  # the default on one CPU
])
def test_mesh_sizes_resolve(sizes, devices, expected):
  assert sharding.MeshConfig(*sizes).resolve(devices) == expected


@pytest.mark.parametrize("sizes,devices,message", [
    ((3, 1, 1), 8, r"config.mesh: data=3 x fsdp=1 x tensor=1 = 3 devices, but there are 8"),
    ((-1, 3, 1), 8, r"config.mesh: .* needs a multiple of 3 devices, but there are 8"),
])
def test_mesh_that_does_not_fit_the_devices_names_the_fields(sizes, devices, message):
  with pytest.raises(sharding.MeshError, match=message):
    sharding.MeshConfig(*sizes).resolve(devices)


def test_mesh_config_rejects_bad_sizes():
  with pytest.raises(sharding.MeshError, match=r"config.mesh.fsdp: only one mesh axis may be -1"):
    sharding.MeshConfig(-1, -1, 1)
  with pytest.raises(sharding.MeshError, match=r"config.mesh.tensor: 0 must be a positive"):
    sharding.MeshConfig(1, 1, 0)


def test_one_device_runs_unsharded():
  mesh = sharding.make_mesh()
  assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
  # The unchanged 1-device path.
  assert sharding.run_mesh(sharding.MeshConfig.from_config(grpo.get_config().mesh)) is None
  assert sharding.batch_shards(None) == 1


def test_logical_rules():
  assert sharding.logical_spec(("batch",)) == P(("data", "fsdp"))
  assert sharding.logical_spec(("layers", "embed", "mlp")) == P(None, "fsdp", "tensor")
  assert sharding.logical_spec(("vocab", "embed")) == P("tensor", "fsdp")
  assert sharding.logical_spec((None, "mlp")) == P(None, "tensor")


@pytest.mark.parametrize("path,ndim,axes", [
    (("embed_tokens", "embedding"), 2, ("vocab", "embed")),
    (("lm_head", "kernel"), 2, ("embed", "vocab")),
    (("norm", "scale"), 1, (None,)),  # norms replicated
    # The stacked decoder layers: the layer axis first (never split), then the layer's own.
    (("layers", "self_attn", "q_proj", "kernel"), 3, ("layers", "embed", "heads")),
    (("layers", "self_attn", "k_proj", "bias"), 2, ("layers", "kv_heads")),
    (("layers", "self_attn", "o_proj", "kernel"), 3, ("layers", "heads", "embed")),
    (("layers", "mlp", "down_proj", "kernel"), 3, ("layers", "mlp", "embed")),
    (("layers", "self_attn", "q_norm", "scale"), 2, ("layers", None)),
    # Optimiser state: the parameter's path inside it gives the parameter's axes ...
    (("1", "0", "mu", "layers", "mlp", "up_proj", "kernel"), 3, ("layers", "embed", "mlp")),
    (("1", "0", "count"), 0, ()),  # ... and its scalars are replicated
    # A rank that does not match (a factored statistic) is replicated, never mis-split.
    (("v_row", "mlp", "up_proj", "kernel"), 1, (None,)),
])
def test_parameter_axes_by_path(path, ndim, axes):
  assert sharding.param_logical_axes(path, ndim, family.param_axes()) == axes


def test_parameter_axes_come_from_the_given_family_table():
  """A family's own table, when given, is the only one read: its names, nothing else's."""
  table = {("wqkv", "kernel"): ("embed", "heads")}
  assert sharding.param_logical_axes(("layers", 0, "wqkv", "kernel"), 2, table) == (
      "embed", "heads")
  assert sharding.param_logical_axes(("layers", 0, "mlp", "up_proj", "kernel"), 2, table) == (
      None, None)
  tree = {"layers": {"0": {"wqkv": {"kernel": jax.ShapeDtypeStruct((8, 4), jnp.float32)}}}}
  spec = sharding.tree_shardings(MESH_222, tree, table)["layers"]["0"]["wqkv"]["kernel"].spec
  assert spec == P("fsdp", "tensor")


def test_a_dimension_the_mesh_does_not_divide_names_the_parameter_and_the_field():
  with pytest.raises(sharding.MeshError, match=(
      r"config.mesh: layers.0.self_attn.k_proj.kernel has 64 along dimension 1, which "
      r"mesh.tensor=3 \(3 shards\) does not divide; choose sizes that divide 64")):
    sharding.check_divisible("layers.0.self_attn.k_proj.kernel", (128, 64), P("fsdp", "tensor"),
                             {"data": 1, "fsdp": 2, "tensor": 3})
  sharding.check_divisible("x", (128, 64), P("fsdp", "tensor"), {"data": 1, "fsdp": 2, "tensor": 4})


def test_qwen3_presets_split_over_eight_devices():
  """Every Qwen3 architecture's parameters and Adam state split on 8-way FSDP and on
  2 x 2 x 2 (vocab 151,936 = 8 x 18,992; widths multiples of 128)."""
  for name in ("qwen3_0p6b", "qwen3_8b"):
    cfg = architecture(name)
    _, params = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0))))
    state = jax.eval_shape(lambda p: step_lib.init_train_state(p, optax.adamw(1e-6)), params)
    for shape in ((1, 8, 1), (2, 2, 2)):
      mesh = AbstractMesh(shape, sharding.MESH_AXES)
      shardings = sharding.tree_shardings(mesh, state, family.param_axes())
      # Adam's moments split like their parameter: mu and nu of the embedding as the table.
      table = shardings.params["embed_tokens"]["embedding"].get_value().spec
      mu, nu = shardings.opt_state[0].mu, shardings.opt_state[0].nu
      assert mu["embed_tokens"]["embedding"].get_value().spec == table == P("tensor", "fsdp")
      down = nu["layers"]["mlp"]["down_proj"]["kernel"].get_value().spec
      assert down == P(None, "tensor", "fsdp")  # [L, F, D]: every layer split alike
      assert shardings.opt_state[0].count.spec == P()


def test_put_places_host_arrays_and_leaves_placed_ones_alone():
  mesh = sharding.make_mesh()
  rows = sharding.rows_sharding(mesh)
  placed = sharding.put({"a": np.arange(4), "b": np.ones((4, 2))}, rows)
  assert placed["a"].sharding == rows and placed["b"].sharding == rows
  np.testing.assert_array_equal(placed["a"], np.arange(4))
  again = sharding.put(placed, rows)
  assert again["a"] is placed["a"]  # already laid out: no copy
  assert sharding.put(placed, None) is placed


def test_constrain_is_a_no_op_without_a_mesh():
  x = jnp.arange(6.0).reshape(3, 2)
  assert sharding.constrain(x, ("batch", None)) is x
  assert sharding.ambient_batch_shards() == 1


@pytest.mark.parametrize("field,value,message", [
    ("mesh.data", 0, r"config.mesh.data: 0 must be a positive integer or -1"),
    ("mesh.tensor", -1, r"config.mesh.tensor: only one mesh axis may be -1"),
    ("model.remat", "full", r"config.model.remat: 'full'; known: none, layer"),
    ("model.arch", "qwen3_70b", r"config.model.arch: 'qwen3_70b'; known: qwen3_0p6b"),
])
def test_invalid_mesh_and_memory_fields_name_the_field(field, value, message):
  c = grpo.get_config()
  group, name = field.split(".")
  c[group][name] = value
  with pytest.raises(configuration.ConfigError, match=message):
    configuration.validate(c)


def test_rows_and_buffer_must_split_over_the_batch_shards():
  c = popo.get_config("smoke")  # 2 prompts x 2 rollouts = 4 rows; buffer of 32 groups
  configuration.check_mesh(c, None)
  configuration.check_mesh(c, AbstractMesh((2, 2, 1), sharding.MESH_AXES))  # 4 | 4, 4 | 32
  with pytest.raises(configuration.ConfigError, match=(
      r"config.rollout.batch_prompts: 2 prompts x 2 rollouts = 4 rows per step must be a "
      r"multiple of mesh data x fsdp = 8")):
    configuration.check_mesh(c, AbstractMesh((8, 1, 1), sharding.MESH_AXES))
  c.rollout.batch_prompts, c.replay.capacity = 4, 12
  with pytest.raises(configuration.ConfigError, match=(
      r"config.replay.capacity: 12 entries must be a multiple of mesh data x fsdp = 8")):
    configuration.check_mesh(c, AbstractMesh((2, 4, 1), sharding.MESH_AXES))


def test_the_slot_pool_must_split_over_the_batch_shards():
  c = grpo.get_config("smoke,partial")  # 2 prompts x 2 rollouts = 4 rows in flight
  configuration.check_mesh(c, AbstractMesh((2, 2, 1), sharding.MESH_AXES))  # 4 | 4
  c.rollout.slots = 6  # 3 groups of 2
  with pytest.raises(configuration.ConfigError, match=(
      r"config.rollout.slots: 6 rows in flight must be a multiple of mesh data x fsdp = 4")):
    configuration.check_mesh(c, AbstractMesh((2, 2, 1), sharding.MESH_AXES))
  configuration.check_mesh(c, AbstractMesh((2, 1, 2), sharding.MESH_AXES))  # 6 | 2


def test_real_model_presets_use_float32_master_weights_fsdp_and_remat():
  c = popo.get_config("qwen3_8b")
  assert (c.model.param_dtype, c.model.dtype, c.model.remat) == ("float32", "bfloat16", "layer")
  assert c.model.arch == "qwen3_8b"
  assert (c.mesh.data, c.mesh.fsdp, c.mesh.tensor) == (1, -1, 1)
  assert configuration.prox_pass(c) == "all"  # bf16 matmuls: pi_prox from the trainer's pass
