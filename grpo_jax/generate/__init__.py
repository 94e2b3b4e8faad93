"""Generation: turning prompts into completions, and scoring tokens under a policy.

Owns the sampler (``sampler``: prefill and the jitted decode loop over a KV cache, recording the
behaviour log-probs of every sampled token), the teacher-forced log-prob passes the train step
and the sampler share (``logprobs``), tokenization (``tokenization``), the building of prompt
batches (``prompts``), the slot pool and its rollout producer (``pool``, ``producer``), packed
log-prob passes (``packing``, ``packed_logprobs``), and generation on its own devices
(``asynchronous``, with ``transfer`` moving parameters between the meshes). May import
``grpo_jax.models`` and the shared top-level modules (types, random_keys, sharding, errors,
console); never ``rl``, ``rewards``, ``allocation`` or ``run``.
"""
