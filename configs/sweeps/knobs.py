"""The regime study's method knobs, where the mechanism says they matter: on the hard task
(numbers to 100, ~85% of groups ineffective), where replay has the most slots to fill.

    python -m grpo_jax.bench.sweep --grid=configs/sweeps/knobs.py \
        --out=docs/results/regime/knobs --workdirs=runs/regime/knobs --detach

Headroom-Drift's drift bound tau (with its acceptance rate in the summary) beside its two
ablations (headroom only: no gate, so no tau; drift only: the gate walking the buffer oldest
first, at each tau, so each ablation pairs with Headroom-Drift at the same bound); POPO's reuse
count and buffer capacity at the default age limit of 4 steps and at 16 steps (a group fills at
most one slot a step, so at age 4 it is replayed at most 4 times: reuse 8 and a larger buffer
can bind only at the longer limit); rollout replay's replay ratio rho and age limit tau_max;
DAPO's oversampling (generation batches of 1 or 3 x B prompts) and SARA's abandonment
threshold tau_lo; each against GRPO. 25,600 generated rollouts, 1,024 held-out prompts, 3
seeds: 108 cells.
"""


def get_grid(arg=None):
  del arg
  return dict(
      methods={"grpo": "grpo", "headroom": "headroom",
               "headroom-headroom_only": "headroom:headroom_only",
               "headroom-drift_only": "headroom:drift_only", "popo": "popo",
               "popo-age16": "popo:age=16",
               "rollout_replay": "rollout_replay", "dapo": "dapo", "sara": "sara"},
      seeds=[0, 1, 2], presets="countdown_hard",
      budget={"rollouts": 25600}, evaluations=4,
      overrides={"eval.num_prompts": 1024},
      method_axes={
          "headroom": {"replay.headroom.tau": [1e-3, 3e-3, 1e-2, 3e-2]},
          "headroom-drift_only": {"replay.headroom.tau": [1e-3, 3e-3, 1e-2, 3e-2]},
          "popo": {"replay.popo.max_uses": [1, 2, 4, 8], "replay.capacity": [32, 128]},
          "popo-age16": {"replay.popo.max_uses": [4, 8], "replay.capacity": [32, 128]},
          "rollout_replay": {"replay.prioritized.rho": [0.25, 0.5, 1.0],
                             "replay.prioritized.tau_max": [2, 5, 10]},
          "dapo": {"allocation.dynamic_sampling.oversample": [1, 3]},
          "sara": {"allocation.sara.tau_lo": [0.3, 0.45, 0.6]},
      })
