"""Sharded vs single-device computations on 8 fake CPU devices, as numbers for a test to judge.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/multidevice_checks.py OUT

JAX fixes its device count when it starts, and the pytest process has started it with one CPU
device, so ``tests/test_multidevice.py`` runs this file in a fresh process (which sets the flag
itself before importing JAX) and asserts on the JSON it writes to OUT. Nothing here asserts:
every check reports the measured differences and layouts, and the test states what they must be
and why. Shapes are tiny (the embedded 1M-parameter model, 8 rows of 12 + 8 tokens).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
import tempfile
import time

if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")
  os.environ["JAX_PLATFORMS"] = "cpu"  # the 8 devices are fake CPU ones, on any machine

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from grpo_jax import assets  # noqa: E402
from grpo_jax import sharding  # noqa: E402
from grpo_jax.generate import producer as producer_lib  # noqa: E402
from grpo_jax.generate import sampler as sampler_lib  # noqa: E402
from grpo_jax.models import family, from_pretrained, hf, lora  # noqa: E402
from grpo_jax.rl import losses, step as step_lib  # noqa: E402
from grpo_jax.rl.replay import init_replay, popo  # noqa: E402
from grpo_jax.rl.step_config import StepConfig  # noqa: E402
from grpo_jax.run import checkpoint as checkpoint_lib  # noqa: E402
from grpo_jax.types import Rollout  # noqa: E402

B, G, P, T = 2, 4, 12, 8
N = B * G
MESH = sharding.MeshConfig(data=2, fsdp=2, tensor=2)
OTHER_MESH = sharding.MeshConfig(data=1, fsdp=2, tensor=4)
SAMPLING = sampler_lib.SamplingConfig(max_new_tokens=T, eos_ids=(5,), pad_id=0)
# Two steps: both groups effective (POPO stores both), then group 0 constant (POPO refills it).
SCORES = ([1, 0, 0, 1, 0, 1, 0, 0], [1, 1, 1, 1, 0, 1, 0, 0])


def max_abs_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def specs(tree) -> dict:
  """{path: partition spec} of a pytree of sharded arrays."""
  return {jax.tree_util.keystr(p): str(x.sharding.spec)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@contextlib.contextmanager
def recorded_reads(reads: dict):
  """Records the shape of every block ``from_pretrained`` reads, and the stored tensor's
  shape, per tensor name."""
  real = hf._safetensors  # pylint: disable=protected-access

  class Slice:

    def __init__(self, name, inner):
      self.name, self.inner = name, inner

    def get_shape(self):
      return self.inner.get_shape()

    def __getitem__(self, index):
      block = self.inner[index]
      entry = reads.setdefault(self.name, {"shape": list(self.get_shape()), "blocks": []})
      entry["blocks"].append(list(block.shape))
      return block

  class File:

    def __init__(self, inner):
      self.inner = inner

    def keys(self):
      return self.inner.keys()

    def get_slice(self, name):
      return Slice(name, self.inner.get_slice(name))

  @contextlib.contextmanager
  def spy(file):
    with real(file) as f:
      yield File(f)

  hf._safetensors = spy  # pylint: disable=protected-access
  try:
    yield
  finally:
    hf._safetensors = real  # pylint: disable=protected-access


@contextlib.contextmanager
def optimised():
  """Programs jitted inside compile at XLA:CPU's usual back-end level (2), not the suite's -O0.

  The test suite compiles at ``--xla_backend_optimization_level=0`` (tests/conftest.py), which
  this process inherits. The sharded and unsharded samplers then round their unoptimised
  reductions differently and one draw in the batch flips; at level 2, the level users run,
  they draw the same tokens bit for bit. Only the sampler comparison needs that, so only its
  two programs pay for the optimised compile (``compiler_options`` overrides ``XLA_FLAGS`` per
  program). The library's ``jax.jit`` calls are made while this is active.
  """
  jit = jax.jit
  jax.jit = functools.partial(jit, compiler_options={"xla_backend_optimization_level": 2})
  try:
    yield
  finally:
    jax.jit = jit


def rollouts(graphdef, params) -> list[Rollout]:
  """Two batches of B x G rows sampled (single device) from the embedded model, as host
  arrays, with the scores of ``SCORES``."""
  rng = np.random.RandomState(0)
  sample = sampler_lib.make_sampler(graphdef, SAMPLING)
  out = []
  for i, scores in enumerate(SCORES):
    ids = np.repeat(rng.randint(6, 1000, (B, P)), G, axis=0).astype(np.int32)
    mask = np.ones((N, P), bool)
    # left padding on every other group; a group's rows share their prompt and its padding,
    # as the sampler's groups do (the train step's shared-prompt gradient relies on it)
    mask[np.repeat(np.arange(B) % 2 == 0, G), :2] = False
    c = jax.device_get(sample(params, ids, mask, jax.random.key(i)))
    s = np.asarray(scores, np.float32)
    out.append(Rollout(prompt_ids=ids, prompt_mask=mask, completion_ids=c.completion_ids,
                       completion_mask=c.completion_mask, behaviour_logp=c.behaviour_logp,
                       scores=s, truncated=c.truncated, success=s >= 1.0,
                       prompt_id=np.repeat(np.arange(B) + 10 * i, G).astype(np.int32),
                       version=np.full(c.completion_ids.shape, i, np.int32)))
  return out


def run_steps(graphdef, params, batches, config, tx, mesh, capacity):
  """The train step over ``batches``, unsharded (mesh None) or sharded; returns the final
  (state, replay), the metrics of every step and the jit cache size."""
  params = jax.tree.map(jnp.copy, params)
  state = step_lib.init_train_state(params, tx, mesh)
  replay = init_replay(capacity, G, P, T)
  shardings = None
  if mesh is not None:
    replay = sharding.put(replay, sharding.replay_shardings(mesh, replay))
    shardings = sharding.step_shardings(mesh, state, replay, family.param_axes())
  fn = step_lib.make_train_step(graphdef, tx, config, shardings)
  metrics = []
  for batch in batches:
    state, replay, m = fn(state, replay, batch, None, jax.random.key(7))
    metrics.append({k: float(v) for k, v in jax.device_get(m).items()})
  return state, replay, metrics, fn._cache_size()  # pylint: disable=protected-access


def compare_steps(graphdef, params, sharded_params, batches, config, capacity, mesh):
  """Single-device vs sharded steps; (report, sharded final state, sharded final replay)."""
  # SGD with momentum: the update is linear in the gradient (lr * g on the first step, lr *
  # (g2 + 0.9 g1) on the second), so the parameter difference measures the gradient
  # difference; Adam's first update, lr * g / (|g| + eps), would turn rounding-level
  # differences of near-zero gradient entries into lr-sized ones, measuring Adam, not the
  # sharding. The momentum trace is optimiser state that must follow the parameters' layout.
  tx = optax.sgd(0.003, momentum=0.9)
  s1, r1, m1, _ = run_steps(graphdef, params, batches, config, tx, None, capacity)
  s8, r8, m8, cache = run_steps(graphdef, sharded_params, batches, config, tx, mesh, capacity)
  keys = sorted(set(m1[-1]) & set(m8[-1]))
  # Relative to max(1, |value|): metrics range from fractions to tens (drift).
  rel = {k: max(abs(a[k] - b[k]) / max(1.0, abs(a[k])) for a, b in zip(m1, m8)) for k in keys}
  report = {
      "params_max_abs_diff": max_abs_diff(s1.params, s8.params),
      "params_moved": max_abs_diff(s1.params, params),
      "replay_max_abs_diff": max_abs_diff(r1, r8) if capacity else 0.0,
      "metrics_max_rel_diff": max(rel.values()),
      "metrics_rel_diff": rel,
      "metrics_sharded": m8,
      "cache_size": cache,
      "param_specs": specs(s8.params),
      "opt_state_specs": specs(s8.opt_state),
      "replay_specs": specs(r8) if capacity else {},
      "state_step": int(s8.step),
  }
  return report, s8, r8


def with_adapters(model):
  """(graphdef, params) of ``model`` with rank-4 adapters on every projection, B ~ 0.05 N(0, 1)
  (the same draws on every call)."""
  lora.attach(model, lora.LoraConfig(rank=4, alpha=8.0), nnx.Rngs(0))
  for i, site in enumerate(lora.dense_layers(model)):
    if site.rank:
      site.set_factors(b=0.05 * jax.random.normal(jax.random.key(i), (site.rank, site.shape[1])))
  return nnx.split(model)


def pool_run(graphdef, params, mesh, steps=3):
  """Partial rollouts' producer (G = 4, 8 slots, chunks of 2 decode steps, rows of 3..8
  tokens by a stop rule) for ``steps`` steps of one group each; (groups, counts, pool specs)."""
  config = sampler_lib.SamplingConfig(max_new_tokens=T, eos_ids=(5,), pad_id=0, prompt_group=G)
  serial = [0]

  def prompts():
    i = serial[0]
    serial[0] += 1
    ids = np.random.RandomState(100 + i).randint(6, 1000, P).astype(np.int32)
    stop = np.asarray([3 + (i + j) % 6 for j in range(G)], np.int32)
    return (i, ids, np.ones(P, bool), stop, producer_lib.key_data(jax.random.key(i), G))

  make = lambda: producer_lib.Producer(graphdef, config, nnx.merge(graphdef, params).config,
                                      slots=2 * G, prompt_len=P, chunk=2, max_staleness=4,
                                      prompts=prompts, mesh=mesh)
  producer = make()
  groups = []
  for i in range(steps):
    if i == steps - 1:  # the last step after a checkpoint round trip (its cache rebuilt)
      arrays = {}  # as the checkpoint writes it: JSON, and its arrays beside it
      saved = json.loads(json.dumps(checkpoint_lib._arrays_out(producer.state_dict(), arrays)))  # pylint: disable=protected-access
      saved = checkpoint_lib._arrays_in(saved, arrays)  # pylint: disable=protected-access
      producer = make()
      producer.load_state_dict(saved)
    groups += producer.take(params, 1)
    producer.advance(params)
  return groups, vars(producer.counts), specs(producer.pool) if mesh is not None else {}


def main(out_path: str):
  results = {"devices": jax.device_count()}
  t0 = time.time()
  mesh = sharding.make_mesh(MESH)
  graphdef, params = nnx.split(from_pretrained(assets.EMBEDDED_MODEL))
  reads = {}
  with recorded_reads(reads):
    sharded_graphdef, sharded_params = nnx.split(
        from_pretrained(assets.EMBEDDED_MODEL, mesh=mesh))
  results["load"] = {
      "max_abs_diff": max_abs_diff(params, sharded_params),
      "specs": specs(sharded_params),
      "reads": reads,
      "shard_shapes": {jax.tree_util.keystr(p): [list(s.data.shape) for s in x.addressable_shards]
                       for p, x in jax.tree_util.tree_flatten_with_path(sharded_params)[0]},
  }

  # The sampler: same key, same prompts, unsharded vs sharded.
  rng = np.random.RandomState(1)
  ids = rng.randint(6, 1000, (N, P)).astype(np.int32)
  mask = np.ones((N, P), bool)
  mask[1::2, :3] = False
  with optimised():
    sample = sampler_lib.make_sampler(graphdef, SAMPLING)
    sharded_sample = sampler_lib.make_sampler(sharded_graphdef, SAMPLING, mesh)
  one = jax.device_get(sample(params, ids, mask, jax.random.key(3)))
  many = sharded_sample(sharded_params, ids, mask, jax.random.key(3))
  sharded_sample(sharded_params, ids[::-1].copy(), mask, jax.random.key(4))
  results["sampler"] = {
      "tokens_equal": bool(np.array_equal(one.completion_ids, np.asarray(many.completion_ids))),
      "mask_equal": bool(np.array_equal(one.completion_mask, np.asarray(many.completion_mask))),
      "logp_max_abs_diff": max_abs_diff(one.behaviour_logp, many.behaviour_logp),
      "tokens_spec": str(many.completion_ids.sharding.spec),
      "cache_size": sharded_sample._cache_size(),  # pylint: disable=protected-access
      "generated": int(np.sum(one.completion_mask)),
  }

  # The slot pool of partial rollouts: rows split over the batch axes vs one device. At the
  # suite's -O0 these draw the same tokens (unlike the sampler above): 9 CPU-s for both runs,
  # against 22 at level 2.
  one_groups, one_counts, _ = pool_run(graphdef, params, None)
  many_groups, many_counts, pool_specs = pool_run(sharded_graphdef, sharded_params, mesh)
  results["pool"] = {
      "tags": [[g.tag for g in one_groups], [g.tag for g in many_groups]],
      "tokens_equal": all(np.array_equal(a.tokens, b.tokens) and
                          np.array_equal(a.versions, b.versions) and
                          np.array_equal(a.lengths, b.lengths)
                          for a, b in zip(one_groups, many_groups)),
      "logp_max_abs_diff": max(max_abs_diff(a.logp, b.logp)
                               for a, b in zip(one_groups, many_groups)),
      "counts_equal": one_counts == many_counts,
      "specs": pool_specs,
  }

  batches = rollouts(graphdef, params)
  grpo = StepConfig(group_size=G, num_minibatches=2, logprob_chunk=16)
  results["grpo"], _, _ = compare_steps(graphdef, params, sharded_params, batches, grpo, 0,
                                        mesh)
  popo_config = StepConfig(group_size=G, num_minibatches=2, logprob_chunk=16,
                                    replay=popo.Popo(fill="replay", max_uses=1))
  results["popo"], state, replay = compare_steps(graphdef, params, sharded_params, batches,
                                                 popo_config, 4, mesh)

  # The update at the real tokens: POPO with packing, each device packing its own rows (a
  # minibatch of 4 rows is one row a device), against one device's packing and against the
  # padded sharded run above. The real tokens of each step's fresh rows, per update, for the
  # useful fraction: each row its own prompt (a device's rows are not whole groups).
  packed_config = dataclasses.replace(popo_config, packing="tokens")
  results["popo_packed"], packed_state, _ = compare_steps(
      graphdef, params, sharded_params, batches, packed_config, 4, mesh)
  results["popo_packed"]["vs_padded_params_max_abs_diff"] = max_abs_diff(packed_state.params,
                                                                         state.params)
  results["popo_packed"]["padded_metrics_sharded"] = results["popo"]["metrics_sharded"]
  results["popo_packed"]["fresh_real_tokens"] = [
      int(np.sum(b.prompt_mask) + np.sum(b.completion_mask)) for b in batches]
  results["popo_packed"]["capacity"] = P + T

  # LoRA: adapters (B drawn away from 0, so A's gradient is not 0 either) on the same base,
  # replicated under the mesh; a KL term, whose reference is the base (adapters off).
  lora_graphdef, lora_params = with_adapters(from_pretrained(assets.EMBEDDED_MODEL))
  _, lora_sharded = with_adapters(from_pretrained(assets.EMBEDDED_MODEL, mesh=mesh))
  lora_config = StepConfig(group_size=G, num_minibatches=2, logprob_chunk=16,
                                    loss=losses.LossConfig(kl_coef=0.05))
  results["lora"], lora_state, _ = compare_steps(lora_graphdef, lora_params, lora_sharded,
                                                 batches, lora_config, 0, mesh)
  adapters, base = lora.split(lora_state.params)
  _, base0 = lora.split(lora_params)
  results["lora"]["base_max_abs_diff"] = max_abs_diff(base, base0)
  results["lora"]["adapters_moved"] = max_abs_diff(adapters, lora.split(lora_params)[0])

  # Checkpoints: the POPO state saved from the (2, 2, 2) mesh, restored onto (1, 2, 4) and
  # onto one device, into zero-filled templates of those layouts.
  with tempfile.TemporaryDirectory() as workdir:
    ckpt = checkpoint_lib.Checkpointer(workdir, keep=1)
    ckpt.save(2, state, replay, {"data_position": 4})
    other = sharding.make_mesh(OTHER_MESH)
    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
    template_state = sharding.put(zeros(state), sharding.tree_shardings(other, state, family.param_axes()))
    template_replay = sharding.put(zeros(replay), sharding.replay_shardings(other, replay))
    s_other, r_other, host = ckpt.restore(2, template_state, template_replay)
    one_device = jax.devices()[0]
    s_one, r_one, _ = ckpt.restore(2, jax.device_put(zeros(state), one_device),
                                   jax.device_put(zeros(replay), one_device))
    ckpt.close()
  results["restore"] = {
      "other_mesh_max_abs_diff": max(max_abs_diff(state, s_other),
                                     max_abs_diff(replay, r_other)),
      "one_device_max_abs_diff": max(max_abs_diff(state, s_one), max_abs_diff(replay, r_one)),
      "other_mesh_specs_match_template": specs(s_other) == specs(template_state)
                                         and specs(r_other) == specs(template_replay),
      "other_mesh_shape": dict(other.shape),
      "restored_mesh_shapes": sorted({str(dict(x.sharding.mesh.shape))
                                      for x in jax.tree.leaves(s_other)}),
      "one_device_devices": len({d for x in jax.tree.leaves(s_one)
                                 for d in x.sharding.device_set}),
      "host": host,
      "nonzero_leaves": sum(bool(np.any(np.asarray(x))) for x in jax.tree.leaves(state)),
      "leaves": len(jax.tree.leaves(state)),
  }
  results["seconds"] = time.time() - t0
  with open(out_path, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
