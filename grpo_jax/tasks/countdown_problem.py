"""The Countdown problem record, shared by the task and generator (``countdown.py``) and the
file loader (``countdown_files.py``): the loader needs it without importing the task, which
imports the loader (before, the two imported each other)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Problem:
  """One Countdown instance.

  Attributes:
      nums: The numbers to use, each exactly once.
      target: The value the expression must reach.
      solution: One expression reaching the target, when known (always set
          for generated problems; None for loaded ones).
  """

  nums: tuple[int, ...]
  target: int
  solution: str | None = None


def is_plain_int(value: Any) -> bool:
  """An int or a numpy integer, not a bool (``True`` is an int in Python)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
