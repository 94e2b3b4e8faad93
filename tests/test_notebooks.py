"""Notebooks stay runnable: their code cells run in order in a fresh process."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_notebook_runs(tmp_path):
  nb = json.load(open(os.path.join(ROOT, "notebooks", "quickstart.ipynb")))
  code = "\n\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  code = code.replace("/tmp/grpo_jax_notebook", str(tmp_path / "run"))
  script = tmp_path / "quickstart.py"
  script.write_text(code)
  # As after `pip install -e .`, whether or not this environment installed the package.
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  proc = subprocess.run([sys.executable, str(script)], cwd=os.path.join(ROOT, "notebooks"),
                        capture_output=True, text=True, timeout=600, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "->" in proc.stdout  # sampled completions were printed with their scores
  assert (tmp_path / "run" / "metrics.jsonl").exists()
