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


def test_each_mode_is_a_valid_config_with_its_knobs_and_overrides():
  """What ``measure`` trains (tests/async_checks.py judges ``row`` on a real asynchronous
  run): the mode's knobs and the typed ``--set`` overrides land in a config the validator
  accepts, evaluation and checkpoints out of the measured steps."""
  from grpo_jax import configuration  # pylint: disable=g-import-not-at-top
  c = asynchronous._config("grpo:smoke", 4, "lockstep", 1, 1, 5,
                           ("rl.loss.kl_coef=0.01", "rl.shared_prompts=false"), ahead=2)
  configuration.validate(c)
  assert (c.rollout.partial, c.rollout.devices, c.rollout.schedule, c.rollout.max_staleness,
          c.rollout.lockstep_chunks, c.rollout.ahead) == (True, 4, "lockstep", 1, 1, 2)
  assert (c.rl.num_minibatches, c.total_steps, c.rl.loss.kl_coef, c.rl.shared_prompts) == (
      1, 5, 0.01, False)  # smoke's own: 2 minibatches, KL 0, shared prompts on
  assert c.eval.every > c.total_steps and c.checkpoint.every > c.total_steps
