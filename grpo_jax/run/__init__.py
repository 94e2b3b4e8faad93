"""A training run: the host loop around the train step, and what it leaves on disk.

Owns what a run builds once (``build``: the model, reference, sampler, allocator, restored
state), the loop (``loop``: generate, score, step, evaluate, checkpoint), held-out
evaluation (``evaluate``), the workdir and its resume checks (``workdir``), orbax checkpoints
(``checkpoint``), preemption (``preemption``), per-step records and metrics files (``records``,
``metrics``), the report of a finished run (``report``) and JAX's compilation cache
(``compilation_cache``). The top of the stages: may import every other package; only the
command-line modules (``grpo_jax.train``, ``export``, ``sft``, ``report``) import it.
"""
