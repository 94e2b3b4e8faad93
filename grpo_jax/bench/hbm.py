"""A chip's memory: what JAX may allocate on it (``pools``), and the memory-bandwidth roofline
of decoding: peak HBM bandwidth per chip, bytes per token step.

A decode step feeds one token per row through the whole model: every weight is read once for
the N rows together, and each row's keys and values are read for every filled cache slot. At
the rows RL samples (hundreds) that is a few FLOPs per byte, far under a GPU's or TPU's ridge
(an H200: about 206 bf16 FLOP per byte), so the sampler is bound by memory bandwidth, and its
figure of merit is the bytes it must move per second against the chip's bandwidth, not its
FLOP utilisation (``bench.peak`` is for the compute-bound train step).

No JAX here: the accelerator check's parent process imports this without touching a device.
"""

from __future__ import annotations

import os

# Peak HBM bandwidth in bytes/s by device-kind substring (``jax.Device.device_kind``), first
# match wins, so the more specific names come first. Vendor datasheets (decimal units):
#   NVIDIA H100 Tensor Core GPU datasheet: SXM 3.35 TB/s, PCIe 2 TB/s, NVL 3.9 TB/s.
#   NVIDIA H200 Tensor Core GPU datasheet: 4.8 TB/s (SXM and NVL).
#   NVIDIA A100 Tensor Core GPU datasheet: 80GB SXM 2,039 GB/s, 80GB PCIe 1,935 GB/s,
#     40GB 1,555 GB/s.
#   Google Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e):
#     v4 1,200 GBps, v5e 819 GBps, v5p 2,765 GBps, v6e 1,638 GBps per chip.
# A GH200 names "H200" in its kind but comes with HBM3 (4 TB/s) or HBM3e (4.9 TB/s): unknown.
HBM_BYTES_PER_S = (
    ("GH200", None),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),
    ("H200", 4.8e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100-PCIE-80GB", 1.935e12),
    ("A100", 1.555e12),
    ("TPU v4", 1.2e12),
    ("TPU v5 lite", 819e9),
    ("TPU v5e", 819e9),
    ("TPU v5p", 2.765e12),
    ("TPU v5", 2.765e12),
    ("TPU v6 lite", 1.638e12),
    ("TPU v6e", 1.638e12),
)

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def hbm_bandwidth(device_kind: str) -> float | None:
  """The datasheet's peak HBM bytes/s of ``device_kind``; None for CPUs and unknown chips."""
  for kind, bandwidth in HBM_BYTES_PER_S:
    if kind.lower() in device_kind.lower():
      return bandwidth
  return None


def decode_bytes(config, rows: int, prompt_len: int, completion_len: int) -> dict:
  """The fewest bytes the sampler's T - 1 decode steps must move through device memory.

  Decode step t (t = 1 .. T - 1) feeds token t - 1 of each of the N rows and attends to the
  P + t filled cache slots (a prompt of P real tokens). With b bytes per element of the compute
  dtype (the sampler casts the weights to it once, before the loop), L layers, K key/value heads
  of width W:

      weights  = b * (num_params - (V * D if the embedding is not tied else 0))
      kv_slot  = 2 * L * K * W * b                  (one slot's keys and values, one row)
      step t   = weights + N * kv_slot * (P + t)    (cache read)  + N * kv_slot  (cache write)
      total    = (T - 1) * (weights + N * kv_slot)
                 + N * kv_slot * ((T - 1) * P + T * (T - 1) / 2)

  Every weight is read once per step (the LM head's V x D included; an untied input
  embedding only at N rows, not counted). Not counted either: activations ([N, D] per layer),
  the float32 logits [N, V] the sampling writes and reads (2 * 4 * N * V bytes per step, 0.6 GB
  at N = 512 for Qwen3's vocabulary), the cache slots past the filled ones that a kernel may
  read anyway (``xla`` reads all P + T), and the prefill. So total / seconds of the whole
  sampler call is a lower bound on the bandwidth it reached.

  Args:
    config: a ``ModelConfig`` (num_params, vocab_size, hidden_size, num_layers, num_kv_heads,
      head_dim, tie_word_embeddings, dtype).
    rows: N.
    prompt_len: P.
    completion_len: T.

  Returns:
    {"weights_per_step", "kv_slot_per_row", "kv_read", "kv_write", "total", "per_step"}: bytes
    (``per_step`` = total / (T - 1); 0 when T = 1).
  """
  b = DTYPE_BYTES[config.dtype]
  untied_embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
  weights = b * (config.num_params - untied_embedding)
  kv_slot = 2 * config.num_layers * config.num_kv_heads * config.head_dim * b
  n, p, t = rows, prompt_len, completion_len
  steps = t - 1
  kv_read = n * kv_slot * (steps * p + t * (t - 1) // 2)
  kv_write = n * kv_slot * steps
  total = steps * weights + kv_read + kv_write
  return {"weights_per_step": weights, "kv_slot_per_row": kv_slot, "kv_read": kv_read,
          "kv_write": kv_write, "total": total, "per_step": total / steps if steps else 0.0}


# Memory per chip (GiB): an H100's 80 GB as CUDA reports it (81,559 MiB), an H200's 141 GB
# (143,771 MiB), a TPU v5e's 16 GiB.
CHIPS = {"H100 80GB": 81_559 / 1024, "H200 141GB": 143_771 / 1024, "v5e 16GiB": 16.0}
GPU_CHIPS = ("H100 80GB", "H200 141GB")
# JAX's share of a GPU when neither XLA_CLIENT_MEM_FRACTION nor its older name
# XLA_PYTHON_CLIENT_MEM_FRACTION is set (docs.jax.dev: GPU memory allocation); on a TPU it
# takes the whole chip.
DEFAULT_GPU_FRACTION = 0.75


def gpu_memory_fraction(environ=None) -> float:
  """The share of a GPU's memory JAX's allocator gets: ``XLA_CLIENT_MEM_FRACTION`` (or the
  deprecated ``XLA_PYTHON_CLIENT_MEM_FRACTION``) as this process's environment sets it for
  the run being judged, else JAX's default 0.75."""
  env = os.environ if environ is None else environ
  value = env.get("XLA_CLIENT_MEM_FRACTION") or env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
  return float(value) if value else DEFAULT_GPU_FRACTION


def pools(fraction: float | None = None) -> dict[str, float]:
  """GiB JAX can allocate on each chip of ``CHIPS``: a GPU's memory times ``fraction``
  (default ``gpu_memory_fraction()``), a TPU's whole memory. "Fits" is judged against these,
  not the chip: at JAX's default a 141 GB H200 gives a process 105 GiB."""
  fraction = gpu_memory_fraction() if fraction is None else fraction
  return {chip: gib * fraction if chip in GPU_CHIPS else gib for chip, gib in CHIPS.items()}
