"""``bench.asynchronous.table``: the speed-up is against the colocated row."""

from grpo_jax.bench import asynchronous


def test_table_speed_up_against_colocated():
  rows = [dict(mode="colocated", devices=0, step_s=1.0, generator_busy_fraction=0.6,
               trainer_busy_fraction=0.4, staleness_mean=0.1),
          dict(mode="async 4 free", devices=4, step_s=0.5, generator_busy_fraction=0.9,
               trainer_busy_fraction=0.8, staleness_mean=1.5, transfer_s=0.002)]
  lines = asynchronous.table(rows).splitlines()
  assert lines[2] == "| colocated | 1.000 | 1.00x | 0.60 | 0.40 | 0.0000 | 0.10 |"
  # 1.0 s / 0.5 s = 2.00x faster than colocated.
  assert lines[3] == "| async 4 free | 0.500 | 2.00x | 0.90 | 0.80 | 0.0020 | 1.50 |"
