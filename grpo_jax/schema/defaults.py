"""The config's schema: every key of an RL run with its default and what it means.

``base_config()`` is the ConfigDict every method's file (``configs/<method>.py``) starts from
and changes; ``grpo_jax.configuration.validate`` checks it before anything loads or compiles.
Field groups: model, task, rollout, rl, replay, prox, allocation, opt, eval, checkpoint, mesh; a
registered component's own group (``task.countdown``, ``replay.popo``, ``allocation.sara``,
``rl.loss.gspo``, ...) comes from its spec's fields (``registry.Configurable``).
"""

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
  # Each method's own group (config.replay.popo.slots, config.replay.headroom.tau, ...): its
  # dataclass's fields and defaults, documented in grpo_jax/rl/replay/<method>.py.
  _add_groups(c.replay, replay_method.METHODS)

  # pi_prox, the proximal policy of the decoupled objective (Hilton et al., arXiv 2110.00641),
  # decided once when the step is built (grpo_jax/rl/prox_plan.py): which rows get it from a
  # no-grad pass, how rows that need it get it, in how many chunks, and whether the continued
  # rows of partial rollouts are corrected as replayed rows are.
  c.prox = ml_collections.ConfigDict()
  # Rows whose pi_prox comes from a pass at the start-of-step parameters: replayed (replayed and
  # continued rows; a fresh row's pi_prox is mu) | all (every row: bfloat16's cached decoding
  # and the full forward differ) | auto (all when model.dtype is not float32, else replayed).
  c.prox.rows = "auto"
  # Replayed and continued rows, where the objective needs pi_prox and the method does not
  # measure it: exact (the pass) | interpolate (no pass: AReaL's log mu + alpha (log pi_theta -
  # log mu), alpha from the version stamps; grpo_jax/rl/off_policy_prox.py).
  c.prox.estimate = "exact"
  # The exact pass runs over only the rows that may need it, in this many chunks; a chunk
  # without such a row is skipped. 0 = one pass over the whole batch.
  c.prox.chunks = 4
  # Continued rows (partial rollouts) in the loss: decoupled (off-policy rows, corrected as
  # replayed rows are) | naive (the clipped pi_theta / mu of a fresh row).
  c.prox.continued = "decoupled"

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
