"""What a run does differently for an accelerator, checked on the CPU: the one-line note on a
float32 run, and the KL reference kept in the compute dtype at no cost in its values."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import grpo
from grpo_jax import configuration
from grpo_jax.generate.logprobs import completion_logprobs
from grpo_jax.models import from_pretrained
from grpo_jax.run import build

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@pytest.mark.parametrize("backend,dtype,noted", [
    ("gpu", "float32", True), ("tpu", "float32", True), ("gpu", "bfloat16", False),
    ("cpu", "float32", False)])
def test_a_float32_run_on_an_accelerator_is_noted_in_one_line(backend, dtype, noted):
  c = grpo.get_config("smoke")
  c.model.dtype = dtype
  notes = configuration.backend_notes(c, backend)
  assert len(notes) == int(noted)
  if noted:
    assert "\n" not in notes[0] and f"model.dtype=float32 on a {backend.upper()}" in notes[0]
    assert "--config.model.dtype=bfloat16" in notes[0]


def test_the_reference_in_the_compute_dtype_computes_what_a_float32_copy_does():
  """float32 master weights, bfloat16 matmuls: every layer casts its weights to bfloat16
  where it uses them, so a reference stored in bfloat16 (half the bytes) gives bit for bit the
  log-probs of a float32 copy."""
  model = from_pretrained(os.path.join(DATA, "tiny_qwen3"), param_dtype="float32",
                          dtype="bfloat16")
  graphdef, params = nnx.split(model)
  ref = build.frozen_reference(params, "bfloat16")
  dtypes = {x.dtype for x in jax.tree.leaves(ref)}
  assert dtypes == {jnp.dtype(jnp.bfloat16)}
  assert sum(x.nbytes for x in jax.tree.leaves(ref)) * 2 == sum(
      x.nbytes for x in jax.tree.leaves(params))
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(1, 128, (2, 5)), jnp.int32)
  mask = jnp.asarray([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], bool)
  completions = jnp.asarray(rng.integers(1, 128, (2, 4)), jnp.int32)
  logp = lambda p: completion_logprobs(nnx.merge(graphdef, p), prompts, mask, completions)
  np.testing.assert_array_equal(np.asarray(logp(ref)), np.asarray(logp(params)))
