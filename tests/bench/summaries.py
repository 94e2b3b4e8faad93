"""Made-up sweep folders for the tests of readers of ``summary.json`` (the regime map, the size
axis)."""

import json
import os


def write_sweep(tmp_path, name: str, rows: list[dict]) -> str:
  """A folder ``tmp_path/name`` holding ``rows`` as its ``summary.json``; its path."""
  folder = tmp_path / name
  folder.mkdir()
  (folder / "summary.json").write_text(json.dumps(rows))
  return os.fspath(folder)
