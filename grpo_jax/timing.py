"""Host wall-clock time per phase of a training step: the phases' names and their timer.

Shared by the loop (``grpo_jax.run``) and the allocators (``grpo_jax.allocation``), which time
their own phases on the loop's timer.
"""

from __future__ import annotations

import contextlib
import time

# Phases of one training step, timed on the host (``PhaseTimer``) and recorded per step
# as ``time/<phase>_s`` (plus ``time/step_s``, the step's wall time) and cumulatively as
# ``time_<phase>_s``. A step's window runs from the end of the previous step's to the end of its
# own evaluation and checkpoint, so the windows tile the loop and the phases add up to
# ``time/step_s``. Device work is counted where the host waits for it, which is right after it
# is dispatched in each phase: "generation" is the sampler call and the fetch of its output,
# "update" the train step's dispatch and ``block_until_ready``.
PHASES = (
    "prompts",     # prompt selection, rendering and tokenisation
    "generation",  # the jitted sampler, and the wait for its tokens on the host
    "scoring",     # detokenising, the verifier, the overlong penalty, host rows
    "assembly",    # the selector's update, the [B * G] batch put on the device, row stats
    "update",      # the jitted train step, up to its new state being ready
    "metrics",     # the previous step's device metrics fetched and written (JSONL, TB, bar)
    "evaluation",  # held-out evaluation after the step, when due
    "checkpoint",  # the orbax save after the step, when due
    "other",       # whatever no phase timed (keys, counters, loop control)
)


class PhaseTimer:
  """Host wall-clock seconds per named phase of the training loop, accumulated until ``take``.

  Phases are timed where they happen (``with timer.phase("scoring"): ...``) and must not nest:
  each second belongs to one phase, so a step's phases add up to at most its wall time. The
  clock is the host's: device work counts where the host waits for it (a ``device_get`` or
  ``block_until_ready`` inside the phase), not where it is dispatched.
  """

  def __init__(self):
    self.seconds: dict[str, float] = {}

  @contextlib.contextmanager
  def phase(self, name: str):
    t0 = time.perf_counter()
    try:
      yield
    finally:
      self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

  def take(self) -> dict[str, float]:
    """The seconds accumulated since the last ``take`` (and starts again from zero)."""
    out, self.seconds = self.seconds, {}
    return out
