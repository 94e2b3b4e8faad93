"""Generation on its own devices: what does the staleness of an asynchronous run cost in
accuracy, and does the decoupled correction recover it?

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m grpo_jax.bench.sweep \
        --grid=configs/sweeps/asynchronous.py --out=docs/results/asynchronous \
        --workdirs=runs/asynchronous --detach

Two fake CPU devices (the flag is inherited by every cell): GRPO colocated on both (mesh data
= 2), and the asynchronous mode (``async=1``: one device generates, one trains, the free
schedule) at ``rollout.max_staleness`` 1, 2 and 4 with the naive correction (``naive``) and the
decoupled one (the default), on the pool of ``configs/sweeps/partial_fast.py`` (512 rows, at
most 8 decode steps a step) where the policy moves (lr 2e-4, 8 updates a batch). 25,600
generated rollouts, 4 evaluations on the same 1,024 held-out prompts, 3 seeds: 21 cells.
"""


def get_grid(arg=None):
  del arg
  methods = {"grpo": "grpo"}
  for s in (1, 2, 4):
    pool = f"async=1,partial={s},slots=512,decode_budget=8"
    methods[f"async{s}-naive"] = f"grpo:{pool},naive"
    methods[f"async{s}-decoupled"] = f"grpo:{pool}"
  return dict(methods=methods, seeds=[0, 1, 2], budget={"rollouts": 25600}, evaluations=4,
              overrides={"eval.num_prompts": 1024, "opt.learning_rate": 2e-4,
                         "rl.num_minibatches": 8})
