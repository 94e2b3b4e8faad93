"""Presets: named changes to a config, chosen by the text after ':' in the config argument.

``--config=configs/popo.py:kl,smoke`` calls ``configs/popo.py``'s ``get_config("kl,smoke")``,
which ends with ``apply_presets(c, arg, own=PRESETS)``: the file's own presets (``kl``) first,
then the ones every RL config takes (``COMMON``: ``smoke``, ``bf16``, ``qwen3_1p7b``,
``partial=S``, ``lora=R``, ...), each group in the order given, those marked ``last`` at the end.
A new preset is a ``Preset`` in a file's ``PRESETS`` (or, for every file, in ``COMMON``).
"""

import dataclasses
from typing import Any, Callable

import ml_collections

# LoRA's learning rate over full fine-tuning's (LoRA Without Regret, Schulman et al. 2025:
# ~10x across model sizes, for supervised and RL fine-tuning alike).
LORA_LR_SCALE = 10.0


@dataclasses.dataclass(frozen=True)
class Preset:
  """A named change to a config, from the argument after ':' (``configs/popo.py:stale=10``).

  Attributes:
    apply: ``apply(c)``, or ``apply(c, value)`` for a preset that takes a value.
    value: how the text after ``name=`` reads: "" (the preset takes none), "int" (an
      integer >= 0), or the allowed words separated by "|".
    bare: the value when the name comes alone (None: a value is required).
    usage: how the list of known presets shows it (``stale=S``); the name when empty.
    last: applied after every other preset (LoRA scales the learning rate a model preset set).
  """

  apply: Callable[..., None]
  value: str = ""
  bare: Any = None
  usage: str = ""
  last: bool = False

  def parse(self, text: str | None):
    """The value of ``name=text`` (``text`` None: the name alone); None when it does not read."""
    if not self.value:
      return () if text is None else None
    if text is None:
      return None if self.bare is None else (self.bare,)
    if self.value == "int":
      return (int(text),) if text.isdigit() else None
    return (text,) if text in self.value.split("|") else None


def apply_presets(c: ml_collections.ConfigDict, arg: str | None,
                  own: dict[str, Preset] | None = None) -> ml_collections.ConfigDict:
  """Applies the comma-separated presets of ``arg``: the config file's ``own`` first, then the
  common ones (``COMMON``), each group in the order given, and those marked ``last`` at the
  end. An unknown name, or a value that does not read, fails in one line listing every preset
  the file accepts."""
  own = own or {}
  tables = (own, COMMON)
  chosen = [[], [], []]  # own, common, last
  for item in filter(None, (arg or "").split(",")):
    name, eq, text = item.partition("=")
    for phase, table in enumerate(tables):
      preset = table.get(name)
      values = preset.parse(text if eq else None) if preset is not None else None
      if values is not None:
        chosen[2 if preset.last else phase].append((preset, values))
        break
    else:
      raise ValueError(f"unknown config preset {item!r}; known: {', '.join(known(own))}")
  for preset, values in chosen[0] + chosen[1] + chosen[2]:
    preset.apply(c, *values)
  return c


def known(own: dict[str, Preset]) -> list[str]:
  """The presets a config file accepts, as the error lists them: the plain names of both
  tables sorted, its own with values among them, then the common ones that take a value."""
  plain = {p.usage or n for n, p in own.items()} | {n for n, p in COMMON.items() if not p.value}
  return sorted(plain) + [p.usage for p in COMMON.values() if p.value]


def _smoke(c):
  """Seconds-long end-to-end check (tests): tiny batch, two steps, tiny eval."""
  c.total_steps = 2
  c.rollout.update(batch_prompts=2, group_size=2, completion_len=8)
  c.rl.num_minibatches = 2
  c.allocation.sara.probes = min(c.allocation.sara.probes, 2)  # sara: probes fit the group of 2
  c.allocation.dynamic_sampling.oversample = 1  # dapo: one round per generation batch
  c.eval.update(every=2, num_prompts=2, k=2)
  c.checkpoint.every = 1


def _gspo(c):
  """GSPO (arXiv 2507.18071): the sequence-level ratio with its own clip range (3e-4 / 4e-4,
  config.rl.loss.gspo), averaged per sequence as the paper's objective."""
  c.rl.loss.policy = "gspo"
  c.rl.loss.aggregation = "seq-mean-token-mean"


def _cispo(c):
  """CISPO (MiniMax-M1, arXiv 2506.13585): clipped stop-gradient IS weights
  (config.rl.loss.cispo), every token of the batch weighing the same as MiniMax-M1's objective."""
  c.rl.loss.policy = "cispo"
  c.rl.loss.aggregation = "token-mean"


def _bf16(c):
  """bfloat16 matmuls with float32 parameters, Adam moments, softmax and losses."""
  c.model.update(param_dtype="float32", dtype="bfloat16")


def _qwen3(size):
  def apply(c):
    """A real Qwen3 checkpoint: expects --config.model.path=/local/Qwen3-{size}."""
    c.model.path = ""  # must be given: nothing is downloaded
    # float32 master weights and Adam moments (a bf16 weight cannot absorb a 1e-6 update),
    # bf16 matmuls; each decoder block rematerialised in the backward pass.
    c.model.update(param_dtype="float32", dtype="bfloat16", remat="layer", query_block=256,
                   arch=f"qwen3_{size.lower().replace('.', 'p')}")
    c.mesh.update(data=1, fsdp=-1, tensor=1)  # FSDP over every device
    c.task.chat_template = True
    c.rollout.update(batch_prompts=64, group_size=8, prompt_len=256, completion_len=1024)
    c.opt.update(learning_rate=1e-6, warmup_steps=10, weight_decay=0.1)
    c.eval.update(every=20, num_prompts=512, k=8, temperature=0.6)
    c.checkpoint.every = 20
  apply.__doc__ = f"Qwen3-{size} on an accelerator."
  return apply


def _selector(name):
  def apply(c):
    """Prompt selection by {name}; it needs a finite pool, 1,024 problems unless set."""
    c.allocation.selector = name
    if not c.task.train_size and c.task.name == "countdown" and not c.task.data_path:
      c.task.train_size = 1024
  apply.__doc__ = apply.__doc__.format(name=name)
  return apply


def _countdown_hard(c):
  """Countdown with numbers up to 100 (the embedded model was trained on 1-50): ~5% solved and
  ~87% of groups ineffective at the start, the regime replay methods are meant for."""
  c.task.countdown.max_number = 100


def _gsm8k(c):
  """GSM8K through TFDS (math word problems, numeric final answer)."""
  c.task.name = "gsm8k"
  c.rollout.prompt_len = max(c.rollout.prompt_len, 256)


def _partial(c, staleness):
  """Partial rollouts (``rollout.partial``, grpo_jax/allocation/partial.py) at
  ``rollout.max_staleness`` = ``staleness``."""
  c.rollout.update(partial=True, max_staleness=staleness)


def _lora(c, rank):
  """LoRA adapters of rank ``rank`` (alpha 32), the learning rate x LORA_LR_SCALE; after every
  other preset, so that a model preset's learning rate is the one scaled."""
  c.model.lora.update(rank=rank, alpha=32.0)
  c.opt.learning_rate *= LORA_LR_SCALE


# The presets every RL config takes (a config file adds its own, applied before these).
COMMON = {
    "smoke": Preset(_smoke), "countdown_hard": Preset(_countdown_hard),
    "mopps": Preset(_selector("mopps")), "dps": Preset(_selector("dps")),
    "qwen3_0p6b": Preset(_qwen3("0.6B")), "qwen3_1p7b": Preset(_qwen3("1.7B")),
    "qwen3_4b": Preset(_qwen3("4B")), "qwen3_8b": Preset(_qwen3("8B")),
    "gsm8k": Preset(_gsm8k), "bf16": Preset(_bf16), "gspo": Preset(_gspo),
    "cispo": Preset(_cispo),
    # A finite training set of N problems.
    "pool": Preset(lambda c, n: c.task.update(train_size=n), "int", usage="pool=N"),
    # Optimiser updates per train step (per epoch).
    "minibatches": Preset(lambda c, m: c.rl.update(num_minibatches=m), "int",
                          usage="minibatches=M"),
    # pi_prox of replayed rows: the exact pass or interpolated; the pass in K chunks.
    "prox": Preset(lambda c, how: c.prox.update(estimate=how), "exact|interpolate",
                   usage="prox=exact|interpolate"),
    "prox_chunks": Preset(lambda c, k: c.prox.update(chunks=k), "int", usage="prox_chunks=K"),
    # Partial rollouts (rows outlive their step) at max_staleness S (bare: the default);
    # their pool's size and per-step decode budget; the decoupled objective over every row.
    "partial": Preset(_partial, "int", bare=4, usage="partial, partial=S"),
    "slots": Preset(lambda c, n: c.rollout.update(slots=n), "int", usage="slots=N"),
    "decode_budget": Preset(lambda c, d: c.rollout.update(decode_budget=d), "int",
                            usage="decode_budget=D"),
    "decoupled_all": Preset(lambda c: c.prox.update(rows="all")),
    # Continued rows trained with the clipped pi_theta / mu (no pi_prox): the naive baseline.
    "naive": Preset(lambda c: c.prox.update(continued="naive")),
    "async": Preset(lambda c, k: c.rollout.update(partial=True, devices=k), "int", bare=1,
                    usage="async, async=K"),
    "ahead": Preset(lambda c, n: c.rollout.update(ahead=n), "int", usage="ahead=N"),
    "lockstep": Preset(lambda c, n: c.rollout.update(schedule="lockstep", lockstep_chunks=n),
                       "int", bare=1, usage="lockstep, lockstep=CHUNKS"),
    "lora": Preset(_lora, "int", bare=32, usage="lora, lora=R", last=True),
}
