"""The regime study's policy-movement axis: how far the policy moves between steps (learning
rate x optimiser updates per batch) against what the off-policy corrections buy.

    python -m grpo_jax.bench.sweep --grid=configs/sweeps/movement.py \
        --out=docs/results/regime/movement --workdirs=runs/regime/movement --detach

GRPO, POPO, GRPO-filter (ineffective groups dropped, nothing refilled: POPO's ablation) and
the two ablations the POPO paper reports collapsing (pi_old: replayed groups
treated as on-policy; stale(10): groups ~10 steps old), POPO with the coupled objective
(align_mu), rollout-level replay as its paper's reference implementation runs it (``:paper``)
and Headroom-Drift, at learning rates 3e-5 (the default), 1e-4 and 2e-4 and 1, 4 or 8 updates
per batch (``rl.num_minibatches``). Equal budgets: 25,600 generated rollouts (100 steps of
32 x 8), 4 evaluations on the same 1,024 held-out prompts, 3 seeds. The default Countdown task
(numbers to 50; about a third of GRPO's groups ineffective). 216 cells, about 100 s each
on this project's 2-core CPU.

``:quick`` is the axis's corners only (lr 3e-5 and 2e-4, 1 and 8 updates): 96 cells.
"""


def get_grid(arg=None):
  if arg not in (None, "quick"):
    raise ValueError(f"movement grid: unknown variant {arg!r} (expected none or 'quick')")
  quick = arg == "quick"
  return dict(
      methods={"grpo": "grpo", "popo": "popo", "grpo-filter": "popo:filter",
               "popo-pi_old": "popo:pi_old",
               "popo-stale10": "popo:stale=10", "popo-align_mu": "popo:align_mu",
               "rollout_replay": "rollout_replay:paper", "headroom": "headroom"},
      seeds=[0, 1, 2],
      budget={"rollouts": 25600}, evaluations=4,
      overrides={"eval.num_prompts": 1024},
      axes={"opt.learning_rate": [3e-5, 2e-4] if quick else [3e-5, 1e-4, 2e-4],
            "rl.num_minibatches": [1, 8] if quick else [1, 4, 8]},
      plot={"x": "opt.learning_rate", "panels": "rl.num_minibatches"})
