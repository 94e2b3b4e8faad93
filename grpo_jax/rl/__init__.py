"""The RL update: the pure, jitted train step and everything inside it.

Owns group-relative advantages (``advantages``), the policy loss (``losses``), how off-policy
rows enter it (``replay_objectives``, ``off_policy_prox``, ``prox_plan``), the replay methods and
their on-device ring buffer (``replay``), the minibatch update scan (``update``, ``policy``,
``batch``), the step itself and its static settings (``step``, ``step_config``), its device-side
metrics (``step_metrics``) and the optimiser (``optim``). May import ``grpo_jax.models``,
``grpo_jax.generate`` (the teacher-forced log-prob passes) and the shared top-level modules;
never ``rewards``, ``allocation`` or ``run``.
"""
