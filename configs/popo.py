"""POPO (arXiv 2606.01281): ineffective fresh groups are refilled from a buffer of recent
effective groups; decoupled off-policy objective (behaviour weight pi_prox / mu, trust region
on pi_theta / pi_prox).

    python -m grpo_jax.train --config=configs/popo.py --workdir=runs/popo

Presets of the paper's comparison (combine with the common ones, e.g. ``:kl,smoke``):
  kl        POPO-KL: replay the stored groups with the lowest KL(mu || pi_theta) to the current
            policy (estimated each step by one teacher-forced pass over the buffer)
  filter    GRPO-filter: drop ineffective groups, no refill, loss over the remaining ones
  ineff     POPO-ineff: buffer and replay without the effective / ineffective distinction
  stale=S   POPO-stale(S): replay groups about S steps old (default 10)
  pi_old    POPO-pi_old: replayed groups treated as on-policy (no behaviour weight; trust
            region around pi_prox recomputed at the start of the step)
  align_mu  the coupled objective: replayed groups clipped around their behaviour policy
            (pi_prox := mu), "fully aligning to the behaviour policy"
  reuse=K   a stored group may be replayed K times (default 1: one-shot; 0 = while young
            enough), the setting that limits refills when few groups are effective
  age=A     replay groups at most A policy steps old (default 4). A group fills at most one
            slot a step, so reuse=K binds only when K < A: reuse above 4 needs age above 4
  keep_unfilled  ineffective slots the buffer cannot fill stay in the loss with advantage 0
            (and in its denominators); by default they leave it,
            so that POPO with an empty buffer is exactly GRPO-filter
"""

from grpo_jax import schema



def get_config(arg: str | None = None):
  c = schema.base_config()
  # "Effective" and the advantages both on the 0/1 accuracy signal: the paper's "reward
  # variance > 0" on the accuracy reward (a group of 0 and 0.1 format scores is ineffective).
  c.rl.reward_signal = "success"
  c.rl.effective_signal = "success"
  c.replay.method = "popo"
  c.replay.popo.fill = "replay"  # refill ineffective slots from the buffer
  # 32 groups = one batch: POPO keeps a *small* buffer of recent groups; with ~1/3 of the
  # slots ineffective and ~2/3 of the groups stored each step it turns over in ~1.5 steps.
  c.replay.capacity = 32
  c.replay.popo.insert = "effective"  # only groups whose success varies are stored
  c.replay.popo.priority = "recency"  # most recently stored first
  # One-shot reuse: a stored group is replayed once, so the buffer never feeds the same
  # off-policy group twice (the paper leaves this open).
  c.replay.popo.max_uses = 1
  # A short-term FIFO: never replay a group more than 4 policy steps old. Recency keeps replay
  # ~1 step old while the buffer turns over fast; the age limit bounds it when it does not
  # (few effective groups, larger buffers), well short of the 10 steps at which the paper's
  # POPO-stale(10) collapses.
  c.replay.popo.max_age = 4
  c.replay.objective = "decoupled"
  c.rl.loss.is_mode = "truncate"  # behaviour weight min(pi_prox / mu, cap), as TIS / verl
  c.rl.loss.is_cap = 2.0  # weights of replayed tokens rarely exceed ~1.1 at this staleness
  return schema.apply_presets(c, arg, own=PRESETS)


def _filter(c):
  """GRPO-filter: ineffective groups leave the loss, nothing is stored or replayed."""
  c.replay.popo.fill, c.replay.capacity = "drop", 0


def _stale(c, staleness):
  """POPO-stale(S): replay groups exactly S policy steps old."""
  c.replay.popo.priority = "staleness"
  c.replay.popo.staleness = staleness
  c.replay.popo.max_uses = 0  # old groups must stay in the buffer to be replayed
  c.replay.popo.max_age = staleness + 1  # the target age itself must stay eligible
  # Every group of the last S + 2 steps must fit, whatever the final batch size: a
  # reference to rollout.batch_prompts follows presets and --config overrides.
  c.replay.capacity = c.rollout.get_ref("batch_prompts") * (staleness + 2)


PRESETS = {
    "kl": schema.Preset(lambda c: c.replay.popo.update(priority="lowest_kl")),
    "filter": schema.Preset(_filter),
    "ineff": schema.Preset(lambda c: c.replay.popo.update(insert="all")),
    "stale": schema.Preset(_stale, "int", bare=10, usage="stale=S"),
    "pi_old": schema.Preset(lambda c: c.replay.update(objective="pi_old")),
    "align_mu": schema.Preset(lambda c: c.replay.update(objective="align_mu")),
    "reuse": schema.Preset(lambda c, k: c.replay.popo.update(max_uses=k), "int", usage="reuse=K"),
    "age": schema.Preset(lambda c, a: c.replay.popo.update(max_age=a), "int", usage="age=A"),
    "keep_unfilled": schema.Preset(lambda c: c.replay.popo.update(unfilled="keep")),
}
