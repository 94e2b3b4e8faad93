"""Imports modules as on a machine without PyTorch (the package never needs it):
``python tests/without_torch.py MODULE [MODULE ...]`` imports each in order, with ``torch``
unimportable and unknown to ``importlib.util.find_spec`` and ``importlib.metadata``, which is
how transformers decides that it is missing."""

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import sys


def _is_torch(name: str) -> bool:
  return name == "torch" or name.startswith("torch.")


class _NoTorch(importlib.abc.MetaPathFinder):

  def find_spec(self, name, path, target=None):
    del path, target
    if _is_torch(name):
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    return None


_find_spec, _version = importlib.util.find_spec, importlib.metadata.version


def _find_spec_without_torch(name, *args, **kwargs):
  return None if _is_torch(name) else _find_spec(name, *args, **kwargs)


def _version_without_torch(name):
  if _is_torch(name):
    raise importlib.metadata.PackageNotFoundError(name)
  return _version(name)


if __name__ == "__main__":
  sys.meta_path.insert(0, _NoTorch())
  importlib.util.find_spec = _find_spec_without_torch
  importlib.metadata.version = _version_without_torch
  for module in sys.argv[1:]:
    importlib.import_module(module)
  import transformers  # pylint: disable=g-import-not-at-top
  transformers.AutoTokenizer  # pylint: disable=pointless-statement  (its lazy import runs)
