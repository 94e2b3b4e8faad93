"""Partial rollouts' learning: rows that span versions, corrected or not, against synchronous
GRPO and POPO at equal generated rollouts.

    python -m grpo_jax.bench.sweep --grid=configs/sweeps/partial.py \
        --out=docs/results/partial --workdirs=runs/partial --detach

Partial rollouts (``rollout.partial``) with a pool of 2 x B x G = 512 rows and at most 8
decode steps a step, at ``max_staleness`` 1, 2 and 4: a step ends when B = 32 groups are
complete, so rows admitted into slots freed during a step finish under the next parameters.
Each with the naive correction (the clipped ratio pi_theta / mu, as a synchronous trainer
treats stale tokens: the ``naive`` preset, ``prox.continued=naive``) and the decoupled one
(``decoupled_all``: pi_prox from a pass at the step's start over every row, ratio to it,
behaviour weight pi_prox / mu; ``prox.continued=decoupled``, the default, gives the
continued rows the same values from a pass over them only). 25,600 generated rollouts (a discarded rollout counts), 4 evaluations on the
same 1,024 held-out prompts, 3 seeds: 24 cells. On the embedded model (completions of about 8
tokens, T = 16) this measures the correction of stale tokens, not the length distribution of
reasoning RL (``bench.rollouts`` measures that).
"""


def get_grid(arg=None):
  del arg
  methods = {"grpo": "grpo", "popo": "popo"}
  for s in (1, 2, 4):
    pool = f"partial={s},slots=512,decode_budget=8"
    methods[f"partial{s}-naive"] = f"grpo:{pool},naive"
    methods[f"partial{s}-decoupled"] = f"grpo:{pool},decoupled_all"
  return dict(methods=methods, seeds=[0, 1, 2], budget={"rollouts": 25600}, evaluations=4,
              overrides={"eval.num_prompts": 1024})
