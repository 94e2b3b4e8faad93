"""Parameters from the training mesh to the generation mesh, device to device.

``jax.device_put`` between two meshes on disjoint devices copies device to device only when
the target layout is the source's on as many devices (the same mesh shape and partition
spec); any other change of layout goes through the host (``jax.transfer_guard`` calls it a
host-to-device transfer). ``Transfer`` therefore moves a parameter tree in up to three
on-device stages, under a guard that raises on any host transfer:

1. cast to the generation's compute dtype on the training mesh (the sampler computes in it
   anyway, so the values generated from are the same; half the bytes under bfloat16), and,
   when the meshes' shapes differ, replicated over the training mesh (an all-gather there);
2. copied device to device: shard for shard onto the generation mesh when the shapes match,
   else one device's full copy onto each generation device;
3. laid out by the generation mesh's own rules (a jitted reshard there; from a replicated copy
   each device keeps its slice, nothing is communicated).

When the shapes differ, stage 1 holds a full copy of the (compute-dtype) parameters on every
training device for the length of the copy; under LoRA only the adapters are sent
(``generate.asynchronous``), so the copy is small.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


def _cast(dtype, x):
  return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x


class Transfer:
  """``transfer(tree)``: ``tree`` (laid out by ``src``) on ``dst``'s layout, device to device.

  Args:
    src: NamedShardings of the tree on the training mesh (by leaf).
    dst: NamedShardings of the tree on the generation mesh (same structure).
    dtype: the compute dtype floating leaves are sent in.
  """

  def __init__(self, src, dst, dtype):
    leaves_src, self._treedef = jax.tree.flatten(src)
    leaves_dst = self._treedef.flatten_up_to(dst)
    src_mesh, dst_mesh = leaves_src[0].mesh, leaves_dst[0].mesh
    self._same_shape = (src_mesh.axis_names == dst_mesh.axis_names
                        and src_mesh.devices.shape == dst_mesh.devices.shape)
    if self._same_shape:  # shard for shard: the source's spec on the generation devices
      staged = [src.spec for src in leaves_src]
      mid_src = leaves_src
    else:  # one full copy per generation device
      staged = [PartitionSpec()] * len(leaves_src)
      mid_src = [NamedSharding(src_mesh, PartitionSpec())] * len(leaves_src)
    self._staged = [NamedSharding(dst_mesh, spec) for spec in staged]
    self._dst_mesh = dst_mesh
    self._prepare = jax.jit(functools.partial(jax.tree.map, functools.partial(_cast, dtype)),
                            out_shardings=mid_src)
    self._layout = jax.jit(lambda leaves: leaves, out_shardings=leaves_dst)
    self._needs_layout = any(a != b for a, b in zip(self._staged, leaves_dst))

  def __call__(self, tree):
    leaves = self._treedef.flatten_up_to(tree)
    with jax.transfer_guard_device_to_host("disallow_explicit"), \
        jax.transfer_guard_host_to_device("disallow_explicit"):
      ready = self._prepare(leaves)
      moved = [self._copy(x, s) for x, s in zip(ready, self._staged)]
      if self._needs_layout:
        moved = self._layout(moved)
    return self._treedef.unflatten(moved)

  def _copy(self, x: jax.Array, staged: NamedSharding) -> jax.Array:
    if self._same_shape:
      return jax.device_put(x, staged)
    one = x.addressable_shards[0].data  # the full value on one training device
    copies = [jax.device_put(one, d) for d in self._dst_mesh.devices.flat]
    return jax.make_array_from_single_device_arrays(x.shape, staged, copies)
