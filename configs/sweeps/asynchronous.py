"""Generation on its own devices: what does the staleness of an asynchronous run cost in
accuracy, does the decoupled correction recover it, and how much does ``rollout.ahead`` (how
far the generator prepares groups beyond the next step) decide?

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m grpo_jax.bench.sweep \
        --grid=configs/sweeps/asynchronous.py --out=docs/results/asynchronous \
        --workdirs=runs/asynchronous --detach

Two fake CPU devices (the flag is inherited by every cell): GRPO colocated on both (mesh data
= 2), and the asynchronous mode (``async=1``: one device generates, one trains, the free
schedule) on the pool of ``configs/sweeps/partial_fast.py`` (512 rows, at most 8 decode steps
a step) where the policy moves (lr 2e-4, 8 updates a batch):

* ``asyncS-<correction>``: ``rollout.max_staleness`` S = 1, 2, 4 with the generator allowed to
  run as far ahead as the bound (``ahead=S``), the naive correction (``naive``) and the
  decoupled one (the default): the cost of staleness S itself;
* ``async4-ahead1-<correction>``: S = 4 with the default ``ahead=1``.

25,600 generated rollouts, 4 evaluations on the same 1,024 held-out prompts, 3 seeds: 27
cells.
"""


def get_grid(arg=None):
  del arg
  methods = {"grpo": "grpo"}
  for s in (1, 2, 4):
    pool = f"async=1,partial={s},ahead={s},slots=512,decode_budget=8"
    methods[f"async{s}-naive"] = f"grpo:{pool},naive"
    methods[f"async{s}-decoupled"] = f"grpo:{pool}"
  pool = "async=1,partial=4,slots=512,decode_budget=8"
  methods["async4-ahead1-naive"] = f"grpo:{pool},naive"
  methods["async4-ahead1-decoupled"] = f"grpo:{pool}"
  return dict(methods=methods, seeds=[0, 1, 2], budget={"rollouts": 25600}, evaluations=4,
              overrides={"eval.num_prompts": 1024, "opt.learning_rate": 2e-4,
                         "rl.num_minibatches": 8})
