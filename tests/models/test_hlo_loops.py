"""Loops whose trip count is a traced value, counted in the compiled (optimised) HLO.

XLA:GPU runs such a ``while`` by copying its predicate to the host and waiting, at every
iteration; a loop whose trip count XLA knows (``known_trip_count`` in its backend config, set by
XLA's trip-count analysis for a ``lax.scan`` or a ``fori_loop`` with static bounds) runs with no
such copy. The compiled train step must have none, whatever the attention kernel (causal block
skipping is a static schedule of block pairs, ``models/flash.py``); the sampler at most one,
its decode loop, which stops when every row has emitted EOS (the cache passes read every slot
or, on a GPU, run one Pallas kernel: ``attention.cache_kernel``). Compiled on the CPU at tiny
shapes for every kernel that runs here: ``xla``, ``blocked`` and ``auto`` (on a CPU one of the
two; ``cudnn`` and ``splash`` need their accelerators)."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.models import attention as attn, from_pretrained
from grpo_jax.rl import step as step_lib
from grpo_jax.rl.replay import init_replay
from grpo_jax.rl.step_config import StepConfig
from grpo_jax.types import Rollout

# test_step.py's shapes. Blocks of 2 queries / keys: the prompt's 5 tokens are 3 query blocks,
# the continuation's 6 queries (offset 5) over 11 keys 3 query blocks x 6 key blocks, so the
# schedules skip blocks in the per-row pass and in both parts of the grouped pass.
B, G, P, T = 2, 4, 5, 6
BLOCK = 2
# An HLO instruction whose opcode is ``while``: "%name = <shape> while(<operands>), ...".
_WHILE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\swhile\(")


def data_dependent_loops(hlo_text: str) -> tuple[int, list[str]]:
  """(number of ``while`` instructions, those without a known trip count) in HLO text as
  ``compiled.as_text()`` prints it: XLA writes a known one into the loop's backend config,
  ``backend_config={..."known_trip_count":{"n":"8"}}``."""
  loops = [line.strip() for line in hlo_text.splitlines() if _WHILE.match(line)]
  return len(loops), [line for line in loops if '"known_trip_count"' not in line]


def test_counter_sees_loops_with_traced_and_static_trip_counts():
  def f(x, n):
    traced = jax.lax.fori_loop(0, n, lambda i, c: c * 2.0 + i, x)
    static = jax.lax.fori_loop(0, 7, lambda i, c: c * 3.0 + i, x)
    until = jax.lax.while_loop(lambda c: c[0] < 100.0, lambda c: c * 2.0, x)
    return traced + static + until

  total, unknown = data_dependent_loops(jax.jit(f).lower(jnp.ones(3), 5).compile().as_text())
  assert total == 3 and len(unknown) == 2
  static_only = lambda x: jax.lax.fori_loop(0, 7, lambda i, c: c * 3.0 + i, x)
  total, unknown = data_dependent_loops(jax.jit(static_only).lower(jnp.ones(3)).compile()
                                        .as_text())
  assert total == 1 and not unknown


@pytest.fixture(scope="module")
def models(split, data_dir):
  """graphdef and params per kernel: ``xla`` is the tiny Qwen3 as test_step.py compiles it
  (``auto`` at these lengths), ``blocked`` with blocks of ``BLOCK``."""
  path = os.fspath(data_dir / "tiny_qwen3")
  return {"xla": split,
          "blocked": nnx.split(from_pretrained(path, attention="blocked", attention_block=BLOCK))}


def _rollout():
  """B * G rows (group-major, every group one prompt, so the grouped pass runs) of random
  tokens; the step is only compiled, never run."""
  rng = np.random.RandomState(0)
  n = B * G
  ids = jnp.asarray(np.repeat(rng.randint(6, 128, (B, P)), G, axis=0), jnp.int32)
  return Rollout(prompt_ids=ids, prompt_mask=jnp.ones((n, P), bool),
                 completion_ids=jnp.asarray(rng.randint(6, 128, (n, T)), jnp.int32),
                 completion_mask=jnp.ones((n, T), bool), behaviour_logp=jnp.zeros((n, T)),
                 scores=jnp.asarray([1, 0, 0, 1, 0, 1, 0, 0], jnp.float32),
                 truncated=jnp.zeros(n, bool), success=jnp.zeros(n, bool),
                 prompt_id=jnp.repeat(jnp.arange(B), G), version=jnp.zeros((n, T), jnp.int32))


def _train_step_hlo(graphdef, params) -> str:
  tx = optax.adam(1e-3)
  fn = step_lib.make_train_step(graphdef, tx, StepConfig(group_size=G,
                                                                  num_minibatches=2))
  args = (step_lib.init_train_state(params, tx), init_replay(0, G, P, T), _rollout(), None,
          jax.random.key(0))
  return fn.lower(*args).compile().as_text()


@pytest.mark.parametrize("impl", ["xla", "blocked", "auto"])
def test_train_step_has_no_data_dependent_loop(models, impl, monkeypatch):
  """The whole train step (the no-grad passes' per-row and grouped passes under their device
  check, the update's forward and backward). ``auto`` with its CPU threshold at 0 keys: the
  ``blocked`` kernel, as ``auto`` runs it on a CPU from 1,024 key slots on."""
  if impl == "auto":
    monkeypatch.setattr(attn, "BLOCKED_FROM_KEYS", 0)
    graphdef, params = models["blocked"]
  else:
    graphdef, params = models[impl]
  total, unknown = data_dependent_loops(_train_step_hlo(graphdef, params))
  assert total > 0  # the update scan at least: the counter read the program
  assert not unknown, "\n".join(line[:300] for line in unknown)


@pytest.mark.parametrize("impl", ["xla", "blocked", "auto"])
def test_sampler_has_one_data_dependent_loop(models, impl, monkeypatch):
  """The decode loop, and nothing inside it: with ``prompt_group`` the shared prefill and the
  per-row one (under their device check) both compiled; the cache passes of every layer.
  ``auto`` with its CPU threshold at 0 keys, as in the train step's test."""
  if impl == "auto":
    monkeypatch.setattr(attn, "BLOCKED_FROM_KEYS", 0)
  graphdef, params = models["blocked" if impl == "auto" else impl]
  config = sampler_lib.SamplingConfig(max_new_tokens=T, eos_ids=(5,), pad_id=0, prompt_group=G)
  ids = _rollout().prompt_ids
  hlo = sampler_lib.make_sampler(graphdef, config).lower(
      params, ids, jnp.ones(ids.shape, bool), jax.random.key(0)).compile().as_text()
  _, unknown = data_dependent_loops(hlo)
  assert len(unknown) <= 1, "\n".join(line[:300] for line in unknown)
