"""The processes of a multi-host run: joining them (``jax.distributed``) and which one writes.

On TPU pod slices and multi-node GPU jobs a JAX program is one process per host; every process
runs the same loop, ``initialize`` joins them into one runtime before anything touches a device,
and process 0 alone prints and writes the run's files (``is_primary``). docs/scaling.md,
"Multi-host", says what each host computes.
"""

from __future__ import annotations

import os

import jax


def initialize(mesh_config) -> bool:
  """Calls ``jax.distributed.initialize`` when the config or the environment asks for it.

  Asked by ``config.mesh.distributed = True`` or by ``JAX_COORDINATOR_ADDRESS`` in the
  environment. The coordinator address, process count and process id come from
  ``config.mesh.coordinator_address / num_processes / process_id`` when set, else from JAX's
  cluster auto-detection (Cloud TPU, SLURM, Open MPI, Kubernetes). Must run before anything
  touches a device; a second call is a no-op.

  Returns:
    True when this process is part of a multi-process run.
  """
  asked = bool(mesh_config.get("distributed", False)) or "JAX_COORDINATOR_ADDRESS" in os.environ
  if not asked:
    return False
  if not jax.distributed.is_initialized():
    kw = {}
    if mesh_config.get("coordinator_address"):
      kw["coordinator_address"] = mesh_config.coordinator_address
    if mesh_config.get("num_processes", 0) > 0:
      kw["num_processes"] = int(mesh_config.num_processes)
    if mesh_config.get("process_id", -1) >= 0:
      kw["process_id"] = int(mesh_config.process_id)
    jax.distributed.initialize(**kw)
  return jax.process_count() > 1


def is_primary() -> bool:
  """True on process 0, the one process that writes metrics, logs and reports."""
  return jax.process_index() == 0
