"""Peak matmul throughput, the denominator of utilisation: a chip's specification or a GEMM.

``gemm_peak(dtype)`` is the specification of the chip JAX runs on when ``CHIP_PEAKS`` knows it
(dense, no sparsity), else (CPUs, unknown chips, dtypes without an entry) a measurement in
this process: the median time of a jitted ``jnp.dot`` of two size x size matrices after a
warm-up call. A measured peak is what ``jnp.dot`` reaches here, not the silicon's limit, so a
utilisation against it says how far a phase is from the best this process does at one large
GEMM.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

# Dense peak FLOP/s by device-kind substring (first match wins, so the more specific names
# come first) and matmul input type. NVIDIA: SXM parts (a PCIe or NVL part matches nothing and
# is measured). "float32" is the CUDA-core rate, "tensorfloat32" the TF32 tensor-core rate: JAX's
# default matmul precision computes float32 dots in TF32 on Ampere and Hopper GPUs (JAX
# documentation, "Matmul precision"), so that is the float32 peak unless
# ``jax_default_matmul_precision`` asks for full float32. TPU: bfloat16 only (float32 matmuls
# are measured).
CHIP_PEAKS = (
    ("H100 PCIe", {}),
    ("H100 NVL", {}),
    ("H100", {"bfloat16": 989e12, "tensorfloat32": 494.7e12, "float32": 67e12}),
    ("H200", {"bfloat16": 989e12, "tensorfloat32": 494.7e12, "float32": 67e12}),
    ("A100", {"bfloat16": 312e12, "tensorfloat32": 156e12, "float32": 19.5e12}),
    ("TPU v4", {"bfloat16": 275e12}),
    ("TPU v5 lite", {"bfloat16": 197e12}),
    ("TPU v5e", {"bfloat16": 197e12}),
    ("TPU v5p", {"bfloat16": 459e12}),
    ("TPU v5", {"bfloat16": 459e12}),
    ("TPU v6 lite", {"bfloat16": 918e12}),
    ("TPU v6e", {"bfloat16": 918e12}),
)
_FULL_FLOAT32 = ("highest", "float32", "f32_f32_f32")


def chip_peak(device_kind: str, dtype: str, matmul_precision: str | None = None) -> float | None:
  """The specification's dense peak FLOP/s of a chip, or None when ``CHIP_PEAKS`` has no entry.

  Args:
    device_kind: ``jax.Device.device_kind``, e.g. "NVIDIA H100 80GB HBM3", "TPU v5 lite".
    dtype: the dtype the matmuls compute in.
    matmul_precision: ``jax_default_matmul_precision`` (None: JAX's default, TF32 for float32
      on GPUs that have it).

  Returns:
    FLOP/s, or None.
  """
  name = jnp.dtype(dtype).name
  for kind, peaks in CHIP_PEAKS:
    if kind.lower() in device_kind.lower():
      if name == "float32" and str(matmul_precision).lower() not in _FULL_FLOAT32:
        return peaks.get("tensorfloat32", peaks.get(name))
      return peaks.get(name)
  return None


def measure_gemm(dtype: str, size: int = 2048, repeats: int = 5) -> float:
  """FLOP/s of a jitted ``jnp.dot`` of two [size, size] matrices in ``dtype`` on the default
  device: 2 * size^3 over the median of ``repeats`` timed calls after one warm-up call."""
  dot = jax.jit(jnp.dot)
  k1, k2 = jax.random.split(jax.random.key(0))
  a_SxS = jax.random.normal(k1, (size, size), jnp.dtype(dtype))
  b_SxS = jax.random.normal(k2, (size, size), jnp.dtype(dtype))
  jax.block_until_ready(dot(a_SxS, b_SxS))
  seconds = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(dot(a_SxS, b_SxS))
    seconds.append(time.perf_counter() - t0)
  return 2.0 * size ** 3 / float(np.median(seconds))


def gemm_peak(dtype: str, size: int = 2048, repeats: int = 5) -> float:
  """Peak FLOP/s in ``dtype`` on the default device (see the module docstring).

  Args:
    dtype: "float32" or "bfloat16" (any jnp dtype name).
    size: matrix side of the measured GEMM.
    repeats: timed calls of the measured GEMM (the median is taken).

  Returns:
    The chip's specification on a non-CPU backend when known, else the measured FLOP/s.
  """
  return peak_and_source(dtype, size, repeats)[0]


def peak_and_source(dtype: str, size: int = 2048, repeats: int = 5) -> tuple[float, str]:
  """(``gemm_peak``'s FLOP/s, "spec" or "measured")."""
  if jax.default_backend() != "cpu":
    spec = chip_peak(jax.devices()[0].device_kind, dtype,
                     jax.config.jax_default_matmul_precision)
    if spec is not None:
      return spec, "spec"
  return measure_gemm(dtype, size, repeats), "measured"
