"""RL training entry point.

    python -m grpo_jax.train --config=configs/grpo.py [--config.x=y ...] [--workdir=DIR]

``train_and_evaluate(config, workdir)`` does the work so notebooks and tests can call it: the
loop (``loop.py``) is prompts -> sampler -> host rewards -> jitted train step -> metrics, with
held-out evaluation every ``eval.every`` steps, orbax checkpoints every ``checkpoint.every``
steps and automatic resume from the latest checkpoint in ``workdir``.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags
from ml_collections import config_flags

from grpo_jax import configuration
from grpo_jax import console
from grpo_jax import deprecated
from grpo_jax import sharding as sharding_lib
from grpo_jax.generate import tokenization
from grpo_jax.models import CheckpointError
from grpo_jax.rewards import scoring
from grpo_jax.run import build, loop
from grpo_jax.run import compilation_cache
from grpo_jax.run.loop import TrainingStopped  # re-exported: callers catch train.TrainingStopped


def define_flags():
  """The CLI flags; defined only when run as a program, so importing this module is free."""
  config_flags.DEFINE_config_file("config", None, "RL config file, e.g. configs/grpo.py.")
  flags.DEFINE_string("workdir", None, "Output folder (metrics, checkpoints); default "
                      "runs/<config file name>, e.g. runs/grpo.")


def train_and_evaluate(config, workdir: str) -> dict:
  """Runs (or resumes) training; returns the last evaluation's metrics."""
  return loop.run(build.setup(config, workdir))


def main(argv):
  del argv
  config = flags.FLAGS.config
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/grpo.py")
  name = os.path.splitext(os.path.basename(
      config_flags.get_config_filename(flags.FLAGS["config"])))[0]
  workdir = flags.FLAGS.workdir or os.path.join("runs", name)
  console.quiet_unless_verbose()
  compilation_cache.enable()  # a restart (a resume, a sweep's next cell) compiles nothing
  try:
    train_and_evaluate(config, workdir)
  except (configuration.ConfigError, CheckpointError, OSError,
          tokenization.PromptTooLongError, TrainingStopped, sharding_lib.MeshError,
          scoring.RewardError) as e:
    # User errors (config, paths, data) and the machine's (a full disk, a folder that cannot be
    # written) end with one readable line, not a traceback.
    sys.exit(f"grpo_jax.train: {e}")


def one_line(message: str) -> str:
  """A flag error as one line: ml_collections puts the traceback of a config file's own error
  (an unknown preset in ``--config=configs/popo.py:nope``) into its message; the first line
  (which flag) and the last (what was wrong) are kept."""
  lines = [x.strip() for x in message.strip().splitlines() if x.strip()]
  if len(lines) > 1 and any(x.startswith("Traceback") for x in lines):
    return f"{lines[0]} {lines[-1]}"
  return message


def parse_flags(argv):
  """absl's flag parsing, with an unknown ``--config.x`` field or a value of the wrong type
  named in one line, not a traceback from inside ml_collections or absl."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:  # a value of the wrong type, e.g. --config.rollout.group_size=abc
    sys.exit(f"grpo_jax.train: {one_line(str(e))}")
  except (AttributeError, KeyError) as e:
    name = str(e).strip("\"'")
    given = [a.split("=")[0][2:] for a in argv
             if a.startswith("--config.") and name in a.split("=")[0].split(".")]
    moved = deprecated.retired(given[0]) if given else None
    sys.exit(f"grpo_jax.train: {moved}" if moved else
             f"grpo_jax.train: unknown config field {given[0] if given else name!r}; the "
             "fields and their meaning are in grpo_jax/schema/defaults.py")


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=parse_flags)
