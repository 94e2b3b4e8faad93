"""Generation on its own devices, on 8 fake CPU devices, as numbers for a test to judge.

    python tests/async_checks.py OUT

Like ``tests/multidevice_checks.py`` this runs in a fresh process (it sets
``--xla_force_host_platform_device_count=8`` before JAX starts) and writes a JSON report that
``tests/test_async_devices.py`` judges; nothing here asserts. The embedded model and the smoke
config (2 prompts x 2 rollouts, T = 8): the first 4 devices generate, the other 4 train.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import grpo, popo, sara  # noqa: E402
from grpo_jax import sharding  # noqa: E402
from grpo_jax.generate import transfer as transfer_lib  # noqa: E402
from grpo_jax.models import family, lora  # noqa: E402
from grpo_jax.run import build, checkpoint as checkpoint_lib, loop, metrics  # noqa: E402


def _config(module, presets: str, total: int, **rollout):
  c = module.get_config(presets)
  c.rollout.update(**{"devices": 4, "partial": True, **rollout})
  c.rollout.generation_mesh.update(data=2, fsdp=1, tensor=2)  # a layout unlike training's
  c.mesh.update(data=2, fsdp=2, tensor=1)
  c.total_steps = total
  c.eval.every = 100
  c.eval.greedy = False
  c.checkpoint.every = 2
  return c


def _devices(tree) -> list[int]:
  return sorted({d.id for x in jax.tree.leaves(tree) for d in x.devices()})


def _run(config, workdir: str) -> dict:
  """Trains; the steps' records and where each side's arrays live at the end."""
  run = build.setup(config, workdir)
  loop.run(run)
  gen = run.setup.allocator.generator
  steps = [r for r in metrics.read_metrics(workdir) if "loss" in r]
  keys = ("rollout/staleness_max", "rollout/staleness_mean", "rollouts", "completion_tokens",
          "alloc/groups_discarded", "alloc/groups_dropped", "alloc/rows_in_flight",
          "alloc/rollouts_in_update", "rollout/generator_version",
          "rollout/trainer_busy_s", "rollout/generator_busy_s", "rollout/transfer_s")
  c = gen.producer.counts
  return {"steps": [{k: r.get(k) for k in keys} | {"step": r["step"]} for r in steps],
          # What the producer itself counted over the run (restored counts included).
          "producer": {"rollouts": c.rows_trained + c.rows_discarded + c.rows_dropped,
                       "completion_tokens": c.tokens_generated,
                       "groups_discarded": c.groups_discarded,
                       "groups_dropped": c.groups_dropped,
                       "in_flight": gen.producer.in_flight()},
          "state_devices": _devices(run.progress.state.params),
          "generator_devices": _devices(gen.params),
          "pool_devices": _devices(gen.producer.pool),
          "transfers": gen.transfers}


def _final_state(workdir: str):
  ck = checkpoint_lib.Checkpointer(workdir, 2)
  return ck.manager.restore(ck.latest_step()).state


def _stopped_at_2(straight: str, resumed: str) -> None:
  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "4"))
  path = os.path.join(resumed, "metrics.jsonl")
  with open(path, encoding="utf-8") as f:
    kept = [line for line in f if line.strip() and json.loads(line)["step"] <= 2]
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(kept)


def resume(root: str, module, presets: str, **rollout) -> dict:
  """Four steps straight, and the same run stopped after step 2 and resumed."""
  straight, resumed = os.path.join(root, "straight"), os.path.join(root, "resumed")
  first = _run(_config(module, presets, 4, **rollout), straight)
  _stopped_at_2(straight, resumed)
  again = _run(_config(module, presets, 4, **rollout), resumed)
  diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
             for a, b in zip(jax.tree.leaves(_final_state(straight)),
                             jax.tree.leaves(_final_state(resumed))))
  return {"straight": first, "resumed": again, "state_max_abs_diff": diff}


def _guarded(fn) -> str:
  try:
    jax.block_until_ready(fn())
    return "not raised"
  except Exception as e:  # pylint: disable=broad-except
    return type(e).__name__ + ": " + str(e)[:100]


def transfer(root: str) -> dict:
  """The generator's copy of the parameters: only through devices, resharded, equal; under
  LoRA only the adapters are sent."""
  run = build.setup(_config(grpo, "smoke,lora=4", 1), os.path.join(root, "lora"))
  gen, state = run.setup.allocator.generator, run.progress.state
  trained, _ = lora.split(state.params)
  out = {"lora_leaves": len(jax.tree.leaves(trained)),
         "all_leaves": len(jax.tree.leaves(state.params)),
         "sent_leaves": len(jax.tree.leaves(gen._send(trained)))}  # pylint: disable=W0212
  run.setup.ckpt.close()
  run.setup.scorer.close()
  # Full parameters between the run's training mesh (data 2 x fsdp 2) and a generation mesh
  # of another shape (data 2 x tensor 2: replicate, copy, reshard) or of the same shape (copy
  # shard for shard), on the other four devices.
  params = run.progress.state.params
  axes = family.param_axes()
  train_mesh = run.setup.mesh
  src = sharding.tree_shardings(train_mesh, params, axes)
  for name, shape in (("other_shape", (2, 1, 2)), ("same_shape", (2, 2, 1))):
    gen_mesh = jax.make_mesh(shape, sharding.MESH_AXES, devices=jax.devices()[:4])
    dst = sharding.tree_shardings(gen_mesh, params, axes)
    send = transfer_lib.Transfer(src, dst, "float32")
    sent = send(params)
    out[name] = {
        "max_abs_diff": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(sent))),
        "layouts_match": all(x.sharding == d for x, d in zip(jax.tree.leaves(sent),
                                                              jax.tree.leaves(dst))),
        "devices": _devices(sent)}
    with jax.transfer_guard_device_to_device("disallow_explicit"):
      out[name]["device_to_device_guard"] = _guarded(lambda: send(params))  # pylint: disable=W0640
    host = jax.tree.map(np.asarray, params)
    out[name]["host_guard"] = _guarded(lambda: send(host))  # pylint: disable=cell-var-from-loop
  return out


def fuzz(root: str, n: int, seed: int = 0) -> list:
  """``n`` drawn settings of the asynchronous knobs on 8 devices: each is refused in one line
  (validation or setup) or trains 2 steps within its bound."""
  rng = np.random.default_rng(seed)
  out = []
  layouts = [dict(data=-1, fsdp=1, tensor=1), dict(data=-1, fsdp=1, tensor=1),
             dict(data=1, fsdp=-1, tensor=1), dict(data=-1, fsdp=1, tensor=2),
             dict(data=1, fsdp=1, tensor=-1)]
  for i in range(n):
    axes = lambda: dict(layouts[int(rng.integers(len(layouts)))])
    knobs = dict(devices=int(rng.choice([1, 2, 4, 4, 6])),
                 schedule=str(rng.choice(["free", "lockstep"])),
                 lockstep_chunks=int(rng.integers(0, 3)), max_staleness=int(rng.integers(0, 4)),
                 ahead=int(rng.integers(0, 3)), slots=int(rng.choice([0, 8, 16])),
                 chunk=int(rng.choice([0, 1, 3])),
                 partial_cache=str(rng.choice(["keep", "reprefill"])))
    continued = str(rng.choice(["decoupled", "naive"]))
    gen_axes, train_axes = axes(), axes()
    c = _config(grpo, "smoke", 2, **knobs)
    c.prox.continued = continued
    c.rollout.batch_prompts = 4  # 8 rows a step: they split over 1, 2, 4 or 8 devices
    c.rollout.generation_mesh.update(**gen_axes)
    c.mesh.update(**train_axes)
    case = {"knobs": knobs, "continued": continued, "generation_mesh": gen_axes,
            "mesh": train_axes}
    try:
      run = _run(c, os.path.join(root, f"fuzz{i}"))
      case["staleness_max"] = max(s["rollout/staleness_max"] for s in run["steps"])
      case["steps"] = len(run["steps"])
    except (ValueError, sharding.MeshError) as e:  # ConfigError and MeshError are ValueErrors
      case["refused"] = str(e)
    out.append(case)
  return out


def main(out_path: str) -> None:
  root = tempfile.mkdtemp()
  report = {"devices": jax.device_count()}
  report["transfer"] = transfer(root)
  # Lockstep under reprefill: the resumed run is the uninterrupted one, bit for bit.
  report["grpo_lockstep"] = resume(os.path.join(root, "g"), grpo, "smoke,lockstep=2",
                                   max_staleness=1, partial_cache="reprefill", chunk=2)
  # Free-running, POPO and SARA: the bound holds, resume loses nothing.
  report["popo_free"] = resume(os.path.join(root, "p"), popo, "smoke", max_staleness=2,
                               chunk=1, slots=8)
  # SARA with rows asked for after the probes (G = 4, 2 probes) and the lead at the next
  # step only (ahead 0): it stalled on the lead once, and lost the counts of its drops.
  sara_config = _config(sara, "smoke", 3, max_staleness=1, chunk=1, slots=8, group_size=4,
                        ahead=0)
  report["sara_free"] = _run(sara_config, os.path.join(root, "s"))
  # The bench's row of the lockstep run's last two steps (its numbers are not judged, its
  # columns are; bench.measure is this row of a run it trains).
  from grpo_jax.bench import asynchronous as bench  # pylint: disable=g-import-not-at-top
  lockstep = [r for r in metrics.read_metrics(os.path.join(root, "g", "straight")) if "loss" in r]
  report["bench"] = bench.row(lockstep[2:], 4, "lockstep", staleness=1, ahead=1)
  report["fuzz"] = fuzz(os.path.join(root, "f"), int(os.environ.get("ASYNC_FUZZ", "4")))
  with open(out_path, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
