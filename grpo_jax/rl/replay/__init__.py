"""Every replay method on one on-device buffer.

``buffer``: the fixed-shape ring (``ReplayState``) and its pure operations, exported here so
callers write ``replay.insert(...)``. ``method``: the small interface through which the train step
talks to a replay method (``NoReplay`` is its simplest implementation). The methods: ``popo``
(group replay into ineffective slots, arXiv 2606.01281), ``prioritized`` (rollout-level
advantage-prioritised replay, arXiv 2606.04560) and ``headroom`` (Headroom-Drift replay, arXiv
2609.03941).
"""

from grpo_jax.rl.replay.buffer import (PRIORITIES, ReplayState, evict, gather, init_replay,
                                       insert, mark_used, select)

__all__ = ["PRIORITIES", "ReplayState", "evict", "gather", "init_replay", "insert", "mark_used",
           "select"]
