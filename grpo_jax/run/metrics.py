"""Metric writers: JSONL always, TensorBoard event files without TensorFlow.

TensorBoard events are written with ``tensorboardX``: a maintained, pure-Python writer of the
same event-file format (protobuf + numpy only), so ``tensorboard --logdir runs/`` works after
the default install plus the ``tensorboard`` viewer, with no TensorFlow in the training
process. The JSONL file is the record every tool here reads (``read_metrics``, ``report``).
"""

from __future__ import annotations

import json
import logging
import os

_LOG = logging.getLogger(__name__)


class MetricWriter:
  """Appends one JSON object per record to ``workdir/metrics.jsonl`` and to TensorBoard.

  Attributes:
    path: the JSONL file.
    tensorboard_dir: the event-file folder, or None when tensorboardX is not importable.
  """

  def __init__(self, workdir: str, tensorboard: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file = open(self.path, "a", encoding="utf-8")
    self._tb = None
    self.tensorboard_dir = None
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
        self.tensorboard_dir = os.path.join(workdir, "tensorboard")
        self._tb = SummaryWriter(self.tensorboard_dir, flush_secs=30)
      except ImportError:
        _LOG.warning("tensorboardX not installed: TensorBoard events off (JSONL only)")

  def write(self, step: int, record: dict) -> None:
    clean = {k: (float(v) if hasattr(v, "__float__") and not isinstance(v, (int, str)) else v)
             for k, v in record.items()}
    self._file.write(json.dumps({"step": int(step), **clean}) + "\n")
    self._file.flush()
    if self._tb is not None:
      scalars = [(k, v) for k, v in clean.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
      try:  # one event holding every scalar: one queue put, not one per scalar (~50 a step)
        from tensorboardX import summary as tb_summary  # pylint: disable=g-import-not-at-top
        from tensorboardX.proto.summary_pb2 import Summary  # pylint: disable=g-import-not-at-top
        values = [value for k, v in scalars for value in tb_summary.scalar(k, v).value]
        file_writer = self._tb._get_file_writer()  # pylint: disable=protected-access
        file_writer.add_summary(Summary(value=values), int(step))
      except (ImportError, AttributeError):  # another tensorboardX: one event per scalar
        for k, v in scalars:
          self._tb.add_scalar(k, v, int(step))

  def write_completions(self, name: str, rows: list[dict]) -> str:
    """Writes ``rows`` (one JSON object each) to ``workdir/completions/<name>.jsonl``,
    replacing a file of that name (a resumed run writes its steps again); returns its path.
    Values JSON cannot hold are written as their ``str``."""
    folder = os.path.join(os.path.dirname(self.path), "completions")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
      for row in rows:
        f.write(json.dumps(row, default=str) + "\n")
    return path

  def close(self):
    self._file.close()
    if self._tb is not None:
      self._tb.close()


class NullWriter:
  """A MetricWriter that writes nothing: the metric writer of processes other than 0 in a
  multi-host run (same attributes, so the loop does not branch)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.tensorboard_dir = None

  def write(self, step: int, record: dict) -> None:
    del step, record

  def write_completions(self, name: str, rows: list[dict]) -> str:
    del name, rows
    return ""

  def close(self):
    pass


def read_metrics(workdir: str) -> list[dict]:
  """All records of a run's metrics.jsonl."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
