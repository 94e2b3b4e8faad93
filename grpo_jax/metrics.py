"""Metric writers: JSONL always, TensorBoard when tensorflow is installed."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os

_LOG = logging.getLogger(__name__)


class MetricWriter:
  """Appends one JSON object per record to ``workdir/metrics.jsonl`` (and TensorBoard)."""

  def __init__(self, workdir: str):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file = open(self.path, "a", encoding="utf-8")
    self._tb = None
    try:
      # tf.summary needs both tensorflow and the tensorboard distribution (tensorflow-cpu
      # alone lacks the latter); a failing first write also turns summaries off (write()).
      importlib.metadata.version("tensorboard")
      import tensorflow as tf  # pylint: disable=g-import-not-at-top
      self._tb = tf.summary.create_file_writer(os.path.join(workdir, "tensorboard"))
      self._tf = tf
    except Exception:  # pylint: disable=broad-except
      _LOG.info("tensorflow/tensorboard not importable: TensorBoard summaries off (JSONL only)")

  def write(self, step: int, record: dict) -> None:
    clean = {k: (float(v) if hasattr(v, "__float__") and not isinstance(v, (int, str)) else v)
             for k, v in record.items()}
    self._file.write(json.dumps({"step": int(step), **clean}) + "\n")
    self._file.flush()
    if self._tb is not None:
      try:
        with self._tb.as_default(step=int(step)):
          for k, v in clean.items():
            if isinstance(v, (int, float)):
              self._tf.summary.scalar(k, v)
      except Exception as e:  # pylint: disable=broad-except
        _LOG.warning("TensorBoard summaries disabled: %s", e)
        self._tb = None

  def close(self):
    self._file.close()
    if self._tb is not None:
      self._tb.flush()


def read_metrics(workdir: str) -> list[dict]:
  """All records of a run's metrics.jsonl."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
