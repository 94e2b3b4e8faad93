"""Generation on its own devices against generation between updates, on fake CPU devices.

    python -m grpo_jax.bench.asynchronous                    # 8 fake devices, 4 generate
    python -m grpo_jax.bench.asynchronous --generation_devices=2,4,6 --steps=12

Each mode trains ``--steps`` steps after ``--warmup`` (compilation excluded) of the real loop
(``grpo_jax.train``'s) from ``--config`` (default: the learning sweep's cell,
``configs/sweeps/asynchronous.py``: B = 32 groups of G = 8, a pool of 512 rows, at most 8
decode steps a step, 8 updates a batch) at ``rollout.max_staleness`` = ``--staleness``:

* ``colocated``: partial rollouts on every device (one mesh; generation, then the update);
* ``async K free ahead A`` / ``async K lockstep ahead A``: K devices generate, the others
  train (``rollout.devices`` = K; the free-running schedule, and lockstep with one chunk an
  update; ``rollout.ahead`` = A, ``--ahead``).

Per mode: seconds per step (evaluation and checkpoint excluded), the generator's and
trainer's busy fractions (their busy seconds over the step's wall time, from ``rollout/*_s``
in metrics.jsonl), the parameter transfer, the trained tokens' mean staleness and the steps'
speed-up over ``colocated`` (> 1 is faster).
The last line is one JSON object.

On this machine the "devices" are threads of one 2-core CPU (``--xla_force_host_platform_
device_count``): both sides compete for the same cores, so the overlap measured here is a
lower bound on what separate accelerators give. On a multi-GPU host ``--fake_devices=0``
measures the real split, e.g. on 8 GPUs::

    python -m grpo_jax.bench.asynchronous --fake_devices=0 --generation_devices=2,4 \
        --config=grpo:qwen3_1p7b,gsm8k,slots=512 --set=model.path=/data/Qwen3-1.7B \
        --set=rollout.completion_len=1024 --steps=10 --out=async_gpu.jsonl
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags, defined when this runs as a program (other benchmarks that
  tests import beside it define some of the same names)."""
  flags.DEFINE_integer("fake_devices", 8, "Fake CPU devices (XLA_FLAGS, set before JAX starts); "
                       "0 uses the machine's own devices.")
  flags.DEFINE_list("generation_devices", ["4"], "Values of rollout.devices to measure.")
  flags.DEFINE_list("schedules", ["free", "lockstep"], "rollout.schedule values to measure.")
  flags.DEFINE_list("ahead", ["1"], "rollout.ahead values to measure.")
  flags.DEFINE_string("config", "grpo:slots=512,decode_budget=8",
                      "configs/<module>.py:presets of every mode (partial rollouts are added).")
  flags.DEFINE_integer("staleness", 2, "rollout.max_staleness.")
  flags.DEFINE_integer("minibatches", 8, "rl.num_minibatches (updates a batch).")
  flags.DEFINE_integer("steps", 8, "Measured steps per mode.")
  flags.DEFINE_integer("warmup", 3, "Steps per mode before measuring (compilation, fill).")
  flags.DEFINE_string("out", "", "JSONL file the rows are appended to (none when empty).")
  flags.DEFINE_multi_string("set", [], "KEY=VALUE config overrides of every mode, e.g. "
                            "--set=model.path=/data/Qwen3-1.7B (read as the key's type).")


_TIMES = ("generator_busy", "generator_idle", "trainer_busy", "trainer_idle", "transfer")


def _config(spec: str, devices: int, schedule: str, staleness: int, minibatches: int,
            total: int, overrides=(), ahead: int = 1):
  from grpo_jax.schema import files  # pylint: disable=g-import-not-at-top
  c = files.load(spec)
  for item in overrides:
    key, _, value = item.partition("=")
    *groups, name = key.split(".")
    parent = c
    for g in groups:
      parent = parent[g]
    parent[name] = type(parent[name])(value) if not isinstance(parent[name], bool) else (
        value.lower() in ("1", "true", "yes"))
  c.rollout.update(partial=True, max_staleness=staleness, devices=devices, schedule=schedule,
                   lockstep_chunks=1, ahead=ahead)
  c.rl.num_minibatches = minibatches
  c.total_steps = total
  c.eval.update(every=10_000, num_prompts=8, greedy=False)
  c.checkpoint.every = 10_000
  return c


def measure(spec: str, devices: int, schedule: str, *, staleness: int, minibatches: int,
            steps: int, warmup: int, overrides=(), ahead: int = 1) -> dict:
  """One mode's row (module doc): trains ``warmup + steps`` steps in a temporary workdir."""
  from grpo_jax import train  # pylint: disable=g-import-not-at-top
  from grpo_jax.run import metrics  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as workdir:
    train.train_and_evaluate(
        _config(spec, devices, schedule, staleness, minibatches, warmup + steps, overrides,
                ahead), workdir)
    records = [r for r in metrics.read_metrics(workdir) if "loss" in r][warmup:]
  return row(records, devices, schedule, staleness, ahead)


def row(records: list[dict], devices: int, schedule: str, staleness: int, ahead: int) -> dict:
  """A mode's row from its measured steps' records (metrics.jsonl's step lines)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  # The run's last step also evaluates and checkpoints: not the steps' own time.
  step_s = float(np.mean([r["time/step_s"] - r["time/evaluation_s"] - r["time/checkpoint_s"]
                          for r in records]))
  out = {"mode": "colocated" if not devices else f"async {devices} {schedule} ahead {ahead}",
         "devices": devices, "schedule": schedule if devices else "", "staleness": staleness,
         "ahead": ahead if devices else None,
         "steps": len(records), "step_s": step_s,
         "staleness_mean": float(np.mean([r["rollout/staleness_mean"] for r in records]))}
  if devices:
    for name in _TIMES:
      out[f"{name}_s"] = float(np.mean([r[f"rollout/{name}_s"] for r in records]))
    out["generator_busy_fraction"] = out["generator_busy_s"] / step_s
    out["trainer_busy_fraction"] = out["trainer_busy_s"] / step_s
  else:  # generation, then the update: each side busy only in its own phase
    gen = float(np.mean([r["time/generation_s"] for r in records]))
    upd = float(np.mean([r["time/update_s"] for r in records]))
    out.update(generator_busy_fraction=gen / step_s, trainer_busy_fraction=upd / step_s)
  return out


def table(rows: list[dict]) -> str:
  """The rows as a markdown table, speed-up against the colocated row."""
  base = next((r["step_s"] for r in rows if not r["devices"]), None)
  lines = ["| mode | s / step | speed-up | generator busy | trainer busy | transfer s | "
           "staleness mean |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    speed = f"{base / r['step_s']:.2f}x" if base else "-"
    lines.append(f"| {r['mode']} | {r['step_s']:.3f} | {speed} | "
                 f"{r['generator_busy_fraction']:.2f} | {r['trainer_busy_fraction']:.2f} | "
                 f"{r.get('transfer_s', 0.0):.4f} | {r['staleness_mean']:.2f} |")
  return "\n".join(lines)


def main(argv):
  del argv
  from grpo_jax import console  # pylint: disable=g-import-not-at-top
  console.quiet_unless_verbose()
  modes = [(0, "free", 1)] + [(int(k), s, int(a)) for k in FLAGS.generation_devices
                              for s in FLAGS.schedules for a in FLAGS.ahead]
  rows = []
  for devices, schedule, ahead in modes:
    rows.append(measure(FLAGS.config, devices, schedule, staleness=FLAGS.staleness,
                        minibatches=FLAGS.minibatches, steps=FLAGS.steps, warmup=FLAGS.warmup,
                        overrides=FLAGS.set, ahead=ahead))
    if FLAGS.out:
      with open(FLAGS.out, "a", encoding="utf-8") as f:
        f.write(json.dumps(rows[-1]) + "\n")
  print(table(rows))
  import jax  # pylint: disable=g-import-not-at-top
  print(json.dumps({"devices": jax.device_count(), "rows": rows}))


def _fake_devices(argv) -> None:
  """Sets the fake CPU device count before JAX starts (a flag parsed by hand: absl parses
  after the imports that start it)."""
  n = next((a.split("=", 1)[1] for a in argv if a.startswith("--fake_devices=")), "8")
  if int(n):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={n}")
    os.environ["JAX_PLATFORMS"] = "cpu"


if __name__ == "__main__":
  _fake_devices(sys.argv)
  define_flags()
  app.run(main)
