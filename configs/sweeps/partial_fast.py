"""Partial rollouts where the policy moves: does the decoupled correction of continued rows
beat the naive clipped ratio when stale tokens are far from the current policy?

    python -m grpo_jax.bench.sweep --grid=configs/sweeps/partial_fast.py \
        --out=docs/results/partial_fast --workdirs=runs/partial_fast --detach

``configs/sweeps/partial.py`` found naive and decoupled within 0.1 points at the default
learning rate (3e-5), where a stale token's pi_prox differs from mu by 0.004-0.010 nats. Here
the movement grid's fast corner (lr 2e-4, 8 updates per batch: where GRPO itself degrades and
POPO's pi_old ablation collapsed): GRPO, and partial rollouts at ``max_staleness`` 2 and 4
(a pool of 512 rows, at most 8 decode steps a step, as in ``partial.py``) with the naive
correction (``naive``) and the decoupled one (``prox.continued=decoupled``, the default:
pi_prox from a pass over the continued rows only). 25,600 generated rollouts, 4 evaluations
on the same 1,024 held-out prompts, 3 seeds: 15 cells.
"""


def get_grid(arg=None):
  del arg
  methods = {"grpo": "grpo"}
  for s in (2, 4):
    pool = f"partial={s},slots=512,decode_budget=8"
    methods[f"partial{s}-naive"] = f"grpo:{pool},naive"
    methods[f"partial{s}-decoupled"] = f"grpo:{pool}"
  return dict(methods=methods, seeds=[0, 1, 2], budget={"rollouts": 25600}, evaluations=4,
              overrides={"eval.num_prompts": 1024, "opt.learning_rate": 2e-4,
                         "rl.num_minibatches": 8})
