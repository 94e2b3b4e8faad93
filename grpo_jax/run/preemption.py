"""Preemption: SIGTERM / SIGINT end a run cleanly at the end of the step under way."""

from __future__ import annotations

import signal

from grpo_jax import console


class StopSignals:
  """SIGTERM / SIGINT set a flag: the current step finishes, a checkpoint is written, the run
  exits 0. Later signals (e.g. a second Ctrl-C during the save) change nothing, so the save
  completes and the last good checkpoint is never torn by us.

  Attributes:
    signal: the first signal received (None until one is).
  """

  def __init__(self):
    self.signal = None
    self._previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread (e.g. a notebook worker): no handler
        pass

  def _handle(self, signum, frame):
    del frame
    if self.signal is None:
      self.signal = signum
      console.say(f"grpo_jax: {signal.Signals(signum).name} received; finishing this step, "
                  "then saving a checkpoint")

  @property
  def name(self) -> str:
    return signal.Signals(self.signal).name if self.signal is not None else ""

  def restore(self):
    """The handlers from before come back."""
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}
