"""grpo_jax: GRPO and rollout-efficient replay and allocation methods for RLVR in JAX.

Importing the package installs one logging filter before anything imports transformers:
transformers says "PyTorch was not found. Models won't be available ..." on import when torch
is missing, and this package never needs torch (its models are JAX; transformers is used for
tokenizers and configs), so that one line would only mislead. Every other transformers message
is left as it is.
"""

import logging as _logging


class _NoTorchAdvice(_logging.Filter):
  """Drops transformers' import-time advice that PyTorch is missing."""

  def filter(self, record: _logging.LogRecord) -> bool:
    return not str(record.msg).startswith("PyTorch was not found.")


_logging.getLogger("transformers").addFilter(_NoTorchAdvice())
