"""The attention switch (``model.attention``): ``blocked`` equals ``xla`` in every pass.

Kernel level: ``flash.flash_attention`` and its custom VJP against the dense ``attention`` at
several block sizes, with left padding and a query offset (forward <= 1e-5, gradients <= 1e-4,
float32, on every query that sees a key), also with a traced offset; no [X, S] array anywhere
in its gradient's jaxpr; its static schedules visit only the causally reachable blocks (read
back with NaN-poisoned blocks); the cache kernel against the dense one. The GPU decode kernel
(``decode_attention``, Pallas) in Pallas' interpreter against the dense one, reading no slot
past the filled blocks, per shard under a mesh of fake devices, and lowered to Triton for a
GPU (compiled and run only on one). The fused kernels against ``blocked`` on
every position (0 at padded ones): ``splash`` in Pallas' interpreter across several blocks,
the ``cudnn`` wrapper on JAX's reference kernel with left, right and both-sides padding and
with NaN where cuDNN's results are unspecified (cuDNN itself needs a GPU; bench/accelerator.py
runs it there). Model level: the per-row and the grouped shared-prompt log-prob passes and
their gradients, the remat'd pass, and the sampler, with ``blocked`` against ``xla`` on the
tiny Qwen3.
"""
import functools
import json
import os
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import configuration, errors
from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.generate.logprobs import completion_logprobs_and_entropy
from grpo_jax.models import attention as attn
from grpo_jax.models import decode_attention as decode_kernel
from grpo_jax.models import flash, from_pretrained, fused_attention
from tests import jaxpr_shapes

FWD, GRAD = 1e-5, 1e-4
N, X, S, KH, QH, W = 3, 13, 21, 2, 2, 8


def _inputs(seed=0, x=X, s=S):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (N, x, KH, QH, W))
  k = jax.random.normal(ks[1], (N, s, KH, W))
  v = jax.random.normal(ks[2], (N, s, KH, W))
  # Rows left padded 0, 3 and 7 key slots.
  key_mask = jnp.arange(s)[None] >= jnp.array([0, 3, 7])[:, None]
  return q, k, v, key_mask, ks[3]


def _max_err(a, b, seen_NxX):
  return float(jnp.max(jnp.abs(jnp.where(seen_NxX[:, :, None, None, None], a - b, 0.0))))


@pytest.mark.parametrize("block_q,block_k", [(4, 5), (13, 21), (1, 1), (8, 16), (64, 64)])
def test_flash_equals_dense_forward_and_gradients(block_q, block_k):
  q, k, v, key_mask, key = _inputs()
  offset = S - X  # queries are the last X slots (as a continuation after a prompt)
  mask = attn.causal_mask(key_mask, X, offset)
  seen = mask.any(-1)  # row 2's first query (slot 8) sees key 7 only; none sees nothing here
  dense = lambda q, k, v: attn.attention(q, k, v, mask)
  blocked = lambda q, k, v: flash.flash_attention(q, k, v, key_mask, offset, block_q=block_q,
                                                  block_k=block_k)
  assert _max_err(blocked(q, k, v), dense(q, k, v), seen) <= FWD
  cot = jax.random.normal(key, (N, X, KH, QH, W)) * seen[:, :, None, None, None]
  loss = lambda f: lambda *a: jnp.sum(f(*a) * cot)
  got = jax.jit(jax.grad(loss(blocked), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2)))(q, k, v)
  for g, w_ in zip(got, want):
    np.testing.assert_allclose(g, w_, atol=GRAD, rtol=0)


def test_flash_with_a_traced_offset_visits_every_pair_and_equals_dense():
  """No call site traces the offset; if one did, the schedule is every block pair (the mask
  alone skips) and the values and gradients are the same."""
  q, k, v, key_mask, key = _inputs()
  offset = S - X
  seen = attn.causal_mask(key_mask, X, offset).any(-1)
  cot = jax.random.normal(key, (N, X, KH, QH, W)) * seen[:, :, None, None, None]
  run = lambda f: jax.jit(jax.value_and_grad(lambda q, k, v, o: jnp.sum(f(q, k, v, o) * cot),
                                             argnums=(0, 1, 2)))(q, k, v, offset)
  got = run(lambda q, k, v, o: flash.flash_attention(q, k, v, key_mask, o, block_q=4,
                                                     block_k=5))
  want = run(lambda q, k, v, o: attn.attention(q, k, v, attn.causal_mask(key_mask, X, o)))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, w_ in zip(got[1], want[1]):
    np.testing.assert_allclose(g, w_, atol=GRAD, rtol=0)
  assert len(flash.block_pairs(None, 4, 5, 4, 5)[0]) == 20


def test_fully_masked_queries_give_zero_and_no_gradient():
  q, k, v, key_mask, _ = _inputs(x=S)
  out = flash.flash_attention(q, k, v, key_mask, 0, block_q=4, block_k=4)
  # Row 2 is left padded 7 slots: its first 7 queries see only padding.
  np.testing.assert_array_equal(out[2, :7], 0.0)
  dq = jax.grad(lambda q: jnp.sum(flash.flash_attention(q, k, v, key_mask, 0, block_q=4,
                                                        block_k=4)))(q)
  np.testing.assert_array_equal(dq[2, :7], 0.0)
  assert np.all(np.isfinite(dq))


def test_no_length_by_length_array_in_forward_or_backward():
  length, block = 96, 16  # a distinctive size: no other axis is 96
  q, k, v, key_mask, _ = _inputs(x=length, s=length)
  grad = jax.grad(lambda q, k, v: jnp.sum(flash.flash_attention(
      q, k, v, key_mask, 0, block_q=block, block_k=block)), argnums=(0, 1, 2))
  shapes = jaxpr_shapes.shapes(jax.make_jaxpr(grad)(q, k, v))
  assert shapes and not [s for s in shapes if s.count(length) >= 2]
  # The guard works: the dense kernel's gradient has [N, K, Q, 96, 96] scores.
  dense = jax.grad(lambda q: jnp.sum(attn.attention(q, k, v, attn.causal_mask(key_mask, length))))
  assert [s for s in jaxpr_shapes.shapes(jax.make_jaxpr(dense)(q)) if s.count(length) >= 2]


def _cache(k, v, key_mask, size):
  """KVCache's layout ([N, K, W, S] keys, [N, K, S, W] values) of ``size`` slots: the S given
  keys, zeros after (as ``KVCache.init`` leaves unwritten slots)."""
  pad = lambda a: jnp.pad(a, ((0, 0), (0, size - a.shape[1]), (0, 0), (0, 0)))
  return (jnp.transpose(pad(k), (0, 2, 3, 1)), jnp.transpose(pad(v), (0, 2, 1, 3)),
          jnp.pad(key_mask, ((0, 0), (0, size - key_mask.shape[1]))))


CACHE_CASES = [(0, 13, 8), (10, 1, 8), (20, 1, 8), (5, 4, 8), (15, 1, 8), (20, 1, 7), (38, 2, 7),
               (39, 1, 40)]


def _poisoned_past_filled(k_c, v_c, index, x, block):
  """The cache with every block past the queries' last one NaN (keys and values), and the slot
  they start from. Blocks of ``block`` slots: the queries' last slot index + x - 1 lies in
  block (index + x - 1) // block. A kernel that read one of them would return NaN (0 * NaN in
  the product with the values), as the dense kernel does."""
  nan_from = min(40, -(-(index + x) // block) * block)
  poison = lambda a, axis: jnp.where(
      jnp.expand_dims(jnp.arange(40) >= nan_from, [d for d in range(4) if d != axis]), np.nan, a)
  return poison(k_c, 3), poison(v_c, 2), nan_from


@pytest.mark.parametrize("index,x,block", CACHE_CASES)
def test_blocked_cache_kernel_equals_dense(index, x, block):
  """Prefills (X > 1) block by block, decode steps (X = 1) in one pass, both over every slot
  (unwritten ones masked). Blocks of 7 do not divide the 40 slots: the last one is read from
  slot 33 with 33..34 masked."""
  q, k, v, key_mask, _ = _inputs()
  q = q[:, :x]
  k_c, v_c, mask_c = _cache(k, v, key_mask, 40)
  dense = attn.cache_attention(q, k_c, v_c, mask_c, index, "xla")
  seen = attn.causal_mask(mask_c, x, index).any(-1)
  got = jax.jit(lambda q, i: attn.cache_attention(q, k_c, v_c, mask_c, i, "blocked",
                                                  block=block))(q, index)
  assert _max_err(got, dense, seen) <= FWD


# The Pallas GPU decode kernel in Pallas' interpreter: (index, block_k, dtype). 40 slots in
# blocks of 16 or 32 (a partial tail block, several splits), the query before, inside and at
# the end of the filled blocks.
PALLAS_CASES = [(3, 16, "float32"), (20, 16, "float32"), (39, 16, "float32"),
                (31, 32, "float32"), (26, 16, "bfloat16")]


@pytest.mark.parametrize("index,block,dtype", PALLAS_CASES)
def test_pallas_decode_equals_dense_and_reads_only_filled_blocks(index, block, dtype):
  """``decode_attention``'s kernel, interpreted, against the dense kernel: row 2 has a hole
  in its key mask (slots 9-10 False), which a [start, length) range could not express; the
  key mask is True past ``index`` (the kernel's causal bound alone must stop there); and every
  block past the filled ones is NaN (the loop never reads it)."""
  w, dt = 16, jnp.dtype(dtype)
  ks = jax.random.split(jax.random.key(7), 3)
  q = jax.random.normal(ks[0], (N, 1, KH, QH, w)).astype(dt)
  k_c = jax.random.normal(ks[1], (N, KH, w, 40)).astype(dt)
  v_c = jax.random.normal(ks[2], (N, KH, 40, w)).astype(dt)
  mask_c = (jnp.arange(40)[None] >= jnp.array([0, 3, 7])[:, None]).at[2, 9:11].set(False)
  dense = attn.cache_attention(q, k_c, v_c, mask_c, index, "xla")
  k_nan, v_nan, nan_from = _poisoned_past_filled(k_c, v_c, index, 1, block)
  if nan_from < 40:  # the guard sees: the dense kernel reads the NaN blocks
    assert not np.all(np.isfinite(attn.cache_attention(q, k_nan, v_nan, mask_c, index, "xla")))
  got = decode_kernel.decode_attention(q, k_nan, v_nan, mask_c, jnp.int32(index), block_k=block,
                                       interpret=True)
  assert got.shape == dense.shape and got.dtype == dense.dtype
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  # bf16: the two round the probabilities at different points (unnormalised / normalised).
  tol = FWD if dt == jnp.float32 else 2e-2
  seen = attn.causal_mask(mask_c, 1, index).any(-1)  # at index 3 row 2 sees no key (unused)
  assert _max_err(got.astype(jnp.float32), dense.astype(jnp.float32), seen) <= tol


@pytest.mark.parametrize("kernel", ["xla", "blocked", "pallas"])
def test_one_index_per_row_equals_each_rows_own_call(kernel):
  """A slot pool's decode step (``generate.pool``): each row at its own slot (indices 3, 20,
  39 of 40) gives what a call with that row's index alone gives it; the Pallas kernel
  (interpreted) reads each row up to its own index, every later block NaN."""
  w = 16
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (N, 1, KH, QH, w))
  k_c = jax.random.normal(ks[1], (N, KH, w, 40))
  v_c = jax.random.normal(ks[2], (N, KH, 40, w))
  mask_c = jnp.arange(40)[None] >= jnp.array([0, 3, 7])[:, None]
  index = jnp.array([3, 20, 39], jnp.int32)
  if kernel == "pallas":
    past = jnp.arange(40)[None, :] >= (index[:, None] // 16 + 1) * 16  # [N, S] blocks of 16
    k_c = jnp.where(past[:, None, None, :], np.nan, k_c)
    v_c = jnp.where(past[:, None, :, None], np.nan, v_c)
    call = lambda i: decode_kernel.decode_attention(q, k_c, v_c, mask_c, i, block_k=16,
                                                    interpret=True)
  else:
    call = lambda i: attn.cache_attention(q, k_c, v_c, mask_c, i, kernel)
  got = call(index)
  for row, i in enumerate(index):
    want = np.asarray(call(jnp.int32(i)))[row] if kernel != "pallas" else np.asarray(
        attn.cache_attention(q, jnp.nan_to_num(k_c), jnp.nan_to_num(v_c), mask_c, i, "xla"))[row]
    assert np.abs(np.asarray(got)[row] - want).max() <= FWD, row


@pytest.mark.parametrize("dtype,w,qh,size,block", [("bfloat16", 128, 2, 1056, 128),
                                                   ("float32", 64, 8, 300, 64)])
def test_pallas_decode_lowers_to_one_triton_kernel(dtype, w, qh, size, block):
  """The kernel's Triton lowering for a GPU, run on this machine (no GPU needed to lower):
  Triton's shape rules (power-of-2 tiles, dots of at least 16) hold at model-like shapes, and
  the step is one kernel call with no XLA loop. Compiling it to PTX and running it need a GPU
  (``test_pallas_decode_equals_blocked_on_gpu``)."""
  dt = jnp.dtype(dtype)
  args = (jax.ShapeDtypeStruct((4, 1, 2, qh, w), dt), jax.ShapeDtypeStruct((4, 2, w, size), dt),
          jax.ShapeDtypeStruct((4, 2, size, w), dt), jax.ShapeDtypeStruct((4, size), bool),
          jax.ShapeDtypeStruct((), jnp.int32))
  text = jax.jit(functools.partial(decode_kernel.decode_attention, block_k=block)).trace(
      *args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 1 and "stablehlo.while" not in text


_PALLAS_UNDER_A_MESH = """
import json, os, re
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from grpo_jax import sharding
from grpo_jax.models import attention as attn, decode_attention as decode_kernel
mesh = jax.make_mesh((2, 1, 2), sharding.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)
n, kh, qh, w, size, index = 4, 2, 2, 16, 40, 29
ks = jax.random.split(jax.random.key(9), 3)
q = jax.random.normal(ks[0], (n, 1, kh, qh, w))
k = jax.random.normal(ks[1], (n, kh, w, size))
v = jax.random.normal(ks[2], (n, kh, size, w))
mask = jnp.arange(size)[None] >= jnp.array([0, 3, 7, 1])[:, None]
specs = (P(sharding.BATCH_AXES, None, "tensor"), P(sharding.BATCH_AXES, "tensor"),
         P(sharding.BATCH_AXES, "tensor"), P(sharding.BATCH_AXES))
args = [jax.device_put(a, NamedSharding(mesh, sp)) for a, sp in zip((q, k, v, mask), specs)]
run = lambda interpret: jax.jit(sharding.use_mesh(
    lambda q, k, v, m, i: decode_kernel.decode_attention(q, k, v, m, i, block_k=16,
                                                         interpret=interpret), mesh))
got = run(True)(*args, jnp.int32(index))
want = attn.cache_attention(q, k, v, mask, index, "xla")
text = run(False).trace(*args, jnp.int32(index)).lower(lowering_platforms=("cuda",)).as_text()
calls = [line for line in text.splitlines() if "xla.gpu.triton" in line]
print(json.dumps({"err": float(jnp.max(jnp.abs(got - want))), "calls": len(calls),
                  "operands": re.findall(r"tensor<[0-9x]+x(?:f32|i32)>", calls[0].split("->")[0])}))
"""


def test_pallas_decode_runs_per_shard_under_a_mesh():
  """On 4 fake CPU devices (rows over data=2, key/value heads over tensor=2): interpreted, the
  kernel equals the dense one; lowered for a GPU, the one Triton call takes each device's own
  rows and heads (XLA cannot partition a Triton call: without ``shard_map`` it would be given
  the whole cache, gathered from every device at every token)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
  proc = subprocess.run([sys.executable, "-c", _PALLAS_UNDER_A_MESH], capture_output=True,
                        text=True, timeout=600, env=env, cwd=root)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got["err"] <= FWD and got["calls"] == 1, got
  # q [2 rows, 1 head, 16 padded query heads, W], keys [2, 1, W, 40], values, mask, lengths.
  assert got["operands"] == ["tensor<2x1x16x16xf32>", "tensor<2x1x16x40xf32>",
                             "tensor<2x1x40x16xf32>", "tensor<2x40xi32>", "tensor<2xi32>"], got


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Triton kernel needs a GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_decode_equals_blocked_on_gpu(dtype):
  """The compiled kernel against ``blocked`` at a model-like shape (several splits, a tail)."""
  dt = jnp.dtype(dtype)
  n, kh, qh, w, size = 4, 2, 4, 64, 1100
  ks = jax.random.split(jax.random.key(8), 3)
  q = jax.random.normal(ks[0], (n, 1, kh, qh, w)).astype(dt)
  k_c = jax.random.normal(ks[1], (n, kh, w, size)).astype(dt)
  v_c = jax.random.normal(ks[2], (n, kh, size, w)).astype(dt)
  mask_c = jnp.arange(size)[None] >= jnp.array([0, 5, 50, 300])[:, None]
  tol = FWD if dt == jnp.float32 else 2e-2
  for index in (400, 700, 1099):
    want = attn.cache_attention(q, k_c, v_c, mask_c, index, "blocked", block=128)
    got = jax.jit(decode_kernel.decode_attention)(q, k_c, v_c, mask_c, jnp.int32(index))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=0)


@pytest.mark.parametrize("name,x,keys,backend,want", [
    ("xla", 1, 4096, "gpu", "xla"), ("blocked", 1, 4096, "gpu", "blocked"),
    ("auto", 1, 4096, "gpu", "pallas"), ("cudnn", 1, 64, "gpu", "pallas"),
    ("auto", 7, 4096, "gpu", "blocked"), ("auto", 1, 4096, "tpu", "blocked"),
    ("splash", 1, 4096, "tpu", "blocked"), ("auto", 1, 4096, "cpu", "blocked"),
    ("auto", 1, 64, "cpu", "xla")])
def test_cache_kernel_per_backend(name, x, keys, backend, want):
  """A GPU's decode step takes the Pallas kernel (``blocked`` where it does not take the
  shape); nothing else reads only the filled blocks."""
  assert attn.cache_kernel(name, x, keys, backend) == want
  if want == "pallas":
    assert attn.cache_kernel(name, x, keys, backend, pallas=False) == "blocked"


def _grouped_inputs():
  b, g, p, t = 2, 3, 7, 9
  ks = jax.random.split(jax.random.key(3), 7)
  qp = jax.random.normal(ks[0], (b, p, KH, QH, W))
  kp, vp = (jax.random.normal(kk, (b, p, KH, W)) for kk in ks[1:3])
  qc = jax.random.normal(ks[3], (b * g, t, KH, QH, W))
  kc, vc = (jax.random.normal(kk, (b * g, t, KH, W)) for kk in ks[4:6])
  prompt_mask = jnp.arange(p)[None] >= jnp.array([0, 4])[:, None]
  return (qp, kp, vp, qc, kc, vc), prompt_mask, g, ks[6]


@pytest.mark.parametrize("impl", ["blocked", "splash"])
def test_grouped_attention_equals_xla(impl, monkeypatch):
  """Prompts and continuations, values and all six gradients; ``splash`` off a TPU runs in
  Pallas' interpreter (same kernel program, interpreted)."""
  if impl == "splash" and jax.default_backend() != "tpu":
    monkeypatch.setattr(fused_attention, "splash_attention",
                        functools.partial(fused_attention.splash_attention, interpret=True))
  arrays, prompt_mask, g, key = _grouped_inputs()
  run = lambda impl: lambda *a: attn.grouped_attention(*a, prompt_mask, g, 0, impl, 4)
  want, got = jax.jit(run("xla"))(*arrays), jax.jit(run(impl))(*arrays)
  seen_p = attn.causal_mask(prompt_mask, prompt_mask.shape[1]).any(-1)
  assert _max_err(got[0], want[0], seen_p) <= FWD
  assert _max_err(got[1], want[1], jnp.ones(got[1].shape[:2], bool)) <= FWD
  cots = [jax.random.normal(kk, o.shape) for kk, o in zip(jax.random.split(key), want)]
  cots[0] = cots[0] * seen_p[:, :, None, None, None]
  loss = lambda f: lambda *a: sum(jnp.sum(o * c) for o, c in zip(f(*a), cots))
  grads_want = jax.jit(jax.grad(loss(run("xla")), argnums=tuple(range(6))))(*arrays)
  grads_got = jax.jit(jax.grad(loss(run(impl)), argnums=tuple(range(6))))(*arrays)
  for a, b in zip(grads_got, grads_want):
    np.testing.assert_allclose(a, b, atol=GRAD, rtol=0)


# --- blocked attention's causal block skipping: which blocks each loop visits -----------------

# Two cases of (X queries at slot offset.., S keys, block_q, block_k), and which key blocks j
# each query block i visits (VISITED[i][j]): the forward's loop over key blocks runs 0 ..
# key_blocks_seen - 1, the backward's over query blocks first_query_block .. num_q - 1; both
# must give this table (a block pair is visited iff some query of block i may see a key of j).
LOOP_CASES = {
    # A continuation: 9 queries at slots 5..13 over 20 keys, blocks of 3 queries, 4 keys.
    # Query blocks: slots 5-7, 8-10, 11-13; their last slots 7, 10, 13 lie in key blocks
    # 7 // 4 = 1, 10 // 4 = 2, 13 // 4 = 3, so the forward visits 2, 3 and 4 key blocks; key
    # block 4 (slots 16-19, after every query) none. Backward: key block j's first slot 4j is
    # first seen by query 4j - 5, in query block (4j - 5) // 3 = -2, -1, 1, 2, 3 for j = 0..4
    # (clipped to 0 .. 3: key block 4's loop is empty).
    "offset": (5, 9, 20, 3, 4, [[1, 1, 0, 0, 0],
                                [1, 1, 1, 0, 0],
                                [1, 1, 1, 1, 0]]),
    # The per-row pass: 10 queries over their own 10 keys (offset 0), blocks of 2 queries, 5
    # keys. Last slots 1, 3, 5, 7, 9 -> key blocks 0, 0, 1, 1, 1: 1, 1, 2, 2, 2 visited.
    # Backward: key block j starts at slot 5j, first seen by query block 5j // 2 = 0, 2.
    "square": (0, 10, 10, 2, 5, [[1, 0],
                                 [1, 0],
                                 [1, 1],
                                 [1, 1],
                                 [1, 1]]),
}


@pytest.mark.parametrize("case", sorted(LOOP_CASES))
def test_loop_bounds_give_the_hand_worked_blocks(case):
  offset, x, s, block_q, block_k, visited = LOOP_CASES[case]
  num_q, num_k = x // block_q, s // block_k
  forward = [[int(j < flash.key_blocks_seen(offset, i * block_q, block_q, block_k, num_k))
              for j in range(num_k)] for i in range(num_q)]
  backward = [[int(i >= flash.first_query_block(offset, j * block_k, block_q, num_q))
               for j in range(num_k)] for i in range(num_q)]
  assert forward == visited and backward == visited


@pytest.mark.parametrize("case", sorted(LOOP_CASES))
def test_loops_visit_only_the_hand_worked_blocks(case):
  """The real loops of ``flash_attention``, not the helpers: key block j is poisoned with NaN
  and each query block's outputs (forward) or query gradients (backward) read back whether the
  loop visited (i, j). A visited block reaches the result even where every key of it is masked
  (probability 0 times a NaN value, or a zero score gradient times a NaN key, is NaN); a
  skipped one never does. Forward: NaN values (a masked NaN key is replaced by the mask's
  finite score). Backward: NaN keys (finite outputs and log-sum-exps where the forward cannot
  see block j, so only the backward's ds @ k reads them)."""
  offset, x, s, block_q, block_k, visited = LOOP_CASES[case]
  q, k, v, _, key = _inputs(x=x, s=s)
  # Left padding: the bounds do not depend on the key mask, and a visited block's masked keys
  # still reach the result (above).
  key_mask = jnp.arange(s)[None] >= jnp.array([0, 2, 5])[:, None]
  cot = jax.random.normal(key, q.shape)
  blocks = jnp.arange(s) // block_k
  attend = lambda q, k, v: flash.flash_attention(q, k, v, key_mask, offset, block_q=block_q,
                                                 block_k=block_k)
  poison = lambda a, j: jnp.where((blocks == j)[None, :, None, None], np.nan, a)
  fwd = jax.jit(lambda j: attend(q, k, poison(v, j)))
  bwd = jax.jit(lambda j: jax.vjp(lambda q: attend(q, poison(k, j), v), q)[1](cot)[0])
  per_query_block = lambda a: np.isnan(np.asarray(a)).reshape(N, -1, block_q, KH * QH * W).any(
      axis=(0, 2, 3))
  forward = np.stack([per_query_block(fwd(j)) for j in range(s // block_k)], axis=1)
  backward = np.stack([per_query_block(bwd(j)) for j in range(s // block_k)], axis=1)
  np.testing.assert_array_equal(forward, np.array(visited, bool), err_msg="forward")
  np.testing.assert_array_equal(backward, np.array(visited, bool), err_msg="backward")


# --- splash: the Pallas kernel in its interpreter, across several blocks ----------------------

# S -> the padded length (a multiple of 128) -> the splash block (the largest of 512, 256, 128
# that divides it: splash needs the block to divide the length).
SPLASH_BLOCKS = {100: (128, 128), 300: (384, 128), 600: (640, 128), 700: (768, 256),
                 1000: (1024, 512), 1100: (1152, 128), 1200: (1280, 256), 1500: (1536, 512)}


def test_splash_block_divides_the_padded_length():
  """The kernel ``splash_attention`` builds, read back: every block size of it, at lengths that
  are not multiples of 512 (the qwen3 presets' 256 + 1024 = 1280 among them)."""
  for s, (length, block) in SPLASH_BLOCKS.items():
    assert fused_attention.splash_length(s) == length
    build = fused_attention._splash_kernel  # pylint: disable=protected-access
    kernel, _ = build(1, length, interpret=True)
    sizes = kernel.kwargs["block_sizes"]
    got = {f: getattr(sizes, f) for f in ("block_q", "block_kv", "block_kv_compute",
                                          "block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute",
                                          "block_q_dq", "block_kv_dq")}
    assert set(got.values()) == {block}, (s, got)


def _splash_inputs(s, kh=1, qh=2, w=8):
  """Two rows of S positions: one left padded 5 slots, one padded 3 on the left and 7 on the
  right (splash's segment ids take any key mask; the real queries of both are compared)."""
  ks = jax.random.split(jax.random.key(s), 4)
  q = jax.random.normal(ks[0], (2, s, kh, qh, w))
  k, v = (jax.random.normal(kk, (2, s, kh, w)) for kk in ks[1:3])
  pos = jnp.arange(s)[None]
  key_mask = (pos >= jnp.array([5, 3])[:, None]) & (pos < jnp.array([s, s - 7])[:, None])
  return q, k, v, key_mask, jax.random.normal(ks[3], q.shape)


def _blocked_on_real_queries(q, k, v, key_mask):
  """``blocked`` with every non-real query's output 0: what the fused kernels return."""
  return jnp.where(key_mask[:, :, None, None, None],
                   flash.flash_attention(q, k, v, key_mask, 0, block_q=128, block_k=128), 0.0)


def _value_and_input_grads(f, args, cot):
  """(f(*args), and the gradients of sum(f(*args) * cot) in each of args), compiled."""
  def run(*args):
    out, vjp = jax.vjp(f, *args)
    return (out, *vjp(cot.astype(out.dtype)))
  return jax.jit(run)(*args)


def _splash(q, k, v, key_mask):
  return fused_attention.splash_attention(q, k, v, key_mask, interpret=True)


def test_splash_equals_blocked_across_several_blocks():
  """600 positions: padded to 640, five blocks of 128 (one block of 512 does not divide 640)."""
  q, k, v, key_mask, _ = _splash_inputs(600)
  got = jax.jit(_splash)(q, k, v, key_mask)
  want = _blocked_on_real_queries(q, k, v, key_mask)
  np.testing.assert_allclose(got, want, atol=FWD, rtol=0)
  np.testing.assert_array_equal(jnp.where(key_mask[:, :, None, None, None], 0.0, got), 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("s", [600, 1100, 1200])
def test_splash_gradients_equal_blocked_across_several_blocks(s):
  """Padded lengths 640, 1152, 1280 (blocks of 128, 128, 256): outputs and the three input
  gradients, every position (padded ones 0 in both)."""
  q, k, v, key_mask, cot = _splash_inputs(s)
  got = _value_and_input_grads(lambda *a: _splash(*a, key_mask), (q, k, v), cot)
  want = _value_and_input_grads(lambda *a: _blocked_on_real_queries(*a, key_mask), (q, k, v),
                                cot)
  for name, g, w_ in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(g, w_, atol=FWD if name == "out" else GRAD, rtol=0, err_msg=name)


# --- cuDNN: the wrapper on JAX's reference kernel here, cuDNN itself on a GPU -----------------

# Each row's real tokens: (first slot, count) of S = 21; the wrapper takes any contiguous run.
PADDINGS = {"left": ((0, 21), (3, 18), (7, 14)),
            "right": ((0, 21), (0, 15), (0, 9)),
            "both": ((2, 12), (6, 15), (0, 20))}


def _run_mask(runs, s=S):
  first, count = (jnp.array(a) for a in zip(*runs))
  pos = jnp.arange(s)[None]
  return (pos >= first[:, None]) & (pos < (first + count)[:, None])


def _check_cudnn_against_blocked(key_mask, dtype, implementation, tol):
  """``cudnn_attention`` against ``blocked`` with every non-real query zeroed: outputs and the
  q, k, v gradients of a random cotangent on every position (padded ones included: the
  wrapper's there must be exactly 0, outputs and gradients, and finite everywhere).

  ``tol``: the largest difference allowed, relative to the reference's largest magnitude (at
  least 1) per array.
  """
  q, k, v, _, key = _inputs(x=S)
  q, k, v = (a.astype(dtype) for a in (q, k, v))
  cot = jax.random.normal(key, q.shape, dtype)
  cudnn = lambda q, k, v: fused_attention.cudnn_attention(q, k, v, key_mask, implementation)
  blocked = lambda q, k, v: _blocked_on_real_queries(q, k, v, key_mask)
  got, want = (_value_and_input_grads(f, (q, k, v), cot) for f in (cudnn, blocked))
  pad_q = ~key_mask[:, :, None, None, None]
  pad_k = ~key_mask[:, :, None, None]
  names = ("out", "dq", "dk", "dv")
  for name, a, b, pad in zip(names, got, want, (pad_q, pad_q, pad_k, pad_k)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.all(np.isfinite(a)), name
    np.testing.assert_array_equal(np.where(pad, a, 0.0), 0.0, err_msg=f"{name} at padding")
    np.testing.assert_array_equal(np.where(pad, b, 0.0), 0.0, err_msg=f"blocked {name}")
    err, scale = np.max(np.abs(a - b)), max(1.0, np.max(np.abs(b)))
    assert err <= tol * scale, (name, err, scale)


@pytest.mark.parametrize("padding", sorted(PADDINGS))
def test_cudnn_call_on_the_reference_kernel_equals_blocked(padding):
  """Everything of ``cudnn_attention`` but cuDNN: each row's run of real tokens rolled to the
  front (cuDNN's right padding) and back, per-row lengths, grouped heads, run on
  ``jax.nn.dot_product_attention``'s xla implementation (float32 here)."""
  _check_cudnn_against_blocked(_run_mask(PADDINGS[padding]), jnp.float32, "xla", GRAD)


def _primitives(jaxpr) -> set[str]:
  """Every primitive of a jaxpr, nested ones included."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names |= _primitives(sub)
  return names


def test_the_cudnn_wrappers_roll_has_a_gather_for_its_gradient():
  """A roll is a permutation: its gradient is the inverse roll (rows 0, 2, 4 rolled by 0, 2, 4
  and back), a gather; autodiff of the gather would scatter-add the cotangent."""
  a = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5, 2)), jnp.float32)
  shift = jnp.asarray([0, 2, 4], jnp.int32)
  weights = jnp.arange(30.0).reshape(3, 5, 2)
  loss = lambda f: lambda a: jnp.sum(f(a, shift) * weights)
  grad = jax.grad(loss(fused_attention._roll_rows))
  np.testing.assert_array_equal(grad(a), jax.grad(loss(fused_attention._gather_roll))(a))
  # d/da of sum(roll(a) * w) = roll^-1(w): row n of w rolled back by shift[n].
  np.testing.assert_array_equal(grad(a)[1], np.roll(np.asarray(weights[1]), -2, axis=0))
  primitives = _primitives(jax.make_jaxpr(grad)(a).jaxpr)
  assert "gather" in primitives and not any(p.startswith("scatter") for p in primitives)


def test_cudnn_wrapper_zeroes_padded_positions_and_passes_lengths(monkeypatch):
  """cuDNN's outputs and input gradients at the rows past a row's lengths are not specified
  (the reference implementation zeroes them, cuDNN need not): here they are NaN, in both
  passes, and the wrapper's outputs and gradients must still be finite, 0 at padded positions
  and equal to ``blocked`` elsewhere. The lengths it passes are each row's count of real
  tokens, for queries (cuDNN skips the padded queries' work) and keys."""
  real_call = jax.nn.dot_product_attention
  calls = []

  def nan_past_lengths(a, lengths):
    if lengths is None:  # no lengths: every row computed
      return a
    return jnp.where((jnp.arange(a.shape[1])[None] < lengths[:, None])[:, :, None, None], a,
                     np.nan)

  def cudnn_like(q, k, v, *, query_seq_lengths=None, key_value_seq_lengths=None, **kwargs):
    calls.append((query_seq_lengths, key_value_seq_lengths))

    @jax.custom_vjp
    def call(q, k, v):
      return nan_past_lengths(real_call(q, k, v, query_seq_lengths=query_seq_lengths,
                                        key_value_seq_lengths=key_value_seq_lengths, **kwargs),
                              query_seq_lengths)

    def fwd(q, k, v):
      return jax.vjp(call.fun, q, k, v)

    def bwd(vjp, dout):
      dq, dk, dv = vjp(dout)
      return (nan_past_lengths(dq, query_seq_lengths),
              nan_past_lengths(dk, key_value_seq_lengths),
              nan_past_lengths(dv, key_value_seq_lengths))

    call.defvjp(fwd, bwd)
    return call(q, k, v)

  monkeypatch.setattr(jax.nn, "dot_product_attention", cudnn_like)
  key_mask = _run_mask(PADDINGS["both"])
  _check_cudnn_against_blocked(key_mask, jnp.float32, "xla", GRAD)
  calls.clear()
  q, k, v, _, _ = _inputs(x=S)
  fused_attention.cudnn_attention(q, k, v, key_mask, "xla")  # eagerly: the lengths concrete
  (lengths_q, lengths_k), = calls
  assert lengths_q is not None and lengths_k is not None
  np.testing.assert_array_equal(lengths_q, [12, 15, 20])
  np.testing.assert_array_equal(lengths_k, [12, 15, 20])


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN needs a GPU")
@pytest.mark.parametrize("padding", sorted(PADDINGS))
def test_cudnn_equals_blocked_on_gpu(padding):
  """cuDNN itself in bfloat16, outputs and gradients, every position. What values can and
  cannot show: a wrong roll (the run's offset) moves real outputs, and garbage cuDNN writes at
  padded rows would show as non-zero or NaN there. Dropping ``query_seq_lengths`` changes no
  value (the padded queries' outputs are zeroed after the call, and every padded key lies after
  every real query once the run is rolled to the front): the lengths are checked as passed in
  ``test_cudnn_wrapper_zeroes_padded_positions_and_passes_lengths``."""
  # bf16 (8 significant bits): the two kernels round probabilities and outputs differently;
  # 2% of the largest magnitude is ~5 bf16 steps at it.
  _check_cudnn_against_blocked(_run_mask(PADDINGS[padding]), jnp.bfloat16, "cudnn", 2e-2)


# --- the model: every pass with attention=blocked against attention=xla -----------------------

B, G, P, T = 2, 3, 6, 7


@pytest.fixture(scope="module")
def models(data_dir):
  path = os.fspath(data_dir / "tiny_qwen3")
  # Blocks of 4 queries / keys: several blocks per row, a partial one at the end.
  return {impl: from_pretrained(path, attention=impl, attention_block=4)
          for impl in ("xla", "blocked")}


@pytest.fixture(scope="module")
def batch():
  rng = np.random.RandomState(0)
  ids = jnp.asarray(np.repeat(rng.randint(6, 128, (B, P)), G, axis=0), jnp.int32)
  mask = jnp.asarray(np.repeat(np.arange(P)[None] >= np.array([[0], [3]]), G, axis=0))
  completions = jnp.asarray(rng.randint(6, 128, (B * G, T)), jnp.int32)
  return ids, mask, completions


@pytest.mark.parametrize("group,remat", [(1, False), (G, False), (G, True)])
def test_model_logprobs_and_gradients_blocked_equal_xla(models, batch, group, remat):
  ids, mask, completions = batch

  def loss_and_grad(model):
    graphdef, params = nnx.split(model)

    def loss(params):
      logp, ent = completion_logprobs_and_entropy(
          nnx.merge(graphdef, params), ids, mask, completions, remat=remat,
          prompt_group=group)
      return jnp.sum(logp) + 0.1 * jnp.sum(ent), logp

    (_, logp), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logp, grads

  logp_x, grads_x = loss_and_grad(models["xla"])
  logp_b, grads_b = loss_and_grad(models["blocked"])
  np.testing.assert_allclose(logp_b, logp_x, atol=FWD, rtol=0)
  flat_x = dict(nnx.to_flat_state(grads_x))
  for path, g in nnx.to_flat_state(grads_b):
    np.testing.assert_allclose(g[...], flat_x[path][...], atol=GRAD, rtol=0, err_msg=str(path))


def test_sampler_blocked_equals_xla(models, batch):
  ids, mask, _ = batch
  config = sampler_lib.SamplingConfig(max_new_tokens=T, eos_ids=(1,), pad_id=0, temperature=1.0,
                                      prompt_group=G)
  outs = {impl: sampler_lib.make_sampler(nnx.graphdef(m), config)(
      nnx.state(m), ids, mask, jax.random.key(5)) for impl, m in models.items()}
  np.testing.assert_array_equal(outs["blocked"].completion_ids, outs["xla"].completion_ids)
  np.testing.assert_allclose(outs["blocked"].behaviour_logp, outs["xla"].behaviour_logp,
                             atol=FWD, rtol=0)


def test_auto_picks_blocked_from_the_threshold_on_cpu():
  if jax.default_backend() != "cpu":
    pytest.skip("auto's CPU rule")
  assert attn.resolve("auto", attn.BLOCKED_FROM_KEYS - 1) == "xla"
  assert attn.resolve("auto", attn.BLOCKED_FROM_KEYS) == "blocked"
  assert attn.resolve("xla", 10 ** 6) == "xla"


def _config(**model):
  from configs import popo  # pylint: disable=g-import-not-at-top
  c = popo.get_config("smoke")
  c.model.update(model)
  return c


@pytest.mark.parametrize("field,value,says", [
    ("attention", "flash", "model.attention: 'flash'; known: auto, xla, blocked"),
    ("attention", "splash", "'splash' needs a TPU backend"),
    ("attention", "cudnn", "'cudnn' needs a GPU backend"),
    ("attention_block", 0, "model.attention_block: 0 must be >= 1"),
])
def test_bad_attention_config_is_one_line(field, value, says):
  if jax.default_backend() in ("gpu", "tpu") and value in ("cudnn", "splash"):
    pytest.skip("allowed on this backend")
  with pytest.raises(errors.ConfigError) as e:
    config = _config(**{field: value})
    configuration.validate(config)
    configuration.check_backend(config)  # the loop's check once the devices are up
  assert says in str(e.value) and "\n" not in str(e.value)


def test_a_run_with_blocked_attention_trains(tmp_path):
  """The whole loop under ``model.attention=blocked`` with a block that divides nothing (3):
  loading, sampling, the POPO step, evaluation and a checkpoint."""
  from grpo_jax import train  # pylint: disable=g-import-not-at-top
  from grpo_jax.run import metrics
  c = _config(attention="blocked", attention_block=3)
  c.total_steps, c.eval.every, c.checkpoint.every = 2, 2, 2
  c.eval.greedy = False
  train.train_and_evaluate(c, os.fspath(tmp_path))
  steps = [r for r in metrics.read_metrics(os.fspath(tmp_path)) if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2] and all(np.isfinite(r["loss"]) for r in steps)
