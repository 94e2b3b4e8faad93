"""The regime study's difficulty axis: every method at its paper defaults on Countdown with
numbers up to 50, 70 and 100, against the share of groups that carry no signal.

    python -m grpo_jax.bench.sweep --grid=configs/sweeps/difficulty.py \
        --out=docs/results/regime/difficulty --workdirs=runs/regime/difficulty --detach

Every method on the same finite pool of 1,024 training problems (``pool=1024``: MoPPS and DPS
need prompts that come back; ~3 epochs) and the same budget of 25,600 *generated* rollouts
(allocation methods spend theirs differently per step), 4 evaluations on the same 1,024
held-out prompts per difficulty, 3 seeds. The figure puts each method's gain over GRPO against
GRPO's measured ineffective-group fraction at that difficulty. 99 cells.
"""


def get_grid(arg=None):
  del arg
  return dict(
      methods={"grpo": "grpo", "drgrpo": "drgrpo", "rloo": "rloo", "dapo": "dapo",
               "popo": "popo", "rollout_replay": "rollout_replay:paper",
               "headroom": "headroom", "sara": "sara", "sara-dps": "sara:dps",
               "grpo-mopps": "grpo:mopps", "grpo-dps": "grpo:dps"},
      seeds=[0, 1, 2], presets="pool=1024",
      budget={"rollouts": 25600}, evaluations=4,
      overrides={"eval.num_prompts": 1024},
      axes={"task.countdown.max_number": [50, 70, 100]},
      plot={"x": "task.countdown.max_number", "panels": None,
            "x_measured": "ineffective_fraction"})
