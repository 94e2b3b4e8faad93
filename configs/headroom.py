"""Headroom-Drift replay (Park & Chang, arXiv 2609.03941).

A FIFO buffer of mixed-outcome groups; each step the 16 stored groups of highest cached
headroom are teacher-forced once, and admitted in that order while their drift
D = mean (log pi_theta - log pi_gen)^2 <= 1e-3, up to 8 groups next to the 32 fresh ones;
replayed groups use pi_gen as the ratio denominator (objective "align_mu").

    python -m grpo_jax.train --config=configs/headroom.py --workdir=runs/headroom

Presets (combine with the common ones):
  headroom_only   no drift gate: the 8 highest-headroom groups
  drift_only      the gate, walking the buffer oldest first instead of by headroom
  decoupled       pi_prox from the candidate pass as the ratio denominator (no extra pass)
  walk=N          teacher-force the candidates in N chunks in walk order, stopping once 8 are
                  admitted (the same groups; unread candidates keep their cached H and D)
"""

from grpo_jax import schema



def get_config(arg: str | None = None):
  c = schema.base_config()
  c.replay.method = "headroom"
  c.replay.capacity = 128  # groups: four batches' worth of mixed-outcome groups
  c.replay.headroom.slots = 8  # K_rep: up to 8 replayed groups (64 rows) next to 32 fresh groups
  c.replay.headroom.candidates = 16  # M: one teacher-forced pass over 16 groups (half a batch)
  c.replay.headroom.tau = 1e-3  # the paper's tau for single-turn math
  c.replay.headroom.gate = True
  c.replay.headroom.order = "headroom"
  c.replay.objective = "align_mu"  # the paper's L_mix: ratio denominator pi_gen
  # 256 fresh + 64 replay rows = 320: 4 minibatches of 80.
  return schema.apply_presets(c, arg, own=PRESETS)


PRESETS = {
    "headroom_only": schema.Preset(lambda c: c.replay.headroom.update(gate=False)),
    "drift_only": schema.Preset(lambda c: c.replay.headroom.update(order="fifo")),
    "decoupled": schema.Preset(lambda c: c.replay.update(objective="decoupled")),
    "walk": schema.Preset(lambda c, n: c.replay.headroom.update(candidate_chunks=n), "int",
                          usage="walk=N"),
}
