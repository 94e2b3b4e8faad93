"""Rewards: from a completion's text to a score and an accuracy signal.

Owns the reward functions in TRL's form, built in or the user's own (``functions``), how they
are called with TRL's keywords (``calls``), how several rewards combine into a score and a
success bit per rollout (``scoring``: the ``Scorer``), and math-verify in bounded worker
processes (``math_answers``). Runs on the host only. May import ``grpo_jax.tasks`` (the
verifiers of the built-in tasks) and the shared top-level modules; never ``rl``,
``allocation`` or ``run``.
"""
