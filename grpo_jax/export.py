"""Writes a run's trained policy as a Hugging Face folder, or its LoRA adapters for PEFT.

    python -m grpo_jax.export --config=configs/popo.py:lora --workdir=runs/popo --out=DIR \
        [--format=merged|adapter] [--step=N]

``--config`` is the run's config (as given to ``grpo_jax.train``); the newest checkpoint of
``--workdir`` (or ``--step``) is read. ``merged`` (default): a folder that
``transformers.AutoModelForCausalLM.from_pretrained`` loads, adapters folded into the kernels.
``adapter`` (LoRA runs only): ``adapter_config.json`` + ``adapter_model.safetensors``, which
``peft.PeftModel.from_pretrained(base, DIR)`` loads onto the base model and
``grpo_jax.models.from_pretrained(DIR)`` loads back. The tokenizer is saved alongside either.
"""

from __future__ import annotations

import sys

import transformers
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from grpo_jax import configuration
from grpo_jax import console
from grpo_jax.models import CheckpointError, save_pretrained
from grpo_jax.models import adapter_folder
from grpo_jax.models import lora
from grpo_jax.rl import optim
from grpo_jax.rl import step as step_lib
from grpo_jax.run import build
from grpo_jax.run import checkpoint as checkpoint_lib

FORMATS = ("merged", "adapter")


def restored_policy(config, workdir: str, step: int | None = None):
  """(the model, its tokenizer, the step) of a run's checkpoint: the newest, or ``step``.

  The model is built as the run built it (``model.path``, its adapters under LoRA) and takes
  the checkpoint's parameters (under LoRA: its adapters, on the base from ``model.path``).

  Raises:
    ConfigError: the config is invalid.
    CheckpointError: ``workdir`` has no checkpoint (or not ``step``).
  """
  settings = configuration.validate(config)
  tokenizer = transformers.AutoTokenizer.from_pretrained(config.model.path)
  graphdef, params = build.load_model(settings.model, tokenizer, None)
  state = step_lib.init_train_state(params, optim.make_optimizer(settings.optimizer))
  ckpt = checkpoint_lib.Checkpointer(workdir, config.checkpoint.keep)
  try:
    steps = ckpt.manager.all_steps()
    if not steps or (step is not None and step not in steps):
      raise CheckpointError(f"{ckpt.directory} has no checkpoint"
                            + (f" of step {step} (it has {sorted(steps)})" if steps and step
                               is not None else ""))
    step = max(steps) if step is None else step
    try:
      state, _, _ = ckpt.restore(step, state, build.init_replay(settings.replay, config, None))
    except CheckpointError as e:  # one written before the decoder layers were stacked
      raise CheckpointError(f"checkpoint {step} of {workdir} does not fit this config: "
                            f"{e}") from None
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f"checkpoint {step} of {workdir} does not fit this config (is it "
                            f"the run's config, LoRA included?): {type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200]}") from None
  finally:
    ckpt.close()
  return nnx.merge(graphdef, state.params), tokenizer, step


def export(config, workdir: str, out: str, fmt: str = "merged", step: int | None = None) -> int:
  """Writes the policy of ``workdir``'s checkpoint to ``out``; returns the step exported.

  Raises:
    ConfigError: an unknown format, or ``adapter`` for a run without LoRA.
    CheckpointError: no such checkpoint.
  """
  if fmt not in FORMATS:
    raise configuration.ConfigError(f"--format={fmt!r}; known: {', '.join(FORMATS)}")
  if fmt == "adapter" and lora.from_config(config.model) is None:
    raise configuration.ConfigError("--format=adapter needs a LoRA run (model.lora.rank > 0); "
                                    "use --format=merged")
  model, tokenizer, step = restored_policy(config, workdir, step)
  if fmt == "adapter":
    adapter_folder.save_adapter(model, out, base_model=config.model.path)
    tokenizer.save_pretrained(out)
  else:
    save_pretrained(model, out, tokenizer=tokenizer)
  return step


def main(argv):
  del argv
  f = flags.FLAGS
  if f.config is None or not f.workdir or not f.out:
    raise app.UsageError("--config, --workdir and --out are required")
  console.quiet_unless_verbose()
  try:
    step = export(f.config, f.workdir, f.out, f.format, f.step)
  except (configuration.ConfigError, CheckpointError, OSError) as e:
    sys.exit(f"grpo_jax.export: {e}")
  print(f"grpo_jax.export: step {step} of {f.workdir} written to {f.out} ({f.format})")


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "the run's config file, e.g. configs/popo.py:lora")
  flags.DEFINE_string("workdir", None, "the run's folder (its checkpoints are read)")
  flags.DEFINE_string("out", None, "output folder")
  flags.DEFINE_enum("format", "merged", FORMATS, "merged Hugging Face folder, or PEFT adapter")
  flags.DEFINE_integer("step", None, "the checkpoint's step (default: the newest)")
  app.run(main)
