"""Shared defaults of every RL config, and the presets parsed from the config argument.

Every config file is ``get_config(arg) -> ConfigDict`` where ``arg`` is the text after ':' in
``--config=configs/grpo.py:smoke``: comma-separated presets, e.g. ``smoke`` or
``qwen3_1p7b,gsm8k``. Field groups: model, task, rollout, rl, replay, allocation, opt, eval,
checkpoint, mesh. Values are validated by ``grpo_jax.configuration.validate`` before anything
compiles.
"""

import dataclasses
from typing import Any, Callable

import ml_collections

from grpo_jax import allocation, assets, deprecated, registry, tasks
from grpo_jax.models import lora
from grpo_jax.rl import step_config
from grpo_jax.rl.replay import method as replay_method


def base_config() -> ml_collections.ConfigDict:
  """Defaults: GRPO on the embedded Countdown model, sized for a few CPU-minutes."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # init, sampling and shuffling seed; same config + seed = same run
  c.total_steps = 200  # train steps (each consumes one batch of fresh rollouts)
  c.log_every = 1  # steps between metric lines (JSONL, TensorBoard)
  # Stop once this many rollouts have been generated (0 = no limit; total_steps still caps):
  # the budget that compares allocation methods, which spend different rollouts per step.
  c.total_rollouts = 0
  # Stop once this many completion tokens have been generated (0 = no limit): the budget that
  # compares methods whose completions differ in length at equal generation cost.
  c.total_tokens = 0

  c.model = ml_collections.ConfigDict()
  c.model.path = assets.EMBEDDED_MODEL  # Hugging Face folder (config.json, safetensors, tokenizer)
  c.model.param_dtype = "float32"  # storage of parameters and optimiser state (float32 master weights)
  c.model.dtype = "float32"  # matmul dtype; "bfloat16" on accelerators (softmax, log-probs, loss stay float32)
  c.model.remat = "none"  # activation checkpointing of the gradient pass: none | layer (per decoder block)
  c.model.query_block = 0  # xla kernel only: queries per attention block in the train step (0 = all): bounds [rows, heads, block, P+T] scores
  # Attention kernel of every pass (grpo_jax/models/attention.py): auto | xla | blocked | cudnn |
  # splash. auto = cudnn on a GPU, splash on a TPU, else blocked from 1,024 key slots (P + T) on.
  c.model.attention = "auto"
  c.model.attention_block = 256  # queries and keys per block of the blocked kernel
  c.model.arch = ""  # published architecture for abstract benchmarks (bench/memory.py); training reads config.json
  # LoRA adapters (grpo_jax/models/lora.py): rank 0 = full fine-tuning. Under LoRA the base is
  # frozen in model.dtype, only the adapters (float32) are trained and checkpointed, and the
  # KL reference is the base (adapters off). Presets :lora (rank 32) and :lora=R.
  c.model.lora = ml_collections.ConfigDict()
  c.model.lora.rank = 0  # r, the adapters' inner width
  c.model.lora.alpha = 32.0  # the update is scaled by alpha / r
  c.model.lora.dropout = 0.0  # must be 0: a random pi_theta breaks ratio = 1 at the first update
  c.model.lora.targets = lora.DEFAULT_TARGETS  # regex over dense-layer paths: attention and MLP projections

  c.task = ml_collections.ConfigDict()
  c.task.name = "countdown"  # a registered task: countdown | gsm8k (TFDS) | jsonl | file (your rows)
  c.task.train_size = 0  # > 0: train on the first N problems only (epochs); MoPPS/DPS need a pool
  c.task.data_path = ""  # optional local file of training problems (countdown rows / jsonl)
  c.task.chat_template = False  # wrap string prompts in the tokenizer's chat template (message prompts always are)
  # Your own data (task.name=file, inferred from a data_path of non-Countdown rows; docs/usage.md):
  c.task.eval_paths = ""  # held-out files, comma-separated, each a set named by its file stem
  c.task.schema = "auto"  # row schema of the files: auto (detected per file) | verl | trl | qa
  c.task.prompt_field = ""  # the prompt's field ("" = the schema's: prompt, or question)
  c.task.answer_field = ""  # the reference's field ("" = reward_model.ground_truth | answer | solution)
  c.task.system_prompt = ""  # a system message before every prompt ("" = none)
  # Rewards in TRL's form: built-ins (math, gsm8k, countdown, format), "pkg.module:fn" or
  # "path/to/file.py:fn", comma-separated; "" = the task's own verifier (file task: math).
  c.task.rewards = ""
  c.task.reward_weights = ""  # one weight per reward, comma-separated ("" = all 1)
  c.task.success_reward = ""  # the reward that is the accuracy signal ("" = the first)
  c.task.success_threshold = 1.0  # a success-reward value >= this is a success
  c.task.max_reward_failures = 3  # stop after this many batches on which every reward failed; 0 = never
  c.task.math_workers = 0  # math-verify processes (0 = min(8, CPU count))
  c.task.math_timeout_s = 5.0  # wall-clock bound per answer; a timeout scores 0 and is counted
  c.task.math_batch_timeout_s = 60.0  # bound of a whole batch's checks (0 = none)
  # Each registered task's own group (config.task.countdown.max_number, config.task.gsm8k.data_dir):
  # its spec's fields and defaults (grpo_jax/tasks/<name>.py).
  _add_groups(c.task, tasks.TASKS)

  c.rollout = ml_collections.ConfigDict()
  c.rollout.batch_prompts = 32  # B, prompts (groups) per step
  c.rollout.group_size = 8  # G, rollouts per prompt
  c.rollout.prompt_len = 24  # P, tokens; longer prompts are skipped and counted
  c.rollout.completion_len = 16  # T, max generated tokens
  c.rollout.temperature = 1.0  # sampling temperature (log-probs are computed at it too)
  c.rollout.top_k = 0  # must stay 0 for RL: the loss's log-probs are of the full softmax
  c.rollout.top_p = 1.0  # must stay 1.0 for RL (same reason)
  c.rollout.sampler_rows = 0  # rows one sampler pass holds a KV cache for (0 = all B x G); a multiple of G dividing B x G
  # Partial rollouts (grpo_jax/allocation/partial.py): rows in a slot pool outlive their step;
  # a step takes the first B groups to complete, the rest continue under the next parameters.
  c.rollout.partial = False
  c.rollout.slots = 0  # rows in flight (0 = B x G, the static batch's KV cache); a multiple of G
  c.rollout.max_staleness = 4  # most updates between a trained token's version and the trained one
  c.rollout.chunk = 0  # decode steps between two looks at which rows ended (0 = T / 32, at least 1)
  c.rollout.decode_budget = 0  # most decode steps per step (0 = until B groups are complete)
  c.rollout.partial_cache = "keep"  # keep | reprefill: a continued row's KV cache after an update
  # Continued rows in the loss: decoupled (off-policy rows, corrected as replayed rows are: pi_prox
  # from the pass or interpolated per token, replay.prox) | naive (clipped pi_theta / mu)
  c.rollout.correction = "decoupled"
  # Generation on its own devices (grpo_jax/generate/asynchronous.py): the first K devices
  # generate into the pool (partial rollouts, on by it) while the rest train; 0 = colocated.
  c.rollout.devices = 0
  c.rollout.generation_mesh = ml_collections.ConfigDict()  # the K devices' layout, as config.mesh's
  c.rollout.generation_mesh.data = -1
  c.rollout.generation_mesh.fsdp = 1
  c.rollout.generation_mesh.tensor = 1
  c.rollout.schedule = "free"  # free (decode until the update's parameters arrive) | lockstep
  c.rollout.lockstep_chunks = 1  # lockstep: chunks the generator decodes while each update runs
  c.rollout.ahead = 1  # steps beyond the next whose groups the generator may prepare (within the bound)

  # The train step's group: StepConfig's fields (grpo_jax/rl/step_config.py says what each
  # does), with the advantage estimator (rl.estimator: grpo | drgrpo | rloo, each its group
  # rl.<name>) and the loss's group rl.loss (grpo_jax/rl/losses.py: rl.loss.policy ppo | gspo |
  # cispo, each its group rl.loss.<name>; the behaviour weight, aggregation, KL, entropy).
  c.rl = step_config.StepConfig.config_group()
  # What "score" starts from before the overlong penalty: task (the task's graded score) |
  # accuracy (+1 success / -1 otherwise: DAPO's rule-based reward)
  c.rl.score_base = "task"
  c.rl.overlong_buffer = 0  # DAPO soft overlong penalty: buffer length in tokens; 0 disables
  c.rl.overlong_penalty = 1.0  # DAPO soft overlong penalty factor
  c.rl.max_consecutive_skips = 5  # stop after this many non-finite steps in a row; 0 = never

  c.replay = ml_collections.ConfigDict()
  c.replay.method = "none"  # a registered replay method: none | popo | prioritized | headroom
  c.replay.capacity = 0  # entries in the on-device buffer (groups; rollouts for "prioritized")
  c.replay.objective = "decoupled"  # replayed rows in the loss: decoupled | pi_old | align_mu
  # pi_prox of replayed rows, where the objective needs it and the method does not measure it:
  # exact (a no-grad pass at the start-of-step parameters) | interpolate (no pass: AReaL's
  # log mu + alpha (log pi_theta - log mu), alpha from the version stamps; grpo_jax/rl/prox.py).
  c.replay.prox = "exact"
  # The exact pass runs over only the rows the method may replay, in this many chunks; a chunk
  # without a replayed row is skipped. 0 = one pass over the whole batch.
  c.replay.prox_chunks = 4
  # Each method's own group (config.replay.popo.slots, config.replay.headroom.tau, ...): its
  # dataclass's fields and defaults, documented in grpo_jax/rl/replay/<method>.py.
  _add_groups(c.replay, replay_method.METHODS)

  c.allocation = ml_collections.ConfigDict()
  c.allocation.method = "uniform"  # rollouts per prompt: uniform | dynamic_sampling (DAPO) | sara
  c.allocation.selector = "stream"  # which prompts: stream (data order) | mopps | dps
  c.allocation.max_rounds = 10  # dynamic_sampling / sara: generation rounds (B*G slots) per step
  # Each rule's and selector's own group (config.allocation.sara.probes,
  # config.allocation.mopps.decay, ...), documented in grpo_jax/allocation/<module>.py.
  _add_groups(c.allocation, allocation.RULES)
  _add_groups(c.allocation, allocation.SELECTORS)

  c.opt = ml_collections.ConfigDict()
  c.opt.learning_rate = 3e-5  # peak; conservative: GRPO peaks at 1e-4-2e-4 (docs/benchmarks.md)
  c.opt.warmup_steps = 10  # linear warm-up, in train steps (not minibatch updates)
  c.opt.schedule = "constant"  # constant | cosine (after warm-up, reaching 0 at total_steps)
  c.opt.weight_decay = 0.0  # AdamW decoupled weight decay
  c.opt.b1 = 0.9  # Adam beta1
  c.opt.b2 = 0.999  # Adam beta2
  c.opt.grad_clip = 1.0  # global-norm clip; 0 disables

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 25  # steps between held-out evaluations (and at the start and end)
  c.eval.every_rollouts = 0  # > 0: evaluate each time this many more rollouts were generated
  c.eval.every_tokens = 0  # > 0: evaluate each time this many more completion tokens were generated
  c.eval.num_prompts = 256  # held-out prompts (per held-out set)
  c.eval.k = 8  # samples per prompt for mean@k / pass@k
  c.eval.temperature = 1.0  # eval sampling temperature
  c.eval.greedy = True  # also report greedy accuracy

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 25  # steps between orbax checkpoints (and at the end)
  c.checkpoint.keep = 2  # checkpoints kept
  c.checkpoint.allow_config_change = False  # resume a workdir whose run had another config

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # data-parallel devices (batch split, parameters replicated); -1 = the rest
  c.mesh.fsdp = 1  # fully-sharded data-parallel devices (batch and parameters split); -1 = the rest
  c.mesh.tensor = 1  # tensor-parallel devices (heads, MLP width, vocabulary split); -1 = the rest
  c.mesh.distributed = False  # multi-host: call jax.distributed.initialize() first (also when JAX_COORDINATOR_ADDRESS is set)
  c.mesh.coordinator_address = ""  # host:port of process 0; "" = auto-detected (Cloud TPU, SLURM, Open MPI, K8s)
  c.mesh.num_processes = 0  # processes of a multi-host run; 0 = auto-detected
  c.mesh.process_id = -1  # this process's index; -1 = auto-detected
  # Keys that moved into a group (replay.slots, task.max_number, rl.clip_high, ...): unset unless given,
  # then moved to their group by configuration.validate with a one-line notice.
  deprecated.add_fields(c)
  return c


def _add_groups(parent: ml_collections.ConfigDict, table: registry.Registry) -> None:
  """parent.<name> = the registered component's own config group, for each that has fields."""
  for name, component in table.items():
    group = component.config_group()
    if group.keys():
      parent[name] = group


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
    "prox": Preset(lambda c, how: c.replay.update(prox=how), "exact|interpolate",
                   usage="prox=exact|interpolate"),
    "prox_chunks": Preset(lambda c, k: c.replay.update(prox_chunks=k), "int",
                          usage="prox_chunks=K"),
    # Partial rollouts (rows outlive their step) at max_staleness S (bare: the default);
    # their pool's size and per-step decode budget; the decoupled objective over every row.
    "partial": Preset(_partial, "int", bare=4, usage="partial, partial=S"),
    "slots": Preset(lambda c, n: c.rollout.update(slots=n), "int", usage="slots=N"),
    "decode_budget": Preset(lambda c, d: c.rollout.update(decode_budget=d), "int",
                            usage="decode_budget=D"),
    "decoupled_all": Preset(lambda c: c.rl.update(prox_pass="all")),
    # Continued rows trained with the clipped pi_theta / mu (no pi_prox): the naive baseline.
    "naive": Preset(lambda c: c.rollout.update(correction="naive")),
    "async": Preset(lambda c, k: c.rollout.update(partial=True, devices=k), "int", bare=1,
                    usage="async, async=K"),
    "ahead": Preset(lambda c, n: c.rollout.update(ahead=n), "int", usage="ahead=N"),
    "lockstep": Preset(lambda c, n: c.rollout.update(schedule="lockstep", lockstep_chunks=n),
                       "int", bare=1, usage="lockstep, lockstep=CHUNKS"),
    "lora": Preset(_lora, "int", bare=32, usage="lora, lora=R", last=True),
}
