"""Two cells in seconds each (the sweep runner's test): GRPO and POPO on ``:smoke``, one seed.

    python -m grpo_jax.bench.sweep --grid=configs/sweeps/smoke.py --out=runs/sweep/smoke
"""


def get_grid(arg=None):
  del arg
  return dict(methods={"grpo": "grpo", "popo": "popo"}, seeds=[0], presets="smoke",
              budget={"steps": 2}, evaluations=1)
